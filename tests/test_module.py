"""DecodeAttention: steps against prefill, in-place caches, scan/vmap/grad, the tiny end-to-end decoder."""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from pallas_kv import cache as kv_cache
from pallas_kv import module
from harness import assert_matches_reference, relative_error, small_mla_layer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layer(**kw):
  base = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, impl="xla")
  return pkv.DecodeAttention(**(base | kw))


def _paged_cache(batch, max_pages, page_size, num_pages, num_kv_heads=2, head_dim=64, dtype=jnp.float32):
  pages = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype)
  return pkv.PagedKVCache(pages, pages, kv_cache.empty_block_tables(batch, max_pages),
                          jnp.zeros((batch,), jnp.int32))


def _reserve(cache, pool, num_new):
  pool, tables, ok = pkv.reserve_pages(pool, cache.block_tables, cache.lengths, num_new, cache.page_size)
  assert bool(ok)
  return dataclasses.replace(cache, block_tables=tables), pool


def test_rope_is_relative():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
  dot = lambda pq, pk: float(jnp.sum(module.rope(q, jnp.asarray([[pq]]), 100.0) *
                                     module.rope(k, jnp.asarray([[pk]]), 100.0)))
  np.testing.assert_allclose(dot(3, 1), dot(12, 10), rtol=1e-5)
  np.testing.assert_allclose(module.rope(q, jnp.zeros((1, 1), jnp.int32), 100.0), q)


@pytest.mark.parametrize("kind", ["dense", "paged"])
@pytest.mark.parametrize("options", [{}, dict(window=4, softcap=20.0, use_sinks=True)])
def test_decode_step_matches_prefill_of_the_longer_prompt(kind, options):
  """Decoding token L after a prefill of L tokens equals the last row of prefilling L + 1 tokens."""
  layer = _layer(**options)
  params = layer.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (2, 7, 64))
  if kind == "dense":
    empty = pkv.KVCache.create(2, 32, 2, 64, jnp.float32)
    prep = lambda c, n: c
  else:
    pool = pkv.PagePool.create(12)
    empty = _paged_cache(2, 4, 8, 12)
    state = {}
    def prep(c, n):
      c, state["pool"] = _reserve(c, state.get("pool", pool), n)
      return c
  prefill = jax.jit(layer.prefill)   # one compile per prompt length, not op by op
  _, cache = prefill(params, x[:, :6], prep(empty, 6))
  y_step, cache = jax.jit(layer)(params, x[:, 6], prep(cache, 1))
  if kind == "paged":
    state.clear()
  y_full, _ = prefill(params, x, prep(empty, 7))
  assert int(cache.lengths[0]) == 7
  assert relative_error(y_step, y_full[:, 6]) < 1e-5


def test_mla_step_matches_prefill():
  layer, params, x = small_mla_layer()
  pool = pkv.PagePool.create(8)
  empty = pkv.PagedLatentCache(jnp.zeros((8, 4, 40)), kv_cache.empty_block_tables(2, 4),
                               jnp.zeros((2,), jnp.int32))
  def reserve(c, pool, n):
    pool, tables, ok = pkv.reserve_pages(pool, c.block_tables, c.lengths, n, c.page_size)
    assert bool(ok)
    return dataclasses.replace(c, block_tables=tables), pool
  prefill, step = jax.jit(layer.prefill), jax.jit(layer.__call__)   # one compile each, not op by op
  c, p = reserve(empty, pool, 4)
  _, c = prefill(params, x[:, :4], c)
  c, p = reserve(c, p, 1)
  y_step, c = step(params, x[:, 4], c)
  c2, _ = reserve(empty, pool, 5)
  y_full, _ = prefill(params, x, c2)
  assert relative_error(y_step, y_full[:, 4]) < 1e-5


def test_donated_cache_is_updated_in_place():
  layer = _layer()
  params = layer.init(jax.random.key(5))
  cache = pkv.KVCache.create(4, 1024, 2, 64, jnp.bfloat16)
  x = jax.ShapeDtypeStruct((4, 1, 64), jnp.float32)
  compiled = jax.jit(layer, donate_argnums=2).lower(params, x, cache).compile()
  stats = compiled.memory_analysis()
  cache_bytes = cache.k.nbytes + cache.v.nbytes
  assert stats.alias_size_in_bytes >= cache_bytes  # the output cache aliases the input
  # The append itself needs no temporary: the scatter writes into the donated buffers.
  new = jax.ShapeDtypeStruct((4, 1, 2, 64), jnp.bfloat16)
  append = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0).lower(cache, new, new).compile()
  stats = append.memory_analysis()
  assert stats.alias_size_in_bytes >= cache_bytes
  assert stats.temp_size_in_bytes < cache.k.nbytes // 100


def test_scan_over_layers_vmap_and_grad():
  layer = _layer(num_kv_heads=1)
  num_layers = 3
  params = jax.vmap(layer.init)(jax.random.split(jax.random.key(6), num_layers))
  caches = jax.vmap(lambda _: pkv.KVCache.create(2, 16, 1, 64, jnp.float32))(jnp.arange(num_layers))
  x = jax.random.normal(jax.random.key(7), (2, 1, 64))

  def stack(x, caches, params):
    def body(x, pc):
      y, c = layer(pc[0], x, pc[1])
      return x + y, c
    return jax.lax.scan(body, x, (params, caches))

  out, new_caches = jax.jit(stack)(x, caches, params)
  one_layer = jax.jit(lambda p, x, c: layer(p, x, c))   # compiled once for the loops below
  loop_x = x
  for i in range(num_layers):
    y, c = one_layer(jax.tree.map(lambda a: a[i], params), loop_x, jax.tree.map(lambda a: a[i], caches))
    loop_x = loop_x + y
    np.testing.assert_allclose(new_caches.k[i], c.k, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out, loop_x, rtol=1e-5, atol=1e-5)
  # vmap over layers (independent inputs) equals the loop.
  ys, _ = jax.jit(jax.vmap(layer, in_axes=(0, None, 0)))(params, x, caches)
  for i in range(num_layers):
    y, _ = one_layer(jax.tree.map(lambda a: a[i], params), x, jax.tree.map(lambda a: a[i], caches))
    np.testing.assert_allclose(ys[i], y, rtol=1e-5, atol=1e-5)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(stack(x, caches, p)[0] ** 2)))(params)
  for g in jax.tree.leaves(grads):
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


# ---------------------------------------------------------------------------- end to end

def _generate(impl, mla: bool = False):
  sys.path.insert(0, REPO)
  from examples import tiny_decoder
  attention = pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=64, impl=impl,
                                  mla=tiny_decoder.MLA if mla else None)
  model = tiny_decoder.TinyDecoder(attention, vocab_size=32, num_layers=2, mlp_size=128)
  params = model.init(jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, model.vocab_size)
  caches = model.empty_cache(batch=2, max_pages_per_seq=8, page_size=16, num_pages=16)
  generate = jax.jit(functools.partial(tiny_decoder.generate, model, num_steps=4))   # one compile, not op by op
  tokens, logits, _, _, ok = generate(params, prompt, caches, pkv.PagePool.create(16))
  assert bool(ok)
  return tokens, logits


@pytest.fixture(scope="module")
def xla_generation():
  return _generate("xla")


@pytest.mark.parametrize("impl", ["mosaic_gpu", "triton"])
def test_generation_matches_xla(xla_generation, interpret_mode, impl):
  tokens, logits = _generate(impl)
  want_tokens, want_logits = xla_generation
  np.testing.assert_array_equal(tokens, want_tokens)
  assert_matches_reference(logits, want_logits, jnp.bfloat16)


def test_mla_generation_on_the_mosaic_gpu_kernel_matches_xla(interpret_mode):
  want_tokens, want_logits = _generate("xla", mla=True)
  tokens, logits = _generate("mosaic_gpu", mla=True)
  assert pkv.last_impl() == "mosaic_gpu"
  np.testing.assert_array_equal(tokens, want_tokens)
  assert_matches_reference(logits, want_logits, jnp.bfloat16)


def test_pool_exhaustion_during_generation_reports():
  sys.path.insert(0, REPO)
  from examples import tiny_decoder
  attention = pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=64, impl="xla")
  model = tiny_decoder.TinyDecoder(attention, vocab_size=32, num_layers=1, mlp_size=64)
  params = model.init(jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(1), (2, 7), 0, model.vocab_size)
  caches = model.empty_cache(batch=2, max_pages_per_seq=8, page_size=4, num_pages=5)
  *_, ok = jax.jit(functools.partial(tiny_decoder.generate, model, num_steps=4))(params, prompt, caches,
                                                                                pkv.PagePool.create(5))
  assert not bool(ok)


def test_readme_layer_snippet_runs():
  readme = open(os.path.join(REPO, "README.md")).read()
  start = readme.index("```python\nimport dataclasses, jax")
  code = readme[start + len("```python\n"):readme.index("```", start + 3)]
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)   # pylint: disable=exec-used
  cache, pool = scope["cache"], scope["pool"]
  np.testing.assert_array_equal(cache.lengths, [0, 3])
  assert int(pool.num_free) == 31 and (np.asarray(cache.block_tables[0]) == -1).all()
  assert np.isfinite(np.asarray(scope["y"], np.float32)).all()


def test_prefill_attention_in_query_blocks_matches_one_block(monkeypatch):
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(37, dtype=jnp.int32), (2, 37))
  lengths = jnp.full((2,), 37, jnp.int32)
  # A new jit each time: the chunk is read when it traces.
  attend = lambda: jax.jit(lambda *a: module.prefix_attention(*a, scale=0.25, softcap=3.0))(q, k, v, positions,
                                                                                            lengths)
  whole = attend()
  monkeypatch.setattr(module, "PREFILL_CHUNK", 8)   # 5 blocks, the last one partial
  blocks = attend()
  np.testing.assert_allclose(np.asarray(blocks), np.asarray(whole), rtol=1e-6, atol=1e-6)
  kk = np.repeat(np.asarray(k)[:, :37], 2, axis=2)   # 4 q heads over 2 kv heads; keys past 37 unseen
  logits = np.einsum("bqhd,bkhd->bhqk", np.asarray(q), kk) * 0.25
  logits = 3.0 * np.tanh(logits / 3.0) + np.where(np.tri(37, dtype=bool), 0.0, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  ref = np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), np.repeat(np.asarray(v)[:, :37], 2, axis=2))
  assert relative_error(blocks, ref) < 1e-5


@pytest.mark.parametrize("paged", [False, True])
def test_prefill_continues_a_cache_in_chunks(paged):
  layer = _layer(num_heads=4, num_kv_heads=2, head_dim=16, softcap=20.0)
  params = layer.init(jax.random.key(3))
  x = jax.random.normal(jax.random.key(4), (2, 12, 64), jnp.float32)
  if paged:
    cache = pkv.PagedKVCache.create(batch=2, num_pages=8, page_size=4, max_pages_per_seq=4, num_kv_heads=2,
                                    head_dim=16, dtype=jnp.float32)
    cache, _ = _reserve(cache, pkv.PagePool.create(8), 12)
  else:
    cache = pkv.KVCache.create(batch=2, capacity=16, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  whole, whole_cache = jax.jit(layer.prefill)(params, x, cache)
  first, part = jax.jit(layer.prefill)(params, x[:, :8], cache)
  second, part = jax.jit(layer.prefill)(params, x[:, 8:], part)   # positions 8..11, over the cached 8
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, rtol=2e-5, atol=2e-5)
  assert np.asarray(part.lengths).tolist() == [12, 12]
  for a, b in zip(jax.tree.leaves(part), jax.tree.leaves(whole_cache)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  # A decode step after the chunks equals one after the whole prompt.
  step_x = jax.random.normal(jax.random.key(5), (2, 64), jnp.float32)
  if paged:
    part, _ = _reserve(part, pkv.PagePool.create(8), 1)
    whole_cache, _ = _reserve(whole_cache, pkv.PagePool.create(8), 1)
  np.testing.assert_allclose(layer(params, step_x, part)[0], layer(params, step_x, whole_cache)[0],
                             rtol=2e-5, atol=2e-5)


def test_ragged_prompts_in_one_prefill_equal_separate_prefills():
  layer = _layer(num_heads=4, num_kv_heads=2, head_dim=16)
  params = layer.init(jax.random.key(6))
  x = jax.random.normal(jax.random.key(7), (2, 9, 64), jnp.float32)
  lengths = [5, 9]
  cache = pkv.KVCache.create(batch=2, capacity=12, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  prefill = jax.jit(layer.prefill)   # a compile per shape, not one per op
  y, together = prefill(params, x, cache, jnp.asarray(lengths, jnp.int32))
  assert np.asarray(together.lengths).tolist() == lengths
  for b, n in enumerate(lengths):
    alone = pkv.KVCache.create(batch=1, capacity=12, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    y_alone, alone = prefill(params, x[b:b + 1, :n], alone)
    np.testing.assert_allclose(y[b, :n], y_alone[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(together.k[b], alone.k[0], rtol=2e-5, atol=2e-5)   # padding not stored


def test_mla_prefill_continues_a_cache():
  from examples import tiny_decoder
  layer = _layer(hidden_size=64, num_heads=4, mla=tiny_decoder.MLA)
  params = layer.init(jax.random.key(8))
  x = jax.random.normal(jax.random.key(9), (1, 10, 64), jnp.float32)
  rows = tiny_decoder.MLA.kv_lora_rank + tiny_decoder.MLA.qk_rope_head_dim
  cache = pkv.PagedLatentCache(jnp.zeros((4, 4, rows)), jnp.asarray([[2, 0, 3, -1]], jnp.int32),
                               jnp.zeros((1,), jnp.int32))
  prefill = jax.jit(layer.prefill)   # a compile per prompt length, not one per op
  whole, whole_cache = prefill(params, x, cache)
  first, part = prefill(params, x[:, :6], cache)
  second, part = prefill(params, x[:, 6:], part)
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(part.kv_pages, whole_cache.kv_pages, rtol=2e-5, atol=2e-5)


def test_plan_step_shared_by_the_layers_gives_each_layer_s_own_result(interpret_mode):
  # One plan for the step (balanced and ordered: both runtime vectors), passed to the call: the
  # same bits as the call planning for itself, eager and under jit.
  layer = _layer(impl="triton")
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=3, split_plan="balanced",
                            sequence_order="longest_first")
  params = layer.init(jax.random.key(11))
  x = jax.random.normal(jax.random.key(12), (3, 7, 64), jnp.float32)
  cache = pkv.KVCache.create(batch=3, capacity=64, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  _, cache = jax.jit(layer.prefill)(params, x[:, :6], cache, jnp.asarray([6, 2, 5], jnp.int32))
  step_x = x[:, 6]
  plan = layer.plan_step(cache, config=config)
  assert isinstance(plan, pkv.SplitPlan) and (plan.kind, plan.num_splits, plan.block_kv) == ("balanced", 3, 16)
  assert plan.order.tolist() == [0, 2, 1]   # lengths after the step: 7, 3, 6
  want, want_cache = layer(params, step_x, cache, config=config)
  got, got_cache = layer(params, step_x, cache, config=config, plan=plan)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))
  jitted, _ = jax.jit(lambda p, x, c, plan: layer(p, x, c, config=config, plan=plan))(params, step_x, cache, plan)
  np.testing.assert_array_equal(np.asarray(jitted), np.asarray(want))
  assert _layer().plan_step(cache) is None   # the xla impl runs no kernel: no plan
