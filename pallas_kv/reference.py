"""Float32 XLA implementations of every op: the correctness oracle and the fallback off the GPU.

Each `*_reference` takes the same arguments as its public op (less `impl` and `config`) and
returns float32 results. They are plain `jnp`, so jit, vmap and grad work through them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kv import validation


def _dequantize(x, scale, num_kv_heads: int):
  """x [..., Hkv, D] in the cache dtype -> float32, times a scalar or per-kv-head scale."""
  x = x.astype(jnp.float32)
  if scale is None:
    return x
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim == 1:
    scale = scale.reshape(num_kv_heads, 1)
  return x * scale


def query_positions(lengths, num_queries: int, capacity: int):
  """Absolute position of each new token: the S new tokens are the last S of the lengths[b] tokens.

  Returns (positions [B, S] int32, clamped lengths [B]). Lengths are clamped to [0, capacity] so
  no runtime value reads outside the cache; a new token at a negative position sees no keys.
  """
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
  return lengths[:, None] - num_queries + jnp.arange(num_queries, dtype=jnp.int32)[None, :], lengths


def key_mask(lengths, num_queries: int, capacity: int, window: int | None):
  """[B, S, T] bool: key t is visible to new token s (causal, inside the length, inside the window)."""
  positions, _ = query_positions(lengths, num_queries, capacity)
  t = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
  p = positions[:, :, None]
  mask = (t <= p) & (t >= 0)
  if window is not None:
    mask &= t > p - window
  return mask


def attend(q4, k, v, lengths, *, scale, softcap=None, window=None, sinks=None):
  """The shared float32 core: q4 [B, S, Hq, D], k [B, T, Hkv, D] f32, v [B, T, Hkv, Dv] f32 ->
  (out [B, S, Hq, Dv], lse [B, S, Hq]). No validation and no limit on S (prefill uses it too)."""
  b, s, hq, d = q4.shape
  t, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  q = q4.astype(jnp.float32).reshape(b, s, hkv, g, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = key_mask(lengths, s, t, window)[:, None, None]  # [B, 1, 1, S, T]
  logits = jnp.where(mask, logits, -jnp.inf)
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


def decode_attention_reference(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None,
                               k_scale=None, v_scale=None, return_lse=False):
  """Decode attention over a contiguous cache in float32. See `pallas_kv.decode_attention`."""
  prob = validation.validate_dense(q, k, v, lengths)
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=prob.num_heads, num_kv_heads=prob.num_kv_heads)
  q4, single = validation.query_as_rank4(q)
  scale = validation.default_scale(prob.head_dim) if scale is None else scale
  kf = _dequantize(k, k_scale, prob.num_kv_heads)
  vf = _dequantize(v, v_scale, prob.num_kv_heads)
  out, lse = attend(q4, kf, vf, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks)
  return _finish(out, lse, single, return_lse)


def gather_pages(pages, block_tables):
  """[P, page_size, ...] pages + [B, max_pages] table -> dense [B, max_pages * page_size, ...].

  Page ids are clamped into [0, P), so a bad id reads a real page rather than out of bounds.
  """
  num_pages = pages.shape[0]
  ids = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1)
  dense = pages[ids]  # [B, max_pages, page_size, ...]
  b, m, ps = dense.shape[:3]
  return dense.reshape(b, m * ps, *pages.shape[2:])


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None,
                                     window=None, sinks=None, k_scale=None, v_scale=None, return_lse=False):
  """Decode attention over a paged cache in float32. See `pallas_kv.paged_decode_attention`."""
  prob = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths)
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=prob.num_heads, num_kv_heads=prob.num_kv_heads)
  q4, single = validation.query_as_rank4(q)
  scale = validation.default_scale(prob.head_dim) if scale is None else scale
  kf = _dequantize(gather_pages(k_pages, block_tables), k_scale, prob.num_kv_heads)
  vf = _dequantize(gather_pages(v_pages, block_tables), v_scale, prob.num_kv_heads)
  out, lse = attend(q4, kf, vf, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks)
  return _finish(out, lse, single, return_lse)


def mla_decode_attention_reference(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None,
                                   return_lse=False):
  """Multi-head latent attention decode in float32. See `pallas_kv.mla_decode_attention`."""
  prob = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  validation.check_options(scale=scale, softcap=None, window=None, sinks=None, k_scale=None, v_scale=None,
                           num_heads=prob.num_heads, num_kv_heads=1)
  q4, single = validation.query_as_rank4(q)
  scale = validation.default_scale(prob.head_dim) if scale is None else scale
  kv = gather_pages(kv_pages, block_tables).astype(jnp.float32)[:, :, None, :]  # [B, T, 1, Dqk]
  out, lse = attend(q4, kv, kv[..., :v_head_dim], lengths, scale=scale, softcap=None, window=None,
                     sinks=None)
  return _finish(out, lse, single, return_lse)
