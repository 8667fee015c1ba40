"""The per-tile pieces the MLA consumer schedules share: `TileMath`, `Static`, P's hand-over (`SharedP`),
Q K^T's start (`Scores`), `add_pv` and a loop's starting state; for one-byte caches, Q's two fp8 terms
(`split_query`), the value columns' widening (`widen_values`) and the scores' scales (`scaled_scores`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import online_softmax
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu.mla_config import Codegen, MlaSmem
from pallas_kv.kernels.mosaic_gpu.trace import region


@dataclasses.dataclass(frozen=True)
class TileMath:
  """What the kernel does with each KV tile: its load, the consumers' slot waits, Q K^T, the masked online
  softmax (not split_scores'), P V. Measurement probes subclass it; `name` goes into the kernel name."""
  name: str = ""

  def load_tile(self, load, unloaded, row_block):
    """The producer's turn at a ring slot: load() copies the tile in; unloaded() marks the slot full
    without a copy. row_block: the program's block of q rows."""
    load()

  def read_slot(self, ring: pipeline.Ring, step):
    """The slot the shipped consumers compute step's tile on: waited for before they read it."""
    return ring.wait(step)

  def release_slot(self, ring: pipeline.Ring, step):
    """Frees step's slot once the shipped consumer is done with it."""
    ring.release(step)

  def qk(self, s_ref, q_tile, k_tile):
    plgpu.wgmma(s_ref, q_tile, k_tile)

  def widen(self, slot, widened, w: int, st: "Static", valid_rows=None):
    """A one-byte slot's value columns of consumer w into widened[w] (`widen_values`)."""
    widen_values(slot, widened, w, st, valid_rows)

  def pv(self, acc_ref, p_tile, v_tile):
    plgpu.wgmma(acc_ref, p_tile, v_tile)

  def softmax(self, s, m_i, l_i, *, tile, length, row0, masked: bool, st: "Static", row_factor=None,
              log2_units=None):
    """(alpha, m, l, p f32) from raw scores s [64, bkv] f32 (rows as N: S^T [bkv, N]); row_factor: each row's
    factor ([64], WGMMA rows: an fp8 Q's), folded into the softmax's scale, or None; log2_units: p divided by a
    running c (`online_softmax.rescale_step`), or None."""
    rows_axis = 1 if st.rows_as_n else 0
    if row_factor is None:
      s = online_softmax.log2_logits(s, scale=st.scale, softcap=None)
    else:   # one multiply per score for both
      s = s * online_softmax.per_row(row_factor * (st.scale * online_softmax.LOG2E), s.shape, rows_axis)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, rows_axis, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1 - rows_axis, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * st.tiling.block_kv, length=length,
                                  num_queries=st.num_queries, group=st.group, window=None)
      s = jnp.where(ok, s, -jnp.inf)   # also drops NaN scores of keys past the length
    return online_softmax.rescale_step(s, m_i, l_i, rows_axis=rows_axis, log2_units=log2_units)


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernel body needs to know at trace time."""
  num_queries: int
  group: int            # Hq: packed row r is token r // Hq of head r % Hq
  out_rows: int
  lse_rows: int
  num_row_blocks: int
  num_splits: int
  batch: int
  scale: float
  tiling: tiling.KVTiling
  smem: MlaSmem
  interpret: bool       # GPU interpret mode cannot run pl.run_state
  balanced: bool = False
  ordered: bool = False
  rows_as_n: int = 0    # MlaSmem.rows_as_n
  schedule: Any = None  # an experimental consumer schedule (mla_config.variant_schedule); None: the shipped one
  tile_math: TileMath = TileMath()
  codegen: Codegen = Codegen()
  trace: Any = None     # a trace.KernelTrace: the call's timeline from inside (a diagnostic), or None

  @property
  def half_v(self) -> int:
    return self.smem.half_v

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.batch, self.num_splits, self.num_row_blocks)   # the last dim launches fastest


@dataclasses.dataclass(frozen=True)
class SharedP:
  """The scorer's P [64, bkv] and alpha (rows[0]; rows[1]: the final row sum) handed to the partner:
  `ready` when stored, `free` when the partner's P V is done; both sides visit every tile in order."""
  p: Any
  rows: Any
  ready: Any
  free: Any
  vector_layout: Any = plgpu.Layout.WGMMA.reduce(1)

  def publish(self, p16, alpha, *, wait_free):
    @pl.when(wait_free)
    def _():
      with region("wait_p_free"):
        plgpu.barrier_wait(self.free)
    self.p[...] = p16
    self.rows[0] = alpha
    plgpu.commit_smem()   # generic-proxy stores, read next by wgmma (the async proxy)
    plgpu.barrier_arrive(self.ready)

  def receive(self):
    with region("wait_p"):
      plgpu.barrier_wait(self.ready)
    return plgpu.load(self.rows.at[0], layout=self.vector_layout)

  def hand_back(self):
    plgpu.barrier_arrive(self.free)


def add_pv(acc, parts, st: Static, meanwhile=None):
  """acc [64, Dv/2] f32 + the sum of P V over parts ((P, V) pairs); meanwhile() runs while the wgmma does."""
  def mma(acc_ref):
    for p, v in parts:
      st.tile_math.pv(acc_ref, p, v)
    if meanwhile is not None:
      meanwhile()

  with region("pv"):   # the products' issue and wait
    if st.interpret:
      def staged(acc_ref):
        mma(acc_ref)
        return acc_ref[...]
      return acc + pl.run_scoped(staged, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def start_state(acc_shape, rows_axis: int = 0):
  """A loop's carry (acc 0, max -inf, row sum 0), the q rows on acc's rows_axis."""
  rows, vector_layout = acc_shape[rows_axis], plgpu.Layout.WGMMA.reduce(1 - rows_axis)
  return (plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), vector_layout),
          plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), vector_layout))


@dataclasses.dataclass(frozen=True)
class Scores:
  """Starts S = Q K^T of a tile's ring slot into s_ref [64, bkv] f32, zeroing its values past the length."""
  q_block: Any
  length: Any
  st: Static
  q_index: Any = None   # this consumer's row of zeros (`zero_row`), for Codegen's opaque indices

  @property
  def q_smem(self):
    return self.q_term(0)

  def q_term(self, term: int):
    return self.q_block.at[self.q_index[0].astype(jnp.int32) + term if self.st.codegen.q_per_tile else term]

  def start(self, s_ref, tile, slot):
    if self.st.smem.quantized:   # two fp8 terms of Q against the fp8 keys; keys past the length are masked
      for term in range(self.st.smem.q_terms):
        q = self.q_term(term)
        if self.st.rows_as_n:   # S^T = K Q^T: both K-major, as fp8 wgmma needs
          self.st.tile_math.qk(s_ref, slot, q.transpose((1, 0)))
        else:
          self.st.tile_math.qk(s_ref, q, slot.transpose((1, 0)))
      return
    self.zero_past(tile, [(slot, self.st.smem.v_dim)])
    self.st.tile_math.qk(s_ref, self.q_smem, slot.transpose((1, 0)))

  def zero_past(self, tile, parts):
    """Zeroes rows past the length of parts: (SMEM ref, value columns) pairs."""
    valid_rows = self.length - tile * self.st.tiling.block_kv

    @pl.when(valid_rows < self.st.tiling.block_kv)
    def _():
      for part, width in parts:
        tiling.zero_rows_past(part, valid_rows, width=width)


def zero_row(row_smem, w: int, st: Static):
  if not (st.codegen.q_per_tile or st.codegen.slots_per_tile):
    return None
  row = row_smem.at[st.smem.zero_rows + w]
  row[0] = jnp.float32(0)
  return row




# ---------------------------------------------------------------- one-byte caches

FP8_MAX = 448.0      # float8_e4m3fn's largest value: each q row is scaled to it
WIDEN_CHUNK = 64     # value columns widened per step: one 128-byte swizzle row of the 16-bit tile


def split_query(q, factor, terms: int = 2):
  """q [B, R, Dqk] as two float8_e4m3fn terms [B, 2, R, Dqk], hi + lo, scaled row by row to FP8_MAX: together
  they keep ~8 significant bits (bf16 has 8), so fp8 wgmma computes Q K^T with bf16's error. Also returns each
  row's factor [B, R] f32, factor (a scalar kv_scale, or 1) over the row's scale, by which S's rows are multiplied.
  terms=1: hi alone [B, 1, R, Dqk] (fp8's error, half the MMA time; docs/decisions.md#mla-fp8-query-terms)."""
  q = q.astype(jnp.float32)
  amax = jnp.max(jnp.abs(q), axis=-1)
  row_scale = jnp.where(amax > 0, FP8_MAX / jnp.where(amax > 0, amax, 1.0), 1.0)
  scaled = q * row_scale[..., None]
  hi = scaled.astype(jnp.float8_e4m3fn)
  # The barrier keeps hi's rounding: XLA on GPU may fold the round trip f32 -> fp8 -> f32 away (excess
  # precision), which made lo all zeros there.
  lo = (scaled - lax.optimization_barrier(hi).astype(jnp.float32)).astype(jnp.float8_e4m3fn)
  return jnp.stack([hi, lo][:terms], axis=1), jnp.asarray(factor, jnp.float32) / row_scale


def widen_values(slot, widened, w: int, st: Static, valid_rows=None):
  """Consumer w's value columns [w Dv/2, (w + 1) Dv/2) of a one-byte slot [bkv, Dqk], widened exactly into
  widened[w] [bkv, Dv/2] (16-bit), rows >= valid_rows zeroed (given), fenced for wgmma. The slot stays held."""
  for start in range(0, st.half_v, WIDEN_CHUNK):
    values = plgpu.load(slot.at[:, pl.ds(w * st.half_v + start, WIDEN_CHUNK)], layout=plgpu.Layout.WGMMA_8BIT)
    values = values.astype(jnp.float16).astype(st.smem.dtype)   # Hopper converts fp8 to f16 only
    if valid_rows is not None:
      values = tiling.rows_below(values, valid_rows, plgpu.Layout.WGMMA_8BIT)
    widened[w].at[:, pl.ds(start, WIDEN_CHUNK)][...] = values
  plgpu.commit_smem()


def running_value_scale(c_i, key_scales, *, keys_axis: int, valid_keys=None):
  """The running max c of the value scales met, after a tile's key_scales [bkv] (the same for every row: c_i [rows]
  stays a splat): P times a key's scale over c stays within [0, 1], where f16 (P V's operand over a one-byte cache)
  keeps its precision; P times the scale alone falls below f16's normal range (6.1e-5) for a cache of small values
  (a scale of amax / 448). valid_keys: a masked tile's keys from it on are left out (their scales may be inf or
  NaN). One reduction of the [bkv] vector, not one per row."""
  scales = key_scales
  if valid_keys is not None:
    keys = plgpu.broadcasted_iota(jnp.int32, key_scales.shape, 0, layout=plgpu.Layout.WGMMA.reduce(1 - keys_axis))
    scales = jnp.where(keys < valid_keys, scales, 0.0)
  return jnp.maximum(c_i, scales.max())


def scaled_scores(s, key_scales=None, *, keys_axis: int = 1):
  """Raw fp8 scores s [64, bkv] f32 (rows as N: S^T [bkv, N], keys_axis 0) times each key's scale ([bkv], a
  vector over keys_axis; given). Each row's factor goes into the softmax's scale (`TileMath.softmax`)."""
  if key_scales is not None:
    s = s * lax.broadcast_in_dim(key_scales, s.shape, [keys_axis])
  return s
