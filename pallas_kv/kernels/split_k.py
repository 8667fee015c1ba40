"""What both kernel backends share around their split-K kernels: the calls they serve and the
packing / merging of rows around a kernel's partials."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from pallas_kv import combine
from pallas_kv import validation

KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_GROUP = 16


def unsupported_reason(op: str, problem, options, dtypes, *, backend: str, head_dims) -> str | None:
  """Why a split-K GQA backend cannot serve the call (MLA, quantized or other caches), or None."""
  _, kv_dtype = dtypes
  if op == "mla":
    return f"MLA is not implemented on the {backend} backend"
  if jnp.dtype(kv_dtype) not in KV_DTYPES:
    return f"the cache dtype {jnp.dtype(kv_dtype).name} is not supported (bfloat16 or float16)"
  if options.quantized:
    return "k_scale / v_scale (quantized caches) are not supported"
  if problem.head_dim not in head_dims:
    return f"head_dim {problem.head_dim} is not one of {tuple(head_dims)}"
  if problem.group_size > MAX_GROUP:
    return f"{problem.group_size} q heads per kv head is over the supported {MAX_GROUP}"
  return None


def check_partials_args(q, k, v, lengths, *, num_queries: int, num_splits: int, num_stages: int, scale: float,
                        softcap: float | None, window: int | None) -> None:
  """The argument checks every backend's `decode_partials` makes (q packed as [B, Hkv, R, D])."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Hkv, R, D], got {q.shape=}")
  if k.ndim != 4 or v.shape != k.shape:
    raise ValueError(f"k and v must have one 4-d shape, got {k.shape=} {v.shape=}")
  B, Hkv, R, D = q.shape
  if k.shape[2:] != (Hkv, D):
    raise ValueError(f"k's heads and head_dim {k.shape[2:]=} must match q's {(Hkv, D)}")
  if jnp.dtype(k.dtype) not in KV_DTYPES:
    raise ValueError(f"k.dtype={jnp.dtype(k.dtype).name} must be bfloat16 or float16")
  if q.dtype != k.dtype or v.dtype != k.dtype:
    raise ValueError(f"q, k, v must share a dtype, got {q.dtype=} {k.dtype=} {v.dtype=}")
  if num_queries < 1 or R % num_queries:
    raise ValueError(f"{num_queries=} must be >= 1 and divide the packed rows {R=}")
  if num_splits < 1:
    raise ValueError(f"{num_splits=} must be >= 1")
  if num_stages < 1:
    raise ValueError(f"{num_stages=} must be >= 1")
  if lengths.shape != (B,) or lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32 [{B}], got {lengths.shape=} {lengths.dtype=}")
  if not scale > 0:
    raise ValueError(f"{scale=} must be positive")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"{softcap=} must be positive or None")
  if window is not None and window < 1:
    raise ValueError(f"{window=} must be a positive int or None")


def run(partials: Callable, q, k, lengths, block_tables, *, problem, sinks, return_lse: bool):
  """Packs q into kernel rows, calls partials(rows, lengths, block_tables) -> (out, lse) per split
  ([B, Hkv, splits, >= R, D], [B, Hkv, splits, >= R]), merges the splits and unpacks the rows.

  Lengths are clamped to [0, T] and page ids to [0, P) before the kernel sees them.
  """
  q4, single = validation.query_as_rank4(q)
  rows = combine.pack_queries(q4, problem.num_kv_heads).astype(k.dtype)  # [B, Hkv, R = S*G, D]
  num_rows = rows.shape[2]
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, problem.capacity)
  if block_tables is not None:
    block_tables = jnp.clip(block_tables.astype(jnp.int32), 0, problem.num_pages - 1)
  out, lse = partials(rows, lengths, block_tables)
  out, lse = out[:, :, :, :num_rows], lse[:, :, :, :num_rows]  # drop rows a kernel padded
  row_sinks = None
  if sinks is not None:
    per_head = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None],
                                (1, problem.num_queries, problem.num_heads, 1))
    row_sinks = combine.pack_queries(per_head, problem.num_kv_heads)[0, ..., 0]  # [Hkv, R]
  out, lse = combine.merge_splits(out, lse, row_sinks)
  out = combine.unpack_rows(out, problem.num_queries)
  lse = combine.unpack_rows(lse, problem.num_queries)
  if single:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
