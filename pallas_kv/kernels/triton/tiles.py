"""A Pallas Triton decode kernel body's pieces: its static description (`Static`), input refs (`Refs`),
masked tile loads (one-byte tiles widened in registers) and one tile's online-softmax step (`tile_step`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import online_softmax

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

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def picks_sequences(self) -> bool:
    return self.ordered or self.stream_k


def load_tile(ref, block_tables_ref, tile, length, st: Static, *, masked: bool, seq: tuple = (),
               tokens_last: bool = False):
  """Tile `tile` of one KV head: [block_kv, D] of a cache ref ([T, D] / [P, page_size, D]) or [block_kv] of
  a per-token scale ref; with `masked`, tokens >= length read as 0. `seq` is (b,) where the per-sequence refs
  hold the whole batch (a Pallas Triton access takes one indexer). tokens_last: a value ref [D, T] /
  [P, D, page_size] read as [D, block_kv], so one-byte values load in words, not single bytes."""
  bkv = st.block_kv
  if tokens_last and st.paged and bkv > st.page_size:
    return _load_pages_tokens_last(ref, block_tables_ref, tile, length, st, masked=masked, seq=seq)
  if tokens_last:
    columns = (st.head_dim,)
  else:
    columns = ref.shape[-1:] if ref.ndim == (3 if st.paged else 2 + len(seq)) else ()
  start = tile * bkv
  tokens = start + jnp.arange(bkv, dtype=jnp.int32)

  def stored(token_index, column_index):
    if not columns:
      return (token_index,)
    return (column_index, token_index) if tokens_last else (token_index, column_index)

  if not st.paged:
    ref = ref.at[(*seq, *stored(pl.ds(pl.multiple_of(start, bkv), bkv), slice(None)))]
  elif bkv <= st.page_size:
    page = jnp.clip(block_tables_ref[(*seq, start // st.page_size)], 0, st.num_pages - 1)
    offset = pl.multiple_of(start % st.page_size, bkv)
    ref = ref.at[(page, *stored(pl.ds(offset, bkv), slice(None)))]
  else:
    # The tile spans pages: gather token by token (each key row is still one contiguous run).
    page_index = jnp.minimum(tokens // st.page_size, st.max_pages - 1)
    pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)
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
  """A tokens-last tile [D, block_kv] spanning pages, loaded as [D, pages, page_size] with one id per page so
  that each page's tokens load as a vector (an id per token would load byte by byte)."""
  ps, D = st.page_size, st.head_dim
  n = st.block_kv // ps
  start = tile * st.block_kv
  page_index = jnp.minimum(start // ps + jnp.arange(n, dtype=jnp.int32), st.max_pages - 1)
  pages = jnp.clip(block_tables_ref[(*seq, page_index)], 0, st.num_pages - 1)
  slots = jnp.arange(ps, dtype=jnp.int32)
  view = ref.at[pages[None, :, None], jnp.arange(D, dtype=jnp.int32)[:, None, None], slots[None, None, :]]
  if masked:
    tokens = start + ps * jnp.arange(n, dtype=jnp.int32)[:, None] + slots[None, :]
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
    self.order = refs.pop(0) if st.ordered else None
    self.tiles_per_split = refs.pop(0)[0] if st.balanced else None
    self.block_tables = refs.pop(0) if st.paged else None
    # Scales: "head" [Hkv] f32 (all heads); "token" [T] | [P, page_size] f32 of this kv head.
    self.k_scale = refs.pop(0) if st.k_scale else None
    self.v_scale = refs.pop(0) if st.v_scale else None
    self.rest = refs


def load_q(r: Refs, row0, seq: tuple, st: Static):
  """This program's q rows [block_rows, D]; rows past R load as 0 (padding q would take a launch)."""
  rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0
  return pltr.load(r.q.at[(*seq, pl.ds(row0, st.block_rows), slice(None))],
                   mask=jnp.broadcast_to(rows < st.rows, (st.block_rows, st.head_dim)), other=0.0)


def initial_carry(st: Static):
  return (jnp.zeros((st.block_rows, st.head_dim), jnp.float32),
          jnp.full((st.block_rows,), -jnp.inf, jnp.float32),
          jnp.zeros((st.block_rows,), jnp.float32))


def head_scales_of(r: Refs, head, st: Static):
  """(k, v) scales of this kv head where per head, else None; read once, outside the tile loop."""
  return (r.k_scale[head] if st.k_scale == "head" else None, r.v_scale[head] if st.v_scale == "head" else None)


def tile_step(r: Refs, q, tile, carry, *, head_scales, row0, length, seq: tuple, masked: bool, st: Static):
  """One KV tile folded into the carry (acc, m, l); with `masked`, invisible keys and values past L are 0."""
  bkv, G = st.block_kv, st.group
  acc, m_i, l_i = carry

  def scaled(x, scale_ref, kind, head_scale):
    if kind == "token":
      scales = load_tile(scale_ref, r.block_tables, tile, length, st, masked=masked, seq=seq)
      return x * _per_column(scales, x.shape)
    if kind == "head":
      return x * head_scale
    return x

  k = widen(load_tile(r.k, r.block_tables, tile, length, st, masked=masked, seq=seq), st)
  s = dot(q, k, trans_b=True)
  s = scaled(s, r.k_scale, st.k_scale, head_scales[0])
  s = online_softmax.log2_logits(s, scale=st.options.scale, softcap=st.options.softcap)
  if masked:
    rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0
    cols = jnp.arange(bkv, dtype=jnp.int32)[None, :]
    ok = online_softmax.visible(rows, cols, tile_start=tile * bkv, length=length, num_queries=st.num_queries,
                                group=G, window=st.options.window)
    s = jnp.where(ok, s, -jnp.inf)
  acc, m_new, l_new, p = online_softmax.softmax_step(s, acc, m_i, l_i)
  p = scaled(p, r.v_scale, st.v_scale, head_scales[1])   # the sum keeps the unscaled p (l_new)
  v = widen(load_tile(r.v, r.block_tables, tile, length, st, masked=masked, seq=seq,
                        tokens_last=st.v_tokens_last), st)
  pv = dot(p.astype(q.dtype), v, trans_b=st.v_tokens_last)
  return acc + pv, m_new, l_new


def first_row(head_block, st: Static):
  return 0 if st.num_row_blocks == 1 else (head_block % st.num_row_blocks) * st.block_rows


def real_rows(row0, st: Static):
  return row0 + jnp.arange(st.block_rows, dtype=jnp.int32) < st.rows
