"""The MLA kernel's experimental consumer schedules, which lost to the shipped one (docs/decisions.md#mla-schedules).

`MLAVariantConfig.mla_schedule` names one (`Schedule`); the kernel runs its `consumers` on an `mla.Program`:
  pipeline_qk       the scorer issues tile i+1's Q K^T before tile i's softmax (32-token tiles, 4 stages);
  ring_halves       the scorer and partner on ring slots loaded and freed in two column parts;
  p_in_registers    False: the scorer's P V from SMEM;
  split_scores      both consumers score half of each tile's keys and trade row maxima (`_score_half_tiles`);
  alternate_scores  the consumers score alternate tiles (`_alternate_consumer`; with ring_halves too);
  rows_as_n         the q rows (at most 64) as wgmma's N: O^T = V^T P^T (`_rows_as_n_consumers`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import online_softmax
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu.mla import PARTNER, SCORER, Program, accumulator_shape, partner_tiles
from pallas_kv.kernels.mosaic_gpu.mla import scorer_and_partner
from pallas_kv.kernels.mosaic_gpu.mla_config import BLOCK_KV, ROWS, ROWS_AS_N_MAX, ROWS_AS_N_MULTIPLE, VALUE_WGS
from pallas_kv.kernels.mosaic_gpu.mla_tiles import Scores, Static, TileMath, add_pv, start_state


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How the two consumers share a tile's work (`MLAVariantConfig`'s fields); the kernel's `variant_schedule`."""
  pipeline_qk: bool = False
  split_scores: bool = False
  rows_as_n: bool = False
  alternate_scores: bool = False
  ring_halves: bool = False
  p_in_registers: bool = True

  def check(self, *, block_kv: int, rows: int) -> None:
    if block_kv != BLOCK_KV and (self.split_scores or self.rows_as_n):
      raise ValueError(f"split_scores and rows_as_n take block_kv={BLOCK_KV}, got {block_kv}")
    if self.pipeline_qk and self.split_scores:
      raise ValueError("MLA on mosaic_gpu takes pipeline_qk or split_scores, not both")
    if self.alternate_scores and (self.pipeline_qk or self.split_scores or self.rows_as_n or block_kv != BLOCK_KV):
      raise ValueError(f"alternate_scores takes block_kv={BLOCK_KV} and none of pipeline_qk, split_scores, "
                       f"rows_as_n; got {self}")
    if self.ring_halves and (self.pipeline_qk or self.split_scores or self.rows_as_n):
      raise ValueError(f"ring_halves takes the plain scorer schedule or alternate_scores: none of pipeline_qk, "
                       f"split_scores, rows_as_n; got {self}")
    if self.p_in_registers and (self.pipeline_qk or self.split_scores or self.alternate_scores or self.rows_as_n):
      raise ValueError(f"p_in_registers takes the plain scorer schedule (alternate_scores always reads its own P "
                       f"from registers): none of pipeline_qk, split_scores, alternate_scores, rows_as_n; got {self}")
    if self.rows_as_n and (self.pipeline_qk or self.split_scores):
      raise ValueError("MLA on mosaic_gpu takes rows_as_n without pipeline_qk or split_scores")
    if self.rows_as_n and rows > ROWS_AS_N_MAX:
      raise ValueError(f"rows_as_n needs at most {ROWS_AS_N_MAX} packed q rows (new tokens x heads), got {rows}")

  def smem_layout(self, rows: int) -> dict[str, Any]:
    """`MlaSmem`'s schedule fields for `rows` packed q rows."""
    return dict(split_scores=self.split_scores, alternate_scores=self.alternate_scores, ring_halves=self.ring_halves,
                rows_as_n=plan.round_up(rows, ROWS_AS_N_MULTIPLE) if self.rows_as_n else 0)

  @property
  def suffix(self) -> str:
    """The kernel name's part for the schedule."""
    return (f"{'_pqk' if self.pipeline_qk else ''}{'_halves' if self.split_scores else ''}"
            f"{'_alt' if self.alternate_scores else ''}{'_ringhalves' if self.ring_halves else ''}"
            f"{'_regp' if self.p_in_registers else ''}")

  def consumers(self, program: Program):
    if _moves_waits(program.st.tile_math) and (self.pipeline_qk or self.split_scores or self.alternate_scores
                                               or self.ring_halves or self.rows_as_n):
      raise ValueError("a TileMath that moves the slot waits (read_slot, release_slot) probes the plain scorer "
                       "schedule only")
    if self.rows_as_n:
      _rows_as_n_consumers(program)
    elif self.alternate_scores:   # rows 0-3 carry the maxima and rescales; 4, 5 are free for the sums
      _both_score(program, functools.partial(_alternate_consumer, program, ring_halves=self.ring_halves), sums_row=4)
    elif self.split_scores:   # each consumer's last row maximum has been read (it met p_ready since)
      _both_score(program, functools.partial(_score_half_tiles, program), sums_row=0)
    else:
      partner = _partner_tiles if self.ring_halves else partner_tiles
      scorer_and_partner(program, functools.partial(_score_tiles, schedule=self), partner)


def schedule_of(config) -> Schedule | None:
  """The schedule of a config's fields; None where that is the shipped one."""
  schedule = Schedule(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Schedule)
                         if hasattr(config, f.name)})
  return None if schedule == Schedule() else schedule


def _moves_waits(tile_math: TileMath) -> bool:
  """Whether tile_math moves the consumers' slot waits (a probe of the plain scorer's schedules)."""
  kind = type(tile_math)
  return kind.read_slot is not TileMath.read_slot or kind.release_slot is not TileMath.release_slot


def _start_halves(scores: Scores, s_ref, ring: pipeline.Ring, step):
  """ring_halves: S over each column part as it lands. Values past the length are zeroed after
  (`_zero_past_parts`): their scores are masked, and the wgmma must finish reading first."""
  for part in (0, 1):
    columns = pl.ds(*ring.spec.part_columns(part))
    scores.st.tile_math.qk(s_ref, scores.q_smem.at[:, columns], ring.wait(step, part).transpose((1, 0)))


def _start_from(scores: Scores, s_ref, ring: pipeline.Ring, step, tile, *, ring_halves: bool):
  if ring_halves:
    _start_halves(scores, s_ref, ring, step)
  else:
    scores.start(s_ref, tile, ring.wait(step))


def _zero_past_parts(scores: Scores, ring: pipeline.Ring, step, tile):
  """ring_halves: zeroes values past the length in both parts, between Q K^T and P V."""
  scores.zero_past(tile, [(ring.slot(step, part), scores.st.half_v) for part in (0, 1)])


def _score_tiles(program: Program, scores: Scores, *, schedule: Schedule):
  """The scorer's loop with pipeline_qk, ring_halves or P V from SMEM: returns (acc, m, l). pipeline_qk
  issues tile i+1's Q K^T before tile i's softmax (the last step re-scores its own tile, still held)."""
  p, st, ring = program, program.st, program.ring
  s_type = plgpu.ACC((ROWS, st.tiling.block_kv), jnp.float32)

  def finish(s, tile, acc, m_i, l_i, values, masked):
    alpha, m_new, l_new, prob = st.tile_math.softmax(s, m_i, l_i, tile=tile, length=p.length, row0=p.row0,
                                                     masked=masked, st=st)
    p16, acc = prob.astype(st.smem.dtype), acc * online_softmax.per_row(alpha, acc.shape)
    publish = functools.partial(p.shared.publish, p16, alpha, wait_free=tile > p.t0)
    if schedule.p_in_registers and not st.interpret:
      return add_pv(acc, [(p16, values)], st, meanwhile=publish), m_new, l_new
    publish()
    return add_pv(acc, [(p.shared.p, values)], st), m_new, l_new

  def first_values(slot):
    return slot.at[:, pl.ds(0, st.half_v)]

  acc, m_i, l_i = start_state((ROWS, st.half_v))

  if not schedule.pipeline_qk:
    def step(tile, carry, *, masked: bool):
      i = tile - p.t0

      def qk(s_ref):
        if schedule.ring_halves:
          _start_halves(scores, s_ref, ring, i)
        else:
          scores.start(s_ref, tile, st.tile_math.read_slot(ring, i))
        return s_ref[...]

      s = pl.run_scoped(qk, s_type)
      if schedule.ring_halves:
        if masked:
          _zero_past_parts(scores, ring, i, tile)
        carry = finish(s, tile, *carry, ring.slot(i, 0), masked)
        ring.release(i, part=0)
      else:
        carry = finish(s, tile, *carry, first_values(ring.slot(i)), masked)
        st.tile_math.release_slot(ring, i)
      return carry

    carry = (acc, m_i, l_i)
  else:
    def first(s_ref):
      @pl.when(p.t1 > p.t0)
      def _():
        scores.start(s_ref, p.t0, ring.wait(0))
      return s_ref[...]

    def step(tile, carry, *, masked: bool):
      acc, m_i, l_i, s = carry
      i = tile - p.t0
      has_next = tile + 1 < p.t1

      @pl.when(has_next)
      def _():
        ring.wait(i + 1)

      scored = jnp.where(has_next, tile + 1, tile)

      def body(s_ref):
        scores.start(s_ref, scored, ring.slot(scored - p.t0))
        return (*finish(s, tile, acc, m_i, l_i, first_values(ring.slot(i)), masked), s_ref[...])

      carry = pl.run_scoped(body, s_type)
      ring.release(i)
      return carry

    carry = (acc, m_i, l_i, pl.run_scoped(first, s_type))

  carry = lax.fori_loop(p.t0, p.c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(p.c, p.t1, functools.partial(step, masked=True), carry)
  return carry[:3]


def _partner_tiles(program: Program):
  """The partner's loop on ring halves (column part 1, its value half, after the scorer's Q K^T) or with
  rows as N (O^T = alpha O^T + V^T P^T)."""
  p, st, ring = program, program.st, program.ring
  rows_axis = 1 if st.rows_as_n else 0
  part = 1 if st.smem.ring_halves else None
  first_column = 0 if st.smem.ring_halves else st.half_v

  def step(tile, acc):
    i = tile - p.t0
    slot = ring.wait(i, part)
    alpha = p.shared.receive()
    values = slot.at[:, pl.ds(first_column, st.half_v)]
    parts = [(values.transpose((1, 0)), p.shared.p)] if st.rows_as_n else [(p.shared.p, values)]
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape, rows_axis), parts, st)
    p.shared.hand_back()
    ring.release(i, part=part)
    return acc

  return lax.fori_loop(p.t0, p.t1, step, plgpu.layout_cast(jnp.zeros(accumulator_shape(p), jnp.float32),
                                                           plgpu.Layout.WGMMA))


def _both_score(program: Program, loop, sums_row: int):
  """split_scores, alternate_scores: both consumers read Q and run loop(w) -> (acc, m, l); their row sums
  meet in row_smem rows sums_row and sums_row + 1."""
  p, st = program, program.st
  for w in range(VALUE_WGS):
    @pl.when(p.wg == w)
    def _():
      plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
      if w == 0:   # both read Q: each waits on the one copy's barrier
        plgpu.copy_gmem_to_smem(p.q_ref.at[p.b, pl.ds(p.row0, ROWS)], p.q_block.at[0], p.q_barrier)
      plgpu.barrier_wait(p.q_barrier)
      acc, m_i, l_i = loop(w)
      p.row_smem[sums_row + w] = l_i
      p.output.meet_and_store(w, acc, None, row_sums=(p.row_smem.at[sums_row], p.row_smem.at[sums_row + 1]),
                              lse_of_max=m_i if w == 0 else None)


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


def _score_half_tiles(program: Program, w: int):
  """split_scores: consumer w scores its half of each tile's keys, shares the row max, and adds both
  halves of P times its value columns. Returns (acc [64, Dv/2], m, l over its half of the keys)."""
  p, st, ring = program, program.st, program.ring
  sync = _HalfSync(rows=p.row_smem, p=p.p_smem, max_ready=p.max_ready, p_ready=p.p_ready, p_free=p.p_free)
  q_smem = p.q_block.at[0]
  hk, bkv = st.smem.half_kv, st.tiling.block_kv
  s_type = plgpu.ACC((ROWS, hk), jnp.float32)
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  columns = pl.ds(w * st.half_v, st.half_v)

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    i = tile - p.t0
    slot = ring.wait(i)

    def qk(s_ref):
      st.tile_math.qk(s_ref, q_smem, slot.at[pl.ds(w * hk, hk)].transpose((1, 0)))
      return s_ref[...]

    s = online_softmax.log2_logits(pl.run_scoped(qk, s_type), scale=st.scale, softcap=None)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + p.row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * bkv + w * hk, length=p.length,
                                  num_queries=st.num_queries, group=st.group, window=None)
      s = jnp.where(ok, s, -jnp.inf)
    half_max = s.max(axis=1)
    sync.rows[w] = half_max
    sync.meet(sync.max_ready)
    tile_max = jnp.maximum(half_max, plgpu.load(sync.rows.at[1 - w], layout=rows_layout))
    alpha, m_new, l_new, prob = online_softmax.rescale_step(s, m_i, l_i, tile_max=tile_max)
    if masked and w == 0:
      valid_rows = p.length - tile * bkv

      @pl.when(valid_rows < bkv)
      def _():
        tiling.zero_rows_past(slot, valid_rows, width=st.smem.v_dim)

    @pl.when(tile > p.t0)
    def _():
      plgpu.barrier_wait(sync.p_free)   # the other consumer's P V of the previous tile is done

    sync.p[w][...] = prob.astype(st.smem.dtype)
    plgpu.commit_smem()   # P (and zeroed values), read next by wgmma
    sync.meet(sync.p_ready)
    parts = [(sync.p[j], slot.at[pl.ds(j * hk, hk), columns]) for j in range(VALUE_WGS)]
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape), parts, st)
    plgpu.barrier_arrive(sync.p_free)
    ring.release(i)
    return acc, m_new, l_new

  carry = start_state((ROWS, st.half_v))
  carry = lax.fori_loop(p.t0, p.c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(p.c, p.t1, functools.partial(step, masked=True), carry)

  @pl.when(p.t1 > p.t0)
  def _():
    plgpu.barrier_wait(sync.p_free)   # the last tile's phase
  return carry


def _own_pv(acc, p16, values, st: Static, meanwhile=None):
  """acc + P V with P from registers (a plain dot in interpret mode); meanwhile() runs during it."""
  if st.interpret:
    if meanwhile is not None:
      meanwhile()
    return acc + jnp.dot(p16, values[...], preferred_element_type=jnp.float32)
  return add_pv(acc, [(p16, values)], st, meanwhile=meanwhile)


def _alternate_consumer(program: Program, w: int, *, ring_halves: bool):
  """alternate_scores (FlashMLA's seesaw): per pair of tiles (a, b), consumer 0 scores a and consumer 1 b;
  each adds P V of both for its value columns w. Consumer 0 puts a's max and rescale in rows 0, 1
  (max_ready[0]); consumer 1 scores b from them and puts b's in rows 2, 3 (max_ready[1]). Each reads its
  own P from registers, the other's from the one SMEM buffer: b's first (p_ready[1]), then a's rescaled to
  b's max (p_ready[0]). Each writer's own P V has read the buffer's previous P, so only an odd last tile
  needs p_free. With ring_halves consumer w alone reads and releases column part w.
  """
  scores = program.scores(w)
  ring, p_smem, row_smem, st = program.ring, program.p_smem, program.row_smem, program.st
  p_ready, max_ready, p_free = program.p_ready, program.max_ready, program.p_free
  t0, t1, c = program.t0, program.t1, program.c
  n = t1 - t0
  pairs, has_tail = n // 2, n % 2
  columns = pl.ds(w * st.half_v, st.half_v)
  s_type = plgpu.ACC((ROWS, st.tiling.block_kv), jnp.float32)

  def ring_step(j):   # Codegen.slots_per_tile: made opaque with this consumer's row of zeros
    return j + scores.q_index[0].astype(jnp.int32) if st.codegen.slots_per_tile else j

  def rows(i):
    return tuple(plgpu.load(row_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(1)) for j in (i, i + 1))

  def rescaled(acc, factor):
    return acc * online_softmax.per_row(factor, acc.shape)

  def values(step):
    if ring_halves:
      return ring.slot(step, w).at[:, pl.ds(0, st.half_v)]
    return ring.slot(step).at[:, columns]

  def release(step):
    ring.release(step, part=w if ring_halves else None, read_by_registers=st.interpret)

  def other_p(acc, step, ready):
    """acc + (the other's P in SMEM) V of step's tile for columns w; then the slot is released."""
    plgpu.barrier_wait(ready)
    acc = add_pv(acc, [(p_smem, values(step))], st)
    release(step)
    return acc

  def score(step, masked, meanwhile=lambda: None):
    def qk(s_ref):
      _start_from(scores, s_ref, ring, step, t0 + step, ring_halves=ring_halves)
      result = meanwhile()
      return s_ref[...], result

    s, result = pl.run_scoped(qk, s_type)
    if ring_halves and masked:
      _zero_past_parts(scores, ring, step, t0 + step)
    return s, result

  def softmax(s, step, m_i, l_i, masked):
    return st.tile_math.softmax(s, m_i, l_i, tile=t0 + step, length=program.length, row0=program.row0,
                                masked=masked, st=st)

  def first(k, carry, *, masked: bool, second: bool):
    """Consumer 0, pair k: tile a; with a second tile, b's P from consumer 1; a's P to consumer 1."""
    acc, m_i, l_i = carry
    a = ring_step(2 * k)
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
    a = ring_step(2 * k)

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


def _score_tiles_as_n(program: Program, scores: Scores):
  """The scorer with rows as N: S^T = K Q^T [bkv, N], softmax over keys, P^T to the partner, O^T += V^T P^T."""
  p, st, ring = program, program.st, program.ring
  n, bkv = st.rows_as_n, st.tiling.block_kv
  s_type = plgpu.ACC((bkv, n), jnp.float32)

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    i = tile - p.t0
    slot = ring.wait(i)

    def qk(s_ref):
      scores.zero_past(tile, [(slot, st.smem.v_dim)])
      st.tile_math.qk(s_ref, slot, scores.q_smem.transpose((1, 0)))
      return s_ref[...]

    alpha, m_new, l_new, prob = st.tile_math.softmax(pl.run_scoped(qk, s_type), m_i, l_i, tile=tile,
                                                     length=p.length, row0=0, masked=masked, st=st)
    p.shared.publish(prob.astype(st.smem.dtype), alpha, wait_free=tile > p.t0)
    values = slot.at[:, pl.ds(0, st.half_v)].transpose((1, 0))
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape, 1), [(values, p.shared.p)], st)
    ring.release(i)
    return acc, m_new, l_new

  carry = start_state((st.half_v, n), rows_axis=1)
  carry = lax.fori_loop(p.t0, p.c, functools.partial(step, masked=False), carry)
  return lax.fori_loop(p.c, p.t1, functools.partial(step, masked=True), carry)


def _rows_as_n_consumers(program: Program):
  """The scorer and partner with rows as N: each stores its half of O^T into out [B, splits, Dv, N]."""
  p, st = program, program.st   # the kernel gives rows as N their column-vector hand-over (SharedP)

  @pl.when(p.wg == SCORER)
  def _scorer():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    p.load_q(p.q_ref.at[p.b])   # q [B, N, Dqk]: every row
    acc, m_i, l_i = _score_tiles_as_n(p, p.scores(SCORER))

    @pl.when(p.t1 > p.t0)
    def _():
      plgpu.barrier_wait(p.shared.free)   # the partner's last P V: observe every phase of the barrier

    p.row_smem[1] = l_i
    p.output.meet()
    p.output.store(0, *online_softmax.finalize(acc, m_i, l_i, rows_axis=1))

  @pl.when(p.wg == PARTNER)
  def _partner():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    acc = _partner_tiles(p)

    p.output.meet()   # the scorer's row sums are in
    l = plgpu.load(p.row_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(0))
    p.output.store(1, acc / online_softmax.per_row(jnp.where(l > 0, l, 1.0), acc.shape, 1))
