"""Split count and tile choice from the shape and the device."""

from __future__ import annotations

import dataclasses

from pallas_kv import runtime
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


def mosaic_gpu_config(problem, config: DecodeConfig | None, *, num_sms: int | None = None) -> DecodeConfig:
  """Explicit config, else the heuristic one, with the split count filled in."""
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  if config is None:
    config = DecodeConfig()
    rows = problem.num_queries * problem.group_size
    # Fewer stages when the packed rows need two consumer warpgroups or D is large.
    while config.num_stages > 2 and not mgpu_decode.fits_smem(
        rows=rows, head_dim=problem.head_dim, dtype="bfloat16", block_kv=config.block_kv,
        num_stages=config.num_stages, page_size=problem.page_size):
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  if config.num_splits is None:
    _, row_blocks = mgpu_decode.row_blocking(problem.num_queries * problem.group_size)
    splits = choose_num_splits(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                               capacity=problem.capacity, block_kv=config.block_kv,
                               num_sms=num_sms or runtime.num_sms())
    config = dataclasses.replace(config, num_splits=splits)
  return config
