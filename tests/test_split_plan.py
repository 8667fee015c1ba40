"""The balanced split plan (`split_plan="balanced"` of TritonConfig / MosaicGPUConfig): one tile
count per split for the whole batch, from `lengths`, so that a ragged batch spreads evenly over the
SMs; the stream-K plan (Triton); and the longest-first sequence order
(TritonConfig.sequence_order), which changes the schedule only."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
import sweeps
from harness import TRITON_CUSTOM_CALL, check_against_reference, lower_for_cuda, make_case, tiered
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton.stream_k_plan import StreamKLayout

CONFIG_TYPE = {"triton": pkv.TritonConfig, "mosaic_gpu": pkv.MosaicGPUConfig}


# ---------------------------------------------------------------- the plan itself

def _walk_segments(lengths, *, block_kv, num_queries, window, head_blocks, num_programs, max_pieces, ahead,
                   unroll=0):
  """Every program's segments as the Mosaic GPU kernel finds them (`work.for_each_item`'s walk, run outside a
  kernel): (program, head block, sequence, t0, t1, slot, fill_from), and the plan's share. ahead: the walk's
  vectors made in XLA (`plan.stream_k_walk`), else each program's share planned from the lengths, its loops
  unrolled `unroll` steps (0: the batch's, straight-line code)."""
  from pallas_kv.kernels.mosaic_gpu import work
  st = types.SimpleNamespace(batch=len(lengths), capacity=1 << 20, num_queries=num_queries, num_row_blocks=1,
                             num_kv_heads=head_blocks, num_programs=num_programs, num_splits=max_pieces,
                             walk_unroll=unroll or len(lengths), tiling=types.SimpleNamespace(block_kv=block_kv),
                             options=types.SimpleNamespace(window=window))
  sequences = work.Sequences(jnp.asarray(lengths, jnp.int32))
  refs = work.WalkRefs()
  if ahead:
    refs = work.WalkRefs(*plan.stream_k_walk(jnp.asarray(lengths, jnp.int32), block_kv=block_kv,
                                             num_queries=num_queries, window=window, head_blocks=head_blocks,
                                             num_programs=num_programs, max_pieces=max_pieces).arrays())
  share_of = jax.jit(lambda p: refs.program(p, sequences, st))   # jitted: one trace, not ops one by one

  @jax.jit
  def segment_of(flat, offset, p, share):
    item, offset = work.segment_of(flat, offset, p, share, st, work._loads_of_flat(flat, sequences, st))
    t0, t1, _, _ = item.ranges[0]
    return (item.head, item.b, t0, t1, item.splits[0], item.fill_from), offset

  segments = []
  for p in range(num_programs):
    share = share_of(jnp.int32(p))
    offset = share.first_offset
    for flat in range(int(share.first), int(share.end)):
      fields, offset = segment_of(jnp.int32(flat), offset, jnp.int32(p), share)
      segments.append((p, *map(int, fields)))
  return segments, int(share.size)


@pytest.mark.parametrize("ahead,unroll", [(True, 0), (False, 0), (False, 1), (False, 3)],
                         ids=["xla-walk", "kernel-walk", "kernel-loop", "kernel-loop-by-3"])
@pytest.mark.parametrize("seed,batch,head_blocks,num_programs,max_pieces,window", [
    (0, 7, 3, 10, 2, None), (1, 5, 2, 24, 3, None), (2, 1, 1, 6, 4, None), (3, 9, 2, 132, 5, 300),
    (4, 6, 1, 4, 2, None)])
def test_stream_k_walk_covers_each_tile_once_in_capped_pieces(seed, batch, head_blocks, num_programs, max_pieces,
                                                              window, ahead, unroll):
  # What the kernel relies on: every visible tile of every (head block, sequence) lies in exactly one segment,
  # a sequence's pieces take slots 0, 1, ... below max_pieces in program order, the segment that ends it (and
  # only that one) names its piece count as fill_from, and every sequence, empty ones included, is visited.
  rng = np.random.default_rng(seed)
  block_kv, num_queries = 16, 2
  lengths = rng.integers(0, 400, size=batch)
  lengths[rng.integers(batch)] = 0 if batch > 1 else lengths[0]
  if seed == 4:
    lengths[:] = 0   # nothing to stream: the last program writes every empty sequence
  segments, share = _walk_segments(lengths, block_kv=block_kv, num_queries=num_queries, window=window,
                                   head_blocks=head_blocks, num_programs=num_programs, max_pieces=max_pieces,
                                   ahead=ahead, unroll=unroll)
  per_program = {}
  for h in range(head_blocks):
    for b, length in enumerate(lengths):
      first, end = (int(x) for x in plan.visible_tiles(jnp.int32(length), block_kv=block_kv,
                                                       num_queries=num_queries, window=window))
      mine = sorted((p, t0, t1, slot, fill) for p, hh, bb, t0, t1, slot, fill in segments if (hh, bb) == (h, b))
      assert mine, f"sequence {b} of head block {h} is never visited"
      if end <= first:
        assert [(slot, fill) for _, _, _, slot, fill in mine] == [(0, 1)]
        continue
      covered = [t for _, t0, t1, _, _ in mine for t in range(t0, t1)]
      assert covered == list(range(first, end))
      assert [slot for *_, slot, _ in mine] == list(range(len(mine))) and len(mine) <= max_pieces
      assert [fill for *_, fill in mine] == [max_pieces] * (len(mine) - 1) + [len(mine)]
      for p, t0, t1, _, _ in mine:
        per_program[p] = per_program.get(p, 0) + t1 - t0
  assert all(tiles <= share for tiles in per_program.values())

@pytest.mark.parametrize("seed,block_kv,num_queries,window,num_splits,chunks", [
    (0, 64, 1, None, 8, 66), (1, 16, 3, None, 4, 10), (2, 64, 2, 700, 16, 200), (3, 32, 1, None, 1, 5),
])
def test_every_visible_tile_is_in_exactly_one_split(seed, block_kv, num_queries, window, num_splits, chunks):
  rng = np.random.default_rng(seed)
  capacity = 4096
  lengths = np.concatenate([rng.integers(0, capacity + 1, size=29), [0, 1, capacity]]).astype(np.int32)
  per_split = plan.balanced_tiles_per_split(jnp.asarray(lengths), block_kv=block_kv, num_queries=num_queries,
                                            num_splits=num_splits, window=window, chunks=chunks)
  assert per_split.shape == (1,) and per_split.dtype == jnp.int32
  per_split = int(per_split[0])
  assert per_split >= plan.MIN_TILES_PER_SPLIT
  kw = dict(block_kv=block_kv, num_queries=num_queries, num_splits=num_splits, window=window,
            tiles_per_split=per_split)
  nonempty = 0
  for length in lengths:
    first_key = 0 if window is None else max(length - num_queries + 1 - window, 0)
    visible = set(range(first_key // block_kv, -(-length // block_kv)))
    covered = []
    for split in range(num_splits):
      t0, t1, a, c = (int(x) for x in plan.split_tile_range(length, split, **kw))
      assert t0 <= a <= c <= t1
      assert t1 - t0 <= per_split
      covered += range(t0, t1)
      nonempty += t1 > t0
    assert sorted(covered) == sorted(visible)   # each once, none missing, none past the length
    active = int(plan.active_splits(length, **kw))
    assert active == sum(1 for s in range(num_splits) if int(np.diff(plan.split_tile_range(length, s, **kw)[:2])[0]))
  total = sum(max(-(-int(n) // block_kv) - (0 if window is None else max(int(n) - num_queries + 1 - window, 0) // block_kv), 0)
              for n in lengths)
  # About `chunks` work items: never fewer tiles per split than an even cut would give.
  assert per_split >= -(-total // chunks)


@pytest.mark.parametrize("window,start,one_loop", [(None, None, False), (300, None, False), (None, 5, False),
                                                    (300, 5, True)])
def test_tile_loops_run_each_tile_once_masked_where_it_must_be(window, start, one_loop):
  # The loops a kernel runs over a split's tiles: every tile once, in order, and masked outside [a, c); a leading
  # masked loop only where a window or a window start can mask a range's first tiles.
  for t0, t1, a, c in ((0, 9, 0, 8), (2, 9, 4, 9), (3, 3, 3, 3), (0, 4, 1, 1)):
    if window is None and start is None and a > t0:
      continue   # not a range a call without either makes
    loops = plan.tile_loops(t0, t1, a, c, window=window, start=start, one_loop=one_loop)
    tiles = [(tile, masked) for lo, hi, masked in loops for tile in range(lo, hi)]
    assert [tile for tile, _ in tiles] == list(range(t0, t1))
    assert all(masked for tile, masked in tiles if not a <= tile < c)
    expected = 1 if one_loop else 2 + plan.masks_leading_tiles(window=window, start=start)
    assert len(loops) == expected, loops


def test_a_long_sequence_among_short_ones_takes_more_splits():
  lengths = jnp.asarray([8192, 64, 64, 64, 100, 0, 64, 64], jnp.int32)
  kw = dict(block_kv=64, num_queries=1, window=None)
  per_split = plan.balanced_tiles_per_split(lengths, num_splits=16, chunks=40, **kw)
  long_splits = int(plan.active_splits(8192, num_splits=16, tiles_per_split=per_split[0], **kw))
  short_splits = int(plan.active_splits(100, num_splits=16, tiles_per_split=per_split[0], **kw))
  assert long_splits > 1 and short_splits == 1
  # The per-sequence plan gives every sequence the same count instead.
  assert int(plan.active_splits(100, num_splits=16, **kw)) == 2


@pytest.mark.parametrize("batch,ragged,one_split", [(128, False, True), (128, True, False), (16, False, False)])
def test_near_equal_lengths_that_fill_a_wave_stay_unsplit(batch, ragged, one_split):
  # 132 SMs, 128 heads (two row blocks, one latent head): the MLA kernel's plan at T8192.
  chunks = plan.balanced_chunks(num_kv_heads=1, row_blocks=2, num_sms=132)
  lengths = np.full(batch, 8192, np.int32)
  if ragged:
    lengths = np.random.default_rng(batch).integers(1, 8193, size=batch).astype(np.int32)
  else:
    lengths[:batch // 4] -= 700   # near-equal: a quarter of them 11 tiles shorter
  per_split = int(plan.balanced_tiles_per_split(jnp.asarray(lengths), block_kv=64, num_queries=1, num_splits=5,
                                                window=None, chunks=chunks)[0])
  assert (per_split >= 128) == one_split   # 128 tiles: the longest sequence in one split


def test_choose_balanced_splits():
  kw = dict(num_kv_heads=8, row_blocks=1, capacity=32768, block_kv=64, num_sms=132)
  chunks = plan.balanced_chunks(num_kv_heads=8, row_blocks=1, num_sms=132)
  assert chunks == 66
  assert plan.choose_balanced_splits(batch=128, **kw) == 1   # the batch alone makes the waves
  assert plan.choose_balanced_splits(batch=16, **kw) == 9    # room for a sequence twice the mean
  assert plan.choose_balanced_splits(batch=1, **kw) == plan.MAX_SPLITS
  short = dict(kw, capacity=256)
  assert plan.choose_balanced_splits(batch=1, **short) == 1   # 4 tiles: one split


def test_split_plan_is_validated():
  for config_type in (pkv.TritonConfig, pkv.MosaicGPUConfig, pkv.MosaicMLAConfig):
    with pytest.raises(ValueError, match="split_plan"):
      config_type(split_plan="even")
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    SplitPlan(kind="balanced", num_splits=2, block_kv=64)
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    SplitPlan(kind="per_sequence", num_splits=2, block_kv=64, tiles_per_split=jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match=r"tiles_per_split must be int32 \[1\]"):
    SplitPlan(kind="balanced", num_splits=2, block_kv=64,
              tiles_per_split=jnp.ones((2,), jnp.int32)).check(block_kv=64, batch=3)
  SplitPlan(kind="balanced", num_splits=2, block_kv=64, tiles_per_split=jnp.ones((1,), jnp.int32)).check(
      block_kv=64, batch=3)


def test_resolve_fills_the_balanced_split_bound():
  problem = sweeps.problem_args((32, 8), (16, 32768), None)[1]
  config = triton_config.resolve_config(problem, pkv.TritonConfig(split_plan="balanced"), num_sms=132)
  assert config.split_plan == "balanced"
  assert config.num_splits == plan.choose_balanced_splits(
      batch=16, num_kv_heads=8, row_blocks=1, capacity=32768, block_kv=config.block_kv, num_sms=132,
      programs_per_sm=triton_config.PROGRAMS_PER_SM)


# ---------------------------------------------------------------- kernels (interpret mode)

def _call(case, impl, config, paged, **options):
  if paged:
    return pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                      return_lse=True, impl=impl, config=config, **options)
  return pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl, config=config,
                              **options)


@pytest.mark.parametrize("impl,block_kv,seq_len,lengths,num_queries,paged,merge,options", [
    # 16 tiles / 4 splits: per split 4 tiles; the 50-token sequence takes one split, not four.
    pytest.param("triton", 16, 256, [256, 50, 16, 0], None, False, False, {}, marks=pytest.mark.slow),
    ("triton", 16, 256, [256, 50, 16, 0], 2, True, True, dict(window=90, softcap=20.0)),
    pytest.param("mosaic_gpu", 64, 512, [512, 200, 64, 0], None, False, False, {}, marks=pytest.mark.slow),
    ("mosaic_gpu", 64, 512, [37, 512, 0, 300], 2, True, False, dict(window=300)),
], ids=["triton-dense", "triton-paged-S2-window-merged", "mosaic-dense", "mosaic-paged-S2-window"])
def test_balanced_plan_matches_reference(interpret_mode, impl, block_kv, seq_len, lengths, num_queries, paged,
                                         merge, options):
  case = make_case(40 + len(options), batch=len(lengths), seq_len=seq_len, num_heads=8, num_kv_heads=2,
                   head_dim=64, dtype=jnp.bfloat16, num_queries=num_queries, lengths=lengths,
                   page_size=64 if paged else None)
  fields = dict(merge_in_kernel=merge) if impl == "triton" else {}
  config = CONFIG_TYPE[impl](block_kv=block_kv, num_stages=2, num_splits=4 if impl == "triton" else 2,
                             split_plan="balanced", **fields)
  balanced = _call(case, impl, config, paged, **options)
  check_against_reference(case, balanced, **options)


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_kernels_cut_the_splits_the_plan_says(impl):
  # The 4-tile sequence takes one split of 4 tiles under the plan; per sequence, two splits of two.
  from pallas_kv.config import AttentionOptions
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  from pallas_kv.kernels.triton import decode as triton_decode
  block_kv = 16 if impl == "triton" else 64
  case = make_case(50, batch=3, seq_len=8 * block_kv, num_heads=8, num_kv_heads=2, head_dim=64,
                   dtype=jnp.bfloat16, lengths=[8 * block_kv, 4 * block_kv - 3, 0])
  rows = frame.pack_queries(case.q[:, None], 2)
  kernel = triton_decode if impl == "triton" else mgpu_decode
  interpret = True
  own = dict(num_warps=4, sequence_order="given", merge_in_kernel=False)
  if impl == "mosaic_gpu":
    from jax.experimental.pallas import mosaic_gpu as plgpu
    interpret = plgpu.InterpretGPUParams()
    own = dict(kv_groups=1, pipeline_qk=False, persistent=False, tile_consumers=1, sequence_order="given",
               queries_as_n=False, values_as_stored=False, paired_terms=False)
  lse = {}
  for kind in ("per_sequence", "balanced"):
    config = CONFIG_TYPE[impl](block_kv=block_kv, num_stages=2, num_splits=2, split_plan=kind, **own)
    per_split = (None if kind == "per_sequence" else
                 plan.balanced_tiles_per_split(case.lengths, block_kv=block_kv, num_queries=1, num_splits=2,
                                               window=None, chunks=1000))
    split_plan = SplitPlan(kind=kind, num_splits=2, block_kv=block_kv, tiles_per_split=per_split)
    _, lse[kind] = kernel.decode_partials(rows, case.k, case.v, case.lengths, num_queries=1,
                                          options=AttentionOptions(scale=0.125), config=config, plan=split_plan,
                                          interpret=interpret)
  has_keys = {kind: np.isfinite(np.asarray(x))[:, 0, :, 0] for kind, x in lse.items()}   # [B, splits]
  np.testing.assert_array_equal(has_keys["per_sequence"], [[1, 1], [1, 1], [0, 0]])
  np.testing.assert_array_equal(has_keys["balanced"], [[1, 1], [1, 0], [0, 0]])


# ---------------------------------------------------------------- CUDA lowering (CPU)

@pytest.mark.parametrize("impl,page_size", [("mosaic_gpu", None), ("mosaic_gpu", 16), ("triton", None),
                                            ("triton", 16)])
def test_balanced_plan_lowers_for_cuda(impl, page_size):
  args, problem = sweeps.problem_args((32, 8), (16, 32768), page_size)
  resolve = mgpu_config.resolve_config if impl == "mosaic_gpu" else triton_config.resolve_config
  config = resolve(problem, CONFIG_TYPE[impl](split_plan="balanced"), num_sms=132)
  assert config.num_splits > 1
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  lower_for_cuda(functools.partial(op, impl=impl, config=config), *args)


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("impl,page_size", tiered(
    [(impl, page) for impl in ("triton", "mosaic_gpu") for page in (None, 16)],
    every_tier=[("triton", 16), ("mosaic_gpu", None)]))
def test_gpu_balanced_plan_on_a_ragged_batch(impl, page_size):
  # One long sequence among short and empty ones: the plan gives the long one most of the splits.
  rng = np.random.default_rng(7)
  lengths = rng.integers(1, 2048, size=16)
  lengths[3], lengths[9] = 16384, 0
  case = make_case(60, batch=16, seq_len=16384, num_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=jnp.bfloat16, lengths=lengths, page_size=page_size)
  resolve = mgpu_config.resolve_config if impl == "mosaic_gpu" else triton_config.resolve_config
  problem = sweeps.problem_args((32, 8), (16, 16384), page_size)[1]
  config = resolve(problem, CONFIG_TYPE[impl](split_plan="balanced"), num_sms=132)
  assert config.split_plan == "balanced" and config.num_splits > 1
  check_against_reference(case, _call(case, impl, config, page_size is not None))


# ---------------------------------------------------------------- the stream-K plan

@pytest.mark.parametrize("seed,block_kv,num_queries,window,programs", [
    (0, 64, 1, None, 33), (1, 16, 3, None, 7), (2, 64, 2, 700, 49), (3, 32, 1, None, 200),
])
def test_stream_k_programs_cover_every_tile_once(seed, block_kv, num_queries, window, programs):
  # Walks the programs' tiles as the kernel does (each finds its sequence with `locate`): each
  # visible tile once, every program at most `chunk` tiles, and the partial slots the programs
  # write are the ones each merge reads.
  rng = np.random.default_rng(seed)
  capacity = 4096
  lengths = np.concatenate([rng.integers(0, capacity + 1, size=29), [0, 1, capacity, 0]]).astype(np.int32)
  padded = np.concatenate([lengths, np.zeros(64 - lengths.size, np.int32)])   # the kernel's power-of-two vector
  layout = StreamKLayout.of(jnp.asarray(padded), block_kv=block_kv, num_queries=num_queries, window=window,
                            num_programs=programs)
  first = np.broadcast_to(np.asarray(layout.first), padded.shape)
  covered = {b: [] for b in range(lengths.size)}
  written = {}   # (program, slot) -> sequence
  locate = jax.jit(layout.locate)
  for w in range(programs):
    lo, hi = (int(x) for x in layout.program_range(w))
    assert 0 <= hi - lo <= int(layout.chunk)
    for g in range(lo, hi):
      b, seq_start = (int(x) for x in locate(g))
      assert b < lengths.size
      covered[b].append(int(first[b]) + g - seq_start)
      if g == max(seq_start, lo) and int(layout.pieces(b)[1]) > 1:   # a segment's first tile
        slot = int(StreamKLayout.piece_slot(g != lo, seq_start == g))
        assert (w, slot) not in written   # two slots per program are enough
        written[w, slot] = b
  for b, length in enumerate(lengths):
    first_key = 0 if window is None else max(length - num_queries + 1 - window, 0)
    assert sorted(covered[b]) == list(range(first_key // block_kv, -(-length // block_kv)))
    first_program, pieces, mid_chunk = (int(x) for x in layout.pieces(b))
    if pieces > 1:
      read = [(first_program + j, int(StreamKLayout.piece_slot(bool(mid_chunk), j == 0)))
              for j in range(pieces)]
      assert sorted(read) == sorted(key for key, seq in written.items() if seq == b)
    assert (pieces == 0) == (not covered[b])


def test_stream_k_programs_fill_one_wave():
  assert plan.stream_k_programs(num_kv_heads=8, row_blocks=1, num_sms=132, programs_per_sm=2) == 33
  assert plan.stream_k_programs(num_kv_heads=8, row_blocks=1, num_sms=132, programs_per_sm=3) == 49
  assert plan.stream_k_programs(num_kv_heads=512, row_blocks=1, num_sms=132, programs_per_sm=2) == 1
  problem = sweeps.problem_args((32, 8), (64, 8192), None)[1]
  config = triton_config.resolve_config(problem, pkv.TritonConfig(split_plan="stream_k"), num_sms=132)
  assert config.num_splits == 132 * 2 // 8
  paged = sweeps.problem_args((32, 8), (64, 8192), 16)[1]   # paged: three programs per SM
  assert triton_config.resolve_config(paged, pkv.TritonConfig(split_plan="stream_k"), num_sms=132).num_splits == 49
  per_sequence = triton_config.resolve_config(paged, pkv.TritonConfig(split_plan="per_sequence"), num_sms=132)
  assert per_sequence.split_plan == "per_sequence" and per_sequence.num_splits != 49
  # A config that fixes none of the plan's fields takes the default's plan (stream-K pays here).
  free = triton_config.resolve_config(paged, pkv.TritonConfig(block_kv=16), num_sms=132)
  assert (free.split_plan, free.num_splits, free.block_kv) == ("stream_k", 49, 16)


@pytest.mark.parametrize("heads,case,page_size,stream_k", [
    ((32, 8), (16, 32768), None, True), ((32, 8), (64, 8192), None, True), ((28, 4), (32, 8192), None, True),
    ((32, 8), (8, 8192), None, False),     # 4 sequences per program's share: many pieces to merge
    ((32, 8), (128, 4096), None, True),    # short sequences, but a long share a program (~16K tokens)
    ((32, 8), (32, 4096), None, False),    # short sequences and short shares: the cuts show
    ((32, 8), (64, 2048), None, False),
    ((32, 8), (160, 8192), None, False),   # B > 4 W
    ((32, 8), (16, 32768), 64, True),      # paged: W = 49 (three programs per SM), B = 0.33 W
    ((32, 8), (128, 8192), 16, True),      # paged, B = 2.6 W
    ((32, 8), (160, 8192), 64, False),     # paged, B > 2.7 W
    ((32, 8), (32, 131072), None, False),  # T > 32768: behind per-sequence splits
    ((16, 8), (32, 8192), None, False),    # head_dim 256 (Gemma): not measured
])
def test_default_takes_stream_k_where_measured(heads, case, page_size, stream_k):
  args, problem = sweeps.problem_args(heads, case, page_size)
  if heads == (16, 8):
    problem = dataclasses.replace(problem, head_dim=256)
  config = triton_config.resolve_config(problem, None, num_sms=132)
  assert (config.split_plan == "stream_k") == stream_k
  if stream_k:
    assert config.num_splits == 132 * (2 if page_size is None else 3) // heads[1]
    assert not config.merge_in_kernel
  # A config that fixes none of split_plan, num_splits and sequence_order takes the same plan, its
  # own fields kept; one that fixes any of them is never rewritten; one-byte caches keep
  # per-sequence splits.
  free = triton_config.resolve_config(problem, pkv.TritonConfig(block_kv=32, num_stages=2), num_sms=132)
  assert (free.block_kv, free.num_stages) == (32, 2)
  assert (free.split_plan, free.num_splits) == (config.split_plan, config.num_splits)
  for fixed in (pkv.TritonConfig(num_splits=4), pkv.TritonConfig(split_plan="per_sequence"),
                pkv.TritonConfig(sequence_order="longest_first")):
    assert triton_config.resolve_config(problem, fixed, num_sms=132).split_plan == "per_sequence"
  assert triton_config.resolve_config(problem, None, dtype=jnp.int8, num_sms=132).split_plan == "per_sequence"


@pytest.mark.parametrize("lengths,programs,paged,num_queries,options", [
    ([256, 50, 16, 0, 200], 3, False, None, {}),                    # short sequences share a program
    ([256, 0, 256, 17, 100], 4, True, 2, dict(window=90, softcap=20.0)),
    ([0, 0, 0], 2, False, None, {}),                                # no tiles at all
    ([256, 9, 130], 64, False, None, {}),   # more programs than tiles: one-tile pieces, up to 16 merged
    ([256, 0, 40], 1, False, None, {}),     # one program per head: no partials, no counters
], ids=["dense-ragged", "paged-S2-window-softcap", "all-empty", "programs-over-tiles", "one-program"])
def test_stream_k_matches_reference(interpret_mode, lengths, programs, paged, num_queries, options):
  case = make_case(70 + programs, batch=len(lengths), seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64,
                   dtype=jnp.bfloat16, num_queries=num_queries, lengths=lengths, page_size=64 if paged else None)
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=programs, split_plan="stream_k")
  check_against_reference(case, _call(case, "triton", config, paged, **options), **options)


def test_stream_k_with_two_row_blocks(interpret_mode):
  # 9 new tokens x 16 q heads per kv head = 144 packed rows at D 64: two row blocks, each with its
  # own programs, partial rows and counters.
  case = make_case(85, batch=3, seq_len=64, num_heads=16, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   num_queries=9, lengths=[64, 20, 47])
  assert triton_config.row_blocking(144, 64)[1] == 2
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=3, split_plan="stream_k")
  check_against_reference(case, _call(case, "triton", config, False))


def test_stream_k_with_sinks_scales_and_no_lse(interpret_mode):
  # int8 with per-token scales (the scale refs hold the whole batch) and sinks, output only.
  lengths = [100, 128, 0, 33]
  case = make_case(80, batch=4, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   lengths=lengths, kv_dtype=jnp.int8)
  rng = np.random.default_rng(80)
  options = {name: jnp.asarray(rng.uniform(0.005, 0.02, (4, 128, 2)), jnp.float32) for name in ("k_scale", "v_scale")}
  options["sinks"] = jnp.asarray(rng.standard_normal(8), jnp.float32)
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=3, split_plan="stream_k")
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl="triton", config=config, **options)
  ref = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl="xla", **options)
  assert out.shape == ref.shape
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


def test_stream_k_is_validated():
  from pallas_kv.config import AttentionOptions
  from pallas_kv.kernels.triton import decode as triton_decode
  with pytest.raises(ValueError, match="split_plan='stream_k' must be one of"):   # not on the MLA kernel
    pkv.MosaicMLAConfig(num_splits=4, split_plan="stream_k")
  with pytest.raises(ValueError, match="sequence_order must be 'given'"):
    pkv.TritonConfig(num_splits=4, split_plan="stream_k", sequence_order="longest_first")
  case = make_case(81, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  rows = frame.pack_queries(case.q[:, None], 2)
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=4, split_plan="stream_k", num_warps=4,
                            sequence_order="given", merge_in_kernel=False)
  with pytest.raises(ValueError, match="call decode_merged"):
    triton_decode.decode_partials(rows, case.k, case.v, case.lengths, num_queries=1,
                                  options=AttentionOptions(scale=0.125), config=config,
                                  plan=SplitPlan(kind="stream_k", num_splits=4, block_kv=16), interpret=True)


@pytest.mark.parametrize("page_size", [None, 16])
def test_stream_k_lowers_for_cuda(page_size):
  args, problem = sweeps.problem_args((32, 8), (64, 8192), page_size)
  config = triton_config.resolve_config(problem, pkv.TritonConfig(split_plan="stream_k"), num_sms=132)
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  module = lower_for_cuda(functools.partial(op, impl="triton", config=config), *args).mlir_module()
  assert module.count(TRITON_CUSTOM_CALL) == 1   # the merge is in the launch


_STREAM_K_SHAPES = [(16, 16384, True), (64, 4096, True), (32, 2048, False)]


@pytest.mark.gpu   # the GPU tier: each shape once, dense and paged
@pytest.mark.parametrize("page_size,batch,seq_len,ragged", tiered(
    [(page, *shape) for page in (None, 16) for shape in _STREAM_K_SHAPES],
    every_tier=[(None, *_STREAM_K_SHAPES[0]), (16, *_STREAM_K_SHAPES[1]), (None, *_STREAM_K_SHAPES[2])]))
def test_gpu_stream_k(page_size, batch, seq_len, ragged):
  # Many programs cut and merge the same sequences concurrently: the counters' ordering on a GPU.
  rng = np.random.default_rng(batch)
  lengths = rng.integers(1, seq_len + 1, size=batch) if ragged else np.full(batch, seq_len)
  if ragged:
    lengths[1] = 0
  case = make_case(90 + batch, batch=batch, seq_len=seq_len, num_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=jnp.bfloat16, lengths=lengths, page_size=page_size)
  problem = sweeps.problem_args((32, 8), (batch, seq_len), page_size)[1]
  for programs_per_sm in (2, 3):
    programs = plan.stream_k_programs(num_kv_heads=8, row_blocks=1, num_sms=pkv.runtime.num_sms(),
                                      programs_per_sm=programs_per_sm)
    config = triton_config.resolve_config(problem, pkv.TritonConfig(split_plan="stream_k", num_splits=programs))
    check_against_reference(case, _call(case, "triton", config, page_size is not None))


# ---------------------------------------------------------------- the longest-first sequence order

def test_longest_first_is_a_stable_descending_order():
  order = plan.longest_first(jnp.asarray([5, 9, 0, 9, 7]))
  assert order.dtype == jnp.int32 and order.tolist() == [1, 3, 4, 0, 2]
  lengths = jnp.asarray([5, 9, 0, 9, 7, 1])
  order = plan.long_short(lengths)
  assert order.dtype == jnp.int32 and order.tolist() == [1, 2, 3, 5, 4, 0]   # 9, 0, 9, 1, 7, 5
  assert sorted(plan.long_short(lengths[:5]).tolist()) == list(range(5))   # odd B: a permutation


@pytest.mark.parametrize("paged,merge,num_splits,kv_dtype", [
    (False, False, 2, jnp.int8),   # dense: q, K/V, per-token scales and the partials go through the order
    (True, True, 3, None),         # paged: the block-table rows; merged in the kernel's launch
    (False, True, 1, None),        # one split: the kernel writes the output rows itself
], ids=["dense-int8-partials", "paged-merged", "dense-one-split"])
def test_longest_first_gives_the_bits_of_batch_order(interpret_mode, paged, merge, num_splits, kv_dtype):
  # Only the schedule changes: each sequence's result must be the same bits, in its own place.
  case = make_case(60 + num_splits, batch=5, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64,
                   dtype=jnp.float16 if kv_dtype else jnp.bfloat16, lengths=[40, 128, 0, 97, 113],
                   page_size=32 if paged else None, kv_dtype=kv_dtype)
  options = {}
  if kv_dtype is not None:
    rng = np.random.default_rng(num_splits)
    options = {name: jnp.asarray(rng.uniform(0.005, 0.02, (5, 128, 2)), jnp.float32)
               for name in ("k_scale", "v_scale")}

  def call(order):
    config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=num_splits, merge_in_kernel=merge,
                              sequence_order=order)
    return _call(case, "triton", config, paged, **options)

  given = call("given")
  for order in ("longest_first", "long_short"):
    ordered = call(order)
    if kv_dtype is None:
      check_against_reference(case, ordered)
    for a, b in zip(given, ordered):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sequence_order_is_validated():
  for config_type in (pkv.TritonConfig, pkv.MosaicMLAConfig, pkv.MosaicGPUConfig):
    with pytest.raises(ValueError, match="sequence_order"):
      config_type(sequence_order="shortest_first")
  ordered = SplitPlan(kind="per_sequence", num_splits=2, block_kv=64, order=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"order must be int32 \[3\]"):
    ordered.check(block_kv=64, batch=3)
  with pytest.raises(ValueError, match="made for 64-token tiles"):
    ordered.check(block_kv=32, batch=2)
  # make_plan takes the config's order over the lengths, clamped as the kernels clamp them.
  lengths = jnp.asarray([5, 900, 0, 9, 7], jnp.int32)
  problem = sweeps.problem_args((32, 8), (5, 512), None)[1]
  config = pkv.TritonConfig(block_kv=64, num_stages=2, num_splits=2, split_plan="per_sequence", num_warps=4,
                            sequence_order="longest_first", merge_in_kernel=False)
  made = plan.make_plan(lengths, problem=problem, config=config, window=None, row_blocks=1)
  assert (made.kind, made.num_splits, made.block_kv, made.tiles_per_split) == ("per_sequence", 2, 64, None)
  assert made.order.tolist() == [1, 3, 4, 0, 2]
  given = plan.make_plan(lengths, problem=problem, config=dataclasses.replace(config, sequence_order="given"),
                         window=None, row_blocks=1)
  assert given.order is None


@pytest.mark.parametrize("paged", [False, True])
def test_longest_first_lowers_for_cuda(paged):
  # The benchmark's ragged B64 T8192 row: the argsort and the kernel; 2 splits add the merge kernel.
  q = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((64,), jnp.int32)
  kw = dict(impl="triton", config=pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=2,
                                                   sequence_order="longest_first"))
  if paged:
    pages = jax.ShapeDtypeStruct((64 * 128 + 3, 64, 8, 128), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((64, 128), jnp.int32)
    module = lower_for_cuda(functools.partial(pkv.paged_decode_attention, **kw), q, pages, pages, tables,
                            lengths).mlir_module()
  else:
    kv = jax.ShapeDtypeStruct((64, 8192, 8, 128), jnp.bfloat16)
    module = lower_for_cuda(functools.partial(pkv.decode_attention, **kw), q, kv, kv, lengths).mlir_module()
  assert module.count(TRITON_CUSTOM_CALL) == 2 and "stablehlo.sort" in module


@pytest.mark.parametrize("batch,pieces", [(16, 4), (64, 2), (1, 34)])
def test_mosaic_stream_k_resolves_to_persistent_programs(batch, pieces):
  # Walked by the persistent programs; a sequence may take enough pieces that one twice the mean length does not
  # lengthen a share (8 kv heads, 132 SMs: 1 + 264 / (8 B)), and the walk has no more programs than pieces of work.
  _, problem = sweeps.problem_args((32, 8), (batch, 4096), None)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(split_plan="stream_k"), num_sms=132)
  assert config.complete and config.persistent and config.kv_groups == 1 and config.num_splits == pieces
  made = plan.make_plan(jnp.full((batch,), 4000, jnp.int32), problem=problem, config=config, window=None,
                        row_blocks=1, num_sms=132, walked=True)
  assert made.walk.num_programs == min(132, batch * 8 * (pieces - 1))
  # A call's own plan leaves the walk to its programs, its loops unrolled by up to KERNEL_WALK_UNROLL: no vector, so
  # no launch before the kernel. A plan made ahead for several calls (`plan_splits`) computes the walk's vectors
  # once, in XLA.
  assert made.walk.in_kernel and made.kernel_inputs() == ()
  assert made.walk.unroll == min(batch, plan.KERNEL_WALK_UNROLL)
  ahead = plan.make_plan(jnp.full((batch,), 4000, jnp.int32), problem=problem, config=config, window=None,
                         row_blocks=1, num_sms=132, walked=True, ahead=True)
  assert ahead.walk.num_programs == made.walk.num_programs and len(ahead.kernel_inputs()) == 4


def test_a_large_batch_walks_its_plan_in_the_kernel_unless_made_ahead():
  # The programs' own walk is two loops over the batch at any batch (B128: 16 steps of 8); only a plan made ahead
  # walks vectors.
  batch = 128
  _, problem = sweeps.problem_args((32, 8), (batch, 1024), None)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(split_plan="stream_k"), num_sms=132)
  lengths = jnp.full((batch,), 1000, jnp.int32)
  made = plan.make_plan(lengths, problem=problem, config=config, window=None, row_blocks=1, num_sms=132, walked=True)
  assert made.walk.in_kernel and made.walk.unroll == plan.KERNEL_WALK_UNROLL and made.kernel_inputs() == ()
  assert not plan.make_plan(lengths, problem=problem, config=config, window=None, row_blocks=1, num_sms=132,
                            walked=True, ahead=True).walk.in_kernel
  assert plan.make_plan(jnp.full((batch,), 4000, jnp.int32), problem=problem, config=config, window=None,
                        row_blocks=1, num_sms=132).walk is None   # Triton plans stream-K in its kernel
