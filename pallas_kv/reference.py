"""The float32 oracle of every op: what the tests and benchmarks compare against.

Each `*_reference` takes the same arguments as its public op (less `impl` and `config`),
validates them like the op does and returns float32 results: the caches are widened to float32
and scaled, and both products run at HIGHEST precision. Tests check it against an independent
float64 loop. Plain `jnp`, so jit, vmap and grad work through it. Library code never imports
this module: the `"xla"` impl (`pallas_kv.xla`) is the fast plain-XLA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kv import validation
from pallas_kv import xla
from pallas_kv.cache import gather_pages


def _check(problem, *, scale, softcap=None, window=None, sinks=None, k_scale=None, v_scale=None) -> float:
  """Checks the options like the public op does; returns the scale with its default applied."""
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads,
                           token_shape=problem.scale_token_shape)
  return validation.default_scale(problem.head_dim) if scale is None else scale


def decode_attention_reference(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None,
                               k_scale=None, v_scale=None, return_lse=False):
  """Decode attention over a contiguous cache in float32. See `pallas_kv.decode_attention`."""
  problem = validation.validate_dense(q, k, v, lengths)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                 v_scale=v_scale)
  return _decode(q, k, v, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks,
                 k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None,
                                     window=None, sinks=None, k_scale=None, v_scale=None, return_lse=False):
  """Decode attention over a paged cache in float32. See `pallas_kv.paged_decode_attention`."""
  problem = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                 v_scale=v_scale)
  return _decode(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), lengths,
                 scale=scale, softcap=softcap, window=window, sinks=sinks,
                 k_scale=_gather_scale(k_scale, block_tables), v_scale=_gather_scale(v_scale, block_tables),
                 return_lse=return_lse)


def mla_decode_attention_reference(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None,
                                   return_lse=False):
  """Multi-head latent attention decode in float32. See `pallas_kv.mla_decode_attention`."""
  problem = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale)
  q4, single = validation.query_as_rank4(q)
  kv = gather_pages(kv_pages, block_tables).astype(jnp.float32)[:, :, None, :]  # [B, T, 1, Dqk]
  out, lse = _attend(q4, kv, kv[..., :v_head_dim], lengths, scale=scale)
  return _finish(out, lse, single, return_lse)


def _decode(q, k, v, lengths, *, scale, softcap, window, sinks, k_scale, v_scale, return_lse):
  q4, single = validation.query_as_rank4(q)
  out, lse = _attend(q4, _dequantize(k, k_scale), _dequantize(v, v_scale), lengths, scale=scale, softcap=softcap,
                     window=window, sinks=sinks)
  return _finish(out, lse, single, return_lse)


def _dequantize(x, scale):
  """x [B, T, Hkv, D] in the cache dtype -> float32, times a scale: a scalar, one per kv head
  [Hkv], or one per token and kv head [B, T, Hkv]."""
  x = x.astype(jnp.float32)
  if scale is None:
    return x
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim == 1:
    scale = scale.reshape(x.shape[-2], 1)
  elif scale.ndim == 3:
    scale = scale[..., None]
  return x * scale


def _gather_scale(scale, block_tables):
  """A per-token scale of a paged cache [P, page_size, Hkv] -> [B, T, Hkv]; other kinds as they are."""
  if scale is None or jnp.ndim(scale) != 3:
    return scale
  return gather_pages(jnp.asarray(scale), block_tables)


def _attend(q4, k, v, lengths, *, scale, softcap=None, window=None, sinks=None):
  """q4 [B, S, Hq, D], k [B, T, Hkv, D] f32, v [B, T, Hkv, Dv] f32 -> (out [B, S, Hq, Dv], lse [B, S, Hq])."""
  b, s, hq, d = q4.shape
  t, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  q = q4.astype(jnp.float32).reshape(b, s, hkv, g, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = xla.key_mask(lengths, s, t, window)[:, None, None]  # [B, 1, 1, S, T]
  logits = jnp.where(mask, logits, -jnp.inf)
  # Masked keys get probability 0, but 0 x NaN is NaN: values past a sequence's length (stale
  # cache memory, or pages it does not own) must not reach the product either.
  in_length = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]  # [B, T]
  v = jnp.where(in_length[:, :, None, None], v, 0.0)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # [B, Hkv, G, S]
  has_keys = jnp.isfinite(row_max)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
    row_max = jnp.maximum(row_max, jax.lax.stop_gradient(sink))
  shift = jnp.where(has_keys, row_max, 0.0)  # rows with no key: any finite shift will do
  probs = jnp.exp(logits - shift[..., None])  # masked keys give exp(-inf) = 0
  row_sum = jnp.sum(probs, axis=-1)
  denom = row_sum
  if sinks is not None:
    denom = denom + jnp.exp(sink - shift)
  out = jnp.einsum("bhgst,bthd->bshgd", probs, v, precision=jax.lax.Precision.HIGHEST)
  denom_bshg = jnp.transpose(denom, (0, 3, 1, 2))[..., None]
  out = out / jnp.where(denom_bshg > 0, denom_bshg, 1.0)
  safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
  lse = jnp.where(row_sum > 0, jnp.log(safe_sum) + shift, -jnp.inf)  # sinks excluded
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, s, hq)
  return out.reshape(b, s, hq, v.shape[-1]), lse


def _finish(out, lse, single_token: bool, return_lse: bool):
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
