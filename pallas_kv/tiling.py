"""KV tiling for the Mosaic GPU decode kernels.

A KV tile is `block_kv` consecutive tokens of one KV head, `[block_kv, head_dim]`, held in
SMEM swizzled so that wgmma can read it directly: the K role is read transposed (Q @ K^T),
the V role as is (P @ V). `KVTiling` says how a tile is laid out in SMEM and where its
tokens live in GMEM:

  contiguous  kv [B, T, Hkv, D]                  tile j of sequence b = kv[b, j*bkv : (j+1)*bkv, h]
  paged       kv [P, page_size, Hkv, D] + table  token t of b is kv[table[b, t // page_size],
                                                 t % page_size, h]

A paged tile is one TMA copy when a page holds one or more whole tiles (page_size >= block_kv),
and `block_kv // page_size` copies into one SMEM slot when a tile spans several pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# TMA boxes are at most 256 rows, and a swizzled tile must start on an 8-row boundary.
MIN_PAGE_SIZE = 8
MAX_BLOCK_KV = 256
MIN_BLOCK_KV = 64   # P @ V contracts over the tile's tokens: Mosaic's wgmma K is a multiple of 64
# Widest swizzle: 128 bytes, i.e. 64 bf16/fp16 elements per swizzle row.
SWIZZLE_BYTES = 128


def smem_transforms(dtype: Any, minor_dim: int) -> tuple[Any, ...]:
  """Tiling + swizzle for a [rows, minor_dim] wgmma operand in SMEM."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_dim * bits, "KV tile")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class KVTiling:
  """How one role (K or V) of the KV cache is cut into SMEM tiles of `block_kv` tokens.

  Attributes:
    role: "k" or "v" (names the tile in errors and kernel names).
    block_kv: tokens per tile.
    head_dim: D.
    dtype: element type of the cache (bf16 / fp16).
    page_size: None for a contiguous cache, else tokens per page.
    num_pages: pages in the pool (paged only; page ids are clamped into range).
    max_pages: block-table width (paged only; table columns are clamped into range).
  """
  role: str
  block_kv: int
  head_dim: int
  dtype: Any
  page_size: int | None = None
  num_pages: int | None = None
  max_pages: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.role not in ("k", "v"):
      raise ValueError(f"role={self.role!r} must be 'k' or 'v'")
    if self.dtype not in SUPPORTED_DTYPES:
      raise NotImplementedError(f"KV cache dtype {self.dtype} must be one of bf16, fp16")
    if self.head_dim not in SUPPORTED_HEAD_DIMS:
      raise NotImplementedError(f"head_dim={self.head_dim} must be one of {SUPPORTED_HEAD_DIMS}")
    if self.block_kv % MIN_BLOCK_KV or not MIN_BLOCK_KV <= self.block_kv <= MAX_BLOCK_KV:
      raise ValueError(f"block_kv={self.block_kv} must be a multiple of {MIN_BLOCK_KV} in "
                       f"[{MIN_BLOCK_KV}, {MAX_BLOCK_KV}] (wgmma K and TMA box)")
    if self.page_size is not None:
      ps = self.page_size
      if ps < MIN_PAGE_SIZE or ps & (ps - 1):
        raise NotImplementedError(
            f"page_size={self.page_size} must be a power of two >= {MIN_PAGE_SIZE}")
      if ps < self.block_kv and self.block_kv % ps:
        raise ValueError(f"page_size={self.page_size} must divide block_kv={self.block_kv}")
      if ps > self.block_kv and ps % self.block_kv:
        raise ValueError(f"page_size={self.page_size} must be a multiple of block_kv={self.block_kv}")
      if self.num_pages is None or self.max_pages is None:
        raise ValueError("paged KVTiling needs num_pages and max_pages")

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
  def tile_bytes(self) -> int:
    return self.block_kv * self.head_dim * self.dtype.itemsize

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

  def tile_locations(self, tile, *, batch, block_tables_ref=None) -> list[tuple[Any, Any]]:
    """Where KV tile `tile` of sequence `batch` lives: one (leading index, first row) per copy.

    Contiguous: [(batch, tile * block_kv)]; paged: [(page id, row within the page), ...].
    block_tables_ref: [B, max_pages] int32 in GMEM (paged only). Page ids are read here,
    in-kernel, and clamped into the pool, so a bad or stale table entry never makes a copy read
    out of bounds. K and V share the locations: compute them once per tile.
    """
    bkv = self.block_kv
    if not self.paged:
      return [(batch, tile * bkv)]
    if block_tables_ref is None:
      raise ValueError("paged KV needs block_tables")
    ps = self.page_size

    def page_id(column):
      column = jnp.minimum(column, self.max_pages - 1)
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


def kv_tilings(*, block_kv: int, head_dim: int, dtype: Any, page_size: int | None = None,
               num_pages: int | None = None, max_pages: int | None = None) -> tuple[KVTiling, KVTiling]:
  """The K-role and V-role tilings of one cache (they share shape, swizzle and addressing)."""
  common = dict(block_kv=block_kv, head_dim=head_dim, dtype=dtype, page_size=page_size,
                num_pages=num_pages, max_pages=max_pages)
  return KVTiling(role="k", **common), KVTiling(role="v", **common)


def split_tile_range(length, split, *, block_kv: int, num_queries: int, num_splits: int, window: int | None):
  """Tiles [t0, t1) of split `split` of a sequence of `length` tokens, and the sub-range [a, c)
  whose tiles every new token sees whole (no masking needed). Shared by every backend.

  New token s (0 <= s < S) sits at p = L - S + s and sees keys t <= p, t > p - window. Every
  split gets an equal share of the tiles that hold visible keys (earlier splits never fewer than
  later ones), so a sequence's partials depend only on its own length and num_splits; tiles
  before the window or past the length belong to no split and are never loaded.
  """
  first_key = 0 if window is None else jnp.maximum(length - num_queries + 1 - window, 0)
  first_tile = first_key // block_kv
  end_tile = (length + block_kv - 1) // block_kv
  num_tiles = jnp.maximum(end_tile - first_tile, 0)
  per_split = (num_tiles + num_splits - 1) // num_splits
  t0 = jnp.minimum(first_tile + split * per_split, end_tile)
  t1 = jnp.minimum(t0 + per_split, end_tile)
  # Whole tiles: keys <= L - S (the first token's position) and, with a window, keys
  # >= L - window (the last token's window start).
  full_hi = jnp.maximum(length - num_queries + 1, 0) // block_kv
  full_lo = 0 if window is None else (jnp.maximum(length - window, 0) + block_kv - 1) // block_kv
  a = jnp.clip(full_lo, t0, t1)
  c = jnp.clip(full_hi, a, t1)
  return t0, t1, a, c
