"""Merging split-K partials and moving between the public layout and the kernels' packed rows.

Kernels see, per (batch, kv head), R = S * G packed query rows: row r = s * G + g is new token s
of q head kv_head * G + g, so every q head sharing a KV head is served by one program.
"""

from __future__ import annotations

import jax.numpy as jnp


def pack_queries(q4, num_kv_heads: int):
  """[B, S, Hq, D] -> [B, Hkv, S * G, D]."""
  b, s, hq, d = q4.shape
  g = hq // num_kv_heads
  return q4.reshape(b, s, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, s * g, d)


def unpack_rows(x, num_queries: int):
  """[B, Hkv, S * G, ...] -> [B, S, Hq, ...], the inverse of pack_queries."""
  b, hkv, r = x.shape[:3]
  g = r // num_queries
  rest = x.shape[3:]
  x = x.reshape(b, hkv, num_queries, g, *rest)
  x = jnp.moveaxis(x, 2, 1)  # [B, S, Hkv, G, ...]
  return x.reshape(b, num_queries, hkv * g, *rest)


def merge_splits(out, lse, sinks=None):
  """Merges split-K partials.

  Args:
    out: [B, Hkv, splits, R, Dv] float32, each split's softmax-normalised output (0 where empty).
    lse: [B, Hkv, splits, R] float32, each split's log-sum-exp (-inf where empty).
    sinks: optional [Hkv, R] float32 sink logit of each packed row; joins the denominator only.
  Returns:
    (out [B, Hkv, R, Dv] float32, lse [B, Hkv, R] float32 over the real keys, -inf where none).
  """
  if out.shape[2] == 1 and sinks is None:  # one split is already the answer: skip the merge
    return out[:, :, 0], lse[:, :, 0]
  total = jnp.max(lse, axis=2)  # [B, Hkv, R]
  shift = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.exp(lse - shift[:, :, None])  # empty splits weigh 0
  norm = jnp.sum(weights, axis=2)
  has_keys = norm > 0
  lse_total = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)
  denom = norm
  if sinks is not None:
    denom = denom + jnp.exp(sinks[None].astype(jnp.float32) - shift)
  merged = jnp.einsum("bhsr,bhsrd->bhrd", weights, out)
  merged = merged / jnp.where(has_keys, denom, 1.0)[..., None]
  return merged, lse_total
