"""The split plan (`pallas_kv.kernels.plan`): which tiles each split of a sequence streams, how many
splits fill the GPU, and the `SplitPlan` a call computes once (`pallas_kv.plan_splits`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kv.kernels import plan


# ---------------------------------------------------------------- tile ranges and split counts

def _ranges(length, *, block_kv, num_queries, num_splits, window):
  return [tuple(int(x) for x in plan.split_tile_range(jnp.int32(length), split, block_kv=block_kv,
                                                        num_queries=num_queries, num_splits=num_splits,
                                                        window=window))
          for split in range(num_splits)]


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 200, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 4])
@pytest.mark.parametrize("num_queries,window", [(1, None), (3, None), (1, 70), (4, 100)])
def test_split_tile_ranges_cover_the_visible_tiles_once(length, num_splits, num_queries, window):
  bkv = 32
  ranges = _ranges(length, block_kv=bkv, num_queries=num_queries, num_splits=num_splits, window=window)
  # Tiles that hold a key some new token sees (positions L - S .. L - 1).
  visible = set()
  for s in range(num_queries):
    p = length - num_queries + s
    for t in range(max(p + 1, 0)):
      if window is None or t > p - window:
        visible.add(t // bkv)
  covered = [tile for t0, t1, _, _ in ranges for tile in range(t0, t1)]
  assert sorted(covered) == sorted(set(covered)), "a tile belongs to two splits"
  assert set(covered) == visible
  sizes = [t1 - t0 for t0, t1, _, _ in ranges]
  assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= max(sizes) // 2 + 1
  # The splits with tiles come first; active_splits counts them (the in-kernel merge reads those).
  active = int(plan.active_splits(jnp.int32(length), block_kv=bkv, num_queries=num_queries,
                                  num_splits=num_splits, window=window))
  assert [size > 0 for size in sizes] == [True] * active + [False] * (num_splits - active)
  for t0, t1, a, c in ranges:
    assert t0 <= a <= c <= t1
    for tile in range(a, c):   # the unmasked body: every new token sees every key of the tile
      for s in range(num_queries):
        p = length - num_queries + s
        keys = range(tile * bkv, (tile + 1) * bkv)
        assert all(t <= p and (window is None or t > p - window) for t in keys)


def test_a_sequence_s_ranges_depend_only_on_its_length_and_the_split_count():
  # The same length gives the same tiles per split, whatever the capacity or batch around it.
  for length in (5, 100, 1000):
    first = _ranges(length, block_kv=64, num_queries=2, num_splits=4, window=None)
    assert first == _ranges(length, block_kv=64, num_queries=2, num_splits=4, window=None)


@pytest.mark.parametrize("batch,heads,capacity,want", [
    (1, 8, 32768, 16),     # 8 programs on 132 SMs: 132 // 8 = 16 splits, the context has room
    (1, 8, 512, 2),        # a short context: 8 tiles of 64 hold 2 splits of >= 4 tiles
    (32, 8, 4096, 1),      # 256 programs already fill 132 SMs
    (1, 1, 1 << 20, plan.MAX_SPLITS),
])
def test_choose_num_splits_fills_one_wave(batch, heads, capacity, want):
  got = plan.choose_num_splits(batch=batch, num_kv_heads=heads, row_blocks=1, capacity=capacity, block_kv=64,
                               num_sms=132)
  assert got == want


# ---------------------------------------------------------------- the SplitPlan

def test_split_plan_is_a_pytree_of_its_arrays():
  tiles, order = jnp.asarray([3], jnp.int32), jnp.asarray([2, 0, 1], jnp.int32)
  balanced = plan.SplitPlan(kind="balanced", num_splits=4, block_kv=64, tiles_per_split=tiles, order=order)
  leaves, treedef = jax.tree_util.tree_flatten(balanced)
  assert len(leaves) == 2 and leaves[0] is tiles and leaves[1] is order   # kind, num_splits, block_kv: static
  assert jax.tree_util.tree_unflatten(treedef, leaves) == balanced
  per_sequence = plan.SplitPlan(kind="per_sequence", num_splits=2, block_kv=64)
  assert jax.tree_util.tree_leaves(per_sequence) == []
  # The static fields are the tree's structure: another count or tile is another jit trace.
  assert jax.tree_util.tree_structure(per_sequence) != jax.tree_util.tree_structure(
      plan.SplitPlan(kind="per_sequence", num_splits=3, block_kv=64))
  doubled = jax.jit(lambda p: jax.tree.map(lambda x: 2 * x, p))(balanced)
  assert (doubled.kind, doubled.num_splits, doubled.block_kv) == ("balanced", 4, 64)
  assert doubled.tiles_per_split.tolist() == [6] and doubled.order.tolist() == [4, 0, 2]
  assert balanced.balanced and balanced.ordered and not balanced.stream_k
  assert balanced.kernel_inputs() == (order, tiles)   # the order first, then the tile count
  assert per_sequence.kernel_inputs() == () and not per_sequence.ordered


def test_split_plan_checks_its_fields():
  tiles = jnp.asarray([3], jnp.int32)
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    plan.SplitPlan(kind="per_sequence", num_splits=2, block_kv=64, tiles_per_split=tiles)
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    plan.SplitPlan(kind="stream_k", num_splits=2, block_kv=64, tiles_per_split=tiles)
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    plan.SplitPlan(kind="balanced", num_splits=2, block_kv=64)
  with pytest.raises(ValueError, match="kind='even' must be one of"):
    plan.SplitPlan(kind="even", num_splits=2, block_kv=64)
  balanced = plan.SplitPlan(kind="balanced", num_splits=2, block_kv=64, tiles_per_split=tiles)
  balanced.check(block_kv=64, batch=5)
  with pytest.raises(ValueError, match="made for 64-token tiles; the kernel streams 32"):
    balanced.check(block_kv=32, batch=5)
  with pytest.raises(ValueError, match=r"tiles_per_split must be int32 \[1\]"):
    plan.SplitPlan(kind="balanced", num_splits=2, block_kv=64,
                   tiles_per_split=jnp.asarray([3.0], jnp.float32)).check(block_kv=64, batch=5)
  with pytest.raises(ValueError, match=r"order must be int32 \[5\]"):
    plan.SplitPlan(kind="per_sequence", num_splits=2, block_kv=64,
                   order=jnp.arange(4, dtype=jnp.int32)).check(block_kv=64, batch=5)


def test_make_plan_follows_the_resolved_config():
  import sweeps
  from pallas_kv import TritonConfig
  _, problem = sweeps.problem_args((32, 8), (4, 4096), None)
  lengths = jnp.asarray([4096, 0, 5000, 100], jnp.int32)   # 5000: clamped to the capacity
  complete = dict(block_kv=64, num_stages=2, num_warps=4, merge_in_kernel=False)
  balanced = TritonConfig(num_splits=8, split_plan="balanced", sequence_order="given", **complete)
  made = plan.make_plan(lengths, problem=problem, config=balanced, window=None, row_blocks=1, num_sms=132)
  assert (made.kind, made.num_splits, made.block_kv, made.order) == ("balanced", 8, 64, None)
  chunks = plan.balanced_chunks(num_kv_heads=8, row_blocks=1, num_sms=132)
  want = plan.balanced_tiles_per_split(jnp.asarray([4096, 0, 4096, 100], jnp.int32), block_kv=64, num_queries=1,
                                       num_splits=8, window=None, chunks=chunks)
  np.testing.assert_array_equal(made.tiles_per_split, want)
  ordered = TritonConfig(num_splits=2, split_plan="per_sequence", sequence_order="longest_first", **complete)
  made = plan.make_plan(lengths, problem=problem, config=ordered, window=None, row_blocks=1, num_sms=132)
  assert (made.kind, made.num_splits, made.tiles_per_split) == ("per_sequence", 2, None)
  assert made.order.tolist() == [0, 2, 3, 1]   # 4096 and the clamped 5000 tie: batch order
  stream_k = TritonConfig(num_splits=33, split_plan="stream_k", sequence_order="given", **complete)
  made = plan.make_plan(lengths, problem=problem, config=stream_k, window=None, row_blocks=1, num_sms=132)
  assert (made.kind, made.num_splits, made.tiles_per_split, made.order) == ("stream_k", 33, None, None)
