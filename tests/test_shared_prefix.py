"""Shared prefixes (`pallas_kv.SharedPrefix`): the cascade equals the plain paged call on every impl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import TRITON_CUSTOM_CALL, assert_lse_matches, assert_matches_reference, lower_for_cuda, tiered
from pallas_kv import shared_prefix
from pallas_kv.shared_prefix import SharedPrefix


def _forked_batch(seed, *, page_size=4, num_queries=1, num_heads=8, num_kv_heads=2, head_dim=32, dtype=jnp.float32,
                  latent=False, max_pages=8):
  """A paged batch of forked groups and loners, and the SharedPrefix that says so.

  Group 0: rows 0-2 share 3 pages (their prefix ended mid-page: the partial page was copied into each
  row's own pages). Group 1: rows 3-4 share 2 pages, row 4's suffix holds only its new tokens (an empty
  suffix before them); the group claims 4 pages, more than row 4's new tokens leave, so 2 are shared.
  Group 2: row 5 alone. Group 3: no members. Rows 6 (no group) and 7 (length 0) attend alone.
  """
  rng = np.random.default_rng(seed)
  batch, num_pages = 8, 64
  tables = np.full((batch, max_pages), pkv.UNALLOCATED, np.int32)
  free = iter(rng.permutation(np.arange(8, num_pages)))
  shared = {0: [0, 1, 2], 1: [3, 4, 5, 6], 2: [7]}
  layout = {0: (0, 3), 1: (0, 3), 2: (0, 3), 3: (1, 4), 4: (1, 4), 5: (2, 1)}   # row: (group, pages it shares)
  for row, (group, count) in layout.items():
    tables[row, :count] = shared[group][:count]
  s = num_queries
  lengths = np.asarray([3 * page_size + 2 + s, 3 * page_size + 3 + s, 5 * page_size + s, 2 * page_size + 1 + s,
                        2 * page_size + s, page_size + 1 + s, 2 * page_size + s, 0], np.int32)
  for row in range(batch):
    held = -(-int(lengths[row]) // page_size)
    for column in range(held):
      if tables[row, column] < 0:
        tables[row, column] = next(free)
  members = np.asarray([[0, 1, 2], [3, 4, -1], [5, -1, -1], [-1, -1, -1]], np.int32)
  sharing = SharedPrefix(jnp.asarray(members), jnp.asarray([3, 4, 1, 2], jnp.int32))
  if latent:
    kv = jnp.asarray(rng.standard_normal((num_pages, page_size, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((batch, num_queries, num_heads, head_dim)), dtype)
    return q, kv, jnp.asarray(tables), jnp.asarray(lengths), sharing
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  k = jnp.asarray(rng.standard_normal(shape), dtype)
  v = jnp.asarray(rng.standard_normal(shape), dtype)
  q = jnp.asarray(rng.standard_normal((batch, num_queries, num_heads, head_dim)), dtype)
  if num_queries == 1:
    q = q[:, 0]
  return q, k, v, jnp.asarray(tables), jnp.asarray(lengths), sharing


def _both(q, k, v, tables, lengths, sharing, **options):
  """(shared, plain) (out, lse) of one batch, each call jitted whole (eager dispatch op by op is slower)."""
  call = jax.jit(lambda q, k, v, tables, lengths, sharing: pkv.paged_decode_attention(
      q, k, v, tables, lengths, return_lse=True, shared_prefix=sharing, **options))
  return call(q, k, v, tables, lengths, sharing), call(q, k, v, tables, lengths, None)


def _assert_same(shared, plain, dtype):
  assert_matches_reference(shared[0], plain[0], dtype)
  assert_lse_matches(shared[1], plain[1], dtype)


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("option", ["plain", "softcap", "sinks", "scale"])
def test_xla_shared_prefix_equals_the_plain_call(num_queries, option):
  q, k, v, tables, lengths, sharing = _forked_batch(1, num_queries=num_queries)
  options = {"plain": {}, "softcap": dict(softcap=4.0), "scale": dict(scale=0.3),
             "sinks": dict(sinks=jnp.asarray(np.random.default_rng(2).standard_normal(8), jnp.float32))}[option]
  shared, plain = _both(q, k, v, tables, lengths, sharing, impl="xla", **options)
  _assert_same(shared, plain, jnp.float32)
  assert np.isneginf(np.asarray(shared[1][7])).all()   # the empty row


def test_the_prefix_pass_reads_each_group_once():
  """The prefix pass is one sequence per group of the stacked queries; the shared pages appear in no
  suffix pass's table (so the plain call's reads of them, once per member, are gone)."""
  q, k, v, tables, lengths, sharing = _forked_batch(3)
  calls = []

  def spy(q, tables, lengths):
    calls.append((q.shape, np.asarray(tables), np.asarray(lengths)))
    return pkv.paged_decode_attention(q, k, v, tables, lengths, return_lse=True, impl="xla")

  shared_prefix.attend(spy, q, tables, lengths, sharing, page_size=4, num_kv_heads=2, return_lse=True, max_group=None)
  (prefix_q, prefix_tables, prefix_lengths), (_, suffix_tables, suffix_lengths) = calls
  assert prefix_q == (4, 2 * 3 * 4, 32)   # 4 groups, each kv head's 3 members x 4 q heads stacked
  np.testing.assert_array_equal(prefix_lengths, [12, 8, 4, 0])
  for row, pages in {0: [0, 1, 2], 3: [3, 4], 5: [7]}.items():
    assert not set(pages) & set(suffix_tables[row].tolist())
  np.testing.assert_array_equal(suffix_lengths, np.asarray(lengths) - [12, 12, 12, 8, 8, 4, 0, 0])


def test_window_and_window_start_run_unshared():
  q, k, v, tables, lengths, sharing = _forked_batch(4, num_queries=2)
  for options in (dict(window=5), dict(window_start=jnp.asarray([3, 0, 9, 1, 4, 2, 0, 0], jnp.int32))):
    shared, plain = _both(q, k, v, tables, lengths, sharing, impl="xla", **options)
    _assert_same(shared, plain, jnp.float32)


def test_members_past_the_stacking_limit_go_in_chunks(monkeypatch):
  """40 members x 4 q heads per kv head is over the kernels' 128: the prefix pass stacks 32, then 8."""
  rng = np.random.default_rng(5)
  batch, page_size = 40, 4
  k = jnp.asarray(rng.standard_normal((64, page_size, 2, 32)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((64, page_size, 2, 32)), jnp.float32)
  tables = np.full((batch, 4), -1, np.int32)
  tables[:, :2] = [0, 1]
  tables[:, 2] = np.arange(2, 2 + batch)
  lengths = jnp.asarray(rng.integers(9, 13, batch), jnp.int32)
  q = jnp.asarray(rng.standard_normal((batch, 8, 32)), jnp.float32)
  sharing = SharedPrefix(jnp.arange(batch, dtype=jnp.int32)[None], jnp.asarray([2], jnp.int32))
  real = shared_prefix.attend
  seen = []
  monkeypatch.setattr(shared_prefix, "attend", lambda *a, **kw: seen.append(kw["max_group"]) or real(*a, **kw))
  shared, plain = _both(q, k, v, jnp.asarray(tables), lengths, sharing, impl="xla")
  _assert_same(shared, plain, jnp.float32)
  assert seen == [128] and shared_prefix._chunks(batch, 4, 128) == 32


def test_grad_jit_and_vmap():
  q, k, v, tables, lengths, sharing = _forked_batch(6, num_queries=2)
  loss = lambda shared: lambda q, k, v: jnp.sum(jnp.sin(pkv.paged_decode_attention(
      q, k, v, tables, lengths, impl="xla", shared_prefix=sharing if shared else None)))
  for shared_grad, plain_grad in zip(jax.jit(jax.grad(loss(True), argnums=(0, 1, 2)))(q, k, v),
                                     jax.jit(jax.grad(loss(False), argnums=(0, 1, 2)))(q, k, v)):
    np.testing.assert_allclose(shared_grad, plain_grad, rtol=1e-4, atol=1e-5)
  qs = jnp.stack([q, q * 0.5])
  shares = jax.tree.map(lambda x: jnp.stack([x, x]), sharing)
  run = lambda q, s: pkv.paged_decode_attention(q, k, v, tables, lengths, impl="xla", shared_prefix=s)
  batched = jax.vmap(run)(qs, shares)
  for i in range(2):
    np.testing.assert_allclose(batched[i], jax.jit(run)(qs[i], None), rtol=1e-5, atol=1e-5)


def test_errors():
  q, k, v, tables, lengths, sharing = _forked_batch(7)
  with pytest.raises(TypeError, match="shared_prefix must be a pallas_kv.SharedPrefix"):
    pkv.paged_decode_attention(q, k, v, tables, lengths, impl="xla", shared_prefix=(sharing.members,))
  with pytest.raises(ValueError, match="does not combine with plan"):
    pkv.paged_decode_attention(q, k, v, tables, lengths, impl="xla", shared_prefix=sharing,
                               plan=pkv.SplitPlan("per_sequence", 1, 64))
  call = lambda sharing: pkv.paged_decode_attention(q, k, v, tables, lengths, impl="xla", shared_prefix=sharing)
  with pytest.raises(ValueError, match="members must be"):
    call(SharedPrefix(jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32)))
  with pytest.raises(ValueError, match="integer array"):
    call(SharedPrefix(jnp.zeros((1, 2), jnp.float32), jnp.zeros((1,), jnp.int32)))


def test_mla_shared_prefix_equals_the_plain_call():
  q, kv, tables, lengths, sharing = _forked_batch(8, num_queries=2, num_heads=16, head_dim=192, latent=True)
  plain = pkv.mla_decode_attention(q, kv, tables, lengths, v_head_dim=128, impl="xla", return_lse=True)
  shared = pkv.mla_decode_attention(q, kv, tables, lengths, v_head_dim=128, impl="xla", return_lse=True,
                                    shared_prefix=sharing)
  _assert_same(shared, plain, jnp.float32)


@pytest.mark.parametrize("impl,num_queries", tiered([("triton", 1), ("triton", 2), ("mosaic_gpu", 1),
                                                     ("mosaic_gpu", 2)], every_tier=[("triton", 2), ("mosaic_gpu", 1)]))
def test_kernels_shared_prefix_equals_the_plain_call(interpret_mode, impl, num_queries):
  page_size = 16 if impl == "mosaic_gpu" else 4
  q, k, v, tables, lengths, sharing = _forked_batch(9, num_queries=num_queries, page_size=page_size,
                                                    dtype=jnp.bfloat16, head_dim=64)
  sinks = jnp.asarray(np.random.default_rng(10).standard_normal(8), jnp.float32)
  shared = pkv.paged_decode_attention(q, k, v, tables, lengths, return_lse=True, impl=impl, shared_prefix=sharing,
                                      sinks=sinks, softcap=6.0)
  f32 = lambda x: x.astype(jnp.float32)
  plain = pkv.paged_decode_attention(f32(q), f32(k), f32(v), tables, lengths, return_lse=True, impl="xla",
                                     sinks=sinks, softcap=6.0)
  _assert_same(shared, plain, jnp.bfloat16)


@pytest.mark.slow
def test_mla_kernel_shared_prefix_equals_the_plain_call(interpret_mode):
  q, kv, tables, lengths, sharing = _forked_batch(11, num_queries=1, num_heads=16, head_dim=192, latent=True,
                                                  page_size=16, dtype=jnp.bfloat16)
  shared = pkv.mla_decode_attention(q, kv, tables, lengths, v_head_dim=128, impl="mosaic_gpu", return_lse=True,
                                    shared_prefix=sharing)
  f32 = lambda x: x.astype(jnp.float32)
  plain = pkv.mla_decode_attention(f32(q), f32(kv), tables, lengths, v_head_dim=128, impl="xla", return_lse=True)
  _assert_same(shared, plain, jnp.bfloat16)


@pytest.mark.parametrize("impl,marker", [("triton", TRITON_CUSTOM_CALL), ("mosaic_gpu", "custom_call @mosaic_gpu")])
def test_shared_prefix_lowers_for_cuda(impl, marker):
  """8 groups x 16 samples over shared pages: both passes lower to kernels, with no host-synced loop."""
  sds = jax.ShapeDtypeStruct
  pages = sds((4096, 16, 8, 128), jnp.bfloat16)
  call = lambda q, k, v, tables, lengths, members, num_pages: pkv.paged_decode_attention(
      q, k, v, tables, lengths, impl=impl, shared_prefix=SharedPrefix(members, num_pages))
  text = lower_for_cuda(call, sds((128, 32, 128), jnp.bfloat16), pages, pages, sds((128, 544), jnp.int32),
                        sds((128,), jnp.int32), sds((8, 16), jnp.int32), sds((8,), jnp.int32)).mlir_module()
  assert text.count(marker) >= 2 and "stablehlo.while" not in text


def test_from_tables_finds_the_groups_and_their_common_pages():
  q, k, v, tables, lengths, _ = _forked_batch(12, num_queries=2)
  found = SharedPrefix_from(tables, lengths, max_groups=4, max_members=3)
  groups = {tuple(int(m) for m in row if m >= 0): int(n) for row, n in zip(found.members, found.num_pages)}
  # Group 1's tables agree on 3 pages (3, 4, 5), though only 2 lie before row 4's new tokens.
  assert groups == {(0, 1, 2): 3, (3, 4): 3, (): 0}
  shared, plain = _both(q, k, v, tables, lengths, found, impl="xla")
  _assert_same(shared, plain, jnp.float32)
  # Past the bounds: one group of two members; the rest attend alone, with the same result.
  small = SharedPrefix_from(tables, lengths, max_groups=1, max_members=2)
  np.testing.assert_array_equal(small.members, [[0, 1]])
  shared, _ = _both(q, k, v, tables, lengths, small, impl="xla")
  _assert_same(shared, plain, jnp.float32)


def SharedPrefix_from(tables, lengths, **bounds):
  return jax.jit(shared_prefix.from_tables, static_argnames=("page_size", "max_groups", "max_members"))(
      tables, lengths, page_size=4, **bounds)


@pytest.mark.parametrize("kind", ["gqa", pytest.param("mla", marks=pytest.mark.slow)])   # MLA: make test-slow
def test_decode_attention_steps_over_forked_sequences(kind):
  """A prompt prefilled once, forked into three more rows, then decode steps with different tokens per
  row: a cache with prefix_groups gives the outputs of one without (and finds the group)."""
  import dataclasses
  page_size, batch, hidden = 4, 4, 64
  if kind == "gqa":
    layer = pkv.DecodeAttention(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=32, impl="xla")
    make = lambda groups: pkv.PagedKVCache.create(batch, 24, page_size, 6, 2, 32, jnp.float32, prefix_groups=groups)
  else:
    layer = pkv.DecodeAttention(hidden_size=hidden, num_heads=4, impl="xla", mla=pkv.MLAConfig(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))
    make = lambda groups: pkv.PagedLatentCache(jnp.zeros((24, page_size, 40)), pkv.empty_block_tables(batch, 6),
                                               jnp.zeros((batch,), jnp.int32), prefix_groups=groups)
  params = layer.init(jax.random.key(13))
  prompt = jax.random.normal(jax.random.key(14), (batch, 10, hidden))
  steps = jax.random.normal(jax.random.key(15), (3, batch, hidden))
  step, prefill = jax.jit(layer.__call__), jax.jit(layer.prefill)
  outputs = {}
  for groups in (None, (2, 4)):
    cache, pool = make(groups), pkv.PagePool.create(24)
    pool, first, ok = pkv.reserve_pages(pool, cache.block_tables[:1], cache.lengths[:1], 10, page_size)
    cache = dataclasses.replace(cache, block_tables=cache.block_tables.at[:1].set(first))
    _, cache = prefill(params, prompt, cache, num_new=jnp.asarray([10, 0, 0, 0]))
    cache, pool, forked = cache.fork(pool, jnp.asarray([0, 0, 0]), jnp.asarray([1, 2, 3]))
    assert bool(ok) and bool(forked)
    ys = []
    for x in steps:
      pool, tables, ok = pkv.reserve_pages(pool, cache.block_tables, cache.lengths, 1, page_size)
      assert bool(ok)
      y, cache = step(params, x, dataclasses.replace(cache, block_tables=tables))
      ys.append(y)
    outputs[groups] = jnp.stack(ys)
    found = shared_prefix.from_tables(cache.block_tables, cache.lengths, page_size=page_size, max_groups=2,
                                      max_members=4)
    np.testing.assert_array_equal(found.members, [[0, 1, 2, 3], [-1, -1, -1, -1]])
    assert int(found.num_pages[0]) == 2   # the prompt's two full pages; its partial page was copied per row
  np.testing.assert_allclose(outputs[(2, 4)], outputs[None], rtol=1e-5, atol=1e-5)
  assert float(jnp.std(outputs[None][:, 0] - outputs[None][:, 1])) > 1e-3   # the rows did diverge


def _large_forked_batch(seed, *, groups, members, prefix, page_size, num_queries, latent=False):
  """`groups` x `members` rows, each group over one `prefix`-token prompt (its full pages shared, the
  partial one copied per row), then 1-300 private tokens per row; NaN in every page no row reads."""
  rng = np.random.default_rng(seed)
  batch = groups * members
  suffix = rng.integers(1, 300, batch) + num_queries
  lengths = prefix + suffix
  width = -(-int(lengths.max()) // page_size)
  shared_pages = prefix // page_size
  num_pages = groups * shared_pages + batch * (width - shared_pages) + 8
  order = iter(rng.permutation(num_pages))
  tables = np.full((batch, width), pkv.UNALLOCATED, np.int32)
  for g in range(groups):
    tables[g * members:(g + 1) * members, :shared_pages] = [next(order) for _ in range(shared_pages)]
  for row in range(batch):
    for column in range(shared_pages, -(-int(lengths[row]) // page_size)):
      tables[row, column] = next(order)
  dims = (512 + 64,) if latent else (8, 128)
  pages = rng.standard_normal((2, num_pages, page_size) + dims).astype(np.float32)
  read = np.zeros((num_pages, page_size), bool)
  for row in range(batch):
    for t in range(int(lengths[row])):
      read[tables[row, t // page_size], t % page_size] = True
  pages[:, ~read] = np.nan
  heads = 16 if latent else 32
  q = rng.standard_normal((batch, num_queries, heads, dims[-1])).astype(np.float32)
  sharing = SharedPrefix(jnp.asarray(np.arange(batch, dtype=np.int32).reshape(groups, members)),
                         jnp.full((groups,), shared_pages, jnp.int32))
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  return bf16(q), bf16(pages[0]), bf16(pages[1]), jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), sharing


@pytest.mark.gpu
@pytest.mark.parametrize("impl,num_queries", [("triton", 1), ("triton", 2), ("mosaic_gpu", 1), ("mosaic_gpu", 2)])
def test_gpu_shared_prefix_equals_the_plain_call(impl, num_queries):
  """4 groups x 16 samples over a 1,000-token prompt (ending mid-page), GQA 32 / 8 D128, page 16."""
  q, k, v, tables, lengths, sharing = _large_forked_batch(20 + num_queries, groups=4, members=16, prefix=1000,
                                                          page_size=16, num_queries=num_queries)
  shared = jax.jit(lambda *a: pkv.paged_decode_attention(*a, return_lse=True, impl=impl, shared_prefix=sharing))(
      q, k, v, tables, lengths)
  f32 = lambda x: x.astype(jnp.float32)
  clean = lambda x: jnp.nan_to_num(x.astype(jnp.float32))   # the reference multiplies unread slots by 0
  plain = pkv.paged_decode_attention(clean(q), clean(k), clean(v), tables, lengths, return_lse=True, impl="xla")
  _assert_same(shared, plain, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_mla_shared_prefix_equals_the_plain_call():
  """MLA (16 heads, latent 512 + rope 64, page 64) on Mosaic GPU: 2 groups x 16 samples over 2,000 tokens."""
  q, kv, _, tables, lengths, sharing = _large_forked_batch(30, groups=2, members=16, prefix=2000, page_size=64,
                                                           num_queries=1, latent=True)
  shared = jax.jit(lambda *a: pkv.mla_decode_attention(*a, v_head_dim=512, impl="mosaic_gpu", return_lse=True,
                                                       shared_prefix=sharing))(q, kv, tables, lengths)
  clean = lambda x: jnp.nan_to_num(x.astype(jnp.float32))
  plain = pkv.mla_decode_attention(clean(q), clean(kv), tables, lengths, v_head_dim=512, impl="xla", return_lse=True)
  _assert_same(shared, plain, jnp.bfloat16)
