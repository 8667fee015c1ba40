"""Split-K flash-decoding partials on Mosaic GPU (Hopper wgmma + TMA).

One program per (batch, kv head [x row block], split). It owns a contiguous range of KV tiles
of its sequence, computed at run time from `lengths` so that tiles past the end (or before
the sliding window) are never loaded. Warp specialization:

  producer warpgroup   walks the range and TMA-copies K and V tiles into two SMEM rings
                       (`pipeline.Ring`), up to num_stages tiles ahead;
  consumer warpgroups  each owns 64 packed query rows (all q heads of the KV head x all new
                       tokens, zero-padded to 64 for wgmma): S = Q K^T and O += P V on the
                       tensor cores, online softmax in float32 in the WGMMA register layout
                       (`TileMath`). Two consumers split 65..128 rows; with kv_groups=2 two
                       consumers instead stream two splits' tiles from their own rings.

Each split writes its softmax-normalised partial output and its natural-log LSE; the caller
merges splits (`split_k.merge_splits`).
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
from pallas_kv.config import DecodeConfig
from pallas_kv.kernels import online_softmax
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

ROWS_PER_WG = mgpu_config.ROWS_PER_WG
PRODUCER_REGISTERS = 40     # the producer only issues TMA: give its registers to the consumers
# TMA stores need 16-byte rows: the lse output is padded to a multiple of 4 float32 rows.
_LSE_ROW_MULTIPLE = 4


def _consumer_registers(num_wgs: int) -> int:
  # 64K registers per SM shared by 128-thread warpgroups; at most 256 per thread; multiple of 8.
  return int(min(256, (512 - PRODUCER_REGISTERS) / num_wgs) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class TileMath:
  """What a consumer warpgroup computes on each KV tile: Q K^T, the masked online softmax, P V.

  The production kernel uses this class as is. A measurement probe may subclass it and leave a
  stage out (its results are then wrong by design) to see where the time goes; `name` goes into
  the kernel name so that profiles tell them apart.
  """
  name: str = ""

  def qk(self, s_ref, q_tile, k_tile):
    """Starts S = Q K^T into the accumulator s_ref [64, bkv] (q_tile [64, D], k_tile [bkv, D] SMEM)."""
    plgpu.wgmma(s_ref, q_tile, k_tile.transpose((1, 0)))

  def softmax(self, s, acc, m_i, l_i, *, tile, length, row0, masked: bool, st: "_Static"):
    """(acc rescaled, m, l, P in the cache dtype) after tile `tile`'s raw scores s [64, bkv] f32."""
    s = online_softmax.log2_logits(s, scale=st.options.scale, softcap=st.options.softcap)
    if masked:
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      ok = online_softmax.visible(rows, cols, tile_start=tile * st.tiling.block_kv, length=length,
                                  num_queries=st.num_queries, group=st.group, window=st.options.window)
      s = jnp.where(ok, s, -jnp.inf)
    acc, m_new, l_new, p = online_softmax.softmax_step(s, acc, m_i, l_i)
    return acc, m_new, l_new, p.astype(st.tiling.dtype)

  def pv(self, acc, p16, v_tile, p_smem=None):
    """acc + P @ V on the tensor cores: acc [64, D] f32 (WGMMA layout), p16 [64, bkv], v_tile SMEM."""
    if p_smem is None:
      def mma(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)
      return pl.run_state(mma)(plgpu.ACC.init(acc))

    # GPU interpret mode (jax 0.11.2) runs neither pl.run_state nor wgmma with a register
    # operand: stage P in SMEM ([64, bkv]) and accumulate into a fresh accumulator instead.
    p_smem[...] = p16

    def mma_staged(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_tile)
      return acc_ref[...]

    return acc + pl.run_scoped(mma_staged, plgpu.ACC(acc.shape, jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernel body needs to know at trace time."""
  num_queries: int      # S
  group: int            # G
  rows: int             # R = S * G
  num_row_blocks: int   # grid factor when R > 2 * 64
  out_rows: int         # rows of the out array (R, or padded when row-blocked)
  lse_rows: int         # rows of the lse array (out_rows rounded up to 4)
  num_splits: int       # partials per (batch, head): grid splits x kv_groups
  capacity: int         # tokens addressable per sequence
  options: AttentionOptions  # scale, softcap, window
  tiling: tiling.KVTiling
  smem: mgpu_config.DecodeSmem
  batch: int = 1
  num_kv_heads: int = 1
  pipeline_qk: bool = False
  num_programs: int | None = None   # persistent grid: programs looping over work items
  tile_math: TileMath = TileMath()

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


def _tile_range(length, split, st: _Static):
  """This split's tiles [t0, t1) and the unmasked sub-range [a, c) (`split_k.split_tile_range`)."""
  return split_k.split_tile_range(length, split, block_kv=st.tiling.block_kv, num_queries=st.num_queries,
                                  num_splits=st.num_splits, window=st.options.window)


@dataclasses.dataclass(frozen=True)
class _Item:
  """One work item: a (batch, kv head [x row block], split program) and its tile ranges."""
  b: Any
  head: Any
  row_block: Any
  length: Any
  splits: list[Any]                # one per KV group
  ranges: list[tuple[Any, ...]]    # (t0, t1, a, c) per KV group

  @property
  def counts(self) -> list[Any]:
    return [t1 - t0 for t0, t1, _, _ in self.ranges]   # counts[0] >= counts[1]


def _item(b, head_block, program_split, lengths_ref, st: _Static) -> _Item:
  if st.num_row_blocks == 1:
    head, row_block = head_block, 0
  else:
    head = lax.div(head_block, jnp.int32(st.num_row_blocks))
    row_block = lax.rem(head_block, jnp.int32(st.num_row_blocks))
  length = jnp.clip(lengths_ref[b], 0, st.capacity)
  # KV group g of this program computes split program_split * kv_groups + g.
  splits = [program_split * st.kv_groups + g for g in range(st.kv_groups)]
  return _Item(b=b, head=head, row_block=row_block, length=length, splits=splits,
               ranges=[_tile_range(length, split, st) for split in splits])


def _for_each_item(body, lengths_ref, st: _Static):
  """Calls body(item, steps_before) for each work item of this program, in order.

  steps_before: ring steps (tiles of KV group 0) of this program's earlier items, so that the
  ring's step numbering runs on across items. body returns this item's step count. Returns
  the program's total step count.
  """
  if not st.persistent:
    item = _item(lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("split"),
                 lengths_ref, st)
    return body(item, jnp.int32(0))
  num_heads, num_split_programs, _ = st.grid_shape
  program = lax.axis_index("program")
  # Items program, program + P, ...; the grid has P <= num_items programs.
  mine = (st.num_items - program + st.num_programs - 1) // st.num_programs

  def one(k, steps_before):
    w = program + k * st.num_programs
    head_block = lax.rem(w, jnp.int32(num_heads))
    rest = lax.div(w, jnp.int32(num_heads))
    item = _item(lax.div(rest, jnp.int32(num_split_programs)), head_block,
                 lax.rem(rest, jnp.int32(num_split_programs)), lengths_ref, st)
    return steps_before + body(item, steps_before)

  return lax.fori_loop(0, mine, one, jnp.int32(0))


def _kernel(q_ref,            # [B, Hkv, rows_padded, D]   GMEM
            k_ref,            # [B, T, Hkv, D] | [P, page_size, Hkv, D]   GMEM
            v_ref,            # same as k_ref
            lengths_ref,      # [B] int32   GMEM
            *refs, st: _Static, **scratch):
  if st.tiling.paged:
    block_tables_ref, *refs = refs   # [B, max_pages] int32   GMEM
  else:
    block_tables_ref = None
  (out_ref,                   # [B, Hkv, num_splits, out_rows, D] f32   GMEM
   lse_ref,                   # [B, Hkv, num_splits, lse_rows] f32   GMEM
   ) = refs
  q_smem = scratch["q_smem"]          # [row_wgs, 64, D]
  # (K ring, V ring) per KV group, [stages / kv_groups, bkv, D] each
  #   | [num_wgs, 64, D] f32, [num_wgs, 64] f32
  if st.smem.separate_out:
    ring_slots, (out_smem, lse_smem) = scratch["rings"], scratch["out_stage"]
  else:
    ring_slots, (out_smem, lse_smem) = scratch["union"]
  ring_spec = st.smem.ring_spec()
  rings = [tuple(pipeline.Ring(ring_spec, ring_slots[2 * g + i], scratch[f"{role}{g}_produced"],
                                  scratch[f"{role}{g}_consumed"])
                 for i, role in enumerate("kv"))
           for g in range(st.kv_groups)]
  wg = lax.axis_index("wg")

  @pl.when(wg == st.smem.num_wgs)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def produce(item: _Item, steps_before):
      counts = item.counts

      @pl.loop(0, counts[0])
      def _(step):
        for g, ((t0, _, _, _), count) in enumerate(zip(item.ranges, counts)):
          @pl.when(step < count)
          def _():
            # Page ids are loaded before waiting for a free slot so their latency overlaps it.
            where = st.tiling.tile_locations(t0 + step, batch=item.b,
                                             block_tables_ref=block_tables_ref)
            for ring, kv in zip(rings[g], (k_ref, v_ref)):
              ring.acquire(steps_before + step)
              ring.commit(steps_before + step, st.tiling.tile_sources(kv, where, head=item.head))

      if not st.persistent:   # the one item: drain each group's rings by its own count
        for g, count in enumerate(counts):
          for ring in rings[g]:
            ring.drain(count)
      return counts[0]

    total = _for_each_item(produce, lengths_ref, st)
    if st.persistent:
      for ring in rings[0]:
        ring.drain(total)

  # One traced body per consumer warpgroup, so that its ring and rows are static.
  for w in range(st.smem.num_wgs):
    g, rw = divmod(w, st.row_wgs)   # KV group, row warpgroup

    @pl.when(wg == w)
    def _consumer():
      plgpu.set_max_registers(_consumer_registers(st.smem.num_wgs), action="increase")
      q_tile = q_smem.at[rw]   # [64, D]
      q_barrier = scratch["q_barrier"].at[rw]
      p_smem = scratch["p_smem"].at[w] if st.smem.stage_p else None   # [64, bkv]

      def consume(item: _Item, steps_before):
        row0 = item.row_block * st.rows_per_program + rw * ROWS_PER_WG
        if g == 0:   # one load per row warpgroup; the other KV group waits on the same barrier
          plgpu.copy_gmem_to_smem(q_ref.at[item.b, item.head, pl.ds(row0, ROWS_PER_WG)], q_tile,
                                  q_barrier)
        plgpu.barrier_wait(q_barrier)
        carry = _consume(q_tile, *rings[g], p_smem, item.length, row0, *item.ranges[g],
                         steps_before, st)
        _write_partials(carry, out_smem.at[w], lse_smem.at[w], out_ref, lse_ref,
                        scratch["consumers_done"], b=item.b, head=item.head,
                        split=item.splits[g], rw=rw, row0=row0, st=st)
        return item.counts[g]

      _for_each_item(consume, lengths_ref, st)
      if st.persistent:
        plgpu.wait_smem_to_gmem(0)


def _consume(q_tile, k_ring, v_ring, p_smem, length, row0, t0, t1, a, c, step0, st: _Static):
  """Online softmax over tiles [t0, t1): masked head [t0, a), plain body [a, c), masked tail.

  Ring step step0 + i holds tile t0 + i.
  """
  math_ = st.tile_math
  wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
  s_type = plgpu.ACC((ROWS_PER_WG, st.tiling.block_kv), jnp.float32)

  def softmax(s, tile, acc, m_i, l_i, masked: bool):
    return math_.softmax(s, acc, m_i, l_i, tile=tile, length=length, row0=row0, masked=masked, st=st)

  def pv(acc, p16, i):
    v_tile = v_ring.wait(i)    # [bkv, D]
    acc = math_.pv(acc, p16, v_tile, p_smem)
    v_ring.release(i)
    return acc

  acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, st.tiling.head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), wgmma_rows)
  l_i = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), wgmma_rows)

  if not st.pipeline_qk:
    def step(tile, carry, *, masked: bool):
      acc, m_i, l_i = carry
      i = step0 + tile - t0
      k_tile = k_ring.wait(i)    # [bkv, D]

      def qk(s_ref):
        math_.qk(s_ref, q_tile, k_tile)
        return s_ref[...]

      s = pl.run_scoped(qk, s_type)   # [64, bkv]
      k_ring.release(i)
      acc, m_new, l_i, p16 = softmax(s, tile, acc, m_i, l_i, masked)
      return pv(acc, p16, i), m_new, l_i

    carry = (acc, m_i, l_i)
  else:
    # FA3-style: step i issues tile i+1's Q K^T on the tensor cores, then runs tile i's softmax
    # and P V while it is in flight. K slot i is released only after that QK^T has landed, so
    # the last step can issue a throw-away QK^T on its own (still held) slot instead of
    # branching around the wgmma.
    def first(s_ref):
      @pl.when(t1 > t0)
      def _():
        math_.qk(s_ref, q_tile, k_ring.wait(step0))
      return s_ref[...]

    s0 = pl.run_scoped(first, s_type)

    def step(tile, carry, *, masked: bool):
      acc, m_i, l_i, s = carry
      i = step0 + tile - t0
      has_next = tile + 1 < t1

      @pl.when(has_next)
      def _():
        k_ring.wait(i + 1)

      k_next = k_ring.slot(jnp.where(has_next, i + 1, i))

      def body(s_ref):
        math_.qk(s_ref, q_tile, k_next)
        acc_new, m_new, l_new, p16 = softmax(s, tile, acc, m_i, l_i, masked)
        acc_new = pv(acc_new, p16, i)
        return acc_new, m_new, l_new, s_ref[...]

      carry = pl.run_scoped(body, s_type)
      k_ring.release(i)
      return carry

    carry = (acc, m_i, l_i, s0)

  carry = lax.fori_loop(t0, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, c, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(c, t1, functools.partial(step, masked=True), carry)
  return carry[:3]


def _write_partials(carry, out_smem, lse_smem, out_ref, lse_ref, consumers_done, *,
                    b, head, split, rw: int, row0, st: _Static):
  """Normalises and stores one warpgroup's partial: out_smem [64, D] f32, lse_smem [64] f32."""
  out, lse = online_softmax.finalize(*carry)
  if st.persistent:
    # The staging buffers are this warpgroup's own; wait until the previous item's stores
    # have read them (the stores themselves may still be in flight).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  elif st.smem.num_wgs > 1:
    # The staging buffers alias the K/V rings: wait until every consumer is done reading them.
    plgpu.barrier_arrive(consumers_done)
    plgpu.barrier_wait(consumers_done)
  out_smem[...] = out
  lse_smem[...] = lse
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
  if not st.persistent:
    plgpu.wait_smem_to_gmem(0)


def _build(st: _Static, interpret: Any):
  """Grid, scratch and barriers for one static config; returns the plgpu.kernel callable."""
  D = st.tiling.head_dim
  out_type = (
      jax.ShapeDtypeStruct((st.batch, st.num_kv_heads, st.num_splits, st.out_rows, D),
                           jnp.float32),
      jax.ShapeDtypeStruct((st.batch, st.num_kv_heads, st.num_splits, st.lse_rows), jnp.float32),
  )
  scratch = st.smem.scratch_types()
  kind = "paged" if st.tiling.paged else "dense"
  name = (f"pallas_kv_decode_{kind}_r{st.rows}_d{D}_bkv{st.tiling.block_kv}"
          f"_st{st.smem.num_stages}_sp{st.num_splits}_g{st.kv_groups}")
  if st.tiling.paged:
    name += f"_ps{st.tiling.page_size}"
  if st.pipeline_qk:
    name += "_pqk"
  if st.persistent:
    name += f"_persist{st.num_programs}"
  if st.tile_math.name:
    name += f"_{st.tile_math.name}"
  if st.persistent:
    grid, grid_names = (st.num_programs,), ("program",)
  else:
    # grid[0] is CUDA's fastest-varying block index: the KV heads of one token range sit
    # side by side in HBM ([.., T, Hkv, D]), so programs launched together read them together.
    grid, grid_names = st.grid_shape, ("head", "split", "batch")
  return plgpu.kernel(
      functools.partial(_kernel, st=st),
      out_type=out_type,
      scratch_types=scratch,   # passed to the body by keyword
      grid=grid,
      grid_names=grid_names,
      num_threads=st.smem.num_wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=name,
  )


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, options: AttentionOptions,
                    config: DecodeConfig, num_programs: int | None = None, tile_math: TileMath = TileMath(),
                    interpret: Any = False):
  """Split-K partials of decode attention over a contiguous or paged KV cache.

  q: [B, Hkv, R, D] in k's dtype (bf16 or fp16), R = num_queries * G packed rows, row
  r = s * G + g is query token s (of num_queries S new tokens) for q head kv_head * G + g.
  Query token s of sequence b is at position p = lengths[b] - S + s; it attends to keys t with
  t < lengths[b], t <= p, and (if options.window) t > p - window.
  dense:  k, v [B, T, Hkv, D]; block_tables None.
  paged:  k, v [P, page_size, Hkv, D]; block_tables int32 [B, max_pages]; token t of sequence
          b is at k[block_tables[b, t // page_size], t % page_size].
  options: scale, softcap and window of the call.
  config: a resolved `DecodeConfig` (num_splits set; `config.resolve_config`), checked here by
    `config.check_config`. With kv_groups=2 the grid has num_splits / 2 programs per (batch,
    head), so use it only where that still fills the GPU.
  num_programs: the programs a persistent config launches (default: the SM count); each loops
    over the work items program, program + P, ... with its rings streaming on across items.
  tile_math: what the consumers compute per tile (`TileMath`; probes subclass it).
  interpret: False, True or a plgpu.InterpretGPUParams (run on the CPU in interpret mode).

  Returns (out [B, Hkv, num_splits, R, D] float32, the softmax-normalised output of each split;
  lse [B, Hkv, num_splits, R] float32, natural-log sum-exp of the split's logits, -inf (and out
  0) where the split saw no valid key). logits = scale * q.k, then softcap * tanh(logits /
  softcap) if softcap.

  Keys past lengths[b] inside the last loaded tile are masked with p = 0, so cache memory there
  must hold finite values (0 * inf would be NaN); TMA zero-fills past the end of the array.
  """
  split_k.check_packed_args(q, k, v, lengths, block_tables, num_queries=num_queries)
  B, Hkv, R, D = q.shape
  page_size = None if block_tables is None else k.shape[1]
  mgpu_config.check_config(config, rows=R, head_dim=D, dtype=k.dtype, page_size=page_size)
  if block_tables is None:
    kv_tiling = tiling.KVTiling(config.block_kv, D, k.dtype)
  else:
    kv_tiling = tiling.KVTiling(config.block_kv, D, k.dtype, page_size=page_size, num_pages=k.shape[0],
                                max_pages=block_tables.shape[1])
  row_wgs, num_row_blocks = mgpu_config.row_blocking(R)
  rows_padded = row_wgs * ROWS_PER_WG * num_row_blocks
  out_rows = R if num_row_blocks == 1 else rows_padded
  smem = mgpu_config.DecodeSmem.for_call(config, rows=R, head_dim=D, dtype=k.dtype, page_size=page_size,
                                         stage_p=bool(interpret))
  st = _Static(
      num_queries=num_queries, group=R // num_queries, rows=R, num_row_blocks=num_row_blocks,
      out_rows=out_rows, lse_rows=split_k.round_up(out_rows, _LSE_ROW_MULTIPLE),
      num_splits=config.num_splits, capacity=kv_tiling.capacity(k.shape), options=options,
      tiling=kv_tiling, smem=smem, batch=B, num_kv_heads=Hkv, pipeline_qk=config.pipeline_qk,
      tile_math=tile_math)
  if config.persistent:
    if num_programs is None:
      num_programs = runtime.num_sms()
    if num_programs < 1:
      raise ValueError(f"{num_programs=} must be a positive int or None")
    st = dataclasses.replace(st, num_programs=min(int(num_programs), st.num_items))

  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  elif interpret is False:
    interpret = None
  if rows_padded != R:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows_padded - R), (0, 0)))
  args = (q, k, v, lengths) if block_tables is None else (q, k, v, lengths, block_tables)
  out, lse = _build(st, interpret)(*args)
  if out_rows != R:
    out = out[:, :, :, :R]
  return out, lse[..., :R]
