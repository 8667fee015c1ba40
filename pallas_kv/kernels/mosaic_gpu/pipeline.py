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
  num_consumers: int = 1

  def __post_init__(self):
    if self.num_stages < 1:
      raise ValueError(f"{self.num_stages=} must be >= 1")
    if self.copies_per_slot < 1:
      raise ValueError(f"{self.copies_per_slot=} must be >= 1")
    if self.num_consumers < 1:
      raise ValueError(f"{self.num_consumers=} must be >= 1")

  def buffer_type(self):
    """SMEM scratch for the slots: [num_stages, *block_shape]."""
    return plgpu.SMEM((self.num_stages, *self.block_shape), jnp.dtype(self.dtype),
                      transforms=self.transforms)

  def barrier_types(self):
    """(produced, consumed) barrier arrays, one barrier per slot."""
    return (plgpu.Barrier(num_arrivals=self.copies_per_slot, num_barriers=self.num_stages),
            plgpu.Barrier(num_arrivals=self.num_consumers, num_barriers=self.num_stages))

  @property
  def buffer_bytes(self) -> int:
    return self.num_stages * math.prod(self.block_shape) * jnp.dtype(self.dtype).itemsize

  @property
  def barrier_bytes(self) -> int:
    return 2 * self.num_stages * BARRIER_BYTES


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ring bound to its refs inside a kernel.

  slots:    [num_stages, *block_shape] SMEM
  produced: [num_stages] barriers, `copies_per_slot` arrivals
  consumed: [num_stages] barriers, `num_consumers` arrivals
  """
  spec: RingSpec
  slots: Any
  produced: Any
  consumed: Any

  def _slot(self, step):
    return lax.rem(step, jnp.int32(self.spec.num_stages))

  # Producer side.
  def acquire(self, step):
    """Waits until the slot of `step` has been released by the step num_stages earlier."""
    slot = self._slot(step)

    @pl.when(step >= self.spec.num_stages)
    def _():
      plgpu.barrier_wait(self.consumed.at[slot])

  def commit(self, step, sources: Sequence[Any]):
    """Starts the TMA copies of `sources` (GMEM views stacked along rows) into the slot of `step`.

    The slot's produced barrier completes when all their bytes have landed.
    """
    if len(sources) != self.spec.copies_per_slot:
      raise ValueError(f"{len(sources)=} copies, but the ring expects {self.spec.copies_per_slot}")
    slot = self._slot(step)
    dst = self.slots.at[slot]
    barrier = self.produced.at[slot]
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

  def commit_stores(self, step):
    """Marks the slot of `step` filled by this warpgroup's own SMEM stores (a ring whose producer
    is a warpgroup, not TMA: copies_per_slot 1): fences the stores for the async proxy, which
    wgmma reads through, and arrives once on the slot's produced barrier."""
    if self.spec.copies_per_slot != 1:
      raise ValueError(f"a ring filled by stores takes one arrival per slot, not {self.spec.copies_per_slot}")
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.produced.at[self._slot(step)])

  def drain(self, num_steps):
    """Waits for the releases of the last num_stages of `num_steps` steps.

    Leaves every consumed barrier with all its phases observed by the producer, so the ring
    could be reused (and GPU interpret mode, which checks this, accepts the kernel).
    """
    @pl.loop(jnp.maximum(num_steps - self.spec.num_stages, 0), num_steps)
    def _(step):
      plgpu.barrier_wait(self.consumed.at[self._slot(step)])

  # Consumer side.
  def wait(self, step):
    """Waits for the data of `step` and returns its slot, [*block_shape] SMEM."""
    slot = self._slot(step)
    plgpu.barrier_wait(self.produced.at[slot])
    return self.slots.at[slot]

  def slot(self, step):
    """The slot of `step`, [*block_shape] SMEM, without waiting (the caller has waited)."""
    return self.slots.at[self._slot(step)]

  def release(self, step, *, read_by_registers: bool = False):
    """Marks the slot of `step` free (one arrival per consumer warpgroup).

    TMA refills the slot through the async proxy. A consumer that read it only with wgmma (also
    the async proxy) needs nothing more; one that loaded it into registers (ordinary loads)
    passes read_by_registers=True, which fences those reads before the slot can be refilled.
    """
    if read_by_registers:
      plgpu.commit_smem()
    plgpu.barrier_arrive(self.consumed.at[self._slot(step)])
