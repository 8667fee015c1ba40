"""One-byte KV caches (int8, float8_e4m3fn, float8_e5m2) on the Mosaic GPU decode kernel, widened by
its consumers: numerics of `decode_partials` in GPU interpret mode against the float32 reference on
the dequantized cache, race detection, the SMEM layout and config choice for one-byte caches, what
the kernel refuses, and CUDA lowering at realistic shapes. The converter warpgroup (an experimental
variant) is tested in test_experimental_mosaic_gpu.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
import sweeps
from harness import assert_lse_matches, assert_matches_reference, lower_for_cuda, paginate
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import frame
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

INT8, E4M3, E5M2 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
SCALE_KINDS = (None, "head", "token")
# A complete config (what decode_partials takes): 64-token tiles through a 2-slot ring, one KV
# group, one split.
BASE = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence", kv_groups=1,
                           pipeline_qk=False, persistent=False, tile_consumers=1, sequence_order="given",
                           queries_as_n=False, values_as_stored=False, paired_terms=False)


def complete(config_type=pkv.MosaicGPUConfig, **fields):
  """BASE with `fields`, as a config_type (an experimental variant config adds its own fields)."""
  return config_type(**(BASE.given() | fields))


# ---------------------------------------------------------------- cases

@dataclasses.dataclass
class QuantCase:
  """A random decode problem over a one-byte cache, dense and (page_size set) paged alike."""
  q: jax.Array                    # [B, S, Hq, D] bf16 / fp16
  k: jax.Array                    # [B, T, Hkv, D] one-byte
  v: jax.Array
  k_scale: jax.Array | None       # None, [Hkv] or [B, T, Hkv] float32
  v_scale: jax.Array | None
  lengths: jax.Array
  page_size: int | None = None
  paged: tuple = ()               # (k_pages, v_pages, block_tables, k_scale, v_scale) when paged

  def dequantized(self, x, scale):
    """x [B, T, Hkv, D] in float32 times its scale, per head or per token."""
    x = x.astype(jnp.float32)
    if scale is None:
      return x
    return x * (scale[None, None, :, None] if scale.ndim == 1 else scale[..., None])

  def reference(self, **options):
    return pkv.decode_attention_reference(self.q.astype(jnp.float32), self.dequantized(self.k, self.k_scale),
                                          self.dequantized(self.v, self.v_scale), self.lengths, return_lse=True,
                                          **options)


def _quantize(x, dtype):
  if dtype == INT8:
    return jnp.asarray(np.clip(np.round(x * 40), -127, 127), dtype)
  return jnp.asarray(x * 8, dtype)   # N(0, 8): fp8 exponents in use, not only the top few


def make_quant_case(seed, *, kv_dtype, k_kind, v_kind, batch=2, seq_len=256, num_heads=8, num_kv_heads=4,
                    head_dim=64, num_queries=1, q_dtype=jnp.bfloat16, page_size=None, lengths=None) -> QuantCase:
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, num_queries, num_heads, head_dim)), q_dtype)
  kv_shape = (batch, seq_len, num_kv_heads, head_dim)
  k, v = (_quantize(rng.standard_normal(kv_shape), jnp.dtype(kv_dtype)) for _ in range(2))

  def scale(kind):
    if kind is None:
      return None
    shape = (num_kv_heads,) if kind == "head" else kv_shape[:3]
    return jnp.asarray(rng.uniform(0.2, 2.0, shape) / (40 if jnp.dtype(kv_dtype) == INT8 else 8), jnp.float32)

  if lengths is None:
    lengths = rng.integers(1, seq_len + 1, batch)
  case = QuantCase(q=q, k=k, v=v, k_scale=scale(k_kind), v_scale=scale(v_kind),
                   lengths=jnp.asarray(lengths, jnp.int32), page_size=page_size)
  if page_size is not None:
    k_pages, tables, perm = paginate(k, page_size, rng)
    v_pages, _, _ = paginate(v, page_size, rng, permutation=perm)
    # Per-token scales go through the same block table as their K and V.
    paged_scale = lambda s: s if s is None or s.ndim == 1 else paginate(s, page_size, rng, permutation=perm)[0]
    case.paged = (k_pages, v_pages, tables, paged_scale(case.k_scale), paged_scale(case.v_scale))
  return case


def run_partials(case: QuantCase, config, *, interpret=None, num_programs=None, **options):
  """decode_partials (the per-sequence plan of a complete config) + merge_splits on a case (paged
  when case.page_size): (out [B, S, Hq, D], lse)."""
  num_queries, num_kv_heads = case.q.shape[1], case.k.shape[2]
  rows = frame.pack_queries(case.q, num_kv_heads)
  if case.page_size is None:
    args, k_scale, v_scale = (rows, case.k, case.v, case.lengths), case.k_scale, case.v_scale
  else:
    k_pages, v_pages, tables, k_scale, v_scale = case.paged
    args = (rows, k_pages, v_pages, case.lengths, tables)
  attention = AttentionOptions(scale=options.get("scale", case.q.shape[-1] ** -0.5),
                               softcap=options.get("softcap"), window=options.get("window"))
  plan = pkv.SplitPlan(kind="per_sequence", num_splits=config.num_splits, block_kv=config.block_kv)
  out, lse = mgpu_decode.decode_partials(*args, num_queries=num_queries, options=attention, config=config, plan=plan,
                                         k_scale=k_scale, v_scale=v_scale, num_programs=num_programs,
                                         interpret=interpret or plgpu.InterpretGPUParams())
  out, lse = frame.merge_splits(out, lse)
  return frame.unpack_rows(out, num_queries), frame.unpack_rows(lse, num_queries)


def check_case(case: QuantCase, config, **kwargs):
  options = {k: kwargs.pop(k) for k in ("scale", "softcap", "window") if k in kwargs}
  out, lse = run_partials(case, config, **kwargs, **options)
  ref, ref_lse = case.reference(**options)
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)
  return out, lse


# ---------------------------------------------------------------- interpret mode (CPU)

# Every dtype, every scale kind of K and of V, dense and both page layouts (one and several copies
# a tile), fp16 q, several new tokens and splits (a split with no tile); per-token scales of 4 kv
# heads (rows of 4 heads' scales) and of one (a flat run). The tests below add the rest (softcap and
# window, eight kv heads, the pipeline options, two row warpgroups). Few programs (B x Hkv x
# splits) and tiles: the CPU simulates each program's warpgroups.
@pytest.mark.parametrize("seed,kv_dtype,k_kind,v_kind,page_size,num_queries,num_splits,num_kv_heads,q_dtype", [
    (11, INT8, "head", "token", 16, 3, 2, 4, jnp.float16),
    (13, E4M3, "token", None, 64, 1, 3, 1, jnp.bfloat16),
    (14, E5M2, None, None, None, 2, 2, 1, jnp.bfloat16),
    pytest.param(15, E5M2, "token", "head", 64, 1, 2, 4, jnp.float16, marks=pytest.mark.slow),   # the first, mirrored
], ids=["int8-head+token-page16-s3-fp16", "e4m3-token+none-hkv1-page64-splits3", "e5m2-unscaled-dense-s2",
        "e5m2-token+head-page64-fp16"])
def test_quantized_matches_reference_interpret(seed, kv_dtype, k_kind, v_kind, page_size, num_queries,
                                               num_splits, num_kv_heads, q_dtype):
  # A ragged length (3 tiles of 64, the last masked) and an empty sequence.
  case = make_quant_case(seed, kv_dtype=kv_dtype, k_kind=k_kind, v_kind=v_kind, batch=2, seq_len=192,
                         num_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads, num_queries=num_queries,
                         q_dtype=q_dtype, page_size=page_size, lengths=[150, 0])
  out, lse = check_case(case, complete(num_splits=num_splits))
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)   # length 0: zeros, -inf
  assert np.isneginf(np.asarray(lse[1])).all()


def test_quantized_softcap_and_window_interpret():
  # The window starts the visible range past the first tile of the long sequence.
  case = make_quant_case(3, kv_dtype=E4M3, k_kind="token", v_kind="token", batch=2, num_heads=4, num_kv_heads=1,
                         num_queries=2, lengths=[256, 150])
  check_case(case, complete(num_stages=3, num_splits=2), softcap=1.5, window=70, scale=0.2)


def test_quantized_single_kv_head_per_token_scales_interpret():
  # One kv head: its per-token scales are contiguous and copied as flat runs (a page's 32 scales, 128 bytes, a
  # copy), not 4-head rows.
  case = make_quant_case(4, kv_dtype=INT8, k_kind="token", v_kind="token", batch=2, num_heads=4, num_kv_heads=1,
                         page_size=32, lengths=[256, 77])
  check_case(case, complete(num_splits=2))


# Per-token scales of 2 or 3 kv heads: a token's group of scales is under one 16-byte TMA row, so the call lays
# them out by head ([B, Hkv, T]) and each tile's scales of a head are one run; over pages of 16 (a run of 64
# bytes, under TMA's 128) it pads the heads to 4-head rows instead. Each consumer that reads them: the widening
# kernel (rows), the queries as N (S^T's rows), fp8 operands (S's columns); dense and over pages of 32 (a page's
# run a copy) and 16. All but the first read V stored tokens last; groups of 2 and 3.
@pytest.mark.parametrize("kv_dtype,num_kv_heads,page_size,fields", [
    (INT8, 2, None, {}),
    (E4M3, 3, 32, dict(queries_as_n=True)),
    (INT8, 2, 32, dict(queries_as_n=True, block_kv=128)),
    (E4M3, 2, None, dict(num_splits=2)),
    (E4M3, 3, 16, dict(queries_as_n=True, block_kv=128)),
], ids=["int8-hkv2-dense-widening", "e4m3-hkv3-page32-queries-as-n", "int8-hkv2-page32-queries-as-n-bkv128",
        "e4m3-hkv2-dense-fp8-operands", "e4m3-hkv3-page16-queries-as-n-padded"])
def test_per_token_scales_of_kv_heads_not_a_multiple_of_4_interpret(kv_dtype, num_kv_heads, page_size, fields):
  # Groups of 3 over 3 kv heads (SmolLM2-135M): 3 rows of Q factors a head, padded to 16 bytes.
  num_queries = 1 if num_kv_heads == 3 else 2
  case = make_quant_case(21, kv_dtype=kv_dtype, k_kind="token", v_kind="token", batch=2, num_heads=3 * num_kv_heads,
                         num_kv_heads=num_kv_heads, num_queries=num_queries, page_size=page_size, lengths=[256, 99])
  config = complete(**fields)
  v_tokens_last = kv_dtype == E4M3 or config.queries_as_n
  smem = mgpu_config.DecodeSmem.for_call(config, rows=3 * num_queries, head_dim=64, dtype=kv_dtype,
                                         page_size=page_size, k_scale_kind="token", v_scale_kind="token",
                                         num_kv_heads=num_kv_heads, v_tokens_last=v_tokens_last)
  by_head = page_size != 16
  assert smem.scales_by_head == by_head
  assert smem.scale_ring_spec("k").block_shape == ((config.block_kv,) if by_head else (config.block_kv, 4))
  rows = frame.pack_queries(case.q, num_kv_heads)
  if page_size is None:
    args, k_scale, v_scale = (rows, case.k, case.v, case.lengths), case.k_scale, case.v_scale
  else:
    k_pages, v_pages, tables, k_scale, v_scale = case.paged
    args = (rows, k_pages, v_pages, case.lengths, tables)
  if v_tokens_last:   # [B, T, Hkv, D] / [P, page_size, Hkv, D] -> tokens last
    args = args[:2] + (jnp.transpose(args[2], (0, 2, 3, 1)),) + args[3:]
  plan = pkv.SplitPlan(kind="per_sequence", num_splits=config.num_splits, block_kv=config.block_kv)
  out, lse = mgpu_decode.decode_partials(*args, num_queries=num_queries, options=AttentionOptions(scale=0.125),
                                         config=config, plan=plan, k_scale=k_scale, v_scale=v_scale,
                                         v_tokens_last=v_tokens_last, interpret=plgpu.InterpretGPUParams())
  out, lse = frame.merge_splits(out, lse)
  ref, ref_lse = case.reference(scale=0.125)
  assert_matches_reference(frame.unpack_rows(out, num_queries), ref, case.q.dtype)
  assert_lse_matches(frame.unpack_rows(lse, num_queries), ref_lse, case.q.dtype)


def test_per_token_scales_of_one_kv_head_on_pages_of_16_are_padded_to_group_rows_interpret():
  # TMA writes SMEM from 128-byte boundaries: a page's run of 16 single scales (64 bytes) would land misaligned,
  # so the call pads the one head to a 4-head row (16 bytes a token), which pages of 8 take.
  case = make_quant_case(9, kv_dtype=INT8, k_kind="token", v_kind="token", batch=1, seq_len=128, num_heads=4,
                         num_kv_heads=1, page_size=16, lengths=[100])
  check_case(case, complete())
  assert tiling.token_scale_width(1, 16) == 4 and tiling.token_scale_width(1, 32) == 1
  assert tiling.token_scale_reason(16, 1) and not tiling.token_scale_reason(8, 4)
  with pytest.raises(ValueError, match="run of 16 tokens a copy, under TMA's 128-byte SMEM alignment"):
    mgpu_config.DecodeSmem(head_dim=64, dtype=INT8, block_kv=64, num_stages=2, copies_per_tile=4,
                           token_scales=("k",), scale_width=1)
  assert not tiling.token_scale_reason(8, tiling.SCALE_ROW) and not tiling.token_scale_reason(None, 1)


def test_quantized_eight_kv_heads_pick_their_scale_group_interpret():
  # Hkv = 8: two 4-head scale groups, through pages of 16; every head must pick its own column of
  # its own group.
  case = make_quant_case(5, kv_dtype=INT8, k_kind="token", v_kind="token", batch=1, seq_len=128, num_heads=8,
                         num_kv_heads=8, page_size=16, lengths=[128])
  check_case(case, complete())


@pytest.mark.parametrize("page_size,fields,num_programs", [
    (None, dict(pipeline_qk=True, num_splits=2), None),
    (32, dict(pipeline_qk=True, persistent=True, num_splits=2), 3),
    (None, dict(kv_groups=2, num_splits=2), None),
    (None, dict(kv_groups=3, num_stages=3, num_splits=3), None),
    (32, dict(tile_consumers=2, num_stages=4, pipeline_qk=True, persistent=True, num_splits=2), 3),
], ids=["pqk", "pqk-persistent3-page32", "kv_groups2", "kv_groups3", "tile_consumers2-pqk-persistent3-page32"])
def test_quantized_pipeline_options_interpret(page_size, fields, num_programs):
  case = make_quant_case(6, kv_dtype=E4M3, k_kind="token", v_kind="head", batch=2, num_heads=4, num_kv_heads=1,
                         page_size=page_size, lengths=[201, 0])
  check_case(case, complete(**fields), num_programs=num_programs)


def test_quantized_two_row_warpgroups_interpret():
  # 5 new tokens x 16 q heads = 80 packed rows: two consumer warpgroups dequantize the same slots.
  case = make_quant_case(7, kv_dtype=INT8, k_kind="token", v_kind="token", batch=1, seq_len=192, num_heads=16,
                         num_kv_heads=1, num_queries=5, page_size=64, lengths=[180])
  check_case(case, complete())


@pytest.mark.parametrize("fields", [dict(), dict(pipeline_qk=True, persistent=True)],
                         ids=["plain", "pqk-persistent"])
def test_quantized_race_detection_finds_none(fields):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  # 5 tiles through a 2-slot ring: K, V and scale slots refilled after register reads, and the
  # dequantized tiles rewritten after wgmma read them.
  case = make_quant_case(8, kv_dtype=INT8, k_kind="token", v_kind="token", batch=1, seq_len=320, num_heads=4,
                         num_kv_heads=1, page_size=32, lengths=[300])
  out, _ = run_partials(case, complete(**fields), num_programs=1,
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found


# ---------------------------------------------------------------- what the kernel refuses

def _problem(num_kv_heads, *, head_dim=128, group=4, num_queries=1, page_size=None):
  heads = (num_kv_heads * group, num_kv_heads)
  _, problem = sweeps.problem_args(heads, (4, 4096), page_size)
  return dataclasses.replace(problem, head_dim=head_dim, num_queries=num_queries)


def test_quantized_reason():
  reason = mgpu_config.quantized_reason
  for dtype in (INT8, E4M3, E5M2):
    for k_kind in SCALE_KINDS:
      for v_kind in SCALE_KINDS:
        for hkv in (1, 4, 8):
          assert reason(dtype, k_kind, v_kind, _problem(hkv)) is None, (dtype, k_kind, v_kind, hkv)
  for page_size in (None, 16, 32):   # laid out by head or padded to 4-head rows before the call
    assert reason(INT8, "token", None, _problem(2, page_size=page_size)) is None
  assert reason(INT8, "head", "head", _problem(2)) is None
  assert "not a one-byte type" in reason(jnp.bfloat16, "head", None, _problem(8))
  assert reason(INT8, None, None, _problem(8, head_dim=256, group=16, num_queries=8)) is None


def test_decode_partials_refuses_what_it_cannot_serve():
  q = jnp.zeros((1, 2, 4, 64), jnp.bfloat16)
  lengths = jnp.array([128], jnp.int32)
  call = functools.partial(mgpu_decode.decode_partials, num_queries=1, options=AttentionOptions(scale=0.1),
                           config=BASE, plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64))
  kv8 = jnp.zeros((1, 128, 2, 64), jnp.int8)
  kv16 = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="need a one-byte cache"):
    call(q, kv16, kv16, lengths, v_scale=jnp.ones((2,), jnp.float32))
  with pytest.raises(ValueError, match="k_scale must be float32"):
    call(q, kv8, kv8, lengths, k_scale=jnp.ones((2,), jnp.bfloat16))
  with pytest.raises(ValueError, match="SMEM"):   # the fit counts the one-byte rings and dequantized tiles
    call(jnp.zeros((1, 2, 128, 256), jnp.bfloat16), jnp.zeros((1, 128, 2, 256), jnp.int8),
         jnp.zeros((1, 128, 2, 256), jnp.int8), lengths, config=complete(num_stages=8))


# ---------------------------------------------------------------- SMEM layout and config choice

def test_smem_of_a_one_byte_cache_counts_every_buffer():
  config = complete(num_stages=8)
  smem = mgpu_config.DecodeSmem.for_call(config, rows=4, head_dim=128, dtype=INT8, page_size=None,
                                         k_scale_kind="token", v_scale_kind="head", num_kv_heads=8)
  align = pipeline.align_up
  rings = 2 * align(8 * 64 * 128)                                  # K and V rings, one byte
  scale_ring = align(8 * 64 * 4 * 4)                               # K's per-token scales, 4-head rows
  dequantized = align(64 * 128 * 2)                                # K and V take turns in one bf16 tile
  staging = align(64 * 128 * 4) + 64 * 4                           # out and lse, aliasing the above
  q = 64 * 128 * 2
  barriers = 3 * 2 * 8 * pipeline.BARRIER_BYTES + 2 * pipeline.BARRIER_BYTES
  reduction = align(plgpu.CompilerParams().reduction_scratch_bytes)
  assert smem.nbytes == align(q) + align(max(rings + scale_ring + dequantized, staging)) + reduction + barriers
  assert smem.fits
  # Q K^T of the next tile in flight during P V: K and V each get a dequantized tile.
  pqk = mgpu_config.DecodeSmem.for_call(dataclasses.replace(config, pipeline_qk=True), rows=4, head_dim=128,
                                        dtype=INT8, page_size=None, k_scale_kind="token", v_scale_kind="head",
                                        num_kv_heads=8)
  assert pqk.nbytes == smem.nbytes + dequantized
  # The rings hold the tiles as stored: half the bytes of bf16 at the same depth.
  bf16 = mgpu_config.DecodeSmem.for_call(config, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=None)
  assert 2 * smem.ring_spec().buffer_bytes == bf16.ring_spec().buffer_bytes


@pytest.mark.parametrize("rows,head_dim", [(4, 128), (128, 128), (16, 256), (4, 64), (128, 256)])
@pytest.mark.parametrize("page_size", [None, 16])
def test_heuristic_config_for_one_byte_caches(rows, head_dim, page_size):
  # Twice the stages of a 16-bit cache where they fit, and two consumers where the rows fit one
  # warpgroup and each consumer keeps two slots.
  problem = _problem(8, head_dim=head_dim, group=rows if rows <= 16 else 16,
                     num_queries=1 if rows <= 16 else rows // 16, page_size=page_size)
  config = mgpu_config.heuristic_config(problem, dtype=INT8)
  fits = lambda c: mgpu_config.fits_smem(c, rows=rows, head_dim=head_dim, dtype=INT8, page_size=page_size,
                                         k_scale_kind="token", v_scale_kind="token", num_kv_heads=8)
  assert fits(config)
  assert config.num_stages >= mgpu_config.heuristic_config(problem, dtype=jnp.bfloat16).num_stages
  if config.kv_groups == 2:
    assert rows <= 64 and config.num_stages % 2 == 0 and config.num_stages >= 4
  else:
    assert rows > 64 or not fits(dataclasses.replace(config, kv_groups=2, num_stages=4))
  if config.num_stages < 2 * mgpu_config.DEFAULT.num_stages:   # else twice the default: as deep as it goes
    assert not fits(dataclasses.replace(config, num_stages=config.num_stages + config.kv_groups))
  mgpu_config.check_config(dataclasses.replace(config, num_splits=2), rows=rows, head_dim=head_dim, dtype=INT8,
                           page_size=page_size, num_splits=2, k_scale_kind="token", v_scale_kind="token",
                           num_kv_heads=8)


def test_partial_configs_are_filled_around_their_fields():
  # The backend fills a partial config's None fields around what it fixes: one KV group where a
  # fixed field rules two out (a persistent grid, an odd split or stage count), and a ring that
  # fits with the fixed fields (a larger tile than the heuristic's).
  _, problem = sweeps.problem_args((32, 8), (32, 4096), None)
  resolve = functools.partial(mgpu_config.resolve_config, problem, num_sms=132)
  assert resolve(None, dtype=INT8).kv_groups == 2
  assert resolve(pkv.MosaicGPUConfig(pipeline_qk=True), dtype=INT8).kv_groups == 2
  for fields in (dict(persistent=True), dict(num_splits=3), dict(num_stages=5)):
    config = resolve(pkv.MosaicGPUConfig(**fields), dtype=INT8)
    assert config.kv_groups == 1 and config.given() | fields == config.given(), fields
  assert resolve(pkv.MosaicGPUConfig(kv_groups=2, num_stages=6), dtype=INT8).num_stages == 6
  assert resolve(pkv.MosaicGPUConfig(num_stages=2), dtype=INT8).kv_groups == 2   # a given even depth: shared out
  # Two tile consumers need an even ring: the depth that fits is found in steps of two (128-token bf16 tiles fit
  # three stages, which they cannot take; two).
  config = resolve(pkv.MosaicGPUConfig(tile_consumers=2, block_kv=128), dtype=jnp.bfloat16)
  assert (config.kv_groups, config.num_stages) == (1, 2)
  mgpu_config.check_config(config, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=None,
                           num_splits=config.num_splits)
  for dtype, block_kv, stages in ((INT8, 256, 2), (jnp.bfloat16, 128, 3)):
    config = resolve(pkv.MosaicGPUConfig(block_kv=block_kv), dtype=dtype)
    assert config.num_stages == stages
    mgpu_config.check_config(config, rows=4, head_dim=128, dtype=dtype, page_size=None, num_splits=config.num_splits,
                             **(dict(k_scale_kind="token", v_scale_kind="token", num_kv_heads=8)
                                if dtype == INT8 else {}))


# ---------------------------------------------------------------- CUDA lowering (CPU)

def lowering_args(kv_dtype, k_kind, v_kind, page_size, *, batch=32, seq_len=4096, heads=(32, 8), head_dim=128,
                  num_queries=1, v_tokens_last=False):
  """ShapeDtypeStructs (q rows [B, Hkv, R, D], k, v, lengths, tables, k_scale, v_scale) of a realistic shape (v
  [lead, Hkv, D, tokens] with v_tokens_last)."""
  hq, hkv = heads
  lead = (batch, seq_len) if page_size is None else (batch * seq_len // page_size, page_size)
  kv = jax.ShapeDtypeStruct((*lead, hkv, head_dim), kv_dtype)
  scale = lambda kind: None if kind is None else jax.ShapeDtypeStruct((hkv,) if kind == "head" else (*lead, hkv),
                                                                       jnp.float32)
  tables = None if page_size is None else jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)
  rows = jax.ShapeDtypeStruct((batch, hkv, num_queries * hq // hkv, head_dim), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((lead[0], hkv, head_dim, lead[1]), kv_dtype) if v_tokens_last else kv
  return rows, kv, v, jax.ShapeDtypeStruct((batch,), jnp.int32), tables, scale(k_kind), scale(v_kind)


def lower(monkeypatch, config, args, *, num_queries=1):
  """Lowers decode_partials (the per-sequence plan of a complete config) for CUDA on `args`
  (`lowering_args`), and checks that the SMEM the fit checks count (`DecodeSmem.nbytes`) is what
  Mosaic GPU lays out. Returns the module."""
  from jax.experimental.mosaic.gpu import core as mgpu_core   # the allocation size has no public accessor
  allocated, tree_size = [], mgpu_core._smem_tree_size

  def recording_tree_size(tree):
    allocated.append(tree_size(tree))
    return allocated[-1]

  monkeypatch.setattr(mgpu_core, "_smem_tree_size", recording_tree_size)
  q, k, v, lengths, tables, k_scale, v_scale = args
  v_tokens_last = v.shape != k.shape
  given = [x for x in (tables, k_scale, v_scale) if x is not None]
  plan = pkv.SplitPlan(kind="per_sequence", num_splits=config.num_splits, block_kv=config.block_kv)

  def partials(q, k, v, lengths, *rest):
    rest = iter(rest)
    pick = lambda x: None if x is None else next(rest)
    return mgpu_decode.decode_partials(q, k, v, lengths, pick(tables), num_queries=num_queries,
                                       options=AttentionOptions(scale=0.1), config=config, plan=plan,
                                       k_scale=pick(k_scale), v_scale=pick(v_scale), v_tokens_last=v_tokens_last)

  module = lower_for_cuda(partials, q, k, v, lengths, *given).mlir_module()
  assert "custom_call @mosaic_gpu" in module
  assert jnp.dtype(k.dtype).itemsize > 1 or jnp.dtype(k.dtype).name in module   # the one-byte kernel's name
  smem = mgpu_config.DecodeSmem.for_call(
      config, rows=q.shape[2], head_dim=q.shape[3], dtype=k.dtype, page_size=None if tables is None else k.shape[1],
      q_dtype=q.dtype, k_scale_kind=frame.scale_kind(k_scale, k.shape), v_scale_kind=frame.scale_kind(v_scale, k.shape),
      num_kv_heads=k.shape[2], v_tokens_last=v_tokens_last)
  assert allocated and max(allocated) == smem.nbytes
  return module


# Per-token scales in every layout (dense, one and several copies a tile), per-head and no scales
# once each (they do not depend on the layout); every dtype (it changes only the tile's conversion).
HEURISTIC_LOWERINGS = [(INT8, None, "token"), (E4M3, 16, "token"), (E5M2, 64, "token"), (E5M2, None, "head"),
                       (E4M3, 16, None)]


@pytest.mark.parametrize("kv_dtype,page_size,scale_kind", HEURISTIC_LOWERINGS,
                         ids=[f"{d.name}-page{p}-{k}" for d, p, k in HEURISTIC_LOWERINGS])
def test_heuristic_configs_lower_for_cuda(monkeypatch, kv_dtype, page_size, scale_kind):
  # B=32 T=4096 heads 32/8 D=128: the heuristic's config for a one-byte cache (two KV groups), each scale kind.
  _, problem = sweeps.problem_args((32, 8), (32, 4096), page_size)
  config = mgpu_config.resolve_config(problem, None, dtype=kv_dtype, num_sms=132)
  assert (config.num_stages, config.kv_groups) == (2 * mgpu_config.DEFAULT.num_stages, 2)
  lower(monkeypatch, config, lowering_args(kv_dtype, scale_kind, scale_kind, page_size))


@pytest.mark.parametrize("kv_dtype,page_size,heads,head_dim", [
    (E4M3, None, (9, 3), 64), (INT8, 64, (9, 3), 64), (INT8, 16, (9, 3), 64), (E4M3, 16, (28, 4), 128)],
    ids=["e4m3-heads9-3-d64", "int8-page64-heads9-3-d64", "int8-page16-heads9-3-d64", "e4m3-page16-heads28-4"])
def test_default_configs_of_odd_groups_lower_for_cuda(monkeypatch, kv_dtype, page_size, heads, head_dim):
  # The default cache (V tokens last, per-token scales) at SmolLM2-135M's heads (3 kv heads: scales laid out by
  # head, or padded to 4-head rows over pages of 16; groups of 3) and Qwen2.5-7B's (groups of 7): Q's row factors
  # padded to 16-byte rows.
  _, problem = sweeps.problem_args(heads, (8, 4096), page_size)
  problem = dataclasses.replace(problem, head_dim=head_dim, v_tokens_last=True)
  config = mgpu_config.resolve_config(problem, None, dtype=kv_dtype, num_sms=132)
  module = lower(monkeypatch, config, lowering_args(kv_dtype, "token", "token", page_size, batch=8, heads=heads,
                                                    head_dim=head_dim, v_tokens_last=True))
  assert "_vlast" in module


@pytest.mark.parametrize("fields,page_size,heads,head_dim,num_queries", [
    (dict(pipeline_qk=True), None, (32, 8), 128, None),
    (dict(pipeline_qk=True, persistent=True, num_stages=6), 16, (32, 8), 128, None),
    (dict(block_kv=128, num_stages=4), None, (32, 8), 128, None),
    (dict(), 32, (8, 1), 128, None),
    (dict(), None, (32, 8), 64, None),
    (dict(), 64, (32, 8), 256, None),
    (dict(), 32, (16, 1), 128, 5),
    (dict(), 32, (12, 2), 128, None),   # per-token scales laid out by head
    (dict(), None, (9, 3), 64, None),
], ids=["pqk", "pqk-persistent-page16", "bkv128", "hkv1-page32", "d64", "d256-page64-one-group",
        "two-row-warpgroups-page32", "hkv2-page32", "hkv3-d64"])
def test_options_and_shapes_lower_for_cuda(monkeypatch, fields, page_size, heads, head_dim, num_queries):
  # K per token, V per head, int8; partial configs filled by the backend (resolve_config).
  _, problem = sweeps.problem_args(heads, (32, 4096), page_size)
  problem = dataclasses.replace(problem, head_dim=head_dim, num_queries=num_queries or 1)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(**fields), dtype=INT8, num_sms=132)
  lower(monkeypatch, config, lowering_args(INT8, "token", "head", page_size, heads=heads, head_dim=head_dim,
                                           num_queries=num_queries or 1), num_queries=num_queries or 1)
