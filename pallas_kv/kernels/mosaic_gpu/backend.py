"""The Mosaic GPU backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op packs the q heads of a KV head into kernel rows, picks a config (explicit, else
heuristic), runs the split-K kernel and merges the splits (`pallas_kv.combine`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kv import combine
from pallas_kv import heuristics
from pallas_kv import runtime
from pallas_kv import validation
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode

NAME = "mosaic_gpu"
HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_GROUP = 16


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  _, kv_dtype = dtypes
  if op == "mla":
    return "MLA is not implemented on Mosaic GPU yet"
  if jnp.dtype(kv_dtype) not in KV_DTYPES:
    return f"the cache dtype {jnp.dtype(kv_dtype).name} is not supported (bfloat16 or float16)"
  if options.quantized:
    return "k_scale / v_scale (quantized caches) are not supported"
  if problem.head_dim not in HEAD_DIMS:
    return f"head_dim {problem.head_dim} is not one of {HEAD_DIMS}"
  if problem.group_size > MAX_GROUP:
    return f"{problem.group_size} q heads per kv head is over the supported {MAX_GROUP}"
  return None


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged)."""
  del op, k_scale, v_scale  # refused by unsupported_reason: quantized caches, MLA
  config = heuristics.mosaic_gpu_config(problem, config, dtype=k.dtype)
  q4, single = validation.query_as_rank4(q)
  rows = combine.pack_queries(q4, problem.num_kv_heads).astype(k.dtype)  # [B, Hkv, S*G, D]
  num_rows = rows.shape[2]
  out, lse = mgpu_decode.decode_partials(
      rows, k, v, jnp.clip(lengths.astype(jnp.int32), 0, problem.capacity),
      None if block_tables is None else jnp.clip(block_tables.astype(jnp.int32), 0, problem.num_pages - 1),
      num_queries=problem.num_queries, num_splits=config.num_splits, block_kv=config.block_kv,
      num_stages=config.num_stages, scale=options.scale, softcap=options.softcap, window=options.window,
      kv_groups=config.kv_groups, pipeline_qk=config.pipeline_qk,
      persistent_programs=runtime.num_sms() if config.persistent else None,
      interpret=runtime.mosaic_gpu_interpret_params())
  out, lse = out[:, :, :, :num_rows], lse[:, :, :, :num_rows]  # drop the rows padded for wgmma
  row_sinks = None
  if sinks is not None:
    per_head = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None],
                                (1, problem.num_queries, problem.num_heads, 1))
    row_sinks = combine.pack_queries(per_head, problem.num_kv_heads)[0, ..., 0]  # [Hkv, S*G]
  out, lse = combine.merge_splits(out, lse, row_sinks)
  out = combine.unpack_rows(out, problem.num_queries)
  lse = combine.unpack_rows(lse, problem.num_queries)
  if single:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
