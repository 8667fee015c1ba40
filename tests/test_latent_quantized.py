"""One-byte latent caches for MLA: `PagedLatentCache` quantizes on append (per-token or fixed scales),
`mla_decode_attention(..., kv_scale=)` widens them, and `DecodeAttention`'s MLA path runs on them. Also: a
one-byte cache without scales stores its values as they are (scale 1), for every cache kind."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from pallas_kv import api
from pallas_kv import cache as kv_cache
from harness import relative_error, small_mla_layer

ONE_BYTE = [jnp.float8_e4m3fn, jnp.int8]


def _tables():
  return jnp.asarray([[5, 0, 3, -1], [1, 7, 2, 6]], jnp.int32)


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_a_one_byte_cache_without_scales_stores_the_values_as_they_are(dtype):
  values = jnp.asarray([[[[1.0, -2.0, 3.0, 4.0]]]])   # representable in int8 and fp8 e4m3
  dense = pkv.KVCache.create(1, 8, 1, 4, dtype).append(values, values)
  assert dense.k_scale is None and np.asarray(dense.k[0, 0, 0], np.float32).tolist() == [1, -2, 3, 4]
  latent = pkv.PagedLatentCache.create(4, 2, 4, batch=1, max_pages_per_seq=2, dtype=dtype)
  latent = dataclasses.replace(latent, block_tables=jnp.asarray([[2, 0]], jnp.int32)).append(values[:, :, 0])
  assert latent.kv_scale is None and np.asarray(latent.kv_pages[2, 0], np.float32).tolist() == [1, -2, 3, 4]


@pytest.mark.parametrize("scales", ["token", 0.02])
def test_latent_append_quantizes_and_gather_widens(scales):
  cache = pkv.PagedLatentCache.create(8, 4, 64, batch=2, max_pages_per_seq=4, dtype=jnp.float8_e4m3fn,
                                      scales=scales)
  cache = dataclasses.replace(cache, block_tables=_tables())
  rows = jax.random.normal(jax.random.key(0), (2, 7, 64)) * 2.0
  cache, ok = cache.try_append(rows, jnp.asarray([5, 7], jnp.int32))
  assert bool(ok.all()) and cache.lengths.tolist() == [5, 7]
  got = np.asarray(cache.gather(jnp.float32))
  want = np.asarray(rows)
  # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself (plus the smallest normal's step).
  for b, n in enumerate((5, 7)):
    err = np.abs(got[b, :n] - want[b, :n])
    assert (err <= np.abs(want[b, :n]) / 16 + 0.02 * 2.0 ** -6 + 1e-6).all() if scales == 0.02 else \
        (err <= np.abs(want[b, :n]).max(-1, keepdims=True) / 16).all()
  if scales == "token":   # each written token's scale is its row's max |x| / 448, at its page and slot
    page, slot = _tables()[1, 1], 2   # sequence 1's token 6
    assert np.isclose(float(cache.kv_scale[page, slot]), np.abs(want[1, 6]).max() / 448, rtol=1e-6)
    assert float(cache.kv_scale[4, 0]) == 1.0   # a page no sequence holds keeps its initial scale


@pytest.mark.parametrize("per_token", [True, False])
def test_mla_on_an_fp8_cache_equals_mla_on_the_widened_cache(per_token):
  keys = jax.random.split(jax.random.key(1), 3)
  num_pages, page_size, dim, v_dim = 8, 16, 192, 128
  q = jax.random.normal(keys[0], (2, 2, 8, dim), jnp.bfloat16)
  x = jax.random.normal(keys[1], (num_pages, page_size, dim)) * 3.0
  scale = jnp.max(jnp.abs(x), -1) / 448 if per_token else jnp.float32(0.04)
  pages = jnp.clip(x / (scale[..., None] if per_token else scale), -448, 448).astype(jnp.float8_e4m3fn)
  widened = (pages.astype(jnp.float32) * (scale[..., None] if per_token else scale)).astype(jnp.bfloat16)
  lengths = jnp.asarray([37, 64], jnp.int32)
  call = lambda q, pages, **kw: pkv.mla_decode_attention(q, pages, _tables(), lengths, v_head_dim=v_dim, impl="xla",
                                                         return_lse=True, **kw)
  out, lse = call(q, pages, kv_scale=scale)
  want_out, want_lse = call(q, widened)
  assert relative_error(out, want_out) < 1e-2 and relative_error(lse, want_lse) < 1e-3
  # Against the bf16 cache it stands for: fp8's own error, a few percent.
  exact_out, _ = call(q, x.astype(jnp.bfloat16))
  assert 1e-3 < relative_error(out, exact_out) < 0.08
  # jit, vmap (a batch of queries over one cache) and grad, as the other ops.
  batched = jax.jit(jax.vmap(lambda q: call(q, pages, kv_scale=scale)[0]))(jnp.stack([q, q[::-1]]))
  assert relative_error(batched[0], out) < 1e-2
  grad = jax.grad(lambda q: call(q, pages, kv_scale=scale)[0].astype(jnp.float32).sum())(q)
  assert grad.shape == q.shape and bool(jnp.isfinite(grad.astype(jnp.float32)).all())


def test_kv_scale_errors_name_the_argument():
  q = jnp.ones((2, 8, 64), jnp.bfloat16)
  pages = jnp.ones((8, 16, 64), jnp.float8_e4m3fn)
  lengths = jnp.asarray([3, 5], jnp.int32)
  call = lambda pages, scale: pkv.mla_decode_attention(q, pages, _tables(), lengths, v_head_dim=32, kv_scale=scale)
  with pytest.raises(ValueError, match=r"kv_scale must be .* per token \[P, page_size\]=\[8, 16\]; got \(8,\)"):
    call(pages, jnp.ones((8,)))
  with pytest.raises(ValueError, match="kv_scale must be floating point"):
    call(pages, jnp.ones((8, 16), jnp.int32))
  with pytest.raises(ValueError, match="kv_scale=2.0 must be None for a bfloat16 latent cache"):
    call(pages.astype(jnp.bfloat16), 2.0)
  with pytest.raises(ValueError, match="scales='token' must be None for a bfloat16 latent cache"):
    pkv.PagedLatentCache.create(8, 16, 64, batch=2, max_pages_per_seq=4, scales="token")


def test_mosaic_gpu_refuses_an_int8_latent_cache_and_auto_runs_fp8_on_it(monkeypatch):
  q = jnp.ones((2, 8, 192), jnp.bfloat16)
  lengths = jnp.asarray([3, 5], jnp.int32)
  int8_pages = jnp.ones((8, 32, 192), jnp.int8)
  with pytest.raises(NotImplementedError, match="MLA needs a bfloat16, float16 or fp8 .* got int8"):
    pkv.mla_decode_attention(q, int8_pages, _tables(), lengths, v_head_dim=128, kv_scale=0.5, impl="mosaic_gpu")
  monkeypatch.setattr(api, "device_can_run", lambda name: True)   # as on a Hopper GPU
  for dtype, want in ((jnp.int8, "xla"), (jnp.float8_e4m3fn, "mosaic_gpu"), (jnp.float8_e5m2, "mosaic_gpu")):
    pages = int8_pages.astype(dtype)
    problem = api.validation.validate_mla(q, pages, _tables(), lengths, 128)
    for kv_scale in (0.5, jnp.ones((8, 32, 1), jnp.float32)):
      options = api._options(problem, None, None, None, None, kv_scale, None)
      assert api.choose_impl("auto", "mla", problem, options, (q.dtype, pages.dtype), None)[0] == want


def test_decode_attention_mla_runs_on_an_fp8_latent_cache():
  layer, params, x = small_mla_layer()

  def run(dtype, scales):
    pool = pkv.PagePool.create(8)
    cache = pkv.PagedLatentCache.create(8, 4, 40, batch=2, max_pages_per_seq=4, dtype=dtype, scales=scales)
    pool, tables, ok = pkv.reserve_pages(pool, cache.block_tables, cache.lengths, 5, cache.page_size)
    assert bool(ok)
    cache = dataclasses.replace(cache, block_tables=tables)
    _, cache = jax.jit(layer.prefill)(params, x[:, :4], cache)
    y, cache = jax.jit(layer.__call__)(params, x[:, 4], cache)
    assert cache.lengths.tolist() == [5, 5]
    return y

  exact = run(jnp.float32, None)
  fp8 = run(jnp.float8_e4m3fn, "token")
  assert 1e-4 < relative_error(fp8, exact) < 0.1
