"""Tiles wgmma reads from the GQA kernel's rings (`decode._kernel`): 16-bit slots as they are (`RingTiles`), one-byte
slots widened in registers into a consumer's own tile of q's dtype (`DequantizedTiles`), or by the converter
warpgroup into a ring of q-dtype tiles (`convert_tile`). tile_math: the kernel's `decode.TileMath` (its
`dequantize`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels.mosaic_gpu import fp8_operands
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling


@dataclasses.dataclass(frozen=True)
class RingTiles:
  """Tiles wgmma reads from their ring slots: fetch(step, valid_rows, first_row) waits and zeroes rows (tokens)
  past valid_rows and before first_row (unless the filler did: zero_rows=False); tile(step) returns a fetched
  tile; done(step) frees its slot. tokens_last: slots [D, bkv] of v stored tokens last, handed to wgmma
  transposed."""
  ring: pipeline.Ring
  zero_rows: bool = True
  tokens_last: bool = False

  def fetch(self, step, valid_rows=None, first_row=None):
    tile = self.ring.wait(step)
    if valid_rows is not None and self.zero_rows:
      partial = valid_rows < self.ring.spec.block_shape[1 if self.tokens_last else 0]
      if first_row is not None:
        partial = partial | (first_row > 0)

      @pl.when(partial)
      def _():
        # Every consumer of the slot writes the same values: a harmless race.
        if self.tokens_last:
          tiling.zero_columns_past(tile, valid_rows, first_column=first_row)
        else:
          tiling.zero_rows_past(tile, valid_rows, first_row=first_row)
    return self.tile(step)

  def tile(self, step):
    tile = self.ring.slot(step)
    return tile.transpose((1, 0)) if self.tokens_last else tile

  def column_scales(self, step):
    del step   # 16-bit tiles have no scales

  def done(self, step):
    self.ring.release(step)


@dataclasses.dataclass(frozen=True)
class DequantizedTiles:
  """One-byte tiles behind `RingTiles`' interface: fetch widens the slot into this consumer's dequantized
  tile and frees the slot; the caller waits for wgmma's reads of that tile before the next fetch.
  tokens_last: V's tiles [D, bkv], widened without their per-token scales, which P takes (`column_scales`)."""
  ring: pipeline.Ring
  dequantized: Any
  tile_math: Any
  scale_ring: pipeline.Ring | None = None
  head: Any = None
  tokens_last: bool = False
  explicit_barriers: bool = False

  def fetch(self, step, valid_rows=None, first_row=None):
    scale_ring = None if self.tokens_last else self.scale_ring
    if self.explicit_barriers:   # every warp's wgmma over the previous tile (wgmma's B: all rows) is done
      plgpu.commit_smem()
    self.dequantized[...] = dequantized_values(self.ring, scale_ring, step, valid_rows, self.head,
                                                self.tile_math, self.dequantized.dtype, first_row,
                                                tokens_axis=1 if self.tokens_last else 0)
    # One proxy fence covers both TMA's refill of the slots read above and wgmma's reads of the stores.
    self.ring.release(step, read_by_registers=True)
    # The scales' reads came before that fence: here, or into P (tokens last: `column_scales`, in the softmax).
    pipeline.release_after_commit((self.scale_ring,), step)
    return self.tile(step)

  def tile(self, step):
    del step
    return self.dequantized.transpose((1, 0)) if self.tokens_last else self.dequantized

  def column_scales(self, step):
    """Tokens last: step's per-token scales [bkv] (WGMMA columns) for P, their slot freed by the same step's fetch;
    else None (fetch applies them)."""
    if not self.tokens_last or self.scale_ring is None:
      return None
    return fp8_operands.column_scales(self.scale_ring, step)

  def done(self, step):
    del step


def dequantized_values(ring: pipeline.Ring, scale_ring, step, valid_rows, head, tile_math: Any, dtype,
                        first_row=None, tokens_axis: int = 0):
  """Step's one-byte tile widened in registers, tokens (rows; columns with tokens_axis=1) past valid_rows (and
  before first_row) zeroed; the slots stay held."""
  values = plgpu.load(ring.wait(step), layout=plgpu.Layout.WGMMA_8BIT)
  token_scales = None
  if scale_ring is not None:
    token_scales = tiling.load_token_scales(scale_ring.wait(step), head=head)
  values = tile_math.dequantize(values, dtype, token_scales)
  if valid_rows is not None:   # after the scales: a scale past the length may be inf as well
    values = tiling.rows_below(values, valid_rows, plgpu.Layout.WGMMA_8BIT, first_row, axis=tokens_axis)
  return values


def convert_tile(ring: pipeline.Ring, scale_ring, out_ring: pipeline.Ring, step, valid_rows, head, tile_math, dtype,
                 first_row=None):
  """The converter: step's widened tile (`tile_math.dequantize` to dtype) into out_ring's slot of the same step."""
  values = dequantized_values(ring, scale_ring, step, valid_rows, head, tile_math, dtype, first_row)
  # The one-byte slots go back first, so that TMA refills them while this tile is stored.
  ring.release(step, read_by_registers=True)
  if scale_ring is not None:
    scale_ring.release(step)
  out_ring.acquire(step)
  out_ring.slot(step)[...] = values
  out_ring.commit_stores(step)
