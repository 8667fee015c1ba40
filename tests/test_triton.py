"""What only the Pallas Triton kernel has: its paged tiles (gathers, pages that are not powers of
two), row blocks, empty splits, the split merge in the kernel's launch (merge_in_kernel), head dims
that are not powers of two, more shapes lowered for CUDA, the hidden deprecation warning. The checks
every backend passes are in test_kernels.py."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kv as pkv
import sweeps
from harness import TRITON_CUSTOM_CALL, check_against_reference, lower_for_cuda, make_case, poison_unread_slots
from harness import assert_lse_matches, assert_matches_reference, tiered
from pallas_kv import validation
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import frame
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import decode as triton_decode
from pallas_kv.kernels.triton import merge as triton_merge

IMPL = "triton"


def _paged(case, **kw):
  return pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                    return_lse=True, impl=IMPL, **kw)


def _kernel_config(num_splits, merge=False, block_kv=16):
  """A complete config and its per-sequence plan, as the kernel entry points take them."""
  config = pkv.TritonConfig(block_kv=block_kv, num_stages=2, num_splits=num_splits, split_plan="per_sequence",
                            num_warps=4, sequence_order="given", merge_in_kernel=merge)
  return dict(config=config, plan=SplitPlan(kind="per_sequence", num_splits=num_splits, block_kv=block_kv))


# ---------------------------------------------------------------- interpret mode (CPU)

def test_paged_window_sinks_heuristic_config_interpret(interpret_mode):
  case = make_case(12, batch=2, seq_len=128, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   page_size=16, lengths=[128, 50])
  kw = dict(window=40, sinks=jnp.linspace(0.0, 1.0, 4))
  check_against_reference(case, _paged(case, **kw), **kw)


def test_row_blocks_interpret(interpret_mode):
  # 9 new tokens x 16 q heads = 144 packed rows: two programs of 128 rows per kv head.
  case = make_case(13, batch=1, seq_len=64, num_heads=16, num_kv_heads=1, head_dim=64, num_queries=9,
                   dtype=jnp.bfloat16, lengths=[60])
  assert triton_config.row_blocking(144, 64) == (128, 2)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL,
                             config=pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=2))
  check_against_reference(case, out)


def test_partials_of_empty_splits_interpret():
  # 40 tokens = 3 tiles of 16 over 4 splits: split 3 is empty, as is every split of length 0.
  case = make_case(14, batch=2, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[0, 40])
  q = case.q.reshape(2, 1, 4, 64)
  out, lse = triton_decode.decode_partials(q, case.k, case.v, case.lengths, num_queries=1,
                                           options=AttentionOptions(scale=0.125), **_kernel_config(4),
                                           interpret=True)
  assert out.shape == (2, 1, 4, 4, 64) and lse.shape == (2, 1, 4, 4)
  lse, out = np.asarray(lse), np.asarray(out)
  assert np.isneginf(lse[0]).all() and np.isneginf(lse[1, :, 3]).all() and np.isfinite(lse[1, :, :3]).all()
  np.testing.assert_array_equal(out[0], 0.0)
  np.testing.assert_array_equal(out[1, :, 3], 0.0)


def test_other_head_dims_and_page_sizes_are_refused_with_reason():
  case = make_case(15, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=36, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="triton.*head_dim 36"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=IMPL)
  case = make_case(16, batch=1, seq_len=72, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=24)
  with pytest.raises(NotImplementedError, match="page_size 24"):
    _paged(case)


# Programs of 64 rows or more (MQA groups, S x group > 32) split for one program per SM, the others for two
# (docs/decisions.md#triton-wide-rows).
@pytest.mark.parametrize("heads,num_queries,wide", [((48, 1), 1, True), ((71, 1), 1, True), ((32, 8), 16, True),
                                                     ((40, 2), 1, False), ((32, 8), 1, False)])
def test_wide_rows_take_one_program_per_sm(heads, num_queries, wide, tmp_path, monkeypatch):
  from pallas_kv import tuned
  from pallas_kv.kernels import plan
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))   # no tuned entries: the heuristic decides
  tuned.clear_cache()
  from pallas_kv import validation
  (hq, hkv), sds = heads, jax.ShapeDtypeStruct
  kv = sds((16, 8192, hkv, 128), jnp.bfloat16)   # few programs: the split count differs with programs per SM
  problem = validation.validate_dense(sds((16, num_queries, hq, 128), jnp.bfloat16), kv, kv, sds((16,), jnp.int32))
  config = triton_config.resolve_config(problem, pkv.TritonConfig(split_plan="per_sequence"), num_sms=132)
  _, row_blocks = triton_config.row_blocking(num_queries * hq // hkv, 128)
  unfilled = pkv.TritonConfig(**{**config.given(), "num_splits": None})
  for_sm = lambda per_sm: plan.fill_num_splits(problem, unfilled, row_blocks=row_blocks, programs_per_sm=per_sm,
                                               num_sms=132).num_splits
  assert config.num_splits == for_sm(1 if wide else 2)
  assert for_sm(1) != for_sm(2)


# The heuristic's stages (benchmarks/RESULTS.md, sixteenth and seventeenth sets): three at D 128
# whatever the grid's waves (two won on full-length batches of one to 2.5 waves and lost more on
# ragged ones); at D 256 three where the SMEM budget is Hopper's, two where it is an A100's.
@pytest.mark.parametrize("heads,case", [((32, 8), (48, 4096)), ((32, 8), (64, 8192)), ((28, 4), (128, 8192)),
                                        ((32, 8), (8, 8192))])
def test_heuristic_stages(heads, case, tmp_path, monkeypatch):
  from pallas_kv import tuned
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))   # no tuned entries: the heuristic decides
  tuned.clear_cache()
  for page_size in (None, 64):
    _, problem = sweeps.problem_args(heads, case, page_size)
    assert triton_config.resolve_config(problem, None, num_sms=132).num_stages == 3
  b, t = case
  from pallas_kv import validation
  q = jax.ShapeDtypeStruct((b, 16, 256), jnp.bfloat16)   # Gemma-2-9B's heads: 16 / 8, D 256
  kv = jax.ShapeDtypeStruct((b, t, 8, 256), jnp.bfloat16)
  gemma = validation.validate_dense(q, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32))
  hopper = triton_config.heuristic_config(gemma, budget=triton_config.HOPPER_SMEM_BUDGET_BYTES)
  a100 = triton_config.heuristic_config(gemma, budget=triton_config.SMEM_BUDGET_BYTES)
  assert (hopper.num_stages, hopper.block_kv, a100.num_stages, a100.block_kv) == (3, 64, 2, 64)
  assert triton_config.heuristic_config(gemma) == hopper   # no GPU here: the budget is Hopper's
  tuned.clear_cache()


def test_bad_explicit_configs_are_refused():
  case = make_case(17, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=48)
  with pytest.raises(ValueError, match="block_kv=32 must divide page_size=48"):
    _paged(case, config=pkv.TritonConfig(block_kv=32))
  with pytest.raises(ValueError, match="num_warps=3"):
    pkv.TritonConfig(num_warps=3)
  # A Mosaic GPU field is not a TritonConfig's; a Mosaic GPU config is not triton's.
  with pytest.raises(TypeError, match="kv_groups"):
    pkv.TritonConfig(kv_groups=2, num_splits=2)
  with pytest.raises(ValueError, match="MosaicGPUConfig.*impl='triton'"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=IMPL,
                         config=pkv.MosaicGPUConfig(kv_groups=2, num_splits=2))


# ---------------------------------------------------------------- merge_in_kernel (interpret mode)

def _merged_config(num_splits, merge=True, block_kv=16):
  return pkv.TritonConfig(block_kv=block_kv, num_stages=2, num_splits=num_splits, merge_in_kernel=merge)


@pytest.mark.parametrize("paged,num_queries,num_heads,num_splits,lengths,options", [
    # S = 2, ragged lengths: 8 tiles over 3 splits, 4 tiles over 2 (one empty), one tile, none.
    (False, 2, 8, 3, [128, 50, 16, 0], dict(sinks=True, softcap=20.0)),
    (True, None, 8, 4, [128, 37, 0, 100], dict(window=40)),
    (False, 9, 16, 2, [60, 33], dict(sinks=True)),   # 144 packed rows: two row blocks, two counters
    (True, 3, 4, 1, [128, 5, 0, 64], dict(softcap=10.0)),   # one split: written directly, no counters
], ids=["dense-S2-sinks-softcap", "paged-S1-window", "dense-row-blocks-sinks", "paged-one-split"])
def test_merge_in_kernel_matches_reference_and_the_two_launch_path(interpret_mode, paged, num_queries, num_heads,
                                                                    num_splits, lengths, options):
  case = make_case(20 + num_splits, batch=len(lengths), seq_len=128, num_heads=num_heads,
                   num_kv_heads=num_heads // 4 if num_heads > 4 else 1, head_dim=64, dtype=jnp.bfloat16,
                   num_queries=num_queries, lengths=lengths, page_size=16 if paged else None)
  if options.get("sinks"):
    options = dict(options, sinks=jnp.linspace(-1.0, 2.0, num_heads))
  def call(merge):
    config = _merged_config(num_splits, merge)
    if paged:
      return _paged(case, config=config, **options)
    return pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config,
                                **options)
  merged, two_launch = call(True), call(False)
  check_against_reference(case, merged, **options)
  # Within float32 rounding of each other (the kernel sums the splits in a loop, merge_splits in an
  # einsum; exp and log are each one's own), so the bf16 outputs differ by at most one ulp.
  np.testing.assert_allclose(np.asarray(merged[0], np.float32), np.asarray(two_launch[0], np.float32),
                             rtol=2 ** -7, atol=1e-6)
  lse, two_lse = np.asarray(merged[1]), np.asarray(two_launch[1])
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(two_lse))
  np.testing.assert_allclose(lse[np.isfinite(lse)], two_lse[np.isfinite(two_lse)], rtol=1e-6, atol=1e-6)


def test_merged_kernel_equals_merge_splits_of_the_partials_in_float32():
  # The kernel's merge against frame.merge_splits on the same partials, before any cast.
  case = make_case(30, batch=3, seq_len=96, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   lengths=[96, 40, 0])
  q = frame.pack_queries(case.q[:, None], 2)
  sinks = frame.pack_queries(jnp.linspace(0.0, 1.0, 8)[None, None, :, None], 2)[0, ..., 0]
  kw = dict(num_queries=1, options=AttentionOptions(scale=0.125), interpret=True)
  out, lse = triton_decode.decode_partials(q, case.k, case.v, case.lengths, **_kernel_config(3, False), **kw)
  want, want_lse = frame.merge_splits(out, lse, sinks)
  got, got_lse = triton_decode.decode_merged(q, case.k, case.v, case.lengths, **_kernel_config(3, True), sinks=sinks,
                                             out_dtype=jnp.float32, **kw)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
  np.testing.assert_allclose(got_lse[:2], want_lse[:2], rtol=1e-6)
  np.testing.assert_array_equal(got[2], 0.0)
  # Without return_lse the kernel writes no LSE; the output is the same.
  out_only, none = triton_decode.decode_merged(q, case.k, case.v, case.lengths, **_kernel_config(3, True),
                                               sinks=sinks, return_lse=False, **kw)
  assert none is None and out_only.dtype == jnp.float16
  np.testing.assert_array_equal(out_only, got.astype(jnp.float16))


def test_merge_in_kernel_with_fixed_splits_is_batch_invariant(interpret_mode):
  case = make_case(31, batch=3, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[100, 128, 7])
  config = _merged_config(4)
  together = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config)
  # Sequence 0 (7 tiles: 2, 2, 2, 1 over the splits) alone, its neighbours swapped for others.
  others = make_case(32, batch=3, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                     lengths=[100, 3, 128])
  pick = lambda x, y: jnp.concatenate([x[:1], y[1:]])
  mixed = pkv.decode_attention(pick(case.q, others.q), pick(case.k, others.k), pick(case.v, others.v),
                               pick(case.lengths, others.lengths), return_lse=True, impl=IMPL, config=config)
  np.testing.assert_array_equal(np.asarray(mixed[0][0]), np.asarray(together[0][0]))
  np.testing.assert_array_equal(np.asarray(mixed[1][0]), np.asarray(together[1][0]))


def _check_merge_kernel(splits, rows, dv, interpret):
  # Random partials (some splits and one whole sequence empty; of several splits, their outputs
  # NaN: a kernel may leave them unwritten), rows and splits not powers of two.
  rng = np.random.default_rng(splits * rows)
  out = rng.standard_normal((2, 3, splits, rows, dv)).astype(np.float32)
  lse = (4 * rng.standard_normal((2, 3, splits, rows))).astype(np.float32)
  empty = rng.random((2, 3, splits)) < 0.3
  empty[1, 2] = True
  lse[empty], out[empty] = -np.inf, np.nan if splits > 1 else 0.0
  sinks = jnp.asarray(rng.standard_normal((3, rows)), jnp.float32)
  for row_sinks in (None, sinks):
    want, want_lse = frame.merge_splits(jnp.asarray(out), jnp.asarray(lse), row_sinks)
    got, got_lse = triton_merge.merge_partials(jnp.asarray(out), jnp.asarray(lse), row_sinks, out_dtype=jnp.float32,
                                               interpret=interpret)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    np.testing.assert_allclose(got_lse[np.isfinite(got_lse)], want_lse[np.isfinite(want_lse)], rtol=1e-6)
    np.testing.assert_array_equal(got[1, 2], 0.0)
  bf16, none = triton_merge.merge_partials(jnp.asarray(out), jnp.asarray(lse), out_dtype=jnp.bfloat16,
                                           return_lse=False, interpret=interpret)
  assert none is None and bf16.dtype == jnp.bfloat16 and bf16.shape == (2, 3, rows, dv)
  # bf16 partials (as the MLA kernel stores them) are summed in float32.
  got, _ = triton_merge.merge_partials(jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse), out_dtype=jnp.float32,
                                       interpret=interpret)
  want, _ = frame.merge_splits(jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Partials padded with rows past R (as a kernel may store them): only the first R are merged.
  padded = lambda x, fill: np.concatenate([x, np.full(x[:, :, :, :3].shape, fill, np.float32)], axis=3)
  got, got_lse = triton_merge.merge_partials(jnp.asarray(padded(out, np.nan)), jnp.asarray(padded(lse, np.nan)),
                                             out_dtype=jnp.float32, rows=rows, interpret=interpret)
  want, want_lse = frame.merge_splits(jnp.asarray(out), jnp.asarray(lse))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got_lse.shape == want_lse.shape


MERGE_SHAPES = [(1, 4, 64), (33, 4, 128), (5, 36, 64), (64, 16, 256), (7, 40, 512)]


@pytest.mark.parametrize("splits,rows,dv", tiered(MERGE_SHAPES, every_tier=MERGE_SHAPES[1:2] + MERGE_SHAPES[3:]))
def test_merge_kernel_equals_merge_splits(splits, rows, dv):
  _check_merge_kernel(splits, rows, dv, interpret=True)


def test_merge_kernel_checks_its_arguments():
  out, lse = jnp.zeros((1, 2, 3, 4, 64)), jnp.zeros((1, 2, 3, 4))
  with pytest.raises(ValueError, match="lse must be float32"):
    triton_merge.merge_partials(out, lse[..., :3], out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="sinks must be"):
    triton_merge.merge_partials(out, lse, jnp.zeros((2, 5)), out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="rows=5 must be in"):
    triton_merge.merge_partials(out, lse, out_dtype=jnp.bfloat16, rows=5)
  with pytest.raises(ValueError, match="out must be float32, bfloat16 or float16"):
    triton_merge.merge_partials(out.astype(jnp.int8), lse, out_dtype=jnp.bfloat16)


def test_merge_in_kernel_config_is_checked():
  with pytest.raises(ValueError, match="merge_in_kernel"):
    pkv.TritonConfig(merge_in_kernel=1)
  with pytest.raises(TypeError, match="merge_in_kernel"):   # a triton field: no Mosaic GPU config has it
    pkv.MosaicGPUConfig(num_splits=4, merge_in_kernel=True)
  # The kernel takes a complete config only (what resolve_config makes).
  with pytest.raises(ValueError, match="complete TritonConfig"):
    triton_config.check_config(pkv.TritonConfig(num_splits=4, merge_in_kernel=True), head_dim=128, page_size=None)
  triton_config.check_config(_kernel_config(4, True)["config"], head_dim=128, page_size=None)


# ---------------------------------------------------------------- head dims that are not powers of two

def _problem(head_dim, *, num_queries=1, group=4, page_size=None):
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
    return validation.validate_dense(q, kv, kv, lengths)
  pages = jax.ShapeDtypeStruct((2 * 1024 // page_size, page_size, 2, head_dim), jnp.bfloat16)
  return validation.validate_paged(q, pages, pages, jax.ShapeDtypeStruct((2, 1024 // page_size), jnp.int32), lengths)


def test_head_dims_served_are_the_multiples_of_8_from_32_to_512():
  reason = lambda d: triton_config.unsupported_reason("decode", _problem(d), AttentionOptions(scale=0.1),
                                                      (jnp.bfloat16, jnp.bfloat16))
  for head_dim in range(32, 513, 8):
    assert reason(head_dim) is None, head_dim
  for head_dim in (8, 16, 20, 24, 36, 81, 100, 520, 1024):
    assert f"head_dim {head_dim} is not a multiple of 8 in [32, 512]" in reason(head_dim)
  with pytest.raises(ValueError, match="head_dim 36"):
    triton_config.check_config(_kernel_config(1)["config"], head_dim=36, page_size=None)


def test_head_dims_are_power_of_two_column_pieces():
  pieces = triton_config.column_pieces
  assert pieces(128) == ((0, 128),) and pieces(32) == ((0, 32),) and pieces(512) == ((0, 512),)
  assert pieces(96) == ((0, 64), (64, 32)) and pieces(80) == ((0, 64), (64, 16))
  assert pieces(40) == ((0, 32), (32, 16))                  # the last 8 columns in a masked piece of 16
  assert pieces(104) == ((0, 64), (64, 32), (96, 16))
  assert pieces(120) == ((0, 64), (64, 32), (96, 32))       # a third piece pads what is left
  for head_dim in range(32, 513, 8):
    cover = pieces(head_dim)
    assert len(cover) <= triton_config.MAX_COLUMN_PIECES
    assert all(w & (w - 1) == 0 and w >= 16 for _, w in cover), cover
    assert [o for o, _ in cover] == [sum(w for _, w in cover[:i]) for i in range(len(cover))]
    assert head_dim <= triton_config.tile_width(head_dim) <= triton_config.padded_dim(head_dim)   # never wider
  assert sum(triton_config.tile_width(d) == d for d in range(32, 513, 16)) > 20   # most multiples of 16: exact


def test_padded_head_dims_size_rows_and_smem_by_the_tile_width():
  # Accumulators rows x the tiles' width float32 stay within 128 x 128 (rows a power of two): D 512 holds 32
  # rows, D 80 and 40 as many as D 128, D 136 (128 + 16) 64.
  assert [triton_config.row_blocking(256, d)[0] for d in (40, 80, 128, 136, 256, 320, 512)] == [128] * 3 + [64] * 2 + [32] * 2
  assert triton_config.smem_bytes(head_dim=80, itemsize=2, block_kv=64, num_stages=3, block_rows=16) == \
      triton_config.smem_bytes(head_dim=64, itemsize=2, block_kv=80, num_stages=3, block_rows=20)
  for budget in (triton_config.HOPPER_SMEM_BUDGET_BYTES, triton_config.SMEM_BUDGET_BYTES):
    for head_dim in (40, 200, 320, 512):
      problem = _problem(head_dim, num_queries=16, group=8)
      config = triton_config.heuristic_config(problem, budget=budget)
      block_rows, _ = triton_config.row_blocking(128, head_dim)
      assert triton_config.fits_smem(head_dim=head_dim, itemsize=2, block_kv=config.block_kv,
                                     num_stages=config.num_stages, block_rows=block_rows, budget=budget)
  # D 512 on Hopper: half the tile, three stages again.
  config = triton_config.heuristic_config(_problem(512), budget=triton_config.HOPPER_SMEM_BUDGET_BYTES)
  assert (config.block_kv, config.num_stages) == (32, 3)


# (head_dim, page_size, num_queries): page 16 gathers a tile of 32 across pages, page 64 holds two.
_PADDED_CASES = [(80, None, 2), (40, 16, None), (512, 64, 2), (96, 16, 2), (200, None, None), (72, 64, None),
                 (104, None, 3)]


@pytest.mark.parametrize("head_dim,page_size,num_queries", tiered(_PADDED_CASES, every_tier=_PADDED_CASES[:3]))
def test_padded_head_dims_interpret(interpret_mode, head_dim, page_size, num_queries):
  # Garbage in every unread slot (NaN values, inf keys) against the reference on the clean case; two splits
  # merged in a second launch, the last tile past the dense cache's end.
  case = make_case(head_dim, batch=3, seq_len=200 if page_size is None else 192, num_heads=8, num_kv_heads=2,
                   head_dim=head_dim, num_queries=num_queries, dtype=jnp.bfloat16, page_size=page_size,
                   lengths=[137, 0, 192])
  bad = poison_unread_slots(case)
  config = pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2)
  if page_size is None:
    out = pkv.decode_attention(bad.q, bad.k, bad.v, bad.lengths, return_lse=True, impl=IMPL, config=config)
  else:
    out = _paged(bad, config=config)
  check_against_reference(case, out)


def test_padded_head_dim_merged_in_kernel_interpret(interpret_mode):
  # The merge in the launch stores and reloads [rows, D] partials: masked past D too.
  case = make_case(3, batch=2, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=80, num_queries=2,
                   dtype=jnp.float16, lengths=[128, 45])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL,
                             config=_merged_config(3))
  check_against_reference(case, out)


@pytest.mark.parametrize("max_pieces", [1, 3])
def test_one_padded_piece_and_several_pieces_agree(interpret_mode, monkeypatch, max_pieces):
  # MAX_COLUMN_PIECES = 1 is the single padded tile (96 in 128 columns), kept to measure the pieces against.
  monkeypatch.setattr(triton_config, "MAX_COLUMN_PIECES", max_pieces)
  assert len(triton_config.column_pieces(96)) == (1 if max_pieces == 1 else 2)
  case = make_case(4, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=96, num_queries=2,
                   dtype=jnp.bfloat16, lengths=[128, 77])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL,
                             config=pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2))
  check_against_reference(case, out)


_ONE_BYTE_PADDED_CASES = [(80, "int8", 16, 2), (40, "float8_e4m3fn", None, None), (200, "float8_e5m2", 32, 3)]


@pytest.mark.parametrize("head_dim,kv_dtype,page_size,num_queries", tiered(_ONE_BYTE_PADDED_CASES,
                                                                           every_tier=_ONE_BYTE_PADDED_CASES[:1]))
def test_padded_head_dims_one_byte_v_tokens_last_interpret(head_dim, kv_dtype, page_size, num_queries):
  # v [.., D, tokens]: padded rows of the value tile, masked; against the xla impl with v laid out like k.
  case = make_case(head_dim, batch=3, seq_len=96, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                   num_queries=num_queries, dtype=jnp.float16, kv_dtype=jnp.dtype(kv_dtype), page_size=page_size)
  case = poison_unread_slots(case, dense=page_size is None)
  k, v = (case.k, case.v) if page_size is None else (case.k_pages, case.v_pages)
  scales = jnp.asarray(np.random.default_rng(head_dim).uniform(0.005, 0.02, k.shape[:3]), jnp.float32)

  def run(impl, v, v_tokens_last, **kw):
    args = (case.q, k, v) + (() if page_size is None else (case.block_tables,)) + (case.lengths,)
    op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
    return op(*args, k_scale=scales, v_scale=scales, v_tokens_last=v_tokens_last, return_lse=True, impl=impl, **kw)

  ref, ref_lse = run("xla", v, False)
  with pkv.interpret():
    out, lse = run(IMPL, jnp.transpose(v, (0, 2, 3, 1)), True,
                   config=pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2))
  assert_matches_reference(out, ref, jnp.float16)
  assert_lse_matches(lse, ref_lse, jnp.float16)


# Dense and paged (page 48: tiles of 16 in a page), one and 16 new tokens, row blocks (group 64), one-byte
# caches with v tokens last: every shape lowers to Triton IR, whose arrays must be powers of two.
_PADDED_LOWERING = [(32, None, 1, 4, "bfloat16"), (40, 48, 16, 8, "bfloat16"), (72, None, 2, 64, "int8"),
                    (80, 16, 1, 8, "float8_e4m3fn"), (96, None, 16, 8, "float16"), (104, 48, 1, 4, "bfloat16"),
                    (160, None, 4, 16, "int8"), (192, 16, 2, 8, "bfloat16"), (320, None, 16, 8, "bfloat16"),
                    (512, 64, 1, 64, "bfloat16"), (512, None, 2, 8, "int8")]


@pytest.mark.parametrize("head_dim,page_size,num_queries,group,kv_dtype", _PADDED_LOWERING)
def test_padded_head_dims_lower_triton(head_dim, page_size, num_queries, group, kv_dtype):
  one_byte = jnp.dtype(kv_dtype).itemsize == 1
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.float16 if one_byte else jnp.dtype(kv_dtype))
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if page_size is None:
    k = jax.ShapeDtypeStruct((2, 4000, 2, head_dim), kv_dtype)
    v = jax.ShapeDtypeStruct((2, 2, head_dim, 4000) if one_byte else k.shape, kv_dtype)
    op, args, scale_shape = pkv.decode_attention, (q, k, v), k.shape[:3]
  else:
    num_pages = 2 * 4800 // page_size + 3
    k = jax.ShapeDtypeStruct((num_pages, page_size, 2, head_dim), kv_dtype)
    v = jax.ShapeDtypeStruct((num_pages, 2, head_dim, page_size) if one_byte else k.shape, kv_dtype)
    op, args = pkv.paged_decode_attention, (q, k, v, jax.ShapeDtypeStruct((2, 4800 // page_size), jnp.int32))
    scale_shape = k.shape[:3]
  kw = dict(impl=IMPL, softcap=30.0, sinks=jnp.zeros((2 * group,)))
  if not one_byte:
    exported = _lower_triton(functools.partial(op, **kw), *args, lengths)
  else:
    scale = jax.ShapeDtypeStruct(scale_shape, jnp.float32)
    fn = lambda *a: op(*a[:-2], k_scale=a[-2], v_scale=a[-1], v_tokens_last=True, **kw)
    exported = _lower_triton(fn, *args, lengths, scale, scale)
  assert f"_d{head_dim}_" in exported.mlir_module()   # the kernel's name: this head dim, not a padded copy


_GPU_PADDED_CASES = [(80, None, 2), (96, 16, 1), (40, 64, 3), (200, 16, 2), (512, None, 4), (72, 32, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,page_size,num_queries", tiered(_GPU_PADDED_CASES,
                                                                  every_tier=_GPU_PADDED_CASES[:2]))
def test_gpu_padded_head_dims(head_dim, page_size, num_queries):
  # The heuristic's config; stores past D would land in the next row's columns, loads past D read garbage.
  case = make_case(head_dim, batch=3, seq_len=1152, num_heads=16, num_kv_heads=2, head_dim=head_dim,
                   num_queries=num_queries, dtype=jnp.bfloat16, page_size=page_size, lengths=[1152, 0, 701])
  bad = poison_unread_slots(case)
  if page_size is None:
    out = pkv.decode_attention(bad.q, bad.k, bad.v, bad.lengths, return_lse=True, impl=IMPL)
  else:
    out = _paged(bad)
  check_against_reference(case, out)


# ---------------------------------------------------------------- CUDA lowering (CPU)

def _lower_triton(fn, *args):
  exported = lower_for_cuda(fn, *args)
  assert TRITON_CUSTOM_CALL in exported.mlir_module()
  return exported


@pytest.mark.parametrize("num_queries,head_dim,group,page_size", [
    (4, 128, 8, None), (1, 64, 16, 8), (1, 256, 4, 256), (16, 128, 16, 48), (16, 256, 16, None),
])
def test_other_shapes_lower_triton(num_queries, head_dim, group, page_size):
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  kw = dict(impl=IMPL, softcap=30.0, window=1024, sinks=jnp.zeros((2 * group,)))
  if page_size is None:
    kv = jax.ShapeDtypeStruct((2, 4000, 2, head_dim), jnp.float16)   # capacity not a multiple of any tile
    _lower_triton(functools.partial(pkv.decode_attention, **kw), q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((2 * 4800 // page_size + 3, page_size, 2, head_dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((2, 4800 // page_size), jnp.int32)
    _lower_triton(functools.partial(pkv.paged_decode_attention, **kw), q, pages, pages, tables, lengths)


def _lower_batch_1_row(paged: bool, **kw) -> str:
  """The CUDA module of the op at B1 T32768 heads 32/8 D128 bf16, dense or paged (page 16)."""
  q = jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  if paged:
    pages = jax.ShapeDtypeStruct((2048 + 5, 16, 8, 128), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    return _lower_triton(functools.partial(pkv.paged_decode_attention, impl=IMPL, **kw), q, pages, pages, tables,
                         lengths).mlir_module()
  kv = jax.ShapeDtypeStruct((1, 32768, 8, 128), jnp.bfloat16)
  return _lower_triton(functools.partial(pkv.decode_attention, impl=IMPL, **kw), q, kv, kv, lengths).mlir_module()


@pytest.mark.parametrize("paged", [False, True])
def test_merge_in_kernel_lowers_as_one_kernel_at_the_batch_1_shape(paged):
  # B1 T32768 heads 32/8 D128 bf16 (the benchmark's batch-1 row), 16 splits: no XLA merge is left.
  module = _lower_batch_1_row(paged, return_lse=True, sinks=jnp.zeros((32,)),
                              config=pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=16, merge_in_kernel=True))
  assert module.count(TRITON_CUSTOM_CALL) == 1
  assert "stablehlo.exponential" not in module and "stablehlo.dot_general" not in module


@pytest.mark.parametrize("paged", [False, True])
def test_split_calls_lower_as_the_kernel_and_the_merge_kernel_alone(paged):
  # The batch-1 row with 33 splits: q is not padded,
  # lengths and page ids are clamped in the kernel, and the splits merge in a second Pallas launch,
  # so the program holds the two kernels and no XLA pad, clamp, exponential, einsum or cast.
  module = _lower_batch_1_row(paged, config=pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=33))
  assert module.count(TRITON_CUSTOM_CALL) == 2
  ops = ["stablehlo.pad", "stablehlo.exponential", "stablehlo.dot_general"]
  if not paged:   # (the paged op's checks of page ids, traced for checkify only, hold a clip)
    ops += ["stablehlo.minimum", "stablehlo.maximum", "stablehlo.convert"]
  for op in ops:
    assert op not in module, op


def test_deprecation_warning_is_hidden_for_our_kernels_only():
  args, _ = sweeps.problem_args((32, 8), (8, 8192), None)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _lower_triton(functools.partial(pkv.decode_attention, impl=IMPL), *args)
  assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]

  def users_own_kernel(x):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

  with pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated"):
    _lower_triton(users_own_kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32))


_GPU_PAGE_CASES = [(64, 8, 64), (256, 128, 32), (128, 48, 16), (128, 32, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,page_size,block_kv", tiered(_GPU_PAGE_CASES,
                                                               every_tier=[_GPU_PAGE_CASES[0], _GPU_PAGE_CASES[1]]))
def test_gpu_head_dims_and_pages(head_dim, page_size, block_kv):
  case = make_case(head_dim + page_size, batch=3, seq_len=1152, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                   dtype=jnp.float16, page_size=page_size, num_queries=3)
  check_against_reference(case, _paged(case, config=pkv.TritonConfig(block_kv=block_kv, num_stages=3)))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_merge_in_kernel(page_size):
  # Splits finish in whatever order the GPU runs them: the merge must give the same bits each time.
  case = make_case(40, batch=4, seq_len=8192, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                   page_size=page_size, lengths=[8192, 4001, 0, 77])
  kw = dict(return_lse=True, impl=IMPL, sinks=jnp.linspace(-1.0, 1.0, 32), softcap=30.0)
  config = pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=16, merge_in_kernel=True)
  if page_size is None:
    fn = jax.jit(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, config=config, **kw))
    args = (case.q, case.k, case.v, case.lengths)
  else:
    fn = jax.jit(lambda q, k, v, t, n: pkv.paged_decode_attention(q, k, v, t, n, config=config, **kw))
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
  first = fn(*args)
  check_against_reference(case, first, sinks=kw["sinks"], softcap=30.0)
  for _ in range(3):
    again = fn(*args)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(first[0]))
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(first[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("splits,rows,dv", tiered(MERGE_SHAPES, every_tier=[MERGE_SHAPES[1], MERGE_SHAPES[4]]))
def test_gpu_merge_kernel_equals_merge_splits(splits, rows, dv):
  _check_merge_kernel(splits, rows, dv, interpret=False)


@pytest.mark.gpu
def test_gpu_capacity_not_a_multiple_of_the_tile_and_row_blocks():
  case = make_case(2, batch=3, seq_len=4000, num_heads=64, num_kv_heads=4, head_dim=128, dtype=jnp.bfloat16,
                   num_queries=16, lengths=[4000, 3999, 17])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL)
  check_against_reference(case, out)


@pytest.mark.gpu
def test_gpu_auto_picks_triton_on_an_untuned_shape():
  # Any GPU: Triton is first in api.KERNEL_IMPLS (measured faster for GQA on the H200).
  case = make_case(5, batch=2, seq_len=1000, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == IMPL
