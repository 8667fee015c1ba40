"""Split-K MLA decode (DeepSeek's absorbed form) on Mosaic GPU: one latent KV head, paged.

kv_pages [P, page_size, Dqk]: keys are whole rows, values their first Dv columns; packed rows (S tokens x Hq heads)
in blocks of 64 (wgmma M), a token range's row blocks launched together (docs/decisions.md#mla-grid-order).
  producer  TMA-copies each KV tile [bkv, Dqk] once into an SMEM ring (`pipeline.Ring`);
  scorer    S = Q K^T, the masked online softmax, P and alpha to the partner (`SharedP`), and O[:, :Dv/2] += P V
            with P from its registers (docs/decisions.md#mla-p-in-registers);
  partner   O[:, Dv/2:] = alpha O[:, Dv/2:] + P V, overlapping the scorer's next tile.
Split by value columns, the f32 accumulator fits each consumer's registers (FlashMLA's plan). Experimental
schedules run their own consumers on a `Program`.

An fp8 cache (`MlaSmem.quantized`) keeps the schedule and changes what a tile costs: Q K^T runs on fp8 wgmma
with Q as two fp8 terms (`split_query`), and the partner widens the value columns into two 16-bit tiles
(`widen_values`), the scorer's half while the scorer runs Q K^T and the softmax (`partner_one_byte_tiles`).
Per-token scales multiply S's columns and fold into P. Up to 32 packed rows take wgmma's N there (`MlaSmem.rows_as_n`:
S^T = K Q^T, the softmax down S^T's columns, O^T = V^T P^T over the widened tiles read transposed), so that 16
heads do a quarter of the padded rows' products; the schedule is the same.
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
from pallas_kv import online_softmax
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.plan import SplitPlan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import mla_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu import trace as mgpu_trace
from pallas_kv.kernels.mosaic_gpu.trace import region
from pallas_kv.kernels.mosaic_gpu.mla_config import ROWS, VALUE_WGS, Codegen, MlaSmem, check_config, row_blocks
from pallas_kv.kernels.mosaic_gpu.mla_config import variant_schedule
from pallas_kv.kernels.mosaic_gpu.mla_output import ProgramOutput
from pallas_kv.kernels.mosaic_gpu.mla_tiles import Scores, SharedP, Static, TileMath, add_pv, start_state, zero_row
from pallas_kv.kernels.mosaic_gpu.mla_tiles import running_value_scale, scaled_scores, split_query

SCORER, PARTNER, PRODUCER = 0, 1, 2
LSE_ROW_MULTIPLE = 4   # TMA stores need 16-byte rows: the lse output is padded to 4 float32 rows
SHIPPED_SUFFIX = "_regp"   # the shipped schedule's kernel-name suffix: the scorer's P V from registers


@dataclasses.dataclass(frozen=True)
class Program:
  """What a consumer schedule works with in one program: Q, the KV ring, `MlaSmem`'s scratch and barriers,
  the output, and sequence b's tiles [t0, t1) ([c, t1) masked), length and first q row row0."""
  wg: Any
  q_ref: Any
  q_block: Any
  q_barrier: Any
  ring: pipeline.Ring
  shared: SharedP
  p_smem: Any
  row_smem: Any
  p_ready: Any
  p_free: Any
  max_ready: Any
  output: ProgramOutput
  b: Any
  t0: Any
  t1: Any
  c: Any
  length: Any
  row0: Any
  st: Static
  row_factor_ref: Any = None          # one-byte caches: [B, rows] f32 (`split_query`)
  widened: Any = None                 # one-byte caches: both consumers' value columns, widened by the partner
  values_ready: Any = None            # one-byte caches: the scorer's widened values, written / read by P V
  values_free: Any = None
  scale_ring: pipeline.Ring | None = None   # per-token scales

  def scores(self, w: int) -> Scores:
    return Scores(q_block=self.q_block, length=self.length, st=self.st, q_index=zero_row(self.row_smem, w, self.st))

  def load_q(self, source=None):
    """Copies q rows (source; default: the row block's) into SMEM and waits for them; over a one-byte cache,
    both fp8 terms and the rows' factors."""
    if self.st.smem.quantized:
      rows = pl.ds(self.row0, self.st.smem.q_rows)
      for term in range(self.st.smem.q_terms):   # one copy per term: TMA strides up to 5 dims
        plgpu.copy_gmem_to_smem(self.q_ref.at[self.b, term, rows], self.q_block.at[term], self.q_barrier)
      plgpu.copy_gmem_to_smem(self.row_factor_ref.at[self.b, rows],
                              self.row_smem.at[self.st.smem.row_factor_row], self.q_barrier)
    else:
      source = self.q_ref.at[self.b, pl.ds(self.row0, ROWS)] if source is None else source
      plgpu.copy_gmem_to_smem(source, self.q_block.at[0], self.q_barrier)
    plgpu.barrier_wait(self.q_barrier)

  def row_factor(self):
    return plgpu.load(self.row_smem.at[self.st.smem.row_factor_row], layout=self.row_vector_layout)

  @property
  def rows_axis(self) -> int:
    """The q rows' axis of S and of the accumulators: 1 with rows as N (S^T [bkv, N], O^T [Dv/2, N])."""
    return 1 if self.st.rows_as_n else 0

  @property
  def row_vector_layout(self):
    return plgpu.Layout.WGMMA.reduce(1 - self.rows_axis)

  def valid_rows(self, tile, masked: bool):
    return self.length - tile * self.st.tiling.block_kv if masked else None


def score_tiles(program: Program, scores: Scores):
  """The scorer's loop over tiles [t0, t1) ([c, t1) masked): returns (acc, m, l) of value columns [0, Dv/2)."""
  p, st = program, program.st
  s_type = plgpu.ACC((ROWS, st.tiling.block_kv), jnp.float32)

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i = carry
    i = tile - p.t0

    def qk(s_ref):
      scores.start(s_ref, tile, st.tile_math.read_slot(p.ring, i))
      return s_ref[...]

    with region("qk"):
      s = pl.run_scoped(qk, s_type)
    values = p.ring.slot(i).at[:, pl.ds(0, st.half_v)]
    with region("softmax"):
      alpha, m_new, l_new, prob = st.tile_math.softmax(s, m_i, l_i, tile=tile, length=p.length, row0=p.row0,
                                                       masked=masked, st=st)
      p16, acc = prob.astype(st.smem.dtype), acc * online_softmax.per_row(alpha, acc.shape)
    acc = publish_and_add_pv(p, acc, p16, alpha, values, tile)
    st.tile_math.release_slot(p.ring, i)
    return acc, m_new, l_new

  return unmasked_then_masked(p, step, start_state((ROWS, st.half_v)))


def publish_and_add_pv(p: Program, acc, p16, alpha, values, tile):
  """The scorer's acc + P V over values [bkv, Dv/2], handing P and alpha to the partner meanwhile (rows as N:
  acc^T + V^T P^T, after the hand-over: P^T is wgmma's B, read from SMEM)."""
  publish = functools.partial(p.shared.publish, p16, alpha, wait_free=tile > p.t0)
  if p.st.interpret or p.st.rows_as_n:   # interpret mode reads P from SMEM; P^T, as wgmma's B, must be there
    publish()
    return add_pv(acc, [value_product(p, p.shared.p, values)], p.st)
  return add_pv(acc, [(p16, values)], p.st, meanwhile=publish)   # the hand-over while the tensor cores run P V


def value_product(p: Program, probabilities, values):
  """P V's wgmma operands (A, B) of P [64, bkv] and values [bkv, Dv/2]; rows as N, V^T and P^T [bkv, N]."""
  return (values.transpose((1, 0)), probabilities) if p.st.rows_as_n else (probabilities, values)


def unmasked_then_masked(p: Program, step, carry):
  """step(tile, carry, masked=) over tiles [t0, c), then the masked [c, t1)."""
  carry = lax.fori_loop(p.t0, p.c, functools.partial(step, masked=False), carry)
  return lax.fori_loop(p.c, p.t1, functools.partial(step, masked=True), carry)


def partner_tiles(program: Program):
  """The partner's loop: acc = alpha acc + P V over value columns [Dv/2, Dv), per tile."""
  p, st = program, program.st

  def step(tile, acc):
    i = tile - p.t0
    slot = st.tile_math.read_slot(p.ring, i)
    alpha = p.shared.receive()
    parts = [(p.shared.p, slot.at[:, pl.ds(st.half_v, st.half_v)])]
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape), parts, st)
    p.shared.hand_back()
    st.tile_math.release_slot(p.ring, i)
    return acc

  zero = plgpu.layout_cast(jnp.zeros((ROWS, st.half_v), jnp.float32), plgpu.Layout.WGMMA)
  return lax.fori_loop(p.t0, p.t1, step, zero)


def scorer_and_partner(program: Program, score, partner):
  """The scorer (warpgroup 0: score(program, scores) -> (acc, m, l)) and its partner (1: partner(program) ->
  acc), each storing its half of O; the scorer's row sums go to the partner in row_smem[1]."""
  p, st = program, program.st

  @pl.when(p.wg == SCORER)
  def _scorer():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    p.load_q()
    acc, m_i, l_i = score(p, p.scores(SCORER))

    @pl.when(p.t1 > p.t0)
    def _():
      plgpu.barrier_wait(p.p_free)   # the partner's last P V: observe every phase of the barrier

    out, lse = online_softmax.finalize(acc, m_i, l_i, reciprocal=True, rows_axis=p.rows_axis)
    p.row_smem[1] = l_i
    p.output.meet_and_store(0, out, lse)

  @pl.when(p.wg == PARTNER)
  def _partner():
    plgpu.set_max_registers(st.codegen.registers.consumer, action="increase")
    p.output.meet_and_store(1, partner(p), row_sums=(p.row_smem.at[1],))


def shipped_consumers(program: Program):
  """The shipped consumer schedule: `score_tiles` and `partner_tiles` (over fp8 caches, their one-byte forms)."""
  if program.st.smem.quantized:
    scorer_and_partner(program, score_one_byte_tiles, partner_one_byte_tiles)
  else:
    scorer_and_partner(program, score_tiles, partner_tiles)


def score_one_byte_tiles(program: Program, scores: Scores):
  """`score_tiles` over an fp8 cache: Q K^T from the fp8 slot; P V on the value columns the partner widened (or,
  `Codegen.widen_own_values`, the scorer did while its Q K^T ran). With a scale per token, P is divided by the
  running max of the scales met (`running_value_scale`), l and both accumulators kept in its units."""
  p, st = program, program.st
  own = st.codegen.widen_own_values
  axis = p.rows_axis
  s_type = plgpu.ACC((st.tiling.block_kv, st.rows_as_n) if st.rows_as_n else (ROWS, st.tiling.block_kv), jnp.float32)
  row_factor = p.row_factor()
  token_scales = p.scale_ring is not None

  def step(tile, carry, *, masked: bool):
    acc, m_i, l_i, c_i = carry
    i = tile - p.t0
    slot = p.ring.wait(i)

    def qk(s_ref):
      scores.start(s_ref, tile, slot)
      if own:   # fenced by its commit: the slot is released plainly below
        with region("widen"):
          st.tile_math.widen(slot, p.widened, SCORER, st, p.valid_rows(tile, masked))
      return s_ref[...]

    with region("qk"):
      s = pl.run_scoped(qk, s_type)
    p.ring.release(i)
    key_scales, c_new, units = None, c_i, None
    if token_scales:   # a vector over the keys: S's columns (rows as N: S^T's rows)
      key_scales = plgpu.load(p.scale_ring.wait(i), layout=plgpu.Layout.WGMMA.reduce(axis))
      c_new = running_value_scale(c_i, key_scales, keys_axis=1 - axis, valid_keys=p.valid_rows(tile, masked))
      units = (jnp.log2(c_i), jnp.log2(c_new))
    with region("softmax"):
      alpha, m_new, l_new, prob = st.tile_math.softmax(scaled_scores(s, key_scales, keys_axis=1 - axis), m_i, l_i,
                                                       tile=tile, length=p.length, row0=p.row0, masked=masked,
                                                       st=st, row_factor=row_factor, log2_units=units)
      # P V reads the unscaled widened values: each key's scale goes into P (P / c: at most 1).
      p16 = online_softmax.times_key_scales(prob, key_scales, masked=masked,
                                            keys_axis=1 - axis).astype(st.smem.dtype)
      acc = acc * online_softmax.per_row(alpha, acc.shape, axis)
    if not own:
      with region("wait_values"):
        plgpu.barrier_wait(p.values_ready)
    acc = publish_and_add_pv(p, acc, p16, alpha, p.widened[SCORER], tile)
    # The key scales were read (into P) before the hand-over's commit: no fence of their own.
    pipeline.release_after_commit((p.scale_ring,), i)
    if not own:
      plgpu.barrier_arrive(p.values_free)   # after P V's wgmma: its result is read above
    return acc, m_new, l_new, c_new

  acc, m_i, l_i = start_state(accumulator_shape(p), rows_axis=axis)
  floor = online_softmax.MIN_VALUE_SCALE if token_scales else 1.0
  c_i = plgpu.layout_cast(jnp.full(m_i.shape, floor, jnp.float32), p.row_vector_layout)
  acc, m_i, l_i, c_i = unmasked_then_masked(p, step, (acc, m_i, l_i, c_i))
  if token_scales:   # lse = (m + log2 c) ln 2 + ln(l / c); acc / l as it is
    m_i = m_i + jnp.log2(c_i)
  return acc, m_i, l_i


def accumulator_shape(p: Program) -> tuple[int, int]:
  """A consumer's share of O: [64, Dv/2], or O^T [Dv/2, N] with rows as N."""
  return (p.st.half_v, p.st.rows_as_n) if p.st.rows_as_n else (ROWS, p.st.half_v)


def partner_one_byte_tiles(program: Program):
  """`partner_tiles` over an fp8 cache. The partner widens both halves of the value columns: the scorer's first,
  once the scorer's last P V is done with them (values_free), handed over by values_ready while the scorer runs
  Q K^T and the softmax; then its own. The scorer's tile then costs what a 16-bit tile costs. With
  `Codegen.widen_own_values`, its own alone."""
  p, st = program, program.st
  own = st.codegen.widen_own_values

  def step(tile, acc, *, masked: bool):
    i = tile - p.t0
    slot, valid_rows = p.ring.wait(i), p.valid_rows(tile, masked)
    if not own:
      @pl.when(tile > p.t0)
      def _():
        with region("wait_values"):
          plgpu.barrier_wait(p.values_free)

      with region("widen"):
        st.tile_math.widen(slot, p.widened, SCORER, st, valid_rows)
      plgpu.barrier_arrive(p.values_ready)
      if st.codegen.explicit_barriers:   # every warp's last P V over its own half (wgmma's B: all rows) is done
        plgpu.commit_smem()
    with region("widen"):
      st.tile_math.widen(slot, p.widened, PARTNER, st, valid_rows)
    p.ring.release(i, read_by_registers=True)
    alpha = p.shared.receive()
    acc = add_pv(acc * online_softmax.per_row(alpha, acc.shape, p.rows_axis),
                 [value_product(p, p.shared.p, p.widened[PARTNER])], st)
    p.shared.hand_back()
    return acc

  acc = unmasked_then_masked(p, step, plgpu.layout_cast(jnp.zeros(accumulator_shape(p), jnp.float32),
                                                        plgpu.Layout.WGMMA))

  if not own:
    @pl.when(p.t1 > p.t0)
    def _():
      plgpu.barrier_wait(p.values_free)   # the scorer's last P V: observe every phase of the barrier

  return acc


def _kernel(q_ref,
            kv_ref,
            lengths_ref,
            block_tables_ref,
            *refs,              # [balanced plan: tiles per split, int32 [1]], [sequence order, int32 [B]],
                                # [one-byte: row factors [B, rows] f32, [per-token scales [P * page_size]
                                #  or gathered [B, T] f32]],
                                # out, lse
            st: Static, q_block, union, p_smem, row_smem, produced, consumed, q_barrier, p_ready,
            p_free, max_ready, consumers_done, widened=None, values_ready=None, values_free=None, scale_slots=None,
            scales_produced=None, scales_consumed=None):
  refs = list(refs)
  tiles_per_split = refs.pop(0)[0] if st.balanced else None
  sequence_order = refs.pop(0) if st.ordered else None        # batch slot -> the sequence it takes
  row_factor_ref = refs.pop(0) if st.smem.quantized else None
  scale_ref = refs.pop(0) if st.smem.token_scales else None
  scale_ring = None
  if scale_ref is not None:
    scale_ring = pipeline.Ring(st.smem.scale_ring_spec(), scale_slots, scales_produced, scales_consumed)
  (out_ref,
   lse_ref,
   ) = refs
  ring_slots, (out_smem, lse_smem) = union
  ring = pipeline.Ring(st.smem.ring_spec(), ring_slots, produced, consumed, poison_released=st.interpret)
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
      for part in ring.spec.part_ids:   # a slot in column parts: the scorer's value part first
        ring.acquire(step, part)
        load = functools.partial(ring.commit, step, st.tiling.tile_sources(kv_ref, where, head=0), part)
        st.tile_math.load_tile(load, functools.partial(ring.commit_stores, step, part), row_block)
      if scale_ring is not None:
        scale_ring.acquire(step)
        if st.smem.gathered_scales:   # [B, T]: the tile's run, one copy
          sources = [scale_ref.at[b, pl.ds((t0 + step) * st.tiling.block_kv, st.tiling.block_kv)]]
        else:
          sources = st.tiling.scale_sources(scale_ref, where, head=0, width=1, tokens_per_index=st.tiling.page_size)
        scale_ring.commit(step, sources)

    ring.drain(t1 - t0)
    if scale_ring is not None:
      scale_ring.drain(t1 - t0)

  shared = SharedP(p_smem, row_smem, p_ready, p_free, vector_layout=plgpu.Layout.WGMMA.reduce(0 if st.rows_as_n else 1))
  program = Program(wg=wg, q_ref=q_ref, q_block=q_block, q_barrier=q_barrier, ring=ring, shared=shared, p_smem=p_smem,
                    row_smem=row_smem, p_ready=p_ready, p_free=p_free, max_ready=max_ready, output=output, b=b, t0=t0,
                    t1=t1, c=c, length=length, row0=row0, st=st, row_factor_ref=row_factor_ref, widened=widened,
                    values_ready=values_ready, values_free=values_free, scale_ring=scale_ring)
  consumers = shipped_consumers if st.schedule is None else st.schedule.consumers
  if st.num_splits == 1:   # the output itself: written whatever the length
    consumers(program)
    return

  @pl.when(t1 > t0)
  def _():
    consumers(program)

  @pl.when((t1 == t0) & (wg == SCORER))
  def _():
    output.store_no_keys()


def _build(st: Static, interpret: Any):
  out_shape = (st.smem.v_dim, st.rows_as_n) if st.rows_as_n else (st.out_rows, st.smem.v_dim)
  out_type = (jax.ShapeDtypeStruct((st.batch, st.num_splits, *out_shape), st.smem.out_dtype),
              jax.ShapeDtypeStruct((st.batch, st.num_splits, st.lse_rows), jnp.float32))
  name = (f"pallas_kv_mla_paged_r{st.num_queries * st.group}_d{st.smem.qk_dim}_v{st.smem.v_dim}"
          f"_bkv{st.tiling.block_kv}_st{st.smem.num_stages}_sp{st.num_splits}_ps{st.tiling.page_size}"
          f"{SHIPPED_SUFFIX if st.schedule is None else st.schedule.suffix}"
          f"{'_balanced' if st.balanced else ''}{'_ordered' if st.ordered else ''}"
          f"{f'_n{st.rows_as_n}' if st.rows_as_n else ''}"
          f"{st.codegen.name}{f'_{st.tile_math.name}' if st.tile_math.name else ''}"
          f"{f'_{st.smem.kv_dtype.name}' if st.smem.quantized else ''}{'_ks' if st.smem.token_scales else ''}"
          f"{'_q1' if st.smem.quantized and st.smem.q_terms == 1 else ''}")
  return plgpu.kernel(
      functools.partial(_kernel, st=st),
      out_type=out_type,
      scratch_types=st.smem.scratch_types(),
      grid=st.grid,
      grid_names=("batch", "split", "rows"),
      num_threads=VALUE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=st.smem.reduction_scratch_bytes,
                                           unsafe_no_auto_barriers=st.codegen.explicit_barriers,
                                           **(st.trace.compiler_params() if st.trace else {})),
      interpret=interpret,
      kernel_name=name,
  )


def mla_partials(q, kv_pages, lengths, block_tables, *, num_queries: int, v_head_dim: int, scale: float,
                 config: MosaicMLAConfig, plan: SplitPlan, kv_scale=None, query_terms: int = 2,
                 tile_math: TileMath = TileMath(), codegen: Codegen = Codegen(), interpret: Any = False):
  """Split-K partials of MLA decode over a paged latent cache.

  q: [B, R, Dqk] in the cache's dtype (bf16 / fp16; over an fp8 cache, fp16 or bf16), R = S * Hq packed rows
    (S = num_queries): row r = s * Hq + h is new token s of head h, at lengths[b] - S + s, seeing keys t <= that
    position.
  kv_pages: [P, page_size, Dqk]; keys are whole rows, values the first v_head_dim columns. float8_e4m3fn /
    float8_e5m2 pages are read as they are and widened in the kernel.
  kv_scale: an fp8 cache's scale: None (1), a scalar or [1], or per token [P, page_size] (or [P, page_size, 1]).
  query_terms: over an fp8 cache, Q's fp8 terms: 2 (bf16's error) or 1 (fp8's error, half Q K^T's MMA time).
  lengths: int32 [B]; block_tables: int32 [B, max_pages] (both clamped in the kernel).
  scale: the logit scale; config: a complete MosaicMLAConfig (a variant config runs its schedule); plan:
    its `SplitPlan` (not stream-K; grid slot i takes sequence plan.order[i] when given); tile_math:
    `TileMath`; codegen: `Codegen`; interpret: False or a plgpu.InterpretGPUParams.

  Returns (out [B, splits, R, v_head_dim] in q's dtype, each split's normalised output, unwritten for
  an empty split; lse [B, splits, R] f32, natural log, -inf where a split saw no key). Inside
  `trace.tracing(...)` the kernel also writes its timeline from inside (a diagnostic; GPU only).
  """
  if q.ndim != 3 or kv_pages.ndim != 3 or q.shape[2] != kv_pages.shape[2]:
    raise ValueError(f"q [B, R, Dqk] and kv_pages [P, page_size, Dqk] must share Dqk: {q.shape=} {kv_pages.shape=}")
  quantized = jnp.dtype(kv_pages.dtype).itemsize == 1
  if jnp.dtype(q.dtype) not in frame.KV_DTYPES or not (quantized or q.dtype == kv_pages.dtype):
    raise ValueError(f"q must be bf16 / fp16, of kv_pages' dtype unless that is one byte; got {q.dtype=} "
                     f"{kv_pages.dtype=}")
  if kv_scale is not None and not quantized:
    raise ValueError(f"kv_scale widens an fp8 cache, not a {jnp.dtype(kv_pages.dtype).name} one")
  B, R, D = q.shape
  if R % num_queries:
    raise ValueError(f"{num_queries=} must divide the packed rows {R=}")
  reason = mla_config.mla_reason(D, v_head_dim, kv_pages.dtype)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  page_size = kv_pages.shape[1]
  token_scales = kv_scale is not None and jnp.ndim(kv_scale) >= 2   # [P, page_size(, 1)]
  check_config(config, qk_dim=D, v_dim=v_head_dim, dtype=q.dtype, page_size=page_size, rows=R,
               kv_dtype=kv_pages.dtype, one_byte_rows_as_n=codegen.one_byte_rows_as_n)
  if plan.stream_k:
    raise ValueError("the MLA kernel takes the per-sequence or balanced plan, not stream-K")
  if codegen.explicit_barriers and variant_schedule(config) is not None:
    raise ValueError("Codegen(explicit_barriers=True) syncs the shipped schedule's stores only, not an experimental "
                     "schedule's")
  plan.check(block_kv=config.block_kv, batch=B)
  kv_tiling = tiling.KVTiling(config.block_kv, D, kv_pages.dtype, page_size=page_size,
                              num_pages=kv_pages.shape[0], max_pages=block_tables.shape[1])
  smem = MlaSmem.for_call(config, qk_dim=D, v_dim=v_head_dim, dtype=q.dtype, page_size=page_size, rows=R,
                          kv_dtype=kv_pages.dtype, token_scales=token_scales, query_terms=query_terms,
                          one_byte_rows_as_n=codegen.one_byte_rows_as_n)
  num_row_blocks = 1 if smem.rows_as_n else row_blocks(R)
  rows_padded = smem.rows_as_n or num_row_blocks * ROWS
  out_rows = R if num_row_blocks == 1 else rows_padded
  st = Static(num_queries=num_queries, group=R // num_queries, out_rows=out_rows,
              lse_rows=split_plan.round_up(smem.rows_as_n or out_rows, LSE_ROW_MULTIPLE),
              num_row_blocks=num_row_blocks, num_splits=plan.num_splits, batch=B, scale=float(scale),
              tiling=kv_tiling, smem=smem, interpret=bool(interpret), balanced=plan.balanced, ordered=plan.ordered,
              rows_as_n=smem.rows_as_n, schedule=variant_schedule(config), tile_math=tile_math, codegen=codegen,
              trace=mgpu_trace.active())
  if rows_padded != R:
    q = jnp.pad(q, ((0, 0), (0, rows_padded - R), (0, 0)))
  kv = kv_pages.reshape(*kv_pages.shape[:2], 1, D)   # KVTiling's [P, page_size, Hkv, D]
  tiles = [] if plan.tiles_per_split is None else [plan.tiles_per_split]
  order = [] if plan.order is None else [plan.order]
  one_byte, factor = [], None
  if quantized:
    factor = 1.0 if kv_scale is None or token_scales else jnp.reshape(kv_scale, ()).astype(jnp.float32)
    q, row_factor = split_query(q, factor, smem.q_terms)
    token_scale = []
    if token_scales:
      token_scale = [jnp.reshape(kv_scale, (-1,)).astype(jnp.float32)]   # [P * page_size], a page's run a copy
      if smem.gathered_scales:   # [B, max_pages * page_size]: a table's stale ids are clamped, their tokens masked
        token_scale = [token_scale[0].reshape(-1, page_size)[block_tables].reshape(B, -1)]
    one_byte = [row_factor] + token_scale
  out, lse = _build(st, interpret or None)(q, kv, lengths, block_tables, *tiles, *order, *one_byte)
  if st.rows_as_n:
    out = jnp.swapaxes(out, 2, 3)   # O^T [B, splits, Dv, N] -> [B, splits, N, Dv]
  if quantized and not token_scales and kv_scale is not None:   # a scalar scale: V's share, after the kernel
    out = (out.astype(jnp.float32) * factor).astype(out.dtype)
  return out[:, :, :R], lse[:, :, :R]
