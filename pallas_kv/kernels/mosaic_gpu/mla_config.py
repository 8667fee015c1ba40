"""The MLA kernel's SMEM layout and its config: what fits, what the kernel accepts, the split count.

`mla.py` is the kernel; this module sizes it (`MlaSmem`: the single source for its scratch and
for the fit check) and chooses and checks its `MosaicMLAConfig` (`resolve_config`, `check_config`).
The consumers' schedule is the shipped one unless an experimental variant config names another
(`Schedule`, `schedule_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.config import MosaicMLAConfig
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

ROWS = mgpu_config.ROWS_PER_WG     # packed query rows per program (wgmma M)
VALUE_WGS = 2                      # consumers, each owning Dv / 2 value columns
BLOCK_KV = 64                      # wgmma K of P V; two 64 x 576 tiles + Q fill SMEM
# 32-token tiles fit four stages in the same SMEM: what pipeline_qk needs, since its scorer holds
# two tiles at once (Q K^T of the next in flight with P V of this one) and a third must be loading.
BLOCK_KVS = (32, 64)
# Row reductions of the WGMMA layout stay inside a warp: no cross-warp scratch is needed, and the
# 64 x 576 tiles leave none to spare.
REDUCTION_SCRATCH_BYTES = 0
# Schedule.rows_as_n: the packed rows are wgmma's N, padded to a multiple of 16 (P's rows
# then span 32 bytes, the narrowest swizzle), at most 64 (beyond that, rows as M pad nothing).
# The softmax reduces the transposed scores over keys, across the scorer's four warps, through
# SMEM scratch: 1 KiB per register reduced at once (4 warps x 32 lanes x 2 float32), four at once
# where it fits; at 64 rows Q takes 72 KiB and one fits.
ROWS_AS_N_MULTIPLE = 16
ROWS_AS_N_MAX = 64
ROWS_AS_N_SCRATCH_BYTES = {16: 4096, 32: 4096, 48: 1024, 64: 1024}


# ---------------------------------------------------------------- registers

# Three warpgroups of 128 threads launch with 168 registers each (64K / 384, rounded down to 8):
# setmaxnreg then moves registers between them within that pool, in multiples of 8.
LAUNCH_REGISTERS = 168
REGISTER_POOL = (VALUE_WGS + 1) * LAUNCH_REGISTERS


@dataclasses.dataclass(frozen=True)
class RegisterSplit:
  """Registers per thread of the producer warpgroup and of each consumer (`setmaxnreg`).

  The producer only issues copies; the consumers hold a 64 x 256 float32 accumulator (128
  registers), the scores (32) and wgmma descriptors. ptxas allocates within each warpgroup's count
  and spills past it (`benchmarks.ptxas_summary`). The default is FA3's 24 / 240: with
  Codegen.q_per_tile the consumers' code spills nothing (ptxas, thirteenth set; 40 / 232 spilled).
  """
  producer: int = 24
  consumer: int = 240

  def __post_init__(self):
    for name, count in (("producer", self.producer), ("consumer", self.consumer)):
      if count % 8 or not 24 <= count <= 256:
        raise ValueError(f"RegisterSplit.{name}={count} must be a multiple of 8 in [24, 256]")
    if self.producer + VALUE_WGS * self.consumer > REGISTER_POOL:
      raise ValueError(f"{self} needs {self.producer + VALUE_WGS * self.consumer} registers per thread slot; the "
                       f"three warpgroups launch with {REGISTER_POOL}")

  @property
  def name(self) -> str:
    """The kernel name's suffix: empty for the default split."""
    return "" if self == RegisterSplit() else f"_r{self.producer}_{self.consumer}"


@dataclasses.dataclass(frozen=True)
class Codegen:
  """How the kernel is compiled, not what it computes: measured choices, named in the kernel name.

  registers: the warpgroups' register split.
  q_per_tile: Q's SMEM address is made opaque to the compilers on every tile (its index is a zero
    loaded from SMEM, which neither LLVM nor ptxas can fold), so that Q K^T's wgmma descriptors
    (one 64-bit value per 16 columns: 36 at Dqk 576) are rebuilt each tile from one base instead
    of being hoisted out of the loop, where they hold 72 registers or, past the consumers' count,
    spill (ptxas, twelfth set). On by default: with 24 / 240 registers the kernel's launch alone
    ran 131.5 us against 146.3 held and 40 / 232 at B64 T4096 (benchmarks/RESULTS.md, thirteenth
    set). Every schedule but split_scores (which slices Q itself, and ignores it).
  slots_per_tile: the alternate scorers' ring steps are made opaque the same way: with two stages
    consumer w scores only tiles in slot w and reads the other's in slot 1 - w, so the K and V
    descriptors of both slots are loop-invariant, hoisted, and spill (ptxas, thirteenth set).
    Only alternate_scores reads it. Not yet timed.
  """
  registers: RegisterSplit = RegisterSplit()
  q_per_tile: bool = True
  slots_per_tile: bool = False

  @property
  def name(self) -> str:
    """The kernel name's suffix: empty for the default; `_heldq` where Q's descriptors are held."""
    return f"{self.registers.name}{'' if self.q_per_tile else '_heldq'}{'_spt' if self.slots_per_tile else ''}"


# ---------------------------------------------------------------- SMEM layout, config

@dataclasses.dataclass(frozen=True)
class Schedule:
  """How the two consumer warpgroups share a tile's work. The shipped schedule: one scorer
  computes Q K^T and the softmax, runs its half of P V with P from registers, and hands P to its
  partner through SMEM (`p_in_registers`; docs/decisions.md#mla-p-in-registers). The other fields
  are experimental variants that measured slower or within noise (`pallas_kv.experimental`,
  docs/decisions.md#mla-schedules)."""
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


def schedule_of(config) -> Schedule:
  """The schedule a config runs: the shipped one, or the fields of an experimental variant config
  (`pallas_kv.experimental.MLAVariantConfig`) that names another."""
  return Schedule(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Schedule) if hasattr(config, f.name)})


@dataclasses.dataclass(frozen=True)
class MlaSmem:
  """The SMEM layout of one program; the single source for scratch and for the fit check.

  q_block  [1, 64, Dqk] dtype, swizzled        packed query rows (wgmma A of Q K^T)
  union    ring [num_stages, bkv, Dqk] dtype, swizzled   | (out [2, 64, Dv/2] out_dtype,
                                                            lse [64] f32)   after the loop
  p        [64, bkv]  dtype, swizzled          P of the current tile (wgmma A of P V)
  rows     [4, 64]    f32                      alpha of the current tile; the final row sum;
           ([6, 64] with alternate_scores: the max and rescale of a pair's first tile, of its
           second, then each consumer's row sum); then a row of zeros per consumer
           (Codegen's per-tile index)
  barriers: ring produced / consumed per slot, q, p_ready and max_ready (one per consumer with
  alternate_scores), p_free, consumers_done.
  """
  qk_dim: int
  v_dim: int
  dtype: Any
  out_dtype: Any
  block_kv: int = BLOCK_KV
  num_stages: int = 2
  copies_per_tile: int = 1
  split_scores: bool = False   # P as two [64, bkv/2] halves, one per consumer (`_score_half_tiles`)
  rows_as_n: int = 0           # q rows as wgmma N (Schedule.rows_as_n): this many, padded; 0: rows as M
  alternate_scores: bool = False   # the consumers score alternate tiles (`_alternate_consumer`)
  ring_halves: bool = False    # ring slots in two column parts: [0, Dv/2) and [Dv/2, Dqk)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))

  @property
  def half_v(self) -> int:
    return self.v_dim // VALUE_WGS

  @property
  def half_kv(self) -> int:
    return self.block_kv // VALUE_WGS

  @property
  def q_rows(self) -> int:
    """Rows of Q, of the row vectors and of the output staging: 64, or the rows as N."""
    return self.rows_as_n or ROWS

  @property
  def reduction_scratch_bytes(self) -> int:
    return ROWS_AS_N_SCRATCH_BYTES[self.rows_as_n] if self.rows_as_n else REDUCTION_SCRATCH_BYTES

  def transforms(self, minor_dim: int):
    """SMEM transforms of an operand. wgmma takes one swizzle for both of its operands, so Q and
    the ring follow P's rows: 64 bytes with 32-token tiles or split_scores' P halves, and with
    rows as N P's rows are the q rows (32 bytes at 16)."""
    limit = self.block_kv * self.dtype.itemsize
    if self.split_scores:
      limit = self.half_kv * self.dtype.itemsize
    elif self.rows_as_n:
      limit = self.rows_as_n * self.dtype.itemsize
    return tiling.smem_transforms(self.dtype, minor_dim, max_swizzle=limit)

  def p_type(self):
    if self.split_scores:   # one half per consumer (separate buffers: wgmma takes no indexed ref)
      return tuple(plgpu.SMEM((ROWS, self.half_kv), self.dtype, transforms=self.transforms(self.half_kv))
                   for _ in range(VALUE_WGS))
    if self.rows_as_n:   # P^T [bkv, N]: the B operand of O^T = V^T P^T
      return plgpu.SMEM((self.block_kv, self.rows_as_n), self.dtype, transforms=self.transforms(self.rows_as_n))
    return plgpu.SMEM((ROWS, self.block_kv), self.dtype, transforms=self.transforms(self.block_kv))

  def ring_spec(self) -> pipeline.RingSpec:
    """With ring_halves, part 0 (the scorer's value half) is released by the scorer alone and part
    1 by the partner alone (the scorer's Q K^T is done with it before P reaches the partner); the
    alternate scorers: part w by consumer w."""
    parts = (self.half_v, self.qk_dim - self.half_v) if self.ring_halves else ()
    return pipeline.RingSpec(num_stages=self.num_stages, block_shape=(self.block_kv, self.qk_dim),
                             dtype=self.dtype, transforms=self.transforms(self.qk_dim),
                             copies_per_slot=self.copies_per_tile,
                             num_consumers=1 if self.ring_halves else VALUE_WGS, column_parts=parts)

  def scratch_types(self) -> dict[str, Any]:
    ring = self.ring_spec()
    produced, consumed = ring.barrier_types()
    # Each consumer's half of the output: [64, Dv/2], or O^T's [Dv/2, N] with rows as N.
    half_out = (self.half_v, self.rows_as_n) if self.rows_as_n else (ROWS, self.half_v)
    out_stage = (plgpu.SMEM((VALUE_WGS, *half_out), self.out_dtype),
                 plgpu.SMEM((self.q_rows,), jnp.float32))
    return dict(
        # [1, rows, Dqk]: a leading index for Codegen.q_per_tile (Q is q_block.at[0]).
        q_block=plgpu.SMEM((1, self.q_rows, self.qk_dim), self.dtype,
                          transforms=self.transforms(self.qk_dim)),
        # The output staging reuses the ring's memory once every tile is consumed.
        union=plgpu.RefUnion(ring.buffer_type(), out_stage),
        p_smem=self.p_type(),
        row_smem=plgpu.SMEM((self.row_vectors, self.q_rows), jnp.float32),
        produced=produced, consumed=consumed,
        q_barrier=plgpu.Barrier(),
        # split_scores: both consumers arrive at each (and max_ready carries the row maxima).
        # alternate_scores: p_ready[w] and max_ready[w] are consumer w's hand-over of its P and of
        # its tile's max; p_free frees P before an odd last tile.
        p_ready=plgpu.Barrier(num_arrivals=VALUE_WGS if self.split_scores else 1,
                              num_barriers=VALUE_WGS if self.alternate_scores else 1),
        p_free=plgpu.Barrier(num_arrivals=VALUE_WGS if self.split_scores else 1),
        max_ready=plgpu.Barrier(num_arrivals=1 if self.alternate_scores else VALUE_WGS,
                                num_barriers=VALUE_WGS if self.alternate_scores else 1),
        consumers_done=plgpu.Barrier(num_arrivals=VALUE_WGS))

  @property
  def zero_rows(self) -> int:
    """The first of the rows of zeros, one per consumer, that Codegen.q_per_tile reads Q's index from."""
    return 6 if self.alternate_scores else 2

  @property
  def row_vectors(self) -> int:
    return self.zero_rows + VALUE_WGS

  @property
  def nbytes(self) -> int:
    """SMEM bytes the kernel asks for (allocations aligned as Mosaic GPU aligns them)."""
    align = pipeline.align_up
    ring = self.ring_spec()
    rows = self.q_rows
    out_stage = align(rows * self.v_dim * self.out_dtype.itemsize) + rows * 4
    q = rows * self.qk_dim * self.dtype.itemsize
    p = rows * self.block_kv * self.dtype.itemsize
    barriers = ring.barrier_bytes + (7 if self.alternate_scores else 5) * pipeline.BARRIER_BYTES
    return (align(q) + align(max(ring.buffer_bytes, out_stage)) + align(p) + align(self.row_vectors * rows * 4)
            + align(self.reduction_scratch_bytes) + barriers)

  @property
  def fits(self) -> bool:
    return self.nbytes <= mgpu_config.SMEM_CAPACITY_BYTES

  @classmethod
  def for_call(cls, config: MosaicMLAConfig, *, qk_dim: int, v_dim: int, dtype: Any, page_size: int,
               rows: int = ROWS) -> "MlaSmem":
    """Outputs and split partials alike are staged in the cache's dtype (`mla_partials`); rows:
    the packed q rows (they size the rows-as-N layout)."""
    return cls(qk_dim=qk_dim, v_dim=v_dim, dtype=dtype, out_dtype=dtype,
               block_kv=config.block_kv, num_stages=config.num_stages,
               copies_per_tile=mgpu_config.copies_per_tile(config.block_kv, page_size),
               split_scores=schedule_of(config).split_scores,
               rows_as_n=plan.round_up(rows, ROWS_AS_N_MULTIPLE) if schedule_of(config).rows_as_n else 0,
               alternate_scores=schedule_of(config).alternate_scores, ring_halves=schedule_of(config).ring_halves)


def row_blocks(rows: int) -> int:
  """Programs per (sequence, split): one per 64 packed rows."""
  return plan.cdiv(rows, ROWS)


def check_config(config: MosaicMLAConfig, *, qk_dim: int, v_dim: int, dtype: Any, page_size: int,
                 rows: int = ROWS) -> None:
  """What the MLA kernel needs of a complete config beyond `MosaicMLAConfig`'s own rules (rows: the
  packed q rows of the call)."""
  if not isinstance(config, MosaicMLAConfig) or not config.complete:
    raise ValueError(f"the MLA kernel takes a complete MosaicMLAConfig (resolve_config), got {config!r}")
  schedule_of(config).check(block_kv=config.block_kv, rows=rows)
  reason = mgpu_config.page_size_reason(page_size)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  smem = MlaSmem.for_call(config, qk_dim=qk_dim, v_dim=v_dim, dtype=dtype, page_size=page_size, rows=rows)
  if not smem.fits:
    raise ValueError(f"num_stages={config.num_stages} of {config.block_kv} x {qk_dim} tiles needs {smem.nbytes} "
                     f"bytes of SMEM, over the {mgpu_config.SMEM_CAPACITY_BYTES} available; use fewer stages")


def heuristic_config(problem, *, dtype: Any = "bfloat16") -> MosaicMLAConfig:
  """64-token tiles and the deepest ring that fits (2 stages at Dqk 576, as FlashMLA), with
  per-sequence splits in batch order (`resolve_config` may reorder)."""
  config = MosaicMLAConfig(block_kv=BLOCK_KV, num_stages=2, split_plan="per_sequence", sequence_order="given")
  while True:
    deeper = dataclasses.replace(config, num_stages=config.num_stages + 1)
    smem = MlaSmem.for_call(deeper, qk_dim=problem.head_dim, v_dim=problem.v_head_dim, dtype=dtype,
                            page_size=problem.page_size)
    if deeper.num_stages > 4 or not smem.fits:
      return config
    config = deeper


def resolve_config(problem, config: MosaicMLAConfig | None, *, dtype: Any = "bfloat16",
                   num_sms: int | None = None) -> MosaicMLAConfig:
  """The given fields over the heuristic's; a split count left None fills about one wave (the
  balanced plan: its bound on one sequence's splits, `plan.choose_balanced_splits`).

  A config that leaves sequence_order None takes the sequences longest first where the programs
  make more than one wave (one program per SM: the SMEM takes it all), so that a ragged batch's
  long sequences start in the first wave (docs/decisions.md#mla-longest-first).
  """
  if config is not None and not isinstance(config, MosaicMLAConfig):
    raise TypeError(f"the MLA kernel takes a MosaicMLAConfig, got {type(config).__name__}")
  given = config or MosaicMLAConfig()
  resolved = given.over(heuristic_config(problem, dtype=dtype))
  num_sms = num_sms or runtime.num_sms()
  blocks = row_blocks(problem.num_queries * problem.num_heads)
  resolved = plan.fill_num_splits(_one_head(problem),
                                  resolved, row_blocks=blocks, num_sms=num_sms)
  if given.sequence_order is None and problem.batch * blocks * resolved.num_splits > num_sms:
    resolved = dataclasses.replace(resolved, sequence_order="longest_first")
  return resolved


@dataclasses.dataclass(frozen=True)
class _OneHead:
  """The sizes `plan.fill_num_splits` reads, for one latent head."""
  batch: int
  capacity: int
  num_kv_heads: int = 1


def _one_head(problem) -> _OneHead:
  return _OneHead(batch=problem.batch, capacity=problem.capacity)
