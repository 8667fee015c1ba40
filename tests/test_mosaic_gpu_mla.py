"""The Mosaic GPU MLA kernel (kernels/mosaic_gpu/mla.py): numerics in GPU interpret mode on small
latent dims (Dqk 192 / Dv 128 keep the CPU simulation quick; the kernel is the same code at
576 / 512), garbage past lengths and in unnamed pages, race detection, what it refuses, CUDA
lowering of the shipped configs at the benchmark shapes, and real shapes on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import assert_lse_matches, assert_matches_reference, lower_for_cuda, paginate
from pallas_kv import validation
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
from pallas_kv.kernels.mosaic_gpu import mla_config

IMPL = "mosaic_gpu"
SMALL_QK, SMALL_V = 192, 128      # 128 latent + 64 rope
QK, V = 576, 512                  # DeepSeek-V3


def _case(seed, *, batch, seq_len, num_heads, num_queries, page_size, lengths, qk_dim=SMALL_QK,
          dtype=jnp.bfloat16):
  """(q [B, (S,) Hq, Dqk], kv_pages [P, page_size, Dqk] shuffled, block_tables, lengths)."""
  rng = np.random.default_rng(seed)
  shape = (batch, num_heads, qk_dim) if num_queries is None else (batch, num_queries, num_heads, qk_dim)
  q = jnp.asarray(rng.standard_normal(shape), dtype)
  kv = jnp.asarray(rng.standard_normal((batch, seq_len, qk_dim)), dtype)
  pages, tables, _ = paginate(kv, page_size, rng)
  return q, pages, tables, jnp.asarray(lengths, jnp.int32)


def _poisoned(pages, tables, lengths, page_size):
  """NaN in every slot past each length (own pages), in every page no used entry names, and -1
  in table entries past each sequence's last page."""
  pages, tables = np.asarray(pages, np.float32).copy(), np.asarray(tables).copy()
  live = set()
  for b, length in enumerate(np.asarray(lengths)):
    used = -(-int(length) // page_size)
    live.update(tables[b, :used].tolist())
    for j in range(used):
      pages[tables[b, j], np.arange(j * page_size, (j + 1) * page_size) >= length] = np.nan
    tables[b, used:] = -1
  for page in set(range(pages.shape[0])) - live:
    pages[page] = np.nan
  return pages, jnp.asarray(tables, jnp.int32)


def _check(args, out_lse, *, v_head_dim=SMALL_V, scale=None, clean_pages=None, clean_tables=None):
  q, pages, tables, lengths = args
  pages = pages if clean_pages is None else clean_pages
  tables = tables if clean_tables is None else clean_tables
  out, lse = out_lse
  ref, ref_lse = pkv.mla_decode_attention_reference(q.astype(jnp.float32), pages.astype(jnp.float32), tables,
                                                    lengths, v_head_dim=v_head_dim, scale=scale, return_lse=True)
  assert out.dtype == q.dtype
  assert_matches_reference(out, ref, q.dtype)
  assert_lse_matches(lse, ref_lse, q.dtype)


# The consumers' schedules: plain (a scorer and a P V partner), pipeline_qk (with the 32-token
# tiles and four stages it needs), split_scores, rows_as_n (transposed tiles: the q rows are
# wgmma's N), alternate_scores (the consumers score alternate tiles) and ring_halves (the plain
# schedule on slots loaded and freed in two column parts).
VARIANTS = {"plain": {}, "pipeline_qk": dict(pipeline_qk=True, block_kv=32, num_stages=4),
            "split_scores": dict(split_scores=True), "rows_as_n": dict(rows_as_n=True),
            "alternate_scores": dict(alternate_scores=True), "ring_halves": dict(ring_halves=True),
            "alternate_halves": dict(alternate_scores=True, ring_halves=True),
            "p_in_registers": dict(p_in_registers=True)}


def _config(num_splits, num_stages=2, variant="plain"):
  return pkv.DecodeConfig(**(dict(block_kv=64, num_stages=num_stages, num_splits=num_splits) | VARIANTS[variant]))


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("page_size,num_queries,num_heads,num_splits,dtype,variant", [
    (16, 2, 4, 2, jnp.bfloat16, "plain"),
    (64, None, 8, 1, jnp.bfloat16, "plain"),
    (32, 4, 4, 3, jnp.bfloat16, "plain"),
    (128, 3, 24, 2, jnp.float16, "plain"),
    (16, 1, 24, 1, jnp.bfloat16, "pipeline_qk"),
    (16, 2, 4, 2, jnp.bfloat16, "split_scores"),
    (128, 3, 24, 1, jnp.float16, "split_scores"),
    (16, 2, 4, 2, jnp.bfloat16, "rows_as_n"),
    (64, 4, 16, 3, jnp.float16, "rows_as_n"),
    (16, 2, 4, 3, jnp.bfloat16, "alternate_scores"),
    (128, 3, 24, 1, jnp.float16, "alternate_scores"),
    (16, 2, 4, 3, jnp.bfloat16, "ring_halves"),
    (128, 3, 24, 2, jnp.float16, "ring_halves"),
    (32, 3, 24, 2, jnp.bfloat16, "alternate_halves"),
], ids=["page16-s2-splits2", "page64-s1-splits1", "page32-s4-splits3", "page128-s3-rowblocks2-splits2-fp16",
        "page16-pipeline_qk-splits1", "page16-s2-split_scores-splits2", "page128-s3-rowblocks2-split_scores-fp16",
        "page16-s2-rows_as_n-splits2", "page64-s4-h16-rows_as_n-splits3-fp16", "page16-s2-alternate-splits3",
        "page128-s3-rowblocks2-alternate-fp16", "page16-s2-ring_halves-splits3",
        "page128-s3-rowblocks2-ring_halves-splits2-fp16", "page32-s3-rowblocks2-alternate_halves-splits2"])
def test_mla_interpret(interpret_mode, page_size, num_queries, num_heads, num_splits, dtype, variant):
  # Ragged lengths (not multiples of a tile), one of zero, shuffled pages; 3 x 24 heads = 72 rows
  # take two row blocks.
  args = _case(page_size + num_heads, batch=3, seq_len=256, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=[219, 0, 70], dtype=dtype)
  out = pkv.mla_decode_attention(*args, v_head_dim=SMALL_V, scale=0.11, return_lse=True, impl=IMPL,
                                 config=_config(num_splits, variant=variant))
  _check(args, out, scale=0.11)


@pytest.mark.parametrize("page_size,variant", [(16, "plain"), (64, "pipeline_qk"), (32, "split_scores"),
                                               (16, "rows_as_n"), (64, "alternate_scores"),
                                               (32, "ring_halves")])
def test_mla_garbage_past_lengths_and_in_unnamed_pages_never_reaches_an_output(interpret_mode, page_size,
                                                                               variant):
  q, pages, tables, lengths = _case(3, batch=3, seq_len=256, num_heads=4, num_queries=2, page_size=page_size,
                                    lengths=[200, 37, 0])
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, page_size)
  out = pkv.mla_decode_attention(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths, v_head_dim=SMALL_V,
                                 return_lse=True, impl=IMPL, config=_config(2, variant=variant))
  _check((q, pages, tables, lengths), out)


def test_mla_zero_lengths_give_zeros_and_no_keys(interpret_mode):
  args = _case(4, batch=2, seq_len=128, num_heads=4, num_queries=None, page_size=64, lengths=[0, 0])
  out, lse = pkv.mla_decode_attention(*args, v_head_dim=SMALL_V, return_lse=True, impl=IMPL, config=_config(2))
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.isneginf(np.asarray(lse)).all()


def test_mla_balanced_plan_gives_a_long_sequence_more_splits_and_matches_reference(interpret_mode):
  # The balanced plan (split_plan="balanced"): one tile count per split from the lengths, so at
  # one tile per split the 256-token sequence takes 4 splits and the 64-token one a single split
  # (its other splits empty, lse -inf); zero and tile-crossing lengths as well. Unbalanced, every
  # sequence would be cut in num_splits equal shares.
  from jax.experimental.pallas import mosaic_gpu as plgpu
  args = _case(8, batch=4, seq_len=256, num_heads=4, num_queries=2, page_size=16, lengths=[256, 64, 0, 130])
  config = pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=4, split_plan="balanced")
  q, pages, tables, lengths = args
  rows = q.reshape(4, 2 * 4, SMALL_QK)
  partials = functools.partial(mgpu_mla.mla_partials, rows, pages, lengths, tables, num_queries=2,
                               v_head_dim=SMALL_V, scale=0.1, config=config, interpret=plgpu.InterpretGPUParams())
  _, lse = partials(tiles_per_split=jnp.asarray([1], jnp.int32))
  assert np.isfinite(np.asarray(lse)).any(axis=2).sum(axis=1).tolist() == [4, 1, 0, 3]   # splits with keys
  with pytest.raises(ValueError, match="tiles_per_split must be given exactly when"):
    partials()
  # Through the op: the plan comes from the lengths (split_k.split_plan).
  out = pkv.mla_decode_attention(*args, v_head_dim=SMALL_V, return_lse=True, impl=IMPL, config=config)
  _check(args, out)


def test_mla_sequence_order_gives_the_bits_of_batch_order(interpret_mode):
  # Programs take the sequences longest first (or long, short, ...): zero, tile-crossing and
  # page-crossing lengths, 2 splits, and the balanced plan; only the schedule changes, so every
  # output and lse is the bits of batch order. The kernel is told the order exactly when the
  # config asks for one.
  from jax.experimental.pallas import mosaic_gpu as plgpu
  args = _case(9, batch=4, seq_len=256, num_heads=4, num_queries=None, page_size=32, lengths=[64, 0, 256, 130])
  op = functools.partial(pkv.mla_decode_attention, *args, v_head_dim=SMALL_V, return_lse=True, impl=IMPL)
  for fields, order in ((dict(num_splits=2), "longest_first"),
                        (dict(num_splits=4, split_plan="balanced"), "long_short")):
    given = op(config=pkv.DecodeConfig(block_kv=64, num_stages=2, **fields))
    _check(args, given)
    ordered = op(config=pkv.DecodeConfig(block_kv=64, num_stages=2, sequence_order=order, **fields))
    for a, b in zip(given, ordered):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  q, pages, tables, lengths = args
  partials = functools.partial(mgpu_mla.mla_partials, q, pages, lengths, tables, num_queries=1, v_head_dim=SMALL_V,
                               scale=0.1, interpret=plgpu.InterpretGPUParams())
  with pytest.raises(ValueError, match="sequence_order must be given exactly when"):
    partials(config=pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=1, sequence_order="longest_first"))
  with pytest.raises(ValueError, match=r"sequence_order must be int32 \[B\]=\[4\]"):
    partials(config=pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=1, sequence_order="longest_first"),
             sequence_order=jnp.arange(3, dtype=jnp.int32))


@pytest.mark.parametrize("variant,codegen", [(v, {}) for v in VARIANTS] + [
    (v, dict(q_per_tile=False)) for v in ("plain", "alternate_scores", "rows_as_n")] + [
    ("alternate_scores", dict(slots_per_tile=True))])
def test_mla_race_detection_finds_none(variant, codegen):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  # 5 tiles through a 2-slot ring, pages of 16 (4 copies per tile), a masked last tile (an odd
  # count: the alternate scorers' last tile has no partner, after two pairs).
  args = _case(5, batch=1, seq_len=384, num_heads=4, num_queries=1, page_size=16, lengths=[300])
  q, pages, tables, lengths = args
  rows = q.reshape(1, 4, SMALL_QK)
  out, lse = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=1, v_head_dim=SMALL_V, scale=0.1,
                                   config=_config(1, variant=variant), codegen=mla_config.Codegen(**codegen),
                                   interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found
  # Q (and the alternate scorers' slots) read at a zero loaded from SMEM or not: the reference's results.
  ref = pkv.mla_decode_attention_reference(q.astype(jnp.float32), pages.astype(jnp.float32), tables, lengths,
                                           v_head_dim=SMALL_V, scale=0.1)
  assert_matches_reference(out[:, 0].reshape(ref.shape), ref, q.dtype)


def test_mla_split_partials_are_stored_in_the_cache_dtype():
  # Split partials in bf16 halve what the splits write and the merge reads; the merged output
  # still matches the reference (test_mla_interpret).
  from jax.experimental.pallas import mosaic_gpu as plgpu
  q, pages, tables, lengths = _case(6, batch=1, seq_len=256, num_heads=4, num_queries=1, page_size=64,
                                    lengths=[200])
  out, lse = mgpu_mla.mla_partials(q.reshape(1, 4, SMALL_QK), pages, lengths, tables, num_queries=1,
                                   v_head_dim=SMALL_V, scale=0.1, config=_config(2),
                                   interpret=plgpu.InterpretGPUParams())
  assert out.dtype == jnp.bfloat16 and out.shape == (1, 2, 4, SMALL_V) and lse.dtype == jnp.float32
  assert np.isfinite(np.asarray(lse)).all()


# ---------------------------------------------------------------- what it serves, configs

def _problem(*, num_heads=128, num_queries=1, qk_dim=QK, v_dim=V, page_size=64, batch=4, seq_len=4096,
             dtype=jnp.bfloat16):
  q = jax.ShapeDtypeStruct((batch, num_queries, num_heads, qk_dim), dtype)
  pages = jax.ShapeDtypeStruct((batch * seq_len // page_size, page_size, qk_dim), dtype)
  tables = jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return (q, pages, tables, lengths), validation.validate_mla(q, pages, tables, lengths, v_dim)


@pytest.mark.parametrize("fields,match", [
    (dict(qk_dim=64, v_dim=32), "MLA needs v_head_dim a multiple of 128"),
    (dict(qk_dim=640, v_dim=512), "Dqk <= 576"),
    (dict(page_size=4), "page_size 4 is not supported"),
    (dict(dtype=jnp.float32), "MLA needs a bfloat16 or float16 cache"),
])
def test_mla_calls_it_cannot_serve_are_refused_with_reason(fields, match):
  args, _ = _problem(seq_len=256, **fields)
  args = [jnp.zeros(a.shape, a.dtype) for a in args]
  with pytest.raises(NotImplementedError, match=f"mosaic_gpu.*{match}"):
    pkv.mla_decode_attention(*args, v_head_dim=fields.get("v_dim", V), impl=IMPL)


def test_mla_on_triton_names_what_is_missing_and_auto_on_cpu_runs_xla():
  args, _ = _problem(num_heads=4, batch=1, seq_len=128)
  args = [jnp.zeros(a.shape, a.dtype) for a in args]
  with pytest.raises(NotImplementedError, match="(?i)MLA is not implemented on the triton backend"):
    pkv.mla_decode_attention(*args, impl="triton")
  pkv.mla_decode_attention(*args)
  assert pkv.last_impl() == "xla"


def test_mla_register_splits_are_checked():
  assert mla_config.RegisterSplit().name == "" and mla_config.RegisterSplit(40, 232).name == "_r40_232"
  assert mla_config.Codegen().name == "" and mla_config.Codegen(q_per_tile=False).name == "_heldq"
  assert mla_config.Codegen(mla_config.RegisterSplit(40, 232), q_per_tile=False).name == "_r40_232_heldq"
  assert mla_config.Codegen(slots_per_tile=True).name == "_spt"
  for producer, consumer, match in ((40, 236, "multiple of 8"), (16, 240, r"\[24, 256\]"),
                                    (32, 240, "three warpgroups launch with 504")):   # 512 > 504
    with pytest.raises(ValueError, match=match):
      mla_config.RegisterSplit(producer, consumer)


def test_mla_configs_are_checked():
  check = functools.partial(mla_config.check_config, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64)
  check(_config(1))
  with pytest.raises(ValueError, match="block_kv=128 must be one of"):
    check(pkv.DecodeConfig(block_kv=128, num_stages=2, num_splits=1))
  check(_config(1, variant="pipeline_qk"))   # 32-token tiles: four stages fit where 64-token ones take two
  with pytest.raises(ValueError, match="SMEM"):
    check(pkv.DecodeConfig(block_kv=32, num_stages=5, num_splits=1))
  with pytest.raises(ValueError, match="split_scores and rows_as_n take block_kv=64"):
    check(pkv.DecodeConfig(block_kv=32, num_stages=4, num_splits=1, split_scores=True))
  with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
    check(_config(1, num_stages=1))
  with pytest.raises(ValueError, match="SMEM"):
    check(_config(1, num_stages=3))
  with pytest.raises(ValueError, match="kv_groups"):
    check(pkv.DecodeConfig(num_stages=2, num_splits=2, kv_groups=2))
  with pytest.raises(ValueError, match="num_splits must be resolved"):
    check(pkv.DecodeConfig(num_stages=2))
  with pytest.raises(ValueError, match="pipeline_qk or split_scores, not both"):
    check(pkv.DecodeConfig(num_stages=2, num_splits=1, pipeline_qk=True, split_scores=True))
  rows_as_n = pkv.DecodeConfig(num_stages=2, num_splits=1, rows_as_n=True)
  check(rows_as_n, rows=64)
  with pytest.raises(ValueError, match="rows_as_n needs at most 64 packed q rows"):
    check(rows_as_n, rows=128)
  with pytest.raises(ValueError, match="rows_as_n without pipeline_qk or split_scores"):
    check(dataclasses.replace(rows_as_n, split_scores=True), rows=16)
  with pytest.raises(ValueError, match="rows_as_n=1 must be a bool"):
    pkv.DecodeConfig(rows_as_n=1)
  with pytest.raises(ValueError, match="split_scores"):
    pkv.DecodeConfig(split_scores=1)
  alternate = _config(1, variant="alternate_scores")
  check(alternate)
  assert mla_config.MlaSmem.for_call(alternate, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64).fits
  with pytest.raises(ValueError, match="alternate_scores takes block_kv=64 and none of pipeline_qk"):
    check(dataclasses.replace(alternate, split_scores=True))
  with pytest.raises(ValueError, match="alternate_scores takes block_kv=64"):
    check(dataclasses.replace(alternate, block_kv=32, num_stages=4))
  with pytest.raises(ValueError, match="alternate_scores=2 must be a bool"):
    pkv.DecodeConfig(alternate_scores=2)
  halves = _config(1, variant="ring_halves")
  check(halves)
  assert mla_config.MlaSmem.for_call(halves, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64).fits
  check(dataclasses.replace(halves, alternate_scores=True))
  for other in (dict(split_scores=True), dict(rows_as_n=True)):
    with pytest.raises(ValueError, match="ring_halves takes the plain scorer schedule or alternate_scores"):
      check(dataclasses.replace(halves, **other))
  with pytest.raises(ValueError, match="ring_halves=1 must be a bool"):
    pkv.DecodeConfig(ring_halves=1)
  check(dataclasses.replace(halves, p_in_registers=True))
  for other in (dict(alternate_scores=True), dict(pipeline_qk=True, block_kv=32, num_stages=4)):
    with pytest.raises(ValueError, match="p_in_registers takes the plain scorer schedule"):
      check(dataclasses.replace(_config(1, variant="p_in_registers"), **other))
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  for field in ("split_scores", "alternate_scores", "ring_halves", "p_in_registers"):
    with pytest.raises(ValueError, match=f"{field}=True is an option of the MLA kernel"):
      mgpu_config.check_config(pkv.DecodeConfig(num_splits=1, **{field: True}), rows=4, head_dim=128,
                               dtype=jnp.bfloat16, page_size=None)
  # The split-scores layout has the same SMEM footprint (P in two halves), so it fits as well.
  assert mla_config.MlaSmem.for_call(_config(1, variant="split_scores"), qk_dim=QK, v_dim=V, dtype=jnp.bfloat16,
                                   page_size=64).fits
  # Two 64 x 576 stages beside Q fill SMEM (as FlashMLA's); small latent dims get a deeper ring.
  _, problem = _problem()
  assert mla_config.heuristic_config(problem).num_stages == 2
  assert mla_config.heuristic_config(problem).p_in_registers   # measured faster on the H200
  _, small = _problem(qk_dim=SMALL_QK, v_dim=SMALL_V)
  assert mla_config.heuristic_config(small).num_stages > 2


# (B, T, heads, splits, order): past one wave of programs (batch x row blocks x splits > 132 SMs)
# the heuristic takes the sequences longest first.
@pytest.mark.parametrize("batch,seq_len,num_heads,want_splits,want_order", [
    (1, 32768, 128, 64, "given"), (16, 4096, 128, 4, "given"), (64, 4096, 128, 1, "given"),
    (128, 8192, 128, 1, "longest_first"), (64, 8192, 16, 2, "given"), (67, 4096, 128, 1, "longest_first")])
def test_mla_split_count_fills_one_wave(batch, seq_len, num_heads, want_splits, want_order):
  _, problem = _problem(batch=batch, seq_len=seq_len, num_heads=num_heads)
  config = mla_config.resolve_config(problem, None, num_sms=132)
  assert (config.num_splits, config.sequence_order) == (want_splits, want_order)
  # An explicit config keeps its own order.
  explicit = pkv.DecodeConfig(block_kv=64, num_stages=2)
  assert mla_config.resolve_config(problem, explicit, num_sms=132).sequence_order == "given"


def test_mla_balanced_plan_bounds_the_splits_by_the_batch():
  # The balanced plan sizes the grid for a batch at least half full: at B128 (two row blocks of
  # 128 heads) up to 5 splits where the per-sequence plan takes 1; at B1, the most splits.
  _, ragged = _problem(batch=128, seq_len=8192)
  balanced = pkv.DecodeConfig(block_kv=64, num_stages=2, split_plan="balanced")
  assert mla_config.resolve_config(ragged, None, num_sms=132).num_splits == 1
  assert mla_config.resolve_config(ragged, balanced, num_sms=132).num_splits == 5
  _, one = _problem(batch=1, seq_len=32768)
  assert mla_config.resolve_config(one, balanced, num_sms=132).num_splits == split_k.MAX_SPLITS


# ---------------------------------------------------------------- CUDA lowering (CPU)

# The benchmark rows (benchmarks/mla.py), then page sizes, new tokens and fp16.
LOWERING_SHAPES = [
    dict(batch=1, seq_len=32768), dict(batch=16, seq_len=4096), dict(batch=64, seq_len=4096),
    dict(batch=128, seq_len=8192), dict(batch=64, seq_len=8192, num_heads=16),
    dict(batch=64, seq_len=4096, num_queries=2),
    dict(batch=8, seq_len=4096, page_size=16, num_queries=4), dict(batch=8, seq_len=4096, page_size=32, num_queries=3),
    dict(batch=8, seq_len=4096, page_size=128, num_heads=32), dict(batch=8, seq_len=4096, num_heads=64, dtype=jnp.float16),
    dict(batch=2, seq_len=1024, qk_dim=SMALL_QK, v_dim=SMALL_V, num_heads=4),
]


def _shape_id(shape):
  return "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in shape.items())


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=_shape_id)
def test_mla_shipped_configs_lower_for_cuda(shape):
  module, config = _lower(shape, None)
  assert ("_ordered" in module) == (config.sequence_order != "given")   # B128 T8192: longest first


# The opt-in schedules lower at B1 (64 splits) and with pages of 16 (four copies per tile) at
# least; the shipped configs above cover every benchmark row. pipeline_qk (benchmarks/mla.py
# times it as mosaic_gpu_pqk), and the plain schedule with the same 32-token tiles
# (mosaic_gpu_bkv32; the tiles' 64-byte rows set every operand's swizzle).
@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (0, 6)], ids=_shape_id)
def test_mla_pipelined_qk_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=32, num_stages=4, pipeline_qk=True))


@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (2, 9)], ids=_shape_id)
def test_mla_32_token_tiles_lower_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=32, num_stages=4))


@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (0, 6)], ids=_shape_id)
def test_mla_split_scores_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, split_scores=True))


@pytest.mark.parametrize("shape", [dict(batch=64, seq_len=8192, num_heads=16),
                                   dict(batch=8, seq_len=4096, num_heads=32, num_queries=2, page_size=16,
                                        dtype=jnp.float16)],
                         ids=_shape_id)
def test_mla_rows_as_n_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, rows_as_n=True))


@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (0, 6)], ids=_shape_id)
def test_mla_alternate_scores_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, alternate_scores=True))


# Pages of 16: four copies per part.
@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (0, 6)], ids=_shape_id)
def test_mla_ring_halves_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, ring_halves=True))


# The scorer's P V from registers: interpret mode runs the P in SMEM instead (the GPU test runs
# both), so lowering is the CPU's check of that path. The heuristic sets it, so the shipped
# configs above lower it at every row; here with ring halves, pages of 16 and fp16.
@pytest.mark.parametrize("shape,halves", [(dict(LOWERING_SHAPES[6], dtype=jnp.float16), True)],
                         ids=lambda v: _shape_id(v) if isinstance(v, dict) else f"ring_halves={v}")
def test_mla_p_in_registers_lowers_for_cuda(shape, halves):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, p_in_registers=True, ring_halves=halves))


@pytest.mark.parametrize("shape", [LOWERING_SHAPES[i] for i in (1, 3)], ids=_shape_id)
def test_mla_balanced_plan_lowers_for_cuda(shape):
  _lower(shape, pkv.DecodeConfig(block_kv=64, num_stages=2, split_plan="balanced"))


# Longest first with the balanced plan at B16 (4 splits); the shipped configs above lower it alone
# at B128 T8192, where the heuristic takes it.
def test_mla_longest_first_with_the_balanced_plan_lowers_for_cuda():
  _lower(LOWERING_SHAPES[1], pkv.DecodeConfig(block_kv=64, num_stages=2, p_in_registers=True,
                                              sequence_order="longest_first", split_plan="balanced"))


def _lower(shape, config):
  args, problem = _problem(**shape)
  config = mla_config.resolve_config(problem, config, num_sms=132)
  exported = lower_for_cuda(functools.partial(pkv.mla_decode_attention, v_head_dim=problem.v_head_dim,
                                              return_lse=True, impl=IMPL, config=config), *args)
  module = exported.mlir_module()
  assert "custom_call @mosaic_gpu" in module and "pallas_kv_mla" in module
  return module, config


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries,page_size", [
    (1, 32768, 128, None, 64), (16, 4096, 128, 2, 64), (64, 4096, 128, None, 16), (8, 8192, 16, 4, 128),
    (4, 4096, 64, 3, 32)])
def test_gpu_mla_matches_reference(batch, seq_len, num_heads, num_queries, page_size):
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  rng = np.random.default_rng(batch + num_heads)
  lengths = rng.integers(1, seq_len + 1, size=batch)
  lengths[0] = seq_len
  if batch > 2:
    lengths[1] = 0
  args = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=lengths, qk_dim=QK)
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, page_size)
  out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True))(
      q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
  assert pkv.last_impl() == IMPL
  _check(args, out, v_head_dim=V)
  few_rows = num_heads * (num_queries or 1) <= mla_config.ROWS_AS_N_MAX
  for fields in (VARIANTS["plain"], VARIANTS["pipeline_qk"], VARIANTS["split_scores"], VARIANTS["alternate_scores"],
                 VARIANTS["ring_halves"], VARIANTS["alternate_halves"], VARIANTS["p_in_registers"],
                 dict(p_in_registers=True, ring_halves=True),
                 dict(split_plan="balanced"), dict(p_in_registers=True, sequence_order="longest_first"),
                 dict(p_in_registers=True, split_plan="balanced", sequence_order="long_short"),
                 *([VARIANTS["rows_as_n"]] if few_rows else [])):
    config = pkv.DecodeConfig(**(dict(block_kv=64, num_stages=2) | fields))
    out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True, impl=IMPL,
                                    config=config))(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
    _check(args, out, v_head_dim=V)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries", [(4, 4096, 128, None), (3, 8192, 64, 2)])
def test_gpu_mla_split_merge_matches_reference(batch, seq_len, num_heads, num_queries):
  """The split merges on the GPU, the op's (Triton) and the Mosaic GPU launch overlapped with the
  kernel (`backend.mla_merge`): ragged, zero and short lengths leave splits with no key, whose
  partials are unwritten."""
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  lengths = [seq_len, 0, 100, seq_len // 3][:batch]
  args = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries, page_size=64,
               lengths=lengths, qk_dim=QK)
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, 64)
  eight_splits = pkv.DecodeConfig(block_kv=64, num_stages=2, p_in_registers=True, num_splits=8)
  for config in (None, eight_splits):
    out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True, config=config))(
        q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
    assert pkv.last_impl() == IMPL
    _check(args, out, v_head_dim=V)
  out = jax.jit(functools.partial(_overlapped_merge, qk_dim=QK, v_dim=V, config=eight_splits))(
      q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
  _check(args, out, v_head_dim=V)


def _overlapped_merge(q, pages, tables, lengths, *, qk_dim, v_dim, config, interpret=False):
  """(out, lse) of the MLA kernel's partials merged by `backend.mla_merge` (q [B, (S,) Hq, Dqk])."""
  from pallas_kv.kernels.mosaic_gpu import backend
  rows = q.reshape(q.shape[0], -1, qk_dim)
  num_queries = 1 if q.ndim == 3 else q.shape[1]
  out, lse = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=num_queries, v_head_dim=v_dim,
                                   scale=qk_dim ** -0.5, config=config, interpret=interpret)
  merged, merged_lse = backend.mla_merge()(out[:, None], lse[:, None], None, rows=rows.shape[1], out_dtype=q.dtype,
                                           return_lse=True)
  return merged[:, 0].reshape(*q.shape[:-1], v_dim), merged_lse[:, 0].reshape(q.shape[:-1])


def test_mla_overlapped_merge_matches_reference(interpret_mode):
  """`backend.mla_merge` after the kernel (interpret mode): the Mosaic GPU merge at 128 packed rows
  (64 heads x 2 tokens), with empty splits (lengths 0 and 100 of 4 splits over 512) and NaN pages."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  args = _case(3, batch=3, seq_len=512, num_heads=64, num_queries=2, page_size=64, lengths=[512, 0, 100])
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, 64)
  config = pkv.DecodeConfig(block_kv=64, num_stages=2, p_in_registers=True, num_splits=4)
  from pallas_kv.kernels.mosaic_gpu import merge as mgpu_merge   # the Mosaic GPU merge serves these rows
  assert mgpu_merge.unsupported_reason((3, 1, 4, 128, SMALL_V), q.dtype, rows=128, has_sinks=False) is None
  out = _overlapped_merge(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths, qk_dim=SMALL_QK, v_dim=SMALL_V,
                          config=config, interpret=plgpu.InterpretGPUParams())
  _check(args, out)


# ---------------------------------------------------------------- the benchmark program

def test_mla_benchmark_runs_a_tiny_case_on_cpu():
  import io
  from benchmarks import mla as mla_bench
  out = io.StringIO()
  rows = mla_bench.run(mla_bench.cpu_rows(), iters=2, repeats=1, out=out)
  assert rows and all(r["status"] == "ok" for r in rows), rows
  assert all(r["rel_err"] < 1e-2 for r in rows if r["impl"] != "bf16_einsum")
  assert "bf16_einsum" in out.getvalue() and "roofline" in out.getvalue()


def test_mla_benchmark_names_its_kernel_variants():
  from benchmarks import mla as mla_bench
  assert mla_bench.variant_fields("mosaic_gpu_sp33") == dict(num_splits=33)
  assert mla_bench.variant_fields("mosaic_gpu_halves") == dict(split_scores=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_balanced") == dict(split_plan="balanced")
  assert mla_bench.variant_fields("mosaic_gpu_rows_as_n") == dict(rows_as_n=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_pqk") == dict(pipeline_qk=True, block_kv=32, num_stages=4,
                                                            p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_bkv32") == dict(block_kv=32, num_stages=4, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_alt") == dict(alternate_scores=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_rh") == dict(ring_halves=True)
  assert mla_bench.variant_fields("mosaic_gpu_smemp") == dict(p_in_registers=False)
  # Variants change the heuristic's config: the benchmark's base is what the heuristic gives.
  _, problem = _problem()
  assert pkv.DecodeConfig(**mla_bench.DEFAULT_FIELDS) == mla_config.heuristic_config(problem)
  assert mla_bench.variant_fields("mosaic_gpu") is None and mla_bench.is_ours("mosaic_gpu_sp4")
  # The kernel's launch alone under each schedule, with or without a probe's stages left out.
  assert mla_bench.KERNEL_IMPLS["kernel_alt_no_loads"] == (dict(alternate_scores=True, p_in_registers=False),
                                                           frozenset({"loads"}), {})
  assert mla_bench.KERNEL_IMPLS["kernel_rh"] == (dict(ring_halves=True), frozenset(), {})
  assert mla_bench.KERNEL_IMPLS["kernel_alt_r232_no_qk"] == (dict(alternate_scores=True, p_in_registers=False),
                                                             frozenset({"qk"}), dict(registers=(40, 232)))
  assert mla_bench.KERNEL_IMPLS["kernel_r232_heldq"][2] == dict(registers=(40, 232), q_per_tile=False)
  assert mla_bench.KERNEL_IMPLS["kernel_alt_spt"][2] == dict(slots_per_tile=True)
  assert mla_bench.is_ours("kernel_alt") and not mla_bench.is_probe("kernel_alt")
  assert mla_bench.is_probe("kernel_rh_no_pv") and not mla_bench.is_ours("kernel_rh_no_pv")
  row = mla_bench.cpu_rows()[0]
  for bad in ("mosaic_gpu_sp0", "mosaic_gpu_sp", "flashmla"):
    with pytest.raises(ValueError, match="unknown impl"):
      mla_bench.build_fn(bad, row)


# ---------------------------------------------------------------- the benchmark's probes

def test_mla_kernel_launch_matches_the_baseline_and_its_probes_run_in_interpret_mode():
  """benchmarks.mla's `kernel` impls (the launch alone, TileMath as the kernel uses it, under the
  default schedule, alternate scorers and ring halves) match the bf16 baseline; the probes, which leave stages of the tile's math out, run and change the output
  (a probe that left nothing out would measure nothing)."""
  from benchmarks import cases as bench_cases
  from benchmarks import mla as mla_bench
  row = mla_bench.cpu_rows()[0]
  case = row.case()
  lengths = bench_cases.make_lengths(case, jax.random.key(1))
  args = bench_cases.make_input_sets(case, jax.random.key(2), lengths, 1)[0]
  baseline = np.asarray(mla_bench.build_fn(mla_bench.BASELINE, row)(*args), np.float32)
  with pkv.interpret():
    outs = {impl: np.asarray(mla_bench.build_fn(impl, row)(*args), np.float32)
            for impl in (mla_bench.KERNEL, "kernel_alt", "kernel_rh", "kernel_r232_heldq", "kernel_alt_spt",
                         "kernel_no_softmax", "kernel_loads_only")}
  # The schedules' launches alone, and compiled otherwise (mla_config.Codegen).
  for impl in (mla_bench.KERNEL, "kernel_alt", "kernel_rh", "kernel_r232_heldq", "kernel_alt_spt"):
    assert bench_cases.relative_error(outs[impl], baseline) < 1e-2, impl
  for impl in ("kernel_no_softmax", "kernel_loads_only"):
    assert outs[impl].shape == baseline.shape and mla_bench.is_probe(impl) and not mla_bench.is_ours(impl)
    assert not np.allclose(outs[impl], outs[mla_bench.KERNEL], atol=1e-2, equal_nan=True), impl


# Every probe stage, schedule and Codegen option at least once (each lowering takes 5-9 s on 2 cores).
@pytest.mark.parametrize("impl", ["kernel", "kernel_rh_no_qk", "kernel_smemp_no_pv", "kernel_heldq_no_softmax",
                                  "kernel_r232_loads_only", "kernel_alt_no_loads", "kernel_altrh_spt",
                                  "kernel_late_waits", "kernel_one_loader"])
def test_mla_kernel_launch_and_probes_lower_for_cuda(impl):
  from benchmarks import mla as mla_bench
  row = mla_bench.ALL_ROWS["h128_b64_t4096"]
  args, _ = _problem(batch=row.batch, seq_len=row.seq_len, num_heads=row.num_heads)
  module = lower_for_cuda(mla_bench.build_fn(impl, row), *args).mlir_module()
  assert "custom_call @mosaic_gpu" in module and "pallas_kv_mla" in module
  if mla_bench.is_probe(impl):
    assert f"_{impl}" in module   # a probe's kernel says so in its name
  if "_r232" in impl:   # and so does a register split other than the default
    assert "_r40_232" in module
  for option in ("_heldq", "_spt"):   # and Q's descriptors held, the ring's slots opaque
    assert (option in impl) == (option in module), option


def test_mla_late_waits_probe_refuses_other_schedules():
  from benchmarks import mla as mla_bench
  row = mla_bench.ALL_ROWS["h128_b64_t4096"]
  args, _ = _problem(batch=row.batch, seq_len=row.seq_len, num_heads=row.num_heads)
  with pytest.raises(ValueError, match="wait_for_loads=False is a probe of the plain scorer schedule only"):
    lower_for_cuda(mla_bench.build_fn("kernel_rh_late_waits", row), *args)
