"""The KV load pipeline on Mosaic GPU: a `Ring` of num_stages SMEM slots filled by TMA, two barriers per slot.

  produced[slot]  completes when every copy into the slot has landed (one arrival per copy)
  consumed[slot]  completes when every consumer has released the slot (`num_consumers` arrivals)

Step i uses slot i % num_stages, so the producer runs up to num_stages tiles ahead:
  producer  ring.acquire(i); ring.commit(i, sources); ... ring.drain(n) after the last step
  consumer  tile = ring.wait(i); ... wgmma on tile ...; ring.release(i)
A warpgroup may fill a ring with its own stores instead (`commit_stores`). Column parts (`RingSpec.column_parts`)
each have their own SMEM array (TMA fills only contiguous SMEM) and barriers, so a part is read as it lands and
refilled once its readers release it. A copy of fewer rows than a swizzle tile holds (pages of 1, 2 or 4 tokens)
lands one column tile at a time through `Ring.tiles`, the slots seen as their swizzle tiles: TMA swizzles by
SMEM address, so a row written alone lands where the whole tile's copy would put it. Barrier phases are tracked
per thread: each side visits every step in order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels.mosaic_gpu.trace import region

# Mosaic GPU aligns every SMEM allocation to this many bytes.
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8
TMA_SMEM_ALIGNMENT = 128   # a copy into a swizzled tile starts on a 128-byte boundary (misaligned address if not)


def align_up(x: int, alignment: int = SMEM_ALIGNMENT) -> int:
  return -(-x // alignment) * alignment


@dataclasses.dataclass(frozen=True)
class RingSpec:
  num_stages: int
  block_shape: tuple[int, ...]
  dtype: Any
  transforms: tuple[Any, ...] = ()
  copies_per_slot: int = 1
  num_consumers: int = 1
  column_parts: tuple[int, ...] = ()   # widths of the slot's column parts; (): one

  def __post_init__(self):
    if self.column_parts and (sum(self.column_parts) != self.block_shape[-1] or min(self.column_parts) < 1):
      raise ValueError(f"{self.column_parts=} must be positive widths adding up to the slot's "
                       f"{self.block_shape[-1]} columns")
    if self.num_stages < 1:
      raise ValueError(f"{self.num_stages=} must be >= 1")
    if self.copies_per_slot < 1:
      raise ValueError(f"{self.copies_per_slot=} must be >= 1")
    if self.num_consumers < 1:
      raise ValueError(f"{self.num_consumers=} must be >= 1")
    if self.splits_rows and self.column_parts:
      raise ValueError(f"copies of {self.rows_per_copy} rows need a slot of one part, got {self.block_shape=} "
                       f"{self.column_parts=}")
    if self.splits_rows and self.rows_per_copy * self.tile[1] * jnp.dtype(self.dtype).itemsize % TMA_SMEM_ALIGNMENT:
      raise ValueError(f"copies of {self.rows_per_copy} rows of {self.tile[1]} {jnp.dtype(self.dtype).name} would "
                       f"start off TMA's {TMA_SMEM_ALIGNMENT}-byte SMEM alignment")

  def buffer_type(self):
    if self.column_parts:
      return tuple(plgpu.SMEM((self.num_stages, *self.block_shape[:-1], width), jnp.dtype(self.dtype),
                              transforms=self.transforms) for width in self.column_parts)
    return plgpu.SMEM((self.num_stages, *self.block_shape), jnp.dtype(self.dtype),
                      transforms=self.transforms)

  @property
  def num_parts(self) -> int:
    return len(self.column_parts) or 1

  @property
  def part_ids(self) -> tuple[int | None, ...]:
    return tuple(range(len(self.column_parts))) if self.column_parts else (None,)

  def part_columns(self, part: int) -> tuple[int, int]:
    return sum(self.column_parts[:part]), self.column_parts[part]

  @property
  def tile(self) -> tuple[int, int] | None:
    """(rows, columns) of the slot's swizzle tiles, or None when untiled."""
    tilings = [t.tiling for t in self.transforms if isinstance(t, plgpu.TilingTransform)]
    return tuple(tilings[0]) if tilings else None

  @property
  def rows_per_copy(self) -> int:
    return self.block_shape[0] // self.copies_per_slot

  @property
  def splits_rows(self) -> bool:
    """Whether a copy fills part of a swizzle tile's rows, and so lands one column tile at a time. A slot of
    three axes [copies, rows, columns] takes a copy a leading index, whole tiles each."""
    return self.tile is not None and len(self.block_shape) == 2 and self.rows_per_copy % self.tile[0] != 0

  @property
  def copies_per_source(self) -> int:
    return self.block_shape[-1] // self.tile[1] if self.splits_rows else 1

  def tiles_type(self):
    """The slots as their swizzle tiles [stages, rows / tr, cols / tc, tr, tc], for `Ring.tiles`."""
    (tr, tc), (rows, cols) = self.tile, self.block_shape
    swizzle = [t for t in self.transforms if isinstance(t, plgpu.SwizzleTransform)]
    return plgpu.SMEM((self.num_stages, rows // tr, cols // tc, tr, tc), jnp.dtype(self.dtype), transforms=swizzle)

  def barrier_types(self):
    count = self.num_stages * self.num_parts
    return (plgpu.Barrier(num_arrivals=self.copies_per_slot * self.copies_per_source, num_barriers=count),
            plgpu.Barrier(num_arrivals=self.num_consumers, num_barriers=count))

  @property
  def buffer_bytes(self) -> int:
    return self.num_stages * math.prod(self.block_shape) * jnp.dtype(self.dtype).itemsize

  @property
  def barrier_bytes(self) -> int:
    return 2 * self.num_stages * self.num_parts * BARRIER_BYTES


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ring bound to its refs inside a kernel. poison_released (interpret mode): a one-consumer slot is
  NaN-filled on release, so a slot freed while another warpgroup reads it shows as NaN in the output.
  tiles: the slots' bytes as `spec.tiles_type()` (a `RefUnion` alias) where copies split rows; None in
  interpret mode, whose union members do not share memory: there such copies go through the slots."""
  spec: RingSpec
  slots: Any
  produced: Any
  consumed: Any
  poison_released: bool = False
  tiles: Any = None

  def _slot(self, step):
    return lax.rem(step, jnp.int32(self.spec.num_stages))

  def _barrier(self, barriers, step, part):
    if (part is None) != (not self.spec.column_parts):
      raise ValueError(f"{part=}: name a part exactly when the ring has column parts {self.spec.column_parts}")
    return barriers.at[self._slot(step) * self.spec.num_parts + (part or 0)]

  def acquire(self, step, part=None):
    with region("wait_free"):
      @pl.when(step >= self.spec.num_stages)
      def _():
        plgpu.barrier_wait(self._barrier(self.consumed, step, part))

  def commit(self, step, sources: Sequence[Any], part=None):
    """Starts the TMA copies of `sources` (GMEM views stacked along rows) into step's slot (part)."""
    if len(sources) != self.spec.copies_per_slot:
      raise ValueError(f"{len(sources)=} copies, but the ring expects {self.spec.copies_per_slot}")
    dst = self.slot(step, part)
    barrier = self._barrier(self.produced, step, part)
    if part is not None:
      columns = pl.ds(*self.spec.part_columns(part))
      sources = [src.at[:, columns] for src in sources]
    if len(sources) == 1:
      plgpu.copy_gmem_to_smem(sources[0], dst, barrier)
      return
    row = 0
    for src in sources:
      rows = src.shape[0]
      if self.spec.splits_rows:
        for src_part, dst_part in self._tile_columns(step, src, dst, row):
          plgpu.copy_gmem_to_smem(src_part, dst_part, barrier)
      else:
        plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(row, rows)], barrier)
      row += rows
    if row != self.spec.block_shape[0]:
      raise ValueError(f"sources cover {row} rows, the slot has {self.spec.block_shape[0]}")

  def _tile_columns(self, step, src, dst, row):
    """(source, destination) per column tile of src's rows, which start at `row` inside one swizzle tile."""
    (tr, tc), rows = self.spec.tile, src.shape[0]
    for c in range(self.spec.copies_per_source):
      columns = pl.ds(c * tc, tc)
      if self.tiles is None:
        yield src.at[:, columns], dst.at[pl.ds(row, rows), columns]
      else:
        yield src.at[:, columns], self.tiles.at[self._slot(step), row // tr, c, pl.ds(row % tr, rows)]

  def commit_stores(self, step, part=None):
    """Marks step's slot (part) filled by this warpgroup's stores, fenced for wgmma's async proxy."""
    if self.spec.copies_per_slot != 1:
      raise ValueError(f"a ring filled by stores takes one arrival per slot, not {self.spec.copies_per_slot}")
    plgpu.commit_smem()
    plgpu.barrier_arrive(self._barrier(self.produced, step, part))

  def drain(self, num_steps):
    """Waits for the last num_stages releases of `num_steps` steps, so the producer observes every
    phase of every consumed barrier (which GPU interpret mode checks)."""
    @pl.loop(jnp.maximum(num_steps - self.spec.num_stages, 0), num_steps)
    def _(step):
      for part in self.spec.part_ids:
        plgpu.barrier_wait(self._barrier(self.consumed, step, part))

  def wait(self, step, part=None):
    with region("wait_tile"):
      plgpu.barrier_wait(self._barrier(self.produced, step, part))
    return self.slot(step, part)

  def slot(self, step, part=None):
    slots = self.slots if part is None else self.slots[part]
    return slots.at[self._slot(step)]

  def release(self, step, *, part=None, read_by_registers: bool = False):
    """Frees step's slot (part). TMA refills it through the async proxy, as wgmma reads it; a consumer
    that loaded it into registers passes read_by_registers=True to fence those reads first, or releases it
    plainly after a later `plgpu.commit_smem` of its own (a fence and a warpgroup barrier) that every read of
    the slot came before (`release_after_commit`)."""
    poison = self.poison_released and self.spec.num_consumers == 1
    if poison:
      slot = self.slot(step, part)
      slot[...] = jnp.full(slot.shape, jnp.nan, slot.dtype)
    if read_by_registers or poison:
      plgpu.commit_smem()
    plgpu.barrier_arrive(self._barrier(self.consumed, step, part))


def release_after_commit(rings: Sequence[Ring | None], step) -> None:
  """Frees step's slots of rings read into registers, without a fence or a warpgroup barrier of their own: call
  it after a `plgpu.commit_smem` that follows every read of them (each warp's loads done, as their values were
  used before it), so that TMA's refill cannot overtake a read. Saves that commit per slot and tile."""
  for ring in rings:
    if ring is not None:
      ring.release(step)
