"""Split-K flash-decoding partials on the Pallas Triton backend (portable GPUs: Ampere, ROCm).

One program per (kv head [x row block], split, sequence). It loads the packed query rows of its
KV head (every q head of the group x every new token, padded to a power of two >= 16 for
`pl.dot`) and streams the KV tiles of its split: a range of `block_kv`-token tiles computed at
run time from `lengths`, so tiles past the end of a sequence (or before its sliding window)
are never loaded. Triton software-pipelines the tile loads of the loop (`num_stages`); the
online softmax runs in float32 (exp2 on log2-scaled logits).

Pallas Triton has no scalar prefetch: the block table row of the sequence is an ordinary input
and page ids are read inside the loop. A tile is one slice of one page when block_kv divides
the page size, else a per-token gather over block_kv / page_size pages.

Each split writes its softmax-normalised partial output and its natural-log LSE (-inf and 0
for a split without valid keys); the caller merges splits (`split_k.merge_splits`).
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
_WIDEN_PTX = {
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
  options: AttentionOptions   # scale, softcap, window
  k_scale: str | None = None  # None, "head" ([Hkv]) or "token" (per token and kv head): split_k.scale_kind
  v_scale: str | None = None
  fast_widen: bool = False    # widen one-byte tiles with _WIDEN_PTX (GPU only)

  @property
  def paged(self) -> bool:
    return self.page_size is not None


def _tile_range(length, split, st: _Static):
  """This split's tiles [t0, t1) and the unmasked sub-range [a, c) (`split_k.split_tile_range`)."""
  return split_k.split_tile_range(length, split, block_kv=st.block_kv, num_queries=st.num_queries,
                                  num_splits=st.num_splits, window=st.options.window)


def _load_tile(ref, block_tables_ref, tile, length, st: _Static, *, masked: bool):
  """Tile `tile` of one KV head: [block_kv, D] of a cache ref ([T, D] or [P, page_size, D]), or
  [block_kv] of a per-token scale ref ([T] or [P, page_size]); with `masked`, tokens >= length
  read as 0."""
  bkv = st.block_kv
  columns = ref.shape[-1:] if ref.ndim == (3 if st.paged else 2) else ()   # (D,) for a cache tile
  start = tile * bkv
  tokens = start + jnp.arange(bkv, dtype=jnp.int32)   # [bkv]
  every_column = (slice(None),) * len(columns)
  if not st.paged:
    ref = ref.at[(pl.ds(pl.multiple_of(start, bkv), bkv), *every_column)]
  elif bkv <= st.page_size:
    # The tile is one slice of one page.
    page = block_tables_ref[start // st.page_size]
    offset = pl.multiple_of(start % st.page_size, bkv)
    ref = ref.at[(page, pl.ds(offset, bkv), *every_column)]
  else:
    # The tile spans bkv / page_size pages: gather token by token.
    page_index = jnp.minimum(tokens // st.page_size, st.max_pages - 1)
    pages = block_tables_ref[page_index]   # [bkv]
    slots = tokens % st.page_size
    if columns:
      ref = ref.at[pages[:, None], slots[:, None], jnp.arange(columns[0], dtype=jnp.int32)[None, :]]
    else:
      ref = ref.at[pages, slots]
  if not masked:
    return pltr.load(ref)
  mask = tokens < length
  if columns:
    mask = jnp.broadcast_to(mask[:, None], (bkv, *columns))
  # The fill must share the ref's kind: Triton casts no int constant to a float8 type.
  return pltr.load(ref, mask=mask, other=0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0)


def _widen(x, st: _Static):
  """A cache tile as the matmuls take it: q's dtype already, or one-byte values as float16."""
  if x.dtype == jnp.float16 or x.dtype == jnp.bfloat16:
    return x
  if not st.fast_widen:
    return x.astype(jnp.float16)
  [out] = pltr.elementwise_inline_asm(_WIDEN_PTX[jnp.dtype(x.dtype)], args=[x], constraints="=r,=r,r", pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return out


def _per_column(x, shape):
  """A per-token vector [bkv] broadcast over rows to `shape` [rows, bkv]."""
  return lax.broadcast_in_dim(x, shape, [1])


def _dot(a, b, *, trans_b: bool = False):
  """a @ b (or a @ b.T) with a float32 result; Triton needs every dimension >= 16."""
  contract = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)


def _kernel(q_ref,            # [block_rows, D]   packed rows of this (sequence, kv head, row block)
            k_ref,            # [T, D] | [P, page_size, D]   this kv head, cache dtype
            v_ref,            # same as k_ref
            lengths_ref,      # [B] int32
            *refs, st: _Static):
  refs = list(refs)
  # [max_pages] int32, this sequence's row (ids already in [0, P))
  block_tables_ref = refs.pop(0) if st.paged else None
  # Scales: "head" [Hkv] f32 (all heads); "token" [T] | [P, page_size] f32 of this kv head.
  k_scale_ref = refs.pop(0) if st.k_scale else None
  v_scale_ref = refs.pop(0) if st.v_scale else None
  (out_ref,                   # [block_rows, D] f32
   lse_ref,                   # [block_rows] f32
   ) = refs
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  head = head_block // st.num_row_blocks
  row0 = 0 if st.num_row_blocks == 1 else (head_block % st.num_row_blocks) * st.block_rows
  length = jnp.clip(lengths_ref[b], 0, st.capacity)
  t0, t1, a, c = _tile_range(length, split, st)
  bkv, G = st.block_kv, st.group

  q = q_ref[...]   # [block_rows, D]
  rows = jnp.arange(st.block_rows, dtype=jnp.int32)[:, None] + row0   # [block_rows, 1]
  cols = jnp.arange(bkv, dtype=jnp.int32)[None, :]                    # [1, bkv]

  # A kv head's scale is the same for every tile: read it once, outside the loop.
  k_head_scale = k_scale_ref[head] if st.k_scale == "head" else None
  v_head_scale = v_scale_ref[head] if st.v_scale == "head" else None

  def scaled(x, scale_ref, kind, head_scale, tile, masked):
    """x [block_rows, bkv] f32 times the tile's per-token or this head's scale (a one-byte cache)."""
    if kind == "token":
      return x * _per_column(_load_tile(scale_ref, block_tables_ref, tile, length, st, masked=masked), x.shape)
    if kind == "head":
      return x * head_scale
    return x

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    # One-byte caches load as such and widen in registers (their values are exact in float16).
    k = _widen(_load_tile(k_ref, block_tables_ref, tile, length, st, masked=masked), st)   # [bkv, D]
    s = _dot(q, k, trans_b=True)   # [block_rows, bkv] f32
    s = scaled(s, k_scale_ref, st.k_scale, k_head_scale, tile, masked)
    s = online_softmax.log2_logits(s, scale=st.options.scale, softcap=st.options.softcap)
    if masked:
      ok = online_softmax.visible(rows, cols, tile_start=tile * bkv, length=length, num_queries=st.num_queries,
                                  group=G, window=st.options.window)
      s = jnp.where(ok, s, -jnp.inf)
    acc, m_new, l_new, p = online_softmax.softmax_step(s, acc, m_i, l_i)
    p = scaled(p, v_scale_ref, st.v_scale, v_head_scale, tile, masked)   # the sum keeps the unscaled p (l_new)
    v = _widen(_load_tile(v_ref, block_tables_ref, tile, length, st, masked=masked), st)   # [bkv, D]
    return acc + _dot(p.astype(q.dtype), v), m_new, l_new

  carry = (jnp.zeros((st.block_rows, st.head_dim), jnp.float32),
           jnp.full((st.block_rows,), -jnp.inf, jnp.float32),
           jnp.zeros((st.block_rows,), jnp.float32))
  carry = lax.fori_loop(t0, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(c, t1, functools.partial(step, masked=True), carry)
  out_ref[...], lse_ref[...] = online_softmax.finalize(*carry)


def _build(st: _Static, *, batch: int, num_kv_heads: int, kv_shape, table_width: int | None,
           num_warps: int, num_stages: int, dtype, interpret: bool):
  """Grid, BlockSpecs and compiler params for one static config; returns the pallas_call."""
  D, nrb, R = st.head_dim, st.num_row_blocks, st.block_rows
  head = lambda hb: hb // nrb
  row_block = lambda hb: hb % nrb
  q_spec = pl.BlockSpec((None, None, R, D), lambda hb, s, b: (b, head(hb), row_block(hb), 0))
  if st.paged:
    num_pages, page_size = kv_shape[:2]
    kv_spec = pl.BlockSpec((num_pages, page_size, None, D), lambda hb, s, b: (0, 0, head(hb), 0))
  else:
    kv_spec = pl.BlockSpec((None, kv_shape[1], None, D), lambda hb, s, b: (b, 0, head(hb), 0))
  in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((batch,), lambda hb, s, b: (0,))]
  if st.paged:
    in_specs.append(pl.BlockSpec((None, table_width), lambda hb, s, b: (b, 0)))
  for kind in (st.k_scale, st.v_scale):
    if kind == "head":
      in_specs.append(pl.BlockSpec((num_kv_heads,), lambda hb, s, b: (0,)))
    elif kind == "token" and st.paged:
      in_specs.append(pl.BlockSpec((num_pages, page_size, None), lambda hb, s, b: (0, 0, head(hb))))
    elif kind == "token":
      in_specs.append(pl.BlockSpec((None, kv_shape[1], None), lambda hb, s, b: (b, 0, head(hb))))
  out_specs = [
      pl.BlockSpec((None, None, None, R, D), lambda hb, s, b: (b, head(hb), s, row_block(hb), 0)),
      pl.BlockSpec((None, None, None, R), lambda hb, s, b: (b, head(hb), s, row_block(hb))),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((batch, num_kv_heads, st.num_splits, nrb * R, D), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_kv_heads, st.num_splits, nrb * R), jnp.float32),
  ]
  kind = f"paged{st.page_size}" if st.paged else "dense"
  name = (f"pallas_kv_triton_decode_{kind}_r{R}x{nrb}_d{D}_bkv{st.block_kv}_sp{st.num_splits}"
          f"_{jnp.dtype(dtype).name}")
  if st.k_scale or st.v_scale:
    name += f"_ks{st.k_scale}_vs{st.v_scale}"
  return pl.pallas_call(
      functools.partial(_kernel, st=st),
      # grid[0] varies fastest: the KV heads of one token range sit side by side in HBM.
      grid=(num_kv_heads * nrb, st.num_splits, batch),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params_class(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                    config: DecodeConfig, k_scale=None, v_scale=None, interpret: bool = False):
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
    `config.check_config`.
  interpret: run the kernel in Pallas interpret mode (CPU).

  Returns (out [B, Hkv, num_splits, R, D] float32, each split's softmax-normalised output;
  lse [B, Hkv, num_splits, R] float32, natural-log sum-exp of the split's logits, -inf (and out
  0) where the split saw no valid key). logits = scale * q.k, then softcap * tanh(logits /
  softcap) if softcap. Tokens at or past lengths[b] are never read as values (masked loads).
  """
  split_k.check_packed_args(q, k, v, lengths, block_tables, num_queries=num_queries, k_scale=k_scale,
                            v_scale=v_scale)
  B, Hkv, R, D = q.shape
  if block_tables is None:
    page_size = max_pages = None
    capacity = k.shape[1]
  else:
    page_size, max_pages = k.shape[1], block_tables.shape[1]
    capacity = page_size * max_pages
  triton_config.check_config(config, head_dim=D, page_size=page_size)

  block_rows, num_row_blocks = triton_config.row_blocking(R, D)
  st = _Static(num_queries=num_queries, group=R // num_queries, block_rows=block_rows,
               num_row_blocks=num_row_blocks, num_splits=config.num_splits, capacity=capacity,
               block_kv=config.block_kv, head_dim=D, page_size=page_size, max_pages=max_pages, options=options,
               k_scale=split_k.scale_kind(k_scale, k.shape), v_scale=split_k.scale_kind(v_scale, k.shape),
               fast_widen=FAST_WIDEN and not interpret and jnp.dtype(k.dtype) in split_k.QUANTIZED_DTYPES)
  rows_padded = block_rows * num_row_blocks
  if rows_padded != R:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows_padded - R), (0, 0)))
  args = (q, k, v, lengths) + ((block_tables,) if block_tables is not None else ())
  args += tuple(scale for scale in (k_scale, v_scale) if scale is not None)
  call = _build(st, batch=B, num_kv_heads=Hkv, kv_shape=k.shape, table_width=max_pages,
                num_warps=config.num_warps, num_stages=config.num_stages, dtype=k.dtype, interpret=bool(interpret))
  with warnings.catch_warnings():
    # Eager calls lower here; jit-time lowering goes through CompilerParams' quiet rule.
    warnings.filterwarnings("ignore", message=DEPRECATION_MESSAGE, category=DeprecationWarning)
    out, lse = call(*args)
  return out[:, :, :, :R], lse[..., :R]
