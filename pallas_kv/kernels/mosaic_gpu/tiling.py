"""KV tiles for the Mosaic GPU kernels: `block_kv` tokens of one KV head, [block_kv, D], swizzled in SMEM for
wgmma (K read transposed), and where their tokens live (`KVTiling`):

  contiguous  kv [B, T, Hkv, D]          tile j of sequence b is kv[b, j*bkv : (j+1)*bkv, h]
  paged       kv [P, page_size, Hkv, D]  token t of b is kv[table[b, t // page_size], t % page_size, h]

v stored tokens last ([B, Hkv, D, T] / [P, Hkv, D, page_size]) is tiled [D, block_kv] instead, read transposed by
P V's wgmma as K is by Q K^T; from pages smaller than a tile, [pages, D, page_size] untiled, a page a copy.

A paged tile is one TMA copy per run of tokens that one page holds (gcd(page_size, block_kv) tokens); a run of
fewer than 8 rows lands one swizzle column tile at a time (`pipeline.RingSpec.splits_rows`). Per-token scales come
with the same copies: TMA rows are 16 bytes, so a scale tile holds the 4-head group of the program's head (one kv
head: contiguous scales; other counts are laid out by head or padded to 4-head rows before the call,
`token_scale_width`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels.mosaic_gpu import pipeline

SCALE_ROW = 4   # float32 scales per 16-byte TMA row
# Each thread holds the SCALE_ROW scales of its WGMMA rows, so one column is a WGMMA row vector.
_SCALE_ROWS_LAYOUT = plgpu.Layout.TILED(
    mgpu_fa.Tiling(((64, SCALE_ROW), (16, SCALE_ROW), (8, SCALE_ROW))), warp_dims=(-6,),
    lane_dims=(-2, mgpu_fa.Replicated(4)), vector_dim=-1)


def token_scale_width(num_kv_heads: int, page_size: int | None) -> int:
  """float32 scales per token in a per-token scale slot: SCALE_ROW, each token's 4-head group (a 16-byte TMA row),
  or 1, one head's run of tokens. Group rows are read as stored over a multiple of 4 kv heads. Otherwise a head's
  run: as stored for one kv head, laid out by head ([B, Hkv, T], `DecodeSmem.scales_by_head`) before the call
  for 2, 3, 5...; except over pages whose run of single scales is under TMA's 128-byte SMEM alignment (pages of
  8 or 16): there the heads are padded to a multiple of 4 before the call and read as group rows."""
  single_run = pipeline.TMA_SMEM_ALIGNMENT // 4   # tokens of single scales per 128 bytes
  if num_kv_heads % SCALE_ROW == 0 or (page_size is not None and page_size % single_run):
    return SCALE_ROW
  return 1


def token_scale_reason(page_size: int | None, width: int) -> str | None:
  """Why a kernel cannot copy per-token scales (`width` float32 a token) of pages of page_size tokens, or None.
  A tile's scales land one page's run a copy, and TMA writes SMEM from 128-byte boundaries: a run of 16 single
  scales (64 bytes) raised a misaligned address on the H200 (RESULTS.md, twenty-sixth set)."""
  run = pipeline.TMA_SMEM_ALIGNMENT // (4 * width)   # tokens per 128 bytes of scales
  if page_size is not None and page_size % run:
    return (f"per-token scales of {width} float32 a token on pages of {page_size} tokens: TMA copies them a page "
            f"at a time into 128-byte aligned SMEM (pages of a multiple of {run} tokens)")
  return None


def load_token_scales(slot, *, head):
  """The head's scales [block_kv] f32 (WGMMA row layout) from a slot [block_kv] or [block_kv, SCALE_ROW]."""
  rows = plgpu.Layout.WGMMA.reduce(1)
  if len(slot.shape) == 1:
    return plgpu.load(slot, layout=rows)
  # SMEM loads of a strided column do not lower: load the whole group, pick the column.
  group = plgpu.load(slot, layout=_SCALE_ROWS_LAYOUT)
  column = plgpu.broadcasted_iota(jnp.int32, group.shape, 1, layout=_SCALE_ROWS_LAYOUT)
  return jnp.sum(jnp.where(column == head % SCALE_ROW, group, 0.0), axis=1)


def rows_below(values, valid_rows, layout, first_row=None, *, axis: int = 0):
  """values [bkv, cols] with rows >= valid_rows (and < first_row, given) set to 0: a masked key's p is 0, but
  0 x NaN is NaN in P V. axis=1: the tokens are the columns (v stored tokens last, [D, bkv])."""
  rows = plgpu.broadcasted_iota(jnp.int32, values.shape, axis, layout=layout)
  keep = rows < valid_rows
  if first_row is not None:
    keep = keep & (rows >= first_row)
  return jnp.where(keep, values, jnp.zeros_like(values))


# Columns zeroed per step: one 128-byte swizzle row, few registers beside the accumulators.
_ZERO_CHUNK = 64


def zero_rows_past(tile, valid_rows, *, width: int | None = None, first_row=None):
  """Zeroes rows >= valid_rows (and < first_row, given) of a 16-bit SMEM tile's first `width` columns, fenced
  for wgmma and TMA."""
  width = tile.shape[1] if width is None else width
  for start in range(0, width, _ZERO_CHUNK):
    chunk = tile.at[:, pl.ds(start, min(_ZERO_CHUNK, width - start))]
    if tile.shape[0] % 64 == 0:
      chunk[...] = rows_below(plgpu.load(chunk, layout=plgpu.Layout.WGMMA), valid_rows, plgpu.Layout.WGMMA,
                              first_row)
    else:   # the WGMMA layout spans 64 rows: a 32-token tile is zeroed through its transpose
      columns = chunk.transpose((1, 0))
      values = plgpu.load(columns, layout=plgpu.Layout.WGMMA)
      tokens = plgpu.broadcasted_iota(jnp.int32, values.shape, 1, layout=plgpu.Layout.WGMMA)
      keep = tokens < valid_rows if first_row is None else (tokens < valid_rows) & (tokens >= first_row)
      columns[...] = jnp.where(keep, values, jnp.zeros_like(values))
  plgpu.commit_smem()


def zero_columns_past(tile, valid_columns, *, first_column=None):
  """Zeroes columns >= valid_columns (and < first_column, given) of an SMEM tile [D, bkv] of v stored tokens last,
  64 rows at a time (the WGMMA layouts' span), fenced for wgmma and TMA. One-byte values are selected as float16
  (exact both ways), as Mosaic GPU has no 8-bit select."""
  one_byte = jnp.dtype(tile.dtype).itemsize == 1
  layout = plgpu.Layout.WGMMA_8BIT if one_byte else plgpu.Layout.WGMMA
  for start in range(0, tile.shape[0], 64):
    chunk = tile.at[pl.ds(start, 64)]
    values = plgpu.load(chunk, layout=layout)
    values = values.astype(jnp.float16) if one_byte else values
    chunk[...] = rows_below(values, valid_columns, layout, first_column, axis=1).astype(chunk.dtype)
  plgpu.commit_smem()


def smem_transforms(dtype: Any, minor_dim: int, max_swizzle: int | None = None) -> tuple[Any, ...]:
  """Tiling + the widest swizzle (at most max_swizzle bytes) for a [rows, minor_dim] wgmma operand."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_dim * bits, "KV tile")
  if max_swizzle is not None:
    swizzle = min(swizzle, max_swizzle)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class KVTiling:
  """How a KV cache (K and V alike) is cut into SMEM tiles; page_size None: contiguous. num_pages and
  max_pages (paged) clamp page ids and table columns. `config.check_config` accepted the sizes."""
  block_kv: int
  head_dim: int
  dtype: Any
  page_size: int | None = None
  num_pages: int | None = None
  max_pages: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.page_size is not None and (self.num_pages is None or self.max_pages is None):
      raise ValueError("a paged KVTiling needs num_pages and max_pages")

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def block_shape(self) -> tuple[int, int]:
    return (self.block_kv, self.head_dim)

  @property
  def transforms(self) -> tuple[Any, ...]:
    return smem_transforms(self.dtype, self.head_dim)

  @property
  def copies_per_tile(self) -> int:
    """Runs of tokens (GMEM sources) per tile; a run is one TMA copy, or one per column tile if it splits rows."""
    return self.block_kv // self.rows_per_copy

  def capacity(self, kv_shape: Sequence[int]) -> int:
    if self.paged:
      return self.max_pages * self.page_size
    return kv_shape[1]

  @property
  def rows_per_copy(self) -> int:
    return math.gcd(self.page_size, self.block_kv) if self.paged else self.block_kv

  def tile_locations(self, tile, *, batch, block_tables_ref=None, length=None) -> list[tuple[Any, Any]]:
    """Where tile `tile` of sequence `batch` lives: (leading index, first row) per copy, for K and V alike.
    Page ids are clamped into the pool; given length, table entries past it (which may name no page or
    another sequence's) are read as the sequence's last page."""
    bkv = self.block_kv
    if not self.paged:
      return [(batch, tile * bkv)]
    if block_tables_ref is None:
      raise ValueError("paged KV needs block_tables")
    ps = self.page_size

    last_column = self.max_pages - 1
    if length is not None:
      last_column = jnp.clip((length - 1) // ps, 0, last_column)

    def page_id(column):
      column = jnp.minimum(column, last_column)
      return jnp.clip(block_tables_ref[batch, column], 0, self.num_pages - 1)

    if ps % bkv == 0:
      tiles_per_page = ps // bkv
      return [(page_id(tile // tiles_per_page), (tile % tiles_per_page) * bkv)]
    n = self.copies_per_tile
    if bkv % ps == 0:
      return [(page_id(tile * n + i), 0) for i in range(n)]
    # Pages and tiles overlap unevenly (pages of 48 tokens): a run of gcd tokens never crosses a page.
    rows = self.rows_per_copy
    tokens = [tile * bkv + i * rows for i in range(n)]
    return [(page_id(t // ps), t % ps) for t in tokens]

  def tile_sources(self, kv_ref, locations, *, head) -> list[Any]:
    """GMEM views [rows_per_copy, D] of kv_ref at `locations`, which stacked in order are the tile."""
    rows = self.rows_per_copy
    return [kv_ref.at[index, pl.ds(row, rows), head] for index, row in locations]

  def tokens_last_sources(self, v_ref, locations, *, head) -> list[Any]:
    """GMEM views of a v stored tokens last (v_ref [B, Hkv, D, T] / [P, Hkv, D, page_size]) at `locations`: one
    [D, block_kv] tile, or from pages smaller than a tile [1, D, page_size] a page, stacked along the slot's first
    axis (`DecodeSmem.value_pages`)."""
    if self.copies_per_tile == 1:
      return [v_ref.at[index, head, :, pl.ds(row, self.block_kv)] for index, row in locations]
    if self.block_kv % self.page_size:
      raise ValueError(f"v stored tokens last in pages of {self.page_size} tokens cannot fill {self.block_kv}-token "
                       f"tiles a whole page at a time")
    return [v_ref.at[pl.ds(index, 1), head] for index, _ in locations]

  def tokens_last_scale_sources(self, scale_ref, locations, *, head) -> list[Any]:
    """GMEM views [rows_per_copy] of per-token scales laid out tokens last (scale_ref [B, Hkv, T] /
    [P, Hkv, page_size] f32), one per copy, which stacked in order are the tile's [block_kv] scales."""
    return [scale_ref.at[index, head, pl.ds(row, self.rows_per_copy)] for index, row in locations]

  def scale_sources(self, scale_ref, locations, *, head, width: int, tokens_per_index: int) -> list[Any]:
    """GMEM views of the tile's per-token scales, one per copy: scale_ref [B, T, Hkv] / [P, page_size, Hkv]
    f32, flattened when width is 1 (one kv head); tokens_per_index is T or page_size."""
    rows = self.rows_per_copy
    if width == 1:
      return [scale_ref.at[pl.ds(index * tokens_per_index + row, rows)] for index, row in locations]
    group = pl.ds((head // width) * width, width)
    return [scale_ref.at[index, pl.ds(row, rows), group] for index, row in locations]
