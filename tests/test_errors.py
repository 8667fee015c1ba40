"""Errors a user can reach name the user's own argument or attribute, and what was expected."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kv as pkv
from pallas_kv import cache as kv_cache

B, T, HQ, HKV, D = 2, 8, 4, 2, 8


def _dense(dtype=jnp.float32, head_dim=D):
  q = jnp.ones((B, HQ, head_dim), jnp.float32)
  k = jnp.ones((B, T, HKV, head_dim), dtype)
  return q, k, k, jnp.full((B,), 3, jnp.int32)


def _paged(dtype=jnp.float32):
  q = jnp.ones((B, HQ, D), jnp.float32)
  pages = jnp.ones((4, 4, HKV, D), dtype)
  tables = jnp.arange(4, dtype=jnp.int32).reshape(B, 2)
  return q, pages, pages, tables, jnp.full((B,), 3, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("op", ["dense", "paged"])
def test_scales_on_a_float_cache_name_the_scale(op, name, dtype):
  scales = {name: 2.0}
  with pytest.raises(ValueError, match=rf"{name}=.*only apply to int8 / fp8 caches"):
    if op == "dense":
      pkv.decode_attention(*_dense(dtype), **scales, impl="xla")
    else:
      pkv.paged_decode_attention(*_paged(dtype), **scales, impl="xla")
  # An array scale is refused too, and under jit at trace time.
  scales = {name: jnp.ones((HKV,), jnp.float32)}
  with pytest.raises(ValueError, match=rf"{name}=.*only apply to int8 / fp8 caches"):
    jax.jit(lambda *a: pkv.decode_attention(*a, **scales, impl="xla")).lower(*_dense(dtype))


def test_zero_head_dim_names_q_k_and_head_dim():
  q, k, v, lengths = _dense(head_dim=0)
  with pytest.raises(ValueError, match=r"q .*head dim D >= 1"):
    pkv.decode_attention(q, k, v, lengths, impl="xla")
  q = jnp.ones((B, HQ, D), jnp.float32)
  with pytest.raises(ValueError, match=rf"k has head_dim 0 but q has head_dim {D}"):
    pkv.decode_attention(q, k, v, lengths, impl="xla")
  with pytest.raises(ValueError, match=r"q .*head dim D >= 1"):
    pkv.paged_decode_attention(jnp.ones((B, HQ, 0)), jnp.ones((4, 4, HKV, 0)), jnp.ones((4, 4, HKV, 0)),
                               jnp.zeros((B, 2), jnp.int32), lengths, impl="xla")
  with pytest.raises(ValueError, match=r"head_dim=0 must be"):
    pkv.DecodeAttention(hidden_size=16, num_heads=HQ, num_kv_heads=HKV, head_dim=0, impl="xla")


def _layer():
  return pkv.DecodeAttention(hidden_size=16, num_heads=HQ, num_kv_heads=HKV, head_dim=D, impl="xla")


def test_layer_input_width_names_x_and_hidden_size():
  layer = _layer()
  params = layer.init(jax.random.key(0))
  cache = pkv.KVCache.create(B, T, HKV, D, jnp.float32)
  for x in (jnp.ones((B, 1, 12)), jnp.ones((B, 12))):
    with pytest.raises(ValueError, match=r"x must be .*hidden_size=16.*got shape"):
      layer(params, x, cache)


def test_a_cache_that_does_not_fit_the_layer_names_its_attribute():
  layer = _layer()
  params = layer.init(jax.random.key(0))
  x = jnp.ones((B, 1, 16))
  cases = [
      (pkv.KVCache.create(B, T, 4, D, jnp.float32), r"cache\.k has 4 kv heads; this layer has num_kv_heads=2"),
      (pkv.KVCache.create(B, T, HKV, 4, jnp.float32), r"cache\.k has head_dim 4; this layer has head_dim=8"),
      (pkv.KVCache.create(3, T, HKV, D, jnp.float32), r"cache batch 3 .*does not match x's batch 2"),
      (pkv.PagedKVCache.create(B, 4, 4, 2, 4, D, jnp.float32),
       r"cache\.k_pages has 4 kv heads; this layer has num_kv_heads=2"),
      (pkv.PagedKVCache.create(B, 4, 4, 2, HKV, 4, jnp.float32),
       r"cache\.k_pages has head_dim 4; this layer has head_dim=8"),
      (pkv.PagedKVCache.create(3, 4, 4, 2, HKV, D, jnp.float32), r"cache batch 3 .*does not match x's batch 2"),
  ]
  for cache, message in cases:
    with pytest.raises(ValueError, match=message):
      layer(params, x, cache)
  mla = pkv.MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
  mla_layer = pkv.DecodeAttention(hidden_size=16, num_heads=HQ, mla=mla, impl="xla")
  mla_params = mla_layer.init(jax.random.key(0))
  lengths = jnp.zeros((B,), jnp.int32)
  wide = pkv.PagedLatentCache(jnp.zeros((8, 4, 48)), kv_cache.empty_block_tables(B, 4), lengths)
  with pytest.raises(ValueError, match=r"cache\.kv_pages has rows of 48; this layer has "
                                       r"kv_lora_rank \+ qk_rope_head_dim = 40"):
    mla_layer(mla_params, x, wide)
  other_batch = pkv.PagedLatentCache(jnp.zeros((8, 4, 40)), kv_cache.empty_block_tables(3, 4),
                                     jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"cache batch 3 .*does not match x's batch 2"):
    mla_layer(mla_params, x, other_batch)
