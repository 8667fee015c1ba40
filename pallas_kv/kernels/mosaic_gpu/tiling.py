"""KV tiling for the Mosaic GPU decode kernels.

A KV tile is `block_kv` consecutive tokens of one KV head, `[block_kv, head_dim]`, held in
SMEM swizzled so that wgmma can read it directly: a K tile is read transposed (Q @ K^T), a V
tile as is (P @ V); both caches share one tiling. `KVTiling` says how a tile is laid out in
SMEM and where its tokens live in GMEM:

  contiguous  kv [B, T, Hkv, D]                  tile j of sequence b = kv[b, j*bkv : (j+1)*bkv, h]
  paged       kv [P, page_size, Hkv, D] + table  token t of b is kv[table[b, t // page_size],
                                                 t % page_size, h]

A paged tile is one TMA copy when a page holds one or more whole tiles (page_size >= block_kv),
and `block_kv // page_size` copies into one SMEM slot when a tile spans several pages.

Per-token scales of a one-byte cache ([B, T, Hkv] or [P, page_size, Hkv] float32) come with the
same copies. TMA moves rows of at least 16 bytes, so a scale tile holds SCALE_ROW scales per token
(the group of 4 kv heads that holds the program's head; needs Hkv % 4 == 0) and the consumer
picks its head's column in registers; with one kv head the scales are contiguous and a tile is
`block_kv` of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

# float32 per-token scales per TMA row: 16 bytes, the least TMA copies.
SCALE_ROW = 4
# [64k, SCALE_ROW] float32 in registers: each thread holds the SCALE_ROW scales of the rows (tokens)
# it holds in the WGMMA layout, so that picking one column leaves a WGMMA row vector.
_SCALE_ROWS_LAYOUT = plgpu.Layout.TILED(
    mgpu_fa.Tiling(((64, SCALE_ROW), (16, SCALE_ROW), (8, SCALE_ROW))), warp_dims=(-6,),
    lane_dims=(-2, mgpu_fa.Replicated(4)), vector_dim=-1)


def token_scale_width(num_kv_heads: int) -> int | None:
  """Scales per token in a per-token scale tile: 1 for one kv head, SCALE_ROW when Hkv is a
  multiple of it, None when TMA cannot copy them (rows of Hkv * 4 bytes are not 16-byte aligned)."""
  if num_kv_heads == 1:
    return 1
  return SCALE_ROW if num_kv_heads % SCALE_ROW == 0 else None


def load_token_scales(slot, *, head):
  """The program's per-token scales [block_kv] float32 (WGMMA row layout) from a scale tile slot.

  slot: [block_kv] (one kv head) or [block_kv, SCALE_ROW] (the 4-head group of `head`) SMEM.
  """
  rows = plgpu.Layout.WGMMA.reduce(1)
  if len(slot.shape) == 1:
    return plgpu.load(slot, layout=rows)
  # SMEM loads of a strided column do not lower: load the whole group, pick the column.
  group = plgpu.load(slot, layout=_SCALE_ROWS_LAYOUT)
  column = plgpu.broadcasted_iota(jnp.int32, group.shape, 1, layout=_SCALE_ROWS_LAYOUT)
  return jnp.sum(jnp.where(column == head % SCALE_ROW, group, 0.0), axis=1)


def rows_below(values, valid_rows, layout):
  """values [bkv, cols] in registers (`layout`) with rows >= valid_rows set to 0.

  A masked key gets p = 0, but 0 x NaN = NaN on the tensor cores: values past a sequence's length
  (stale slots, or the pages of another sequence a tile spans) must be zero before P V reads them.
  """
  rows = plgpu.broadcasted_iota(jnp.int32, values.shape, 0, layout=layout)
  return jnp.where(rows < valid_rows, values, jnp.zeros_like(values))


# Columns of a 16-bit tile zeroed per step: one 128-byte swizzle row, few registers beside the
# accumulators.
_ZERO_CHUNK = 64


def zero_rows_past(tile, valid_rows, *, width: int | None = None):
  """Zeroes rows >= valid_rows of the first `width` columns (default all) of a 16-bit SMEM tile
  [bkv, cols] in place (`rows_below`), then fences so that wgmma, and later TMA refills, see it."""
  width = tile.shape[1] if width is None else width
  for c in range(width // _ZERO_CHUNK):
    chunk = tile.at[:, pl.ds(c * _ZERO_CHUNK, _ZERO_CHUNK)]
    if tile.shape[0] % 64 == 0:
      chunk[...] = rows_below(plgpu.load(chunk, layout=plgpu.Layout.WGMMA), valid_rows, plgpu.Layout.WGMMA)
    else:   # the WGMMA layout spans 64 rows: a 32-token tile is zeroed through its transpose
      columns = chunk.transpose((1, 0))   # [64, bkv]
      values = plgpu.load(columns, layout=plgpu.Layout.WGMMA)
      tokens = plgpu.broadcasted_iota(jnp.int32, values.shape, 1, layout=plgpu.Layout.WGMMA)
      columns[...] = jnp.where(tokens < valid_rows, values, jnp.zeros_like(values))
  plgpu.commit_smem()


def smem_transforms(dtype: Any, minor_dim: int, max_swizzle: int | None = None) -> tuple[Any, ...]:
  """Tiling + swizzle for a [rows, minor_dim] wgmma operand in SMEM (the widest swizzle, at most
  max_swizzle bytes: wgmma needs one swizzle for both of its SMEM operands)."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_dim * bits, "KV tile")
  if max_swizzle is not None:
    swizzle = min(swizzle, max_swizzle)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class KVTiling:
  """How a KV cache (K or V: they share it) is cut into SMEM tiles of `block_kv` tokens.

  The config checks (`config.check_config`) have accepted block_kv and the page size.

  Attributes:
    block_kv: tokens per tile.
    head_dim: D.
    dtype: element type of the cache (bf16 / fp16, or a one-byte type that the consumers
      dequantize).
    page_size: None for a contiguous cache, else tokens per page.
    num_pages: pages in the pool (paged only; page ids are clamped into range).
    max_pages: block-table width (paged only; table columns are clamped into range).
  """
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
    """TMA copies that fill one tile (= arrivals on the slot's produced barrier)."""
    if self.paged and self.page_size < self.block_kv:
      return self.block_kv // self.page_size
    return 1

  def capacity(self, kv_shape: Sequence[int]) -> int:
    """Tokens addressable per sequence: T (contiguous) or max_pages * page_size."""
    if self.paged:
      return self.max_pages * self.page_size
    return kv_shape[1]

  @property
  def rows_per_copy(self) -> int:
    return self.block_kv // self.copies_per_tile

  def tile_locations(self, tile, *, batch, block_tables_ref=None, length=None) -> list[tuple[Any, Any]]:
    """Where KV tile `tile` of sequence `batch` lives: one (leading index, first row) per copy.

    Contiguous: [(batch, tile * block_kv)]; paged: [(page id, row within the page), ...].
    block_tables_ref: [B, max_pages] int32 in GMEM (paged only). Page ids are read here,
    in-kernel, and clamped into the pool, so a bad or stale table entry never makes a copy read
    out of bounds. length: the sequence's length (paged only): a tile that spans several pages
    and runs past the length copies the sequence's last page again in place of table entries
    past it, which may name no page or another sequence's. K and V share the locations:
    compute them once per tile.
    """
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

    if ps >= bkv:
      tiles_per_page = ps // bkv
      return [(page_id(tile // tiles_per_page), (tile % tiles_per_page) * bkv)]
    n = self.copies_per_tile
    return [(page_id(tile * n + i), 0) for i in range(n)]

  def tile_sources(self, kv_ref, locations, *, head) -> list[Any]:
    """GMEM views [rows_per_copy, D] of `kv_ref` at `locations`, stacked in order = the tile.

    kv_ref: [B, T, Hkv, D] (contiguous) or [P, page_size, Hkv, D] (paged), in GMEM.
    """
    rows = self.rows_per_copy
    return [kv_ref.at[index, pl.ds(row, rows), head] for index, row in locations]

  def scale_sources(self, scale_ref, locations, *, head, width: int, tokens_per_index: int) -> list[Any]:
    """GMEM views of the per-token scales of the tile at `locations` (`tile_locations`), one per copy.

    scale_ref: [B, T, Hkv] / [P, page_size, Hkv] float32 when width is SCALE_ROW (the copies take
    the 4-head group of `head`), the same flattened to [B * T] / [P * page_size] when width is 1
    (one kv head); tokens_per_index is T or page_size.
    """
    rows = self.rows_per_copy
    if width == 1:
      return [scale_ref.at[pl.ds(index * tokens_per_index + row, rows)] for index, row in locations]
    group = pl.ds((head // width) * width, width)
    return [scale_ref.at[index, pl.ds(row, rows), group] for index, row in locations]
