"""Split count and tile choice from the shape and the device.

Order of choice: an explicit config, else a tuned one for this device kind (`pallas_kv.tuned`),
else the heuristic. A split count left as None is filled in from the batch and the SM count.
"""

from __future__ import annotations

import dataclasses

from pallas_kv import runtime
from pallas_kv import tuned
from pallas_kv.config import DecodeConfig

# A split shorter than this many tiles spends more on its prologue and the combine than it saves.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def choose_num_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                      num_sms: int, programs_per_sm: int = 1) -> int:
  """Splits per sequence so that the grid fills the GPU in about one wave.

  No split when batch x kv heads already fill it, or when the context is short.
  """
  programs = batch * num_kv_heads * row_blocks
  slots = num_sms * programs_per_sm
  if programs >= slots:
    return 1
  by_occupancy = slots // programs
  by_length = max(1, _cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def tuned_config(backend: str, problem, dtype, device_kind: str | None = None) -> DecodeConfig | None:
  """The tuned config for this call on the local (or named) device kind, if the tuned file has one."""
  op = "decode" if problem.page_size is None else "paged"
  return tuned.lookup(backend, tuned.shape_key(op, problem, dtype), device_kind or runtime.device_kind())


def mosaic_gpu_config(problem, config: DecodeConfig | None, *, dtype="bfloat16", num_sms: int | None = None,
                      device_kind: str | None = None) -> DecodeConfig:
  """Explicit config, else tuned, else the heuristic one, with the split count filled in."""
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  if config is None:
    config = tuned_config("mosaic_gpu", problem, dtype, device_kind)
  if config is None:
    config = DecodeConfig()
    rows = problem.num_queries * problem.group_size
    # Fewer stages when the packed rows need two consumer warpgroups or D is large.
    while config.num_stages > 2 and not mgpu_decode.fits_smem(
        rows=rows, head_dim=problem.head_dim, dtype=dtype, block_kv=config.block_kv,
        num_stages=config.num_stages, page_size=problem.page_size):
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  if config.num_splits is None:
    _, row_blocks = mgpu_decode.row_blocking(problem.num_queries * problem.group_size)
    splits = choose_num_splits(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                               capacity=problem.capacity, block_kv=config.block_kv,
                               num_sms=num_sms or runtime.num_sms())
    # With two KV groups a program serves two splits: twice the splits keep the grid as full.
    splits *= config.kv_groups
    config = dataclasses.replace(config, num_splits=splits)
  return config


# The triton backend: several programs share an SM (Triton pipelines each program's loads).
TRITON_PROGRAMS_PER_SM = 2
TRITON_DEFAULT_BLOCK_KV = 64
TRITON_DEFAULT_STAGES = 3
# DecodeConfig fields the triton backend does not implement, with the value it needs.
TRITON_UNSUPPORTED_FIELDS = {"kv_groups": 1, "pipeline_qk": False, "persistent": False}


def triton_block_kv_for_page(page_size: int, block_kv: int = TRITON_DEFAULT_BLOCK_KV) -> int | None:
  """The largest tile <= block_kv that a page of page_size tokens can serve, or None.

  A tile must lie within one page (block_kv divides page_size) or cover whole pages (page_size
  divides block_kv); block_kv is a power of two >= 16.
  """
  from pallas_kv.kernels.triton import decode as triton_decode
  if page_size < 1:
    return None
  if page_size & (page_size - 1) == 0:   # a power of two: any tile size works
    return block_kv
  largest_pow2_divisor = page_size & -page_size
  if largest_pow2_divisor < triton_decode.MIN_BLOCK_KV:
    return None
  return min(block_kv, largest_pow2_divisor)


def triton_config(problem, config: DecodeConfig | None, *, dtype="bfloat16", num_sms: int | None = None,
                  device_kind: str | None = None) -> DecodeConfig:
  """Explicit config, else tuned, else the heuristic one, with the split count filled in (triton backend)."""
  from pallas_kv.kernels.triton import decode as triton_decode
  rows = problem.num_queries * problem.group_size
  block_rows, row_blocks = triton_decode.row_blocking(rows, problem.head_dim)
  if config is None:
    config = tuned_config("triton", problem, dtype, device_kind)
  if config is None:
    block_kv = TRITON_DEFAULT_BLOCK_KV
    if problem.page_size is not None:
      block_kv = triton_block_kv_for_page(problem.page_size, block_kv) or block_kv
    config = DecodeConfig(block_kv=block_kv, num_stages=TRITON_DEFAULT_STAGES,
                          num_warps=8 if block_rows * problem.head_dim >= 128 * 128 else 4)
    # Fewer stages, then smaller tiles, until the tiles in flight fit in shared memory.
    fits = lambda c: triton_decode.fits_smem(head_dim=problem.head_dim, itemsize=2, block_kv=c.block_kv,
                                             num_stages=c.num_stages, block_rows=block_rows)
    while not fits(config):
      if config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
      elif config.block_kv > triton_decode.MIN_BLOCK_KV:
        config = dataclasses.replace(config, block_kv=config.block_kv // 2)
      else:
        break
  else:
    for name, default in TRITON_UNSUPPORTED_FIELDS.items():
      value = getattr(config, name, default)
      if value != default:
        raise ValueError(f"config.{name}={value!r} is a mosaic_gpu option; the triton backend needs {default!r}")
    if problem.page_size is not None:
      triton_decode.check_page_size(problem.page_size, config.block_kv)
  if config.num_splits is None:
    splits = choose_num_splits(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                               capacity=problem.capacity, block_kv=config.block_kv,
                               num_sms=num_sms or runtime.num_sms(), programs_per_sm=TRITON_PROGRAMS_PER_SM)
    config = dataclasses.replace(config, num_splits=splits)
  return config
