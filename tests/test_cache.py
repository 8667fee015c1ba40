"""KV cache pytrees (appending through the block table, dense views, attention over shuffled pages)
and the page pool (reserve, release, exhaustion)."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest

import pallas_kv as pkv
from pallas_kv import cache as kv_cache
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


def test_dense_append_past_capacity_stores_nothing_for_that_sequence_and_says_so():
  rng = np.random.default_rng(1)
  cache = pkv.KVCache(_random(rng, (2, 4, 1, 2)), _random(rng, (2, 4, 1, 2)), jnp.asarray([3, 1], jnp.int32))
  k_new, v_new = _random(rng, (2, 3, 1, 2)), _random(rng, (2, 3, 1, 2))
  new, ok = jax.jit(lambda c, k, v: c.try_append(k, v))(cache, k_new, v_new)
  assert np.asarray(ok).tolist() == [False, True]
  assert np.asarray(new.lengths).tolist() == [3, 4]   # the refused sequence keeps its length
  np.testing.assert_array_equal(new.k[0], cache.k[0])   # and none of its tokens is stored
  np.testing.assert_array_equal(new.k[1, 1:4], k_new[1])
  # append reports the refusal in checked mode; a plain append traces no check.
  with pkv.checked():
    err, _ = checkify.checkify(jax.jit(lambda c, k, v: c.append(k, v)))(cache, k_new, v_new)
  assert "do not fit" in err.get()
  assert not jax.make_jaxpr(lambda c, k, v: c.append(k, v))(cache, k_new, v_new).effects


def test_append_of_more_tokens_than_the_capacity_raises_at_trace_time():
  cache = pkv.KVCache.create(batch=1, capacity=2, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  x = jnp.ones((1, 3, 2, 16))
  with pytest.raises(ValueError, match="3 new tokens per sequence cannot fit a cache of capacity 2"):
    cache.append(x, x)


def test_append_takes_num_new_tokens_per_sequence():
  rng = np.random.default_rng(4)
  cache = pkv.KVCache.create(batch=2, capacity=8, num_kv_heads=1, head_dim=2, dtype=jnp.float32)
  k_new = _random(rng, (2, 4, 1, 2))
  new, ok = cache.try_append(k_new, k_new, jnp.asarray([2, 4], jnp.int32))
  assert bool(np.all(ok)) and np.asarray(new.lengths).tolist() == [2, 4]
  np.testing.assert_array_equal(new.k[0, :2], k_new[0, :2])
  np.testing.assert_array_equal(new.k[0, 2:], 0.0)   # the padding is not stored
  with pytest.raises(ValueError, match="num_new must be an integer array"):
    cache.append(k_new, k_new, jnp.asarray([2.0, 4.0]))


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


def test_paged_append_past_table_stores_nothing():
  rng = np.random.default_rng(3)
  k = _random(rng, (1, 4, 1, 2))
  k_pages, tables, _ = paginate(k, 2, rng, spare_pages=2)
  cache = pkv.PagedKVCache(k_pages, k_pages, tables, jnp.asarray([4], jnp.int32))
  new, ok = cache.try_append(_random(rng, (1, 1, 2)), _random(rng, (1, 1, 2)))
  np.testing.assert_array_equal(new.k_pages, k_pages)
  assert not bool(ok[0]) and int(new.lengths[0]) == 4


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


# ---------------------------------------------------------------- page pool

def _paged_cache(batch, max_pages, page_size, num_pages, num_kv_heads=2, head_dim=64, dtype=jnp.float32):
  pages = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype)
  return pkv.PagedKVCache(pages, pages, kv_cache.empty_block_tables(batch, max_pages),
                          jnp.zeros((batch,), jnp.int32))


def test_reserve_assigns_distinct_pages_and_release_returns_them():
  pool = pkv.PagePool.create(10)
  tables = kv_cache.empty_block_tables(3, 4)
  lengths = jnp.asarray([0, 0, 0], jnp.int32)
  pool, tables, ok = pkv.reserve_pages(pool, tables, lengths, 5, 4)  # 2 pages each
  assert bool(ok) and int(pool.num_free) == 4
  held = np.asarray(tables)[:, :2]
  assert len(set(held.ravel().tolist())) == 6 and (held >= 0).all()
  assert (np.asarray(tables)[:, 2:] == kv_cache.UNALLOCATED).all()
  lengths = lengths + 5
  # Growing by 3 tokens from 5 to 8 needs no new page; to 9 needs one.
  pool2, tables2, ok = pkv.reserve_pages(pool, tables, lengths, 3, 4)
  assert bool(ok) and int(pool2.num_free) == 4
  np.testing.assert_array_equal(tables2, tables)
  pool3, tables3, ok = pkv.reserve_pages(pool, tables, lengths, 4, 4)
  assert bool(ok) and int(pool3.num_free) == 1
  assert len(set(np.asarray(tables3)[:, :3].ravel().tolist())) == 9
  # Release sequence 1: its 3 pages return, the others keep theirs.
  pool4, tables4, lengths4 = pkv.release_sequences(pool3, tables3, lengths + 4, jnp.asarray([False, True, False]), 4)
  assert int(pool4.num_free) == 4
  np.testing.assert_array_equal(lengths4, [9, 0, 9])
  assert (np.asarray(tables4)[1] == kv_cache.UNALLOCATED).all()
  free = set(np.asarray(pool4.free_pages)[: int(pool4.num_free)].tolist())
  assert set(np.asarray(tables3)[1, :3].tolist()) <= free
  assert not free & set(np.asarray(tables4)[[0, 2], :3].ravel().tolist())


def test_exhausted_pool_changes_nothing_and_reports():
  pool = pkv.PagePool.create(3)
  tables = kv_cache.empty_block_tables(2, 4)
  lengths = jnp.zeros((2,), jnp.int32)
  new_pool, new_tables, ok = jax.jit(pkv.reserve_pages, static_argnums=(3, 4))(pool, tables, lengths, 8, 4)
  assert not bool(ok)
  np.testing.assert_array_equal(new_tables, tables)
  assert int(new_pool.num_free) == 3
  # Outgrowing the block table is refused the same way.
  _, _, ok = pkv.reserve_pages(pkv.PagePool.create(100), tables, lengths, 17, 4)
  assert not bool(ok)


def test_append_to_unreserved_pages_stores_nothing_and_keeps_lengths():
  # Before reserve_pages: no page, so nothing is written, lengths stay, and attention sees no token.
  c = pkv.PagedKVCache.create(batch=1, num_pages=4, page_size=4, max_pages_per_seq=4, num_kv_heads=2, head_dim=16,
                              dtype=jnp.float32)
  x = jnp.ones((1, 3, 2, 16))
  new, ok = c.try_append(x, x)
  assert not bool(ok[0]) and int(new.lengths[0]) == 0
  np.testing.assert_array_equal(new.k_pages, c.k_pages)   # no wraparound into another page
  # One page reserved for 3 tokens of page 4: a 2-token append after 3 needs a second page, so
  # none of the two is stored; with the page, both are.
  pool, tables, _ = pkv.reserve_pages(pkv.PagePool.create(4), c.block_tables, c.lengths, 3, 4)
  c = dataclasses.replace(c, block_tables=tables).append(x, x)
  two = jnp.full((1, 2, 2, 16), 2.0)
  refused, ok = c.try_append(two, two)
  assert not bool(ok[0]) and int(refused.lengths[0]) == 3 and float(refused.k_pages[0, 3, 0, 0]) == 0.0
  pool, tables, _ = pkv.reserve_pages(pool, c.block_tables, c.lengths, 2, 4)
  taken, ok = dataclasses.replace(c, block_tables=tables).try_append(two, two)
  assert bool(ok[0]) and int(taken.lengths[0]) == 5


def test_latent_append_is_all_or_nothing():
  cache = pkv.PagedLatentCache(jnp.zeros((2, 4, 8)), jnp.asarray([[0, -1]], jnp.int32), jnp.asarray([2], jnp.int32))
  new, ok = cache.try_append(jnp.ones((1, 3, 8)))   # positions 2..4: position 4 has no page
  assert not bool(ok[0]) and int(new.lengths[0]) == 2 and float(jnp.abs(new.kv_pages).sum()) == 0.0
  new, ok = cache.try_append(jnp.ones((1, 2, 8)))
  assert bool(ok[0]) and int(new.lengths[0]) == 4 and float(new.kv_pages[0, 3, 0]) == 1.0


def test_pool_errors_at_trace_time():
  with pytest.raises(ValueError, match="num_pages"):
    pkv.PagePool.create(0)
  with pytest.raises(ValueError, match="num_new"):
    pkv.reserve_pages(pkv.PagePool.create(2), kv_cache.empty_block_tables(1, 2), jnp.zeros((1,), jnp.int32), -1, 4)


def test_append_reserving_takes_its_pages_from_the_pool():
  cache = pkv.PagedKVCache.create(batch=2, num_pages=3, page_size=4, max_pages_per_seq=4, num_kv_heads=1, head_dim=2,
                                  dtype=jnp.float32)
  pool = pkv.PagePool.create(3)
  x = jnp.ones((2, 3, 1, 2))
  cache, pool, ok = jax.jit(lambda c, p, k, v: c.append_reserving(p, k, v))(cache, pool, x, x)
  assert bool(ok) and np.asarray(cache.lengths).tolist() == [3, 3] and int(pool.num_free) == 1
  np.testing.assert_array_equal(cache.dense_view().k[:, :3], x)
  # Two more tokens each need a second page each: one is free, so nothing changes.
  again, same_pool, ok = cache.append_reserving(pool, x[:, :2], x[:, :2])
  assert not bool(ok) and np.asarray(again.lengths).tolist() == [3, 3] and int(same_pool.num_free) == 1
  np.testing.assert_array_equal(again.block_tables, cache.block_tables)
