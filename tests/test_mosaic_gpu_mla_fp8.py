"""The Mosaic GPU MLA kernel over an fp8 latent cache (kernels/mosaic_gpu/mla.py, `MlaSmem.quantized`): Q K^T on
fp8 wgmma with Q as two fp8 terms (`split_query`), each consumer widening its own value columns, per-token or
scalar kv_scale. Numerics in GPU interpret mode on small latent dims against the reference over the exactly widened
cache, garbage (NaN pages and scales) past the lengths, the terms' precision, what the kernel refuses, CUDA
lowering at DeepSeek-V3 shapes, and real shapes on a GPU."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import assert_lse_matches, assert_matches_reference, lower_for_cuda, mosaic_text_for_cuda
from harness import paginate, relative_error
from pallas_kv import cache as kv_cache
from pallas_kv.kernels.mosaic_gpu import mla_config
from pallas_kv.kernels.mosaic_gpu import mla_tiles

IMPL = "mosaic_gpu"
SMALL_QK, SMALL_V = 192, 128
QK, V = 576, 512
FP8 = jnp.float8_e4m3fn


def _case(seed, *, batch, seq_len, num_heads, num_queries, page_size, lengths, scales, qk_dim=SMALL_QK,
          dtype=FP8, magnitude=3.0):
  """(q bf16, fp8 pages, tables, lengths, kv_scale, the pages widened exactly in f32). scales: "token" (one per
  token, from each row's max), a number, or None (values stored as they are); magnitude: the values' spread."""
  rng = np.random.default_rng(seed)
  shape = (batch, num_heads, qk_dim) if num_queries is None else (batch, num_queries, num_heads, qk_dim)
  q = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  kv = rng.standard_normal((batch, seq_len, qk_dim)) * magnitude
  kv[..., :4] *= 20.0   # outlier channels, as latent caches have
  pages, tables, _ = paginate(jnp.asarray(kv, jnp.float32), page_size, rng)
  if scales == "token":
    pages, kv_scale = kv_cache.quantize(pages, dtype)
    widened = pages.astype(jnp.float32) * kv_scale[..., None]
  elif scales is None:
    pages, kv_scale = kv_cache.quantize(pages / 20.0, dtype, 1.0)[0], None
    widened = pages.astype(jnp.float32)
  else:
    pages, kv_scale = kv_cache.quantize(pages, dtype, scales)[0], scales
    widened = pages.astype(jnp.float32) * scales
  return q, pages, tables, jnp.asarray(lengths, jnp.int32), kv_scale, widened


def _check(case, out_lse, *, scale=None, v_head_dim=SMALL_V):
  q, _, tables, lengths, _, widened = case
  out, lse = out_lse
  ref, ref_lse = pkv.mla_decode_attention_reference(q.astype(jnp.float32), widened, tables, lengths,
                                                    v_head_dim=v_head_dim, scale=scale, return_lse=True)
  assert out.dtype == q.dtype
  assert_matches_reference(out, ref, q.dtype)   # bf16's tolerance: the fp8 cache's rounding is not the kernel's
  assert_lse_matches(lse, ref_lse, q.dtype)


def _config(num_splits, **fields):
  return pkv.MosaicMLAConfig(**(dict(block_kv=64, num_stages=2, num_splits=num_splits, split_plan="per_sequence",
                                     sequence_order="given") | fields))


# ---------------------------------------------------------------- interpret mode (CPU)

# Up to 32 packed rows take wgmma's N (`mla_config.ONE_BYTE_ROWS_AS_N_MAX`): all but the 72-row case.
@pytest.mark.parametrize("page_size,num_queries,num_heads,num_splits,scales,dtype", [
    (32, 2, 4, 2, "token", FP8),
    (64, None, 8, 1, 0.05, FP8),
    (32, 3, 24, 2, "token", FP8),
    (64, None, 4, 3, None, jnp.float8_e5m2),
    (16, 2, 16, 2, "token", FP8),
], ids=["page32-s2-token-splits2", "page64-s1-scalar", "page32-s3-rowblocks2-token", "page64-e5m2-unscaled-splits3",
        "page16-s2-h16-n32-token-splits2"])
def test_fp8_mla_interpret(interpret_mode, page_size, num_queries, num_heads, num_splits, scales, dtype):
  # A ragged length (not a multiple of a tile) and one of zero; 3 x 24 heads = 72 rows take two row blocks.
  case = _case(page_size + num_heads, batch=2, seq_len=256, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=[219, 0], scales=scales, dtype=dtype)
  q, pages, tables, lengths, kv_scale, _ = case
  out, lse = pkv.mla_decode_attention(q, pages, tables, lengths, v_head_dim=SMALL_V, scale=0.11, return_lse=True,
                                      impl=IMPL, config=_config(num_splits), kv_scale=kv_scale)
  _check(case, (out, lse), scale=0.11)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
  assert np.isneginf(np.asarray(lse[1])).all()


@pytest.mark.parametrize("num_heads", [4, 72], ids=["rows-as-n", "rows-as-m"])
def test_fp8_mla_small_values_keep_their_precision(interpret_mode, num_heads):
  # Values ~1e-5 take per-token scales ~1e-7: P times a key's scale fell below f16's normal range, P V's operand
  # (errors 1.5e-2 / 1.8e-2 before; 0.19 at 1e-6); P over the running max of the scales met keeps the error of
  # values ~3 (~2e-3).
  case = _case(9, batch=2, seq_len=256, num_heads=num_heads, num_queries=None, page_size=32, lengths=[219, 256],
               scales="token", magnitude=1e-5)
  q, pages, tables, lengths, kv_scale, widened = case
  scale = 0.3 / 1e-5   # logits of the usual spread
  out, lse = pkv.mla_decode_attention(q, pages, tables, lengths, v_head_dim=SMALL_V, scale=scale, return_lse=True,
                                      impl=IMPL, config=_config(2), kv_scale=kv_scale)
  _check(case, (out, lse), scale=scale)
  ref = pkv.mla_decode_attention_reference(q.astype(jnp.float32), widened, tables, lengths, v_head_dim=SMALL_V,
                                           scale=scale)
  assert relative_error(out, ref) < 5e-3


def test_fp8_mla_garbage_past_lengths_never_reaches_an_output(interpret_mode):
  page_size = 32
  case = _case(5, batch=3, seq_len=128, num_heads=4, num_queries=2, page_size=page_size, lengths=[100, 37, 70],
               scales="token")
  q, pages, tables, lengths, kv_scale, _ = case
  bad_pages = np.asarray(pages.astype(jnp.float32)).copy()
  bad_scale = np.asarray(kv_scale).copy()
  live = set()
  for b, length in enumerate(np.asarray(lengths)):
    used = -(-int(length) // page_size)
    live.update(np.asarray(tables)[b, :used].tolist())
    for j in range(used):
      past = np.arange(j * page_size, (j + 1) * page_size) >= length
      bad_pages[tables[b, j], past] = np.nan
      bad_scale[tables[b, j], past] = np.inf
  for page in set(range(pages.shape[0])) - live:
    bad_pages[page], bad_scale[page] = np.nan, np.nan
  out = pkv.mla_decode_attention(q, jnp.asarray(bad_pages, pages.dtype), tables, lengths, v_head_dim=SMALL_V,
                                 return_lse=True, impl=IMPL, config=_config(2), kv_scale=jnp.asarray(bad_scale))
  _check(case, out)


@pytest.mark.parametrize("codegen", [mla_config.Codegen(), mla_config.Codegen(explicit_barriers=True),
                                     mla_config.Codegen(one_byte_rows_as_n=False),
                                     mla_config.Codegen(widen_own_values=True)],
                         ids=["shipped", "explicit-barriers", "rows-as-m", "own-values"])
def test_fp8_mla_race_detection_finds_none(codegen):
  # The partner widens the scorer's value columns for each tile (values_ready / values_free) while the scorer
  # scores it (own-values: each widens its own): 5 tiles through a 2-slot ring, pages of 32, a masked last tile,
  # per-token scales; 4 rows, as wgmma's N unless the codegen pads them to M = 64.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  case = _case(5, batch=1, seq_len=384, num_heads=4, num_queries=None, page_size=32, lengths=[300], scales="token")
  q, pages, tables, lengths, kv_scale, widened = case
  out, lse = mgpu_mla.mla_partials(q.astype(jnp.float16), pages, lengths, tables, num_queries=1,
                                   v_head_dim=SMALL_V, scale=0.1, config=_config(1), kv_scale=kv_scale,
                                   plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64),
                                   codegen=codegen, interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found
  ref = pkv.mla_decode_attention_reference(q.astype(jnp.float32), widened, tables, lengths, v_head_dim=SMALL_V,
                                           scale=0.1)
  assert_matches_reference(out[:, 0], ref, jnp.bfloat16)


def test_split_query_terms_keep_bf16_precision():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 64, SMALL_QK)).astype(np.float32)
  q[0, :, :3] *= 50.0    # outlier channels
  q[1, 5] = 0.0          # an all-zero row
  terms, factor = mla_tiles.split_query(jnp.asarray(q), 0.5)
  assert terms.shape == (2, 2, 64, SMALL_QK) and terms.dtype == FP8 and factor.shape == (2, 64)
  joined = (terms[:, 0].astype(jnp.float32) + terms[:, 1].astype(jnp.float32)) * factor[..., None] / 0.5
  hi_only = terms[:, 0].astype(jnp.float32) * factor[..., None] / 0.5
  # Dot products, as Q K^T takes them: the two terms err as bf16 does, one fp8 term ~16x more.
  k = rng.standard_normal((SMALL_QK, 32)).astype(np.float32)
  exact = q @ k
  bf16 = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32) @ k
  assert relative_error(np.asarray(joined) @ k, exact) < 2 * relative_error(bf16, exact)
  assert relative_error(np.asarray(hi_only) @ k, exact) > 4 * relative_error(bf16, exact)
  np.testing.assert_array_equal(np.asarray(joined[1, 5]), 0.0)
  assert np.isfinite(np.asarray(factor)).all()


# ---------------------------------------------------------------- what it refuses (CPU)

def test_fp8_mla_takes_the_shipped_schedule_on_64_token_tiles():
  for given in (dict(block_kv=32, num_stages=4),):
    with pytest.raises(ValueError, match="fp8 latent cache takes the shipped schedule with block_kv=64"):
      mla_config.check_config(_config(1, **given), qk_dim=QK, v_dim=V, dtype=jnp.float16, page_size=64,
                              kv_dtype=FP8)
  # Q's two fp8 terms and each consumer's widened values fit beside two one-byte stages.
  smem = mla_config.MlaSmem.for_call(_config(1), qk_dim=QK, v_dim=V, dtype=FP8, page_size=64, token_scales=True)
  assert smem.quantized and smem.dtype == jnp.float16 and smem.fits
  deeper = mla_config.MlaSmem.for_call(_config(1, num_stages=3), qk_dim=QK, v_dim=V, dtype=FP8, page_size=64)
  assert not deeper.fits


def test_per_token_scales_on_pages_of_16_are_gathered_by_sequence(interpret_mode, monkeypatch):
  # A page's run of 16 scales (64 bytes) is under TMA's 128-byte SMEM alignment: the call gathers them by sequence
  # ([B, T]) and copies a tile's run. Stale table entries past a length (here out of range) read clamped pages.
  from pallas_kv import api
  case = _case(2, batch=2, seq_len=192, num_heads=4, num_queries=None, page_size=16, lengths=[150, 9],
               scales="token")
  q, pages, tables, lengths, kv_scale, widened = case
  tables = tables.at[1, 4:].set(pages.shape[0] + 7)
  _check((q, pages, tables, lengths, kv_scale, widened),
         pkv.mla_decode_attention(q, pages, tables, lengths, v_head_dim=SMALL_V, impl=IMPL, kv_scale=kv_scale,
                                  return_lse=True))
  smem = mla_config.MlaSmem.for_call(_config(1), qk_dim=SMALL_QK, v_dim=SMALL_V, dtype=FP8, page_size=16,
                                     token_scales=True)
  assert smem.gathered_scales and smem.scale_ring_spec().copies_per_slot == 1
  assert not mla_config.MlaSmem.for_call(_config(1), qk_dim=SMALL_QK, v_dim=SMALL_V, dtype=FP8, page_size=32,
                                         token_scales=True).gathered_scales
  monkeypatch.setattr(api, "device_can_run", lambda name: True)   # as on a Hopper GPU
  problem = api.validation.validate_mla(q, pages, tables, lengths, SMALL_V)
  options = api._options(problem, None, None, None, None, kv_scale[..., None], None)
  assert api.choose_impl("auto", "mla", problem, options, (q.dtype, pages.dtype), None)[0] == IMPL


def test_fp8_mla_kernel_refuses_a_scale_on_a_16_bit_cache():
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  q = jnp.zeros((1, 64, SMALL_QK), jnp.bfloat16)
  pages = jnp.zeros((4, 64, SMALL_QK), jnp.bfloat16)
  with pytest.raises(ValueError, match="kv_scale widens an fp8 cache, not a bfloat16 one"):
    mgpu_mla.mla_partials(q, pages, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 4), jnp.int32), num_queries=1,
                          v_head_dim=SMALL_V, scale=0.1, config=_config(1), plan=pkv.SplitPlan(
                              kind="per_sequence", num_splits=1, block_kv=64), kv_scale=jnp.ones((1,)))


# ---------------------------------------------------------------- CUDA lowering (CPU)

LOWERING = [
    dict(batch=64, seq_len=4096), dict(batch=64, seq_len=8192, num_heads=16), dict(batch=1, seq_len=32768,
                                                                                     scales="scalar"),
    dict(batch=8, seq_len=4096, num_heads=32, num_queries=4, page_size=32),
    dict(batch=8, seq_len=4096, num_heads=32, page_size=16, scales="scalar"),
    dict(batch=8, seq_len=4096, page_size=16),   # per-token scales gathered by sequence
    dict(batch=4, seq_len=1024, dtype=jnp.float8_e5m2, scales=None),
    dict(batch=8, seq_len=4096, num_heads=16, num_queries=2, page_size=32),   # 32 rows as wgmma's N
]


@pytest.mark.parametrize("shape", LOWERING, ids=lambda s: "-".join(f"{k}={getattr(v, '__name__', v)}"
                                                                   for k, v in s.items()))
def test_fp8_mla_lowers_for_cuda(shape):
  shape = dict(num_heads=128, num_queries=1, page_size=64, dtype=FP8, scales="token") | shape
  b, t, ps = shape["batch"], shape["seq_len"], shape["page_size"]
  q_shape = (b, shape["num_heads"], QK) if shape["num_queries"] == 1 else (b, shape["num_queries"],
                                                                            shape["num_heads"], QK)
  args = [jax.ShapeDtypeStruct(q_shape, jnp.bfloat16), jax.ShapeDtypeStruct((b * t // ps, ps, QK), shape["dtype"]),
          jax.ShapeDtypeStruct((b, t // ps), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)]
  scales = shape["scales"]
  if scales is not None:
    args.append(jax.ShapeDtypeStruct((b * t // ps, ps) if scales == "token" else (), jnp.float32))
  call = lambda q, pages, tables, lengths, kv_scale=None: pkv.mla_decode_attention(
      q, pages, tables, lengths, v_head_dim=V, return_lse=True, impl=IMPL, kv_scale=kv_scale)
  module = lower_for_cuda(call, *args).mlir_module()
  rows = shape["num_heads"] * shape["num_queries"]   # 16 heads: the rows as wgmma's N, padded to 16
  as_n = f"_n{-(-rows // 16) * 16}" if rows <= mla_config.ONE_BYTE_ROWS_AS_N_MAX else ""
  name = f"_regp{as_n}_{jnp.dtype(shape['dtype']).name}"
  assert "custom_call @mosaic_gpu" in module and name in module
  assert ("_ks" in module) == (scales == "token")


def _kernel_launch(dtype, codegen, *, batch=64, seq_len=4096, num_heads=128, page_size=64):
  """(the MLA kernel's launch, one split, on a bf16 or fp8 pool of DeepSeek-V3 shapes; its ShapeDtypeStructs)."""
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  pages = batch * seq_len // page_size
  fp8 = jnp.dtype(dtype).itemsize == 1
  args = [jax.ShapeDtypeStruct((batch, num_heads, QK), jnp.float16 if fp8 else jnp.bfloat16),
          jax.ShapeDtypeStruct((pages, page_size, QK), dtype), jax.ShapeDtypeStruct((batch,), jnp.int32),
          jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)]
  if fp8:
    args.append(jax.ShapeDtypeStruct((pages, page_size), jnp.float32))
  plan = pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64)
  fn = lambda q, kv, lengths, tables, kv_scale=None: mgpu_mla.mla_partials(
      q, kv, lengths, tables, num_queries=1, v_head_dim=V, scale=0.1, config=_config(1), plan=plan,
      kv_scale=kv_scale, codegen=codegen)[0]
  return fn, args


@pytest.mark.parametrize("codegen", [mla_config.Codegen(), mla_config.Codegen(one_byte_rows_as_n=False),
                                     mla_config.Codegen(widen_own_values=True)],
                         ids=["rows-as-n", "rows-as-m", "own-values"])
def test_fp8_mla_16_heads_lower_for_cuda_each_way(codegen):
  # The kernels `tools.mla_fp8_parts` compares at 16 heads B64 T8192, lowered with layout inference; the name
  # says which form each took.
  fn, args = _kernel_launch(FP8, codegen, seq_len=8192, num_heads=16)
  module = lower_for_cuda(fn, *args).mlir_module()
  assert ("_regp_n16_" in module) == codegen.one_byte_rows_as_n
  assert ("_ownv" in module) == codegen.widen_own_values


@pytest.mark.parametrize("dtype,num_heads", [(FP8, 16), (FP8, 128), (jnp.bfloat16, 128)],
                         ids=["fp8-16-heads", "fp8-128-heads", "bf16-128-heads"])
def test_mla_kernel_lowers_with_its_trace(monkeypatch, dtype, num_heads):
  # `tools.mla_fp8_parts --trace_dir`: inside `trace.tracing`, the kernel records each warpgroup's regions (two
  # clock reads a region: the scorer's qk, softmax, pv, wait_p_free; the partner's wait_p, pv and, fp8, widen and
  # wait_values; the ring's waits), in the SMEM its config leaves (128 heads: 128 visits a warpgroup, bf16 32).
  from pallas_kv.kernels.mosaic_gpu import trace as mgpu_trace
  fn, args = _kernel_launch(dtype, mla_config.Codegen(), num_heads=num_heads)
  plain = mosaic_text_for_cuda(monkeypatch, fn, *args, host_callbacks=True)
  visits = 256 if num_heads == 16 else 128 if jnp.dtype(dtype).itemsize == 1 else 32
  with mgpu_trace.tracing(mgpu_trace.KernelTrace("unused", visits=visits)):
    traced = mosaic_text_for_cuda(monkeypatch, fn, *args, host_callbacks=True)
  assert "%clock" not in plain
  regions = 9 if jnp.dtype(dtype).itemsize == 1 else 7
  assert traced.count("%clock") >= 2 * regions, traced.count("%clock")


def test_the_parts_tool_traces_only_on_a_gpu(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("this checks the CPU's refusal to trace")
  run = subprocess.run([sys.executable, "-m", "benchmarks", "tools.mla_fp8_parts", f"--trace_dir={tmp_path}"],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True,
                       timeout=300)
  assert run.returncode != 0 and "on a GPU" in run.stderr + run.stdout


@pytest.mark.parametrize("impl", ["bf16", "fp8"])
def test_the_parts_tools_traced_chain_feeds_each_call_the_last_ones_output(impl):
  # `--trace_dir` chains two launches, each call's queries the last one's output: an MLA output has v_dim
  # columns and its queries qk_dim, so a step writes the output over q's first v_dim columns (a chain of the bare
  # launch failed to trace on the GPU: "must share Dqk"). Shapes only, at the 16-head GPU row.
  from benchmarks import mla as mla_bench
  from benchmarks.tools import kernel_trace, mla_fp8_parts
  row = next(r for r in mla_bench.GPU_ROWS if r.name == "h16_b64_t8192")
  pages = row.batch * row.seq_len // mla_bench.PAGE_SIZE
  pool = FP8 if impl == "fp8" else jnp.bfloat16
  args = [jax.ShapeDtypeStruct((row.batch, row.num_queries, row.num_heads, row.qk_dim), jnp.bfloat16),
          jax.ShapeDtypeStruct((pages, mla_bench.PAGE_SIZE, row.qk_dim), pool),
          jax.ShapeDtypeStruct((row.batch, row.seq_len // mla_bench.PAGE_SIZE), jnp.int32),
          jax.ShapeDtypeStruct((row.batch,), jnp.int32)]
  if impl == "fp8":
    args.append(jax.ShapeDtypeStruct((pages, mla_bench.PAGE_SIZE), jnp.float32))
  with pytest.raises(ValueError, match="share Dqk"):
    jax.eval_shape(kernel_trace.chained(mla_fp8_parts.launch(row, impl), 2), *args)
  out = jax.eval_shape(kernel_trace.chained(mla_fp8_parts.chain_step(row, impl), 2), *args)
  assert (out.shape, out.dtype) == (args[0].shape, args[0].dtype)


@pytest.mark.parametrize("dtype", [FP8, jnp.bfloat16], ids=["fp8", "bf16"])
def test_mla_explicit_barriers_lower_with_fewer_warpgroup_barriers(monkeypatch, dtype):
  # Codegen(explicit_barriers=True): no automatic barrier around each SMEM store (P's hand-over, the fp8 widening)
  # in the kernel lowered for CUDA (layout inference included); the shipped schedule's own syncs stay.
  counts = {}
  for name, codegen in (("auto", mla_config.Codegen()), ("explicit", mla_config.Codegen(explicit_barriers=True))):
    fn, args = _kernel_launch(dtype, codegen)
    counts[name] = mosaic_text_for_cuda(monkeypatch, fn, *args).count("bar.sync")
  assert counts["explicit"] <= counts["auto"] // 2, counts


def test_mla_explicit_barriers_refuse_an_experimental_schedule():
  from pallas_kv.experimental import MLAVariantConfig
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  q = jnp.ones((1, 4, SMALL_QK), jnp.bfloat16)
  pages = jnp.ones((4, 64, SMALL_QK), jnp.bfloat16)
  config = MLAVariantConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence",
                            sequence_order="given", alternate_scores=True)
  with pytest.raises(ValueError, match=r"explicit_barriers=True\) syncs the shipped schedule"):
    mgpu_mla.mla_partials(q, pages, jnp.asarray([100], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None],
                          num_queries=1, v_head_dim=SMALL_V, scale=0.1, config=config,
                          plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64),
                          codegen=mla_config.Codegen(explicit_barriers=True), interpret=True)
  assert mla_config.Codegen(explicit_barriers=True).name == "_eb"


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["token", None], ids=["fp8-token", "bf16"])
def test_gpu_mla_explicit_barriers_match_reference_and_rerun_bit_identical(scales):
  # A race between a warp's SMEM stores and another warp's reads would show as a wrong or a varying result.
  from pallas_kv import runtime
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  case = _case(7, batch=8, seq_len=4096, num_heads=128, num_queries=None, page_size=64, scales="token",
               lengths=[4096, 1, 3000, 64, 65, 4000, 2048, 999], qk_dim=QK)
  q, pages, tables, lengths, kv_scale, widened = case
  if scales is None:   # the same values in a bf16 pool
    pages, kv_scale = widened.astype(jnp.bfloat16), None
    widened = pages.astype(jnp.float32)
  rows = q.astype(jnp.float16) if scales else q
  run = jax.jit(lambda rows, pages, lengths, tables, kv_scale: mgpu_mla.mla_partials(
      rows, pages, lengths, tables, num_queries=1, v_head_dim=V, scale=QK ** -0.5, config=_config(1),
      plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64), kv_scale=kv_scale,
      codegen=mla_config.Codegen(explicit_barriers=True))[0])
  first = run(rows, pages, lengths, tables, kv_scale)
  ref = pkv.mla_decode_attention_reference(q.astype(jnp.float32), widened, tables, lengths, v_head_dim=V)
  assert_matches_reference(first[:, 0], ref, jnp.bfloat16)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(run(rows, pages, lengths, tables, kv_scale)), np.asarray(first))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries,page_size,scales", [
    (1, 32768, 128, None, 64, "token"), (16, 4096, 128, 2, 64, 0.05), (64, 4096, 128, None, 32, "token"),
    (8, 8192, 16, 4, 128, "token"), (8, 4096, 128, None, 16, "token"),   # the last: scales gathered by sequence
    (64, 4096, 16, None, 64, "token"), (8, 4096, 16, 2, 16, 0.05)])   # 16 / 32 rows as wgmma's N
def test_gpu_fp8_mla_matches_reference(batch, seq_len, num_heads, num_queries, page_size, scales):
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  rng = np.random.default_rng(batch)
  lengths = rng.integers(1, seq_len + 1, size=batch)
  lengths[0] = seq_len
  case = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=lengths, scales=scales, qk_dim=QK)
  q, pages, tables, lengths, kv_scale, _ = case
  out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True))(
      q, pages, tables, lengths, kv_scale=kv_scale)
  assert pkv.last_impl() == IMPL
  _check(case, out, v_head_dim=V)
