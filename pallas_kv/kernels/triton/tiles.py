"""A Pallas Triton decode kernel body's pieces: its static description (`Static`), input refs (`Refs`),
masked tile loads (one-byte tiles widened in registers) and one tile's online-softmax step (`tile_step`).

Triton's arrays are powers of two, so a [rows, D] tile (q, K, V, the accumulator, the outputs) is a tuple of
power-of-two column pieces (`triton_config.column_pieces`: D 96 is 64 + 32; D 128 one piece); a last piece
that runs past D has its columns masked in every load and store (never fetched, never written)."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.config import AttentionOptions
from pallas_kv import online_softmax
from pallas_kv.kernels.triton import config as triton_config

# 4 one-byte values in $2 -> float16 pairs $0 (values 0, 1), $1 (2, 3). int8: (s ^ 0x80) under the float16
# exponent of 1024 reads 1024 + s + 128, minus 1152 is s; e5m2 is a float16's high byte; e4m3fn: sm_89+ cvt.
WIDEN_PTX = {
    jnp.dtype(jnp.int8): """{
      .reg .b32 t, m, c;
      xor.b32 t, $2, 0x80808080;
      mov.b32 m, 0x64646464;
      mov.b32 c, 0x64806480;
      prmt.b32 $0, t, m, 0x5140;
      prmt.b32 $1, t, m, 0x7362;
      sub.f16x2 $0, $0, c;
      sub.f16x2 $1, $1, c;
    }""",
    jnp.dtype(jnp.float8_e5m2): """{
      .reg .b32 z;
      mov.b32 z, 0;
      prmt.b32 $0, $2, z, 0x1404;
      prmt.b32 $1, $2, z, 0x3424;
    }""",
    jnp.dtype(jnp.float8_e4m3fn): """{
      .reg .b16 lo, hi;
      mov.b32 {lo, hi}, $2;
      cvt.rn.f16x2.e4m3x2 $0, lo;
      cvt.rn.f16x2.e4m3x2 $1, hi;
    }""",
}
# Leaner one-byte variants did not pay: the loop is latency-bound (docs/decisions.md#one-byte-variants-dropped).


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernel body needs to know at trace time."""
  num_queries: int
  group: int
  block_rows: int
  num_row_blocks: int
  num_splits: int
  capacity: int
  block_kv: int
  head_dim: int
  page_size: int | None   # None: contiguous cache
  max_pages: int | None
  num_pages: int | None
  options: AttentionOptions
  k_scale: str | None = None
  v_scale: str | None = None
  fast_widen: bool = False
  merge: bool = False
  rows: int = 0               # R, the real packed rows
  has_sinks: bool = False
  write_lse: bool = True
  barriers: bool = False      # CTA barriers around the counter atomic (GPU only)
  balanced: bool = False
  ordered: bool = False
  stream_k: bool = False
  v_tokens_last: bool = False
  operand_dtype: Any = None   # the matmuls' dtype, `frame.compute_dtype` of the cache

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def pieces(self) -> tuple[tuple[int, int], ...]:
    """(first column, width) of each column piece of a [rows, D] tile."""
    return triton_config.column_pieces(self.head_dim)

  @property
  def picks_sequences(self) -> bool:
    return self.ordered or self.stream_k


def _both(a, b):
  """a & b of two masks, either None (all true)."""
  return b if a is None else a if b is None else a & b


def _columns(piece, st: Static):
  """A piece's column indices [width] and the mask of the real ones (< D), None where all are."""
  offset, width = piece
  cols = jnp.arange(width, dtype=jnp.int32)
  cols = cols if offset == 0 else cols + offset
  return cols, None if offset + width <= st.head_dim else cols < st.head_dim


def _row_tile(ref, index: tuple, first_row, num_rows: int, piece, st: Static, *, transposed: bool = False):
  """ref.at[(*index, rows first_row.., the piece's columns)] as a [num_rows, width] view ([width, num_rows]
  transposed) and the mask of its real columns, or None. A piece past D indexes with arrays, masked (never
  fetched): a slice past the ref's end passes jax's bounds check only at a start of 0, and interpret mode takes
  no mix of slices and arrays."""
  offset, width = piece
  shape = (width, num_rows) if transposed else (num_rows, width)
  if offset + width <= st.head_dim:
    rows = pl.ds(first_row, num_rows)
    cols = slice(None) if width == st.head_dim else pl.ds(offset, width)
    return ref.at[(*index, *((cols, rows) if transposed else (rows, cols)))], None
  cols, col_ok = _columns(piece, st)
  rows = first_row + jnp.arange(num_rows, dtype=jnp.int32)
  if transposed:
    return ref.at[(*index, cols[:, None], rows[None, :])], jnp.broadcast_to(col_ok[:, None], shape)
  return ref.at[(*index, rows[:, None], cols[None, :])], jnp.broadcast_to(col_ok[None, :], shape)


def _load(ref, mask):
  # The fill must share the ref's kind: Triton casts no int constant to a float8 type.
  return pltr.load(ref, mask=mask, other=None if mask is None else
                   0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0)


def load_tile(ref, block_tables_ref, tile, length, st: Static, *, masked: bool, seq: tuple = (),
               tokens_last: bool = False, window_start=None):
  """Tile `tile` of one KV head: a cache ref's ([T, D] / [P, page_size, D]) as a tuple of [block_kv, width]
  column pieces, or [block_kv] of a per-token scale ref; with `masked`, tokens >= length read as 0. `seq` is
  (b,) where the per-sequence refs hold the whole batch (a Pallas Triton access takes one indexer). tokens_last:
  a value ref [D, T] / [P, D, page_size] read as [width, block_kv] pieces, so one-byte values load in words,
  not single bytes. window_start: with `masked`, tokens before it read as 0 too (they may hold anything)."""
  if not (tokens_last or ref.ndim == (3 if st.paged else 2 + len(seq))):
    return _load_piece(ref, block_tables_ref, tile, length, st, None, masked=masked, seq=seq,
                       window_start=window_start)
  if tokens_last and st.paged and st.block_kv > st.page_size:
    return tuple(_load_pages_tokens_last(ref, block_tables_ref, tile, length, st, piece, masked=masked, seq=seq,
                                         window_start=window_start) for piece in st.pieces)
  return tuple(_load_piece(ref, block_tables_ref, tile, length, st, piece, masked=masked, seq=seq,
                           tokens_last=tokens_last, window_start=window_start) for piece in st.pieces)


def _load_piece(ref, block_tables_ref, tile, length, st: Static, piece, *, masked: bool, seq: tuple,
                tokens_last: bool = False, window_start=None):
  """One column piece of `load_tile` (piece None: a scale ref's [block_kv])."""
  bkv = st.block_kv
  start = tile * bkv
  tokens = start + jnp.arange(bkv, dtype=jnp.int32)
  col_ok = None
  if st.paged and bkv > st.page_size:
    # The tile spans pages: gather token by token (each key row is still one contiguous run).
    page_index = jnp.minimum(tokens // st.page_size, st.max_pages - 1)
    pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)
    slots = tokens % st.page_size
    if piece is not None:
      cols, col_ok = _columns(piece, st)
      ref = ref.at[pages[:, None], slots[:, None], cols[None, :]]
      if col_ok is not None:
        col_ok = jnp.broadcast_to(col_ok[None, :], (bkv, piece[1]))
    else:
      ref = ref.at[pages, slots]
  else:
    if st.paged:
      index = (jnp.clip(block_tables_ref[(*seq, start // st.page_size)], 0, st.num_pages - 1),)
      first = pl.multiple_of(start % st.page_size, bkv)
    else:
      index, first = seq, pl.multiple_of(start, bkv)
    if piece is not None:
      ref, col_ok = _row_tile(ref, index, first, bkv, piece, st, transposed=tokens_last)
    else:
      ref = ref.at[(*index, pl.ds(first, bkv))]
  token_ok = None
  if masked:
    token_ok = _in_bounds(tokens, length, window_start)
    if piece is not None:
      token_ok = jnp.broadcast_to(token_ok[None, :] if tokens_last else token_ok[:, None], ref.shape)
  return _load(ref, _both(token_ok, col_ok))


def _in_bounds(tokens, length, window_start):
  return tokens < length if window_start is None else (tokens < length) & (tokens >= window_start)


def _load_pages_tokens_last(ref, block_tables_ref, tile, length, st: Static, piece, *, masked: bool, seq: tuple,
                            window_start=None):
  """A piece [width, block_kv] of a tokens-last tile spanning pages, loaded as [width, pages, page_size] with one
  id per page so that each page's tokens load as a vector (an id per token would load byte by byte)."""
  ps, W = st.page_size, piece[1]
  n = st.block_kv // ps
  start = tile * st.block_kv
  page_index = jnp.minimum(start // ps + jnp.arange(n, dtype=jnp.int32), st.max_pages - 1)
  pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)
  slots = jnp.arange(ps, dtype=jnp.int32)
  cols, col_ok = _columns(piece, st)
  view = ref.at[pages[None, :, None], cols[:, None, None], slots[None, None, :]]
  mask = None if col_ok is None else jnp.broadcast_to(col_ok[:, None, None], (W, n, ps))
  if masked:
    tokens = start + ps * jnp.arange(n, dtype=jnp.int32)[:, None] + slots[None, :]
    mask = _both(mask, jnp.broadcast_to(_in_bounds(tokens, length, window_start)[None], (W, n, ps)))
  return _load(view, mask).reshape(W, st.block_kv)


def widen(x, st: Static):
  """A cache tile as the matmuls take it: q's dtype already, or one-byte values as float16."""
  if x.dtype == jnp.float16 or x.dtype == jnp.bfloat16:
    return x
  if not st.fast_widen:
    return x.astype(jnp.float16)
  [out] = pltr.elementwise_inline_asm(WIDEN_PTX[jnp.dtype(x.dtype)], args=[x], constraints="=r,=r,r",
                                      pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return out


def _per_column(x, shape):
  return lax.broadcast_in_dim(x, shape, [1])


def dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with a float32 result; Triton needs every dimension >= 16."""
  contract = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)


class Refs:
  """A kernel's input refs by name, in `_build`'s order; `rest`: the outputs and merge mode's inputs."""

  def __init__(self, q_ref, k_ref, v_ref, lengths_ref, refs, st: Static):
    refs = list(refs)
    self.q, self.k, self.v, self.lengths = q_ref, k_ref, v_ref, lengths_ref
    self.window_start = refs.pop(0) if st.options.has_window_start else None   # int32 [B]
    self.order = refs.pop(0) if st.ordered else None
    self.tiles_per_split = refs.pop(0)[0] if st.balanced else None
    self.block_tables = refs.pop(0) if st.paged else None
    # Scales: "head" [Hkv] f32 (all heads); "token" [T] | [P, page_size] f32 of this kv head.
    self.k_scale = refs.pop(0) if st.k_scale else None
    self.v_scale = refs.pop(0) if st.v_scale else None
    self.rest = refs


def load_q(r: Refs, row0, seq: tuple, st: Static):
  """This program's q rows as [block_rows, width] pieces in the matmuls' dtype; rows past R and columns past D
  load as 0. Padding q, or casting it for a one-byte cache's float16 math, would each take a launch."""
  return tuple(x.astype(st.operand_dtype) for x in load_rows(r.q, seq, row0, st))


def _row_mask(row0, piece, st: Static):
  """[block_rows, width]: the program's real rows (< R)."""
  return jnp.broadcast_to(real_rows(row0, st)[:, None], (st.block_rows, piece[1]))


def store_rows(ref, index: tuple, row0, x: tuple, st: Static):
  """Stores a tile's pieces [block_rows, width], their real rows and columns, at ref[(*index, rows row0.., :D)]."""
  for piece, values in zip(st.pieces, x, strict=True):
    view, col_ok = _row_tile(ref, index, row0, st.block_rows, piece, st)
    pltr.store(view, values.astype(ref.dtype), mask=_both(_row_mask(row0, piece, st), col_ok))


def load_rows(ref, index: tuple, row0, st: Static) -> tuple:
  """`store_rows`' inverse: ref[(*index, rows row0.., :D)] as [block_rows, width] pieces, 0 outside the real
  rows and columns."""
  pieces = []
  for piece in st.pieces:
    view, col_ok = _row_tile(ref, index, row0, st.block_rows, piece, st)
    pieces.append(pltr.load(view, mask=_both(_row_mask(row0, piece, st), col_ok), other=0.0))
  return tuple(pieces)


def zero_rows(st: Static) -> tuple:
  """A float32 [block_rows, D] tile of zeros, as pieces."""
  return tuple(jnp.zeros((st.block_rows, width), jnp.float32) for _, width in st.pieces)


def initial_carry(st: Static):
  """(acc as pieces, m, l, c) before the first tile; c: the running max of the V scales met (1 without)."""
  return (zero_rows(st), jnp.full((st.block_rows,), -jnp.inf, jnp.float32),
          jnp.zeros((st.block_rows,), jnp.float32),
          jnp.full((st.block_rows,), online_softmax.MIN_VALUE_SCALE if st.v_scale else 1.0, jnp.float32))


def finalize(acc: tuple, m_i, l_i, c_i):
  """`online_softmax.finalize` of an accumulator in pieces: (out pieces, lse). l and acc are in units of 1 / c:
  lse = (m + log2 c) ln 2 + ln(l / c)."""
  outs = [online_softmax.finalize(piece, m_i + jnp.log2(c_i), l_i) for piece in acc]
  return tuple(out for out, _ in outs), outs[0][1]


def head_scales_of(r: Refs, head, st: Static):
  """(k, v) scales of this kv head where per head, else None; read once, outside the tile loop."""
  return (r.k_scale[head] if st.k_scale == "head" else None, r.v_scale[head] if st.v_scale == "head" else None)


def window_start_of(r: Refs, b, st: Static):
  """Sequence b's first visible key, clamped into [0, capacity], or None where the call has no window start."""
  return None if r.window_start is None else jnp.clip(r.window_start[b], 0, st.capacity)


def tile_step(r: Refs, q, tile, carry, *, head_scales, row0, length, seq: tuple, masked: bool, st: Static,
              start=None):
  """One KV tile folded into the carry (acc, m, l, c); with `masked`, invisible keys (before start too, given
  one) and values past L are 0. A V scale goes into P, divided by c, the running max of the V scales met: P s / c
  stays within [0, 1], where P V's f16 operand keeps its precision (P s alone falls below f16's normal range for a
  cache of small values); l and acc are kept in units of 1 / c."""
  bkv, G = st.block_kv, st.group
  acc, m_i, l_i, c_i = carry

  def scales_of(scale_ref, kind, head_scale):
    if kind == "token":
      return load_tile(scale_ref, r.block_tables, tile, length, st, masked=masked, seq=seq, window_start=start)
    return head_scale if kind == "head" else None

  def scaled(x, scales, kind):
    if kind == "token":
      return x * _per_column(scales, x.shape)
    return x if scales is None else x * scales

  k = load_tile(r.k, r.block_tables, tile, length, st, masked=masked, seq=seq)
  s = functools.reduce(operator.add, (dot(q_piece, widen(k_piece, st), trans_b=True)
                                      for q_piece, k_piece in zip(q, k, strict=True)))
  s = scaled(s, scales_of(r.k_scale, st.k_scale, head_scales[0]), st.k_scale)
  s = online_softmax.log2_logits(s, scale=st.options.scale, softcap=st.options.softcap)
  if masked:
    rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0
    cols = jnp.arange(bkv, dtype=jnp.int32)[None, :]
    ok = online_softmax.visible(rows, cols, tile_start=tile * bkv, length=length, num_queries=st.num_queries,
                                group=G, window=st.options.window, start=start)
    s = jnp.where(ok, s, -jnp.inf)
  v_scales, c_new, units = scales_of(r.v_scale, st.v_scale, head_scales[1]), c_i, None
  if v_scales is not None:
    met = v_scales
    if st.v_scale == "token" and masked:   # per row, as m; keys a row does not see count for nothing
      met = jnp.where(s > -jnp.inf, _per_column(v_scales, s.shape), 0.0).max(axis=1)
    elif st.v_scale == "token":   # every row sees every key: one reduction of the [bkv] scales
      met = jnp.max(v_scales, axis=0, keepdims=True)
    c_new = jnp.maximum(c_i, met)
    units = (jnp.log2(c_i), jnp.log2(c_new))
  alpha, m_new, l_new, p = online_softmax.rescale_step(s, m_i, l_i, log2_units=units)
  acc = tuple(piece * online_softmax.per_row(alpha, piece.shape) for piece in acc)
  p = scaled(p, v_scales, st.v_scale)   # the sum keeps the unscaled p (l_new)
  v = load_tile(r.v, r.block_tables, tile, length, st, masked=masked, seq=seq, tokens_last=st.v_tokens_last,
                window_start=start)
  p = p.astype(q[0].dtype)
  acc = tuple(a + dot(p, widen(v_piece, st), trans_b=st.v_tokens_last) for a, v_piece in zip(acc, v))
  return acc, m_new, l_new, c_new


def first_row(head_block, st: Static):
  return 0 if st.num_row_blocks == 1 else (head_block % st.num_row_blocks) * st.block_rows


def real_rows(row0, st: Static):
  return row0 + jnp.arange(st.block_rows, dtype=jnp.int32) < st.rows
