"""Sequences sharing pages: fork (shared full pages, a copied partial page), reference counts
through release, retain and drop, and the pool's accounting over a random run of all of them."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv

PAGE_SIZE = 4


def _random(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _kv_cache(kind: str, batch: int = 3, num_pages: int = 12, max_pages: int = 4, heads: int = 2, dim: int = 8):
  """An empty cache of the kind: "float32", "tokens_last" (v [P, Hkv, D, page_size]), "int8"
  (per-token scales, v tokens last) or "latent" (a `PagedLatentCache`)."""
  if kind == "latent":
    return pkv.PagedLatentCache(jnp.zeros((num_pages, PAGE_SIZE, dim), jnp.float32),
                                pkv.empty_block_tables(batch, max_pages), jnp.zeros((batch,), jnp.int32))
  dtype, scales = (jnp.int8, "token") if kind == "int8" else (jnp.float32, None)
  return pkv.PagedKVCache.create(batch, num_pages, PAGE_SIZE, max_pages, heads, dim, dtype, scales, scales,
                                 v_tokens_last=kind != "float32")


def _new_tokens(rng, cache, num_tokens: int):
  """Random new tokens for every sequence of the cache: (kv,) latent, else (k, v)."""
  batch = cache.block_tables.shape[0]
  if isinstance(cache, pkv.PagedLatentCache):
    return (_random(rng, (batch, num_tokens, cache.kv_pages.shape[2])),)
  shape = (batch, num_tokens, *cache.k_pages.shape[2:])
  return _random(rng, shape), _random(rng, shape)


def _grow(cache, pool, row, new_tokens, count):
  """Appends the first `count` of new_tokens to sequence `row` only, reserving its pages.
  Returns (cache, pool, ok); all or nothing."""
  tables = cache.block_tables
  pool, row_table, reserved = pkv.reserve_pages(pool, tables[row][None], cache.lengths[row][None], count,
                                                cache.page_size)
  cache = dataclasses.replace(cache, block_tables=tables.at[row].set(row_table[0]))
  num_new = jnp.where(jnp.arange(tables.shape[0]) == row, count, 0)
  cache, ok = cache.try_append(*[x[:, :count] for x in new_tokens], num_new=num_new)
  return cache, pool, reserved & ok[row]


def _page_arrays(cache):
  """The arrays that hold something per page (values, per-token scales)."""
  if isinstance(cache, pkv.PagedLatentCache):
    return {"kv": cache.kv_pages}
  arrays = {"k": cache.k_pages, "v": cache.v_pages}
  arrays.update({name: s for name, s in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale))
                 if s is not None and s.ndim == 3})
  return arrays


@pytest.mark.parametrize("kind", ["float32", "tokens_last", "int8", "latent"])
def test_fork_shares_full_pages_and_copies_the_partial_one(kind):
  rng = np.random.default_rng(10)
  cache, pool = _kv_cache(kind), pkv.PagePool.create(12)
  cache, pool, ok = _grow(cache, pool, 0, _new_tokens(rng, cache, 6), 6)   # one full page, one half page
  assert bool(ok)
  forked, new_pool, ok = jax.jit(lambda c, p: c.fork(p, jnp.asarray([0]), jnp.asarray([2])))(cache, pool)
  assert bool(ok)
  parent, child = np.asarray(forked.block_tables[0]), np.asarray(forked.block_tables[2])
  assert child[0] == parent[0] and int(new_pool.ref_counts[parent[0]]) == 2
  assert child[1] >= 0 and child[1] != parent[1]
  assert int(new_pool.ref_counts[parent[1]]) == 1 and int(new_pool.ref_counts[child[1]]) == 1
  assert (child[2:] == pkv.UNALLOCATED).all() and np.asarray(forked.lengths).tolist() == [6, 0, 6]
  assert int(new_pool.num_free) == int(pool.num_free) - 1
  for name, pages in _page_arrays(forked).items():
    before = _page_arrays(cache)[name]
    assert float(jnp.abs(before[child[1]].astype(jnp.float32) - before[parent[1]]).max()) > 0, name
    np.testing.assert_array_equal(pages[child[1]], pages[parent[1]], err_msg=name)
    np.testing.assert_array_equal(pages[parent[1]], before[parent[1]], err_msg=name)


def _dense_like(kind: str, batch: int, capacity: int):
  """A contiguous cache of the kind, to replay the same appends on."""
  dtype, scales = (jnp.int8, "token") if kind == "int8" else (jnp.float32, None)
  return pkv.KVCache.create(batch, capacity, 2, 8, dtype, scales, scales, v_tokens_last=kind != "float32")


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_appends_after_fork_leave_the_other_sequence_unchanged(kind):
  rng = np.random.default_rng(11)
  cache, pool = _kv_cache(kind, batch=2), pkv.PagePool.create(12)
  prompt = _new_tokens(rng, cache, 6)
  cache, pool, _ = _grow(cache, pool, 0, prompt, 6)
  cache, pool, ok = cache.fork(pool, jnp.asarray([0]), jnp.asarray([1]))
  assert bool(ok)
  # Before they diverge, the child attends exactly as the parent, and the parent as before the fork.
  q = _random(rng, (1, 4, 8))
  attend = lambda c: pkv.paged_decode_attention(jnp.concatenate([q, q]), c.k_pages, c.v_pages, c.block_tables,
                                                c.lengths, k_scale=c.k_scale, v_scale=c.v_scale,
                                                v_tokens_last=c.v_tokens_last, impl="xla")
  out = attend(cache)
  np.testing.assert_array_equal(out[1], out[0])
  np.testing.assert_array_equal(out[0], attend(dataclasses.replace(cache, lengths=cache.lengths.at[1].set(0)))[0])
  # Three new tokens each, different: two into the partial page (copied for the child), one onto a new page.
  k_new, v_new = _new_tokens(rng, cache, 3)
  cache, pool, ok = jax.jit(lambda c, p, k, v: c.append_reserving(p, k, v))(cache, pool, k_new, v_new)
  assert bool(ok)
  # Each sequence holds its prompt and its own new tokens, as in a cache where nothing is shared.
  both = lambda x: jnp.concatenate([x[:1], x[:1]])
  dense = _dense_like(kind, 2, cache.capacity).append(both(prompt[0]), both(prompt[1])).append(k_new, v_new)
  view = cache.dense_view()
  np.testing.assert_array_equal(view.lengths, [9, 9])
  np.testing.assert_array_equal(view.k[:, :9], dense.k[:, :9])
  np.testing.assert_array_equal(view.v[..., :9] if view.v_tokens_last else view.v[:, :9],
                                dense.v[..., :9] if dense.v_tokens_last else dense.v[:, :9])
  if kind == "int8":
    np.testing.assert_array_equal(view.k_scale[:, :9], dense.k_scale[:, :9])
    np.testing.assert_array_equal(view.v_scale[:, :9], dense.v_scale[:, :9])
  assert not np.array_equal(view.k[0, 6:9], view.k[1, 6:9])


def _pool_state(pool):
  return [np.asarray(x) for x in (pool.free_pages, pool.num_free, pool.ref_counts)]


def _free_set(pool) -> list[int]:
  return sorted(np.asarray(pool.free_pages)[: int(pool.num_free)].tolist())


def _fork_of_whole_pages(rng):
  """Sequence 0 at 8 tokens (two full pages) forked into sequence 1: nothing to copy."""
  cache, pool = _kv_cache("float32", batch=3), pkv.PagePool.create(12)
  cache, pool, _ = _grow(cache, pool, 0, _new_tokens(rng, cache, 8), 8)
  tables, lengths = cache.block_tables, cache.lengths
  pool, tables, lengths, copy_src, copy_dst, ok = jax.jit(pkv.fork_sequences, static_argnums=5)(
      pool, tables, lengths, jnp.asarray([0]), jnp.asarray([1]), PAGE_SIZE)
  assert bool(ok) and copy_src.tolist() == [pkv.UNALLOCATED] and copy_dst.tolist() == [pkv.UNALLOCATED]
  return pool, tables, lengths


@pytest.mark.parametrize("together", [False, True])
def test_release_of_one_sharer_keeps_the_pages_and_of_both_frees_them_once(together):
  pool, tables, lengths = _fork_of_whole_pages(np.random.default_rng(12))
  shared = np.asarray(tables[0, :2])
  np.testing.assert_array_equal(tables[1, :2], shared)
  assert np.asarray(pool.ref_counts)[shared].tolist() == [2, 2] and int(pool.num_free) == 10
  release = jax.jit(pkv.release_sequences, static_argnums=4)
  if not together:
    pool, tables, lengths = release(pool, tables, lengths, jnp.asarray([True, False, False]), PAGE_SIZE)
    assert np.asarray(pool.ref_counts)[shared].tolist() == [1, 1] and int(pool.num_free) == 10
    assert not set(shared.tolist()) & set(_free_set(pool))
    np.testing.assert_array_equal(tables[1, :2], shared)
  pool, tables, lengths = release(pool, tables, lengths, jnp.asarray([True, True, False]), PAGE_SIZE)
  assert np.asarray(pool.ref_counts)[shared].tolist() == [0, 0] and int(pool.num_free) == 12
  assert _free_set(pool) == list(range(12))   # every page once
  assert (np.asarray(tables) == pkv.UNALLOCATED).all() and np.asarray(lengths).tolist() == [0, 0, 0]


def test_retain_and_drop_count_references_and_free_a_page_once():
  pool, tables, _ = _fork_of_whole_pages(np.random.default_rng(13))
  page, free_page = int(tables[0, 0]), _free_set(pool)[0]
  # Twice on a held page; a negative id and a free page are ignored.
  pool = jax.jit(pkv.retain_pages)(pool, jnp.asarray([page, -1, page, free_page]))
  assert int(pool.ref_counts[page]) == 4 and int(pool.ref_counts[free_page]) == 0 and int(pool.num_free) == 10
  pool = pkv.drop_pages(pool, jnp.asarray([page, -1, page, page]))
  assert int(pool.ref_counts[page]) == 1 and page not in _free_set(pool)
  # The last reference listed twice in one call (one too many): the page is pushed once, its count stays 0.
  pool = jax.jit(pkv.drop_pages)(pool, jnp.asarray([[page, free_page], [page, -1]]))
  assert int(pool.ref_counts[page]) == 0 and int(pool.num_free) == 11
  assert _free_set(pool).count(page) == 1 and _free_set(pool).count(free_page) == 1


def test_fork_into_several_children_and_of_an_empty_parent():
  rng = np.random.default_rng(14)
  cache, pool = _kv_cache("float32", batch=5, num_pages=16), pkv.PagePool.create(16)
  cache, pool, _ = _grow(cache, pool, 0, _new_tokens(rng, cache, 7), 7)
  # Sequence 0 into 1, 2 and 3 (parallel sampling): one shared page, three copies of the partial one.
  forked, new_pool, ok = cache.fork(pool, jnp.asarray([0, 0, 0]), jnp.asarray([1, 2, 3]))
  assert bool(ok) and np.asarray(forked.lengths).tolist() == [7, 7, 7, 7, 0]
  tables = np.asarray(forked.block_tables)
  assert (tables[1:4, 0] == tables[0, 0]).all() and int(new_pool.ref_counts[tables[0, 0]]) == 4
  assert len(set(tables[:4, 1].tolist())) == 4 and int(new_pool.num_free) == int(pool.num_free) - 3
  for row in (1, 2, 3):
    np.testing.assert_array_equal(forked.k_pages[tables[row, 1]], cache.k_pages[tables[0, 1]])
  _, _, ok = forked.fork(new_pool, jnp.asarray([4]), jnp.asarray([1]))   # child 1 is not empty
  assert not bool(ok)
  child, child_pool, ok = cache.fork(pool, jnp.asarray([4]), jnp.asarray([3]))
  assert bool(ok) and int(child.lengths[3]) == 0 and (np.asarray(child.block_tables[3]) == pkv.UNALLOCATED).all()
  for before, after in zip(_pool_state(pool), _pool_state(child_pool)):
    np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("case", ["short_pool", "child_not_empty", "child_is_parent", "child_twice",
                                  "row_out_of_range"])
def test_a_refused_fork_changes_nothing(case):
  rng = np.random.default_rng(15)
  cache, pool = _kv_cache("int8", batch=4, num_pages=5), pkv.PagePool.create(5)
  tokens = _new_tokens(rng, cache, 5)
  for row in (0, 1):   # 5 tokens each: 2 pages each, the second partly filled
    cache, pool, ok = _grow(cache, pool, row, tokens, 5)
    assert bool(ok)
  # Two copies needed, one page free; the other cases have room for their copy.
  parents, children = {"short_pool": ([0, 1], [2, 3]), "child_not_empty": ([0], [1]),
                       "child_is_parent": ([0, 2], [2, 3]), "child_twice": ([0, 0], [2, 2]),
                       "row_out_of_range": ([0], [4])}[case]
  fork = jax.jit(lambda c, p, a, b: c.fork(p, a, b))
  forked, new_pool, ok = fork(cache, pool, jnp.asarray(parents), jnp.asarray(children))
  assert not bool(ok)
  for before, after in zip(jax.tree.leaves((cache, pool)), jax.tree.leaves((forked, new_pool))):
    np.testing.assert_array_equal(after, before)
  _, _, _, copy_src, copy_dst, _ = pkv.fork_sequences(pool, cache.block_tables, cache.lengths, jnp.asarray(parents),
                                                      jnp.asarray(children), PAGE_SIZE)
  assert (np.asarray(copy_src) == pkv.UNALLOCATED).all() and (np.asarray(copy_dst) == pkv.UNALLOCATED).all()
  # With a page more in the pool, the two-copy fork goes through.
  if case == "short_pool":
    pool = pkv.drop_pages(pool, jnp.asarray([int(cache.block_tables[1, 0])]))
    _, _, ok = fork(cache, pool, jnp.asarray(parents), jnp.asarray(children))
    assert bool(ok)


# ---------------------------------------------------------------- accounting over a random run

def _check_accounting(pool, tables, lengths, page_size: int, retained: collections.Counter) -> int:
  """Each page's count is the (sequence, page) references plus the retains; the free stack holds
  exactly the pages of count 0, once each; a partly filled page belongs to one sequence only.
  Returns the most sequences that share one page."""
  tables, lengths, counts = np.asarray(tables), np.asarray(lengths), np.asarray(pool.ref_counts)
  held = -(-lengths // page_size)
  columns = np.arange(tables.shape[1])[None, :]
  assert (tables[columns >= held[:, None]] == pkv.UNALLOCATED).all()
  references = collections.Counter(tables[columns < held[:, None]].tolist())
  want = np.asarray([references[p] + retained[p] for p in range(pool.num_pages)])
  np.testing.assert_array_equal(counts, want)
  free = np.asarray(pool.free_pages)[: int(pool.num_free)].tolist()
  assert len(free) == len(set(free)) and sorted(free) == np.flatnonzero(counts == 0).tolist()
  for row in np.flatnonzero(lengths % page_size):
    assert references[tables[row, held[row] - 1]] == 1, f"sequence {row} shares its partial page"
  return max(references.values(), default=0)


def test_pool_accounting_over_a_random_run_under_jit():
  rng = np.random.default_rng(16)
  batch, page_size, num_pages = 4, 2, 14
  cache = pkv.PagedKVCache.create(batch, num_pages, page_size, 4, 1, 2, jnp.float32)
  pool, retained = pkv.PagePool.create(num_pages), collections.Counter()
  contents = [np.zeros((0, 1, 2), np.float32) for _ in range(batch)]   # each sequence's tokens
  grow = jax.jit(_grow, static_argnums=(2, 4))
  fork = jax.jit(lambda c, p, a, b: c.fork(p, a, b))
  release = jax.jit(pkv.release_sequences, static_argnums=4)
  retain, drop = jax.jit(pkv.retain_pages), jax.jit(pkv.drop_pages)
  done_steps, most_sharers = collections.Counter(), 0
  # 30 steps, a fixed number of each kind, in a random order.
  schedule = rng.permutation(["append"] * 10 + ["fork"] * 7 + ["release"] * 5 + ["retain"] * 4 + ["drop"] * 4)
  for step in schedule:
    lengths = np.asarray(cache.lengths)
    if step == "append":
      row, count = int(rng.integers(batch)), int(rng.integers(1, 4))
      tokens = _new_tokens(rng, cache, 3)
      cache, pool, ok = grow(cache, pool, row, tokens, count)
      if bool(ok):
        contents[row] = np.concatenate([contents[row], np.asarray(tokens[0][row, :count])])
    elif step == "fork":
      # Children mostly from the empty sequences, sometimes any other one (a fork to refuse).
      empty = np.flatnonzero(lengths == 0)
      size = int(rng.integers(1, 3))
      parents = rng.choice(np.flatnonzero(lengths > 0) if (lengths > 0).any() else batch, size=size)
      candidates = [r for r in (empty if rng.random() < 0.8 else range(batch)) if r not in parents]
      if not candidates:
        continue
      children = rng.choice(candidates, size=min(size, len(candidates)), replace=False)
      parents = parents[:len(children)]
      # Refused where a child is not empty or the pool lacks a page for each partial page to copy.
      want_ok = (lengths[children] == 0).all() and (lengths[parents] % page_size > 0).sum() <= int(pool.num_free)
      cache, pool, ok = fork(cache, pool, jnp.asarray(parents, jnp.int32), jnp.asarray(children, jnp.int32))
      assert bool(ok) == want_ok
      if bool(ok):
        done_steps["fork taken"] += 1
        for parent, child in zip(parents, children):
          contents[child] = contents[parent].copy()
    elif step == "release":
      done = rng.random(batch) < 0.4
      pool, tables, lengths_after = release(pool, cache.block_tables, cache.lengths, jnp.asarray(done), page_size)
      cache = dataclasses.replace(cache, block_tables=tables, lengths=lengths_after)
      for row in np.flatnonzero(done):
        contents[row] = contents[row][:0]
    elif step == "retain":
      pool_before = np.asarray(pool.ref_counts)
      held = np.flatnonzero(pool_before > 0)
      pages = np.append(rng.choice(held, size=2) if held.size else [], rng.integers(num_pages)).astype(np.int32)
      pool = retain(pool, jnp.asarray(np.append(pages, -1), jnp.int32))
      retained.update(int(p) for p in pages if pool_before[p] > 0)   # a free page is not retained
    elif step == "drop" and retained:
      listed = list(retained.elements())
      pages = [listed[i] for i in rng.permutation(len(listed))[:2]]
      pool = drop(pool, jnp.asarray(pages + [-1], jnp.int32))
      done_steps["drop taken"] += 1
      retained.subtract(pages)
      retained = +retained
    done_steps[step] += 1
    most_sharers = max(most_sharers, _check_accounting(pool, cache.block_tables, cache.lengths, page_size, retained))
    view = cache.dense_view()
    for row in range(batch):
      assert int(view.lengths[row]) == len(contents[row])
      np.testing.assert_array_equal(view.k[row, :len(contents[row])], contents[row])
  assert min(done_steps[s] for s in ("append", "fork taken", "release", "retain", "drop taken")) > 0, done_steps
  assert most_sharers >= 2
