"""Split-K flash-decoding on the Pallas Triton backend (portable GPUs: Ampere, ROCm).

One program per (kv head x row block, split, sequence) loads its packed q rows and streams its split's tiles,
a range computed in the kernel from `lengths`, so tiles outside the visible keys are never loaded.
`decode_partials` writes each split's partial; `decode_merged` merges in the launch (also for stream-K)."""

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
from pallas_kv.config import TritonConfig
from pallas_kv import online_softmax
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import stream_k
from pallas_kv.kernels.triton.outputs import MergedOutputs
from pallas_kv.kernels.triton.tiles import Refs
from pallas_kv.kernels.triton.tiles import Static
from pallas_kv.kernels.triton.tiles import finalize
from pallas_kv.kernels.triton.tiles import first_row
from pallas_kv.kernels.triton.tiles import head_scales_of
from pallas_kv.kernels.triton.tiles import initial_carry
from pallas_kv.kernels.triton.tiles import load_q
from pallas_kv.kernels.triton.tiles import real_rows
from pallas_kv.kernels.triton.tiles import store_rows
from pallas_kv.kernels.triton.tiles import tile_step
from pallas_kv.kernels.triton.tiles import window_start_of

DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"
# Widen one-byte tiles with `tiles.WIDEN_PTX`: generic conversions are slower than HBM delivers the bytes.
FAST_WIDEN = True


def _quiet_lowering_rule():
  """(register, rule) of a lowering that hides jax's deprecation warning (raised at jit time) for our kernels'
  `CompilerParams` only, or None without the jax internals it needs."""
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
  return _compiler_params_class(**kwargs)


_hook = _quiet_lowering_rule()
if _hook is not None:
  _hook[0](CompilerParams, _hook[1], "gpu")
  _compiler_params_class = CompilerParams
else:
  _compiler_params_class = pltr.CompilerParams


def _tile_range(length, split, st: Static, tiles_per_split, start):
  return split_plan.split_tile_range(length, split, block_kv=st.block_kv, num_queries=st.num_queries,
                                  num_splits=st.num_splits, window=st.options.window,
                                  tiles_per_split=tiles_per_split, start=start)


def _attend(r: Refs, *, head, row0, length, tiles, seq: tuple, st: Static, start):
  """One sequence's partial (out [block_rows, width] f32, lse [block_rows]) over tiles [t0, t1), masked outside
  [a, c)."""
  t0, a, c, t1 = tiles
  q = load_q(r, row0, seq, st)
  head_scales = head_scales_of(r, head, st)
  step = lambda masked: lambda tile, carry: tile_step(r, q, tile, carry, head_scales=head_scales, row0=row0,
                                                       length=length, seq=seq, masked=masked, st=st,
                                                       start=start)
  carry = initial_carry(st)
  for lo, hi, masked in split_plan.tile_loops(t0, t1, a, c, window=st.options.window, start=start):
    carry = lax.fori_loop(lo, hi, step(masked), carry)
  return finalize(*carry)


def _kernel(q_ref,
            k_ref,
            v_ref,
            lengths_ref,
            *refs, st: Static):
  r = Refs(q_ref, k_ref, v_ref, lengths_ref, refs, st)
  if st.stream_k:
    return stream_k.stream_k_kernel(r, st)
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  seq = ()
  if st.ordered:
    # Picked at run time: the per-sequence refs hold the whole batch, indexed by seq = (b,).
    b = jnp.clip(r.order[b], 0, lengths_ref.shape[0] - 1)
    seq = (b,)
  head = head_block // st.num_row_blocks
  row0 = first_row(head_block, st)
  length = jnp.clip(lengths_ref[b], 0, st.capacity)
  start = window_start_of(r, b, st)
  t0, t1, a, c = _tile_range(length, split, st, r.tiles_per_split, start)
  partial = _attend(r, head=head, row0=row0, length=length, tiles=(t0, a, c, t1), seq=seq, st=st, start=start)
  if not st.merge:
    out_ref, lse_ref = r.rest
    out, lse = partial
    store_rows(out_ref, seq, row0, out, st)
    pltr.store(lse_ref.at[(*seq, pl.ds(row0, st.block_rows))], lse, mask=real_rows(row0, st))
  else:
    _merge_epilogue(partial, r.rest, b=b, head=head, head_block=head_block, split=split, row0=row0,
                    length=length, tiles_per_split=r.tiles_per_split, st=st, start=start)


def _merge_epilogue(partial, refs, *, b, head, head_block, split, row0, length, tiles_per_split, st: Static,
                    start):
  """Merge mode: store this split's partial; the last split of a sequence to arrive merges them all."""
  outs = MergedOutputs(refs, row0=row0, st=st)
  if st.num_splits == 1:
    outs.write_one(b, head, *partial)
    return
  active = split_plan.active_splits(length, block_kv=st.block_kv, num_queries=st.num_queries,
                                 num_splits=st.num_splits, window=st.options.window,
                                 tiles_per_split=tiles_per_split, start=start)

  @pl.when((active <= 1) & (split == 0))
  def _():
    outs.write_one(b, head, *partial)

  @pl.when((active > 1) & (split < active))
  def _():
    outs.store_partial((b, head, split), partial)

    @pl.when(outs.arrive(b, head_block) == active - 1)
    def _():
      outs.merge(b, head, active, lambda j: (b, head, j))


def _build(st: Static, *, batch: int, num_kv_heads: int, kv_shape, table_width: int | None,
           num_warps: int, num_stages: int, dtype, interpret: bool, out_dtype=None):
  """The pallas_call of one static config. Merge mode also takes sinks [Hkv, R] (has_sinks) and zeroed
  counters [B, Hkv * nrb] (num_splits > 1, aliased to the last output) and returns (out [B, Hkv, R, D]
  out_dtype, [lse [B, Hkv, R]], [partials, their LSEs, counters]), whole-array blocks the programs index."""
  D, nrb, R = st.head_dim, st.num_row_blocks, st.block_rows
  head = lambda hb: hb // nrb
  whole = lambda shape: pl.BlockSpec(shape, lambda hb, s, b: (0,) * len(shape))

  def per_sequence(block, index):
    """One sequence's block, or the whole batch where the kernel picks sequences (no scalar prefetch)."""
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
  if st.options.has_window_start:
    in_specs.append(whole((batch,)))
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
    # The row blocks of a (sequence, kv head, split) each store their real rows into one block.
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
    name += "_streamk"
  if st.v_tokens_last:
    name += "_vt"
  if st.options.has_window_start:
    name += "_wstart"
  return pl.pallas_call(
      functools.partial(_kernel, st=st),
      # grid[0] varies fastest: the KV heads of one token range sit side by side in HBM.
      grid=(num_kv_heads * nrb, st.num_splits, 1 if st.stream_k else batch),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )


def _static(q, k, v, lengths, block_tables, *, num_queries: int, options: AttentionOptions, config: TritonConfig,
            plan: SplitPlan, k_scale, v_scale, interpret: bool, v_tokens_last=False, **merge) -> Static:
  frame.check_packed_args(q, k, v, lengths, block_tables, num_queries=num_queries, k_scale=k_scale,
                            v_scale=v_scale, v_tokens_last=v_tokens_last)
  _, _, R, D = q.shape
  if block_tables is None:
    page_size = max_pages = num_pages = None
    capacity = k.shape[1]
  else:
    num_pages, page_size, max_pages = k.shape[0], k.shape[1], block_tables.shape[1]
    capacity = page_size * max_pages
  triton_config.check_config(config, head_dim=D, page_size=page_size)
  plan.check(block_kv=config.block_kv, batch=q.shape[0])
  if plan.stream_k and not merge.get("merge"):
    raise ValueError("the stream-K plan merges its pieces in the launch: call decode_merged, not decode_partials")
  block_rows, num_row_blocks = triton_config.row_blocking(R, D)
  return Static(num_queries=num_queries, group=R // num_queries, block_rows=block_rows,
                 num_row_blocks=num_row_blocks, num_splits=plan.num_splits, capacity=capacity,
                 block_kv=config.block_kv, head_dim=D, page_size=page_size, max_pages=max_pages, num_pages=num_pages,
                 options=options,
                 k_scale=frame.scale_kind(k_scale, k.shape), v_scale=frame.scale_kind(v_scale, k.shape),
                 fast_widen=FAST_WIDEN and not interpret and jnp.dtype(k.dtype) in frame.QUANTIZED_DTYPES,
                 rows=R, balanced=plan.balanced, ordered=plan.ordered, stream_k=plan.stream_k,
                 v_tokens_last=v_tokens_last, operand_dtype=frame.compute_dtype(k.dtype), **merge)


def _call(st: Static, args, *, q, k, config: TritonConfig, interpret: bool, out_dtype=None):
  B, Hkv = q.shape[:2]
  call = _build(st, batch=B, num_kv_heads=Hkv, kv_shape=k.shape, table_width=st.max_pages,
                num_warps=config.num_warps, num_stages=config.num_stages, dtype=k.dtype, interpret=bool(interpret),
                out_dtype=out_dtype)
  return call_quietly(call, args)


def call_quietly(call, args):
  """call(*args) with jax's Pallas Triton deprecation warning hidden, for eager calls that lower here."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=DEPRECATION_MESSAGE, category=DeprecationWarning)
    return call(*args)


def _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan: SplitPlan, window_start, options) -> tuple:
  if (window_start is not None) != options.has_window_start:
    raise ValueError(f"window_start is given exactly when options.has_window_start; got "
                     f"{options.has_window_start=} and window_start {'None' if window_start is None else 'given'}")
  args = (q, k, v, lengths) + (() if window_start is None else (window_start.astype(jnp.int32),))
  args += plan.kernel_inputs()
  args += (block_tables,) if block_tables is not None else ()
  return args + tuple(scale for scale in (k_scale, v_scale) if scale is not None)


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                    config: TritonConfig, plan: SplitPlan, k_scale=None, v_scale=None, interpret: bool = False,
                    v_tokens_last: bool = False, window_start=None):
  """Split-K partials of decode attention over a contiguous or paged KV cache.

  q: [B, Hkv, R, D] bf16 / fp16, R = S * G rows (`frame.pack_queries`), S = num_queries; token s of sequence b
    sits at p = lengths[b] - S + s and sees keys p - window < t <= p. lengths: int32 [B], clamped into [0, capacity].
  k, v: dense [B, T, Hkv, D] or paged [P, page_size, Hkv, D] with block_tables int32 [B, max_pages]; with
    v_tokens_last v has k's dims 0, 2, 3, 1. q's dtype, or one-byte times k_scale / v_scale (float16 math):
    None, float32 [Hkv], or float32 per token and kv head shaped like the cache's first three dims.
  window_start: int32 [B] (given exactly when options.has_window_start): keys before it are invisible.
  config: a complete `TritonConfig`; plan: its `SplitPlan` (results are in batch order whatever plan.order).
  Returns (out [B, Hkv, num_splits, R, D] float32, each split's normalised output; lse [B, Hkv, num_splits, R]
  float32 natural log, -inf (out 0) where the split saw no key)."""
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config, plan=plan,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, v_tokens_last=v_tokens_last)
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan, window_start, options)
  return tuple(_call(st, args, q=q, k=k, config=config, interpret=interpret))


def decode_merged(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                  config: TritonConfig, plan: SplitPlan, sinks=None, k_scale=None, v_scale=None, out_dtype=None,
                  return_lse: bool = True, interpret: bool = False, v_tokens_last: bool = False, window_start=None):
  """`frame.merge_splits` of `decode_partials`' result in the same launch, up to float32 rounding, the bits
  independent of the order splits finish in. Extra arguments: sinks None or float32 [Hkv, R] (`frame.packed_sinks`),
  out_dtype (default q's). Returns (out [B, Hkv, R, D] out_dtype, lse [B, Hkv, R] float32 or None)."""
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config, plan=plan,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, v_tokens_last=v_tokens_last, merge=True,
               has_sinks=sinks is not None, write_lse=return_lse, barriers=not interpret)
  B, Hkv, R, _ = q.shape
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan, window_start, options)
  if sinks is not None:
    if sinks.shape != (Hkv, R):
      raise ValueError(f"sinks must be float32 [Hkv, R]=({Hkv}, {R}), got {sinks.shape=}")
    args += (sinks.astype(jnp.float32),)
  if st.num_splits > 1:
    args += (jnp.zeros((B, Hkv * st.num_row_blocks), jnp.int32),)
  outs = _call(st, args, q=q, k=k, config=config, interpret=interpret, out_dtype=out_dtype or q.dtype)
  return outs[0], outs[1] if return_lse else None
