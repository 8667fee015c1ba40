"""KV cache pytrees: appending through the block table, dense views, attention over shuffled pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import make_case, paginate


def _random(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("num_new", [None, 3])
def test_dense_append_writes_at_lengths(num_new):
  rng = np.random.default_rng(0)
  cache = pkv.KVCache(_random(rng, (2, 8, 2, 4)), _random(rng, (2, 8, 2, 4)), jnp.asarray([2, 5], jnp.int32))
  s = 1 if num_new is None else num_new
  k_new = _random(rng, (2, s, 2, 4))
  v_new = _random(rng, (2, s, 2, 4))
  new = jax.jit(lambda c, k, v: c.append(k, v))(cache, k_new[:, 0] if num_new is None else k_new,
                                                 v_new[:, 0] if num_new is None else v_new)
  np.testing.assert_array_equal(new.lengths, cache.lengths + s)
  for b, start in enumerate([2, 5]):
    want_k = np.array(cache.k[b])
    want_k[start:start + s] = k_new[b, : 8 - start]
    np.testing.assert_array_equal(new.k[b], want_k)
    want_v = np.array(cache.v[b])
    want_v[start:start + s] = v_new[b, : 8 - start]
    np.testing.assert_array_equal(new.v[b], want_v)


def test_dense_append_past_capacity_drops_tokens():
  rng = np.random.default_rng(1)
  cache = pkv.KVCache(_random(rng, (1, 4, 1, 2)), _random(rng, (1, 4, 1, 2)), jnp.asarray([3], jnp.int32))
  new = cache.append(_random(rng, (1, 3, 1, 2)), _random(rng, (1, 3, 1, 2)))
  np.testing.assert_array_equal(new.k[:, :3], cache.k[:, :3])
  assert int(new.lengths[0]) == 6  # > capacity marks the overflow


@pytest.mark.parametrize("page_size", [2, 4])
def test_paged_append_matches_dense_append(page_size):
  rng = np.random.default_rng(2)
  b, t, hkv, d = 3, 16, 2, 4
  k, v = _random(rng, (b, t, hkv, d)), _random(rng, (b, t, hkv, d))
  lengths = jnp.asarray([0, 7, 13], jnp.int32)
  k_pages, tables, perm = paginate(k, page_size, rng)
  v_pages, _, _ = paginate(v, page_size, rng, permutation=perm)
  paged = pkv.PagedKVCache(k_pages, v_pages, tables, lengths)
  dense = pkv.KVCache(k, v, lengths)
  for step in range(2):
    k_new, v_new = _random(rng, (b, 2, hkv, d)), _random(rng, (b, 2, hkv, d))
    paged = jax.jit(lambda c, x, y: c.append(x, y))(paged, k_new, v_new)
    dense = dense.append(k_new, v_new)
  view = paged.dense_view()
  np.testing.assert_array_equal(view.k, dense.k)
  np.testing.assert_array_equal(view.v, dense.v)
  np.testing.assert_array_equal(view.lengths, dense.lengths)
  # Pages that no sequence owns are untouched.
  spare = np.setdiff1d(np.arange(k_pages.shape[0]), np.asarray(tables).ravel())
  np.testing.assert_array_equal(paged.k_pages[spare], k_pages[spare])


def test_paged_append_past_table_is_dropped():
  rng = np.random.default_rng(3)
  k = _random(rng, (1, 4, 1, 2))
  k_pages, tables, _ = paginate(k, 2, rng, spare_pages=2)
  cache = pkv.PagedKVCache(k_pages, k_pages, tables, jnp.asarray([4], jnp.int32))
  new = cache.append(_random(rng, (1, 1, 2)), _random(rng, (1, 1, 2)))
  np.testing.assert_array_equal(new.k_pages, k_pages)


@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_paged_attention_over_shuffled_pages_equals_dense_view(page_size):
  case = make_case(page_size, batch=3, seq_len=32, num_heads=8, num_kv_heads=2, head_dim=16, num_queries=2,
                   page_size=page_size)
  cache = pkv.PagedKVCache(case.k_pages, case.v_pages, case.block_tables, case.lengths)
  view = cache.dense_view()
  paged = pkv.paged_decode_attention(case.q, cache.k_pages, cache.v_pages, cache.block_tables, cache.lengths,
                                     impl="xla")
  dense = pkv.decode_attention(case.q, view.k, view.v, view.lengths, impl="xla")
  np.testing.assert_allclose(paged, dense, rtol=1e-6, atol=1e-6)
