"""The GQA consumer over an fp8 cache with V stored tokens last: wgmma reads the fp8 tiles as they are.

Both products then have K-major fp8 operands (K [bkv, D], V [D, bkv]), so nothing is widened:
  Q K^T  Q as two e4m3 terms (hi + lo, each row scaled to 448: `split_rows`; ~8 significant bits, bf16's), two
         wgmmas over the K slot; S's rows times their factors, its columns times the keys' per-token scales.
  P V    P times the values' per-token scales, over c (each row's running max of the scales it has seen), times
         448, as two e4m3 terms staged in SMEM, two wgmmas over the V slot read transposed. 1 / c rides in the
         softmax's shift: exp2(s - m - log2 c) = P / c, so that acc and the row sum l are kept in units of 1 / c (acc
         also of 448) and one rescale a tile, exp2 of the shift's change, covers both m's growth and c's.
Rows past a length are masked in S; V's columns there are zeroed in the slot (0 x NaN is NaN in P V). With
pipeline_qk the next tile's Q K^T is issued before this tile's softmax, as in the 16-bit consumer.

`consume_as_n` (queries_as_n) turns the products around for <= 16 packed rows: S^T = K Q^T, the queries as wgmma's N,
so that the softmax works on 16 columns rather than 64 rows, and O^T = V^T P^T over V widened to f16. It also reads
an int8 cache as stored: Q as two int8 terms (hi + lo / 254, each row scaled to 127: ~15 bits), S^T of each term
exact in s32 (s8 wgmma), combined in f32. V from pages smaller than a tile arrives a page's run at a time, widened
and joined in registers. With values_as_stored (the default over dense caches) V is not widened: P^T goes to
wgmma as two one-byte terms (`stored_probability_terms`). The consumer makes Q's terms itself from q's 16-bit rows
(`split_queries`), so that the kernel is the call's only launch.
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
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import mla_tiles
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu.trace import region
from pallas_kv.kernels.mosaic_gpu import tiling

FP8_MAX = mla_tiles.FP8_MAX
FP8_OPERAND = mgpu_config.FP8_OPERAND_DTYPE
ROWS = mgpu_config.ROWS_PER_WG   # wgmma M: a consumer's packed query rows


def split_rows(q, k_head_scale=None):
  """q [B, Hkv, R, D] as two e4m3 terms [B, Hkv, 2, R, D] (`mla_tiles.split_query`) and each row's factor
  [B, Hkv, R] f32 (times the head's k_scale if given), by which S's rows are multiplied: the keys as S's columns
  (the queries as N make them in the kernel, `split_queries`)."""
  b, hkv, r, d = q.shape
  terms, factors = mla_tiles.split_query(q.reshape(b * hkv, r, d), 1.0)
  terms, factors = terms.reshape(b, hkv, 2, r, d), factors.reshape(b, hkv, r)
  if k_head_scale is not None:
    factors = factors * k_head_scale.astype(jnp.float32)[None, :, None]
  return terms, factors


# An int8 Q row is hi + lo / INT8_LOW_SCALE in units of its scale: lo, hi's rounding error (<= 1/2) times 254, fits
# int8; the two terms keep ~15 significant bits.
INT8_MAX = 127
INT8_LOW_SCALE = 2 * INT8_MAX


def split_queries(rows_ref, terms_ref, factors_ref, *, k_head_scale=None, paired: bool = False):
  """Q's two one-byte terms (terms_ref [2, 64, D], or paired [1, 64, D]) and each row's factor (factors_ref [64] f32,
  times k_head_scale if given) from q's rows (rows_ref [64, D] 16-bit, landed), fenced for wgmma: e4m3 as
  `split_rows` makes them outside a kernel; int8 q = factor (hi + lo / INT8_LOW_SCALE), factor the row's max over
  127. No XLA op (~2 µs each on the chain) then runs before the kernel. Paired, rows 16-31 hold rows 0-15 again,
  and theirs become the low terms. Rows past q's are whatever SMEM held: their scores are their own. The terms may
  take the rows' bytes (a union): every warp has read the rows before any stores."""
  int8 = terms_ref.dtype == jnp.int8
  q = plgpu.load(rows_ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  plgpu.commit_smem()   # a warpgroup barrier: the rows read, in every warp
  per_row = lambda x: lax.broadcast_in_dim(x, q.shape, [0])
  amax = jnp.max(jnp.abs(q), axis=1)
  factor = jnp.where(amax > 0, amax, 1.0) * (1.0 / (INT8_MAX if int8 else FP8_MAX))
  units = q * per_row(1.0 / factor)
  if int8:   # rounded to nearest (ties to even: one instruction): |lo| <= INT8_LOW_SCALE / 2
    nearest = lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    hi = nearest(units)
    lo = nearest((units - hi) * INT8_LOW_SCALE)
  else:
    hi = units.astype(FP8_OPERAND).astype(jnp.float32)
    lo = units - hi
  if paired:
    low_rows = plgpu.broadcasted_iota(jnp.int32, q.shape, 0, layout=plgpu.Layout.WGMMA) >= QUERY_COLUMNS
    terms_ref.at[0][...] = jnp.where(low_rows, lo, hi).astype(terms_ref.dtype)
  else:
    terms_ref.at[0][...] = hi.astype(terms_ref.dtype)
    terms_ref.at[1][...] = lo.astype(terms_ref.dtype)
  factors_ref[...] = factor if k_head_scale is None else factor * k_head_scale
  plgpu.commit_smem()


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
  """One consumer's refs: Q's terms [2, 64, D] and their factors [64] (SMEM), the K and V rings and their
  per-token scale rings (None: no per-token scale), P's terms (hi, lo), each [64, bkv] in SMEM."""
  q_terms: Any
  q_factors: Any
  k_ring: pipeline.Ring
  v_ring: pipeline.Ring
  k_scales: pipeline.Ring | None
  v_scales: pipeline.Ring | None
  p_terms: Any


def column_scales(ring: pipeline.Ring, step):
  """Step's per-token scales [bkv] as WGMMA columns. The slot stays held: the caller frees it after its next
  `plgpu.commit_smem` (`pipeline.release_after_commit`), not with a fence of its own."""
  return plgpu.load(ring.wait(step), layout=plgpu.Layout.WGMMA.reduce(0))


def value_runs(v_slot) -> list[Any]:
  """V's slot as its runs [D, run] in token order: the slot [D, bkv], or each page of [pages, D, page_size]."""
  return [v_slot] if len(v_slot.shape) == 2 else [v_slot.at[j] for j in range(v_slot.shape[0])]


def zero_values_past(v_slot, *, length, start, tile, bkv):
  """V's slot [D, bkv] (or [pages, D, page_size]) of a masked tile with its columns past the length (and before a
  window start) zeroed in place, where the tile has such columns: a key that P weighs 0 must not bring NaN (0 x NaN)
  into P V."""
  valid, first = length - tile * bkv, None if start is None else start - tile * bkv

  @pl.when(valid < bkv if first is None else (valid < bkv) | (first > 0))
  def _():   # every consumer of the slot writes the same values
    for j, run in enumerate(value_runs(v_slot)):
      offset = j * run.shape[1]
      tiling.zero_columns_past(run, valid - offset, first_column=None if first is None else first - offset)


def accumulate(acc, mma, *, interpret=False):
  """acc plus what mma(acc_ref) issues into a wgmma accumulator, awaited. GPU interpret mode runs no pl.run_state:
  there the products go into a scoped accumulator of their own, added after."""
  if not interpret:
    return pl.run_state(mma)(plgpu.ACC.init(acc))

  def staged(acc_ref):
    mma(acc_ref)
    return acc_ref[...]
  return acc + pl.run_scoped(staged, plgpu.ACC(acc.shape, jnp.float32))


def probability_terms(p):
  """P f32 in [0, 1] as two fp8 terms (hi, lo) of P FP8_MAX = hi + lo, each as values e4m3 holds exactly (hi in e4m3
  already, converted by the caller; ~8 significant bits together, bf16's)."""
  wide = p * FP8_MAX
  hi = wide.astype(FP8_OPERAND)
  return hi, wide - hi.astype(jnp.float32)


def stored_probability_terms(p, *, int8: bool):
  """P f32 [keys, 16] (WGMMA layout) as its two one-byte terms in the WGMMA_TRANSPOSED layout, which P^T's K-major
  store takes: P FP8_MAX (or INT8_MAX) rounded to f16, transposed once and split after the transpose (`split_fp8`,
  `split_int8`). A one-byte array in the WGMMA layout costs shuffles to pack, and its widening back for the low
  term conversions (lowered, fp8: a third of the tile loop's shuffles); int8's terms split in f32 and transposed
  one by one took 39-45% of the consumer's span against fp8's 18% (H100 kernel traces)."""
  wide = plgpu.layout_cast((p * (INT8_MAX if int8 else FP8_MAX)).astype(jnp.float16), plgpu.Layout.WGMMA_TRANSPOSED)
  return list(split_int8(wide) if int8 else split_fp8(wide))


def split_int8(wide):
  """f16 values in [0, INT8_MAX] as two int8 terms: hi, the integer part, and lo, the rest times INT8_MAX, truncated
  (wide - hi is exact in f16): hi + lo / INT8_MAX within 1 / INT8_MAX of wide, both >= 0. With f16's rounding of
  wide (half an ulp, 2^-5 at most), P is within 3.2e-4 of (hi + lo / INT8_MAX) / INT8_MAX: bf16 rounds a P near 1
  by up to 2^-9 (2e-3)."""
  hi = wide.astype(jnp.int8)
  return hi, ((wide - hi.astype(jnp.float16)) * INT8_MAX).astype(jnp.int8)


def split_fp8(wide):
  """f16 values in [0, FP8_MAX] as two e4m3 terms: hi, wide rounded to e4m3, and lo, the rest (wide - hi, exact in
  f16 as both lie within a factor of two), rounded to e4m3: hi + lo within 2^-8 of wide, or 2^-9 below e4m3's
  normal range."""
  hi = wide.astype(FP8_OPERAND)
  return hi, (wide - hi.astype(jnp.float16)).astype(FP8_OPERAND)


def _loads_only_step(tiles):
  """A measurement probe's tile step (`TileMath.loads_only`): each ring's slot waited for and freed, no math, so that
  a kernel-only timing is the load path's own (results wrong by design)."""
  rings = [ring for ring in (tiles.k_ring, tiles.v_ring, tiles.k_scales, tiles.v_scales) if ring is not None]

  def step(tile, i, carry, masked: bool):
    del tile, masked
    for ring in rings:
      ring.wait(i)
      ring.release(i)
    return carry
  return step


def run_tiles(carry, step, pipelined, *, tiles, issue_qk, s_type, st, t0, t1, a, c, step0, start=None):
  """The carry after tiles [t0, t1), [a, c) unmasked (tiles before a only under a window or a window `start`):
  step(tile, i, carry, masked) scores ring step i itself.
  With st.pipeline_qk, pipelined(tile, i, s_raw, carry, masked) takes this tile's raw scores from the carry while the
  next tile's Q K^T (issue_qk into a scoped s_type accumulator) runs during its softmax, FA3's overlap in one
  warpgroup. K slot i is held until the step ends, so that the last step re-scores its own slot rather than branch
  around the wgmma (each landed slot is waited for once). Under a loads_only probe (`st.tile_math`) each step only
  waits for and frees the slots of `tiles`' rings."""
  k_ring, pipeline_qk = tiles.k_ring, st.pipeline_qk
  if st.tile_math.loads_only:
    step, pipeline_qk = _loads_only_step(tiles), False

  def pipelined_step(tile, carry, *, masked: bool):
    *state, s_raw = carry
    i = step0 + tile - t0
    has_next = tile + 1 < t1

    @pl.when(has_next)
    def _():
      k_ring.wait(i + 1)

    def body(s_ref):
      issue_qk(s_ref, k_ring.slot(jnp.where(has_next, i + 1, i)))
      return *pipelined(tile, i, s_raw, tuple(state), masked), s_ref[...]

    carry = pl.run_scoped(body, s_type)
    k_ring.release(i)
    return carry

  def tile_step(tile, carry, *, masked: bool):
    return step(tile, step0 + tile - t0, carry, masked)

  if pipeline_qk:   # the first tile's raw scores join the carry
    def score_first(s_ref):
      @pl.when(t1 > t0)
      def _():
        issue_qk(s_ref, k_ring.wait(step0))
      return s_ref[...]

    carry, tile_step = (*carry, pl.run_scoped(score_first, s_type)), pipelined_step
  for lo, hi, masked in plan.tile_loops(t0, t1, a, c, window=st.options.window, start=start,
                                        one_loop=st.one_tile_loop):
    carry = lax.fori_loop(lo, hi, functools.partial(tile_step, masked=masked), carry)
  return carry[:-1] if pipeline_qk else carry


def consume(tiles: Fp8Tiles, *, length, row0, t0, t1, a, c, step0, st, tile_math, start=None, interpret=False):
  """(acc, m, l) over tiles [t0, t1), [a, c) unmasked, as the 16-bit consumer's (`decode._consume`)."""
  bkv = st.tiling.block_kv
  wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
  rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
  columns = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
  row_factors = plgpu.load(tiles.q_factors, layout=wgmma_rows)

  s_type = plgpu.ACC((ROWS, bkv), jnp.float32)

  def issue_qk(s_ref, k_slot):
    """Q K^T of a landed K slot into s_ref: Q's two terms, two wgmmas (awaited by whoever reads s_ref)."""
    k_t = k_slot.transpose((1, 0))
    for term in range(2):
      plgpu.wgmma(s_ref, tiles.q_terms.at[term], k_t)

  def scaled(s, i):
    """Raw scores of step i times their rows' factors and the keys' per-token scales."""
    s = s * rows(row_factors, s.shape)
    if tiles.k_scales is not None:
      s = s * columns(column_scales(tiles.k_scales, i), s.shape)
    return s

  def scores(i):
    @region("qk")
    def qk(s_ref):
      issue_qk(s_ref, tiles.k_ring.wait(i))
      return s_ref[...]

    s = pl.run_scoped(qk, s_type)
    tiles.k_ring.release(i)
    return scaled(s, i)

  def values(i, tile, masked: bool):
    """V's slot read transposed [bkv, D], its columns past the length (and before a window start) zeroed."""
    v_slot = tiles.v_ring.wait(i)
    if masked:
      zero_values_past(v_slot, length=length, start=start, tile=tile, bkv=bkv)
    return v_slot.transpose((1, 0))

  @region("pv")
  def pv(acc, i, tile, masked: bool):
    v_t = values(i, tile, masked)

    def mma(acc_ref):
      for term in range(2):
        plgpu.wgmma(acc_ref, tiles.p_terms[term], v_t)

    acc = accumulate(acc, mma, interpret=interpret)
    tiles.v_ring.release(i)
    return acc

  @region("softmax")
  def softmax(s, i, acc, m_i, l_i, c_i, *, masked: bool):
    """The online softmax's step, its P stored as two e4m3 terms for P V; (acc, m, l, c) after it."""
    if tiles.v_scales is None:
      alpha, m_new, l_new, p = online_softmax.rescale_step(s, m_i, l_i)
      c_new = c_i
    else:
      key_scales = column_scales(tiles.v_scales, i)
      v_scales = columns(key_scales, s.shape)
      # Past the length a scale may be inf: a masked key's scale counts for nothing and its P stays 0.
      seen = jnp.where(s > -jnp.inf, v_scales, 0.0) if masked else v_scales
      c_new = jnp.maximum(c_i, seen.max(axis=1))
      alpha, m_new, l_new, p = online_softmax.rescale_step(s, m_i, l_i,
                                                           log2_units=(jnp.log2(c_i), jnp.log2(c_new)))
      p = online_softmax.times_key_scales(p, key_scales, masked=masked)
    acc = acc * rows(alpha, acc.shape)
    p_hi, p_lo = tiles.p_terms
    hi, lo = probability_terms(p)
    p_hi[...] = hi
    p_lo[...] = lo.astype(p_lo.dtype)
    plgpu.commit_smem()
    # Both scale slots were read (into S and P) before that commit, in every warp.
    pipeline.release_after_commit((tiles.k_scales, tiles.v_scales), i)
    return acc, m_new, l_new, c_new

  def logits(s, tile, masked: bool):
    return tile_math.logits(s, tile=tile, length=length, row0=row0, masked=masked, st=st, start=start)

  def tile_step_math(s, i, tile, carry, masked: bool):
    """One tile from its scores: carry (acc, m, l, c); m: the logits' running max; c: the V scales'; acc and l in
    units of 1 / c."""
    acc, m_new, l_new, c_new = softmax(logits(s, tile, masked), i, *carry, masked=masked)
    return pv(acc, i, tile, masked), m_new, l_new, c_new

  acc = plgpu.layout_cast(jnp.zeros((ROWS, st.tiling.head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), wgmma_rows)
  l_i = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wgmma_rows)
  floor = 1.0 if tiles.v_scales is None else online_softmax.MIN_VALUE_SCALE   # a row's running V scale
  c_i = plgpu.layout_cast(jnp.full((ROWS,), floor, jnp.float32), wgmma_rows)
  acc, m_i, l_i, c_i = run_tiles(
      (acc, m_i, l_i, c_i), lambda tile, i, carry, masked: tile_step_math(scores(i), i, tile, carry, masked),
      lambda tile, i, s_raw, carry, masked: tile_step_math(scaled(s_raw, i), i, tile, carry, masked),
      tiles=tiles, issue_qk=issue_qk, s_type=s_type, st=st, t0=t0, t1=t1, a=a, c=c, step0=step0,
      start=start)
  if tiles.v_scales is not None:   # the shift's units: lse = (m + log2 c) ln 2 + ln(l / c); acc / l as it is
    m_i = m_i + jnp.log2(c_i)
  return acc * (1 / FP8_MAX), m_i, l_i


def raw_scores(k_ring: pipeline.Ring, i, issue_qk, s_type):
  """S^T of K's ring step i, its slot freed: issue_qk(s_ref, k_slot) into a scoped s_type accumulator."""
  @region("qk")
  def qk(s_ref):
    issue_qk(s_ref, k_ring.wait(i))
    return s_ref[...]

  s = pl.run_scoped(qk, s_type)
  k_ring.release(i)
  return s


def masked_keys(s, *, tile, length, row0, st, start=None):
  """S^T [bkv, 16] (keys as rows, queries as columns) with -inf where a query does not see the key."""
  keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
  rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + row0
  ok = online_softmax.visible(rows, keys, tile_start=tile * st.tiling.block_kv, length=length,
                              num_queries=st.num_queries, group=st.group, window=st.options.window, start=start)
  return jnp.where(ok, s, -jnp.inf)


# Queries as wgmma N (`queries_as_n`): a GQA group of <= 16 packed rows fills N = 16, not M = 64, so the softmax's
# per-score work covers 16 columns of S^T [bkv, 16] instead of 64 rows of S, three quarters of them padding.
QUERY_COLUMNS = mgpu_config.AS_N_COLUMNS
# The floor of a V scale in the logits' shift (a key's scale may be 0: its V is then 0, its P still counts in l).
# A row's shift m is the max of logit + log2(scale), so a row sum's term, P^T over the scale = exp2(logit - m),
# stays <= 1 / floor = 2^64 (f32 holds 2^127). Scales under it would be floored, so the floor sits far below any
# real cache's (2^-24 here made a cache of values ~1e-6, scales ~3e-8, decode wrongly: error 0.08 to 1.1).
_VALUE_SCALE_FLOOR = 2.0 ** -64


@dataclasses.dataclass(frozen=True)
class AsNTiles:
  """One consumer's refs for `consume_as_n`: Q's terms [2, 64, D] (its first 16 rows read) and their factors [64],
  the K and V rings (V's slot [D, bkv], or [pages, D, page_size]: `DecodeSmem.value_pages`) and their per-token scale
  rings (None: no per-token scale), P^T [bkv, 16] f16 (values_as_stored: two one-byte terms [2, runs, 16, run], a
  block for each run of V's slot: `value_runs`) and the V slot widened to f16 [D, bkv] (SMEM, swizzled as
  `config.AS_N_SWIZZLE`; None: widened in registers instead, or not at all)."""
  q_terms: Any
  q_factors: Any
  k_ring: pipeline.Ring
  v_ring: pipeline.Ring
  k_scales: pipeline.Ring | None
  v_scales: pipeline.Ring | None
  p_t: Any
  v_wide: Any
  head: Any   # the kv head: its column of the per-token scale slots [bkv, SCALE_ROW] (scales as stored)


def consume_as_n(tiles: AsNTiles, *, length, row0, t0, t1, a, c, step0, st, start=None, interpret=False):
  """(acc^T [D, 16], m [16], l [16]) over tiles [t0, t1) ([a, c) unmasked), the queries as N:
  S^T = K Q^T (K [bkv, D] as A, Q's two one-byte terms as B, both K-major as such wgmma needs), the online softmax down
  the columns (rows_axis=1), P^T stored f16, and O^T += V^T P^T over the V slot widened to f16 (exact): V stored
  tokens last is V^T already, the A operand. Vectors over the queries take the WGMMA columns' layout.

  The keys are wgmma's M, so a reduction over them crosses warps (a warpgroup barrier and an SMEM round trip, through
  a scratch Mosaic GPU places at the same SMEM for every warpgroup: hence one consumer a program). One a tile: the
  running max, of the logits plus log2 of each key's V scale, so that P times the V scales needs no second max to
  stay <= 1. The row sums are kept per score and summed once at the end."""
  bkv, d = st.tiling.block_kv, st.tiling.head_dim
  n = QUERY_COLUMNS
  cols = plgpu.Layout.WGMMA.reduce(0)
  tokens = plgpu.Layout.WGMMA.reduce(1)
  per_query = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
  per_token = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
  # Each query's factor, times the logits' own (`online_softmax.logit_factor`): one multiply a score fewer.
  query_factors = (plgpu.load(tiles.q_factors.at[pl.ds(0, n)], layout=cols)
                   * online_softmax.logit_factor(st.options.scale, st.options.softcap))

  # Summed in f32 (int8, and fp8 with V as stored): each term's S^T in its own n columns (int8 exact in s32),
  # combined in `scaled`, and each tile's P V from zero, added to O in f32. Paired terms (Q's two in one block of 2n
  # rows): one wgmma, the same columns. Hopper's fp8 wgmma keeps fewer bits than f32 as it accumulates: fp8's terms
  # and tiles in one accumulator measured 3.4x the error, and no faster (docs/decisions.md#mosaic-values-as-stored).
  int8 = tiles.q_terms.dtype == jnp.int8
  paired = st.smem.paired_terms
  as_stored = st.smem.values_as_stored   # V read by wgmma as stored, P^T as two one-byte terms
  f32_sums = int8 or as_stored
  s_type = plgpu.ACC((bkv, 2 * n) if f32_sums else (bkv, n), jnp.int32 if int8 else jnp.float32)

  def issue_qk(s_ref, k_slot):
    """S^T of a landed K slot into s_ref: Q's two terms, two wgmmas, or paired one (awaited by whoever reads s_ref)."""
    if paired:
      plgpu.wgmma(s_ref, k_slot, tiles.q_terms.at[0, pl.ds(0, 2 * n)].transpose((1, 0)))
      return
    for term in range(2):
      target = s_ref.at[:, pl.ds(term * n, n)] if f32_sums else s_ref
      plgpu.wgmma(target, k_slot, tiles.q_terms.at[term, pl.ds(0, n)].transpose((1, 0)))

  def scores(i, tile, masked: bool):
    return scaled(raw_scores(tiles.k_ring, i, issue_qk, s_type), i, tile, masked)

  def key_scales(ring, i):
    """Step i's per-token scales of this head as a vector over the keys (S^T's rows), from the slot as stored."""
    return plgpu.layout_cast(tiling.load_token_scales(ring.wait(i), head=tiles.head), tokens)

  def scaled(s, i, tile, masked: bool):
    """(z, 1 / the keys' V scales or None) of step i's raw S^T: z the log2-unit logits plus log2 of each key's V
    scale (the logits without V scales), -inf where a query does not see the key (masked tiles)."""
    if int8:
      s = s[:, :n].astype(jnp.float32) + s[:, n:].astype(jnp.float32) * (1.0 / INT8_LOW_SCALE)
    elif f32_sums:
      s = s[:, :n] + s[:, n:]
    s = s * per_query(query_factors, s.shape)
    if tiles.k_scales is not None:
      s = s * per_token(key_scales(tiles.k_scales, i), s.shape)
    s = online_softmax.log2_logits_prescaled(s, softcap=st.options.softcap)
    inverse = None
    if tiles.v_scales is not None:
      value_scales = jnp.maximum(key_scales(tiles.v_scales, i), _VALUE_SCALE_FLOOR)
      s, inverse = s + per_token(jnp.log2(value_scales), s.shape), 1.0 / value_scales
    if masked:   # also drops NaN scores (and V scales) of keys past the length
      s = masked_keys(s, tile=tile, length=length, row0=row0, st=st, start=start)
    return s, inverse

  def p_term(term: int, run: int):
    """P^T's one-byte term over run `run` of V's slot as P [16, run_tokens] (as_stored): its own block, or paired
    the term's rows of the run's shared block."""
    return tiles.p_t.at[run, pl.ds(term * n, n)] if paired else tiles.p_t.at[term, run]
  in_registers = tiles.v_wide is None and not as_stored

  @region("widen")
  def widen_values(i, tile, masked: bool):
    """The V slot [D, bkv] as f16, its columns past the length (or before a window start) zeroed: into v_wide, or
    (in_registers) as 64-row register chunks in the WGMMA layout, the A operands of P V; as_stored: the slot
    itself, those columns zeroed in place."""
    v_slot = tiles.v_ring.wait(i)
    if as_stored:
      if masked and not int8:   # int8 holds no NaN: a masked key's P^T of 0 gives its column exactly 0
        zero_values_past(v_slot, length=length, start=start, tile=tile, bkv=bkv)
      return [v_slot]
    page_runs = len(v_slot.shape) == 3   # [pages, D, page_size] from pages smaller than a tile (`value_pages`)
    layout = plgpu.Layout.WGMMA if in_registers or page_runs else plgpu.Layout.WGMMA_8BIT
    chunks = []
    for r in range(0, d, ROWS):
      if page_runs:   # each page's untiled run of 16 or 32 columns widened, joined: one store a row block
        values = jnp.concatenate([plgpu.load(v_slot.at[j, pl.ds(r, ROWS)], layout=layout).astype(jnp.float16)
                                  for j in range(v_slot.shape[0])], axis=1)
      elif in_registers:   # one shuffle from the upcast layout to wgmma's A fragment
        values = plgpu.load(v_slot.at[pl.ds(r, ROWS)], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
        values = plgpu.layout_cast(values, layout)
      else:
        values = plgpu.load(v_slot.at[pl.ds(r, ROWS)], layout=layout).astype(jnp.float16)
      if masked:
        first = None if start is None else start - tile * bkv
        values = tiling.rows_below(values, length - tile * bkv, layout, first, axis=1)
      chunks.append(values)
    if not in_registers:   # one store (and one pair of automatic barriers) for the whole tile
      tiles.v_wide[...] = jnp.concatenate(chunks, axis=0) if len(chunks) > 1 else chunks[0]
    return chunks

  @region("softmax")
  def softmax(z, inverse, acc, m_i, l_part, *, masked: bool):
    """One tile of the online softmax down the columns of z (`scaled`), P^T stored for P V; (acc, m, l_part) after
    it. The running max m is z's, so that P^T = exp2(z - m), each key's P times its V scale, stays <= 1 (f16) with
    one reduction a tile; l_part adds P^T / V scale = exp2(logit - m), the row sums' terms, per score."""
    m_new = jnp.maximum(m_i, z.max(axis=0))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a query with no key yet: exp2 gives 0, not NaN
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(z - per_query(m_use, z.shape))
    terms = p
    if inverse is not None:
      terms = p * per_token(inverse, z.shape)
      terms = jnp.where(p > 0, terms, 0.0) if masked else terms   # 1 / a scale past the length may be NaN
    if as_stored:   # P^T as two one-byte terms, each stored as P [16, run] a run of V (f16 takes the transpose)
      run = tiles.p_t.shape[-1]
      for j in range(bkv // run):
        for term, x in enumerate(stored_probability_terms(p if run == bkv else p[j * run:(j + 1) * run], int8=int8)):
          p_term(term, j).transpose((1, 0))[...] = x
    else:
      tiles.p_t[...] = p.astype(tiles.p_t.dtype)
    return acc * per_query(alpha, acc.shape), m_new, l_part * per_query(alpha, z.shape) + terms

  @region("pv")
  def pv(acc, i, chunks):
    plgpu.commit_smem()   # P^T and V widened: generic-proxy stores that wgmma reads
    # The scale slots and the V slot were read (into S, P and v_wide) before that commit, in every warp; as_stored,
    # wgmma reads the V slot after it: freed once the products are done.
    pipeline.release_after_commit((tiles.k_scales, tiles.v_scales) + (() if as_stored else (tiles.v_ring,)), i)

    def term_products(r_ref):   # each term's products in their own n columns (int8: exact in s32)
      for j, values in enumerate(value_runs(chunks[0])):
        if paired:   # both terms one operand: one wgmma a run
          plgpu.wgmma(r_ref, values, tiles.p_t.at[j].transpose((1, 0)))
          continue
        for term in range(2):
          plgpu.wgmma(r_ref.at[:, pl.ds(term * n, n)], values, p_term(term, j).transpose((1, 0)))
      return r_ref[...]

    def mma(acc_ref):
      if not in_registers:
        plgpu.wgmma(acc_ref, tiles.v_wide, tiles.p_t)
      else:
        for r, values in zip(range(0, d, ROWS), chunks):
          plgpu.wgmma(acc_ref.at[pl.ds(r, ROWS)], values, tiles.p_t)

    if as_stored:   # the terms combined in f32
      r = pl.run_scoped(term_products, plgpu.ACC((d, 2 * n), jnp.int32 if int8 else jnp.float32))
      low = r[:, n:].astype(jnp.float32) * (1.0 / INT8_MAX) if int8 else r[:, n:]
      acc = acc + r[:, :n].astype(jnp.float32) + low
    else:
      acc = accumulate(acc, mma, interpret=interpret)
    if as_stored:
      tiles.v_ring.release(i)
    return acc

  def tile_math(z_and_inverse, i, tile, carry, masked: bool):
    chunks = widen_values(i, tile, masked)
    acc, m_new, l_part = softmax(*z_and_inverse, *carry, masked=masked)
    return pv(acc, i, chunks), m_new, l_part

  acc = plgpu.layout_cast(jnp.zeros((d, n), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), cols)
  l_part = plgpu.layout_cast(jnp.zeros((bkv, n), jnp.float32), plgpu.Layout.WGMMA)   # summed at the end
  acc, m_i, l_part = run_tiles(
      (acc, m_i, l_part), lambda tile, i, carry, masked: tile_math(scores(i, tile, masked), i, tile, carry, masked),
      lambda tile, i, s_raw, carry, masked: tile_math(scaled(s_raw, i, tile, masked), i, tile, carry, masked),
      tiles=tiles, issue_qk=issue_qk, s_type=s_type, st=st, t0=t0, t1=t1, a=a, c=c, step0=step0,
      start=start)
  if as_stored:   # P's terms were in units of 1 / FP8_MAX or 1 / INT8_MAX (`stored_probability_terms`)
    acc = acc * (1.0 / (INT8_MAX if int8 else FP8_MAX))
  return acc, m_i, l_part.sum(axis=0)


def store_as_n(out, lse, out_smem, lse_smem):
  """A `consume_as_n` partial, normalised (out^T [D, 16], lse [16]), into the staging out_smem [64, D] (its first
  16 rows, written through a transposed view) and lse_smem [64]."""
  n = QUERY_COLUMNS
  out = plgpu.layout_cast(out.astype(out_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
  out_smem.at[pl.ds(0, n)].transpose((1, 0))[...] = out
  lse_smem.at[pl.ds(0, n)][...] = lse
