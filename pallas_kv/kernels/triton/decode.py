"""Split-K flash-decoding partials on the Pallas Triton backend (portable GPUs: Ampere, ROCm).

One program per (kv head [x row block], split, sequence). It loads the packed query rows of its
KV head (every q head of the group x every new token; q is not padded in memory, the rows up
to a power of two >= 16 for `pl.dot` load as zeros) and streams the KV tiles of its split: a
range of `block_kv`-token tiles computed at run time from `lengths`, so tiles past the end of a
sequence (or before its sliding window) are never loaded. Triton software-pipelines the tile
loads of the loop (`num_stages`); the online softmax runs in float32 (exp2 on log2-scaled
logits).

Pallas Triton has no scalar prefetch: the block table row of the sequence is an ordinary input
and page ids are read inside the loop. A tile is one slice of one page when block_kv divides
the page size, else a per-token gather over block_kv / page_size pages.

Lengths and page ids are clamped here (into [0, capacity] and [0, P)), so the ops launch
nothing before the kernel.

Each split writes its softmax-normalised partial output and its natural-log LSE (-inf and 0
for a split without valid keys) for the real rows only; the caller merges splits
(`merge.merge_partials`, one launch; `split_k.merge_splits` is its reference).

With `DecodeConfig.merge_in_kernel` (`decode_merged`) the merge runs in the same launch: each
split of a sequence that has more than one split with tiles writes its partial, then bumps the
(sequence, kv head, row block) counter with an acq_rel atomic; the split that sees every other
split arrived (old count = active splits - 1) reads all partials back in split order, merges
them as `split_k.merge_splits` does (sinks included) and writes the output rows in the output
dtype. A sequence whose tiles fit one split has its split 0 write the output directly.

With `DecodeConfig.split_plan="stream_k"` (`_stream_k_kernel`, merge mode only) the grid is
num_splits programs per (kv head, row block) instead, each streaming an equal share of the whole
batch's tiles laid end to end (`split_k.StreamKLayout`, planned in each program from the lengths
vector); it meets one segment per sequence, writes a sequence that lies wholly in it directly,
and otherwise stores its piece in one of its two partial slots and bumps the sequence's counter
as above (the last piece merges the pieces in program order).

Memory ordering on the GPU (programs run concurrently; interpret mode runs them one by one, so
there the order is trivially right and the barriers are left out): a program's partial is stored
by all of its threads, the atomic is issued by one. A CTA barrier (bar.sync) before the atomic
orders every thread's stores before it, and the atomic's release is cumulative over what that
thread has observed, so the partial is visible at gpu scope to any program that acquires a later
count. The counter's read-modify-writes form one release sequence: the last program's acquire
reads the value the n-1 others wrote in turn, so it synchronizes with every one of them. A second
barrier after the atomic orders the acquire before the loads of all of the last program's
threads (they sit in a branch on the atomic's result, so they are not hoisted above it; the
partials are written by the kernel, so they are not loaded through the read-only cache).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.config import AttentionOptions
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import online_softmax
from pallas_kv.kernels import split_k
from pallas_kv.kernels.triton import config as triton_config

DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"
# Widen one-byte cache tiles to float16 with a few integer instructions per 4 values (PTX below)
# rather than the generic int/float conversions, whose throughput (16 per clock per SM) is less
# than HBM delivers one-byte values at. Interpret mode always takes the generic path.
FAST_WIDEN = True

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
# The stream-K plan as one tile loop across sequence boundaries (`_stream_k_one_loop_kernel`), or
# as a loop per segment (`_stream_k_kernel`).
STREAM_K_ONE_LOOP = True
# Measured on the H200 and left out (benchmarks/RESULTS.md, eighth set): int8 widened to
# value + 1152 with the offset taken off after the products, and q . k on the integer tensor cores
# from two int8 terms of q. They cut the SASS per 128-token tile from 875 to 833 and 702
# instructions and changed the time by -4% to +7%. With two programs per SM (~240 registers) the
# loop is bound by each warp's latency, not by how many instructions it issues.


# ---------------------------------------------------------------- jax's deprecation warning

def _quiet_lowering_rule():
  """The Triton pallas_call lowering, run with jax's Pallas Triton deprecation warning hidden.

  jax warns while lowering (at jit time, not at our call), so the library's kernels carry their
  own CompilerParams class whose lowering rule hides that one warning; users' own Pallas Triton
  kernels still warn. This needs jax internals: returns (register, rule), or None when they are
  not there (then our kernels warn like any other).
  """
  try:
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import pallas_call_registration
    register = pallas_core.register_lowering_rule
    lowering = pallas_call_registration.pallas_call_lowering
  except (ImportError, AttributeError):
    return None

  def rule(ctx, *args, **params):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=DEPRECATION_MESSAGE, category=DeprecationWarning)
      return lowering(ctx, *args, **params)

  return register, rule


@dataclasses.dataclass(frozen=True)
class CompilerParams(pltr.CompilerParams):
  """`pltr.CompilerParams` of the library's own kernels (see `_quiet_lowering_rule`)."""


def compiler_params(**kwargs):
  """Compiler params of a library kernel on this backend (`CompilerParams` where it can be)."""
  return _compiler_params_class(**kwargs)


_hook = _quiet_lowering_rule()
if _hook is not None:
  _hook[0](CompilerParams, _hook[1], "gpu")
  _compiler_params_class = CompilerParams
else:
  _compiler_params_class = pltr.CompilerParams


# ---------------------------------------------------------------- the kernel

@dataclasses.dataclass(frozen=True)
class _Static:
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
  k_scale: str | None = None  # None, "head" ([Hkv]) or "token" (per token and kv head): split_k.scale_kind
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
  one_loop: bool = False      # stream-K as one tile loop across sequence boundaries (STREAM_K_ONE_LOOP)
  v_tokens_last: bool = False  # v's tiles are [D, block_kv]: v [B, Hkv, D, T] | [P, Hkv, D, page_size]

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def picks_sequences(self) -> bool:
    """Programs choose their sequences at run time, so the per-sequence refs hold the whole batch."""
    return self.ordered or self.stream_k


def _tile_range(length, split, st: _Static, tiles_per_split):
  """This split's tiles [t0, t1) and the unmasked sub-range [a, c) (`split_k.split_tile_range`)."""
  return split_k.split_tile_range(length, split, block_kv=st.block_kv, num_queries=st.num_queries,
                                  num_splits=st.num_splits, window=st.options.window,
                                  tiles_per_split=tiles_per_split)


def _load_tile(ref, block_tables_ref, tile, length, st: _Static, *, masked: bool, seq: tuple = (),
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


def _load_pages_tokens_last(ref, block_tables_ref, tile, length, st: _Static, *, masked: bool, seq: tuple):
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


def _widen(x, st: _Static):
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


def _dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with a float32 result; Triton needs every dimension >= 16."""
  contract = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)


class _Refs:
  """A kernel's input refs by name, in `_build`'s order (the balanced plan's tile count read out);
  `rest` holds what follows them: the outputs, and merge mode's extra inputs."""

  def __init__(self, q_ref, k_ref, v_ref, lengths_ref, refs, st: _Static):
    refs = list(refs)
    self.q, self.k, self.v, self.lengths = q_ref, k_ref, v_ref, lengths_ref
    # [B] int32, the sequence each batch slot of the grid takes (DecodeConfig.sequence_order)
    self.order = refs.pop(0) if st.ordered else None
    # [1] int32, the balanced plan's tiles per split (`split_k.balanced_tiles_per_split`)
    self.tiles_per_split = refs.pop(0)[0] if st.balanced else None
    # [max_pages] int32, this sequence's row ([B, max_pages] when the kernel picks sequences);
    # ids clamped into [0, P) here
    self.block_tables = refs.pop(0) if st.paged else None
    # Scales: "head" [Hkv] f32 (all heads); "token" [T] | [P, page_size] f32 of this kv head.
    self.k_scale = refs.pop(0) if st.k_scale else None
    self.v_scale = refs.pop(0) if st.v_scale else None
    self.rest = refs   # the outputs (and merge-mode inputs)


def _load_q(r: _Refs, row0, seq: tuple, st: _Static):
  """This program's packed q rows [block_rows, D]; q is not padded (a pad would be a launch of its
  own): rows past R load as 0."""
  rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0
  return pltr.load(r.q.at[(*seq, pl.ds(row0, st.block_rows), slice(None))],
                   mask=jnp.broadcast_to(rows < st.rows, (st.block_rows, st.head_dim)), other=0.0)


def _initial_carry(st: _Static):
  """The online softmax's (acc, running max, running sum) before any tile."""
  return (jnp.zeros((st.block_rows, st.head_dim), jnp.float32),
          jnp.full((st.block_rows,), -jnp.inf, jnp.float32),
          jnp.zeros((st.block_rows,), jnp.float32))


def _head_scales(r: _Refs, head, st: _Static):
  """(k, v) scales of this kv head where they are per head, else None: the same for every tile,
  so read once, outside the tile loop."""
  return (r.k_scale[head] if st.k_scale == "head" else None, r.v_scale[head] if st.v_scale == "head" else None)


def _tile_step(r: _Refs, q, tile, carry, *, head_scales, row0, length, seq: tuple, masked: bool, st: _Static):
  """One KV tile of one sequence folded into the online softmax's carry (acc, m, l); with
  `masked`, keys a row may not see (past the length, outside the window, after its own
  position) are masked and values past the length read as 0. head_scales: `_head_scales`."""
  bkv, G = st.block_kv, st.group
  acc, m_i, l_i = carry

  def scaled(x, scale_ref, kind, head_scale):
    """x [block_rows, bkv] f32 times the tile's per-token or this head's scale (a one-byte cache)."""
    if kind == "token":
      scales = _load_tile(scale_ref, r.block_tables, tile, length, st, masked=masked, seq=seq)
      return x * _per_column(scales, x.shape)
    if kind == "head":
      return x * head_scale
    return x

  # One-byte caches load as such and widen in registers (their values are exact in float16).
  k = _widen(_load_tile(r.k, r.block_tables, tile, length, st, masked=masked, seq=seq), st)   # [bkv, D]
  s = _dot(q, k, trans_b=True)   # [block_rows, bkv] f32
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
  v = _widen(_load_tile(r.v, r.block_tables, tile, length, st, masked=masked, seq=seq,
                        tokens_last=st.v_tokens_last), st)
  pv = _dot(p.astype(q.dtype), v, trans_b=st.v_tokens_last)
  return acc + pv, m_new, l_new


def _attend(r: _Refs, *, head, row0, length, tiles, seq: tuple, st: _Static):
  """One sequence's attention over its tiles (t0, a, c, t1) for this program's rows: the
  softmax-normalised partial (out [block_rows, D] f32, natural-log lse [block_rows]) of tiles
  [t0, t1), masked in [t0, a) and [c, t1) (`split_k.unmasked_tiles`). `seq` is (b,) where the
  per-sequence refs hold the whole batch."""
  t0, a, c, t1 = tiles
  q = _load_q(r, row0, seq, st)
  head_scales = _head_scales(r, head, st)
  step = lambda masked: lambda tile, carry: _tile_step(r, q, tile, carry, head_scales=head_scales, row0=row0,
                                                       length=length, seq=seq, masked=masked, st=st)
  carry = lax.fori_loop(t0, a, step(True), _initial_carry(st))
  carry = lax.fori_loop(a, c, step(False), carry)
  carry = lax.fori_loop(c, t1, step(True), carry)
  return online_softmax.finalize(*carry)


def _kernel(q_ref,            # [R, D] packed rows of this (sequence, kv head), unpadded
            k_ref,            # [T, D] | [P, page_size, D]   this kv head, cache dtype
            v_ref,            # same as k_ref
            lengths_ref,      # [B] int32
            *refs, st: _Static):
  r = _Refs(q_ref, k_ref, v_ref, lengths_ref, refs, st)
  if st.stream_k:
    return (_stream_k_one_loop_kernel if st.one_loop else _stream_k_kernel)(r, st)
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  seq = ()
  if st.ordered:
    # The sequence is chosen at run time, so its refs hold the whole batch (`_build`): every
    # access to them puts b first in its one indexer.
    b = jnp.clip(r.order[b], 0, lengths_ref.shape[0] - 1)
    seq = (b,)
  head = head_block // st.num_row_blocks
  row0 = _row0(head_block, st)
  length = jnp.clip(lengths_ref[b], 0, st.capacity)
  t0, t1, a, c = _tile_range(length, split, st, r.tiles_per_split)
  partial = _attend(r, head=head, row0=row0, length=length, tiles=(t0, a, c, t1), seq=seq, st=st)
  if not st.merge:
    out_ref, lse_ref = r.rest   # [R, D] f32, [R] f32 of this split: the real rows only
    out, lse = partial
    row_ok = _row_ok(row0, st)
    pltr.store(out_ref.at[(*seq, pl.ds(row0, st.block_rows), slice(None))], out,
               mask=jnp.broadcast_to(row_ok[:, None], (st.block_rows, st.head_dim)))
    pltr.store(lse_ref.at[(*seq, pl.ds(row0, st.block_rows))], lse, mask=row_ok)
  else:
    _merge_epilogue(partial, r.rest, b=b, head=head, head_block=head_block, split=split, row0=row0,
                    length=length, tiles_per_split=r.tiles_per_split, st=st)


def _row0(head_block, st: _Static):
  """The first packed row of this program's row block."""
  return 0 if st.num_row_blocks == 1 else (head_block % st.num_row_blocks) * st.block_rows


def _row_ok(row0, st: _Static):
  """[block_rows] bool: which of this program's rows are real (< R)."""
  return row0 + jnp.arange(st.block_rows, dtype=jnp.int32) < st.rows


def _merge_finish(acc, norm, shift, sink):
  """`split_k.merge_splits`' last step on one program's rows: acc = sum_j w_j out_j and
  norm = sum_j w_j with w_j = exp(lse_j - shift). Returns (out, lse over the real keys; 0 and
  -inf where there are none)."""
  has_keys = norm > 0
  lse = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)
  denom = norm if sink is None else norm + jnp.exp(sink - shift)
  return acc / online_softmax.per_row(jnp.where(has_keys, denom, 1.0), acc.shape), lse


class _MergedOutputs:
  """Merge mode's outputs (module doc): the final rows of a (sequence, kv head), written directly
  from one partial or merged from several partials in a fixed order."""

  def __init__(self, refs, *, row0, st: _Static):
    refs = list(refs)
    sinks_ref = refs.pop(0) if st.has_sinks else None   # [R] f32, this kv head's rows
    if st.num_splits > 1:
      refs.pop(0)   # the zeroed counters given as an input, aliased to the counters output
    self.out = refs.pop(0)                               # [B, Hkv, R, D] output dtype
    self.lse = refs.pop(0) if st.write_lse else None     # [B, Hkv, R] f32
    # [B, Hkv, splits, R, D] and [B, Hkv, splits, R] f32 partials (stream-K: [Hkv, programs, 2, ...]),
    # [B, Hkv * num_row_blocks] int32 counters, zero at the start of the call
    self.partials = tuple(refs) if st.num_splits > 1 else None
    br, D = st.block_rows, st.head_dim
    self.row_ok = _row_ok(row0, st)
    self.tile_ok = jnp.broadcast_to(self.row_ok[:, None], (br, D))
    self.rows = pl.ds(row0, br)
    self.sink = None if sinks_ref is None else pltr.load(sinks_ref.at[self.rows], mask=self.row_ok, other=0.0)
    self.st = st

  def write(self, b, head, out, lse):
    pltr.store(self.out.at[b, head, self.rows, :], out.astype(self.out.dtype), mask=self.tile_ok)
    if self.lse is not None:
      pltr.store(self.lse.at[b, head, self.rows], lse, mask=self.row_ok)

  def write_one(self, b, head, out, lse):
    """The merge of a single partial, from registers."""
    shift = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = jnp.exp(lse - shift)   # 1, or 0 where the partial saw no key
    self.write(b, head, *_merge_finish(out * online_softmax.per_row(weight, out.shape), weight, shift, self.sink))

  def store_partial(self, index, partial):
    """Stores a partial at `index` of the partials (the leading indices before the rows)."""
    part_out, part_lse = self.partials[:2]
    pltr.store(part_out.at[(*index, self.rows, slice(None))], partial[0], mask=self.tile_ok)
    pltr.store(part_lse.at[(*index, self.rows)], partial[1], mask=self.row_ok)

  def arrive(self, b, head_block):
    """Bumps the (sequence, head block) counter; returns how many partials had arrived before."""
    counts = self.partials[2]
    if self.st.barriers:
      pltr.debug_barrier()   # every thread's partial stores come before the release
    arrived = pltr.atomic_add(counts, (b, head_block), jnp.int32(1))   # acq_rel, gpu scope
    if self.st.barriers:
      pltr.debug_barrier()   # the acquire comes before every thread's loads
    return arrived

  def merge(self, b, head, count, index_of):
    """Merges `count` partials, partial j at index_of(j), in order j = 0, 1, ...: the result is
    the same bits whatever order they arrived in."""
    part_out, part_lse = self.partials[:2]
    br, D = self.st.block_rows, self.st.head_dim
    lse_of = lambda j: pltr.load(part_lse.at[(*index_of(j), self.rows)], mask=self.row_ok, other=-jnp.inf)
    shift = lax.fori_loop(0, count, lambda j, m: jnp.maximum(m, lse_of(j)), jnp.full((br,), -jnp.inf, jnp.float32))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)

    def add(j, carry):
      acc, norm = carry
      weight = jnp.exp(lse_of(j) - shift)
      out = pltr.load(part_out.at[(*index_of(j), self.rows, slice(None))], mask=self.tile_ok, other=0.0)
      return acc + out * online_softmax.per_row(weight, out.shape), norm + weight

    acc, norm = lax.fori_loop(0, count, add, (jnp.zeros((br, D), jnp.float32), jnp.zeros((br,), jnp.float32)))
    self.write(b, head, *_merge_finish(acc, norm, shift, self.sink))


def _merge_epilogue(partial, refs, *, b, head, head_block, split, row0, length, tiles_per_split, st: _Static):
  """Merge mode: write this split's partial and let the last split to arrive merge them all
  (module doc); a sequence with at most one split with tiles has its split 0 write directly."""
  outs = _MergedOutputs(refs, row0=row0, st=st)
  if st.num_splits == 1:
    outs.write_one(b, head, *partial)
    return
  active = split_k.active_splits(length, block_kv=st.block_kv, num_queries=st.num_queries,
                                 num_splits=st.num_splits, window=st.options.window,
                                 tiles_per_split=tiles_per_split)

  @pl.when((active <= 1) & (split == 0))
  def _():
    outs.write_one(b, head, *partial)

  @pl.when((active > 1) & (split < active))
  def _():
    outs.store_partial((b, head, split), partial)

    @pl.when(outs.arrive(b, head_block) == active - 1)
    def _():
      outs.merge(b, head, active, lambda j: (b, head, j))


def _stream_k_kernel(r: _Refs, st: _Static):
  """The stream-K plan (`split_k.StreamKLayout`): program (head block, w) streams its equal share
  of the batch's tiles of that kv head, one segment per sequence it meets. A sequence whose tiles
  lie in one program is written directly; one cut across programs leaves a partial per piece, and
  the piece that arrives last merges them (module doc). Sequences without tiles are written by
  program b % programs."""
  head_block, w = pl.program_id(0), pl.program_id(1)
  head = head_block // st.num_row_blocks
  row0 = _row0(head_block, st)
  batch = r.lengths.shape[0]
  padded = triton_config.next_pow2(batch)
  index = jnp.arange(padded, dtype=jnp.int32)
  # The whole batch's lengths as one vector (indices clamped: the padding reads length 0).
  lengths = jnp.where(index < batch, jnp.clip(r.lengths[jnp.minimum(index, batch - 1)], 0, st.capacity), 0)
  plan = split_k.StreamKLayout.of(lengths, block_kv=st.block_kv, num_queries=st.num_queries,
                                  window=st.options.window, num_programs=st.num_splits)
  lo, hi = plan.program_range(w)
  outs = _MergedOutputs(r.rest, row0=row0, st=st)

  def segment(g):
    b, t0, t1 = plan.segment(g, hi)
    length = split_k.pick(lengths, b)
    a, c = split_k.unmasked_tiles(length, t0, t1, block_kv=st.block_kv, num_queries=st.num_queries,
                                  window=st.options.window)
    partial = _attend(r, head=head, row0=row0, length=length, tiles=(t0, a, c, t1), seq=(b,), st=st)
    first_program, pieces, starts_mid_chunk = plan.pieces(b)

    if st.num_splits == 1:   # one program per head block: every sequence lies in it whole
      outs.write_one(b, head, *partial)
      return g + (t1 - t0)

    @pl.when(pieces == 1)
    def _():
      outs.write_one(b, head, *partial)

    @pl.when(pieces > 1)
    def _():
      outs.store_partial((head, w, jnp.where(g == lo, 0, 1)), partial)

      @pl.when(outs.arrive(b, head_block) == pieces - 1)
      def _():
        slot = lambda j: split_k.StreamKLayout.piece_slot(starts_mid_chunk, j == 0)
        outs.merge(b, head, pieces, lambda j: (head, first_program + j, slot(j)))

    return g + (t1 - t0)

  lax.while_loop(lambda g: g < hi, segment, lo)
  _write_empty_sequences(outs, plan, head=head, w=w, batch=batch, st=st)


def _stream_k_one_loop_kernel(r: _Refs, st: _Static):
  """The stream-K plan as one tile loop over the program's whole share [lo, hi) of the batch's
  tiles: each step finds its tile's sequence from the tile index (`StreamKLayout.locate`), so
  Triton's pipeline keeps loading across sequence boundaries instead of draining and refilling
  at every segment (what `_stream_k_kernel`'s loop per segment costs). At a segment's last tile
  the step flushes it: a sequence wholly in this program is written directly; a piece of a cut
  sequence is stored and counted, and the merges that fall to this program (at most two: its
  first and its last segment) run after the loop, so that the tile loop stays innermost."""
  head_block, w = pl.program_id(0), pl.program_id(1)
  head = head_block // st.num_row_blocks
  row0 = _row0(head_block, st)
  batch = r.lengths.shape[0]
  padded = triton_config.next_pow2(batch)
  index = jnp.arange(padded, dtype=jnp.int32)
  lengths = jnp.where(index < batch, jnp.clip(r.lengths[jnp.minimum(index, batch - 1)], 0, st.capacity), 0)
  plan = split_k.StreamKLayout.of(lengths, block_kv=st.block_kv, num_queries=st.num_queries,
                                  window=st.options.window, num_programs=st.num_splits)
  lo, hi = plan.program_range(w)
  outs = _MergedOutputs(r.rest, row0=row0, st=st)
  head_scales = _head_scales(r, head, st)
  no_merge = jnp.int32(-1)

  def step(g, carry):
    softmax_carry, merge_first, merge_last = carry
    b, seq_start = plan.locate(g)
    b = jnp.minimum(b, batch - 1)
    length = jnp.clip(r.lengths[b], 0, st.capacity)
    first, end = split_k.visible_tiles(length, block_kv=st.block_kv, num_queries=st.num_queries,
                                       window=st.options.window)
    seq_end = seq_start + jnp.maximum(end - first, 0)
    segment_start = jnp.maximum(seq_start, lo)
    # A segment's first tile starts a fresh online softmax.
    softmax_carry = jax.tree.map(lambda fresh, x: jnp.where(g == segment_start, fresh, x), _initial_carry(st),
                                 softmax_carry)
    q = _load_q(r, row0, (b,), st)
    softmax_carry = _tile_step(r, q, first + (g - seq_start), softmax_carry, head_scales=head_scales, row0=row0,
                               length=length, seq=(b,), masked=True, st=st)
    segment_ends = (g + 1 == seq_end) | (g + 1 == hi)
    if st.num_splits == 1:   # one program per head block: every sequence lies in it whole
      pl.when(segment_ends)(lambda: outs.write_one(b, head, *online_softmax.finalize(*softmax_carry)))
      return softmax_carry, merge_first, merge_last
    pieces = (seq_end - 1) // plan.chunk - seq_start // plan.chunk + 1
    pl.when(segment_ends & (pieces == 1))(
        lambda: outs.write_one(b, head, *online_softmax.finalize(*softmax_carry)))

    def store_and_arrive():
      slot = jnp.where(segment_start == lo, 0, 1)   # `StreamKLayout.piece_slot`
      outs.store_partial((head, w, slot), online_softmax.finalize(*softmax_carry))
      return outs.arrive(b, head_block)

    cut = segment_ends & (pieces > 1)
    arrived = lax.cond(cut, store_and_arrive, lambda: no_merge)
    merges = cut & (arrived == pieces - 1)   # the last piece to arrive: this program merges b
    merge_first = jnp.where(merges & (segment_start == lo), b, merge_first)
    merge_last = jnp.where(merges & (segment_start != lo), b, merge_last)
    return softmax_carry, merge_first, merge_last

  _, merge_first, merge_last = lax.fori_loop(lo, hi, step, (_initial_carry(st), no_merge, no_merge))
  if st.num_splits > 1:
    for b in (merge_first, merge_last):
      @pl.when(b >= 0)
      def _():
        first_program, pieces, starts_mid_chunk = plan.pieces(b)
        slot = lambda j: split_k.StreamKLayout.piece_slot(starts_mid_chunk, j == 0)
        outs.merge(b, head, pieces, lambda j: (head, first_program + j, slot(j)))
  _write_empty_sequences(outs, plan, head=head, w=w, batch=batch, st=st)


def _write_empty_sequences(outs, plan, *, head, w, batch: int, st: _Static):
  """Zeros and lse -inf for the sequences without tiles, sequence b by program b % programs."""

  def write_empty(j, carry):
    b = w + j * st.num_splits

    @pl.when((b < batch) & (split_k.pick(plan.tiles, b) == 0))
    def _():
      outs.write_one(b, head, jnp.zeros((st.block_rows, st.head_dim), jnp.float32),
                     jnp.full((st.block_rows,), -jnp.inf, jnp.float32))
    return carry

  lax.fori_loop(0, split_k.cdiv(batch, st.num_splits), write_empty, 0)


def _build(st: _Static, *, batch: int, num_kv_heads: int, kv_shape, table_width: int | None,
           num_warps: int, num_stages: int, dtype, interpret: bool, out_dtype=None):
  """Grid, BlockSpecs and compiler params for one static config; returns the pallas_call.

  Merge mode (st.merge) takes q unpadded [B, Hkv, R, D], then the sinks [Hkv, R] (has_sinks) and
  zeroed counters [B, Hkv * nrb] (num_splits > 1, aliased to the last output), and returns
  (out [B, Hkv, R, D] out_dtype, [lse [B, Hkv, R]], [partials, their LSEs, the counters]); every
  output is one whole-array block that the programs index themselves.
  """
  D, nrb, R = st.head_dim, st.num_row_blocks, st.block_rows
  head = lambda hb: hb // nrb
  whole = lambda shape: pl.BlockSpec(shape, lambda hb, s, b: (0,) * len(shape))

  def per_sequence(block, index):
    """One sequence's block (`block` after the batch dim, at `index(hb, s)`); with
    st.picks_sequences the whole batch, since the kernel picks the sequence at run time (Pallas
    Triton has no scalar prefetch to feed an index map)."""
    if st.picks_sequences:
      return pl.BlockSpec((batch, *block), lambda hb, s, b: (0, *index(hb, s)))
    return pl.BlockSpec((None, *block), lambda hb, s, b: (b, *index(hb, s)))

  q_spec = per_sequence((None, st.rows, D), lambda hb, s: (head(hb), 0, 0))
  if st.paged:
    num_pages, page_size = kv_shape[:2]
    kv_spec = pl.BlockSpec((num_pages, page_size, None, D), lambda hb, s, b: (0, 0, head(hb), 0))
    v_spec = pl.BlockSpec((num_pages, None, D, page_size), lambda hb, s, b: (0, head(hb), 0, 0))
  else:
    kv_spec = per_sequence((kv_shape[1], None, D), lambda hb, s: (0, head(hb), 0))
    v_spec = per_sequence((None, D, kv_shape[1]), lambda hb, s: (head(hb), 0, 0))
  in_specs = [q_spec, kv_spec, v_spec if st.v_tokens_last else kv_spec, whole((batch,))]
  if st.ordered:
    in_specs.append(whole((batch,)))
  if st.balanced:
    in_specs.append(whole((1,)))
  if st.paged:
    in_specs.append(per_sequence((table_width,), lambda hb, s: (0,)))
  for kind in (st.k_scale, st.v_scale):
    if kind == "head":
      in_specs.append(pl.BlockSpec((num_kv_heads,), lambda hb, s, b: (0,)))
    elif kind == "token" and st.paged:
      in_specs.append(pl.BlockSpec((num_pages, page_size, None), lambda hb, s, b: (0, 0, head(hb))))
    elif kind == "token":
      in_specs.append(per_sequence((kv_shape[1], None), lambda hb, s: (0, head(hb))))
  aliases = {}
  if not st.merge:
    # Every row block of a (sequence, kv head, split) stores its own real rows into one block.
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, st.num_splits, st.rows, D), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, st.num_splits, st.rows), jnp.float32),
    ]
    out_specs = [per_sequence((None, None, st.rows, D), lambda hb, s: (head(hb), s, 0, 0)),
                 per_sequence((None, None, st.rows), lambda hb, s: (head(hb), s, 0))]
  else:
    if st.has_sinks:
      in_specs.append(pl.BlockSpec((None, st.rows), lambda hb, s, b: (head(hb), 0)))
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, st.rows, D), out_dtype)]
    if st.write_lse:
      out_shape.append(jax.ShapeDtypeStruct((batch, num_kv_heads, st.rows), jnp.float32))
    if st.num_splits > 1:
      counts = (batch, num_kv_heads * nrb)
      in_specs.append(whole(counts))
      aliases = {len(in_specs) - 1: len(out_shape) + 2}
      # Stream-K: two partial slots per program (`split_k.StreamKLayout.piece_slot`).
      slots = (num_kv_heads, st.num_splits, 2) if st.stream_k else (batch, num_kv_heads, st.num_splits)
      out_shape += [jax.ShapeDtypeStruct((*slots, st.rows, D), jnp.float32),
                    jax.ShapeDtypeStruct((*slots, st.rows), jnp.float32),
                    jax.ShapeDtypeStruct(counts, jnp.int32)]
    out_specs = [whole(o.shape) for o in out_shape]
  kind = f"paged{st.page_size}" if st.paged else "dense"
  name = (f"pallas_kv_triton_decode_{kind}_r{R}x{nrb}_d{D}_bkv{st.block_kv}_sp{st.num_splits}"
          f"_{jnp.dtype(dtype).name}")
  if st.k_scale or st.v_scale:
    name += f"_ks{st.k_scale}_vs{st.v_scale}"
  if st.merge:
    name += "_merged"
  if st.balanced:
    name += "_balanced"
  if st.ordered:
    name += "_ordered"
  if st.stream_k:
    name += "_streamk1" if st.one_loop else "_streamk"
  if st.v_tokens_last:
    name += "_vt"
  return pl.pallas_call(
      functools.partial(_kernel, st=st),
      # grid[0] varies fastest: the KV heads of one token range sit side by side in HBM.
      # Stream-K: num_splits programs per head block, each over a share of the whole batch.
      grid=(num_kv_heads * nrb, st.num_splits, 1 if st.stream_k else batch),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )


def _static(q, k, v, lengths, block_tables, *, num_queries: int, options: AttentionOptions, config: DecodeConfig,
            k_scale, v_scale, interpret: bool, tiles_per_split=None, sequence_order=None, v_tokens_last=False,
            **merge) -> _Static:
  """The checked static description of one call (`decode_partials`' arguments)."""
  split_k.check_packed_args(q, k, v, lengths, block_tables, num_queries=num_queries, k_scale=k_scale,
                            v_scale=v_scale, v_tokens_last=v_tokens_last)
  _, _, R, D = q.shape
  if block_tables is None:
    page_size = max_pages = num_pages = None
    capacity = k.shape[1]
  else:
    num_pages, page_size, max_pages = k.shape[0], k.shape[1], block_tables.shape[1]
    capacity = page_size * max_pages
  triton_config.check_config(config, head_dim=D, page_size=page_size)
  if config.split_plan == "stream_k" and not merge.get("merge"):
    raise ValueError("config.split_plan='stream_k' merges its pieces in the launch: call decode_merged, "
                     "not decode_partials")
  block_rows, num_row_blocks = triton_config.row_blocking(R, D)
  return _Static(num_queries=num_queries, group=R // num_queries, block_rows=block_rows,
                 num_row_blocks=num_row_blocks, num_splits=config.num_splits, capacity=capacity,
                 block_kv=config.block_kv, head_dim=D, page_size=page_size, max_pages=max_pages, num_pages=num_pages,
                 options=options,
                 k_scale=split_k.scale_kind(k_scale, k.shape), v_scale=split_k.scale_kind(v_scale, k.shape),
                 fast_widen=FAST_WIDEN and not interpret and jnp.dtype(k.dtype) in split_k.QUANTIZED_DTYPES,
                 rows=R, balanced=split_k.check_tiles_per_split(tiles_per_split, config),
                 ordered=split_k.check_sequence_order(sequence_order, config, batch=q.shape[0]),
                 stream_k=config.split_plan == "stream_k", one_loop=config.split_plan == "stream_k" and STREAM_K_ONE_LOOP,
                 v_tokens_last=v_tokens_last, **merge)


def _call(st: _Static, args, *, q, k, config: DecodeConfig, interpret: bool, out_dtype=None):
  B, Hkv = q.shape[:2]
  call = _build(st, batch=B, num_kv_heads=Hkv, kv_shape=k.shape, table_width=st.max_pages,
                num_warps=config.num_warps, num_stages=config.num_stages, dtype=k.dtype, interpret=bool(interpret),
                out_dtype=out_dtype)
  return call_quietly(call, args)


def call_quietly(call, args):
  """call(*args) with jax's Pallas Triton deprecation warning hidden: eager calls lower here;
  jit-time lowering goes through CompilerParams' quiet rule."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=DEPRECATION_MESSAGE, category=DeprecationWarning)
    return call(*args)


def _args(q, k, v, lengths, block_tables, k_scale, v_scale, tiles_per_split=None, sequence_order=None) -> tuple:
  args = (q, k, v, lengths) + ((sequence_order,) if sequence_order is not None else ())
  args += (tiles_per_split,) if tiles_per_split is not None else ()
  args += (block_tables,) if block_tables is not None else ()
  return args + tuple(scale for scale in (k_scale, v_scale) if scale is not None)


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                    config: DecodeConfig, k_scale=None, v_scale=None, tiles_per_split=None,
                    sequence_order=None, interpret: bool = False, v_tokens_last: bool = False):
  """Split-K partials of decode attention over a contiguous or paged KV cache.

  q: [B, Hkv, R, D] bf16 or fp16, R = num_queries * G packed rows, row
  r = s * G + g is query token s (of S = num_queries new tokens) for q head kv_head * G + g.
  Query token s of sequence b is at position p = lengths[b] - S + s; it attends to keys t with
  t <= p and (if options.window) t > p - window.
  dense:  k, v [B, T, Hkv, D]; block_tables None.
  paged:  k, v [P, page_size, Hkv, D]; block_tables int32 [B, max_pages] with ids in [0, P);
          token t of sequence b is k[block_tables[b, t // page_size], t % page_size].
  k and v hold q's dtype, or a one-byte dtype (int8, float8_e4m3fn, float8_e5m2) widened to
  float16 (q must then be float16) after the load and scaled by k_scale / v_scale: each None,
  float32 [Hkv] (per kv head)
  or float32 per token and kv head ([B, T, Hkv] dense, [P, page_size, Hkv] paged, addressed like
  the cache); logits use k_scale[t] * k[t] and the output v_scale[t] * v[t].
  lengths: int32 [B] (clamped into [0, capacity]).
  options: scale, softcap and window of the call.
  config: a resolved `DecodeConfig` (num_splits set; `config.resolve_config`), checked here by
    `config.check_config`. Its merge_in_kernel is not read here: `decode_merged` is that kernel.
  tiles_per_split: int32 [1], the balanced plan (`split_k.balanced_tiles_per_split`), given
    exactly when config.split_plan is "balanced".
  sequence_order: int32 [B], a permutation of the batch (`split_k.ORDER_FUNCTIONS`): batch slot i
    of the grid computes sequence sequence_order[i]; given exactly when config.sequence_order is
    not "given". Results are indexed by sequence either way.
  interpret: run the kernel in Pallas interpret mode (CPU).
  v_tokens_last: v is [B, Hkv, D, T] (paged [P, Hkv, D, page_size]): k's dims 0, 2, 3, 1.

  Returns (out [B, Hkv, num_splits, R, D] float32, each split's softmax-normalised output;
  lse [B, Hkv, num_splits, R] float32, natural-log sum-exp of the split's logits, -inf (and out
  0) where the split saw no valid key). logits = scale * q.k, then softcap * tanh(logits /
  softcap) if softcap. Tokens at or past lengths[b] are never read as values (masked loads).
  """
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, tiles_per_split=tiles_per_split,
               sequence_order=sequence_order, v_tokens_last=v_tokens_last)
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, tiles_per_split, sequence_order)
  return tuple(_call(st, args, q=q, k=k, config=config, interpret=interpret))


def decode_merged(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                  config: DecodeConfig, sinks=None, k_scale=None, v_scale=None, out_dtype=None,
                  return_lse: bool = True, tiles_per_split=None, sequence_order=None, interpret: bool = False,
                  v_tokens_last: bool = False):
  """Decode attention with the split merge in the same launch (`DecodeConfig.merge_in_kernel`;
  the module doc says how the last split of a sequence merges and why that is safe).

  Arguments as `decode_partials`, plus sinks: None or float32 [Hkv, R], the sink logit of each
  packed row (`split_k.packed_sinks`), which joins the denominator only; out_dtype: the output's
  dtype (q's by default).

  Returns (out [B, Hkv, R, D] out_dtype, lse [B, Hkv, R] float32 over the real keys, -inf where
  there are none; None unless return_lse): what `split_k.merge_splits` makes of
  `decode_partials`' result, up to float32 rounding (the sum over splits runs in another order,
  and exp / log are the kernel's own). For a fixed num_splits the bits depend only on each
  sequence's own inputs, never on the order in which its splits finish.
  """
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, tiles_per_split=tiles_per_split,
               sequence_order=sequence_order, v_tokens_last=v_tokens_last, merge=True, has_sinks=sinks is not None,
               write_lse=return_lse, barriers=not interpret)
  B, Hkv, R, _ = q.shape
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, tiles_per_split, sequence_order)
  if sinks is not None:
    if sinks.shape != (Hkv, R):
      raise ValueError(f"sinks must be float32 [Hkv, R]=({Hkv}, {R}), got {sinks.shape=}")
    args += (sinks.astype(jnp.float32),)
  if st.num_splits > 1:
    args += (jnp.zeros((B, Hkv * st.num_row_blocks), jnp.int32),)   # one counter per program group: a memset
  outs = _call(st, args, q=q, k=k, config=config, interpret=interpret, out_dtype=out_dtype or q.dtype)
  return outs[0], outs[1] if return_lse else None
