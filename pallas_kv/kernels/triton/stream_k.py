"""The stream-K kernel body: num_splits programs per (kv head, row block), each streaming an equal share of
the batch's tiles laid end to end (`stream_k_plan.StreamKLayout`) in one loop across sequence boundaries, so
the pipeline never drains (docs/decisions.md#stream-k-one-loop). A segment's last tile writes a whole sequence,
or stores a cut piece; the last piece's program merges them after the loop, keeping the loop innermost."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kv import online_softmax
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.triton.stream_k_plan import StreamKLayout
from pallas_kv.kernels.triton.stream_k_plan import pick
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton.outputs import MergedOutputs
from pallas_kv.kernels.triton.tiles import Refs
from pallas_kv.kernels.triton.tiles import Static
from pallas_kv.kernels.triton.tiles import first_row
from pallas_kv.kernels.triton.tiles import head_scales_of
from pallas_kv.kernels.triton.tiles import initial_carry
from pallas_kv.kernels.triton.tiles import load_q
from pallas_kv.kernels.triton.tiles import tile_step
from pallas_kv.kernels.triton.tiles import window_start_of
from pallas_kv.kernels.triton.tiles import zero_rows
from pallas_kv.kernels.triton.tiles import finalize


def stream_k_kernel(r: Refs, st: Static):
  """Program (head block, w): its share's tile loop, then the merges that fell to it, then empty sequences."""
  head_block, w = pl.program_id(0), pl.program_id(1)
  head = head_block // st.num_row_blocks
  row0 = first_row(head_block, st)
  batch = r.lengths.shape[0]
  padded = triton_config.next_pow2(batch)
  index = jnp.arange(padded, dtype=jnp.int32)
  lengths = jnp.where(index < batch, jnp.clip(r.lengths[jnp.minimum(index, batch - 1)], 0, st.capacity), 0)
  starts = window_start_of(r, jnp.minimum(index, batch - 1), st)
  plan = StreamKLayout.of(lengths, block_kv=st.block_kv, num_queries=st.num_queries,
                                  window=st.options.window, num_programs=st.num_splits, start=starts)
  lo, hi = plan.program_range(w)
  outs = MergedOutputs(r.rest, row0=row0, st=st)
  head_scales = head_scales_of(r, head, st)
  no_merge = jnp.int32(-1)

  def step(g, carry):
    softmax_carry, merge_first, merge_last = carry
    b, seq_start = plan.locate(g)
    b = jnp.minimum(b, batch - 1)
    length = jnp.clip(r.lengths[b], 0, st.capacity)
    start = window_start_of(r, b, st)
    first, end = split_plan.visible_tiles(length, block_kv=st.block_kv, num_queries=st.num_queries,
                                       window=st.options.window, start=start)
    seq_end = seq_start + jnp.maximum(end - first, 0)
    segment_start = jnp.maximum(seq_start, lo)
    softmax_carry = jax.tree.map(lambda fresh, x: jnp.where(g == segment_start, fresh, x), initial_carry(st),
                                 softmax_carry)
    # q reloads per tile (from L2, small beside a KV tile): pipelined with it, not stalled at segment starts.
    q = load_q(r, row0, (b,), st)
    softmax_carry = tile_step(r, q, first + (g - seq_start), softmax_carry, head_scales=head_scales, row0=row0,
                               length=length, seq=(b,), masked=True, st=st, start=start)
    segment_ends = (g + 1 == seq_end) | (g + 1 == hi)
    if st.num_splits == 1:   # one program per head block: every sequence lies in it whole
      pl.when(segment_ends)(lambda: outs.write_one(b, head, *finalize(*softmax_carry)))
      return softmax_carry, merge_first, merge_last
    _, pieces, _ = plan.pieces_of_span(seq_start, seq_end)
    pl.when(segment_ends & (pieces == 1))(
        lambda: outs.write_one(b, head, *finalize(*softmax_carry)))

    def store_and_arrive():
      slot = StreamKLayout.piece_slot(segment_start != lo, segment_start == seq_start)
      outs.store_partial((head, w, slot), finalize(*softmax_carry))
      return outs.arrive(b, head_block)

    cut = segment_ends & (pieces > 1)
    arrived = lax.cond(cut, store_and_arrive, lambda: no_merge)
    merges = cut & (arrived == pieces - 1)   # the last piece to arrive: this program merges b
    merge_first = jnp.where(merges & (segment_start == lo), b, merge_first)
    merge_last = jnp.where(merges & (segment_start != lo), b, merge_last)
    return softmax_carry, merge_first, merge_last

  _, merge_first, merge_last = lax.fori_loop(lo, hi, step, (initial_carry(st), no_merge, no_merge))
  if st.num_splits > 1:
    for b in (merge_first, merge_last):
      @pl.when(b >= 0)
      def _():
        first_program, pieces, starts_mid_chunk = plan.pieces(b)
        slot = lambda j: StreamKLayout.piece_slot(starts_mid_chunk, j == 0)
        outs.merge(b, head, pieces, lambda j: (head, first_program + j, slot(j)))
  _write_empty_sequences(outs, plan, head=head, w=w, batch=batch, st=st)


def _write_empty_sequences(outs, plan, *, head, w, batch: int, st: Static):
  """Zeros and lse -inf for the sequences without tiles, sequence b by program b % programs."""

  def write_empty(j, carry):
    b = w + j * st.num_splits

    @pl.when((b < batch) & (pick(plan.tiles, b) == 0))
    def _():
      outs.write_one(b, head, zero_rows(st),
                     jnp.full((st.block_rows,), -jnp.inf, jnp.float32))
    return carry

  lax.fori_loop(0, split_plan.cdiv(batch, st.num_splits), write_empty, 0)
