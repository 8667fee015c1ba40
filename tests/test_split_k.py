"""Merging split-K partials: equal to attention over the whole range, whatever the split."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kv.kernels import split_k


def _partials(rng, scores, values, bounds):
  """Per-split normalised outputs and LSEs of softmax(scores) @ values over key ranges."""
  outs, lses = [], []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    s, v = scores[..., lo:hi], values[..., lo:hi, :]
    if hi == lo:
      outs.append(np.zeros(scores.shape + (values.shape[-1],))[..., 0, :])
      lses.append(np.full(scores.shape[:-1], -np.inf))
      continue
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    outs.append(np.einsum("...k,...kd->...d", e, v) / e.sum(-1)[..., None])
    lses.append(np.log(e.sum(-1)) + m[..., 0])
  return np.stack(outs, 2), np.stack(lses, 2)


@pytest.mark.parametrize("bounds", [(0, 24), (0, 10, 24), (0, 0, 7, 24, 24)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_equals_whole_softmax(bounds, with_sinks):
  rng = np.random.default_rng(len(bounds))
  b, h, r, t, d = 2, 3, 4, 24, 8
  scores = rng.standard_normal((b, h, r, t))
  values = rng.standard_normal((b, h, t, d))[:, :, None]  # shared by the rows
  values = np.broadcast_to(values, (b, h, r, t, d))
  out, lse = _partials(rng, scores, values, bounds)
  sinks = rng.standard_normal((h, r)) if with_sinks else None
  merged, merged_lse = split_k.merge_splits(jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32),
                                            None if sinks is None else jnp.asarray(sinks, jnp.float32))
  m = scores.max(-1, keepdims=True)
  e = np.exp(scores - m)
  denom = e.sum(-1) + (np.exp(sinks[None] - m[..., 0]) if with_sinks else 0.0)
  want = np.einsum("bhrk,bhrkd->bhrd", e, values) / denom[..., None]
  np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(merged_lse, np.log(e.sum(-1)) + m[..., 0], rtol=1e-5, atol=1e-5)


def test_merge_of_empty_splits_gives_zeros_and_minus_inf():
  out = jnp.full((1, 1, 3, 2, 4), jnp.nan)   # never read: a kernel may leave them unwritten
  lse = jnp.full((1, 1, 3, 2), -jnp.inf)
  for sinks in (None, jnp.ones((1, 2))):
    merged, merged_lse = split_k.merge_splits(out, lse, sinks)
    np.testing.assert_array_equal(merged, 0.0)
    assert np.isneginf(np.asarray(merged_lse)).all()


def test_pack_and_unpack_are_inverse():
  q = jnp.arange(2 * 3 * 8 * 5, dtype=jnp.float32).reshape(2, 3, 8, 5)  # [B, S, Hq, D]
  packed = split_k.pack_queries(q, num_kv_heads=2)  # [B, Hkv, S*G, D]
  assert packed.shape == (2, 2, 12, 5)
  # Row s*G + g of kv head h is token s of q head h*G + g.
  np.testing.assert_array_equal(packed[1, 1, 2 * 4 + 3], q[1, 2, 1 * 4 + 3])
  np.testing.assert_array_equal(split_k.unpack_rows(packed, 3), q)


# ---------------------------------------------------------------- tile ranges and split counts

def _ranges(length, *, block_kv, num_queries, num_splits, window):
  return [tuple(int(x) for x in split_k.split_tile_range(jnp.int32(length), split, block_kv=block_kv,
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
  active = int(split_k.active_splits(jnp.int32(length), block_kv=bkv, num_queries=num_queries,
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
    (1, 1, 1 << 20, split_k.MAX_SPLITS),
])
def test_choose_num_splits_fills_one_wave(batch, heads, capacity, want):
  got = split_k.choose_num_splits(batch=batch, num_kv_heads=heads, row_blocks=1, capacity=capacity, block_kv=64,
                                  num_sms=132)
  assert got == want


def test_packed_args_are_checked():
  q = jnp.zeros((2, 2, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
  lengths = jnp.zeros((2,), jnp.int32)
  split_k.check_packed_args(q, kv, kv, lengths, None, num_queries=2)
  with pytest.raises(ValueError, match="must share q.s dtype"):
    split_k.check_packed_args(q.astype(jnp.float16), kv, kv, lengths, None, num_queries=1)
  with pytest.raises(ValueError, match="num_queries=3"):
    split_k.check_packed_args(q, kv, kv, lengths, None, num_queries=3)
  with pytest.raises(ValueError, match="lengths must be int32"):
    split_k.check_packed_args(q, kv, kv, lengths.astype(jnp.float32), None, num_queries=1)
  with pytest.raises(ValueError, match="block_tables"):
    split_k.check_packed_args(q, kv, kv, lengths, jnp.zeros((3, 4), jnp.int32), num_queries=1)
