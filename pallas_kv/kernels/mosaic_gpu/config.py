"""What the Mosaic GPU decode kernel supports, its SMEM layout and fit, and its config choice.

Order of choice: an explicit `DecodeConfig`, else a tuned one for this device kind
(`pallas_kv.tuned`), else the heuristic here; a split count left as None is filled in from the
batch and the SM count. `DecodeConfig` checks its own fields; `check_config` checks only what
this kernel adds (tile sizes wgmma and TMA can take, page sizes, the variants' needs, the SMEM
fit), and `decode_partials` runs it once per call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

NAME = "mosaic_gpu"
HEAD_DIMS = (64, 128, 256)
# P @ V contracts over the tile's tokens: Mosaic's wgmma K is a multiple of 64; TMA boxes are at
# most 256 rows.
MIN_BLOCK_KV = 64
MAX_BLOCK_KV = 256
# A swizzled tile must start on an 8-row boundary: pages hold a power of two >= 8 tokens.
MIN_PAGE_SIZE = 8
ROWS_PER_WG = 64            # wgmma M: packed query rows per consumer warpgroup
MAX_COMPUTE_WGS = 2         # 2 consumers + 1 producer = 384 threads
SMEM_CAPACITY_BYTES = 227 * 1024   # per thread block, Hopper (H100 / H200)
# Scratch Mosaic GPU reserves for cross-warp reductions (CompilerParams default).
_REDUCTION_SCRATCH_BYTES = plgpu.CompilerParams().reduction_scratch_bytes


def row_blocking(rows: int) -> tuple[int, int]:
  """(consumer warpgroups per program, row blocks in the grid) for `rows` packed rows.

  Rows beyond 2 x 64 are split over more programs (each re-reads the KV of its head).
  """
  num_wgs = min(split_k.cdiv(rows, ROWS_PER_WG), MAX_COMPUTE_WGS)
  return num_wgs, split_k.cdiv(rows, num_wgs * ROWS_PER_WG)


def copies_per_tile(block_kv: int, page_size: int | None) -> int:
  """TMA copies that fill one KV tile: one per page when a tile spans several pages."""
  return block_kv // page_size if page_size is not None and page_size < block_kv else 1


def page_size_reason(page_size: int) -> str | None:
  """Why pages of `page_size` tokens cannot be tiled here, or None."""
  if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
    return f"page_size {page_size} is not supported (a power of two >= {MIN_PAGE_SIZE})"
  return None


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why this backend cannot serve the call, or None if it can."""
  reason = split_k.unsupported_reason(op, problem, options, dtypes, backend="Mosaic GPU", head_dims=HEAD_DIMS)
  if reason is None and problem.page_size is not None:
    reason = page_size_reason(problem.page_size)
  return reason


# ---------------------------------------------------------------- SMEM layout and fit

@dataclasses.dataclass(frozen=True)
class DecodeSmem:
  """The SMEM layout of one decode program; the single source for scratch and for fit checks.

  q      [row_wgs, 64, D] dtype              packed queries, swizzled (wgmma A operand)
  union  ( per KV group g: K ring g [stages / kv_groups, bkv, D], V ring g [same] )  streaming
         | ( out [num_wgs, 64, D] f32, lse [num_wgs, 64] f32 )                  after the loop
         (separate_out: rings and out/lse side by side, for a persistent program whose rings
         keep streaming the next work item while one item's partial is stored)
  barriers: produced + consumed per ring slot, q per row warpgroup, one among consumers.
  `num_stages` counts the KV tile slots of each role (K or V) over all groups.
  """
  head_dim: int
  dtype: Any
  block_kv: int
  num_stages: int
  row_wgs: int = 1          # consumer warpgroups that split the packed rows (64 each)
  kv_groups: int = 1        # consumer warpgroups that split the KV tiles (own rings each)
  copies_per_tile: int = 1
  stage_p: bool = False     # P staged in SMEM for P @ V (interpret mode only)
  separate_out: bool = False   # out/lse staging beside the rings, not aliasing them (persistent)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.num_stages % self.kv_groups:
      raise ValueError(f"{self.num_stages=} must be a multiple of {self.kv_groups=}")

  @classmethod
  def for_call(cls, config: DecodeConfig, *, rows: int, head_dim: int, dtype: Any, page_size: int | None,
               stage_p: bool = False) -> "DecodeSmem":
    """The layout a config needs for `rows` packed rows (before padding)."""
    row_wgs, _ = row_blocking(rows)
    return cls(head_dim=head_dim, dtype=dtype, block_kv=config.block_kv, num_stages=config.num_stages,
               row_wgs=row_wgs, kv_groups=config.kv_groups,
               copies_per_tile=copies_per_tile(config.block_kv, page_size), stage_p=stage_p,
               separate_out=config.persistent)

  @property
  def num_wgs(self) -> int:
    return self.row_wgs * self.kv_groups

  def ring_spec(self) -> pipeline.RingSpec:
    return pipeline.RingSpec(
        num_stages=self.num_stages // self.kv_groups, block_shape=(self.block_kv, self.head_dim),
        dtype=self.dtype, transforms=tiling.smem_transforms(self.dtype, self.head_dim),
        copies_per_slot=self.copies_per_tile, num_consumers=self.row_wgs)

  def scratch_types(self) -> dict[str, Any]:
    ring = self.ring_spec()
    rings, barriers = [], {}
    for g in range(self.kv_groups):
      rings += [ring.buffer_type(), ring.buffer_type()]
      for role in ("k", "v"):
        barriers[f"{role}{g}_produced"], barriers[f"{role}{g}_consumed"] = ring.barrier_types()
    out_stage = (plgpu.SMEM((self.num_wgs, ROWS_PER_WG, self.head_dim), jnp.float32),
                 plgpu.SMEM((self.num_wgs, ROWS_PER_WG), jnp.float32))
    if self.separate_out:
      buffers = dict(rings=tuple(rings), out_stage=out_stage)
    else:
      # Output staging reuses the rings' memory once every tile is consumed.
      buffers = dict(union=plgpu.RefUnion(tuple(rings), out_stage))
    scratch = dict(
        q_smem=plgpu.SMEM((self.row_wgs, ROWS_PER_WG, self.head_dim), self.dtype,
                          transforms=tiling.smem_transforms(self.dtype, self.head_dim)),
        **buffers,
        q_barrier=plgpu.Barrier(num_barriers=self.row_wgs),
        consumers_done=plgpu.Barrier(num_arrivals=self.num_wgs),
        **barriers)
    if self.stage_p:
      scratch["p_smem"] = plgpu.SMEM(self._p_shape, self.dtype)
    return scratch

  @property
  def _p_shape(self) -> tuple[int, int, int]:
    return (self.num_wgs, ROWS_PER_WG, self.block_kv)

  @property
  def nbytes(self) -> int:
    """SMEM bytes the kernel asks for (allocations aligned as Mosaic GPU aligns them)."""
    ring = self.ring_spec()
    align = pipeline.align_up
    rings = 2 * self.kv_groups * align(ring.buffer_bytes)
    outputs = align(self.num_wgs * ROWS_PER_WG * self.head_dim * 4) + self.num_wgs * ROWS_PER_WG * 4
    q = self.row_wgs * ROWS_PER_WG * self.head_dim * self.dtype.itemsize
    barriers = (2 * self.kv_groups * ring.barrier_bytes
                + (self.row_wgs + 1) * pipeline.BARRIER_BYTES)
    p = math.prod(self._p_shape) * self.dtype.itemsize if self.stage_p else 0
    streaming = rings + align(outputs) if self.separate_out else max(rings, outputs)
    return (align(q) + align(streaming) + align(p)
            + align(_REDUCTION_SCRATCH_BYTES) + barriers)

  @property
  def fits(self) -> bool:
    return self.nbytes <= SMEM_CAPACITY_BYTES


def smem_bytes(config: DecodeConfig, *, rows: int, head_dim: int, dtype: Any = "bfloat16",
               page_size: int | None = None) -> int:
  """SMEM bytes one decode program needs on the GPU (rows = num_queries * group size)."""
  return DecodeSmem.for_call(config, rows=rows, head_dim=head_dim, dtype=dtype, page_size=page_size).nbytes


def fits_smem(config: DecodeConfig, **kwargs) -> bool:
  """Whether a config fits in Hopper's 227 KiB of SMEM per block (same args as smem_bytes)."""
  return smem_bytes(config, **kwargs) <= SMEM_CAPACITY_BYTES


# ---------------------------------------------------------------- checks and choice

def check_config(config: DecodeConfig, *, rows: int, head_dim: int, dtype: Any, page_size: int | None) -> None:
  """What this kernel needs of a resolved config (num_splits set) beyond DecodeConfig's own rules.

  kv_groups=2 gives each of two consumer warpgroups one split's tiles and its own ring pair; it
  needs the packed rows to fit one warpgroup (rows <= 64), an even split count (a program serves
  two splits) and an even num_stages (the slots are shared out equally). pipeline_qk holds tile
  i's K slot until tile i+1's Q K^T is done, so it needs two stages.
  """
  bkv = config.block_kv
  if config.num_splits is None:
    raise ValueError("config.num_splits must be resolved (resolve_config) before the kernel runs")
  if bkv % MIN_BLOCK_KV or not MIN_BLOCK_KV <= bkv <= MAX_BLOCK_KV:
    raise ValueError(f"config.block_kv={bkv} must be a multiple of {MIN_BLOCK_KV} in "
                     f"[{MIN_BLOCK_KV}, {MAX_BLOCK_KV}] on mosaic_gpu (wgmma K and TMA box)")
  if page_size is not None:
    reason = page_size_reason(page_size)
    if reason:
      raise NotImplementedError(f"mosaic_gpu: {reason}")
    if page_size < bkv and bkv % page_size or page_size > bkv and page_size % bkv:
      raise ValueError(f"page_size={page_size} and config.block_kv={bkv}: one must divide the other")
  if config.kv_groups == 2:
    if rows > ROWS_PER_WG:
      raise NotImplementedError(f"kv_groups=2 needs <= {ROWS_PER_WG} packed rows, got {rows}")
    if config.num_splits % 2:
      raise ValueError(f"kv_groups=2 needs an even num_splits, got {config.num_splits=}")
    if config.num_stages % 2:
      raise ValueError(f"kv_groups=2 needs an even num_stages, got {config.num_stages=}")
  if config.pipeline_qk and config.num_stages < 2:
    raise ValueError(f"pipeline_qk=True needs num_stages >= 2, got {config.num_stages=}")
  smem = DecodeSmem.for_call(config, rows=rows, head_dim=head_dim, dtype=dtype, page_size=page_size)
  if not smem.fits:
    raise ValueError(
        f"block_kv={bkv} x num_stages={config.num_stages} needs {smem.nbytes} bytes of SMEM for head_dim "
        f"{head_dim} and {rows} packed rows{' (persistent)' if config.persistent else ''}, over the "
        f"{SMEM_CAPACITY_BYTES} available; use fewer stages")


def heuristic_config(problem, *, dtype: Any = "bfloat16") -> DecodeConfig:
  """The default tile and ring depth: fewer stages when two consumer warpgroups or a large D
  need the SMEM (split count left to `resolve_config`)."""
  config = DecodeConfig()
  rows = problem.num_queries * problem.group_size
  while config.num_stages > 2 and not fits_smem(config, rows=rows, head_dim=problem.head_dim, dtype=dtype,
                                                page_size=problem.page_size):
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  return config


def resolve_config(problem, config: DecodeConfig | None, *, dtype: Any = "bfloat16", num_sms: int | None = None,
                   device_kind: str | None = None) -> DecodeConfig:
  """Explicit config, else tuned, else the heuristic one, with the split count filled in."""
  _, row_blocks = row_blocking(problem.num_queries * problem.group_size)
  return split_k.resolve_config(problem, config, backend=NAME, heuristic=heuristic_config, row_blocks=row_blocks,
                                dtype=dtype, num_sms=num_sms, device_kind=device_kind)
