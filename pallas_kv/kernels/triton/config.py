"""What the Pallas Triton decode kernel supports, its SMEM estimate, and its config choice: `resolve_config`
takes each field from the caller, else the tuned config (`pallas_kv.tuned`), else `heuristic_config`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kv import runtime
from pallas_kv import tuned
from pallas_kv.config import TritonConfig
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan

NAME = "triton"
# Any multiple of HEAD_DIM_STEP in the range: tiles pad to a power of two in the kernel, loads masked past D.
# Steps of 8 keep the column mask constant over 16-byte runs of 16-bit values: the loads stay vectorized.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 32, 512, 8
MIN_DOT_DIM = 16   # tl.dot needs every dimension >= 16
MIN_BLOCK_KV = 16
# Rows one program accumulates in registers, rows x padded D float32 (128 x 128 at D 128); more rows go to more
# programs, each re-reading its KV head.
MAX_ROWS_PER_PROGRAM = 128
MAX_ACCUMULATOR_ELEMENTS = 128 * 128
# SMEM for pipelined tiles: Hopper's, also when lowering without a GPU (docs/decisions.md#triton-smem-budget).
HOPPER_SMEM_BUDGET_BYTES = 227 * 1024
SMEM_BUDGET_BYTES = 160 * 1024
# What the split counts were tuned with, though 3 fit at D 128 (docs/decisions.md#triton-programs-per-sm).
PROGRAMS_PER_SM = 2
# Programs of this many rows or more (MQA groups; S x group > 32) are compute-heavy: one per SM, half the
# splits, measured faster (docs/decisions.md#triton-wide-rows).
WIDE_ROWS = 64
WIDE_ROWS_PROGRAMS_PER_SM = 1
DEFAULT_BLOCK_KV = 64
# One-byte v tokens last loads rows of block_kv bytes: whole cache lines (docs/decisions.md#tokens-last-tiles).
TOKENS_LAST_ONE_BYTE_BLOCK_KV = 128
# Three wherever SMEM allows: ragged batches need them, and trace time cannot tell
# (docs/decisions.md#triton-three-stages).
DEFAULT_STAGES = 3
# Stream-K by default where it pays: long shares, few cuts per sequence, measured shapes only
# (docs/decisions.md#stream-k-default, docs/decisions.md#stream-k-paged).
STREAM_K_MIN_CAPACITY = 8192
STREAM_K_MAX_CAPACITY = 32768
STREAM_K_MIN_TOKENS_PER_PROGRAM = 15_000
STREAM_K_SEQUENCES_PER_PROGRAM = (0.45, 4.0)   # batch / programs per head block
STREAM_K_PAGED_SEQUENCES_PER_PROGRAM = (0.3, 2.7)
STREAM_K_PAGED_PROGRAMS_PER_SM = 3
STREAM_K_HEAD_DIMS = (128,)


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def padded_dim(head_dim: int) -> int:
  """head_dim padded to one array: Triton's arrays are powers of two, and tl.dot's dims >= 16."""
  return max(MIN_DOT_DIM, next_pow2(head_dim))


# A [rows, D] tile is up to this many power-of-two column pieces (96 = 64 + 32), each its own array and dot,
# so that padding does not multiply the work per byte; the last piece pads what is left. 1 gives one padded
# tile, to measure against (set it before a process's first call: traces are cached).
MAX_COLUMN_PIECES = 3


def column_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
  """(first column, width) of the pieces that cover head_dim: the largest powers of two that fit, then the rest
  padded (`padded_dim`); columns past head_dim are masked."""
  pieces, offset = [], 0
  while offset < head_dim:
    rest = head_dim - offset
    last = len(pieces) == MAX_COLUMN_PIECES - 1 or rest < MIN_DOT_DIM
    width = padded_dim(rest) if last else 1 << (rest.bit_length() - 1)
    pieces.append((offset, width))
    offset += width
  return tuple(pieces)


def tile_width(head_dim: int) -> int:
  """Columns the kernel's [rows, D] tiles hold: D, or a little more where a piece is padded."""
  return sum(width for _, width in column_pieces(head_dim))


def head_dim_reason(head_dim: int) -> str | None:
  if head_dim % HEAD_DIM_STEP or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
    return f"head_dim {head_dim} is not a multiple of {HEAD_DIM_STEP} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
  return None


def max_rows_per_program(head_dim: int) -> int:
  """128 rows up to D 128, 64 at D 256, 32 at D 512."""
  return min(MAX_ROWS_PER_PROGRAM, next_pow2(MAX_ACCUMULATOR_ELEMENTS // tile_width(head_dim) + 1) // 2)


def row_blocking(rows: int, head_dim: int) -> tuple[int, int]:
  """(rows per program, a power of two >= 16; row blocks in the grid) for `rows` packed rows."""
  block = min(max(MIN_DOT_DIM, next_pow2(rows)), max_rows_per_program(head_dim))
  return block, plan.cdiv(rows, block)


def smem_bytes(*, head_dim: int, itemsize: int, block_kv: int, num_stages: int, block_rows: int) -> int:
  """Pipelined K and V tiles and the q rows, at the width the kernel's tiles have (`tile_width`)."""
  width = tile_width(head_dim)
  return max(num_stages, 1) * 2 * block_kv * width * itemsize + block_rows * width * itemsize


def smem_budget() -> int:
  return HOPPER_SMEM_BUDGET_BYTES if runtime.gpu_device() is None or runtime.is_hopper_or_newer() else SMEM_BUDGET_BYTES


def fits_smem(*, budget: int | None = None, **kwargs) -> bool:
  return smem_bytes(**kwargs) <= (smem_budget() if budget is None else budget)


def block_kv_for_page(page_size: int, block_kv: int = DEFAULT_BLOCK_KV) -> int | None:
  """The largest tile <= block_kv (a power of two >= 16) that divides page_size or is a multiple of it, or None."""
  if page_size < 1:
    return None
  if page_size & (page_size - 1) == 0:
    return block_kv
  largest_pow2_divisor = page_size & -page_size
  if largest_pow2_divisor < MIN_BLOCK_KV:
    return None
  return min(block_kv, largest_pow2_divisor)


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  reason = frame.unsupported_reason(op, problem, options, dtypes, backend=NAME)
  if reason is None:
    reason = head_dim_reason(problem.head_dim)
  if reason is None and problem.page_size is not None and block_kv_for_page(problem.page_size) is None:
    reason = f"page_size {problem.page_size} is not supported (a power of two, or a multiple of {MIN_BLOCK_KV})"
  return reason


def check_config(config: TritonConfig, *, head_dim: int, page_size: int | None) -> None:
  if not isinstance(config, TritonConfig) or not config.complete:
    raise ValueError(f"the triton kernel takes a complete TritonConfig (resolve_config), got {config!r}")
  if (reason := head_dim_reason(head_dim)) is not None:
    raise ValueError(reason)
  if page_size is not None and page_size % config.block_kv and config.block_kv % page_size:
    raise ValueError(f"block_kv={config.block_kv} must divide page_size={page_size} or be a multiple of it")


def heuristic_config(problem, *, dtype: Any = "bfloat16", budget: int | None = None) -> TritonConfig:
  """The default tile, stages and warps; to fit `budget` bytes of SMEM, fewer stages, then half the tile with
  three stages again (D 512 on Hopper: 32 tokens, three stages)."""
  budget = smem_budget() if budget is None else budget
  itemsize = jnp.dtype(dtype).itemsize
  block_rows, _ = row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  block_kv = DEFAULT_BLOCK_KV
  if itemsize == 1 and problem.v_tokens_last:
    block_kv = TOKENS_LAST_ONE_BYTE_BLOCK_KV
  if problem.page_size is not None:
    block_kv = block_kv_for_page(problem.page_size, block_kv) or block_kv
  config = TritonConfig(block_kv=block_kv, num_stages=DEFAULT_STAGES, split_plan="per_sequence",
                        num_warps=8 if block_rows * tile_width(problem.head_dim) >= 128 * 128 else 4,
                        sequence_order="given", merge_in_kernel=False)
  fits = lambda c: fits_smem(head_dim=problem.head_dim, itemsize=itemsize, block_kv=c.block_kv,
                             num_stages=c.num_stages, block_rows=block_rows, budget=budget)
  while not fits(config):
    if config.num_stages > 2:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    elif config.block_kv > MIN_BLOCK_KV:
      config = dataclasses.replace(config, block_kv=config.block_kv // 2, num_stages=DEFAULT_STAGES)
    else:
      break
  return config


def resolve_config(problem, config: TritonConfig | None, *, dtype: Any = "bfloat16", num_sms: int | None = None,
                   device_kind: str | None = None) -> TritonConfig:
  """The complete config of a call; one that fixes no plan field takes stream-K where `stream_k_pays`."""
  given = TritonConfig() if config is None else config
  if not isinstance(given, TritonConfig):
    raise TypeError(f"the triton backend takes a TritonConfig, got {type(given).__name__}")
  resolved = (tuned.tuned_config(NAME, problem, dtype, device_kind) if config is None else None) or given
  resolved = resolved.over(heuristic_config(problem, dtype=dtype))
  _, row_blocks = row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  num_sms = num_sms or runtime.num_sms()
  if not plan.fixes_plan(given):
    programs = plan.stream_k_programs(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                                      programs_per_sm=stream_k_programs_per_sm(problem))
    if stream_k_pays(problem, dtype=dtype, programs=programs):
      return plan.as_stream_k(resolved, programs)
  return plan.fill_num_splits(problem, resolved, row_blocks=row_blocks, programs_per_sm=programs_per_sm(resolved, problem),
                              num_sms=num_sms)


def programs_per_sm(config: TritonConfig, problem) -> int:
  if plan.is_stream_k(config):
    return stream_k_programs_per_sm(problem)
  block_rows, _ = row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  return WIDE_ROWS_PROGRAMS_PER_SM if block_rows >= WIDE_ROWS else PROGRAMS_PER_SM


def stream_k_programs_per_sm(problem) -> int:
  return PROGRAMS_PER_SM if problem.page_size is None else STREAM_K_PAGED_PROGRAMS_PER_SM


def stream_k_pays(problem, *, dtype: Any, programs: int) -> bool:
  low, high = STREAM_K_SEQUENCES_PER_PROGRAM if problem.page_size is None else STREAM_K_PAGED_SEQUENCES_PER_PROGRAM
  long_enough = (problem.capacity >= STREAM_K_MIN_CAPACITY
                 or problem.batch * problem.capacity >= STREAM_K_MIN_TOKENS_PER_PROGRAM * programs)
  return (long_enough and problem.capacity <= STREAM_K_MAX_CAPACITY
          and low * programs <= problem.batch <= high * programs
          and problem.head_dim in STREAM_K_HEAD_DIMS and jnp.dtype(dtype).itemsize == 2)
