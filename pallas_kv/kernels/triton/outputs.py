"""Merge mode's outputs (`TritonConfig.merge_in_kernel` and the stream-K plan): the final rows of a
(sequence, kv head) written directly from one partial, or stored as partials that the last to
arrive merges in a fixed order (`decode.py`'s module doc says why that is safe on the GPU)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.kernels import online_softmax
from pallas_kv.kernels.triton.tiles import Static
from pallas_kv.kernels.triton.tiles import real_rows

def _merge_finish(acc, norm, shift, sink):
  """`frame.merge_splits`' last step on one program's rows: acc = sum_j w_j out_j and
  norm = sum_j w_j with w_j = exp(lse_j - shift). Returns (out, lse over the real keys; 0 and
  -inf where there are none)."""
  has_keys = norm > 0
  lse = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)
  denom = norm if sink is None else norm + jnp.exp(sink - shift)
  return acc / online_softmax.per_row(jnp.where(has_keys, denom, 1.0), acc.shape), lse


class MergedOutputs:
  """Merge mode's outputs (module doc): the final rows of a (sequence, kv head), written directly
  from one partial or merged from several partials in a fixed order."""

  def __init__(self, refs, *, row0, st: Static):
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
    self.row_ok = real_rows(row0, st)
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
