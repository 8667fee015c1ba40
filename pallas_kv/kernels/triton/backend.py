"""The Pallas Triton backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op picks a config (explicit, else tuned, else heuristic) and runs the split-K kernel between
the row packing and split merging that both backends share (`pallas_kv.kernels.split_k`).
"""

from __future__ import annotations

from pallas_kv import heuristics
from pallas_kv import runtime
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.triton import decode as triton_decode

NAME = "triton"
HEAD_DIMS = triton_decode.HEAD_DIMS


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  reason = split_k.unsupported_reason(op, problem, options, dtypes, backend="triton", head_dims=HEAD_DIMS)
  if reason is None and problem.page_size is not None and heuristics.triton_block_kv_for_page(
      problem.page_size) is None:
    reason = (f"page_size {problem.page_size} is not supported (a power of two, or a multiple of "
              f"{triton_decode.MIN_BLOCK_KV})")
  return reason


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged)."""
  del op, k_scale, v_scale  # refused by unsupported_reason: quantized caches, MLA
  config = heuristics.triton_config(problem, config, dtype=k.dtype)

  def partials(rows, lengths, block_tables):
    return triton_decode.decode_partials(
        rows, k, v, lengths, block_tables, num_queries=problem.num_queries, num_splits=config.num_splits,
        block_kv=config.block_kv, num_stages=config.num_stages, num_warps=config.num_warps, scale=options.scale,
        softcap=options.softcap, window=options.window, interpret=runtime.triton_interpret_flag())

  return split_k.run(partials, q, k, lengths, block_tables, problem=problem, sinks=sinks, return_lse=return_lse)
