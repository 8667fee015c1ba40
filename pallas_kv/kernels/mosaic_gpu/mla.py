"""Split-K MLA decode (DeepSeek's absorbed form) on Mosaic GPU: one latent KV head, paged.

kv_pages [P, page_size, Dqk]: keys are whole rows, values their first Dv columns. The packed rows (S new tokens x
Hq heads) are cut into blocks of 64 (wgmma M); a token range's row blocks launch together, so the second reads its
tiles mostly from L2 (docs/decisions.md#mla-grid-order). Three warpgroups per program:
  producer  TMA-copies each KV tile [bkv, Dqk] once into an SMEM ring (`pipeline.Ring`);
  scorer    S = Q K^T, the masked online softmax, P and the rescale alpha to the partner (`SharedP`), and
            O[:, :Dv/2] += P V with P from its registers (docs/decisions.md#mla-p-in-registers);
  partner   O[:, Dv/2:] = alpha O[:, Dv/2:] + P V, overlapping the scorer's next tile.
Split by value columns, the f32 accumulator fits each consumer's registers (FlashMLA's plan); V is the K tile
itself. Other schedules are experimental variants (docs/decisions.md#mla-schedules). Values past a sequence's
length are masked, their value rows zeroed in SMEM before either P V. Each split writes its normalised partial and LSE.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.config import MosaicMLAConfig
from pallas_kv.kernels import online_softmax
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu.mla_config import ROWS, VALUE_WGS, Codegen, MlaSmem, check_config, row_blocks
from pallas_kv.kernels.mosaic_gpu.mla_config import schedule_of
from pallas_kv.kernels.mosaic_gpu.mla_output import ProgramOutput
from pallas_kv.kernels.mosaic_gpu.mla_tiles import Scores, SharedP, Static, TileMath, add_pv, start_state, zero_row

SCORER, PARTNER, PRODUCER = 0, 1, 2
LSE_ROW_MULTIPLE = 4   # TMA stores need 16-byte rows: the lse output is padded to 4 float32 rows


def _score_tiles(scores: Scores, shared: SharedP, ring: pipeline.Ring, t0, t1, c, *, length, row0,
                 st: Static):
  """The scorer's loop over tiles [t0, t1) ([c, t1) masked): returns (acc, m, l). pipeline_qk issues
  tile i+1's Q K^T before tile i's softmax (the last step re-scores its own tile, still held)."""
  s_type = plgpu.ACC((ROWS, st.tiling.block_kv), jnp.float32)

  def finish(s, tile, acc, m_i, l_i, values, masked):
    alpha, m_new, l_new, p = st.tile_math.softmax(s, m_i, l_i, tile=tile, length=length, row0=row0, masked=masked,
                                                  st=st)
    p16, acc = p.astype(st.smem.dtype), acc * online_softmax.per_row(alpha, acc.shape)
    publish = functools.partial(shared.publish, p16, alpha, wait_free=tile > t0)
    if st.p_in_registers and not st.interpret:   # the hand-over while the tensor cores run P V
      return add_pv(acc, [(p16, values)], st, meanwhile=publish), m_new, l_new
    publish()
    return add_pv(acc, [(shared.p, values)], st), m_new, l_new

  def first_values(slot):
    return slot.at[:, pl.ds(0, st.half_v)]

  acc, m_i, l_i = start_state((ROWS, st.half_v))

  if not st.pipeline_qk:
    def step(tile, carry, *, masked: bool):
      i = tile - t0

      def qk(s_ref):
        scores.start_from(s_ref, ring, i, tile)
        return s_ref[...]

      s = pl.run_scoped(qk, s_type)
      if st.ring_halves:
        if masked:
          scores.zero_past_parts(ring, i, tile)
        carry = finish(s, tile, *carry, ring.slot(i, 0), masked)
      else:
        carry = finish(s, tile, *carry, first_values(ring.slot(i)), masked)
      if not st.tile_math.wait_for_loads:
        ring.wait(i)
      ring.release(i, part=0 if st.ring_halves else None)
      return carry

    carry = (acc, m_i, l_i)
  else:
    def first(s_ref):
      @pl.when(t1 > t0)
      def _():
        scores.start(s_ref, t0, ring.wait(0))
      return s_ref[...]

    def step(tile, carry, *, masked: bool):
      acc, m_i, l_i, s = carry
      i = tile - t0
      has_next = tile + 1 < t1

      @pl.when(has_next)
      def _():
        ring.wait(i + 1)

      scored = jnp.where(has_next, tile + 1, tile)

      def body(s_ref):
        scores.start(s_ref, scored, ring.slot(scored - t0))
        return (*finish(s, tile, acc, m_i, l_i, first_values(ring.slot(i)), masked), s_ref[...])

      carry = pl.run_scoped(body, s_type)
      ring.release(i)
      return carry

    carry = (acc, m_i, l_i, pl.run_scoped(first, s_type))

  carry = lax.fori_loop(t0, c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(c, t1, functools.partial(step, masked=True), carry)
  return carry[:3]


@dataclasses.dataclass(frozen=True)
class _HalfSync:
  """split_scores: what the consumers trade per tile. rows [2, 64] f32: consumer w's row max of its half
  (after the loop, its row sum); p[w]: its half of P [64, bkv/2]. Barriers (two arrivals; both consumers
  wait on every phase): max_ready, p_ready (P halves and a last tile's zeroed values in), p_free."""
  rows: Any
  p: Any
  max_ready: Any
  p_ready: Any
  p_free: Any

  def meet(self, barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _score_half_tiles(w: int, q_smem, sync: _HalfSync, ring: pipeline.Ring, t0, t1, c, *, length, row0,
                      st: Static):
  """split_scores: consumer w scores its half of each tile's keys, shares the row max, and adds both
  halves of P times its value columns. Returns (acc [64, Dv/2], m, l over its half of the keys)."""
  hk, bkv = st.smem.half_kv, st.tiling.block_kv
  s_type = plgpu.ACC((ROWS, hk), jnp.float32)
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  columns = pl.ds(w * st.half_v, st.half_v)

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    i = tile - t0
    slot = ring.wait(i)

    def qk(s_ref):
      st.tile_math.qk(s_ref, q_smem, slot.at[pl.ds(w * hk, hk)].transpose((1, 0)))
      return s_ref[...]

    s = online_softmax.log2_logits(pl.run_scoped(qk, s_type), scale=st.scale, softcap=None)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * bkv + w * hk, length=length,
                                  num_queries=st.num_queries, group=st.group, window=None)
      s = jnp.where(ok, s, -jnp.inf)
    half_max = s.max(axis=1)
    sync.rows[w] = half_max
    sync.meet(sync.max_ready)
    tile_max = jnp.maximum(half_max, plgpu.load(sync.rows.at[1 - w], layout=rows_layout))
    alpha, m_new, l_new, p = online_softmax.rescale_step(s, m_i, l_i, tile_max=tile_max)
    if masked and w == 0:
      valid_rows = length - tile * bkv

      @pl.when(valid_rows < bkv)
      def _():
        tiling.zero_rows_past(slot, valid_rows, width=st.smem.v_dim)

    @pl.when(tile > t0)
    def _():
      plgpu.barrier_wait(sync.p_free)   # the other consumer's P V of the previous tile is done

    sync.p[w][...] = p.astype(st.smem.dtype)
    plgpu.commit_smem()   # P (and zeroed values), read next by wgmma
    sync.meet(sync.p_ready)
    parts = [(sync.p[j], slot.at[pl.ds(j * hk, hk), columns]) for j in range(VALUE_WGS)]
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape), parts, st)
    plgpu.barrier_arrive(sync.p_free)
    ring.release(i)
    return acc, m_new, l_new

  carry = start_state((ROWS, st.half_v))
  carry = lax.fori_loop(t0, c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(c, t1, functools.partial(step, masked=True), carry)

  @pl.when(t1 > t0)
  def _():
    plgpu.barrier_wait(sync.p_free)   # the last tile's phase
  return carry


def _partner_tiles(shared: SharedP, ring: pipeline.Ring, t0, t1, st: Static):
  """The partner's loop: alpha acc + P V for the second half of the value columns, per tile."""
  rows_axis = 1 if st.rows_as_n else 0
  shape = (st.half_v, st.rows_as_n) if st.rows_as_n else (ROWS, st.half_v)

  part = 1 if st.ring_halves else None   # its value half (after the scorer's Q K^T of the tile)
  first_column = 0 if st.ring_halves else st.half_v

  def step(tile, acc):
    i = tile - t0
    slot = ring.wait(i, part) if st.tile_math.wait_for_loads else ring.slot(i, part)
    alpha = shared.receive()
    values = slot.at[:, pl.ds(first_column, st.half_v)]
    parts = [(values.transpose((1, 0)), shared.p)] if st.rows_as_n else [(shared.p, values)]
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape, rows_axis), parts, st)
    shared.hand_back()
    if not st.tile_math.wait_for_loads:
      ring.wait(i, part)
    ring.release(i, part=part)
    return acc

  return lax.fori_loop(t0, t1, step, plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))


def _own_pv(acc, p16, values, st: Static, meanwhile=None):
  """acc + P V with P from registers (a plain dot in interpret mode); meanwhile() runs during it."""
  if st.interpret:
    if meanwhile is not None:
      meanwhile()
    return acc + jnp.dot(p16, values[...], preferred_element_type=jnp.float32)
  return add_pv(acc, [(p16, values)], st, meanwhile=meanwhile)


def _alternate_consumer(w: int, scores: Scores, ring: pipeline.Ring, p_smem, row_smem, p_ready, max_ready, p_free,
                        t0, t1, c, *, length, row0, st: Static):
  """alternate_scores (FlashMLA's seesaw): per pair of tiles (a, b), consumer 0 scores a and consumer 1 b;
  each adds P V of both for its value columns w. Consumer 0 puts a's max and rescale in rows 0, 1
  (max_ready[0]); consumer 1 scores b from them and puts b's in rows 2, 3 (max_ready[1]). Each reads its
  own P from registers, the other's from the one SMEM buffer: b's first (p_ready[1]), then a's rescaled to
  b's max (p_ready[0]). Each writer's own P V has read the buffer's previous P, so only an odd last tile
  needs p_free. With ring_halves consumer w alone reads and releases column part w.
  """
  n = t1 - t0
  pairs, has_tail = n // 2, n % 2
  columns = pl.ds(w * st.half_v, st.half_v)
  s_type = plgpu.ACC((ROWS, st.tiling.block_kv), jnp.float32)

  def rows(i):
    return tuple(plgpu.load(row_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(1)) for j in (i, i + 1))

  def rescaled(acc, factor):
    return acc * online_softmax.per_row(factor, acc.shape)

  def values(step):
    if st.ring_halves:
      return ring.slot(step, w).at[:, pl.ds(0, st.half_v)]
    return ring.slot(step).at[:, columns]

  def release(step):
    ring.release(step, part=w if st.ring_halves else None, read_by_registers=st.interpret)

  def other_p(acc, step, ready):
    """acc + (the other's P in SMEM) V of step's tile for columns w; then the slot is released."""
    plgpu.barrier_wait(ready)
    acc = add_pv(acc, [(p_smem, values(step))], st)
    release(step)
    return acc

  def score(step, masked, meanwhile=lambda: None):
    def qk(s_ref):
      scores.start_from(s_ref, ring, step, t0 + step)
      result = meanwhile()
      return s_ref[...], result

    s, result = pl.run_scoped(qk, s_type)
    if st.ring_halves and masked:
      scores.zero_past_parts(ring, step, t0 + step)
    return s, result

  def softmax(s, step, m_i, l_i, masked):
    return st.tile_math.softmax(s, m_i, l_i, tile=t0 + step, length=length, row0=row0, masked=masked, st=st)

  def first(k, carry, *, masked: bool, second: bool):
    """Consumer 0, pair k: tile a; with a second tile, b's P from consumer 1; a's P to consumer 1."""
    acc, m_i, l_i = carry
    a = scores.ring_step(2 * k)
    s, _ = score(a, masked)
    scale_a, m_a, l_i, p = softmax(s, a, m_i, l_i, masked)
    row_smem[0], row_smem[1] = m_a, scale_a
    plgpu.barrier_arrive(max_ready.at[0])
    acc = _own_pv(rescaled(acc, scale_a), p.astype(st.smem.dtype), values(a), st)
    release(a)
    if second:
      plgpu.barrier_wait(max_ready.at[1])
      m_a, scale_b = rows(2)   # from here on the pair's max, b's
      acc = other_p(rescaled(acc, scale_b), a + 1, p_ready.at[1])
      p, l_i = p * online_softmax.per_row(scale_b, p.shape), l_i * scale_b
    else:
      @pl.when(pairs > 0)
      def _():
        plgpu.barrier_wait(p_free)   # consumer 1 is done with the last pair's P
    p_smem[...] = p.astype(st.smem.dtype)
    plgpu.commit_smem()   # read next by consumer 1's wgmma
    plgpu.barrier_arrive(p_ready.at[0])
    return acc, m_a, l_i

  def second(k, carry, *, masked: bool, second: bool):
    """Consumer 1, pair k: with a second tile, b from a's max and its P to consumer 0; then a's P."""
    acc, _, l_i = carry
    a = scores.ring_step(2 * k)

    def max_of_a():
      plgpu.barrier_wait(max_ready.at[0])
      return rows(0)

    if not second:
      m, scale_a = max_of_a()
      return other_p(rescaled(acc, scale_a), a, p_ready.at[0]), m, l_i * scale_a
    s, (m_a, scale_a) = score(a + 1, masked, max_of_a)
    scale_b, m, l_i, p = softmax(s, a + 1, m_a, l_i * scale_a, masked)
    row_smem[2], row_smem[3] = m, scale_b
    plgpu.barrier_arrive(max_ready.at[1])
    p16 = p.astype(st.smem.dtype)

    def publish():
      p_smem[...] = p16
      plgpu.commit_smem()   # read next by consumer 0's wgmma
      plgpu.barrier_arrive(p_ready.at[1])

    acc = _own_pv(rescaled(acc, scale_a * scale_b), p16, values(a + 1), st, meanwhile=publish)
    release(a + 1)
    return other_p(acc, a, p_ready.at[0]), m, l_i

  pair = (first, second)[w]
  unmasked = jnp.minimum(pairs, jnp.maximum(c - t0, 0) // 2)   # pairs with both tiles before c
  carry = start_state((ROWS, st.half_v))
  for lo, hi, masked in ((0, unmasked, False), (unmasked, pairs, True)):
    carry = lax.fori_loop(lo, hi, lambda k, cr, masked=masked: pair(k, cr, masked=masked, second=True), carry)
  if w == 1:
    @pl.when((has_tail == 1) & (pairs > 0))
    def _():
      plgpu.barrier_arrive(p_free)   # its last P V is done with consumer 0's last P
  return lax.fori_loop(0, has_tail, lambda k, cr: pair(pairs, cr, masked=True, second=False), carry)


def _score_tiles_as_n(scores: Scores, shared: SharedP, ring: pipeline.Ring, t0, t1, c, *, length,
                      st: Static):
  """The scorer with rows as N: S^T = K Q^T [bkv, N], softmax over keys, P^T to the partner, O^T += V^T P^T."""
  n, bkv = st.rows_as_n, st.tiling.block_kv
  s_type = plgpu.ACC((bkv, n), jnp.float32)

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    i = tile - t0
    slot = ring.wait(i)

    def qk(s_ref):
      scores.start(s_ref, tile, slot)
      return s_ref[...]

    alpha, m_new, l_new, p = st.tile_math.softmax(pl.run_scoped(qk, s_type), m_i, l_i, tile=tile, length=length,
                                                  row0=0, masked=masked, st=st)
    shared.publish(p.astype(st.smem.dtype), alpha, wait_free=tile > t0)
    values = slot.at[:, pl.ds(0, st.half_v)].transpose((1, 0))
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape, 1), [(values, shared.p)], st)
    ring.release(i)
    return acc, m_new, l_new

  carry = start_state((st.half_v, n), rows_axis=1)
  carry = lax.fori_loop(t0, c, functools.partial(step, masked=False), carry)
  return lax.fori_loop(c, t1, functools.partial(step, masked=True), carry)


def _rows_as_n_consumers(wg, q_ref, q_block, q_barrier, ring: pipeline.Ring, shared: SharedP, row_smem,
                         output: ProgramOutput, *, b, t0, t1, c, length, st: Static):
  """The scorer and partner with rows as N: each stores its half of O^T into out [B, splits, Dv, N]."""

  @pl.when(wg == SCORER)
  def _scorer():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    plgpu.copy_gmem_to_smem(q_ref.at[b], q_block.at[0], q_barrier)   # q [B, N, Dqk]: every row
    plgpu.barrier_wait(q_barrier)
    scores = Scores(q_block=q_block, length=length, st=st, q_index=zero_row(row_smem, SCORER, st))
    acc, m_i, l_i = _score_tiles_as_n(scores, shared, ring, t0, t1, c, length=length, st=st)

    @pl.when(t1 > t0)
    def _():
      plgpu.barrier_wait(shared.free)   # the partner's last P V: observe every phase of the barrier

    row_smem[1] = l_i
    output.meet()
    output.store(0, *online_softmax.finalize(acc, m_i, l_i, rows_axis=1))

  @pl.when(wg == PARTNER)
  def _partner():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    acc = _partner_tiles(shared, ring, t0, t1, st)

    output.meet()   # the scorer's row sums are in
    l = plgpu.load(row_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(0))
    output.store(1, acc / online_softmax.per_row(jnp.where(l > 0, l, 1.0), acc.shape, 1))


def _kernel(q_ref,
            kv_ref,
            lengths_ref,
            block_tables_ref,
            *refs,              # [balanced plan: tiles per split, int32 [1]], [sequence order, int32 [B]], out, lse
            st: Static, q_block, union, p_smem, row_smem, produced, consumed, q_barrier, p_ready,
            p_free, max_ready, consumers_done):
  refs = list(refs)
  tiles_per_split = refs.pop(0)[0] if st.balanced else None
  sequence_order = refs.pop(0) if st.ordered else None        # batch slot -> the sequence it takes
  (out_ref,
   lse_ref,
   ) = refs
  q_smem = q_block.at[0]
  ring_slots, (out_smem, lse_smem) = union
  ring = pipeline.Ring(st.smem.ring_spec(), ring_slots, produced, consumed, poison_released=st.interpret)
  shared = SharedP(p_smem, row_smem, p_ready, p_free)
  if not st.interpret and st.num_splits > 1:   # a merge launch that waits (PDL) may take SMs this one leaves
    plgpu.griddepcontrol_launch_dependents()
  row_block, split, b = lax.axis_index("rows"), lax.axis_index("split"), lax.axis_index("batch")
  if st.ordered:   # clamped: a runtime value never addresses past the batch
    b = jnp.clip(sequence_order[b], 0, st.batch - 1)
  length = jnp.clip(lengths_ref[b], 0, st.tiling.max_pages * st.tiling.page_size)
  t0, t1, _, c = split_plan.split_tile_range(length, split, block_kv=st.tiling.block_kv,
                                          num_queries=st.num_queries, num_splits=st.num_splits, window=None,
                                          tiles_per_split=tiles_per_split)
  row0 = row_block * ROWS
  wg = lax.axis_index("wg")
  output = ProgramOutput(out_smem, lse_smem, out_ref, lse_ref, consumers_done, b=b, split=split,
                         row0=0 if st.rows_as_n else row0, half_v=st.half_v, out_rows=st.out_rows,
                         lse_rows=st.lse_rows, one_row_block=st.num_row_blocks == 1, rows_as_n=st.rows_as_n)

  @pl.when(wg == PRODUCER)
  def _producer():
    plgpu.set_max_registers(st.codegen.registers.producer, action="decrease")

    @pl.loop(0, t1 - t0)
    def _(step):
      where = st.tiling.tile_locations(t0 + step, batch=b, block_tables_ref=block_tables_ref)
      for part in ring.spec.part_ids:   # with ring halves the scorer's value half first
        ring.acquire(step, part)
        load = functools.partial(ring.commit, step, st.tiling.tile_sources(kv_ref, where, head=0), part)
        unloaded = functools.partial(ring.commit_stores, step, part)
        if not st.tile_math.load_tiles:
          unloaded()
        elif st.tile_math.first_row_block_loads_only:
          pl.when(row_block == 0)(load)
          pl.when(row_block != 0)(unloaded)
        else:
          load()

    ring.drain(t1 - t0)

  def consumers():
    if st.rows_as_n:
      transposed = dataclasses.replace(shared, vector_layout=plgpu.Layout.WGMMA.reduce(0))
      _rows_as_n_consumers(wg, q_ref, q_block, q_barrier, ring, transposed, row_smem, output, b=b, t0=t0, t1=t1,
                           c=c, length=length, st=st)
      return

    def both_score(loop, sums_row: int):
      """split_scores, alternate_scores: both consumers read Q and run loop(w) -> (acc, m, l); their
      row sums meet in row_smem rows sums_row and sums_row + 1."""
      for w in range(VALUE_WGS):
        @pl.when(wg == w)
        def _():
          plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
          if w == 0:   # both read Q: each waits on the one copy's barrier
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, ROWS)], q_smem, q_barrier)
          plgpu.barrier_wait(q_barrier)
          acc, m_i, l_i = loop(w)
          row_smem[sums_row + w] = l_i
          _store(output, acc, None, w, row_sums=(row_smem.at[sums_row], row_smem.at[sums_row + 1]),
                 lse_of_max=m_i if w == 0 else None)

    if st.alternate_scores:   # rows 0-3 carry the maxima and rescales; 4, 5 are free for the sums
      both_score(lambda w: _alternate_consumer(
          w, Scores(q_block=q_block, length=length, st=st, q_index=zero_row(row_smem, w, st)), ring, p_smem,
          row_smem, p_ready, max_ready, p_free, t0, t1, c, length=length, row0=row0, st=st), sums_row=4)
      return

    if st.split_scores:   # each consumer's last row maximum has been read (it met p_ready since)
      sync = _HalfSync(rows=row_smem, p=p_smem, max_ready=max_ready, p_ready=p_ready, p_free=p_free)
      both_score(lambda w: _score_half_tiles(w, q_smem, sync, ring, t0, t1, c, length=length, row0=row0, st=st),
                 sums_row=0)
      return

    @pl.when(wg == SCORER)
    def _scorer():
      plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, ROWS)], q_smem, q_barrier)
      plgpu.barrier_wait(q_barrier)
      scores = Scores(q_block=q_block, length=length, st=st, q_index=zero_row(row_smem, SCORER, st))
      acc, m_i, l_i = _score_tiles(scores, shared, ring, t0, t1, c, length=length, row0=row0, st=st)

      @pl.when(t1 > t0)
      def _():
        plgpu.barrier_wait(p_free)   # the partner's last P V: observe every phase of the barrier

      out, lse = online_softmax.finalize(acc, m_i, l_i)
      row_smem[1] = l_i
      _store(output, out, lse, 0)

    @pl.when(wg == PARTNER)
    def _partner():
      plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
      acc = _partner_tiles(shared, ring, t0, t1, st)
      _store(output, acc, None, 1, row_sums=(row_smem.at[1],))

  if st.num_splits == 1:   # the output itself: written whatever the length
    consumers()
    return

  @pl.when(t1 > t0)
  def _():
    consumers()

  @pl.when((t1 == t0) & (wg == SCORER))
  def _():
    output.store_no_keys()


def _store(output: ProgramOutput, out, lse, half: int, *, row_sums=(), lse_of_max=None):
  """Stores one consumer's half of the output: normalised with its lse, or raw with row_sums (SMEM rows,
  added up once both consumers meet); lse_of_max (log2 units) makes the lse from them."""
  output.meet()
  if row_sums:
    l = sum(plgpu.load(part, layout=plgpu.Layout.WGMMA.reduce(1)) for part in row_sums)
    if lse_of_max is not None:
      out, lse = online_softmax.finalize(out, lse_of_max, l)
    else:
      out = out / online_softmax.per_row(jnp.where(l > 0, l, 1.0), out.shape)
  output.store(half, out, lse)


def _build(st: Static, interpret: Any):
  out_shape = (st.smem.v_dim, st.rows_as_n) if st.rows_as_n else (st.out_rows, st.smem.v_dim)
  out_type = (jax.ShapeDtypeStruct((st.batch, st.num_splits, *out_shape), st.smem.out_dtype),
              jax.ShapeDtypeStruct((st.batch, st.num_splits, st.lse_rows), jnp.float32))
  name = (f"pallas_kv_mla_paged_r{st.num_queries * st.group}_d{st.smem.qk_dim}_v{st.smem.v_dim}"
          f"_bkv{st.tiling.block_kv}_st{st.smem.num_stages}_sp{st.num_splits}_ps{st.tiling.page_size}"
          f"{'_pqk' if st.pipeline_qk else ''}{'_halves' if st.split_scores else ''}"
          f"{'_alt' if st.alternate_scores else ''}{'_ringhalves' if st.ring_halves else ''}"
          f"{'_regp' if st.p_in_registers else ''}"
          f"{'_balanced' if st.balanced else ''}{'_ordered' if st.ordered else ''}"
          f"{f'_n{st.rows_as_n}' if st.rows_as_n else ''}"
          f"{st.codegen.name}{f'_{st.tile_math.name}' if st.tile_math.name else ''}")
  return plgpu.kernel(
      functools.partial(_kernel, st=st),
      out_type=out_type,
      scratch_types=st.smem.scratch_types(),
      grid=st.grid,
      grid_names=("batch", "split", "rows"),
      num_threads=VALUE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=st.smem.reduction_scratch_bytes),
      interpret=interpret,
      kernel_name=name,
  )


def mla_partials(q, kv_pages, lengths, block_tables, *, num_queries: int, v_head_dim: int, scale: float,
                 config: MosaicMLAConfig, plan: SplitPlan, tile_math: TileMath = TileMath(),
                 codegen: Codegen = Codegen(), interpret: Any = False):
  """Split-K partials of MLA decode over a paged latent cache.

  q: [B, R, Dqk] in the cache's dtype (bf16 / fp16), R = S * Hq packed rows (S = num_queries): row
    r = s * Hq + h is new token s of head h, at lengths[b] - S + s, seeing keys t <= that position.
  kv_pages: [P, page_size, Dqk]; keys are whole rows, values the first v_head_dim columns.
  lengths: int32 [B]; block_tables: int32 [B, max_pages] (both clamped in the kernel).
  scale: the logit scale; config: a complete MosaicMLAConfig (a variant config runs its schedule); plan:
    its `SplitPlan` (not stream-K; grid slot i takes sequence plan.order[i] when given); tile_math:
    `TileMath`; codegen: `Codegen`; interpret: False or a plgpu.InterpretGPUParams.

  Returns (out [B, splits, R, v_head_dim] in q's dtype, each split's normalised output, unwritten for
  an empty split; lse [B, splits, R] f32, natural log, -inf where a split saw no key). 16-bit partials
  (as FlashInfer's) halve what the splits write and the merge reads, at the bf16 output's rounding.
  """
  if q.ndim != 3 or kv_pages.ndim != 3 or q.shape[2] != kv_pages.shape[2]:
    raise ValueError(f"q [B, R, Dqk] and kv_pages [P, page_size, Dqk] must share Dqk: {q.shape=} {kv_pages.shape=}")
  if q.dtype != kv_pages.dtype or jnp.dtype(q.dtype) not in frame.KV_DTYPES:
    raise ValueError(f"q and kv_pages must share a 16-bit dtype, got {q.dtype=} {kv_pages.dtype=}")
  B, R, D = q.shape
  if R % num_queries:
    raise ValueError(f"{num_queries=} must divide the packed rows {R=}")
  reason = mgpu_config.mla_reason(D, v_head_dim, kv_pages.dtype)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  page_size = kv_pages.shape[1]
  check_config(config, qk_dim=D, v_dim=v_head_dim, dtype=q.dtype, page_size=page_size, rows=R)
  if plan.stream_k:
    raise ValueError("the MLA kernel takes the per-sequence or balanced plan, not stream-K")
  plan.check(block_kv=config.block_kv, batch=B)
  schedule = schedule_of(config)
  kv_tiling = tiling.KVTiling(config.block_kv, D, kv_pages.dtype, page_size=page_size,
                              num_pages=kv_pages.shape[0], max_pages=block_tables.shape[1])
  smem = MlaSmem.for_call(config, qk_dim=D, v_dim=v_head_dim, dtype=q.dtype, page_size=page_size, rows=R)
  num_row_blocks = 1 if smem.rows_as_n else row_blocks(R)
  rows_padded = smem.rows_as_n or num_row_blocks * ROWS
  out_rows = R if num_row_blocks == 1 else rows_padded
  st = Static(num_queries=num_queries, group=R // num_queries, out_rows=out_rows,
               lse_rows=split_plan.round_up(smem.rows_as_n or out_rows, LSE_ROW_MULTIPLE), num_row_blocks=num_row_blocks,
               num_splits=plan.num_splits, batch=B, scale=float(scale), tiling=kv_tiling, smem=smem,
               interpret=bool(interpret), pipeline_qk=schedule.pipeline_qk, split_scores=schedule.split_scores,
               balanced=plan.balanced, ordered=plan.ordered, rows_as_n=smem.rows_as_n,
               alternate_scores=schedule.alternate_scores, ring_halves=schedule.ring_halves,
               p_in_registers=schedule.p_in_registers, tile_math=tile_math, codegen=codegen)
  if not tile_math.wait_for_loads and (st.pipeline_qk or st.split_scores or st.alternate_scores or st.ring_halves
                                       or st.rows_as_n):
    raise ValueError("tile_math.wait_for_loads=False is a probe of the plain scorer schedule only")
  if rows_padded != R:
    q = jnp.pad(q, ((0, 0), (0, rows_padded - R), (0, 0)))
  kv = kv_pages.reshape(*kv_pages.shape[:2], 1, D)   # KVTiling's [P, page_size, Hkv, D]
  tiles = [] if plan.tiles_per_split is None else [plan.tiles_per_split]
  order = [] if plan.order is None else [plan.order]
  out, lse = _build(st, interpret or None)(q, kv, lengths, block_tables, *tiles, *order)
  if st.rows_as_n:
    out = jnp.swapaxes(out, 2, 3)   # O^T [B, splits, Dv, N] -> [B, splits, N, Dv]
  return out[:, :, :R], lse[:, :, :R]
