"""Where an MLA program's results go: each consumer's half of the output, and the lse, staged in
SMEM (which aliases the KV ring once every tile is consumed) and copied to GMEM by TMA."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels.mosaic_gpu.mla_config import ROWS


@dataclasses.dataclass(frozen=True)
class ProgramOutput:
  """One program's output destinations and their SMEM staging.

  out_smem [2, 64, Dv/2] (rows as N: O^T's halves [2, Dv/2, N]) in the output dtype, lse_smem [64]
  (or [N]) f32; out_ref [B, splits, out_rows, Dv] (rows as N: [B, splits, Dv, N]), lse_ref
  [B, splits, lse_rows] f32; consumers_done: one arrival per consumer warpgroup.
  """
  out_smem: Any
  lse_smem: Any
  out_ref: Any
  lse_ref: Any
  consumers_done: Any
  b: Any
  split: Any
  row0: Any               # this program's first packed row
  half_v: int
  out_rows: int           # rows of out_ref (all of them when one_row_block)
  lse_rows: int           # rows of lse_ref, a multiple of 4 (TMA stores need 16-byte rows)
  one_row_block: bool     # the program holds every row: static counts, only the real rows
  rows_as_n: int = 0

  def meet(self):
    """Waits until both consumers are here: the staging aliases the ring, which both read until
    their last tile (and whatever one put in SMEM for the other before arriving is in)."""
    plgpu.barrier_arrive(self.consumers_done)
    plgpu.barrier_wait(self.consumers_done)

  def lse_copy(self):
    """(SMEM source, GMEM destination) of the lse: every row with one row block or rows as N
    (static counts, padded to 16 bytes), else the block's 64 rows."""
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
    plgpu.wait_smem_to_gmem(0)

  def store_no_keys(self):
    """A split with no tile (of several): its lse alone, -inf, which tells the merges to skip its
    output (left unwritten, as Q is left unread)."""
    n = self.rows_as_n or ROWS
    vector = plgpu.Layout.WGMMA.reduce(0 if self.rows_as_n else 1)
    self.lse_smem[...] = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), vector)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(*self.lse_copy())
    plgpu.wait_smem_to_gmem(0)
