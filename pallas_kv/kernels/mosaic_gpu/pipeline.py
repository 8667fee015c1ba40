"""The multi-stage KV load pipeline on Mosaic GPU: an SMEM ring fed by TMA.

A `Ring` is `num_stages` SMEM slots of one tile each, plus two barrier arrays:

  produced[slot]  completes when every TMA copy into the slot has landed
                  (arrivals: `copies_per_slot`, one arrive-expect-tx per copy)
  consumed[slot]  completes when every consumer warpgroup has released the slot
                  (arrivals: `num_consumers`)

Steps are numbered 0, 1, 2, ... on both sides and step i uses slot i % num_stages, so a
producer warpgroup may run up to `num_stages` tiles ahead of the consumers:

  producer                         consumer
  --------                         --------
  ring.acquire(i)  # slot free?    tile = ring.wait(i)    # data landed?
  ring.commit(i, sources)  # TMA   ... wgmma on tile ...
  ...                              ring.release(i)        # slot may be refilled
  ring.drain(n)    # after step n-1

A warpgroup may fill a ring with its own stores instead of TMA (`commit_stores` in place of
`commit`): the converter of one-byte tiles does, between the TMA rings and the consumers.

A ring may split its slots into column parts (`RingSpec.column_parts`), each with its own SMEM
array (TMA fills only contiguous SMEM, and a column slice of a tiled slot is not) and its own pair
of barriers: a consumer can start on the first part while the rest lands, and a part is refilled
as soon as its own readers release it. Every call then names its `part`.

Mosaic GPU tracks barrier phases per thread, so each side must visit every step in order
(a thread that skips a step would wait on the wrong phase next time round).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Mosaic GPU aligns every SMEM allocation to this many bytes.
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8


def align_up(x: int, alignment: int = SMEM_ALIGNMENT) -> int:
  return -(-x // alignment) * alignment


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static shape of a ring: what one slot holds and who fills / drains it."""
  num_stages: int
  block_shape: tuple[int, ...]
  dtype: Any
  transforms: tuple[Any, ...] = ()
  copies_per_slot: int = 1
  num_consumers: int = 1          # releases per slot (per part with column_parts)
  column_parts: tuple[int, ...] = ()   # widths of the slot's column parts (sum: its columns); (): one

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

  def buffer_type(self):
    """SMEM scratch for the slots: [num_stages, *block_shape], or with column parts one array
    [num_stages, rows, width] per part."""
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
    """What every call takes as `part`, in order: (None,) without column parts."""
    return tuple(range(len(self.column_parts))) if self.column_parts else (None,)

  def part_columns(self, part: int) -> tuple[int, int]:
    """(first column of the slot, width) of a column part."""
    return sum(self.column_parts[:part]), self.column_parts[part]

  def barrier_types(self):
    """(produced, consumed) barrier arrays, one barrier per slot (and part: slot * parts + part)."""
    count = self.num_stages * self.num_parts
    return (plgpu.Barrier(num_arrivals=self.copies_per_slot, num_barriers=count),
            plgpu.Barrier(num_arrivals=self.num_consumers, num_barriers=count))

  @property
  def buffer_bytes(self) -> int:
    return self.num_stages * math.prod(self.block_shape) * jnp.dtype(self.dtype).itemsize

  @property
  def barrier_bytes(self) -> int:
    return 2 * self.num_stages * self.num_parts * BARRIER_BYTES


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ring bound to its refs inside a kernel.

  slots:    [num_stages, *block_shape] SMEM (with column parts: a tuple of one array per part)
  produced: [num_stages] barriers, `copies_per_slot` arrivals
  consumed: [num_stages] barriers, `num_consumers` arrivals
  poison_released: a check for GPU interpret mode: a slot (part) with one consumer is filled with
    NaN when released, so a consumer that frees what another still reads makes that reader's
    output NaN, whatever order the interpreter runs them in (a race it may not report).
  """
  spec: RingSpec
  slots: Any
  produced: Any
  consumed: Any
  poison_released: bool = False

  def _slot(self, step):
    return lax.rem(step, jnp.int32(self.spec.num_stages))

  def _barrier(self, barriers, step, part):
    """The barrier of (step's slot, part): part must be given exactly when the ring has parts."""
    if (part is None) != (not self.spec.column_parts):
      raise ValueError(f"{part=}: name a part exactly when the ring has column parts {self.spec.column_parts}")
    return barriers.at[self._slot(step) * self.spec.num_parts + (part or 0)]

  # Producer side.
  def acquire(self, step, part=None):
    """Waits until the slot (part) of `step` has been released by the step num_stages earlier."""
    @pl.when(step >= self.spec.num_stages)
    def _():
      plgpu.barrier_wait(self._barrier(self.consumed, step, part))

  def commit(self, step, sources: Sequence[Any], part=None):
    """Starts the TMA copies of `sources` (GMEM views stacked along rows; with parts, the part's
    columns of each) into the slot of `step`.

    The slot's (part's) produced barrier completes when all their bytes have landed.
    """
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
      plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(row, rows)], barrier)
      row += rows
    if row != self.spec.block_shape[0]:
      raise ValueError(f"sources cover {row} rows, the slot has {self.spec.block_shape[0]}")

  def commit_stores(self, step, part=None):
    """Marks the slot (part) of `step` filled by this warpgroup's own SMEM stores (a ring whose
    producer is a warpgroup, not TMA: copies_per_slot 1): fences the stores for the async proxy,
    which wgmma reads through, and arrives once on the produced barrier."""
    if self.spec.copies_per_slot != 1:
      raise ValueError(f"a ring filled by stores takes one arrival per slot, not {self.spec.copies_per_slot}")
    plgpu.commit_smem()
    plgpu.barrier_arrive(self._barrier(self.produced, step, part))

  def drain(self, num_steps):
    """Waits for the releases of the last num_stages of `num_steps` steps (every part).

    Leaves every consumed barrier with all its phases observed by the producer, so the ring
    could be reused (and GPU interpret mode, which checks this, accepts the kernel).
    """
    @pl.loop(jnp.maximum(num_steps - self.spec.num_stages, 0), num_steps)
    def _(step):
      for part in self.spec.part_ids:
        plgpu.barrier_wait(self._barrier(self.consumed, step, part))

  # Consumer side.
  def wait(self, step, part=None):
    """Waits for the data of `step` (its part) and returns its slot (part), [*block_shape] SMEM
    (a part: [rows, width])."""
    plgpu.barrier_wait(self._barrier(self.produced, step, part))
    return self.slot(step, part)

  def slot(self, step, part=None):
    """The slot (part) of `step` without waiting (the caller has waited)."""
    slots = self.slots if part is None else self.slots[part]
    return slots.at[self._slot(step)]

  def release(self, step, *, part=None, read_by_registers: bool = False):
    """Marks the slot (part) of `step` free (one arrival per consumer warpgroup).

    TMA refills the slot through the async proxy. A consumer that read it only with wgmma (also
    the async proxy) needs nothing more; one that loaded it into registers (ordinary loads)
    passes read_by_registers=True, which fences those reads before the slot can be refilled.
    """
    poison = self.poison_released and self.spec.num_consumers == 1
    if poison:
      slot = self.slot(step, part)
      slot[...] = jnp.full(slot.shape, jnp.nan, slot.dtype)
    if read_by_registers or poison:   # before the async proxy writes it again
      plgpu.commit_smem()
    plgpu.barrier_arrive(self._barrier(self.consumed, step, part))
