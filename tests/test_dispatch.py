"""A plain call dispatches like any jitted function: no effect in its jaxpr, host time near an einsum's.

A jaxpr with an effect (an always-traced checkify check, a debug callback) leaves jit's C++ fast
path for its Python one: ~10x the host time per call. Checks of runtime values are traced only
inside `pallas_kv.checked()`.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import make_case

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples.smollm2 import serving  # noqa: E402
from examples.smollm2.gguf_loader import LlamaConfig  # noqa: E402
from examples.smollm2.model import Llama  # noqa: E402

IMPLS = ["xla", "triton", "mosaic_gpu"]


def _effects(fn, *args):
  return jax.make_jaxpr(fn)(*args).effects


@pytest.mark.parametrize("impl", IMPLS)
def test_ops_trace_no_effect_outside_checked(impl):
  case = make_case(3, batch=2, seq_len=64, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                   dtype=jnp.bfloat16)
  dense = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl=impl)
  paged = lambda q, k, v, t, n: pkv.paged_decode_attention(q, k, v, t, n, impl=impl)
  assert not _effects(dense, case.q, case.k, case.v, case.lengths)
  assert not _effects(paged, case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
  with pkv.checked():
    assert _effects(dense, case.q, case.k, case.v, case.lengths)
    assert _effects(paged, case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)


@pytest.mark.parametrize("impl", ["xla", "mosaic_gpu"])
def test_mla_traces_no_effect_outside_checked(impl):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 64, 576)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((8, 64, 576)), jnp.bfloat16)
  tables = jnp.asarray(rng.permutation(8).reshape(2, 4), jnp.int32)
  lengths = jnp.asarray([200, 37], jnp.int32)
  mla = lambda q, kv, t, n: pkv.mla_decode_attention(q, kv, t, n, impl=impl)
  assert not _effects(mla, q, kv, tables, lengths)
  with pkv.checked():
    assert _effects(mla, q, kv, tables, lengths)


def test_decode_attention_layer_traces_no_effect():
  layer = pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, impl="xla")
  params = layer.init(jax.random.key(0))
  cache = pkv.KVCache.create(batch=2, capacity=32, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  x = jnp.ones((2, 64), jnp.float32)
  assert not _effects(layer, params, x, cache)
  pages = pkv.PagedKVCache.create(batch=2, num_pages=8, page_size=8, max_pages_per_seq=4, num_kv_heads=2,
                                  head_dim=16, dtype=jnp.float32)
  assert not _effects(layer, params, x, pages)


def _tiny_llama():
  config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, eos_token_id=2)
  keys = iter(jax.random.split(jax.random.key(0), 16))
  w = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
  n, h, kv, d, f, layers = 4, 32, 2, 8, 48, 2
  params = dict(embed=w(64, h), final_norm=jnp.ones((h,)), layers=dict(
      attn_norm=jnp.ones((layers, h)), mlp_norm=jnp.ones((layers, h)),
      attn=dict(wq=w(layers, h, n, d), wk=w(layers, h, kv, d), wv=w(layers, h, kv, d), wo=w(layers, n, d, h)),
      w_gate=w(layers, h, f), w_up=w(layers, h, f), w_down=w(layers, f, h)))
  return config, params


def test_smollm2_decode_step_traces_no_effect():
  config, params = _tiny_llama()
  model = Llama(config, impl="xla")
  state = serving.empty_state(model, num_slots=2, num_pages=8, page_size=4, max_pages_per_seq=4)
  step = lambda params, state: serving.decode_steps.__wrapped__(model, params, state, 2)
  assert not _effects(step, params, state)


def _host_seconds_per_call(fn, args, calls: int = 200) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def test_a_jitted_call_costs_the_host_about_what_a_plain_jitted_attention_does():
  """Host time per call of jitted decode_attention(impl="xla") at a tiny shape, within 2x of a
  plain jitted einsum attention of the same shape (an effect in the jaxpr made it ~10x)."""
  q = jax.random.normal(jax.random.key(0), (1, 2, 16), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (1, 16, 1, 16), jnp.float32)
  v = jax.random.normal(jax.random.key(2), (1, 16, 1, 16), jnp.float32)
  lengths = jnp.asarray([9], jnp.int32)
  ours = jax.jit(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="xla"))
  plain = jax.jit(lambda q, k, v: jnp.einsum(
      "bht,btkd->bhd", jax.nn.softmax(jnp.einsum("bhd,btkd->bht", q, k) / 4.0, axis=-1), v))
  # Interleaved rounds, the best of each: another process's load slows both alike. A load spike
  # can still hit one side harder, so a few attempts are allowed; an effect in the jaxpr (~10x)
  # fails them all.
  attempts = []
  for _ in range(5):
    ours_s, plain_s = [], []
    for _ in range(7):
      ours_s.append(_host_seconds_per_call(ours, (q, k, v, lengths)))
      plain_s.append(_host_seconds_per_call(plain, (q, k, v)))
    attempts.append((min(ours_s), min(plain_s)))
    if min(ours_s) < 2.0 * min(plain_s):
      return
  pytest.fail("a jitted decode_attention costs more than 2x a plain jitted attention on the host: (ours, plain) "
              f"us per call {[(round(1e6 * a, 1), round(1e6 * b, 1)) for a, b in attempts]}")
