"""The Mosaic GPU backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op picks a config (explicit, else tuned, else heuristic) and runs the split-K kernel between
the row packing and split merging that both backends share (`pallas_kv.kernels.split_k`).
"""

from __future__ import annotations

from pallas_kv import heuristics
from pallas_kv import runtime
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode

NAME = "mosaic_gpu"
HEAD_DIMS = (64, 128, 256)


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  return split_k.unsupported_reason(op, problem, options, dtypes, backend="Mosaic GPU", head_dims=HEAD_DIMS)


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged)."""
  del op, k_scale, v_scale  # refused by unsupported_reason: quantized caches, MLA
  config = heuristics.mosaic_gpu_config(problem, config, dtype=k.dtype)

  def partials(rows, lengths, block_tables):
    return mgpu_decode.decode_partials(
        rows, k, v, lengths, block_tables, num_queries=problem.num_queries, num_splits=config.num_splits,
        block_kv=config.block_kv, num_stages=config.num_stages, scale=options.scale, softcap=options.softcap,
        window=options.window, kv_groups=config.kv_groups, pipeline_qk=config.pipeline_qk,
        persistent_programs=runtime.num_sms() if config.persistent else None,
        interpret=runtime.mosaic_gpu_interpret_params())

  return split_k.run(partials, q, k, lengths, block_tables, problem=problem, sinks=sinks, return_lse=return_lse)
