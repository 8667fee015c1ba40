"""What a Pallas Triton decode kernel body reads and computes per KV tile: its static description
(`Static`), its input refs by name (`Refs`), tile loads (contiguous or paged, masked, one-byte
tiles widened in registers) and one tile's step of the online softmax (`tile_step`), shared by
the per-sequence kernel (`decode.py`) and the stream-K kernel (`stream_k.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import online_softmax

# Each takes 4 one-byte values packed in $2 and writes them as float16 pairs to $0 (values 0, 1)
# and $1 (values 2, 3). int8: (s ^ 0x80) placed under the float16 exponent of 1024 reads
# 1024 + s + 128; subtracting 1152 leaves s. float8_e5m2 is the high byte of a float16.
# float8_e4m3fn has a packed hardware conversion (sm_89+).
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
# Measured on the H200 and left out (benchmarks/RESULTS.md, eighth set): int8 widened to
# value + 1152 with the offset taken off after the products, and q . k on the integer tensor cores
# from two int8 terms of q. They cut the SASS per 128-token tile from 875 to 833 and 702
# instructions and changed the time by -4% to +7%. With two programs per SM (~240 registers) the
# loop is bound by each warp's latency, not by how many instructions it issues.


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernel body needs to know at trace time."""
  num_queries: int      # S
  group: int            # G
  block_rows: int       # packed rows per program (power of two >= 16)
  num_row_blocks: int
  num_splits: int
  capacity: int         # tokens addressable per sequence (T, or max_pages * page_size)
  block_kv: int
  head_dim: int
  page_size: int | None   # None: contiguous cache
  max_pages: int | None
  num_pages: int | None   # P: page ids are clamped into [0, P) here, not by a launch before the kernel
  options: AttentionOptions   # scale, softcap, window
  k_scale: str | None = None  # None, "head" ([Hkv]) or "token" (per token and kv head): frame.scale_kind
  v_scale: str | None = None
  fast_widen: bool = False    # widen one-byte tiles with WIDEN_PTX (GPU only)
  merge: bool = False         # merge the splits in this launch (decode_merged)
  rows: int = 0               # R, the real packed rows (merge: padding rows are never loaded or stored)
  has_sinks: bool = False     # merge: sink logits join the denominator
  write_lse: bool = True      # merge: write the merged LSE
  barriers: bool = False      # merge: CTA barriers around the counter atomic (GPU; see the module doc)
  balanced: bool = False      # the balanced split plan: tiles per split from an int32 [1] input
  ordered: bool = False       # programs take sequence order[b] (int32 [B] input), not b
  stream_k: bool = False      # the stream-K plan (merge mode): num_splits programs per head block share its tiles
  v_tokens_last: bool = False  # v's tiles are [D, block_kv]: v [B, Hkv, D, T] | [P, Hkv, D, page_size]

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def picks_sequences(self) -> bool:
    """Programs choose their sequences at run time, so the per-sequence refs hold the whole batch."""
    return self.ordered or self.stream_k


def load_tile(ref, block_tables_ref, tile, length, st: Static, *, masked: bool, seq: tuple = (),
               tokens_last: bool = False):
  """Tile `tile` of one KV head: [block_kv, D] of a cache ref ([T, D] or [P, page_size, D]), or
  [block_kv] of a per-token scale ref ([T] or [P, page_size]); with `masked`, tokens >= length
  read as 0. `seq` is (b,) where the per-sequence refs (a dense ref, the block tables) hold the
  whole batch (st.picks_sequences): a Pallas Triton access takes one indexer, so b joins it.
  tokens_last: a value ref stored [D, T] or [P, D, page_size] (`v_tokens_last`), read as a
  [D, block_kv] tile whose rows are contiguous tokens, so that P V's operand of a one-byte cache
  loads in words instead of single bytes."""
  bkv = st.block_kv
  if tokens_last and st.paged and bkv > st.page_size:
    return _load_pages_tokens_last(ref, block_tables_ref, tile, length, st, masked=masked, seq=seq)
  if tokens_last:
    columns = (st.head_dim,)
  else:
    columns = ref.shape[-1:] if ref.ndim == (3 if st.paged else 2 + len(seq)) else ()   # (D,) for a cache tile
  start = tile * bkv
  tokens = start + jnp.arange(bkv, dtype=jnp.int32)   # [bkv]

  def stored(token_index, column_index):
    """The indices after the batch or page dim, in the ref's order of tokens and columns."""
    if not columns:
      return (token_index,)
    return (column_index, token_index) if tokens_last else (token_index, column_index)

  if not st.paged:
    ref = ref.at[(*seq, *stored(pl.ds(pl.multiple_of(start, bkv), bkv), slice(None)))]
  elif bkv <= st.page_size:
    # The tile is one slice of one page.
    page = jnp.clip(block_tables_ref[(*seq, start // st.page_size)], 0, st.num_pages - 1)
    offset = pl.multiple_of(start % st.page_size, bkv)
    ref = ref.at[(page, *stored(pl.ds(offset, bkv), slice(None)))]
  else:
    # The tile spans bkv / page_size pages: gather token by token (a key row, D contiguous
    # values, is one run of vectors; tokens-last values took `_load_pages_tokens_last` above).
    page_index = jnp.minimum(tokens // st.page_size, st.max_pages - 1)
    pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)   # [bkv]
    slots = tokens % st.page_size
    if columns:
      ref = ref.at[pages[:, None], slots[:, None], jnp.arange(columns[0], dtype=jnp.int32)[None, :]]
    else:
      ref = ref.at[pages, slots]
  if not masked:
    return pltr.load(ref)
  mask = tokens < length
  if columns:
    mask = jnp.broadcast_to(mask[None, :], (*columns, bkv)) if tokens_last else jnp.broadcast_to(
        mask[:, None], (bkv, *columns))
  # The fill must share the ref's kind: Triton casts no int constant to a float8 type.
  return pltr.load(ref, mask=mask, other=0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0)


def _load_pages_tokens_last(ref, block_tables_ref, tile, length, st: Static, *, masked: bool, seq: tuple):
  """Tile `tile` [D, block_kv] of a tokens-last value ref [P, D, page_size] when the tile spans
  block_kv / page_size pages. It loads as [D, pages, page_size] with one page id per page, so
  each page's run of tokens is contiguous to the compiler and loads as a vector (a page id per
  token would make every byte a load of its own), then merges the last two dims."""
  ps, D = st.page_size, st.head_dim
  n = st.block_kv // ps
  start = tile * st.block_kv
  page_index = jnp.minimum(start // ps + jnp.arange(n, dtype=jnp.int32), st.max_pages - 1)
  pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)   # [n]
  slots = jnp.arange(ps, dtype=jnp.int32)
  view = ref.at[pages[None, :, None], jnp.arange(D, dtype=jnp.int32)[:, None, None], slots[None, None, :]]
  if masked:
    tokens = start + ps * jnp.arange(n, dtype=jnp.int32)[:, None] + slots[None, :]   # [n, ps]
    mask = jnp.broadcast_to((tokens < length)[None], (D, n, ps))
    x = pltr.load(view, mask=mask, other=0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0)
  else:
    x = pltr.load(view)
  return x.reshape(D, st.block_kv)


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
  """A per-token vector [bkv] broadcast over rows to `shape` [rows, bkv]."""
  return lax.broadcast_in_dim(x, shape, [1])


def dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with a float32 result; Triton needs every dimension >= 16."""
  contract = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)


class Refs:
  """A kernel's input refs by name, in `_build`'s order (the balanced plan's tile count read out);
  `rest` holds what follows them: the outputs, and merge mode's extra inputs."""

  def __init__(self, q_ref, k_ref, v_ref, lengths_ref, refs, st: Static):
    refs = list(refs)
    self.q, self.k, self.v, self.lengths = q_ref, k_ref, v_ref, lengths_ref
    # [B] int32, the sequence each batch slot of the grid takes (`SplitPlan.order`)
    self.order = refs.pop(0) if st.ordered else None
    # [1] int32, the balanced plan's tiles per split (`SplitPlan.tiles_per_split`)
    self.tiles_per_split = refs.pop(0)[0] if st.balanced else None
    # [max_pages] int32, this sequence's row ([B, max_pages] when the kernel picks sequences);
    # ids clamped into [0, P) here
    self.block_tables = refs.pop(0) if st.paged else None
    # Scales: "head" [Hkv] f32 (all heads); "token" [T] | [P, page_size] f32 of this kv head.
    self.k_scale = refs.pop(0) if st.k_scale else None
    self.v_scale = refs.pop(0) if st.v_scale else None
    self.rest = refs   # the outputs (and merge-mode inputs)


def load_q(r: Refs, row0, seq: tuple, st: Static):
  """This program's packed q rows [block_rows, D]; q is not padded (a pad would be a launch of its
  own): rows past R load as 0."""
  rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0
  return pltr.load(r.q.at[(*seq, pl.ds(row0, st.block_rows), slice(None))],
                   mask=jnp.broadcast_to(rows < st.rows, (st.block_rows, st.head_dim)), other=0.0)


def initial_carry(st: Static):
  """The online softmax's (acc, running max, running sum) before any tile."""
  return (jnp.zeros((st.block_rows, st.head_dim), jnp.float32),
          jnp.full((st.block_rows,), -jnp.inf, jnp.float32),
          jnp.zeros((st.block_rows,), jnp.float32))


def head_scales_of(r: Refs, head, st: Static):
  """(k, v) scales of this kv head where they are per head, else None: the same for every tile,
  so read once, outside the tile loop."""
  return (r.k_scale[head] if st.k_scale == "head" else None, r.v_scale[head] if st.v_scale == "head" else None)


def tile_step(r: Refs, q, tile, carry, *, head_scales, row0, length, seq: tuple, masked: bool, st: Static):
  """One KV tile of one sequence folded into the online softmax's carry (acc, m, l); with
  `masked`, keys a row may not see (past the length, outside the window, after its own
  position) are masked and values past the length read as 0. head_scales: `head_scales_of`."""
  bkv, G = st.block_kv, st.group
  acc, m_i, l_i = carry

  def scaled(x, scale_ref, kind, head_scale):
    """x [block_rows, bkv] f32 times the tile's per-token or this head's scale (a one-byte cache)."""
    if kind == "token":
      scales = load_tile(scale_ref, r.block_tables, tile, length, st, masked=masked, seq=seq)
      return x * _per_column(scales, x.shape)
    if kind == "head":
      return x * head_scale
    return x

  # One-byte caches load as such and widen in registers (their values are exact in float16).
  k = widen(load_tile(r.k, r.block_tables, tile, length, st, masked=masked, seq=seq), st)   # [bkv, D]
  s = dot(q, k, trans_b=True)   # [block_rows, bkv] f32
  s = scaled(s, r.k_scale, st.k_scale, head_scales[0])
  s = online_softmax.log2_logits(s, scale=st.options.scale, softcap=st.options.softcap)
  if masked:
    rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0   # [block_rows, 1]
    cols = jnp.arange(bkv, dtype=jnp.int32)[None, :]                    # [1, bkv]
    ok = online_softmax.visible(rows, cols, tile_start=tile * bkv, length=length, num_queries=st.num_queries,
                                group=G, window=st.options.window)
    s = jnp.where(ok, s, -jnp.inf)
  acc, m_new, l_new, p = online_softmax.softmax_step(s, acc, m_i, l_i)
  p = scaled(p, r.v_scale, st.v_scale, head_scales[1])   # the sum keeps the unscaled p (l_new)
  # [bkv, D], or [D, bkv] with v tokens last
  v = widen(load_tile(r.v, r.block_tables, tile, length, st, masked=masked, seq=seq,
                        tokens_last=st.v_tokens_last), st)
  pv = dot(p.astype(q.dtype), v, trans_b=st.v_tokens_last)
  return acc + pv, m_new, l_new


def first_row(head_block, st: Static):
  """The first packed row of this program's row block."""
  return 0 if st.num_row_blocks == 1 else (head_block % st.num_row_blocks) * st.block_rows


def real_rows(row0, st: Static):
  """[block_rows] bool: which of this program's rows are real (< R)."""
  return row0 + jnp.arange(st.block_rows, dtype=jnp.int32) < st.rows
