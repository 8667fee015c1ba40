"""The Mosaic GPU GQA kernel's experimental variants (`pallas_kv.experimental.MosaicGPUVariantConfig`):
the converter warpgroup, which widens one-byte K / V tiles for the consumers (FA3's fp8 path), explicit
barriers (no automatic warpgroup barrier around each SMEM store), per-token scales laid out by head, one tile loop
and the stream-K walk as a loop. Numerics in GPU interpret mode, race detection, their checks, CUDA lowering and the
GPU run."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
from harness import assert_matches_reference, lower_for_cuda, mosaic_text_for_cuda
from pallas_kv.experimental import MosaicGPUVariantConfig
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from test_mosaic_gpu_quantized import E4M3, E5M2, INT8, check_case, complete, make_quant_case, run_partials

pytestmark = pytest.mark.experimental


def converter(**fields) -> MosaicGPUVariantConfig:
  """A complete config of the converter variant (64-token tiles, 2 stages, one split unless given)."""
  return complete(MosaicGPUVariantConfig, convert_warpgroup=True, **fields)


@pytest.mark.parametrize("seed,kv_dtype,k_kind,v_kind,page_size,num_queries,num_kv_heads,fields", [
    (30, INT8, "token", "token", None, 1, 4, dict(num_splits=2)),
    (31, E4M3, "head", "token", 32, 3, 1, dict(pipeline_qk=True)),
    (32, E5M2, None, "head", 64, 2, 1, dict()),
], ids=["int8-token-dense", "e4m3-head+token-hkv1-page32-s3-pqk", "e5m2-none+head-page64-s2"])
def test_converter_warpgroup_matches_reference_interpret(seed, kv_dtype, k_kind, v_kind, page_size, num_queries,
                                                         num_kv_heads, fields):
  # A ragged length (the last tile masked) and an empty sequence: the converter zeroes V's rows past
  # the length itself.
  case = make_quant_case(seed, kv_dtype=kv_dtype, k_kind=k_kind, v_kind=v_kind, batch=2, seq_len=192,
                         num_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads, num_queries=num_queries,
                         page_size=page_size, lengths=[150, 0])
  out, lse = check_case(case, converter(**fields))
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
  assert np.isneginf(np.asarray(lse[1])).all()


def test_converter_warpgroup_race_detection_finds_none():
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  # 5 tiles through 2-slot rings on both sides of the converter: every slot refilled.
  case = make_quant_case(33, kv_dtype=INT8, k_kind="token", v_kind="token", batch=1, seq_len=320, num_heads=4,
                         num_kv_heads=1, page_size=32, lengths=[300])
  out, _ = run_partials(case, converter(), interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found


def test_converter_warpgroup_is_checked():
  config = converter(num_splits=2)
  check = functools.partial(mgpu_config.check_config, rows=4, page_size=None, num_splits=config.num_splits)
  with pytest.raises(ValueError, match="converts one-byte caches"):
    check(config, head_dim=128, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="kv_groups=1 and persistent=False"):
    check(dataclasses.replace(config, kv_groups=2), head_dim=128, dtype=INT8)
  with pytest.raises(NotImplementedError, match="head_dim=256"):
    check(config, head_dim=256, dtype=INT8)
  check(config, head_dim=128, dtype=INT8)
  with pytest.raises(ValueError, match="convert_warpgroup"):
    MosaicGPUVariantConfig(convert_warpgroup=1)
  assert mgpu_config.converter(config) and not mgpu_config.converter(complete())
  # The converted rings count in the SMEM budget: 2 slots of K and of V in q's dtype.
  plain = mgpu_config.smem_bytes(dataclasses.replace(config, convert_warpgroup=False), rows=4, head_dim=128,
                                 dtype=INT8, q_dtype=jnp.bfloat16)
  converted = mgpu_config.smem_bytes(config, rows=4, head_dim=128, dtype=INT8, q_dtype=jnp.bfloat16)
  assert converted - plain >= 2 * 2 * 64 * 128 * 2 - 64 * 128 * 2   # minus the dequantized tile it replaces
  # A partial variant config is filled around it: one KV group (the heuristic takes two for int8).
  from sweeps import problem_args
  _, problem = problem_args((32, 8), (32, 4096), None)
  resolved = mgpu_config.resolve_config(problem, MosaicGPUVariantConfig(convert_warpgroup=True), dtype=INT8,
                                        num_sms=132)
  assert isinstance(resolved, MosaicGPUVariantConfig) and resolved.convert_warpgroup and resolved.kv_groups == 1
  assert mgpu_config.resolve_config(problem, None, dtype=INT8, num_sms=132).kv_groups == 2


def _lower_op(q, kv, scales, tables=None, *, config):
  """The op (impl mosaic_gpu, a variant config) lowered for CUDA on ShapeDtypeStructs; its module."""
  kw = dict(impl="mosaic_gpu", config=config)
  lengths = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)
  if tables is None:
    fn = lambda q, k, v, n, ks, vs: pkv.decode_attention(q, k, v, n, k_scale=ks, v_scale=vs, **kw)
    return lower_for_cuda(fn, q, kv, kv, lengths, scales, scales).mlir_module()
  fn = lambda q, k, v, t, n, ks, vs: pkv.paged_decode_attention(q, k, v, t, n, k_scale=ks, v_scale=vs, **kw)
  return lower_for_cuda(fn, q, kv, kv, tables, lengths, scales, scales).mlir_module()


@pytest.mark.parametrize("kv_dtype,scale_kind,page_size", [(INT8, "token", None), (E4M3, "token", 16),
                                                           (INT8, "head", 64)])
def test_converter_warpgroup_lowers_for_cuda(kv_dtype, scale_kind, page_size):
  # B32 T4096 heads 32/8 D128: Mosaic GPU lowering and layout inference of the converter's loads
  # and stores, which interpret mode does not check.
  num_kv_heads, T = 8, 4096
  q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
  config = MosaicGPUVariantConfig(block_kv=64, num_stages=4, num_splits=1, convert_warpgroup=True)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((32, T, num_kv_heads, 128), kv_dtype)
    scales = jax.ShapeDtypeStruct((32, T, num_kv_heads) if scale_kind == "token" else (num_kv_heads,), jnp.float32)
    module = _lower_op(q, kv, scales, config=config)
  else:
    pages = jax.ShapeDtypeStruct((32 * T // page_size, page_size, num_kv_heads, 128), kv_dtype)
    tables = jax.ShapeDtypeStruct((32, T // page_size), jnp.int32)
    shape = (32 * T // page_size, page_size, num_kv_heads) if scale_kind == "token" else (num_kv_heads,)
    module = _lower_op(q, pages, jax.ShapeDtypeStruct(shape, jnp.float32), tables, config=config)
  assert "_cvt" in module   # the converter's kernel, not the consumers' dequantizing one


def test_converter_warpgroup_with_two_row_warpgroups_lowers_for_cuda():
  # 5 new tokens x 16 q heads = 80 packed rows: two consumers read each converted slot (4 warpgroups).
  q = jax.ShapeDtypeStruct((4, 5, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((4, 4096, 1, 128), INT8)
  scales = jax.ShapeDtypeStruct((4, 4096, 1), jnp.float32)
  module = _lower_op(q, kv, scales, config=converter(num_splits=2))
  assert "_cvt" in module


def test_converter_warpgroup_keeps_garbage_past_the_length_out():
  # V past the length holds NaN and its per-token scales inf: the converter must zero those rows.
  clean = make_quant_case(34, kv_dtype=E4M3, k_kind="token", v_kind="token", batch=2, num_heads=4, num_kv_heads=1,
                          lengths=[201, 130])
  past = (jnp.arange(clean.v.shape[1]) >= clean.lengths[:, None])[..., None]   # [B, T, 1]
  poisoned = dataclasses.replace(clean, v=jnp.where(past[..., None], jnp.nan, clean.v.astype(jnp.float32))
                                 .astype(E4M3), v_scale=jnp.where(past, jnp.inf, clean.v_scale))
  out, _ = run_partials(poisoned, converter(num_splits=2))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_matches_reference(out, clean.reference()[0], clean.q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,kind,page_size", [(INT8, "token", None), (E4M3, "token", 16), (INT8, "head", 64)],
                         ids=["int8-token-dense", "e4m3-token-page16", "int8-head-page64"])
def test_gpu_converter_warpgroup_matches_reference(kv_dtype, kind, page_size):
  case = make_quant_case(35, kv_dtype=kv_dtype, k_kind=kind, v_kind=kind, batch=4, seq_len=2048, num_heads=32,
                         num_kv_heads=8, head_dim=128, page_size=page_size, lengths=[2048, 1000, 0, 77])
  config = MosaicGPUVariantConfig(block_kv=64, num_stages=4, num_splits=4, convert_warpgroup=True)
  q = case.q[:, 0]
  if page_size is None:
    out = pkv.decode_attention(q, case.k, case.v, case.lengths, k_scale=case.k_scale, v_scale=case.v_scale,
                               impl="mosaic_gpu", config=config)
  else:
    k_pages, v_pages, tables, k_scale, v_scale = case.paged
    out = pkv.paged_decode_attention(q, k_pages, v_pages, tables, case.lengths, k_scale=k_scale, v_scale=v_scale,
                                     impl="mosaic_gpu", config=config)
  assert_matches_reference(out, case.reference()[0][:, 0], case.q.dtype)


# ---------------------------------------------------------------- explicit barriers

def explicit(**fields) -> MosaicGPUVariantConfig:
  return complete(MosaicGPUVariantConfig, explicit_barriers=True, **fields)


def _tokens_last_call(case, config, interpret: bool):
  """decode_attention over the case's cache with V stored tokens last ([B, Hkv, D, T])."""
  v = jnp.transpose(case.v, (0, 2, 3, 1))
  with pkv.interpret(interpret):
    return pkv.decode_attention(case.q[:, 0], case.k, v, case.lengths, k_scale=case.k_scale, v_scale=case.v_scale,
                                v_tokens_last=True, impl="mosaic_gpu", config=config)


@pytest.mark.parametrize("seed,kv_dtype,page_size,fields", [
    (40, INT8, None, dict(num_splits=2)),
    (41, INT8, 32, dict(pipeline_qk=True, persistent=True, num_splits=2)),
    (42, E4M3, None, dict(tile_consumers=2, num_stages=4, persistent=True, num_splits=2)),
], ids=["int8-widened", "int8-pqk-persistent-page32", "e4m3-widened-tc2-persistent"])
def test_explicit_barriers_match_reference_interpret(seed, kv_dtype, page_size, fields):
  # The widening consumers' stores, the persistent programs' output staging and two consumers' hand-over,
  # over a masked last tile and an empty sequence (interpret mode runs the code; the barriers it needs on a GPU
  # are the GPU test's to check).
  case = make_quant_case(seed, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=2, seq_len=192,
                         num_heads=4, num_kv_heads=1, page_size=page_size, lengths=[150, 0])
  out, _ = check_case(case, explicit(**fields), num_programs=1 if fields.get("persistent") else None)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)


def test_explicit_barriers_fp8_operands_match_reference_interpret():
  # fp8 tiles read by wgmma as stored, P staged in SMEM as two e4m3 terms each tile (the stores this variant
  # frees of their barriers).
  case = make_quant_case(43, kv_dtype=E4M3, k_kind="token", v_kind="token", batch=2, seq_len=192, num_heads=4,
                         num_kv_heads=1, lengths=[150, 77])
  out = _tokens_last_call(case, explicit(num_splits=2), True)
  assert_matches_reference(out, case.reference()[0][:, 0], case.q.dtype)


def test_explicit_barriers_are_checked():
  check = functools.partial(mgpu_config.check_config, rows=4, page_size=None, num_splits=1, head_dim=128, dtype=INT8)
  with pytest.raises(ValueError, match="explicit_barriers=True has no converter"):
    check(complete(MosaicGPUVariantConfig, explicit_barriers=True, convert_warpgroup=True))
  assert mgpu_config.explicit_barriers(explicit()) and not mgpu_config.explicit_barriers(complete())


@pytest.mark.parametrize("kv_dtype", [E4M3, INT8], ids=["e4m3-fp8-operands", "int8-widened"])
def test_explicit_barriers_lower_with_fewer_warpgroup_barriers(monkeypatch, kv_dtype):
  # B32 T4096 heads 32/8 D128, V tokens last: the variant lowers for CUDA (layout inference included) and its
  # consumers' loops hold fewer warpgroup barriers (bar.sync) than the shipped kernel's.
  q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((32, 4096, 8, 128), kv_dtype)
  v = jax.ShapeDtypeStruct((32, 8, 128, 4096), kv_dtype)
  lengths = jax.ShapeDtypeStruct((32,), jnp.int32)
  scales = jax.ShapeDtypeStruct((32, 4096, 8), jnp.float32)
  counts = {}
  for name, config in (("auto", complete(num_splits=1)), ("explicit", explicit(num_splits=1))):
    fn = functools.partial(pkv.decode_attention, v_tokens_last=True, impl="mosaic_gpu", config=config)
    text = mosaic_text_for_cuda(monkeypatch, lambda q, k, v, n, ks, vs: fn(q, k, v, n, k_scale=ks, v_scale=vs),
                         q, k, v, lengths, scales, scales)
    counts[name] = text.count("bar.sync")
  # fp8: P's two stores a tile lose the barriers before and after them, in two consumers' two tile loops each
  # (unmasked and masked; 28 -> 6 in the whole module); int8: the widened tiles' stores keep one, before (23 -> 11).
  assert counts["explicit"] <= counts["auto"] - (20 if kv_dtype == E4M3 else 10), counts


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,fields", [(E4M3, dict(num_splits=4)), (INT8, dict(num_splits=4)),
                                             (INT8, dict(pipeline_qk=True, persistent=True, num_splits=2))],
                         ids=["e4m3-fp8-operands", "int8-widened", "int8-pqk-persistent"])
def test_gpu_explicit_barriers_match_reference_and_rerun_bit_identical(kv_dtype, fields):
  # A race between a warp's SMEM stores and another warp's reads would show as a wrong or a varying result.
  case = make_quant_case(44, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=8, seq_len=2048,
                         num_heads=32, num_kv_heads=8, head_dim=128, lengths=[2048, 1000, 0, 77, 2047, 1, 640, 1500])
  config = MosaicGPUVariantConfig(block_kv=64, num_stages=4, explicit_barriers=True, **fields)
  first = _tokens_last_call(case, config, False)
  assert_matches_reference(first, case.reference()[0][:, 0], case.q.dtype)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(_tokens_last_call(case, config, False)), np.asarray(first))


# ---------------------------------------------------------------- scales by head

@pytest.mark.parametrize("seed,kv_dtype", [(50, E4M3), (51, INT8)], ids=["e4m3", "int8"])
def test_scales_by_head_match_reference_interpret(seed, kv_dtype):
  # 4 kv heads (a multiple of 4, read as [bkv, 4] boxes unless the variant lays the scales out by head), the
  # one-byte default's tiles (queries as N, 256 tokens, V as stored), a masked last tile and a short sequence.
  case = make_quant_case(seed, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=2, seq_len=512,
                         num_heads=8, num_kv_heads=4, lengths=[300, 77])
  fields = dict(queries_as_n=True, block_kv=256, values_as_stored=True, num_splits=2)
  config = MosaicGPUVariantConfig(scales_by_head=True, **fields)
  smem = functools.partial(mgpu_config.DecodeSmem.for_call, rows=2, head_dim=64, dtype=kv_dtype, page_size=None,
                           k_scale_kind="token", v_scale_kind="token", num_kv_heads=4, v_tokens_last=True,
                           q_dtype=jnp.bfloat16)
  assert smem(complete(MosaicGPUVariantConfig, **fields)).scales_by_head is False
  assert smem(complete(MosaicGPUVariantConfig, scales_by_head=True, **fields)).scales_by_head is True
  out = _tokens_last_call(case, config, True)
  assert_matches_reference(out, case.reference()[0][:, 0], case.q.dtype)


def test_kernel_call_inputs_give_the_partials():
  # `kernel_call`'s kernel on its prepared inputs (what a bare kernel timing runs) is `decode_partials`.
  from pallas_kv import SplitPlan
  from pallas_kv.config import AttentionOptions
  from pallas_kv.kernels import frame
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  case = make_quant_case(52, kv_dtype=E4M3, k_kind="token", v_kind="token", batch=2, seq_len=256, num_heads=8,
                         num_kv_heads=4, lengths=[256, 100])
  config = complete(MosaicGPUVariantConfig, queries_as_n=True, block_kv=256, values_as_stored=True,
                    scales_by_head=True)
  kwargs = dict(num_queries=1, options=AttentionOptions(scale=0.125), config=config, k_scale=case.k_scale,
                v_scale=case.k_scale, plan=SplitPlan(kind="per_sequence", num_splits=1, block_kv=256),
                v_tokens_last=True, interpret=True)
  rows, v = frame.pack_queries(case.q, 4), jnp.transpose(case.v, (0, 2, 3, 1))
  kernel, inputs, finish = mgpu_decode.kernel_call(rows, case.k, v, case.lengths, **kwargs)
  assert inputs[-1].shape == (2, 4, 256)   # the scales laid out by head before the kernel
  with pkv.interpret():
    bare = finish(*kernel(*inputs))
    whole = mgpu_decode.decode_partials(rows, case.k, v, case.lengths, **kwargs)
  for a, b in zip(bare, whole):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kv_dtype", [E4M3, INT8], ids=["e4m3", "int8"])
def test_scales_by_head_lower_for_cuda(kv_dtype):
  # B32 T4096 heads 32/8 D128 on the one-byte default's tiles: each tile's scales one run of 256 a copy.
  q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((32, 4096, 8, 128), kv_dtype)
  v = jax.ShapeDtypeStruct((32, 8, 128, 4096), kv_dtype)
  lengths = jax.ShapeDtypeStruct((32,), jnp.int32)
  scales = jax.ShapeDtypeStruct((32, 4096, 8), jnp.float32)
  config = MosaicGPUVariantConfig(queries_as_n=True, block_kv=256, values_as_stored=True, scales_by_head=True)
  fn = functools.partial(pkv.decode_attention, v_tokens_last=True, impl="mosaic_gpu", config=config)
  lower_for_cuda(lambda q, k, v, n, s: fn(q, k, v, n, k_scale=s, v_scale=s), q, k, v, lengths, scales)


# ---------------------------------------------------------------- one tile loop

@pytest.mark.parametrize("seed,kv_dtype,fields", [
    (60, INT8, dict(queries_as_n=True, block_kv=256, values_as_stored=True, paired_terms=True, num_splits=2)),
    (61, E4M3, dict(queries_as_n=True, block_kv=64, num_splits=2)),
    (62, INT8, dict(queries_as_n=False, kv_groups=1, pipeline_qk=True, num_splits=2)),
], ids=["int8-as-stored-paired", "e4m3-widened-as-n", "int8-keys-as-columns-pqk"])
def test_one_tile_loop_matches_reference_interpret(seed, kv_dtype, fields):
  # Every tile through the masked step: unmasked tiles, a masked last one, a sequence shorter than a tile, an
  # empty one.
  case = make_quant_case(seed, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=4, seq_len=768,
                         num_heads=8, num_kv_heads=4, lengths=[700, 77, 0, 768])
  out = _tokens_last_call(case, MosaicGPUVariantConfig(one_tile_loop=True, **fields), True)
  assert_matches_reference(out, case.reference()[0][:, 0], case.q.dtype)
  np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)


@pytest.mark.parametrize("pipeline_qk", [False, True], ids=["plain", "pqk"])
def test_one_tile_loop_16_bit_matches_reference_interpret(pipeline_qk):
  key = jax.random.split(jax.random.key(63), 3)
  q = jax.random.normal(key[0], (3, 8, 64), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (3, 320, 2, 64), jnp.bfloat16) for kk in key[1:])
  lengths = jnp.array([300, 64, 17], jnp.int32)
  config = MosaicGPUVariantConfig(one_tile_loop=True, block_kv=64, num_splits=2, pipeline_qk=pipeline_qk)
  with pkv.interpret():
    out = pkv.decode_attention(q, k, v, lengths, impl="mosaic_gpu", config=config)
  assert_matches_reference(out, pkv.decode_attention(q, k, v, lengths, impl="xla"), q.dtype)


@pytest.mark.parametrize("kv_dtype", [INT8, E4M3, jnp.bfloat16], ids=["int8", "e4m3", "bf16"])
def test_one_tile_loop_lowers_one_tile_loop(monkeypatch, kv_dtype):
  # B1 T32768 heads 32/8 D128, the default config with the variant (one-byte: V tokens last, per-token scales):
  # one loop issues the tile's wgmma (the default two: the unmasked tiles, then the masked last ones), and the
  # kernel is smaller by most of one.
  from harness import tile_loops
  one_byte = kv_dtype != jnp.bfloat16
  q = jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 32768, 8, 128), kv_dtype)
  v = jax.ShapeDtypeStruct((1, 8, 128, 32768) if one_byte else k.shape, kv_dtype)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  scales = jax.ShapeDtypeStruct((1, 32768, 8), jnp.float32)
  texts = {}
  for name, config in (("default", None), ("one", MosaicGPUVariantConfig(one_tile_loop=True))):
    fn = functools.partial(pkv.decode_attention, impl="mosaic_gpu", config=config)
    if one_byte:
      texts[name] = mosaic_text_for_cuda(
          monkeypatch, lambda q, k, v, n, s: fn(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True),
          q, k, v, lengths, scales)
    else:
      texts[name] = mosaic_text_for_cuda(monkeypatch, fn, q, k, v, lengths)
  loops = {name: tile_loops(text) for name, text in texts.items()}
  assert (len(loops["default"]), len(loops["one"])) == (2, 1)
  shorter = len(texts["default"].splitlines()) - len(texts["one"].splitlines())
  assert shorter > 0.6 * len(loops["default"][0]), (shorter, [len(body) for body in loops["default"]])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_gpu_one_tile_loop_matches_reference(kv_dtype):
  case = make_quant_case(64, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=8, seq_len=2048,
                         num_heads=32, num_kv_heads=8, head_dim=128, lengths=[2048, 1000, 0, 77, 2047, 1, 640, 1500])
  out = _tokens_last_call(case, MosaicGPUVariantConfig(one_tile_loop=True), False)
  assert_matches_reference(out, case.reference()[0][:, 0], case.q.dtype)


# ---------------------------------------------------------------- the stream-K walk as a loop

def _stream_k(**fields) -> MosaicGPUVariantConfig:
  return MosaicGPUVariantConfig(split_plan="stream_k", block_kv=64, num_stages=2, num_splits=3, **fields)


@pytest.mark.parametrize("walk_unroll", [1, 2], ids=["loop", "loop-by-2"])
def test_walk_as_a_loop_matches_the_xla_walk_interpret(walk_unroll):
  # Sequences cut into pieces, an empty one and one shorter than a tile, over two kv heads: the programs' own
  # loops find the segments the XLA walk's vectors give, so the partials are the same bits.
  key = jax.random.split(jax.random.key(70), 3)
  q = jax.random.normal(key[0], (6, 4, 64), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (6, 256, 2, 64), jnp.bfloat16) for kk in key[1:])
  lengths = jnp.array([250, 30, 0, 256, 5, 130], jnp.int32)
  looped = _stream_k(walk_unroll=walk_unroll)
  with pkv.interpret():
    plan = pkv.plan_splits(pkv.decode_attention, q, k, v, lengths, impl="mosaic_gpu", config=looped)
    out, lse = pkv.decode_attention(q, k, v, lengths, impl="mosaic_gpu", config=looped, return_lse=True)
    ahead = pkv.decode_attention(q, k, v, lengths, impl="mosaic_gpu", config=looped, return_lse=True, plan=plan)
  assert plan.walk is not None and not plan.walk.in_kernel   # a plan made ahead still makes vectors
  assert_matches_reference(out, pkv.decode_attention(q, k, v, lengths, impl="xla"), q.dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ahead[0], np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ahead[1]))


def test_walk_unroll_is_checked_and_planned_in_the_kernel_at_any_batch():
  with pytest.raises(ValueError, match="walk_unroll=-1 must be an int >= 0"):
    _stream_k(walk_unroll=-1)
  with pytest.raises(ValueError, match="walk_unroll=4 is the stream-K walk's; needs split_plan='stream_k'"):
    MosaicGPUVariantConfig(walk_unroll=4, split_plan="per_sequence")
  from pallas_kv.kernels import plan as split_plan
  problem = dataclasses.make_dataclass("P", ["batch", "num_kv_heads", "num_queries", "capacity"])(128, 8, 1, 4096)
  lengths = jnp.full((128,), 4096, jnp.int32)
  for config, unroll in ((_stream_k(walk_unroll=1), 1), (_stream_k(walk_unroll=500), 128),
                         (_stream_k(), split_plan.KERNEL_WALK_UNROLL)):
    made = split_plan.make_plan(lengths, problem=problem, config=config, window=None, row_blocks=1, num_sms=132,
                                walked=True)
    assert made.walk.in_kernel and made.walk.unroll == unroll   # at most the batch's steps


def test_walk_as_a_loop_lowers_to_less_code(monkeypatch):
  # B128 T4096 heads 32/8 D128: the straight-line walk of 128 sequences against the loops unrolled by 4. Both
  # lower for CUDA.
  q = jax.ShapeDtypeStruct((128, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((128, 4096, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((128,), jnp.int32)
  sizes = {}
  for unroll in (128, 4):
    config = MosaicGPUVariantConfig(split_plan="stream_k", pipeline_qk=True, walk_unroll=unroll)
    fn = functools.partial(pkv.decode_attention, impl="mosaic_gpu", config=config)
    text = mosaic_text_for_cuda(monkeypatch, fn, q, k, k, lengths)
    assert f"_streamk_kwalk{unroll}" in text
    sizes[unroll] = len(text.splitlines())
  # The straight-line walk is over a third of that kernel (two passes of a load and ~20 ops a sequence, on every
  # warpgroup's path: 18.4 thousand lines against 11.7 with the loops).
  assert sizes[4] < 0.7 * sizes[128], sizes


@pytest.mark.gpu
@pytest.mark.parametrize("walk_unroll", [1, 8], ids=["loop", "loop-by-8"])
def test_gpu_walk_as_a_loop_matches_reference(walk_unroll):
  key = jax.random.split(jax.random.key(71), 4)
  q = jax.random.normal(key[0], (64, 32, 128), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (64, 2048, 8, 128), jnp.bfloat16) for kk in key[1:3])
  lengths = jax.random.randint(key[3], (64,), 0, 2049).at[:3].set(jnp.array([0, 1, 2048]))
  config = MosaicGPUVariantConfig(split_plan="stream_k", pipeline_qk=True, walk_unroll=walk_unroll)
  out = jax.jit(functools.partial(pkv.decode_attention, impl="mosaic_gpu", config=config))(q, k, v, lengths)
  assert_matches_reference(out, pkv.decode_attention(q, k, v, lengths, impl="xla"), q.dtype)
