"""The Mosaic GPU backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op picks a config (explicit, else tuned, else heuristic: `config.resolve_config`) and runs
the split-K kernel between the row packing and split merging that both backends share
(`pallas_kv.kernels.split_k`).
"""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode

NAME = mgpu_config.NAME
unsupported_reason = mgpu_config.unsupported_reason


def interpret_params():
  """The `interpret=` argument of the kernels: InterpretGPUParams() in interpret mode, else False."""
  return plgpu.InterpretGPUParams() if runtime.interpret_enabled() else False


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged)."""
  del op  # refused by unsupported_reason: MLA
  config = mgpu_config.resolve_config(problem, config, dtype=k.dtype)

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    return mgpu_decode.decode_partials(rows, k, v, lengths, block_tables, num_queries=problem.num_queries,
                                       options=options, config=config, k_scale=k_scale, v_scale=v_scale,
                                       interpret=interpret_params())

  return split_k.run(partials, q, k, lengths, block_tables, problem=problem, sinks=sinks, return_lse=return_lse,
                     k_scale=k_scale, v_scale=v_scale)
