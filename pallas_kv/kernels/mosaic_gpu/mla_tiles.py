"""The per-tile pieces of the MLA kernel (`mla.py`), shared by its consumer schedules: what a tile
computes (`TileMath`), the trace-time facts (`Static`), P's hand-over (`SharedP`), Q K^T's start
(`Scores`), P V (`add_pv`) and a loop's starting state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels import online_softmax
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu.mla_config import Codegen, MlaSmem

@dataclasses.dataclass(frozen=True)
class TileMath:
  """What the consumers compute on each KV tile: Q K^T, the masked online softmax and P V.

  The kernel uses this class as is. A measurement probe may subclass it and leave a stage out (its
  results are then wrong by design) to see where a tile's time goes; `name` goes into the kernel
  name so that profiles tell them apart. (`split_scores` runs its own softmax, not `softmax`.)
  """
  name: str = ""
  load_tiles: bool = True   # False (a probe): the producer marks slots full without loading them
  # False (a probe; the plain schedule only): the consumers read a slot before its copy lands and
  # wait for it only before releasing it, so the loads' SMEM traffic stays and their waits go.
  wait_for_loads: bool = True
  # True (a probe): only row block 0's producer loads; the others mark their slots full unloaded,
  # so the L2-to-SM traffic of a 128-head sequence halves, as multicasting each tile to a cluster
  # of both row blocks would (with all of its SMEM writes gone too: an upper bound on that gain).
  first_row_block_loads_only: bool = False

  def qk(self, s_ref, q_tile, k_tile):
    """Starts S = q_tile k_tile into the accumulator s_ref (SMEM operands, either orientation)."""
    plgpu.wgmma(s_ref, q_tile, k_tile)

  def pv(self, acc_ref, p_tile, v_tile):
    """Starts acc_ref += p_tile v_tile (SMEM operands, either orientation)."""
    plgpu.wgmma(acc_ref, p_tile, v_tile)

  def softmax(self, s, m_i, l_i, *, tile, length, row0, masked: bool, st: "Static"):
    """One tile of the online softmax on raw scores s [64, bkv] f32, or S^T [bkv, N] with rows as
    N: (alpha, m, l, p f32 shaped as s)."""
    rows_axis = 1 if st.rows_as_n else 0
    s = online_softmax.log2_logits(s, scale=st.scale, softcap=None)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, rows_axis, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1 - rows_axis, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * st.tiling.block_kv, length=length,
                                  num_queries=st.num_queries, group=st.group, window=None)
      s = jnp.where(ok, s, -jnp.inf)   # also drops NaN scores of keys past the length
    return online_softmax.rescale_step(s, m_i, l_i, rows_axis=rows_axis)


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernel body needs to know at trace time."""
  num_queries: int      # S
  group: int            # Hq: packed row r is token r // Hq of head r % Hq
  out_rows: int         # rows of the out array
  lse_rows: int         # rows of the lse array (multiple of 4)
  num_row_blocks: int
  num_splits: int
  batch: int
  scale: float
  tiling: tiling.KVTiling
  smem: MlaSmem
  interpret: bool       # GPU interpret mode (jax 0.11.2) cannot run pl.run_state
  pipeline_qk: bool = False   # the scorer issues tile i+1's Q K^T before tile i's softmax
  split_scores: bool = False  # both consumers score half of each tile (`_score_half_tiles`)
  balanced: bool = False      # the balanced split plan: tiles per split from an int32 [1] input
  ordered: bool = False       # the sequence order: batch slot -> sequence from an int32 [B] input
  rows_as_n: int = 0          # q rows as wgmma N (`_rows_as_n_consumers`), this many padded rows; 0: off
  alternate_scores: bool = False   # the consumers score alternate tiles (`_alternate_consumer`)
  ring_halves: bool = False   # the ring's slots in two column parts (`Scores.start_halves`)
  p_in_registers: bool = False   # the scorer's P V with P from registers (not in interpret mode)
  tile_math: TileMath = TileMath()
  codegen: Codegen = Codegen()

  @property
  def half_v(self) -> int:
    return self.smem.half_v

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.batch, self.num_splits, self.num_row_blocks)   # the last dim launches fastest


@dataclasses.dataclass(frozen=True)
class SharedP:
  """The scorer's P and row rescale of the current tile, handed to the partner through SMEM.

  p [64, bkv] (wgmma A operand), rows [2, 64] f32: row 0 alpha, row 1 the final row sum.
  p_ready: the scorer stored P and alpha (one arrival); p_free: the partner's P V is done with
  them (one arrival). Each side visits every tile in order (barrier phases are per thread).
  """
  p: Any
  rows: Any
  ready: Any
  free: Any
  vector_layout: Any = plgpu.Layout.WGMMA.reduce(1)   # alpha's layout (reduce(0) with rows as N)

  def publish(self, p16, alpha, *, wait_free):
    """Scorer: waits until the partner is done with the previous tile's P, then stores this one."""
    @pl.when(wait_free)
    def _():
      plgpu.barrier_wait(self.free)
    self.p[...] = p16
    self.rows[0] = alpha
    plgpu.commit_smem()   # generic-proxy stores, read next by wgmma (the async proxy)
    plgpu.barrier_arrive(self.ready)

  def receive(self):
    """Partner: waits for the tile's P; returns alpha [64] f32 (WGMMA row layout)."""
    plgpu.barrier_wait(self.ready)
    return plgpu.load(self.rows.at[0], layout=self.vector_layout)

  def hand_back(self):
    plgpu.barrier_arrive(self.free)


def add_pv(acc, parts, st: Static, meanwhile=None):
  """acc + P @ V on the tensor cores: acc [64, Dv/2] f32 (WGMMA layout); parts: (P, V) pairs in
  SMEM (P also in registers) whose products add up to P V (one pair, or P's column blocks with V's
  matching row blocks). meanwhile(): run after the wgmma is issued, before it is waited on."""
  def mma(acc_ref):
    for p, v in parts:
      st.tile_math.pv(acc_ref, p, v)
    if meanwhile is not None:
      meanwhile()

  if st.interpret:
    def staged(acc_ref):
      mma(acc_ref)
      return acc_ref[...]
    return acc + pl.run_scoped(staged, plgpu.ACC(acc.shape, jnp.float32))
  return pl.run_state(mma)(plgpu.ACC.init(acc))


def start_state(acc_shape, rows_axis: int = 0):
  """(acc 0 [acc_shape] f32 in the WGMMA layout, running max -inf, row sum 0 over the q rows of
  acc's rows_axis: 1 with rows as N): a loop's carry."""
  rows, vector_layout = acc_shape[rows_axis], plgpu.Layout.WGMMA.reduce(1 - rows_axis)
  return (plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), vector_layout),
          plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), vector_layout))


@dataclasses.dataclass(frozen=True)
class Scores:
  """Starts S = Q K^T of a tile (its ring slot [bkv, Dqk]) into s_ref [64, bkv] f32, after zeroing
  the values of rows past the length (only a sequence's last tile has any)."""
  q_block: Any   # [1, 64, Dqk]: Q is q_block.at[0]
  length: Any
  st: Static
  q_index: Any = None   # Codegen's per-tile options: this consumer's row of zeros in SMEM (`zero_row`)

  @property
  def q_smem(self):
    """Q [64, Dqk]; with Codegen.q_per_tile at a 0 loaded each tile (descriptors rebuilt per tile)."""
    return self.q_block.at[self.q_index[0].astype(jnp.int32) if self.st.codegen.q_per_tile else 0]

  def ring_step(self, j):
    """Step j, with Codegen.slots_per_tile plus a 0 loaded each tile (its slot stays unknown)."""
    return j + self.q_index[0].astype(jnp.int32) if self.st.codegen.slots_per_tile else j

  def start(self, s_ref, tile, slot):
    self.zero_past(tile, [(slot, self.st.smem.v_dim)])
    if self.st.rows_as_n:   # S^T [bkv, N] = K Q^T
      self.st.tile_math.qk(s_ref, slot, self.q_smem.transpose((1, 0)))
    else:
      self.st.tile_math.qk(s_ref, self.q_smem, slot.transpose((1, 0)))

  def start_halves(self, s_ref, ring: pipeline.Ring, i):
    """ring_halves: S = Q K^T over the first column part once it lands, then over the second.
    Values past the length are zeroed afterwards (`zero_past`), not before: their scores are
    masked, and the wgmma must be done reading the tile before the scorer writes it."""
    for part in (0, 1):
      columns = pl.ds(*ring.spec.part_columns(part))
      self.st.tile_math.qk(s_ref, self.q_smem.at[:, columns], ring.wait(i, part).transpose((1, 0)))

  def start_from(self, s_ref, ring: pipeline.Ring, step, tile):
    """Starts S of step's tile (tile from the sequence's start) once it lands: the whole slot
    (`start`), or with ring halves part by part (`start_halves`; then `zero_past_parts`)."""
    if self.st.ring_halves:
      self.start_halves(s_ref, ring, step)
    else:
      self.start(s_ref, tile, ring.wait(step) if self.st.tile_math.wait_for_loads else ring.slot(step))

  def zero_past_parts(self, ring: pipeline.Ring, step, tile):
    """ring_halves: zeroes the values past the length in both parts of step's tile, once Q K^T
    has read them and before either P V does."""
    self.zero_past(tile, [(ring.slot(step, part), self.st.half_v) for part in (0, 1)])

  def zero_past(self, tile, parts):
    """Zeroes the values of rows past the length in a tile: parts are (SMEM ref, its number of
    value columns) pairs, the slot itself or its column parts."""
    valid_rows = self.length - tile * self.st.tiling.block_kv

    @pl.when(valid_rows < self.st.tiling.block_kv)
    def _():
      for part, width in parts:
        tiling.zero_rows_past(part, valid_rows, width=width)


def zero_row(row_smem, w: int, st: Static):
  """Codegen's per-tile options: consumer w's zero for `Scores.q_index`, written and read by w."""
  if not (st.codegen.q_per_tile or st.codegen.slots_per_tile):
    return None
  row = row_smem.at[st.smem.zero_rows + w]
  row[0] = jnp.float32(0)
  return row


