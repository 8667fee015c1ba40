"""A plain call dispatches like any jitted function: no effect in its jaxpr, jit's C++ fast path.

A jaxpr with an effect (an always-traced checkify check, a debug callback) leaves jit's C++ fast
path for its Python one: ~10x the host time per call. Checks of runtime values are traced only
inside `pallas_kv.checked()`.
"""

import os
import sys

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


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("impl", IMPLS)
def test_one_byte_caches_trace_no_effect_outside_checked(impl, kv_dtype):
  # The one-byte default: per-token scales, V stored tokens last (each backend's one-byte kernel, not the bf16 one).
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.integers(-100, 100, (2, 256, 2, 64)), jnp.int8).astype(kv_dtype)
  v = jnp.asarray(rng.integers(-100, 100, (2, 2, 64, 256)), jnp.int8).astype(kv_dtype)
  scales = jnp.asarray(rng.uniform(0.01, 0.02, (2, 256, 2)), jnp.float32)
  lengths = jnp.asarray([256, 77], jnp.int32)
  fn = lambda q, k, v, s, n: pkv.decode_attention(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True, impl=impl)
  assert not _effects(fn, q, k, v, scales, lengths)
  with pkv.checked():
    assert _effects(fn, q, k, v, scales, lengths)


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


def _abstract(fn, *args, **kwargs):
  """fn's result as ShapeDtypeStructs: the traces below need shapes only, and building real random
  weights and caches eagerly costs an XLA compile per shape (seconds, not milliseconds)."""
  return jax.eval_shape(lambda: fn(*args, **kwargs))


def test_decode_attention_layer_traces_no_effect():
  layer = pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, impl="xla")
  params = _abstract(layer.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((2, 64), jnp.float32)
  cache = _abstract(pkv.KVCache.create, batch=2, capacity=32, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  pages = _abstract(pkv.PagedKVCache.create, batch=2, num_pages=8, page_size=8, max_pages_per_seq=4,
                    num_kv_heads=2, head_dim=16, dtype=jnp.float32)
  assert not _effects(layer, params, x, cache)
  assert not _effects(layer, params, x, pages)
  with pkv.checked():   # the same traces do carry the checks where asked for
    assert _effects(layer, params, x, cache)
    assert _effects(layer, params, x, pages)


def _tiny_llama():
  config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, eos_token_id=2)
  n, h, kv, d, f, layers = 4, 32, 2, 8, 48, 2
  w = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = dict(embed=w(64, h), final_norm=w(h), layers=dict(
      attn_norm=w(layers, h), mlp_norm=w(layers, h),
      attn=dict(wq=w(layers, h, n, d), wk=w(layers, h, kv, d), wv=w(layers, h, kv, d), wo=w(layers, n, d, h)),
      w_gate=w(layers, h, f), w_up=w(layers, h, f), w_down=w(layers, f, h)))
  return config, params


def test_smollm2_decode_step_traces_no_effect():
  config, params = _tiny_llama()
  model = Llama(config, impl="xla")
  state = _abstract(serving.empty_state, model, num_slots=2, num_pages=8, page_size=4, max_pages_per_seq=4)
  step = lambda params, state: serving.decode_steps.__wrapped__(model, params, state, 2)
  assert not _effects(step, params, state)
  with pkv.checked():
    assert _effects(step, params, state)


# jit's C++ dispatch path: after the first call of a jitted function, a call whose compiled
# computation has no effect (and whose arguments match the cached signature) runs in C++ without
# entering Python. A call that cannot (an effect in the jaxpr: checkify, a debug callback) falls
# back to jit's Python path on every call, and that path announces itself with this jax test event
# (the one `jax._src.test_util.count_pjit_cpp_cache_miss` counts). Counting it is deterministic:
# no wall clock, so no retries on load spikes.
PYTHON_DISPATCH_EVENT = "jit_cpp_cache_miss"


@pytest.fixture
def python_dispatches(monkeypatch):
  """count(fn, args, calls): how many of `calls` warm calls of the jitted fn took jit's Python path."""
  from jax._src import util as jax_util
  events = []
  previous = jax_util.test_event_listener

  def listener(name, *args):
    events.append(name)
    if previous is not None:
      previous(name, *args)

  monkeypatch.setattr(jax_util, "test_event_listener", listener)

  def count(fn, args, calls: int = 10) -> int:
    jax.block_until_ready(fn(*args))  # traces, compiles and fills the C++ cache
    events.clear()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    return events.count(PYTHON_DISPATCH_EVENT)

  return count


def _tiny_dense():
  q = jax.random.normal(jax.random.key(0), (1, 2, 16), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (1, 16, 1, 16), jnp.float32)
  v = jax.random.normal(jax.random.key(2), (1, 16, 1, 16), jnp.float32)
  return q, k, v, jnp.asarray([9], jnp.int32)


def test_the_dispatch_probe_sees_the_python_path(python_dispatches):
  """The probe itself: a plain jitted einsum stays on the C++ path, a jitted function with an effect
  (a debug callback, like an always-traced check) takes the Python path on every call. Fails if
  jax stops announcing its Python path, instead of the test below passing vacuously."""
  q, k, v, _ = _tiny_dense()
  plain = jax.jit(lambda q, k: jnp.einsum("bhd,btkd->bht", q, k))
  with_effect = jax.jit(lambda q, k: (jax.debug.callback(lambda: None),
                                      jnp.einsum("bhd,btkd->bht", q, k))[1])
  assert python_dispatches(plain, (q, k)) == 0
  assert python_dispatches(with_effect, (q, k), calls=10) == 10


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_jitted_call_takes_jits_cpp_fast_path(python_dispatches, paged):
  """Warm calls of a jitted decode_attention(impl="xla") never enter jit's Python path, like a plain
  jitted einsum: an effect traced into the plain call path (the always-traced checkify check made
  a call ~10x slower on the host) sends every call there."""
  if paged:
    case = make_case(3, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8,
                     dtype=jnp.float32)
    fn = jax.jit(lambda q, k, v, t, n: pkv.paged_decode_attention(q, k, v, t, n, impl="xla"))
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
  else:
    fn = jax.jit(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="xla"))
    args = _tiny_dense()
  assert not jax.make_jaxpr(fn)(*args).effects
  assert python_dispatches(fn, args) == 0, "a warm jitted call left jit's C++ fast path"
  assert fn._cache_size() == 1, "a warm jitted call was traced again"
