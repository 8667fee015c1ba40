"""Split-K flash-decoding partials on Mosaic GPU (Hopper wgmma + TMA).

One program per (batch, kv head [x row block], split). It owns a contiguous range of KV tiles
of its sequence, computed at run time from `lengths` so that tiles past the end (or before
the sliding window) are never loaded. Warp specialization:

  producer warpgroup   walks the range and TMA-copies K and V tiles into two SMEM rings
                       (`pallas_kv.pipeline.Ring`), up to num_stages tiles ahead;
  consumer warpgroups  each owns 64 packed query rows (all q heads of the KV head x all new
                       tokens, zero-padded to 64 for wgmma): S = Q K^T and O += P V on the
                       tensor cores, online softmax in float32 in the WGMMA register layout.
                       Two consumers split 65..128 rows; with kv_groups=2 two consumers
                       instead stream two splits' tiles from their own rings.

Each split writes its softmax-normalised partial output and its natural-log LSE; the caller
merges splits (`lse_tot = logsumexp(lse)`, `out = sum(exp(lse - lse_tot) * out)`).
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

from pallas_kv import pipeline as kv_pipeline
from pallas_kv import tiling as kv_tiling
from pallas_kv.kernels import split_k

ROWS_PER_WG = 64            # wgmma M: packed query rows per consumer warpgroup
MAX_COMPUTE_WGS = 2         # 2 consumers + 1 producer = 384 threads
PRODUCER_REGISTERS = 40     # the producer only issues TMA: give its registers to the consumers
SMEM_CAPACITY_BYTES = 227 * 1024   # per thread block, Hopper (H100 / H200)
# Scratch Mosaic GPU reserves for cross-warp reductions (CompilerParams default).
_REDUCTION_SCRATCH_BYTES = plgpu.CompilerParams().reduction_scratch_bytes
# TMA stores need 16-byte rows: the lse output is padded to a multiple of 4 float32 rows.
_LSE_ROW_MULTIPLE = 4
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _cdiv(a, b):
  return -(-a // b)


def _round_up(a: int, b: int) -> int:
  return _cdiv(a, b) * b


def row_blocking(rows: int) -> tuple[int, int]:
  """(consumer warpgroups per program, row blocks in the grid) for `rows` packed rows.

  Rows beyond 2 x 64 are split over more programs (each re-reads the KV of its head).
  """
  num_wgs = min(_cdiv(rows, ROWS_PER_WG), MAX_COMPUTE_WGS)
  return num_wgs, _cdiv(rows, num_wgs * ROWS_PER_WG)


def _consumer_registers(num_wgs: int) -> int:
  # 64K registers per SM shared by 128-thread warpgroups; at most 256 per thread; multiple of 8.
  return int(min(256, (512 - PRODUCER_REGISTERS) / num_wgs) // 8 * 8)


def check_kv_groups(*, kv_groups: int, rows: int, num_splits: int, num_stages: int) -> None:
  """Validates `kv_groups`: consumer warpgroups that stream different KV tiles in one program.

  kv_groups=2 gives each of two consumer warpgroups one split's tiles and its own ring pair
  (two softmax pipelines per SM). It needs the packed rows to fit one warpgroup (rows <= 64),
  an even split count (a program serves two splits; the grid has num_splits / 2 of them) and an
  even num_stages (the slots are shared out equally).
  """
  if kv_groups == 1:
    return
  if kv_groups != 2:
    raise ValueError(f"{kv_groups=} must be 1 or 2")
  if rows > ROWS_PER_WG:
    raise NotImplementedError(f"kv_groups=2 needs <= {ROWS_PER_WG} packed rows, got {rows}")
  if num_splits % 2:
    raise ValueError(f"kv_groups=2 needs an even num_splits, got {num_splits=}")
  if num_stages % 2:
    raise ValueError(f"kv_groups=2 needs an even num_stages, got {num_stages=}")


@dataclasses.dataclass(frozen=True)
class DecodeSmem:
  """The SMEM layout of one decode program; the single source for scratch and for fit checks.

  q      [row_wgs, 64, D] dtype              packed queries, swizzled (wgmma A operand)
  union  ( per KV group g: K ring g [stages / kv_groups, bkv, D], V ring g [same] )  streaming
         | ( out [num_wgs, 64, D] f32, lse [num_wgs, 64] f32 )                  after the loop
         (separate_out: rings and out/lse side by side, for a persistent program whose rings
         keep streaming the next work item while one item's partial is stored)
  barriers: produced + consumed per ring slot, q per row warpgroup, one among consumers.
  `num_stages` counts the KV tile slots of each role (K or V) over all groups.
  """
  head_dim: int
  dtype: Any
  block_kv: int
  num_stages: int
  row_wgs: int = 1          # consumer warpgroups that split the packed rows (64 each)
  kv_groups: int = 1        # consumer warpgroups that split the KV tiles (own rings each)
  copies_per_tile: int = 1
  stage_p: bool = False     # P staged in SMEM for P @ V (interpret mode only)
  separate_out: bool = False   # out/lse staging beside the rings, not aliasing them (persistent)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.num_stages % self.kv_groups:
      raise ValueError(f"{self.num_stages=} must be a multiple of {self.kv_groups=}")

  @property
  def num_wgs(self) -> int:
    return self.row_wgs * self.kv_groups

  def ring_spec(self) -> kv_pipeline.RingSpec:
    return kv_pipeline.RingSpec(
        num_stages=self.num_stages // self.kv_groups, block_shape=(self.block_kv, self.head_dim),
        dtype=self.dtype, transforms=kv_tiling.smem_transforms(self.dtype, self.head_dim),
        copies_per_slot=self.copies_per_tile, num_consumers=self.row_wgs)

  def scratch_types(self) -> dict[str, Any]:
    ring = self.ring_spec()
    rings, barriers = [], {}
    for g in range(self.kv_groups):
      rings += [ring.buffer_type(), ring.buffer_type()]
      for role in ("k", "v"):
        barriers[f"{role}{g}_produced"], barriers[f"{role}{g}_consumed"] = ring.barrier_types()
    out_stage = (plgpu.SMEM((self.num_wgs, ROWS_PER_WG, self.head_dim), jnp.float32),
                 plgpu.SMEM((self.num_wgs, ROWS_PER_WG), jnp.float32))
    if self.separate_out:
      buffers = dict(rings=tuple(rings), out_stage=out_stage)
    else:
      # Output staging reuses the rings' memory once every tile is consumed.
      buffers = dict(union=plgpu.RefUnion(tuple(rings), out_stage))
    scratch = dict(
        q_smem=plgpu.SMEM((self.row_wgs, ROWS_PER_WG, self.head_dim), self.dtype,
                          transforms=kv_tiling.smem_transforms(self.dtype, self.head_dim)),
        **buffers,
        q_barrier=plgpu.Barrier(num_barriers=self.row_wgs),
        consumers_done=plgpu.Barrier(num_arrivals=self.num_wgs),
        **barriers)
    if self.stage_p:
      scratch["p_smem"] = plgpu.SMEM(self._p_shape, self.dtype)
    return scratch

  @property
  def _p_shape(self) -> tuple[int, int, int]:
    return (self.num_wgs, ROWS_PER_WG, self.block_kv)

  @property
  def nbytes(self) -> int:
    """SMEM bytes the kernel asks for (allocations aligned as Mosaic GPU aligns them)."""
    ring = self.ring_spec()
    align = kv_pipeline.align_up
    rings = 2 * self.kv_groups * align(ring.buffer_bytes)
    outputs = align(self.num_wgs * ROWS_PER_WG * self.head_dim * 4) + self.num_wgs * ROWS_PER_WG * 4
    q = self.row_wgs * ROWS_PER_WG * self.head_dim * self.dtype.itemsize
    barriers = (2 * self.kv_groups * ring.barrier_bytes
                + (self.row_wgs + 1) * kv_pipeline.BARRIER_BYTES)
    p = math.prod(self._p_shape) * self.dtype.itemsize if self.stage_p else 0
    streaming = rings + align(outputs) if self.separate_out else max(rings, outputs)
    return (align(q) + align(streaming) + align(p)
            + align(_REDUCTION_SCRATCH_BYTES) + barriers)

  @property
  def fits(self) -> bool:
    return self.nbytes <= SMEM_CAPACITY_BYTES


def smem_bytes(*, rows: int, head_dim: int, dtype: Any, block_kv: int, num_stages: int,
               page_size: int | None = None, kv_groups: int = 1, persistent: bool = False) -> int:
  """SMEM bytes one decode program needs (rows = num_queries * group size, before padding)."""
  row_wgs, _ = row_blocking(rows)
  copies = block_kv // page_size if page_size is not None and page_size < block_kv else 1
  return DecodeSmem(head_dim=head_dim, dtype=dtype, block_kv=block_kv, num_stages=num_stages,
                    row_wgs=row_wgs, kv_groups=kv_groups, copies_per_tile=copies,
                    separate_out=persistent).nbytes


def fits_smem(**kwargs) -> bool:
  """Whether a config fits in Hopper's 227 KiB of SMEM per block (same args as smem_bytes)."""
  return smem_bytes(**kwargs) <= SMEM_CAPACITY_BYTES


# Measurement-only variants of the consumer (`decode_partials(_probe=...)`): each leaves out a
# stage so that a benchmark can tell where the time goes. Their results are WRONG by design;
# nothing in the public API can select them.
PROBES = ("no_qk", "no_softmax", "no_pv", "loads_only")


def check_pipeline_options(*, pipeline_qk: bool, persistent: bool, kv_groups: int,
                           num_stages: int, probe: str | None) -> None:
  """Validates the combinations of pipeline_qk, persistent, kv_groups and probe."""
  if pipeline_qk and num_stages < 2:
    # The consumer holds tile i's K slot until tile i+1's QK^T is done.
    raise ValueError(f"pipeline_qk=True needs num_stages >= 2, got {num_stages=}")
  if persistent and kv_groups != 1:
    raise NotImplementedError(f"persistent=True needs kv_groups=1, got {kv_groups=}")
  if probe is not None:
    if probe not in PROBES:
      raise ValueError(f"_probe={probe!r} must be one of {PROBES} or None")
    if pipeline_qk:
      raise NotImplementedError("_probe applies to the pipeline_qk=False consumer only")


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
  scale: float
  softcap: float | None
  window: int | None
  tiling: kv_tiling.KVTiling
  smem: DecodeSmem
  batch: int = 1
  num_kv_heads: int = 1
  pipeline_qk: bool = False
  num_programs: int | None = None   # persistent grid: programs looping over work items
  probe: str | None = None          # measurement only, see PROBES

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
  """This split's tiles [t0, t1) and the unmasked sub-range [a, c) (`tiling.split_tile_range`)."""
  return kv_tiling.split_tile_range(length, split, block_kv=st.tiling.block_kv, num_queries=st.num_queries,
                                    num_splits=st.num_splits, window=st.window)


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
  rings = [tuple(kv_pipeline.Ring(ring_spec, ring_slots[2 * g + i], scratch[f"{role}{g}_produced"],
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
                         steps_before, q_ref.dtype, st)
        _write_partials(carry, out_smem.at[w], lse_smem.at[w], out_ref, lse_ref,
                        scratch["consumers_done"], b=item.b, head=item.head,
                        split=item.splits[g], rw=rw, row0=row0, st=st)
        return item.counts[g]

      _for_each_item(consume, lengths_ref, st)
      if st.persistent:
        plgpu.wait_smem_to_gmem(0)


def _consume(q_tile, k_ring, v_ring, p_smem, length, row0, t0, t1, a, c, step0, dtype,
             st: _Static):
  """Online softmax over tiles [t0, t1): masked head [t0, a), plain body [a, c), masked tail.

  Ring step step0 + i holds tile t0 + i.
  """
  bkv = st.tiling.block_kv
  D = st.tiling.head_dim
  G = st.group
  wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
  probe = st.probe
  s_type = plgpu.ACC((ROWS_PER_WG, bkv), jnp.float32)

  def issue_qk(s_ref, k_tile):
    if probe not in ("no_qk", "loads_only"):
      plgpu.wgmma(s_ref, q_tile, k_tile.transpose((1, 0)))

  def softmax(s, tile, acc, m_i, l_i, masked: bool):
    """(acc rescaled, m, l, P in dtype) after tile `tile`'s logits s [64, bkv] f32."""
    if probe == "no_softmax":
      return acc, m_i, l_i, s.astype(dtype)
    # Logits in log2 units so that exp2 (one MUFU op) does the softmax.
    if st.softcap is not None:
      s = jnp.tanh(s * (st.scale / st.softcap)) * (st.softcap * LOG2E)
    else:
      s = s * (st.scale * LOG2E)
    if masked:
      # Row r is query s_r = r // G at p = L - S + s_r. With x = t - (L - S):
      # t <= p  <=>  x * G <= r;   t > p - window  <=>  r < (x + window) * G.
      rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + row0
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      x_g = (cols + (tile * bkv - length + st.num_queries)) * G
      valid = x_g <= rows
      if st.window is not None:
        valid = valid & (rows < x_g + st.window * G)
      s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    # A row with no valid key yet keeps m = -inf; shift by 0 then so that exp2 gives 0, not NaN.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_new, l_i, p.astype(dtype)

  def pv(acc, p16, i):
    v_tile = v_ring.wait(i)    # [bkv, D]
    if probe not in ("no_pv", "loads_only"):
      acc = _pv_update(acc, p16, v_tile, p_smem)
    v_ring.release(i)
    return acc

  acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, D), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), wgmma_rows)
  l_i = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), wgmma_rows)

  if not st.pipeline_qk:
    def step(tile, carry, *, masked: bool):
      acc, m_i, l_i = carry
      i = step0 + tile - t0
      k_tile = k_ring.wait(i)    # [bkv, D]

      def qk(s_ref):
        issue_qk(s_ref, k_tile)
        return s_ref[...]

      s = pl.run_scoped(qk, s_type)   # [64, bkv]
      k_ring.release(i)
      if probe == "loads_only":
        v_ring.wait(i)
        v_ring.release(i)
        return acc, m_i, l_i
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
        issue_qk(s_ref, k_ring.wait(step0))
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
        issue_qk(s_ref, k_next)
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


def _pv_update(acc, p16, v_tile, p_smem=None):
  """acc + P @ V on the tensor cores: acc [64, D] f32 (WGMMA layout), p16 [64, bkv], v_tile SMEM."""
  if p_smem is None:
    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p16, v_tile)
    return pl.run_state(pv)(plgpu.ACC.init(acc))

  # GPU interpret mode (jax 0.11.2) runs neither pl.run_state nor wgmma with a register
  # operand: stage P in SMEM ([64, bkv]) and accumulate into a fresh accumulator instead.
  p_smem[...] = p16

  def mma(acc_ref):
    plgpu.wgmma(acc_ref, p_smem, v_tile)
    return acc_ref[...]

  return acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))


def _write_partials(carry, out_smem, lse_smem, out_ref, lse_ref, consumers_done, *,
                    b, head, split, rw: int, row0, st: _Static):
  """Normalises and stores one warpgroup's partial: out_smem [64, D] f32, lse_smem [64] f32."""
  acc, m_i, l_i = carry
  has_keys = l_i > 0
  l_safe = jnp.where(has_keys, l_i, 1.0)
  out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
  lse = jnp.where(has_keys, m_i * LN2 + jnp.log(l_safe), -jnp.inf)
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
  if st.probe is not None:
    name += f"_PROBE_{st.probe}"
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


def decode_partials(q, k, v, lengths, block_tables=None, *, num_queries: int, num_splits: int,
                    block_kv: int, num_stages: int, scale: float, softcap: float | None = None,
                    window: int | None = None, kv_groups: int = 1, pipeline_qk: bool = False,
                    persistent_programs: int | None = None, interpret: Any = False,
                    _probe: str | None = None):
  """Split-K partials of decode attention over a contiguous or paged KV cache.

  q: [B, Hkv, R, D] in k's dtype (bf16 or fp16), R = num_queries * G packed rows, row
  r = s * G + g is query token s (of num_queries S new tokens) for q head kv_head * G + g.
  Query token s of sequence b is at position p = lengths[b] - S + s; it attends to keys t with
  t < lengths[b], t <= p, and (if window) t > p - window.
  dense:  k, v [B, T, Hkv, D]; block_tables None.
  paged:  k, v [P, page_size, Hkv, D]; block_tables int32 [B, max_pages]; token t of sequence
          b is at k[block_tables[b, t // page_size], t % page_size].
  kv_groups: 1, or 2 to have two consumer warpgroups per program each stream one split's tiles
    (needs <= 64 packed rows and even num_splits and num_stages; the grid then has num_splits/2
    programs per (batch, head), so use it only where that still fills the GPU).
  pipeline_qk: issue tile i+1's Q K^T before tile i's softmax (needs num_stages >= 2).
  persistent_programs: None for one program per work item (kv head [x row block], split
    program, batch); else launch min(this, items) programs that each loop over the items
    program, program + P, ... with their rings streaming on across items (e.g. the SM count).
  interpret: False, True or a plgpu.InterpretGPUParams (run on the CPU in interpret mode).
  _probe: MEASUREMENT ONLY, results wrong by design: one of PROBES leaves out a consumer stage.

  Returns (out [B, Hkv, num_splits, R, D] float32, the softmax-normalised output of each split;
  lse [B, Hkv, num_splits, R] float32, natural-log sum-exp of the split's logits, -inf (and out
  0) where the split saw no valid key). logits = scale * q.k, then softcap * tanh(logits /
  softcap) if softcap.

  Keys past lengths[b] inside the last loaded tile are masked with p = 0, so cache memory there
  must hold finite values (0 * inf would be NaN); TMA zero-fills past the end of the array.
  """
  split_k.check_partials_args(q, k, v, lengths, num_queries=num_queries, num_splits=num_splits,
                              num_stages=num_stages, scale=scale, softcap=softcap, window=window)
  B, Hkv, R, D = q.shape
  if persistent_programs is not None and persistent_programs < 1:
    raise ValueError(f"{persistent_programs=} must be a positive int or None")
  group = R // num_queries

  if block_tables is None:
    if k.shape[0] != B:
      raise ValueError(f"dense k must be [B={B}, T, Hkv, D], got {k.shape=}")
    tiling = kv_tiling.KVTiling("k", block_kv, D, k.dtype)
  else:
    if block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.dtype != jnp.int32:
      raise ValueError(
          f"block_tables must be int32 [B={B}, max_pages], got {block_tables.shape=} "
          f"{block_tables.dtype=}")
    tiling = kv_tiling.KVTiling("k", block_kv, D, k.dtype, page_size=k.shape[1],
                                num_pages=k.shape[0], max_pages=block_tables.shape[1])

  check_kv_groups(kv_groups=kv_groups, rows=R, num_splits=num_splits, num_stages=num_stages)
  persistent = persistent_programs is not None
  check_pipeline_options(pipeline_qk=pipeline_qk, persistent=persistent, kv_groups=kv_groups,
                         num_stages=num_stages, probe=_probe)
  row_wgs, num_row_blocks = row_blocking(R)
  rows_padded = row_wgs * ROWS_PER_WG * num_row_blocks
  out_rows = R if num_row_blocks == 1 else rows_padded
  smem = DecodeSmem(head_dim=D, dtype=k.dtype, block_kv=block_kv, num_stages=num_stages,
                    row_wgs=row_wgs, copies_per_tile=tiling.copies_per_tile,
                    kv_groups=kv_groups, separate_out=persistent,
                    stage_p=bool(interpret))
  gpu_smem = dataclasses.replace(smem, stage_p=False)   # the fit that matters on the GPU
  if not gpu_smem.fits:
    raise ValueError(
        f"{block_kv=} x {num_stages=} needs {gpu_smem.nbytes} bytes of SMEM for head_dim {D} and "
        f"{R} packed rows{' (persistent)' if persistent else ''}, over the "
        f"{SMEM_CAPACITY_BYTES} available; use fewer stages")
  st = _Static(
      num_queries=num_queries, group=group, rows=R, num_row_blocks=num_row_blocks,
      out_rows=out_rows, lse_rows=_round_up(out_rows, _LSE_ROW_MULTIPLE), num_splits=num_splits,
      capacity=tiling.capacity(k.shape), scale=float(scale),
      softcap=None if softcap is None else float(softcap),
      window=None if window is None else int(window), tiling=tiling, smem=smem,
      batch=B, num_kv_heads=Hkv, pipeline_qk=bool(pipeline_qk), probe=_probe)
  if persistent:
    st = dataclasses.replace(st, num_programs=min(int(persistent_programs), st.num_items))

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
