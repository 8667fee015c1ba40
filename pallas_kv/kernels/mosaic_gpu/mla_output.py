"""An MLA program's output stores: each consumer's half and the lse, staged in SMEM, copied by TMA."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import online_softmax
from pallas_kv.kernels.mosaic_gpu.mla_config import ROWS


@dataclasses.dataclass(frozen=True)
class ProgramOutput:
  """One program's output destinations and SMEM staging (`MlaSmem`); out_ref [B, splits, out_rows, Dv]
  (rows as N: [B, splits, Dv, N]), lse_ref [B, splits, lse_rows] f32."""
  out_smem: Any
  lse_smem: Any
  out_ref: Any
  lse_ref: Any
  consumers_done: Any
  b: Any
  split: Any
  row0: Any
  half_v: int
  out_rows: int
  lse_rows: int           # a multiple of 4: TMA stores need 16-byte rows
  one_row_block: bool     # static counts: only the real rows are stored
  rows_as_n: int = 0

  def meet(self):
    """Waits for both consumers: the staging aliases the ring, which both read until their last tile."""
    plgpu.barrier_arrive(self.consumers_done)
    plgpu.barrier_wait(self.consumers_done)

  def lse_copy(self):
    if self.rows_as_n or self.one_row_block:
      return self.lse_smem.at[pl.ds(0, self.lse_rows)], self.lse_ref.at[self.b, self.split, pl.ds(0, self.lse_rows)]
    return self.lse_smem, self.lse_ref.at[self.b, self.split, pl.ds(self.row0, ROWS)]

  def store(self, half: int, out, lse=None):
    """Stores consumer `half`'s part of the output (and the lse when given); after `meet`."""
    self.out_smem[half] = out.astype(self.out_smem.dtype)
    if lse is not None:
      self.lse_smem[...] = lse
    plgpu.commit_smem()
    rows = pl.ds(half * self.half_v, self.half_v)   # O^T's rows with rows as N, else out's columns
    destination = self.out_ref.at[self.b, self.split]
    if self.rows_as_n:
      plgpu.copy_smem_to_gmem(self.out_smem.at[half], destination.at[rows])
    elif self.one_row_block:
      n = self.out_rows
      plgpu.copy_smem_to_gmem(self.out_smem.at[half, pl.ds(0, n)], destination.at[pl.ds(0, n), rows])
    else:
      plgpu.copy_smem_to_gmem(self.out_smem.at[half], destination.at[pl.ds(self.row0, ROWS), rows])
    if lse is not None:
      plgpu.copy_smem_to_gmem(*self.lse_copy())
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the program ends: the launch ends after the writes land

  def meet_and_store(self, half: int, out, lse=None, *, row_sums=(), lse_of_max=None):
    """`meet`, then `store`: out normalised with its lse, or raw with row_sums (SMEM rows the consumers
    wrote, added up); lse_of_max (log2 units) makes the lse from them."""
    self.meet()
    if row_sums:
      rows_axis = 1 if self.rows_as_n else 0   # out^T [Dv/2, N] with rows as N
      l = sum(plgpu.load(part, layout=plgpu.Layout.WGMMA.reduce(1 - rows_axis)) for part in row_sums)
      if lse_of_max is not None:
        out, lse = online_softmax.finalize(out, lse_of_max, l, reciprocal=True, rows_axis=rows_axis)
      else:   # one divide a row
        out = out * online_softmax.per_row(1.0 / jnp.where(l > 0, l, 1.0), out.shape, rows_axis)
    self.store(half, out, lse)

  def store_no_keys(self):
    """An empty split's lse alone, -inf, which tells the merges to skip its unwritten output."""
    n = self.rows_as_n or ROWS
    vector = plgpu.Layout.WGMMA.reduce(0 if self.rows_as_n else 1)
    self.lse_smem[...] = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), vector)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(*self.lse_copy())
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
