"""The split-K frame (`pallas_kv.kernels.frame`): merging split-K partials equals attention over the whole
range whatever the split; the query row packing; the packed arguments every kernel checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kv.kernels import frame


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
  merged, merged_lse = frame.merge_splits(jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32),
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
    merged, merged_lse = frame.merge_splits(out, lse, sinks)
    np.testing.assert_array_equal(merged, 0.0)
    assert np.isneginf(np.asarray(merged_lse)).all()


def test_pack_and_unpack_are_inverse():
  q = jnp.arange(2 * 3 * 8 * 5, dtype=jnp.float32).reshape(2, 3, 8, 5)  # [B, S, Hq, D]
  packed = frame.pack_queries(q, num_kv_heads=2)  # [B, Hkv, S*G, D]
  assert packed.shape == (2, 2, 12, 5)
  # Row s*G + g of kv head h is token s of q head h*G + g.
  np.testing.assert_array_equal(packed[1, 1, 2 * 4 + 3], q[1, 2, 1 * 4 + 3])
  np.testing.assert_array_equal(frame.unpack_rows(packed, 3), q)


def test_packed_args_are_checked():
  q = jnp.zeros((2, 2, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
  lengths = jnp.zeros((2,), jnp.int32)
  frame.check_packed_args(q, kv, kv, lengths, None, num_queries=2)
  with pytest.raises(ValueError, match="must share q.s dtype"):
    frame.check_packed_args(q.astype(jnp.float16), kv, kv, lengths, None, num_queries=1)
  with pytest.raises(ValueError, match="num_queries=3"):
    frame.check_packed_args(q, kv, kv, lengths, None, num_queries=3)
  with pytest.raises(ValueError, match="lengths must be int32"):
    frame.check_packed_args(q, kv, kv, lengths.astype(jnp.float32), None, num_queries=1)
  with pytest.raises(ValueError, match="block_tables"):
    frame.check_packed_args(q, kv, kv, lengths, jnp.zeros((3, 4), jnp.int32), num_queries=1)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_is_one_reduction(with_sinks):
  # In XLA one launch: a variadic reduction over the splits, no separate max, sum or contraction.
  import jax
  out = jnp.zeros((2, 3, 4, 5, 8), jnp.float32)
  lse = jnp.zeros((2, 3, 4, 5), jnp.float32)
  sinks = jnp.zeros((3, 5), jnp.float32) if with_sinks else None
  text = jax.jit(frame.merge_splits).lower(out, lse, sinks).as_text()
  assert text.count("stablehlo.reduce") == 1 and "dot_general" not in text, text
