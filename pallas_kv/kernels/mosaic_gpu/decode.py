"""Split-K flash-decoding partials on Mosaic GPU (Hopper wgmma + TMA).

One program per (kv head x row block, split, sequence) streams its split's tiles, computed in the kernel from
`lengths`. A producer warpgroup TMA-copies K and V tiles into SMEM rings (`pipeline.Ring`); each consumer owns 64
packed query rows (or, with kv_groups=2, one of two splits; with tile_consumers=2, every other tile of the item,
merged with its partner's at the item's end) and runs Q K^T, the online softmax and P V (`TileMath`).
Hopper has no mixed-type wgmma: consumers widen one-byte tiles (times per-token scales) into SMEM tiles of q's
dtype (`tile_feeds.DequantizedTiles`). Each split writes its normalised partial and natural-log LSE.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.config import AttentionOptions
from pallas_kv.config import MosaicGPUConfig
from pallas_kv import online_softmax
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import fp8_operands
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import queries_as_n
from pallas_kv.kernels.mosaic_gpu import tile_feeds
from pallas_kv.kernels.mosaic_gpu import tiling
from pallas_kv.kernels.mosaic_gpu import work
from pallas_kv.kernels.mosaic_gpu import trace as mgpu_trace
from pallas_kv.kernels.mosaic_gpu.trace import region
from pallas_kv.kernels.mosaic_gpu.work import Item

ROWS_PER_WG = mgpu_config.ROWS_PER_WG
PRODUCER_REGISTERS = 40     # the producer only issues TMA: give its registers to the consumers
CONVERTER_REGISTERS = 128   # the converter holds one [bkv, 128] tile as float32 with its scales
# TMA needs 16-byte rows and GMEM strides: the float32 arrays the kernel copies by rows (the lse output, Q's row
# factors) are padded to a multiple of 4.
_F32_PER_TMA_ROW = 4
# q's rows are copied in whole swizzle tiles (8 rows), those past q's filled with zeros by TMA (and by GPU interpret
# mode), so q is not padded before the kernel (a launch, and 16x q's bytes at 4 rows padded to wgmma's 64). The SMEM
# tile's rows past the copy are never written: each row's scores, softmax and output are its own, never stored.
_Q_ROW_MULTIPLE = 8


def _consumer_registers(num_wgs: int, converter: bool = False) -> int:
  # 64K registers per SM shared by 128-thread warpgroups; at most 256 per thread; multiple of 8.
  others = PRODUCER_REGISTERS + (CONVERTER_REGISTERS if converter else 0)
  return int(min(256, (512 - others) / num_wgs) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class TileMath:
  """A consumer's work on each KV tile: Q K^T, the masked online softmax, P V, one-byte tiles' widening.
  Measurement probes subclass it to leave a stage out (loads_only: the fp8-operand consumers only wait for and free
  each slot); `name` goes into the kernel name."""
  name: str = ""
  loads_only: bool = False

  def dequantize(self, tile, dtype, token_scales=None):
    """A one-byte tile [bkv, D] in registers widened to `dtype`, row t times token_scales[t] if given
    ([bkv] f32, WGMMA row layout)."""
    # Exact conversions; Hopper converts fp8 only to f16.
    if jnp.issubdtype(tile.dtype, jnp.floating):
      tile = tile.astype(jnp.float16)
    if token_scales is None:
      return tile.astype(dtype)
    return (tile.astype(jnp.float32) * lax.broadcast_in_dim(token_scales, tile.shape, [0])).astype(dtype)

  def qk(self, s_ref, q_tile, k_tile):
    plgpu.wgmma(s_ref, q_tile, k_tile.transpose((1, 0)))

  def softmax(self, s, acc, m_i, l_i, *, tile, length, row0, masked: bool, st: "_Static", k_scale=None,
              start=None, v_scales=None):
    """(acc rescaled, m, l, P in q's dtype) after raw scores s [64, bkv] f32; k_scale: the head's or None; start:
    the sequence's window start or None; v_scales: the tile's per-token V scales [bkv] (WGMMA columns) or None."""
    acc, m_new, l_new, p = self.probabilities(s, acc, m_i, l_i, tile=tile, length=length, row0=row0, masked=masked,
                                              st=st, k_scale=k_scale, start=start)
    p = online_softmax.times_key_scales(p, v_scales, masked=masked)
    return acc, m_new, l_new, p.astype(st.q_dtype)

  def probabilities(self, s, acc, m_i, l_i, **where):
    """`softmax` with P f32, no V scale folded in."""
    return online_softmax.softmax_step(self.logits(s, **where), acc, m_i, l_i)

  def logits(self, s, *, tile, length, row0, masked: bool, st: "_Static", k_scale=None, start=None):
    """Raw scores s [64, bkv] f32 as log2-unit logits, -inf where a row does not see the key (masked tiles)."""
    s = online_softmax.log2_logits(s, scale=st.options.scale * (1 if k_scale is None else k_scale),
                                   softcap=st.options.softcap)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * st.tiling.block_kv, length=length,
                                  num_queries=st.num_queries, group=st.group, window=st.options.window, start=start)
      s = jnp.where(ok, s, -jnp.inf)
    return s

  def pv(self, acc, p16, v_tile, p_smem=None):
    if p_smem is None:
      def mma(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)
      return pl.run_state(mma)(plgpu.ACC.init(acc))

    # GPU interpret mode runs neither pl.run_state nor wgmma with a register operand: stage P in SMEM.
    p_smem[...] = p16

    def mma_staged(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_tile)
      return acc_ref[...]

    return acc + pl.run_scoped(mma_staged, plgpu.ACC(acc.shape, jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Static:
  num_queries: int
  group: int
  rows: int
  num_row_blocks: int
  out_rows: int
  lse_rows: int
  num_splits: int       # partials per (batch, head): grid splits x kv_groups
  capacity: int
  options: AttentionOptions
  tiling: tiling.KVTiling
  smem: mgpu_config.DecodeSmem
  batch: int = 1
  num_kv_heads: int = 1
  pipeline_qk: bool = False
  num_programs: int | None = None   # persistent grid: programs looping over work items
  tile_math: TileMath = TileMath()
  q_dtype: Any = jnp.bfloat16
  k_scale: str | None = None
  v_scale: str | None = None
  balanced: bool = False
  ordered: bool = False   # the batch slots take the sequences of the plan's order
  stream_k: bool = False  # the persistent programs walk the plan's equal shares of the tiles (`work`)
  walk_vectors: int = 0   # stream-K: the walk's vectors passed in (4, a plan made ahead), or 0: planned inside
  walk_unroll: int = 0    # stream-K planned inside: its loops' unroll (`plan.kernel_walk`; B: straight-line code)
  explicit_barriers: bool = False   # no automatic barriers around SMEM stores: the kernel syncs where needed
  one_tile_loop: bool = False   # every tile through the masked step (`plan.tile_loops`)
  trace: mgpu_trace.KernelTrace | None = None   # a timeline of the call from inside (a diagnostic)

  @property
  def quantized(self) -> bool:
    return self.smem.quantized

  @property
  def row_wgs(self) -> int:
    return self.smem.row_wgs

  @property
  def kv_groups(self) -> int:
    return self.smem.kv_groups

  @property
  def rows_per_program(self) -> int:
    return self.row_wgs * ROWS_PER_WG

  @property
  def persistent(self) -> bool:
    return self.num_programs is not None

  @property
  def grid_shape(self) -> tuple[int, int, int]:
    """(head blocks, split programs, batch): the work items, fastest-varying first."""
    return (self.num_kv_heads * self.num_row_blocks, self.num_splits // self.kv_groups, self.batch)

  @property
  def num_items(self) -> int:
    return math.prod(self.grid_shape)


def _first_row(start, tile, st: "_Static"):
  """The first row of `tile` at or after a window start (the rows before it are zeroed), or None without one."""
  return None if start is None else start - tile * st.tiling.block_kv


def _kernel(q_ref,
            k_ref,
            v_ref,
            lengths_ref,
            *refs, st: _Static, **scratch):
  refs = list(refs)
  q_factors_ref = refs.pop(0) if st.smem.one_byte_operands and not st.smem.splits_queries else None
  starts_ref = refs.pop(0) if st.options.has_window_start else None
  sequences = work.Sequences(lengths_ref, starts_ref, refs.pop(0) if st.ordered else None)
  tiles_per_split = refs.pop(0)[0] if st.balanced else None
  walk = work.WalkRefs(*(refs.pop(0) for _ in range(st.walk_vectors))) if st.stream_k else None
  for_each_item = functools.partial(work.for_each_item, sequences=sequences, st=st, tiles_per_split=tiles_per_split,
                                    walk=walk)
  block_tables_ref = refs.pop(0) if st.tiling.paged else None
  k_scale_ref = refs.pop(0) if st.k_scale else None
  v_scale_ref = refs.pop(0) if st.v_scale else None
  out_ref, lse_ref = refs
  q_smem, q_rows = scratch["q_smem"] if st.smem.splits_queries else (scratch["q_smem"], None)
  streaming, (out_smem, lse_smem), tiles = st.smem.buffers(scratch)
  rings = []
  for g in range(st.kv_groups):
    names = {role: st.smem.ring_name(role, g) for role in st.smem.ring_specs()}
    rings.append({role: pipeline.Ring(spec, streaming[names[role]], scratch[f"{names[role]}_produced"],
                                      scratch[f"{names[role]}_consumed"],
                                      tiles=None if tiles is None else tiles[names[role]])
                  for role, spec in st.smem.ring_specs().items()})
  converted = {role: pipeline.Ring(spec, streaming[name], scratch[f"{name}_produced"], scratch[f"{name}_consumed"])
               for role, spec in st.smem.converted_ring_specs().items()
               for name in [st.smem.converted_ring_name(role)]}
  wg = lax.axis_index("wg")

  if converted:
    @pl.when(wg == st.smem.num_wgs + 1)
    def _converter():
      plgpu.set_max_registers(CONVERTER_REGISTERS, action="decrease")

      def convert(item: Item, steps_before):
        t0, count = item.ranges[0][0], item.counts[0]

        @pl.loop(0, count)
        def _(step):
          for role in ("k", "v"):
            # V's rows past the length are zeroed here (0 x NaN is NaN in P V); K's are masked.
            valid_rows = item.length - (t0 + step) * st.tiling.block_kv if role == "v" else None
            first_row = _first_row(item.start, t0 + step, st) if role == "v" else None
            tile_feeds.convert_tile(rings[0][role], rings[0].get(f"{role}s"), converted[role], steps_before + step,
                                    valid_rows, item.head, st.tile_math, st.q_dtype, first_row)

        for ring in converted.values():   # one item (no persistent grid with a converter)
          ring.drain(count)
        return count

      for_each_item(convert)

  @pl.when(wg == st.smem.num_wgs)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    scale_sources = functools.partial(st.tiling.scale_sources, width=st.smem.scale_width,
                                      tokens_per_index=st.tiling.page_size or st.capacity)
    sources = {"k": functools.partial(st.tiling.tile_sources, k_ref),
               "v": functools.partial(st.tiling.tile_sources, v_ref),
               "ks": functools.partial(scale_sources, k_scale_ref),
               "vs": functools.partial(scale_sources, v_scale_ref)}
    if st.smem.v_tokens_last:
      sources["v"] = functools.partial(st.tiling.tokens_last_sources, v_ref)
    for role, scale_ref in (("k", k_scale_ref), ("v", v_scale_ref)):
      if st.smem.scales_tokens_last(role):
        sources[f"{role}s"] = functools.partial(st.tiling.tokens_last_scale_sources, scale_ref)
    if st.stream_k:   # the source of the unused piece slots' lse (`work.fill_unused_slots`)
      scratch["lse_fill"][...] = jnp.full(scratch["lse_fill"].shape, -jnp.inf, jnp.float32)
      plgpu.commit_smem()

    def produce(item: Item, steps_before):
      counts = item.counts

      @pl.loop(0, counts[0])
      def _(step):
        for g, ((t0, _, _, _), count) in enumerate(zip(item.ranges, counts)):
          @pl.when(step < count)
          def _():
            # Page ids are loaded before waiting for a free slot so their latency overlaps it.
            where = st.tiling.tile_locations(t0 + step, batch=item.b, block_tables_ref=block_tables_ref,
                                             length=item.length)
            for role, ring in rings[g].items():
              ring.acquire(steps_before + step)
              ring.commit(steps_before + step, sources[role](where, head=item.head))

      if not st.persistent:
        for g, count in enumerate(counts):
          for ring in rings[g].values():
            ring.drain(count)
      if st.stream_k:
        work.fill_unused_slots(item, scratch["lse_fill"], lse_ref, st)
      return counts[0]

    total = for_each_item(produce)
    if st.persistent:
      for ring in rings[0].values():
        ring.drain(total)
    if st.stream_k:   # exits once its stores have read SMEM: the launch ends after their writes land
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  # One traced body per consumer warpgroup, so that its ring and rows are static.
  as_stored = st.smem.one_byte_operands   # wgmma reads the one-byte tiles as stored (`fp8_operands`)
  for w in range(st.smem.num_wgs):
    turn, w_in_turn = divmod(w, st.row_wgs * st.kv_groups)   # which ring steps' parity (tile_consumers=2)
    g, rw = divmod(w_in_turn, st.row_wgs)   # KV group, row warpgroup

    @pl.when(wg == w)
    def _consumer():
      plgpu.set_max_registers(_consumer_registers(st.smem.num_wgs, bool(converted)), action="increase")
      queries = _Queries(q_smem, scratch.get("q_factors"), scratch["q_barrier"], q_ref, q_factors_ref, rw=rw, st=st,
                         rows=q_rows)
      p_smem = scratch["p_smem"].at[w] if st.smem.stage_p else None
      partner = None
      if st.smem.tile_consumers == 2:
        partner = _Partner(out_smem.at[1], lse_smem.at[1], scratch["partner_staged"], scratch["partner_read"])

      def consume(item: Item, steps_before):
        row0 = item.row_block * st.rows_per_program + rw * ROWS_PER_WG
        if g == 0 and turn == 0:   # one load per row warpgroup; the other consumers wait on its barrier
          queries.load_for(item)
        t0, t1, a, c = item.ranges[g]
        k_head_scale = k_scale_ref[item.head] if st.k_scale == "head" else None
        v_head_scale = v_scale_ref[item.head] if st.v_scale == "head" else None
        with region("wait_q"):
          q_tile = queries.wait(item, k_head_scale)
        fp8_where = dict(length=item.length, row0=row0, t0=t0, t1=t1, a=a, c=c, step0=steps_before, st=st,
                         start=item.start, interpret=st.smem.stage_p)
        fp8_rings = (rings[g]["k"], rings[g]["v"], rings[g].get("ks"), rings[g].get("vs"))
        if st.smem.queries_as_n and not st.quantized:
          tiles = queries_as_n.Tiles(q_tile, rings[g]["k"], rings[g]["v"], scratch["p_t"][w], st.smem.v_tokens_last)
          carry = queries_as_n.consume(tiles, **fp8_where)
        elif st.smem.queries_as_n:
          tiles = fp8_operands.AsNTiles(q_tile, queries.factors_of(item), *fp8_rings, scratch["p_t"][w],
                                        scratch["v_wide"][w], item.head)
          carry = fp8_operands.consume_as_n(tiles, **fp8_where)
        elif as_stored:
          tiles = fp8_operands.Fp8Tiles(q_tile, queries.factors_of(item), *fp8_rings,
                                        scratch["p_terms"][2 * w:2 * w + 2])
          carry = fp8_operands.consume(tiles, tile_math=st.tile_math, **fp8_where)
        else:
          k_tiles, v_tiles = _tile_feeds(rings[g], streaming, w, item.head, st, converted)
          carry = _consume(q_tile, k_tiles, v_tiles, p_smem, item.length, row0, *item.ranges[g],
                           steps_before, st, k_scale=k_head_scale, start=item.start, turn=turn)
        with region("write_out"):
          _write_partials(carry, out_smem.at[w], lse_smem.at[w], out_ref, lse_ref,
                          scratch["consumers_done"], b=item.b, head=item.head,
                          split=item.splits[g], rw=rw, row0=row0, st=st, v_scale=v_head_scale,
                          partner=partner, turn=turn)
        return item.counts[g]

      for_each_item(consume)
      if st.persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@dataclasses.dataclass(frozen=True)
class _Queries:
  """One row warpgroup's q rows in SMEM (wgmma's A, [64, D]; one-byte operands: Q's two terms and the rows' factors),
  copied by one of its consumers. A persistent program has two buffers and copies the next item's rows at the
  start of this one, so they land while it streams: that buffer's last item ended before this one began (a
  partner's with it: `_Partner`)."""
  smem: Any           # [buffers, row_wgs, (2,) 64, D]
  factors: Any        # [buffers, row_wgs, 64] f32, or None
  barriers: Any       # [buffers * row_wgs]
  q_ref: Any
  factors_ref: Any    # Q's factors as made before the kernel, or None
  rw: int
  st: _Static
  rows: Any = None    # [buffers, row_wgs, 64, D] q_dtype: q's rows, made into Q's terms in their bytes, or None

  def _buffer(self, item: Item):
    return 0 if self.st.smem.q_buffers == 1 else lax.rem(item.index, 2)

  def _copy(self, b, head, row_block, buffer):
    """Starts the copy of q's rows of (b, head, row block) into `buffer`: with one row block, q's rows rounded up to
    a swizzle tile (`_Q_ROW_MULTIPLE`); the rows past them in SMEM stay as they were."""
    st = self.st
    n = ROWS_PER_WG
    if st.num_row_blocks == 1:
      n = min(ROWS_PER_WG, split_plan.round_up(st.rows - self.rw * ROWS_PER_WG, _Q_ROW_MULTIPLE))
    rows, first = pl.ds(row_block * st.rows_per_program + self.rw * ROWS_PER_WG, n), pl.ds(0, n)
    barrier = self.barriers.at[buffer * st.row_wgs + self.rw]
    if self.rows is not None:   # q's rows; paired terms: again 16 rows on, whose terms become the low ones
      for at in range(0, st.smem.q_copies * fp8_operands.QUERY_COLUMNS, fp8_operands.QUERY_COLUMNS):
        plgpu.copy_gmem_to_smem(self.q_ref.at[b, head, rows], self.rows.at[buffer, self.rw, pl.ds(at, n)], barrier)
      return
    if self.factors is None:
      plgpu.copy_gmem_to_smem(self.q_ref.at[b, head, rows], self.smem.at[buffer, self.rw, first], barrier)
      return
    for term in range(2):   # each term's rows are one contiguous box; paired, the terms' rows 16 apart in one block
      into = (self.smem.at[buffer, self.rw, 0, pl.ds(term * fp8_operands.QUERY_COLUMNS, n)] if st.smem.paired_terms
              else self.smem.at[buffer, self.rw, term, first])
      plgpu.copy_gmem_to_smem(self.q_ref.at[b, head, term, rows], into, barrier)
    plgpu.copy_gmem_to_smem(self.factors_ref.at[b, head, rows], self.factors.at[buffer, self.rw, first], barrier)

  def load_for(self, item: Item):
    """The copies this item needs started: its own (unless the item before started it) and the next item's."""
    if self.st.smem.q_buffers == 1:
      self._copy(item.b, item.head, item.row_block, 0)
      return
    buffer = self._buffer(item)
    pl.when(item.index == 0)(lambda: self._copy(item.b, item.head, item.row_block, buffer))
    b, head, row_block, any_next = item.following
    pl.when(any_next)(lambda: self._copy(b, head, row_block, 1 - buffer))

  def wait(self, item: Item, k_head_scale=None):
    """The item's q tile [(2,) 64, D], once landed (and, from q's rows, split into Q's terms here; their factors
    times k_head_scale, given)."""
    buffer = self._buffer(item)
    plgpu.barrier_wait(self.barriers.at[buffer * self.st.row_wgs + self.rw])
    if self.rows is not None:
      fp8_operands.split_queries(self.rows.at[buffer, self.rw], self.smem.at[buffer, self.rw],
                                 self.factors.at[buffer, self.rw], k_head_scale=k_head_scale,
                                 paired=self.st.smem.paired_terms)
    return self.smem.at[buffer, self.rw]

  def factors_of(self, item: Item):
    return self.factors.at[self._buffer(item), self.rw]


def _tile_feeds(rings, streaming, w: int, head, st: _Static, converted=None):
  """A consumer's K and V feeds (`tile_feeds`): converted tiles, 16-bit slots, or its own widened tiles."""
  if converted:
    return tile_feeds.RingTiles(converted["k"]), tile_feeds.RingTiles(converted["v"], zero_rows=False)
  tokens_last = st.smem.v_tokens_last
  if not st.quantized:
    return tile_feeds.RingTiles(rings["k"]), tile_feeds.RingTiles(rings["v"], tokens_last=tokens_last)
  n = st.smem.dequant_tiles
  mine = streaming["dequantized"][w * n:(w + 1) * n]
  return tuple(tile_feeds.DequantizedTiles(rings[role], dequantized, st.tile_math, scale_ring=rings.get(f"{role}s"),
                                           head=head, tokens_last=tokens_last and role == "v",
                                           explicit_barriers=st.explicit_barriers)
               for role, dequantized in (("k", mine[0]), ("v", mine[-1])))


def _consume(q_tile, k_tiles, v_tiles, p_smem, length, row0, t0, t1, a, c, step0, st: _Static, k_scale=None,
             start=None, turn: int = 0):
  """(acc, m, l) over tiles [t0, t1), [a, c) unmasked; ring step step0 + i holds tile t0 + i; keys before a
  window start (given) are masked. With two tile consumers, only the tiles whose ring step has parity `turn`."""
  math_ = st.tile_math
  stride = st.smem.tile_consumers
  # This consumer's tiles are first, first + stride, ... below t1; mine(x) counts those below x.
  if stride == 1:
    first, mine = t0, lambda x: x - t0
  else:
    first = t0 + lax.rem(jnp.int32(turn + stride) - lax.rem(step0, jnp.int32(stride)), jnp.int32(stride))
    mine = lambda x: lax.div(jnp.maximum(x - first + (stride - 1), 0), jnp.int32(stride))
  wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
  s_type = plgpu.ACC((ROWS_PER_WG, st.tiling.block_kv), jnp.float32)

  @region("softmax")
  def softmax(s, i, tile, acc, m_i, l_i, masked: bool):
    return math_.softmax(s, acc, m_i, l_i, tile=tile, length=length, row0=row0, masked=masked, st=st,
                         k_scale=k_scale, start=start, v_scales=v_tiles.column_scales(i))

  @region("pv")
  def pv(acc, p16, i, tile, masked: bool):
    valid_rows = length - tile * st.tiling.block_kv if masked else None
    first_row = _first_row(start, tile, st) if masked else None
    v_tile = v_tiles.fetch(i, valid_rows, first_row)
    acc = math_.pv(acc, p16, v_tile, p_smem)
    v_tiles.done(i)
    return acc

  acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, st.tiling.head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), wgmma_rows)
  l_i = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), wgmma_rows)

  if not st.pipeline_qk:
    def step(j, carry, *, masked: bool):
      acc, m_i, l_i = carry
      tile = first + stride * j
      i = step0 + tile - t0
      k_tile = k_tiles.fetch(i)

      @region("qk")
      def qk(s_ref):
        math_.qk(s_ref, q_tile, k_tile)
        return s_ref[...]

      s = pl.run_scoped(qk, s_type)
      k_tiles.done(i)
      acc, m_new, l_i, p16 = softmax(s, i, tile, acc, m_i, l_i, masked)
      return pv(acc, p16, i, tile, masked), m_new, l_i

    carry = (acc, m_i, l_i)
  else:
    # FA3-style: tile i+1's Q K^T runs during tile i's softmax and P V. K slot i is held until then,
    # so the last step re-scores its own tile rather than branch around the wgmma.
    def score_first(s_ref):
      @pl.when(t1 > first)
      def _():
        math_.qk(s_ref, q_tile, k_tiles.fetch(step0 + first - t0))
      return s_ref[...]

    s0 = pl.run_scoped(score_first, s_type)

    def step(j, carry, *, masked: bool):
      acc, m_i, l_i, s = carry
      tile = first + stride * j
      i = step0 + tile - t0
      has_next = tile + stride < t1

      @pl.when(has_next)
      def _():
        k_tiles.fetch(i + stride)

      k_next = k_tiles.tile(jnp.where(has_next, i + stride, i))

      def body(s_ref):
        math_.qk(s_ref, q_tile, k_next)
        acc_new, m_new, l_new, p16 = softmax(s, i, tile, acc, m_i, l_i, masked)
        acc_new = pv(acc_new, p16, i, tile, masked)
        return acc_new, m_new, l_new, s_ref[...]

      carry = pl.run_scoped(body, s_type)
      k_tiles.done(i)
      return carry

    carry = (acc, m_i, l_i, s0)

  for lo, hi, masked in split_plan.tile_loops(t0, t1, a, c, window=st.options.window, start=start,
                                              one_loop=st.one_tile_loop):
    carry = lax.fori_loop(mine(lo), mine(hi), functools.partial(step, masked=masked), carry)
  return carry[:3]


@dataclasses.dataclass(frozen=True)
class _Partner:
  """How the second of two tile consumers hands its partial to the first, which merges the two: its staging
  out [64, D] and lse [64] (f32), `staged` (its stores are done) and `read` (the first has loaded them)."""
  out: Any
  lse: Any
  staged: Any
  read: Any

  def hand_over(self, out, lse):
    self.out[...] = out
    self.lse[...] = lse
    plgpu.barrier_arrive(self.staged)
    plgpu.barrier_wait(self.read)   # the staging is free again for the next item

  def merged_with(self, out, lse):
    plgpu.barrier_wait(self.staged)
    other_out = plgpu.load(self.out, layout=plgpu.Layout.WGMMA)
    other_lse = plgpu.load(self.lse, layout=plgpu.Layout.WGMMA.reduce(1))
    plgpu.barrier_arrive(self.read)
    return online_softmax.merge_pair(out, lse, other_out, other_lse)


def _write_partials(carry, out_smem, lse_smem, out_ref, lse_ref, consumers_done, *,
                    b, head, split, rw: int, row0, st: _Static, v_scale=None, partner: _Partner | None = None,
                    turn: int = 0):
  """Normalises and stores one warpgroup's partial through out_smem [64, D], lse_smem [64] (f32). Two tile
  consumers: the second (turn 1) hands its partial over through `partner`, the first merges and stores."""
  out, lse = online_softmax.finalize(*carry, reciprocal=True, rows_axis=int(st.smem.queries_as_n))
  if v_scale is not None:
    out = out * v_scale
  if not st.persistent and st.smem.num_wgs > 1:
    # The staging buffers alias the K/V rings: wait until every consumer is done reading them.
    plgpu.barrier_arrive(consumers_done)
    plgpu.barrier_wait(consumers_done)
  if partner is not None:
    if turn == 1:
      partner.hand_over(out, lse)
      return
    out, lse = partner.merged_with(out, lse)
  if st.persistent:
    # The staging is this warpgroup's own: wait only until the previous item's stores have read it.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if st.explicit_barriers:   # every warp past its reads of the staging: the last tiles' wgmma, the last store's TMA
    plgpu.commit_smem()
  if st.smem.queries_as_n:
    fp8_operands.store_as_n(out, lse, out_smem, lse_smem)
  else:
    out_smem[...], lse_smem[...] = out.astype(out_smem.dtype), lse
  plgpu.commit_smem()
  if st.num_row_blocks == 1:
    # Static row counts: write only the real rows (lse rows padded to 16 bytes for TMA).
    n_out = min(ROWS_PER_WG, st.out_rows - rw * ROWS_PER_WG)
    n_lse = min(ROWS_PER_WG, st.lse_rows - rw * ROWS_PER_WG)
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, n_out)],
                            out_ref.at[b, head, split, pl.ds(rw * ROWS_PER_WG, n_out)])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, n_lse)],
                            lse_ref.at[b, head, split, pl.ds(rw * ROWS_PER_WG, n_lse)])
  else:
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, head, split, pl.ds(row0, ROWS_PER_WG)])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, head, split, pl.ds(row0, ROWS_PER_WG)])
  if not st.persistent:   # the program ends: SMEM read is enough, the launch ends after the writes land
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _build(st: _Static, interpret: Any):
  D = st.tiling.head_dim
  out_type = (
      jax.ShapeDtypeStruct((st.batch, st.num_kv_heads, st.num_splits, st.out_rows, D), st.smem.out_dtype),
      jax.ShapeDtypeStruct((st.batch, st.num_kv_heads, st.num_splits, st.lse_rows), jnp.float32),
  )
  scratch = st.smem.scratch_types()
  kind = "paged" if st.tiling.paged else "dense"
  name = (f"pallas_kv_decode_{kind}_r{st.rows}_d{D}_bkv{st.tiling.block_kv}"
          f"_st{st.smem.num_stages}_sp{st.num_splits}_g{st.kv_groups}")
  suffixes = [  # (whether it applies, its part of the name), in name order
      (st.tiling.paged, f"_ps{st.tiling.page_size}"), (st.pipeline_qk, "_pqk"),
      (st.persistent, f"_persist{st.num_programs}"), (st.smem.q_buffers == 2, "_q2"),
      (st.quantized, f"_{st.tiling.dtype.name}_k{st.k_scale or 'none'}_v{st.v_scale or 'none'}"),
      (st.smem.converter, "_cvt"), (st.smem.v_tokens_last, "_vlast"), (st.smem.one_byte_operands, "_stored"),
      (st.smem.queries_as_n, "_asn" + "_vreg" * st.smem.values_in_registers + "_v8" * st.smem.values_as_stored
       + "_pair" * st.smem.paired_terms),
      (st.smem.tile_consumers == 2, "_tc2"), (st.tile_math.name, f"_{st.tile_math.name}"),
      (st.balanced, "_balanced"), (st.stream_k, "_streamk" if st.walk_vectors else f"_streamk_kwalk{st.walk_unroll}"),
      (st.ordered, "_ordered"), (st.explicit_barriers, "_eb"), (st.one_tile_loop, "_1loop"),
      (st.options.has_window_start, "_wstart")]
  name += "".join(part for applies, part in suffixes if applies)
  if st.persistent:
    grid, grid_names = (st.num_programs,), ("program",)
  else:
    # Batch fastest (the last grid dimension launches first): docs/decisions.md#mosaic-gqa-grid-order.
    grid, grid_names = st.grid_shape, ("head", "split", "batch")
  return plgpu.kernel(
      functools.partial(_kernel, st=st),
      out_type=out_type,
      scratch_types=scratch,
      grid=grid,
      grid_names=grid_names,
      num_threads=st.smem.num_threads,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=st.explicit_barriers,
                                           **(st.trace.compiler_params() if st.trace else {})),
      interpret=interpret,
      kernel_name=name,
  )


def decode_partials(q, k, v, lengths, block_tables=None, **kwargs):
  """Split-K partials of decode attention over a contiguous or paged KV cache: the kernel of `kernel_call`
  on its inputs, (out, lse) as that describes."""
  kernel, args, finish = kernel_call(q, k, v, lengths, block_tables, **kwargs)
  return finish(*kernel(*args))


def kernel_call(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                config: MosaicGPUConfig, plan: split_plan.SplitPlan, k_scale=None, v_scale=None,
                num_programs: int | None = None, tile_math: TileMath = TileMath(), interpret: Any = False,
                window_start=None, v_tokens_last: bool = False, out_dtype: Any = jnp.float32):
  """(kernel, its inputs, finish) of split-K decode attention: finish(*kernel(*inputs)) are the partials. The
  inputs are the call's arrays as the kernel reads them (Q's one-byte terms where the kernel does not make them,
  scales laid out by head where it reads them so), so that a timing of the kernel alone leaves their making out.

  q: [B, Hkv, R, D] bf16 / fp16, R = S * G packed rows (S = num_queries): row r = s * G + g is new token
    s of q head kv_head * G + g, at p = lengths[b] - S + s; it sees keys t < lengths[b], t <= p and,
    with options.window, t > p - window.
  k, v: [B, T, Hkv, D], or paged [P, page_size, Hkv, D] with block_tables int32 [B, max_pages]; in q's
    dtype or a one-byte type (`frame.QUANTIZED_DTYPES`). v_tokens_last: v is [B, Hkv, D, T] / [P, Hkv, D,
    page_size] (`config.tokens_last_reason`).
  k_scale, v_scale: None, [Hkv] f32, or per token with the cache's leading dims ([B, T, Hkv] /
    [P, page_size, Hkv]; other than a multiple of 4 kv heads are laid out by head or padded here,
    `tiling.token_scale_width`): logits use k_scale_t * k_t, the output v_scale_t * v_t.
  window_start: int32 [B], given exactly when options.has_window_start: keys before it are invisible.
  options: scale, softcap, window; config: a complete `MosaicGPUConfig`; plan: its `SplitPlan` (batch slot i takes
    sequence plan.order[i] when given);
    num_programs: a persistent config's (default: the SM count; a stream-K plan's walk sets it); interpret: False,
    True or InterpretGPUParams.

  out_dtype: the partials' dtype: float32, or with one split (which is then the output) and one tile consumer,
    q's 16-bit dtype, so that no cast follows the kernel.
  Inside `trace.tracing(...)` the kernel also writes its timeline from inside (a diagnostic; GPU only).

  The partials: (out [B, Hkv, num_splits, R, D] out_dtype, each split's normalised output; lse [B, Hkv, num_splits,
  R] f32, natural log, -inf with out 0 where the split saw no key).
  """
  frame.check_packed_args(q, k, v, lengths, block_tables, num_queries=num_queries, k_scale=k_scale,
                          v_scale=v_scale, v_tokens_last=v_tokens_last)
  B, Hkv, R, D = q.shape
  page_size = None if block_tables is None else k.shape[1]
  k_kind, v_kind = frame.scale_kind(k_scale, k.shape), frame.scale_kind(v_scale, k.shape)
  reason = mgpu_config.quantized_call_reason(k.dtype, k_kind, v_kind, num_kv_heads=Hkv, page_size=page_size)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  quantized = dict(q_dtype=q.dtype, k_scale_kind=k_kind, v_scale_kind=v_kind, num_kv_heads=Hkv,
                   v_tokens_last=v_tokens_last)
  mgpu_config.check_config(config, rows=R, head_dim=D, dtype=k.dtype, page_size=page_size, num_splits=plan.num_splits,
                           **quantized)
  work.check_stream_k(plan, config, options, num_programs)
  plan.check(block_kv=config.block_kv, batch=B)
  if block_tables is None:
    kv_tiling = tiling.KVTiling(config.block_kv, D, k.dtype)
  else:
    kv_tiling = tiling.KVTiling(config.block_kv, D, k.dtype, page_size=page_size, num_pages=k.shape[0],
                                max_pages=block_tables.shape[1])
  row_wgs, num_row_blocks = mgpu_config.row_blocking(R)
  rows_padded = row_wgs * ROWS_PER_WG * num_row_blocks
  out_rows = R if num_row_blocks == 1 else rows_padded
  if jnp.dtype(out_dtype) != jnp.float32 and (plan.num_splits != 1 or jnp.dtype(out_dtype) not in frame.KV_DTYPES):
    raise ValueError(f"out_dtype={jnp.dtype(out_dtype).name}: partials are float32, or 16-bit where one split is "
                     f"the output; this plan has {plan.num_splits} splits")
  smem = mgpu_config.DecodeSmem.for_call(config, rows=R, head_dim=D, dtype=k.dtype, page_size=page_size,
                                         interpret=bool(interpret), out_dtype=out_dtype, **quantized)
  st = _Static(
      num_queries=num_queries, group=R // num_queries, rows=R, num_row_blocks=num_row_blocks,
      out_rows=out_rows, lse_rows=split_plan.round_up(out_rows, _F32_PER_TMA_ROW),
      num_splits=plan.num_splits, capacity=kv_tiling.capacity(k.shape), options=options,
      tiling=kv_tiling, smem=smem, batch=B, num_kv_heads=Hkv, pipeline_qk=config.pipeline_qk,
      tile_math=tile_math, q_dtype=jnp.dtype(q.dtype), k_scale=k_kind, v_scale=v_kind,
      balanced=plan.balanced, ordered=plan.ordered, stream_k=plan.stream_k,
      explicit_barriers=mgpu_config.explicit_barriers(config),
      one_tile_loop=bool(getattr(config, "one_tile_loop", False)),   # `experimental.MosaicGPUVariantConfig`
      trace=mgpu_trace.active())
  if plan.stream_k:
    st = dataclasses.replace(st, num_programs=plan.walk.num_programs, walk_vectors=len(plan.walk.arrays()),
                             walk_unroll=plan.walk.unroll)
  elif config.persistent:
    if num_programs is None:
      num_programs = runtime.num_sms()
    if num_programs < 1:
      raise ValueError(f"{num_programs=} must be a positive int or None")
    st = dataclasses.replace(st, num_programs=min(int(num_programs), st.num_items))

  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  elif interpret is False:
    interpret = None
  if (window_start is not None) != options.has_window_start:
    raise ValueError(f"window_start is given exactly when options.has_window_start; got "
                     f"{options.has_window_start=} and window_start {'None' if window_start is None else 'given'}")
  if R > _Q_ROW_MULTIPLE and R % _Q_ROW_MULTIPLE:   # a swizzled TMA box needs q's rows below or a multiple of 8
    q = jnp.pad(q, ((0, 0), (0, 0), (0, split_plan.round_up(R, _Q_ROW_MULTIPLE) - R), (0, 0)))
  if smem.one_byte_operands and not smem.splits_queries:   # Q's one-byte terms and factors (k_scale of a head in)
    q, q_factors = fp8_operands.split_rows(q, k_scale if k_kind == "head" else None)
    rows = q.shape[-2]   # [B, Hkv, R] factors: R of 3 or 7 (groups of 3, 7) has no 16-byte stride
    q_factors = jnp.pad(q_factors, ((0, 0), (0, 0), (0, split_plan.round_up(rows, _F32_PER_TMA_ROW) - rows)))
    args = [q, k, v, lengths, q_factors]
  else:
    args = [q, k, v, lengths]
  args += [] if window_start is None else [window_start.astype(jnp.int32)]
  args += plan.kernel_inputs()
  args += [] if block_tables is None else [block_tables]
  for role, kind, scale in (("k", k_kind, k_scale), ("v", v_kind, v_scale)):
    if kind == "token" and smem.scales_tokens_last(role):
      scale = jnp.swapaxes(scale, 1, 2)   # [B, Hkv, T]: a tile's scales are one run (tiling.tokens_last_scale_sources)
    elif kind == "token" and smem.scale_width == 1:
      scale = scale.reshape(-1)   # one kv head, contiguous: copied as flat runs (tiling.scale_sources)
    elif kind == "token" and Hkv % tiling.SCALE_ROW:   # 4-head group rows over pages of 8 / 16 (token_scale_width)
      scale = jnp.pad(scale, ((0, 0), (0, 0), (0, split_plan.round_up(Hkv, tiling.SCALE_ROW) - Hkv)))
    if kind is not None:
      args.append(scale)
  def finish(out, lse):
    return (out if out_rows == R else out[:, :, :, :R]), lse[..., :R]
  return _build(st, interpret), args, finish
