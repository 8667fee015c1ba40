"""The Pallas Triton backend as `pallas_kv.api` sees it: config resolution, split planning, and runs. The
splits merge in a second launch (`merge.merge_partials`) or in the kernel (one split, stream-K, merge_in_kernel)."""

from __future__ import annotations

import functools

from pallas_kv import runtime
from pallas_kv.config import TritonConfig
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import decode as triton_decode
from pallas_kv.kernels.triton import merge as triton_merge

NAME = triton_config.NAME
CONFIG_TYPE = TritonConfig
unsupported_reason = triton_config.unsupported_reason


def resolve_config(op: str, problem, config, *, dtype) -> TritonConfig:
  del op  # GQA only: unsupported_reason refuses MLA
  return triton_config.resolve_config(problem, config, dtype=dtype)


def plan_splits(op: str, problem, options, config: TritonConfig, lengths, *, ahead: bool = False) -> plan.SplitPlan:
  del op, ahead   # the same plan either way: Triton plans stream-K inside its kernel
  _, row_blocks = triton_config.row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  return plan.make_plan(lengths, problem=problem, config=config, window=options.window, row_blocks=row_blocks,
                        programs_per_sm=triton_config.programs_per_sm(config, problem))


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: TritonConfig,
        split_plan: plan.SplitPlan, sinks, k_scale, v_scale, return_lse: bool, window_start=None):
  """Runs an accepted call with a complete config and its plan; k, v are the caches (pages when paged);
  window_start: int32 [B] or None, each sequence's first visible key."""
  del op
  interpret = runtime.interpret_enabled()
  kw = dict(num_queries=problem.num_queries, options=options, config=config, plan=split_plan, interpret=interpret,
            v_tokens_last=problem.v_tokens_last)

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    return triton_decode.decode_partials(rows, k, v, lengths, block_tables, k_scale=k_scale, v_scale=v_scale,
                                         window_start=window_start, **kw)

  def merged(rows, lengths, block_tables, k_scale, v_scale, row_sinks):
    return triton_decode.decode_merged(rows, k, v, lengths, block_tables, sinks=row_sinks, k_scale=k_scale,
                                       v_scale=v_scale, out_dtype=q.dtype, return_lse=return_lse,
                                       window_start=window_start, **kw)

  # No merge launch with one split (docs/decisions.md#triton-one-split); stream-K merges in the launch.
  in_kernel = config.merge_in_kernel or split_plan.num_splits == 1 or split_plan.stream_k
  return frame.run(merged if in_kernel else partials, q, k, lengths, block_tables, problem=problem, sinks=sinks,
                   return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, merged=in_kernel,
                   merge=functools.partial(triton_merge.merge_partials, interpret=interpret),
                   cast_rows=False)   # the kernel casts bf16 q for a one-byte cache: no launch for it
