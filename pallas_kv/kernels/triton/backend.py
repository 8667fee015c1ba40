"""The Pallas Triton backend as `pallas_kv.api` sees it: what it serves, and the ops on its kernels.

Each op picks a config (explicit, else tuned, else heuristic: `config.resolve_config`) and runs
the split-K kernel inside the row packing both backends share (`pallas_kv.kernels.split_k`).
The splits are merged by a second launch (`merge.merge_partials`), or with `merge_in_kernel` by
the kernel itself; with one split the kernel always writes the output itself.
"""

from __future__ import annotations

import functools

from pallas_kv import runtime
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import decode as triton_decode
from pallas_kv.kernels.triton import merge as triton_merge

NAME = triton_config.NAME
unsupported_reason = triton_config.unsupported_reason


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config: DecodeConfig | None, sinks,
        k_scale, v_scale, return_lse: bool):
  """Runs a call that `unsupported_reason` accepted. k, v are the caches (pages when paged)."""
  del op  # refused by unsupported_reason: MLA
  config = triton_config.resolve_config(problem, config, dtype=k.dtype)

  interpret = runtime.interpret_enabled()
  kw = dict(num_queries=problem.num_queries, options=options, config=config, interpret=interpret,
            v_tokens_last=problem.v_tokens_last)

  def plan(lengths):
    _, row_blocks = triton_config.row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
    return split_k.split_plan(lengths, problem=problem, config=config, window=options.window, row_blocks=row_blocks,
                              programs_per_sm=triton_config.PROGRAMS_PER_SM)

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    order = split_k.sequence_order(lengths, config)
    return triton_decode.decode_partials(rows, k, v, lengths, block_tables, k_scale=k_scale, v_scale=v_scale,
                                         tiles_per_split=plan(lengths), sequence_order=order, **kw)

  def merged(rows, lengths, block_tables, k_scale, v_scale, row_sinks):
    order = split_k.sequence_order(lengths, config)
    return triton_decode.decode_merged(rows, k, v, lengths, block_tables, sinks=row_sinks, k_scale=k_scale,
                                       v_scale=v_scale, out_dtype=q.dtype, return_lse=return_lse,
                                       tiles_per_split=plan(lengths), sequence_order=order, **kw)

  # With one split the merged kernel writes the output itself (no partials, no counters): measured
  # 134.3 -> 125.6 us at B64 T2048 on an H200 (benchmarks/RESULTS.md, "the Triton split merge").
  # Otherwise the splits' partials go to the merge kernel, a second launch (merge_in_kernel: the
  # kernel's own last split merges). Either way the kernel reads q unpadded and clamps lengths and
  # page ids itself, so nothing else is launched around it.
  in_kernel = config.merge_in_kernel or config.num_splits == 1 or config.split_plan == "stream_k"
  return split_k.run(merged if in_kernel else partials, q, k, lengths, block_tables, problem=problem, sinks=sinks,
                     return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, merged=in_kernel,
                     merge=functools.partial(triton_merge.merge_partials, interpret=interpret))
