"""The float32 oracle of every op: what the tests and benchmarks compare against.

Each `*_reference` takes the same arguments as its public op (less `impl` and `config`),
validates them like the op does and returns float32 results: it widens the caches to float32
(times their scales) and runs the `pallas_kv.xla` formulation on them, which at float32 computes
both products at HIGHEST precision. Tests check it against an independent float64 loop. Plain
`jnp`, so jit, vmap and grad work through it. Library code never imports this module.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kv import validation
from pallas_kv import xla


def _check(problem, *, scale, softcap=None, window=None, sinks=None, k_scale=None, v_scale=None) -> float:
  """Checks the options like the public op does; returns the scale with its default applied."""
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads,
                           token_shape=problem.scale_token_shape)
  return validation.default_scale(problem.head_dim) if scale is None else scale


def decode_attention_reference(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None,
                               k_scale=None, v_scale=None, return_lse=False, window_start=None):
  """Decode attention over a contiguous cache in float32. See `pallas_kv.decode_attention`."""
  problem = validation.validate_dense(q, k, v, lengths)
  validation.check_window_start(window_start, problem.batch)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                 v_scale=v_scale)
  return xla.decode_attention(q, _widened(k, k_scale), _widened(v, v_scale), lengths, scale=scale,
                              softcap=softcap, window=window, sinks=sinks, return_lse=return_lse,
                              window_start=window_start)


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None,
                                     window=None, sinks=None, k_scale=None, v_scale=None, return_lse=False,
                                     window_start=None):
  """Decode attention over a paged cache in float32. See `pallas_kv.paged_decode_attention`."""
  problem = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths)
  validation.check_window_start(window_start, problem.batch)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                 v_scale=v_scale)
  return xla.paged_decode_attention(q, _widened(k_pages, k_scale), _widened(v_pages, v_scale), block_tables,
                                    lengths, scale=scale, softcap=softcap, window=window, sinks=sinks,
                                    return_lse=return_lse, window_start=window_start)


def mla_decode_attention_reference(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None,
                                   return_lse=False):
  """Multi-head latent attention decode in float32. See `pallas_kv.mla_decode_attention`."""
  problem = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  scale = _check(problem, scale=scale)
  return xla.mla_decode_attention(q, kv_pages.astype(jnp.float32), block_tables, lengths, v_head_dim=v_head_dim,
                                  scale=scale, return_lse=return_lse)


def _widened(x, scale):
  """A cache (contiguous [B, T, Hkv, D] or paged [P, page_size, Hkv, D]) in float32 times its scale:
  a scalar, one per kv head [Hkv], or one per token and kv head (the cache's leading dims)."""
  x = x.astype(jnp.float32)
  if scale is None:
    return x
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim == 1:
    scale = scale.reshape(x.shape[-2], 1)
  elif scale.ndim == 3:
    scale = scale[..., None]
  return x * scale
