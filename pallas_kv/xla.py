"""The "xla" impl: every op as plain XLA ops, on any device.

`impl="xla"` runs these, `impl="auto"` falls back to them where no kernel serves a call, the
kernel impls take their gradients from them (custom VJP), and `DecodeAttention.prefill` uses
`attend` for the prompt. Today they compute in float32 throughout, the same math as the oracle
(`pallas_kv.reference` validates the public arguments and calls these).

Arguments are the public ops' after validation, with `scale` resolved; results are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kv import validation
from pallas_kv.cache import gather_pages


def dequantize(x, scale):
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
  """The float32 core: q4 [B, S, Hq, D], k [B, T, Hkv, D] f32, v [B, T, Hkv, Dv] f32 ->
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


def decode_attention(q, k, v, lengths, *, scale, softcap=None, window=None, sinks=None, k_scale=None,
                     v_scale=None, return_lse=False):
  """Decode attention over a contiguous cache. See `pallas_kv.decode_attention`."""
  q4, single = validation.query_as_rank4(q)
  out, lse = attend(q4, dequantize(k, k_scale), dequantize(v, v_scale), lengths, scale=scale, softcap=softcap,
                    window=window, sinks=sinks)
  return _finish(out, lse, single, return_lse)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale, softcap=None, window=None,
                           sinks=None, k_scale=None, v_scale=None, return_lse=False):
  """Decode attention over a paged cache. See `pallas_kv.paged_decode_attention`."""
  return decode_attention(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), lengths,
                          scale=scale, softcap=softcap, window=window, sinks=sinks,
                          k_scale=_gather_scale(k_scale, block_tables), v_scale=_gather_scale(v_scale, block_tables),
                          return_lse=return_lse)


def mla_decode_attention(q, kv_pages, block_tables, lengths, *, v_head_dim, scale, return_lse=False):
  """Multi-head latent attention decode. See `pallas_kv.mla_decode_attention`."""
  q4, single = validation.query_as_rank4(q)
  kv = gather_pages(kv_pages, block_tables).astype(jnp.float32)[:, :, None, :]  # [B, T, 1, Dqk]
  out, lse = attend(q4, kv, kv[..., :v_head_dim], lengths, scale=scale)
  return _finish(out, lse, single, return_lse)
