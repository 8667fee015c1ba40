"""The Mosaic GPU backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op picks a config (explicit, else tuned, else heuristic: `config.resolve_config`, or
`mla_config.resolve_config` for MLA) and runs its split-K kernel between the row packing and split
merging that both backends share (`pallas_kv.kernels.split_k`).
"""

from __future__ import annotations

import functools

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from pallas_kv.kernels.mosaic_gpu import merge as mgpu_merge
from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
from pallas_kv.kernels.mosaic_gpu import mla_config

NAME = mgpu_config.NAME
unsupported_reason = mgpu_config.unsupported_reason


def interpret_params():
  """The `interpret=` argument of the kernels: InterpretGPUParams() in interpret mode, else False."""
  return plgpu.InterpretGPUParams() if runtime.interpret_enabled() else False


def fused_merge():
  """The split merge in one launch (the Pallas Triton merge kernel), or None to merge in XLA
  where the Triton backend's folder is gone. XLA's merge was 3-4 launches, ~5 us of a 52 us GQA
  and ~9 us of a 49 us MLA call at batch 1 on the H200 (benchmarks/RESULTS.md)."""
  try:
    from pallas_kv.kernels.triton import merge   # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return functools.partial(merge.merge_partials, interpret=runtime.interpret_enabled())


def mla_merge():
  """The MLA split merge overlapped with the kernel: the Mosaic GPU merge launch (programmatic
  dependent launch, `merge.py`), with `fused_merge`'s signature; it refuses (NotImplementedError)
  what its 64-row blocks cannot cover. Not the op's: at B1 T32768 (64 splits, 128 heads) the call
  took 34.4 us with it against 25.8 with the Triton merge (benchmarks/RESULTS.md, fourteenth set);
  `benchmarks.mla` times it (kernel_sp<N>_mosaic_merge)."""
  return functools.partial(mgpu_merge.merge_partials, interpret=interpret_params())


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged; for MLA
  both are the latent pool)."""
  if op == "mla":
    return run_mla(q, k, lengths, block_tables, problem=problem, options=options, config=config,
                   return_lse=return_lse)
  config = mgpu_config.resolve_config(problem, config, dtype=k.dtype)

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    _, row_blocks = mgpu_config.row_blocking(problem.num_queries * problem.group_size)
    plan = split_k.split_plan(lengths, problem=problem, config=config, window=options.window, row_blocks=row_blocks)
    return mgpu_decode.decode_partials(rows, k, v, lengths, block_tables, num_queries=problem.num_queries,
                                       options=options, config=config, k_scale=k_scale, v_scale=v_scale,
                                       tiles_per_split=plan, interpret=interpret_params())

  return split_k.run(partials, q, k, lengths, block_tables, problem=problem, sinks=sinks, return_lse=return_lse,
                     k_scale=k_scale, v_scale=v_scale, merge=fused_merge())


def run_mla(q, kv_pages, lengths, block_tables, *, problem, options, config: DecodeConfig | None,
            return_lse: bool):
  """MLA over the latent pool kv_pages [P, page_size, Dqk]: the packed rows of every q head go to
  `mla.mla_partials` (one latent head: Hkv = 1)."""
  config = mla_config.resolve_config(problem, config, dtype=kv_pages.dtype)

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    del k_scale, v_scale   # MLA takes no scales
    plan = split_k.split_plan(lengths, problem=problem, config=config, window=None,
                              row_blocks=mla_config.row_blocks(rows.shape[2]))
    out, lse = mgpu_mla.mla_partials(rows[:, 0], kv_pages, lengths, block_tables,
                                     num_queries=problem.num_queries, v_head_dim=problem.v_head_dim,
                                     scale=options.scale, config=config, tiles_per_split=plan,
                                     sequence_order=split_k.sequence_order(lengths, config),
                                     interpret=interpret_params())
    return out[:, None], lse[:, None]   # [B, Hkv = 1, splits, R, ...]

  return split_k.run(partials, q, kv_pages, lengths, block_tables, problem=problem, sinks=None,
                     return_lse=return_lse, merge=fused_merge())
