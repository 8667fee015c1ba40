"""Merge mode's outputs (`TritonConfig.merge_in_kernel` and the stream-K plan): the final rows of a
(sequence, kv head) written from one partial, or stored as partials that the last to arrive, counted by an
atomic (`MergedOutputs.arrive`), merges in a fixed order."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv import online_softmax
from pallas_kv.kernels.triton.tiles import Static
from pallas_kv.kernels.triton.tiles import load_rows
from pallas_kv.kernels.triton.tiles import real_rows
from pallas_kv.kernels.triton.tiles import store_rows
from pallas_kv.kernels.triton.tiles import zero_rows

def _merge_finish(acc: tuple, norm, shift, sink):
  """`frame.merge_splits`' last step: acc = sum_j w_j out_j (in column pieces), norm = sum_j w_j,
  w_j = exp(lse_j - shift)."""
  has_keys = norm > 0
  lse = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)
  denom = norm if sink is None else norm + jnp.exp(sink - shift)
  denom = jnp.where(has_keys, denom, 1.0)
  return tuple(piece / online_softmax.per_row(denom, piece.shape) for piece in acc), lse


class MergedOutputs:
  """Merge mode's output and partial refs of one program's rows (module doc)."""

  def __init__(self, refs, *, row0, st: Static):
    refs = list(refs)
    sinks_ref = refs.pop(0) if st.has_sinks else None
    if st.num_splits > 1:
      refs.pop(0)   # the zeroed counters input, aliased to the counters output
    self.out = refs.pop(0)
    self.lse = refs.pop(0) if st.write_lse else None
    # partials [B, Hkv, splits, R(, D)] (stream-K [Hkv, programs, 2, R(, D)]), counters [B, Hkv * nrb]
    self.partials = tuple(refs) if st.num_splits > 1 else None
    self.row0 = row0
    self.row_ok = real_rows(row0, st)
    self.rows = pl.ds(row0, st.block_rows)
    self.sink = None if sinks_ref is None else pltr.load(sinks_ref.at[self.rows], mask=self.row_ok, other=0.0)
    self.st = st

  def write(self, b, head, out, lse):
    store_rows(self.out, (b, head), self.row0, out, self.st)
    if self.lse is not None:
      pltr.store(self.lse.at[b, head, self.rows], lse, mask=self.row_ok)

  def write_one(self, b, head, out, lse):
    shift = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = jnp.exp(lse - shift)
    out = tuple(piece * online_softmax.per_row(weight, piece.shape) for piece in out)
    self.write(b, head, *_merge_finish(out, weight, shift, self.sink))

  def store_partial(self, index, partial):
    part_out, part_lse = self.partials[:2]
    store_rows(part_out, index, self.row0, partial[0], self.st)
    pltr.store(part_lse.at[(*index, self.rows)], partial[1], mask=self.row_ok)

  def arrive(self, b, head_block):
    """Bumps the (sequence, head block) counter with an acq_rel gpu-scope atomic; returns the partials before.

    A CTA barrier before orders every thread's stores before the cumulative release; the counter's RMWs form one
    release sequence, so the last arriver's acquire sees every partial; a barrier after orders it before all
    threads' loads. Interpret mode runs programs one by one and needs no barriers."""
    counts = self.partials[2]
    if self.st.barriers:
      pltr.debug_barrier()
    arrived = pltr.atomic_add(counts, (b, head_block), jnp.int32(1))
    if self.st.barriers:
      pltr.debug_barrier()
    return arrived

  def merge(self, b, head, count, index_of):
    """Merges `count` partials, j at index_of(j), in order j = 0, 1, ...: the same bits whatever their arrival."""
    part_out, part_lse = self.partials[:2]
    br = self.st.block_rows
    lse_of = lambda j: pltr.load(part_lse.at[(*index_of(j), self.rows)], mask=self.row_ok, other=-jnp.inf)
    shift = lax.fori_loop(0, count, lambda j, m: jnp.maximum(m, lse_of(j)), jnp.full((br,), -jnp.inf, jnp.float32))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)

    def add(j, carry):
      acc, norm = carry
      weight = jnp.exp(lse_of(j) - shift)
      out = load_rows(part_out, index_of(j), self.row0, self.st)
      acc = tuple(a + piece * online_softmax.per_row(weight, piece.shape) for a, piece in zip(acc, out))
      return acc, norm + weight

    acc, norm = lax.fori_loop(0, count, add, (zero_rows(self.st), jnp.zeros((br,), jnp.float32)))
    self.write(b, head, *_merge_finish(acc, norm, shift, self.sink))
