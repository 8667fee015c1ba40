"""What the Pallas Triton decode kernel supports, its SMEM estimate, and its config choice.

A `TritonConfig` is filled field by field: what the caller gave, else a tuned config for this
device kind (`pallas_kv.tuned`), else the heuristic here; a split count left as None is chosen
from the batch and the SM count. `TritonConfig` checks its own fields; `check_config` checks what
this kernel adds (page sizes, head dims), and `decode_partials` runs it once per call.
"""

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
HEAD_DIMS = (64, 128, 256)
MIN_DOT_DIM = 16   # tl.dot needs every dimension >= 16
MIN_BLOCK_KV = 16
# Packed query rows one program keeps in registers (accumulator [rows, D] float32); more rows
# are split over programs, each of which re-reads its KV head.
MAX_ROWS_PER_PROGRAM = {64: 128, 128: 128, 256: 64}
# Shared memory the pipelined K and V tiles may take per program: Hopper's 227 KiB per block
# (also assumed without a GPU, as for lowering), else what fits an A100 (164 KiB). With the
# larger budget D 256 tiles keep three stages, measured 2-15% faster than two at B >= 16 on the
# H200 (Gemma-2-9B, benchmarks/RESULTS.md, seventeenth set).
HOPPER_SMEM_BUDGET_BYTES = 227 * 1024
SMEM_BUDGET_BYTES = 160 * 1024
# Several programs share an SM (Triton pipelines each program's loads). The split count assumes
# two; Nsight Compute counted three three-stage programs per SM at D 128 (71.7 KiB, 128 registers
# each; seventeenth set), and the split counts were tuned and measured with two.
PROGRAMS_PER_SM = 2
DEFAULT_BLOCK_KV = 64
# A one-byte V stored tokens last is read as [D, block_kv] rows of block_kv bytes, one row per
# head dim: 64-byte rows (half a cache line, D of them per tile) measured up to 26% slower on the
# H200 than 128-byte rows (benchmarks/RESULTS.md, seventh set).
TOKENS_LAST_ONE_BYTE_BLOCK_KV = 128
# Three stages everywhere the SMEM allows. Two stages (five programs per SM against three, at
# head_dim 128) read 1.5-14% faster on full-length batches whose grid makes one to 2.5 waves of
# three-stage programs, and 6-30% slower on ragged batches of the same shapes (sixteenth and
# seventeenth sets): the kernel cannot see at trace time which it gets, and serving is ragged.
DEFAULT_STAGES = 3
# The stream-K plan (TritonConfig.split_plan) by default where it was measured to pay (H200,
# benchmarks/RESULTS.md, eighteenth and nineteenth sets). On ragged batches it ran 3-42% faster
# than per-sequence splits (B16 T32768, B32 / B48 / B64 T8192, B128 T4096, paged page 16 B64
# T8192, 28 / 4 heads B32 T8192), at full length within 1.4% (B16 T32768, B64 T8192, B128 T4096).
# Each program meets about 1 + B / W sequences (W programs per kv head) and stores and merges at
# most two cut pieces, which cost about what a few tiles do: where a program's share is short the
# cuts show (full length B32 T4096 +8%, B64 T2048 +19%), and with B much under W a sequence is cut
# into many pieces that one program merges in turn (B8 T8192: +43%). So: B from 0.45 W to 4 W,
# and T >= 8192 or a share of at least ~16K tokens a program (B128 T4096 at W = 33). Only 16-bit
# caches at head_dim 128 were measured, up to T 32768: at Llama-3-8B B32 T131072 it ran 6% behind
# the per-sequence splits of the fifteenth set (twentieth set). Paged caches run three programs
# per SM (W = 49 at 8 kv heads): with two, stream-K read full-length batches at 3.6-3.8 TB/s, 7-19%
# behind per-sequence splits on five of six rows (likely: each tile's page ids, loaded ahead of
# it, want more warps in flight than a contiguous tile); with three, 4.0-4.2 TB/s at full length
# and 4-26% faster than per-sequence splits on every ragged row measured (pages 16 and 64, B16
# T32768, B64 T8192, B128 T4096: B from 0.33 W to 2.6 W). The share rule leaves paged B128 T4096
# (~10.7K tokens a program) to per-sequence splits: there stream-K was 4-10% faster ragged but 8%
# slower at full length with pages of 64.
STREAM_K_MIN_CAPACITY = 8192
STREAM_K_MAX_CAPACITY = 32768
STREAM_K_MIN_TOKENS_PER_PROGRAM = 15_000
STREAM_K_SEQUENCES_PER_PROGRAM = (0.45, 4.0)   # B / W
STREAM_K_PAGED_SEQUENCES_PER_PROGRAM = (0.3, 2.7)
STREAM_K_PAGED_PROGRAMS_PER_SM = 3
STREAM_K_HEAD_DIMS = (128,)


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def row_blocking(rows: int, head_dim: int) -> tuple[int, int]:
  """(rows per program, row blocks in the grid) for `rows` packed rows.

  Rows per program is a power of two >= 16 (tl.dot and Triton tensor shapes).
  """
  block = max(MIN_DOT_DIM, next_pow2(rows))
  block = min(block, MAX_ROWS_PER_PROGRAM[head_dim])
  return block, plan.cdiv(rows, block)


def smem_bytes(*, head_dim: int, itemsize: int, block_kv: int, num_stages: int, block_rows: int) -> int:
  """Estimated shared memory of one program: num_stages K and V tiles in flight, plus Q."""
  tile = block_kv * head_dim * itemsize
  return max(num_stages, 1) * 2 * tile + block_rows * head_dim * itemsize


def smem_budget() -> int:
  """The SMEM budget of the local GPU (`HOPPER_SMEM_BUDGET_BYTES` on Hopper or without a GPU)."""
  return HOPPER_SMEM_BUDGET_BYTES if runtime.gpu_device() is None or runtime.is_hopper_or_newer() else SMEM_BUDGET_BYTES


def fits_smem(*, budget: int | None = None, **kwargs) -> bool:
  """Whether `smem_bytes(**kwargs)` is within `budget` (default: the local GPU's, `smem_budget`)."""
  return smem_bytes(**kwargs) <= (smem_budget() if budget is None else budget)


def block_kv_for_page(page_size: int, block_kv: int = DEFAULT_BLOCK_KV) -> int | None:
  """The largest tile <= block_kv that a page of page_size tokens can serve, or None.

  A tile must lie within one page (block_kv divides page_size) or cover whole pages (page_size
  divides block_kv); block_kv is a power of two >= 16.
  """
  if page_size < 1:
    return None
  if page_size & (page_size - 1) == 0:   # a power of two: any tile size works
    return block_kv
  largest_pow2_divisor = page_size & -page_size
  if largest_pow2_divisor < MIN_BLOCK_KV:
    return None
  return min(block_kv, largest_pow2_divisor)


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  reason = frame.unsupported_reason(op, problem, options, dtypes, backend=NAME, head_dims=HEAD_DIMS)
  if reason is None and problem.page_size is not None and block_kv_for_page(problem.page_size) is None:
    reason = f"page_size {problem.page_size} is not supported (a power of two, or a multiple of {MIN_BLOCK_KV})"
  return reason


def check_config(config: TritonConfig, *, head_dim: int, page_size: int | None) -> None:
  """What this kernel needs of a complete config beyond `TritonConfig`'s own rules."""
  if not isinstance(config, TritonConfig) or not config.complete:
    raise ValueError(f"the triton kernel takes a complete TritonConfig (resolve_config), got {config!r}")
  if head_dim not in HEAD_DIMS:
    raise ValueError(f"head_dim={head_dim} must be one of {HEAD_DIMS}")
  if page_size is not None and page_size % config.block_kv and config.block_kv % page_size:
    raise ValueError(f"block_kv={config.block_kv} must divide page_size={page_size} or be a multiple of it")


def heuristic_config(problem, *, dtype: Any = "bfloat16", budget: int | None = None) -> TritonConfig:
  """The default tile, stages and warps: fewer stages, then smaller tiles, until the tiles in
  flight fit in `budget` bytes of SMEM (default: the local GPU's, `smem_budget`); per-sequence
  splits in batch order, their count left to `resolve_config`."""
  budget = smem_budget() if budget is None else budget
  itemsize = jnp.dtype(dtype).itemsize   # one-byte caches: twice the tokens in flight per byte
  block_rows, _ = row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  block_kv = DEFAULT_BLOCK_KV
  if itemsize == 1 and problem.v_tokens_last:
    # Paged too: a tile that spans pages of 16 or 32 loads page by page; 128-token tiles measured
    # faster than 64 at pages 16 and 64 (docs/decisions.md#tokens-last-tiles).
    block_kv = TOKENS_LAST_ONE_BYTE_BLOCK_KV
  if problem.page_size is not None:
    block_kv = block_kv_for_page(problem.page_size, block_kv) or block_kv
  config = TritonConfig(block_kv=block_kv, num_stages=DEFAULT_STAGES, split_plan="per_sequence",
                        num_warps=8 if block_rows * problem.head_dim >= 128 * 128 else 4,
                        sequence_order="given", merge_in_kernel=False)
  fits = lambda c: fits_smem(head_dim=problem.head_dim, itemsize=itemsize, block_kv=c.block_kv,
                             num_stages=c.num_stages, block_rows=block_rows, budget=budget)
  while not fits(config):
    if config.num_stages > 2:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    elif config.block_kv > MIN_BLOCK_KV:
      config = dataclasses.replace(config, block_kv=config.block_kv // 2)
    else:
      break
  return config


def resolve_config(problem, config: TritonConfig | None, *, dtype: Any = "bfloat16", num_sms: int | None = None,
                   device_kind: str | None = None) -> TritonConfig:
  """The complete config of a call: the tuned one when none is given, else the given fields over
  the heuristic's, with a split count; a config that fixes none of the plan's fields takes the
  stream-K plan where `stream_k_pays`."""
  given = TritonConfig() if config is None else config
  if not isinstance(given, TritonConfig):
    raise TypeError(f"the triton backend takes a TritonConfig, got {type(given).__name__}")
  resolved = (tuned.tuned_config(NAME, problem, dtype, device_kind) if config is None else None) or given
  resolved = resolved.over(heuristic_config(problem, dtype=dtype))
  _, row_blocks = row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
  num_sms = num_sms or runtime.num_sms()
  plan_free = given.split_plan is None and given.num_splits is None and given.sequence_order in (None, "given")
  if plan_free:
    programs = plan.stream_k_programs(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                                      programs_per_sm=stream_k_programs_per_sm(problem))
    if stream_k_pays(problem, dtype=dtype, programs=programs):
      return dataclasses.replace(resolved, split_plan="stream_k", num_splits=programs, sequence_order="given")
  return plan.fill_num_splits(problem, resolved, row_blocks=row_blocks, programs_per_sm=programs_per_sm(resolved, problem),
                              num_sms=num_sms)


def programs_per_sm(config: TritonConfig, problem) -> int:
  """Programs per SM that the split count and the balanced plan assume."""
  return stream_k_programs_per_sm(problem) if config.split_plan == "stream_k" else PROGRAMS_PER_SM


def stream_k_programs_per_sm(problem) -> int:
  """Programs per SM of the stream-K plan (STREAM_K_* above): three on a paged cache, else two."""
  return PROGRAMS_PER_SM if problem.page_size is None else STREAM_K_PAGED_PROGRAMS_PER_SM


def stream_k_pays(problem, *, dtype: Any, programs: int) -> bool:
  """Whether the default config takes the stream-K plan (STREAM_K_* above): about 0.5-4 sequences
  per program (0.3-2.7 paged), long enough sequences or shares but T <= 32768, and what was measured
  (16-bit, head_dim 128)."""
  low, high = STREAM_K_SEQUENCES_PER_PROGRAM if problem.page_size is None else STREAM_K_PAGED_SEQUENCES_PER_PROGRAM
  long_enough = (problem.capacity >= STREAM_K_MIN_CAPACITY
                 or problem.batch * problem.capacity >= STREAM_K_MIN_TOKENS_PER_PROGRAM * programs)
  return (long_enough and problem.capacity <= STREAM_K_MAX_CAPACITY
          and low * programs <= problem.batch <= high * programs
          and problem.head_dim in STREAM_K_HEAD_DIMS and jnp.dtype(dtype).itemsize == 2)
