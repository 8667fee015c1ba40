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
(`merge.merge_partials`, one launch; `frame.merge_splits` is its reference).

With `TritonConfig.merge_in_kernel` (`decode_merged`) the merge runs in the same launch: each
split of a sequence that has more than one split with tiles writes its partial, then bumps the
(sequence, kv head, row block) counter with an acq_rel atomic; the split that sees every other
split arrived (old count = active splits - 1) reads all partials back in split order, merges
them as `frame.merge_splits` does (sinks included) and writes the output rows in the output
dtype. A sequence whose tiles fit one split has its split 0 write the output directly.

With `TritonConfig(split_plan="stream_k")` (merge mode only) the grid is num_splits programs per
(kv head, row block) instead, each streaming an equal share of the whole batch's tiles laid end
to end across sequence boundaries (`stream_k.py`); a sequence cut across programs is merged by
the counter as above (the last piece merges the pieces in program order).

The kernel body's pieces (tile loads, the online-softmax step per tile) are in `tiles.py`, merge
mode's outputs in `outputs.py`.

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
from pallas_kv.config import TritonConfig
from pallas_kv.kernels import online_softmax
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import stream_k
from pallas_kv.kernels.triton.outputs import MergedOutputs
from pallas_kv.kernels.triton.tiles import Refs
from pallas_kv.kernels.triton.tiles import Static
from pallas_kv.kernels.triton.tiles import first_row
from pallas_kv.kernels.triton.tiles import head_scales_of
from pallas_kv.kernels.triton.tiles import initial_carry
from pallas_kv.kernels.triton.tiles import load_q
from pallas_kv.kernels.triton.tiles import real_rows
from pallas_kv.kernels.triton.tiles import tile_step

DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"
# Widen one-byte cache tiles to float16 with a few integer instructions per 4 values
# rather than the generic int/float conversions, whose throughput (16 per clock per SM) is less
# than HBM delivers one-byte values at (`tiles.WIDEN_PTX`). Interpret mode always takes the
# generic path.
FAST_WIDEN = True


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

def _tile_range(length, split, st: Static, tiles_per_split):
  """This split's tiles [t0, t1) and the unmasked sub-range [a, c) (`plan.split_tile_range`)."""
  return split_plan.split_tile_range(length, split, block_kv=st.block_kv, num_queries=st.num_queries,
                                  num_splits=st.num_splits, window=st.options.window,
                                  tiles_per_split=tiles_per_split)


def _attend(r: Refs, *, head, row0, length, tiles, seq: tuple, st: Static):
  """One sequence's attention over its tiles (t0, a, c, t1) for this program's rows: the
  softmax-normalised partial (out [block_rows, D] f32, natural-log lse [block_rows]) of tiles
  [t0, t1), masked in [t0, a) and [c, t1) (`plan.unmasked_tiles`). `seq` is (b,) where the
  per-sequence refs hold the whole batch."""
  t0, a, c, t1 = tiles
  q = load_q(r, row0, seq, st)
  head_scales = head_scales_of(r, head, st)
  step = lambda masked: lambda tile, carry: tile_step(r, q, tile, carry, head_scales=head_scales, row0=row0,
                                                       length=length, seq=seq, masked=masked, st=st)
  carry = lax.fori_loop(t0, a, step(True), initial_carry(st))
  carry = lax.fori_loop(a, c, step(False), carry)
  carry = lax.fori_loop(c, t1, step(True), carry)
  return online_softmax.finalize(*carry)


def _kernel(q_ref,            # [R, D] packed rows of this (sequence, kv head), unpadded
            k_ref,            # [T, D] | [P, page_size, D]   this kv head, cache dtype
            v_ref,            # same as k_ref
            lengths_ref,      # [B] int32
            *refs, st: Static):
  r = Refs(q_ref, k_ref, v_ref, lengths_ref, refs, st)
  if st.stream_k:
    return stream_k.stream_k_kernel(r, st)
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  seq = ()
  if st.ordered:
    # The sequence is chosen at run time, so its refs hold the whole batch (`_build`): every
    # access to them puts b first in its one indexer.
    b = jnp.clip(r.order[b], 0, lengths_ref.shape[0] - 1)
    seq = (b,)
  head = head_block // st.num_row_blocks
  row0 = first_row(head_block, st)
  length = jnp.clip(lengths_ref[b], 0, st.capacity)
  t0, t1, a, c = _tile_range(length, split, st, r.tiles_per_split)
  partial = _attend(r, head=head, row0=row0, length=length, tiles=(t0, a, c, t1), seq=seq, st=st)
  if not st.merge:
    out_ref, lse_ref = r.rest   # [R, D] f32, [R] f32 of this split: the real rows only
    out, lse = partial
    row_ok = real_rows(row0, st)
    pltr.store(out_ref.at[(*seq, pl.ds(row0, st.block_rows), slice(None))], out,
               mask=jnp.broadcast_to(row_ok[:, None], (st.block_rows, st.head_dim)))
    pltr.store(lse_ref.at[(*seq, pl.ds(row0, st.block_rows))], lse, mask=row_ok)
  else:
    _merge_epilogue(partial, r.rest, b=b, head=head, head_block=head_block, split=split, row0=row0,
                    length=length, tiles_per_split=r.tiles_per_split, st=st)


def _merge_epilogue(partial, refs, *, b, head, head_block, split, row0, length, tiles_per_split, st: Static):
  """Merge mode: write this split's partial and let the last split to arrive merge them all
  (module doc); a sequence with at most one split with tiles has its split 0 write directly."""
  outs = MergedOutputs(refs, row0=row0, st=st)
  if st.num_splits == 1:
    outs.write_one(b, head, *partial)
    return
  active = split_plan.active_splits(length, block_kv=st.block_kv, num_queries=st.num_queries,
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


def _build(st: Static, *, batch: int, num_kv_heads: int, kv_shape, table_width: int | None,
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
      # Stream-K: two partial slots per program (`StreamKLayout.piece_slot`).
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


def _static(q, k, v, lengths, block_tables, *, num_queries: int, options: AttentionOptions, config: TritonConfig,
            plan: SplitPlan, k_scale, v_scale, interpret: bool, v_tokens_last=False, **merge) -> Static:
  """The checked static description of one call (`decode_partials`' arguments)."""
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
                 v_tokens_last=v_tokens_last, **merge)


def _call(st: Static, args, *, q, k, config: TritonConfig, interpret: bool, out_dtype=None):
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


def _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan: SplitPlan) -> tuple:
  args = (q, k, v, lengths) + plan.kernel_inputs()
  args += (block_tables,) if block_tables is not None else ()
  return args + tuple(scale for scale in (k_scale, v_scale) if scale is not None)


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                    config: TritonConfig, plan: SplitPlan, k_scale=None, v_scale=None, interpret: bool = False,
                    v_tokens_last: bool = False):
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
  config: a complete `TritonConfig` (`config.resolve_config`), checked here by `config.check_config`.
    Its merge_in_kernel is not read here: `decode_merged` is that kernel.
  plan: the call's `SplitPlan` (`plan.make_plan`): the split count, the balanced plan's tiles per
    split, and the order in which batch slot i of the grid takes sequence plan.order[i].
    Results are indexed by sequence either way.
  interpret: run the kernel in Pallas interpret mode (CPU).
  v_tokens_last: v is [B, Hkv, D, T] (paged [P, Hkv, D, page_size]): k's dims 0, 2, 3, 1.

  Returns (out [B, Hkv, num_splits, R, D] float32, each split's softmax-normalised output;
  lse [B, Hkv, num_splits, R] float32, natural-log sum-exp of the split's logits, -inf (and out
  0) where the split saw no valid key). logits = scale * q.k, then softcap * tanh(logits /
  softcap) if softcap. Tokens at or past lengths[b] are never read as values (masked loads).
  """
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config, plan=plan,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, v_tokens_last=v_tokens_last)
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan)
  return tuple(_call(st, args, q=q, k=k, config=config, interpret=interpret))


def decode_merged(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                  config: TritonConfig, plan: SplitPlan, sinks=None, k_scale=None, v_scale=None, out_dtype=None,
                  return_lse: bool = True, interpret: bool = False, v_tokens_last: bool = False):
  """Decode attention with the split merge in the same launch (`TritonConfig.merge_in_kernel`;
  the module doc says how the last split of a sequence merges and why that is safe).

  Arguments as `decode_partials`, plus sinks: None or float32 [Hkv, R], the sink logit of each
  packed row (`frame.packed_sinks`), which joins the denominator only; out_dtype: the output's
  dtype (q's by default).

  Returns (out [B, Hkv, R, D] out_dtype, lse [B, Hkv, R] float32 over the real keys, -inf where
  there are none; None unless return_lse): what `frame.merge_splits` makes of
  `decode_partials`' result, up to float32 rounding (the sum over splits runs in another order,
  and exp / log are the kernel's own). For a fixed num_splits the bits depend only on each
  sequence's own inputs, never on the order in which its splits finish.
  """
  st = _static(q, k, v, lengths, block_tables, num_queries=num_queries, options=options, config=config, plan=plan,
               k_scale=k_scale, v_scale=v_scale, interpret=interpret, v_tokens_last=v_tokens_last, merge=True,
               has_sinks=sinks is not None, write_lse=return_lse, barriers=not interpret)
  B, Hkv, R, _ = q.shape
  args = _args(q, k, v, lengths, block_tables, k_scale, v_scale, plan)
  if sinks is not None:
    if sinks.shape != (Hkv, R):
      raise ValueError(f"sinks must be float32 [Hkv, R]=({Hkv}, {R}), got {sinks.shape=}")
    args += (sinks.astype(jnp.float32),)
  if st.num_splits > 1:
    args += (jnp.zeros((B, Hkv * st.num_row_blocks), jnp.int32),)   # one counter per program group: a memset
  outs = _call(st, args, q=q, k=k, config=config, interpret=interpret, out_dtype=out_dtype or q.dtype)
  return outs[0], outs[1] if return_lse else None
