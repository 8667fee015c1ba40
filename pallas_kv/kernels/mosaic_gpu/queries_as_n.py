"""The GQA consumer over a 16-bit cache with the queries as wgmma's N (`queries_as_n`, <= 16 packed rows).

A GQA group of a few packed rows padded to wgmma's M = 64 does four to sixteen times the products and the softmax
it needs, on one consumer's serial chain per tile (Q K^T, softmax, P V), which can bound a program rather than HBM.
Turned around, the rows fill N = 16 (measured level with the padded rows where pipeline_qk overlaps the chain:
docs/decisions.md#mosaic-16-bit-queries-as-n):
  S^T = K Q^T   K's slot [bkv, D] as A, q's first 16 rows [16, D] read transposed as B (both K-major);
  softmax       down S^T's 16 columns; the keys are M, so the running max crosses warps (one reduction a tile) and
                the row sums are kept per score, summed once at the end (as `fp8_operands.consume_as_n` does);
  O^T += V^T P^T  V's slot [bkv, D] read transposed as A (a 16-bit operand may be; stored tokens last it is V^T
                already), P stored [16, bkv] in q's dtype and read transposed as K-major B.
wgmma takes one swizzle for both operands: P's SMEM is swizzled as the V slot (`config.DecodeSmem`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import online_softmax
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import fp8_operands
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tile_feeds
from pallas_kv.kernels.mosaic_gpu.trace import region

QUERY_COLUMNS = mgpu_config.AS_N_COLUMNS


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One consumer's refs: q's rows [64, D] (its first 16 read), the K and V rings (V's slots [bkv, D], or [D, bkv]
  stored tokens last) and P [16, bkv] in q's dtype (`config.DecodeSmem`'s p_t). No scales: a 16-bit cache."""
  q: Any
  k_ring: pipeline.Ring
  v_ring: pipeline.Ring
  p: Any
  v_tokens_last: bool = False
  k_scales: None = None   # (`fp8_operands.run_tiles` frees the scale rings of a loads-only probe: none here)
  v_scales: None = None


def consume(tiles: Tiles, *, length, row0, t0, t1, a, c, step0, st, start=None, interpret=False):
  """(acc^T [D, 16], m [16], l [16]) over tiles [t0, t1) ([a, c) unmasked); ring step step0 + i holds tile t0 + i;
  keys before a window `start` (given) are masked. Vectors over the queries take the WGMMA columns' layout."""
  bkv, n = st.tiling.block_kv, QUERY_COLUMNS
  per_query = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
  factor = online_softmax.logit_factor(st.options.scale, st.options.softcap)
  s_type = plgpu.ACC((bkv, n), jnp.float32)
  values = tile_feeds.RingTiles(tiles.v_ring, tokens_last=tiles.v_tokens_last)

  def issue_qk(s_ref, k_slot):
    plgpu.wgmma(s_ref, k_slot, tiles.q.at[pl.ds(0, n)].transpose((1, 0)))

  def logits(s, tile, masked: bool):
    """Raw S^T [bkv, 16] as log2-unit logits, -inf where a query does not see the key (masked tiles)."""
    s = online_softmax.log2_logits_prescaled(s * factor, softcap=st.options.softcap)
    return fp8_operands.masked_keys(s, tile=tile, length=length, row0=row0, st=st, start=start) if masked else s

  def scores(i, tile, masked: bool):
    return logits(fp8_operands.raw_scores(tiles.k_ring, i, issue_qk, s_type), tile, masked)

  @region("softmax")
  def softmax(z, acc, m_i, l_part):
    """One tile of the online softmax down z's columns, P stored for P V; (acc, m, l_part) after it."""
    m_new = jnp.maximum(m_i, z.max(axis=0))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a query with no key yet: exp2 gives 0, not NaN
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(z - per_query(m_use, z.shape))
    # P^T [bkv, 16] in registers; stored as P [16, bkv] through a transposed view (wgmma's K-major B).
    tiles.p.transpose((1, 0))[...] = plgpu.layout_cast(p.astype(tiles.p.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    return acc * per_query(alpha, acc.shape), m_new, l_part * per_query(alpha, z.shape) + p

  @region("pv")
  def pv(acc, i, tile, masked: bool):
    # V's keys past the length (or before a window start) zeroed in the slot: 0 x NaN is NaN in P V.
    valid = length - tile * bkv if masked else None
    first = None if start is None or not masked else start - tile * bkv
    v_tile = values.fetch(i, valid, first)   # [bkv, D] (a transposed view of a slot stored tokens last)
    v_t = tiles.v_ring.slot(i) if tiles.v_tokens_last else v_tile.transpose((1, 0))   # V^T: wgmma's A
    plgpu.commit_smem()   # P's stores (and the zeroed keys) before wgmma reads them

    def mma(acc_ref):
      plgpu.wgmma(acc_ref, v_t, tiles.p.transpose((1, 0)))

    acc = fp8_operands.accumulate(acc, mma, interpret=interpret)
    values.done(i)
    return acc

  def tile_math(z, i, tile, carry, masked: bool):
    acc, m_new, l_part = softmax(z, *carry)
    return pv(acc, i, tile, masked), m_new, l_part

  d = st.tiling.head_dim
  acc = plgpu.layout_cast(jnp.zeros((d, n), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
  l_part = plgpu.layout_cast(jnp.zeros((bkv, n), jnp.float32), plgpu.Layout.WGMMA)   # summed at the end
  acc, m_i, l_part = fp8_operands.run_tiles(
      (acc, m_i, l_part), lambda tile, i, carry, masked: tile_math(scores(i, tile, masked), i, tile, carry, masked),
      lambda tile, i, s_raw, carry, masked: tile_math(logits(s_raw, tile, masked), i, tile, carry, masked),
      tiles=tiles, issue_qk=issue_qk, s_type=s_type, st=st, t0=t0, t1=t1, a=a, c=c, step0=step0, start=start)
  return acc, m_i, l_part.sum(axis=0)
