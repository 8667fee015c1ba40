"""The Mosaic GPU backend as `pallas_kv.api` sees it: each op resolves its kernel's config, plans the
splits once and runs the split-K kernel inside the shared row packing and merge (`kernels.frame`)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from pallas_kv.kernels.mosaic_gpu import merge as mgpu_merge
from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
from pallas_kv.kernels.mosaic_gpu import mla_config

NAME = mgpu_config.NAME


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  if op == "mla":
    return mla_config.unsupported_reason(problem, dtypes)
  return mgpu_config.unsupported_reason(op, problem, options, dtypes)


def interpret_params():
  """The `interpret=` argument of the kernels: InterpretGPUParams() in interpret mode, else False."""
  return plgpu.InterpretGPUParams() if runtime.interpret_enabled() else False


def fused_merge():
  """The split merge of the ops, one launch: Triton's where Pallas Triton imports (measured: docs/decisions.md#fused-
  merge), else Mosaic GPU's (`mosaic_merge`)."""
  try:
    from pallas_kv.kernels.triton import merge   # pylint: disable=g-import-not-at-top
  except ImportError:
    return mosaic_merge
  return functools.partial(merge.merge_partials, interpret=runtime.interpret_enabled())


def mosaic_merge(out, lse, sinks, *, rows: int, out_dtype, return_lse: bool):
  """The Mosaic GPU merge launch (`kernels/mosaic_gpu/merge.py`) where it takes the partials, else XLA's
  (`frame.merge_splits`): the contract of `frame.run`'s merge."""
  reason = mgpu_merge.unsupported_reason(out.shape, lse.shape, out.dtype, rows=rows, has_sinks=sinks is not None,
                                         return_lse=return_lse)
  if reason is None:
    return mgpu_merge.merge_partials(out, lse, sinks, out_dtype=out_dtype, return_lse=return_lse, rows=rows,
                                     interpret=interpret_params())
  merged, merged_lse = frame.merge_splits(out, lse, sinks, rows=rows)
  return merged.astype(out_dtype), merged_lse if return_lse else None


def resolve_config(op: str, problem, config, *, dtype):
  if op == "mla":
    return mla_config.resolve_config(problem, config, dtype=dtype)
  return mgpu_config.resolve_config(problem, config, dtype=dtype)


def plan_splits(op: str, problem, options, config, lengths, *, ahead: bool = False) -> plan.SplitPlan:
  """The call's split plan for a complete config; ahead: made once for several calls (`plan.make_plan`)."""
  if op == "mla":
    return plan.make_plan(lengths, problem=problem, config=config, window=None,
                          row_blocks=mla_config.row_blocks(problem.num_queries * problem.num_heads))
  _, row_blocks = mgpu_config.row_blocking(problem.num_queries * problem.group_size)
  return plan.make_plan(lengths, problem=problem, config=config, window=options.window, row_blocks=row_blocks,
                        walked=True, ahead=ahead)


def run(op: str, q, k, v, lengths, block_tables, *, problem, options, config, split_plan: plan.SplitPlan, sinks,
        k_scale, v_scale, return_lse: bool, window_start=None):
  """Runs an accepted call with a complete config and its plan; k, v: the caches (MLA: both the latent pool);
  window_start: int32 [B] or None, each sequence's first visible key."""
  if op == "mla":
    return _run_mla(q, k, lengths, block_tables, problem=problem, options=options, config=config,
                    split_plan=split_plan, return_lse=return_lse, kv_scale=k_scale)

  # One split without sinks is the output: stored in q's dtype, so that no cast follows the kernel (two tile
  # consumers hand a partial over through the float32 staging, so they keep it).
  direct = split_plan.num_splits == 1 and sinks is None and config.tile_consumers == 1
  out_dtype = q.dtype if direct else jnp.float32

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    return mgpu_decode.decode_partials(rows, k, v, lengths, block_tables, num_queries=problem.num_queries,
                                       options=options, config=config, plan=split_plan, k_scale=k_scale,
                                       v_scale=v_scale, interpret=interpret_params(), window_start=window_start,
                                       v_tokens_last=problem.v_tokens_last, out_dtype=out_dtype)

  # The queries as N make Q's one-byte terms from q's 16-bit rows in the kernel (`fp8_operands.split_queries`):
  # no cast before it.
  return frame.run(partials, q, k, lengths, block_tables, problem=problem, sinks=sinks, return_lse=return_lse,
                   k_scale=k_scale, v_scale=v_scale, merge=fused_merge(), cast_rows=not config.queries_as_n)


def _run_mla(q, kv_pages, lengths, block_tables, *, problem, options, config, split_plan, return_lse: bool,
             kv_scale=None):
  """MLA over the latent pool kv_pages [P, page_size, Dqk], as one kv head (Hkv = 1); kv_scale: an fp8 pool's."""

  def partials(rows, lengths, block_tables, k_scale, v_scale):
    del v_scale
    out, lse = mgpu_mla.mla_partials(rows[:, 0], kv_pages, lengths, block_tables,
                                     num_queries=problem.num_queries, v_head_dim=problem.v_head_dim,
                                     scale=options.scale, config=config, plan=split_plan, kv_scale=k_scale,
                                     interpret=interpret_params())
    return out[:, None], lse[:, None]   # [B, Hkv = 1, splits, R, ...]

  return frame.run(partials, q, kv_pages, lengths, block_tables, problem=problem, sinks=None,
                   return_lse=return_lse, k_scale=kv_scale, merge=fused_merge())
