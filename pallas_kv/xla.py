"""The "xla" impl: every op as plain XLA ops, on any device, at the cache's precision.

`impl="xla"` runs these, `impl="auto"` falls back to them where no kernel serves a call, the
kernel impls take their gradients from them (custom VJP), and `DecodeAttention.prefill` uses
`attend` for the prompt. Unlike the float32 oracle (`pallas_kv.reference`) they never widen the
cache: both products take the cache's dtype (q is cast to it) and accumulate in float32 on the
tensor cores; a one-byte cache is widened to q's 16-bit dtype (exact for int8 and fp8) and its
scales are folded into the logits (K) and the probabilities or the output (V) instead of into a
scaled copy. Scores and the softmax are float32.

A paged cache is gathered through the block table: every column of the table is read, so the
table's width bounds the bytes (a caller keeps it as narrow as the longest sequence needs).

Arguments are the public ops' after validation, with `scale` resolved; results are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kv import validation
from pallas_kv.cache import gather_pages
from pallas_kv.cache import gather_widened


def query_positions(lengths, num_queries: int, capacity: int):
  """Absolute position of each new token: the S new tokens are the last S of the lengths[b] tokens.

  Returns (positions [B, S] int32, clamped lengths [B]). Lengths are clamped to [0, capacity] so
  no runtime value reads outside the cache; a new token at a negative position sees no keys.
  """
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
  return lengths[:, None] - num_queries + jnp.arange(num_queries, dtype=jnp.int32)[None, :], lengths


def key_mask(lengths, num_queries: int, capacity: int, window: int | None, positions=None, window_start=None):
  """[B, S, T] bool: key t is visible to new token s (causal, inside the length, inside the window, at or
  after window_start[b] if given).

  positions [B, S]: the new tokens' positions, if not the last S of the lengths[b] tokens."""
  if positions is None:
    positions, _ = query_positions(lengths, num_queries, capacity)
  t = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
  p = positions[:, :, None]
  mask = (t <= p) & (t >= 0)
  if window is not None:
    mask &= t > p - window
  if window_start is not None:
    mask &= t >= window_start.astype(jnp.int32)[:, None, None]
  return mask


def compute_dtype(q_dtype, kv_dtype):
  """The dtype both products take: the cache's, or q's for a one-byte cache (float32 q: float32)."""
  if jnp.dtype(kv_dtype).itemsize == 1:
    return jnp.dtype(q_dtype)
  return jnp.dtype(kv_dtype)


def _per_head_and_token(scale, num_kv_heads: int):
  """A K or V scale as (per-head [Hkv] f32 or None, per-token [B, Hkv, T] f32 or None)."""
  if scale is None:
    return None, None
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim == 3:
    return None, jnp.transpose(scale, (0, 2, 1))
  return jnp.broadcast_to(scale, (num_kv_heads,)), None


def values_in_length(x, lengths):
  """x [B, T, ...] with every token at or past lengths[b] zeroed (0 x NaN would be NaN)."""
  t = x.shape[1]
  in_length = jnp.arange(t, dtype=jnp.int32)[None, :] < jnp.clip(lengths.astype(jnp.int32), 0, t)[:, None]
  return jnp.where(in_length.reshape(in_length.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def _masked_softmax(logits, mask, sink=None):
  """Unnormalized softmax of float32 logits [..., T] over the keys `mask` lets through.

  Returns (probs [..., T], row_sum, denom, shift), each but probs [...]: probs / denom is the
  softmax (denom adds the sink's exp(sink - shift) to row_sum); shift is the row maximum, or 0
  for a row with no key, whose probs are all 0.
  """
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
  has_keys = jnp.isfinite(row_max)
  if sink is not None:
    row_max = jnp.maximum(row_max, jax.lax.stop_gradient(sink))
  shift = jnp.where(has_keys, row_max, 0.0)  # rows with no key: any finite shift will do
  probs = jnp.exp(logits - shift[..., None])  # masked keys give exp(-inf) = 0
  row_sum = jnp.sum(probs, axis=-1)
  denom = row_sum if sink is None else row_sum + jnp.exp(sink - shift)
  return probs, row_sum, denom, shift


def _log_sum(row_sum, shift):
  """The log-sum-exp of a row from its softmax parts; -inf for a row with no key."""
  safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
  return jnp.where(row_sum > 0, jnp.log(safe_sum) + shift, -jnp.inf)


def attend(q4, k, v, lengths, *, scale, softcap=None, window=None, sinks=None, k_scale=None, v_scale=None,
           positions=None, window_start=None):
  """q4 [B, S, Hq, D]; k [B, T, Hkv, D], v [B, T, Hkv, Dv] in the cache's dtype; k_scale, v_scale:
  None, a scalar, [Hkv] or per token [B, T, Hkv]. positions [B, S]: the new tokens' positions
  (default: the last S of the lengths[b] tokens). Returns (out [B, S, Hq, Dv], lse [B, S, Hq]) in
  float32. No limit on S (prefill uses it too)."""
  b, s, hq, d = q4.shape
  t, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  dtype = compute_dtype(q4.dtype, k.dtype)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  q = q4.astype(dtype).reshape(b, s, hkv, g, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", q, k.astype(dtype), precision=precision,
                      preferred_element_type=jnp.float32)
  k_head, k_token = _per_head_and_token(k_scale, hkv)
  if k_head is not None:
    logits = logits * (k_head * scale)[None, :, None, None, None]
  else:
    logits = logits * scale
  if k_token is not None:
    logits = logits * k_token[:, :, None, None, :]
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = key_mask(lengths, s, t, window, positions, window_start)[:, None, None]  # [B, 1, 1, S, T]
  # Masked keys get probability 0, but 0 x NaN is NaN: values past a sequence's length (stale
  # cache memory, or pages it does not own) must not reach the product either.
  v = values_in_length(v.astype(dtype), lengths)
  sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
  probs, row_sum, denom, shift = _masked_softmax(logits, mask, sink)
  v_head, v_token = _per_head_and_token(v_scale, hkv)
  weights = probs
  if v_token is not None:   # masked keys: 0 x a scale past the length, which may be inf
    weights = jnp.where(mask, probs * v_token[:, :, None, None, :], 0.0)
  out = jnp.einsum("bhgst,bthd->bshgd", weights.astype(dtype), v, precision=precision,
                   preferred_element_type=jnp.float32)
  if v_head is not None:
    out = out * v_head[None, None, :, None, None]
  denom_bshg = jnp.transpose(denom, (0, 3, 1, 2))[..., None]
  out = out / jnp.where(denom_bshg > 0, denom_bshg, 1.0)
  lse = jnp.transpose(_log_sum(row_sum, shift), (0, 3, 1, 2)).reshape(b, s, hq)  # sinks excluded
  return out.reshape(b, s, hq, v.shape[-1]), lse


def _finish(out, lse, single_token: bool, return_lse: bool):
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


def _gather_scale(scale, block_tables):
  """A per-token scale of a paged cache [P, page_size, Hkv] -> [B, T, Hkv]; other kinds as they are."""
  if scale is None or jnp.ndim(scale) != 3:
    return scale
  return gather_pages(jnp.asarray(scale), block_tables)


def decode_attention(q, k, v, lengths, *, scale, softcap=None, window=None, sinks=None, k_scale=None,
                     v_scale=None, return_lse=False, window_start=None):
  """Decode attention over a contiguous cache. See `pallas_kv.decode_attention`."""
  q4, single = validation.query_as_rank4(q)
  out, lse = attend(q4, k, v, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks,
                    k_scale=k_scale, v_scale=v_scale, window_start=window_start)
  return _finish(out, lse, single, return_lse)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale, softcap=None, window=None,
                           sinks=None, k_scale=None, v_scale=None, return_lse=False, window_start=None):
  """Decode attention over a paged cache. See `pallas_kv.paged_decode_attention`."""
  return decode_attention(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), lengths,
                          scale=scale, softcap=softcap, window=window, sinks=sinks,
                          k_scale=_gather_scale(k_scale, block_tables), v_scale=_gather_scale(v_scale, block_tables),
                          return_lse=return_lse, window_start=window_start)


def mla_decode_attention(q, kv_pages, block_tables, lengths, *, v_head_dim, scale, return_lse=False, kv_scale=None):
  """Multi-head latent attention decode. See `pallas_kv.mla_decode_attention`; kv_scale: None, a scalar or
  per token [P, page_size, 1] (a one-byte cache's dequantizing scale, applied to the gathered tile).

  Every q head reads the one latent head, so the products are written per head ([B, S, H, T]
  scores, keys minor) rather than through `attend`'s grouped form: there XLA laid the scores out
  keys-major and transposed the output, 11-33% slower on the H200 at batch 64 and 16
  (benchmarks/RESULTS.md, 2026-11-30 third set).
  """
  q4, single = validation.query_as_rank4(q)
  s, t = q4.shape[1], block_tables.shape[1] * kv_pages.shape[1]
  # One latent tile is both K and V: zero it past each length once, in the gather (masked keys
  # get -inf scores either way, but 0 x NaN is NaN).
  # A scaled one-byte cache is widened to q's dtype: the products run as on a two-byte cache.
  kv = gather_widened(kv_pages, block_tables, kv_scale, kv_pages.dtype if kv_scale is None else q4.dtype)
  kv = values_in_length(kv, lengths)  # [B, T, Dqk]
  dtype = compute_dtype(q4.dtype, kv.dtype)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  kv = kv.astype(dtype)
  logits = jnp.einsum("bshd,btd->bsht", q4.astype(dtype), kv, precision=precision,
                      preferred_element_type=jnp.float32) * scale
  mask = key_mask(lengths, s, t, None)[:, :, None, :]  # [B, S, 1, T]
  probs, row_sum, denom, shift = _masked_softmax(logits, mask)
  out = jnp.einsum("bsht,btd->bshd", probs.astype(dtype), kv[..., :v_head_dim], precision=precision,
                   preferred_element_type=jnp.float32)
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  return _finish(out, _log_sum(row_sum, shift), single, return_lse)
