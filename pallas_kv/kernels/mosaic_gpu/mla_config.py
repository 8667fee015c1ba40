"""The MLA kernel's SMEM layout (`MlaSmem`), compile options (`Codegen`), config choice (`resolve_config`,
`check_config`) and the seam to an experimental consumer schedule (`variant_schedule`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv.config import MosaicMLAConfig
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

# Dv splits over two consumers in 64-column swizzle tiles; Q and two 64-token stages must fit SMEM.
MLA_MAX_QK_DIM = 576
MLA_V_DIM_MULTIPLE = 128
MLA_ONE_BYTE_DTYPES = mgpu_config.FP8_DTYPES


def mla_reason(qk_dim: int, v_dim: int, kv_dtype) -> str | None:
  """Why the MLA kernel cannot serve a latent cache of Dqk = qk_dim, Dv = v_dim, or None."""
  kv_dtype = jnp.dtype(kv_dtype)
  if kv_dtype not in frame.KV_DTYPES + MLA_ONE_BYTE_DTYPES:
    return (f"MLA needs a bfloat16, float16 or fp8 (e4m3 / e5m2: fp8 wgmma) cache on Mosaic GPU, got "
            f"{kv_dtype.name}")
  if v_dim % MLA_V_DIM_MULTIPLE or qk_dim % 64 or not v_dim <= qk_dim <= MLA_MAX_QK_DIM:
    return (f"MLA needs v_head_dim a multiple of {MLA_V_DIM_MULTIPLE} and Dqk a multiple of 64 with "
            f"v_head_dim <= Dqk <= {MLA_MAX_QK_DIM} on Mosaic GPU, got Dqk {qk_dim}, v_head_dim {v_dim}")
  return None


def unsupported_reason(problem, dtypes) -> str | None:
  """Why the MLA kernel cannot serve the call, or None if it can."""
  return (mla_reason(problem.head_dim, problem.v_head_dim, dtypes[1])
          or mgpu_config.page_size_reason(problem.page_size))


ROWS = mgpu_config.ROWS_PER_WG
VALUE_WGS = 2                      # consumers, each owning Dv / 2 value columns
BLOCK_KV = 64
# 32-token tiles fit the four stages pipeline_qk needs (two tiles held, a third loading).
BLOCK_KVS = (32, 64)
# WGMMA row reductions stay inside a warp: no cross-warp scratch, and the ring leaves none to spare.
REDUCTION_SCRATCH_BYTES = 0
# rows_as_n: rows as wgmma N (multiples of 16, up to 64); cross-warp softmax scratch, 1 KiB per register.
ROWS_AS_N_MULTIPLE = 16
ROWS_AS_N_MAX = 64
ROWS_AS_N_SCRATCH_BYTES = {16: 4096, 32: 4096, 48: 1024, 64: 1024}
# Over a one-byte cache the math, not the bytes, bounds a tile of rows padded to M = 64 (16 heads: 4x the products
# the rows need); up to 32 rows take wgmma's N instead (docs/decisions.md#mla-fp8-rows-as-n).
ONE_BYTE_ROWS_AS_N_MAX = 32

# 64K registers / 384 threads, rounded down to 8: setmaxnreg moves registers within this pool.
LAUNCH_REGISTERS = 168
REGISTER_POOL = (VALUE_WGS + 1) * LAUNCH_REGISTERS


@dataclasses.dataclass(frozen=True)
class RegisterSplit:
  """Registers per thread of the producer and of each consumer (`setmaxnreg`); ptxas spills past them.
  FA3's 24 / 240 spills nothing (docs/decisions.md#mla-register-split)."""
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
    return "" if self == RegisterSplit() else f"_r{self.producer}_{self.consumer}"


@dataclasses.dataclass(frozen=True)
class Codegen:
  """How the kernel is compiled, not what it computes; named in the kernel name.

  q_per_tile: Q's SMEM index is a zero loaded each tile, so Q K^T's wgmma descriptors are rebuilt per tile
    instead of hoisted out of the loop, where they spill (docs/decisions.md#mla-q-per-tile).
  slots_per_tile: the same for ring steps, for experimental schedules (docs/decisions.md#mla-slots-per-tile).
  explicit_barriers: Mosaic GPU's automatic warpgroup barriers around every SMEM store off
    (`CompilerParams.unsafe_no_auto_barriers`); the shipped schedule syncs where its stores need it: P's hand-over
    loses four a tile, an fp8 cache's widening sixteen. A candidate, not yet measured on a GPU.
  one_byte_rows_as_n: over a one-byte cache, up to ONE_BYTE_ROWS_AS_N_MAX packed rows as wgmma's N (S^T = K Q^T,
    O^T = V^T P^T); False pads them to M = 64 as a 16-bit cache's are (`_rowsm`: the comparison).
  widen_own_values: over a one-byte cache each consumer widens its own value columns, the scorer while its Q K^T
    runs, and no widened tile is handed over; default, the partner widens both halves, so that an MMA-bound
    scorer's tile costs what a 16-bit one does. A candidate where the scorer has time to spare (rows as N).
  """
  registers: RegisterSplit = RegisterSplit()
  q_per_tile: bool = True
  slots_per_tile: bool = False
  explicit_barriers: bool = False
  one_byte_rows_as_n: bool = True
  widen_own_values: bool = False

  @property
  def name(self) -> str:
    return (f"{self.registers.name}{'' if self.q_per_tile else '_heldq'}{'_spt' if self.slots_per_tile else ''}"
            f"{'_eb' if self.explicit_barriers else ''}{'' if self.one_byte_rows_as_n else '_rowsm'}"
            f"{'_ownv' if self.widen_own_values else ''}")


def variant_schedule(config):
  """The experimental consumer schedule a config names (`pallas_kv.experimental.MLAVariantConfig.mla_schedule`),
  or None: the shipped one. It gives `check(block_kv=, rows=)`, `smem_layout(rows)` (MlaSmem's schedule
  fields), the kernel name's `suffix` and `consumers(program)` (`mla.Program`); docs/decisions.md#mla-schedules."""
  return getattr(config, "mla_schedule", None)


def gathers_scales(page_size: int) -> bool:
  """Whether per-token scales on pages of page_size tokens are gathered by sequence before the call, [P, page_size]
  -> [B, T] through the block table (~1% of an fp8 latent pool's bytes): a page's run of scales is under TMA's
  128-byte SMEM alignment (pages of 16: 64 bytes, a misaligned address on the H200), a tile's run is not."""
  return tiling.token_scale_reason(page_size, 1) is not None


@dataclasses.dataclass(frozen=True)
class MlaSmem:
  """The SMEM layout of one MLA program; the single source for scratch and for the fit check.

  q_block  [1, 64, Dqk] dtype, swizzled                 Q (wgmma A); the leading 1 is Codegen's index
  union    ring [num_stages, bkv, Dqk] dtype, swizzled  | (out [2, 64, Dv/2] out_dtype, lse [64] f32) after the loop
  p_smem   [64, bkv] dtype, swizzled                    P of the current tile (wgmma A of P V)
  row_smem [4, 64] f32    alpha, the final row sum, then one row of zeros per consumer (more rows for
                          experimental schedules)
  barriers ring produced / consumed per slot, q, p_ready, max_ready, p_free, consumers_done
  A one-byte cache (kv_dtype float8_e4m3fn) changes three of these and adds two:
  q_block  [2, 64, Dqk] float8_e4m3fn                   Q as two fp8 terms (hi, lo), for fp8 wgmma with K
  ring     [num_stages, bkv, Dqk] kv_dtype              the cache's bytes as TMA lands them
  row_smem one more row                                 each q row's factor (1 / its fp8 scale x kv_scale)
  widened  2 x [bkv, Dv/2] dtype, swizzled              the consumers' value columns, widened by the partner
  barriers values_ready, values_free                    the scorer's half handed over
  scales   ring [num_stages, bkv] f32                   per-token scales, when the call has them (a page's run a
                                                        copy; gathered by sequence, one copy a tile)
  With rows as N (a one-byte cache's few rows, or the experimental schedule), q, P^T and the row vectors hold N
  rows, not 64, and the 16-bit operands take the swizzle of P^T's rows.
  """
  qk_dim: int
  v_dim: int
  dtype: Any
  out_dtype: Any
  block_kv: int = BLOCK_KV
  num_stages: int = 2
  copies_per_tile: int = 1
  split_scores: bool = False
  rows_as_n: int = 0           # padded q rows as wgmma N; 0: rows as M
  alternate_scores: bool = False
  ring_halves: bool = False    # ring slots in two column parts: [0, Dv/2) and [Dv/2, Dqk)
  kv_dtype: Any = None         # the cache's dtype; None: dtype. One byte: Q K^T in fp8, V widened by the partner
  token_scales: bool = False   # a one-byte cache's per-token scales ride a ring of their own
  gathered_scales: bool = False   # token_scales gathered by sequence ([B, T]) before the call (`gathers_scales`)
  query_terms: int = 2         # one-byte caches: Q's fp8 terms (1 halves Q K^T's MMA time at fp8's error)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))
    object.__setattr__(self, "kv_dtype", jnp.dtype(self.dtype if self.kv_dtype is None else self.kv_dtype))
    if self.token_scales and not self.quantized:
      raise ValueError("token_scales widen a one-byte cache")
    if self.gathered_scales and not self.token_scales:
      raise ValueError("gathered_scales are token_scales")
    if self.query_terms not in (1, 2):
      raise ValueError(f"query_terms={self.query_terms} must be 1 or 2")

  @property
  def quantized(self) -> bool:
    return self.kv_dtype.itemsize == 1

  @property
  def q_terms(self) -> int:
    return self.query_terms if self.quantized else 1

  @property
  def row_factor_row(self) -> int:
    """row_smem's row of q row factors (one-byte caches)."""
    return self.zero_rows + VALUE_WGS

  @property
  def half_v(self) -> int:
    return self.v_dim // VALUE_WGS

  @property
  def half_kv(self) -> int:
    return self.block_kv // VALUE_WGS

  @property
  def q_rows(self) -> int:
    return self.rows_as_n or ROWS

  @property
  def reduction_scratch_bytes(self) -> int:
    return ROWS_AS_N_SCRATCH_BYTES[self.rows_as_n] if self.rows_as_n else REDUCTION_SCRATCH_BYTES

  def transforms(self, minor_dim: int):
    """An operand's SMEM transforms: wgmma takes one swizzle for both operands, so all follow P's rows."""
    limit = self.block_kv * self.dtype.itemsize
    if self.split_scores:
      limit = self.half_kv * self.dtype.itemsize
    elif self.rows_as_n:
      limit = self.rows_as_n * self.dtype.itemsize
    return tiling.smem_transforms(self.dtype, minor_dim, max_swizzle=limit)

  def kv_transforms(self):
    """Q's and the ring's: in fp8, Q K^T's operands take the swizzle of their own rows."""
    return tiling.smem_transforms(self.kv_dtype, self.qk_dim) if self.quantized else self.transforms(self.qk_dim)

  def p_type(self):
    if self.split_scores:   # one half per consumer (separate buffers: wgmma takes no indexed ref)
      return tuple(plgpu.SMEM((ROWS, self.half_kv), self.dtype, transforms=self.transforms(self.half_kv))
                   for _ in range(VALUE_WGS))
    if self.rows_as_n:
      return plgpu.SMEM((self.block_kv, self.rows_as_n), self.dtype, transforms=self.transforms(self.rows_as_n))
    return plgpu.SMEM((ROWS, self.block_kv), self.dtype, transforms=self.transforms(self.block_kv))

  def ring_spec(self) -> pipeline.RingSpec:
    """With ring_halves, each part has one reader that releases it: consumer w, part w."""
    parts = (self.half_v, self.qk_dim - self.half_v) if self.ring_halves else ()
    return pipeline.RingSpec(num_stages=self.num_stages, block_shape=(self.block_kv, self.qk_dim),
                             dtype=self.kv_dtype, transforms=self.kv_transforms(),
                             copies_per_slot=self.copies_per_tile,
                             num_consumers=1 if self.ring_halves else VALUE_WGS, column_parts=parts)

  def scale_ring_spec(self) -> pipeline.RingSpec:
    """Read by the scorer alone: the partner's P comes scaled."""
    return pipeline.RingSpec(num_stages=self.num_stages, block_shape=(self.block_kv,), dtype=jnp.float32,
                             copies_per_slot=1 if self.gathered_scales else self.copies_per_tile, num_consumers=1)

  def widened_type(self):
    """One buffer per consumer (wgmma's operand is a whole ref, not an index into a stack)."""
    return tuple(plgpu.SMEM((self.block_kv, self.half_v), self.dtype, transforms=self.transforms(self.half_v))
                 for _ in range(VALUE_WGS))

  def quantized_scratch(self) -> dict[str, Any]:
    if not self.quantized:
      return {}
    scratch = dict(widened=self.widened_type(), values_ready=plgpu.Barrier(), values_free=plgpu.Barrier())
    if self.token_scales:
      scales = self.scale_ring_spec()
      scratch.update(scale_slots=scales.buffer_type(), **dict(zip(("scales_produced", "scales_consumed"),
                                                                   scales.barrier_types())))
    return scratch

  def scratch_types(self) -> dict[str, Any]:
    ring = self.ring_spec()
    produced, consumed = ring.barrier_types()
    half_out = (self.half_v, self.rows_as_n) if self.rows_as_n else (ROWS, self.half_v)
    out_stage = (plgpu.SMEM((VALUE_WGS, *half_out), self.out_dtype),
                 plgpu.SMEM((self.q_rows,), jnp.float32))
    return dict(
        q_block=plgpu.SMEM((self.q_terms, self.q_rows, self.qk_dim),
                           jnp.float8_e4m3fn if self.quantized else self.dtype,   # e4m3 pairs with either fp8
                          transforms=self.kv_transforms()),
        union=plgpu.RefUnion(ring.buffer_type(), out_stage),
        p_smem=self.p_type(),
        row_smem=plgpu.SMEM((self.row_vectors, self.q_rows), jnp.float32),
        produced=produced, consumed=consumed,
        q_barrier=plgpu.Barrier(num_arrivals=self.q_terms + 1 if self.quantized else 1),   # Q's terms, row factors
        p_ready=plgpu.Barrier(num_arrivals=VALUE_WGS if self.split_scores else 1,
                              num_barriers=VALUE_WGS if self.alternate_scores else 1),
        p_free=plgpu.Barrier(num_arrivals=VALUE_WGS if self.split_scores else 1),
        max_ready=plgpu.Barrier(num_arrivals=1 if self.alternate_scores else VALUE_WGS,
                                num_barriers=VALUE_WGS if self.alternate_scores else 1),
        consumers_done=plgpu.Barrier(num_arrivals=VALUE_WGS),
        **self.quantized_scratch())

  @property
  def zero_rows(self) -> int:
    return 6 if self.alternate_scores else 2

  @property
  def row_vectors(self) -> int:
    return self.zero_rows + VALUE_WGS + (1 if self.quantized else 0)

  @property
  def nbytes(self) -> int:
    align = pipeline.align_up
    ring = self.ring_spec()
    rows = self.q_rows
    out_stage = align(rows * self.v_dim * self.out_dtype.itemsize) + rows * 4
    q = self.q_terms * rows * self.qk_dim * self.kv_dtype.itemsize
    p = rows * self.block_kv * self.dtype.itemsize
    barriers = ring.barrier_bytes + (7 if self.alternate_scores else 5) * pipeline.BARRIER_BYTES
    quantized = 0
    if self.quantized:
      quantized = (VALUE_WGS * align(self.block_kv * self.half_v * self.dtype.itemsize)
                   + 2 * pipeline.BARRIER_BYTES)
    if self.token_scales:
      quantized += align(self.scale_ring_spec().buffer_bytes) + self.scale_ring_spec().barrier_bytes
    return (align(q) + align(max(ring.buffer_bytes, out_stage)) + align(p) + align(self.row_vectors * rows * 4)
            + align(self.reduction_scratch_bytes) + barriers + quantized)

  @property
  def fits(self) -> bool:
    return self.nbytes <= mgpu_config.SMEM_CAPACITY_BYTES

  @classmethod
  def for_call(cls, config: MosaicMLAConfig, *, qk_dim: int, v_dim: int, dtype: Any, page_size: int,
               rows: int = ROWS, kv_dtype: Any = None, token_scales: bool = False, query_terms: int = 2,
               one_byte_rows_as_n: bool = True) -> "MlaSmem":
    """Outputs and partials are staged in q's dtype (the cache's, or bf16 over a one-byte cache); rows: packed q
    rows (rows as N). A one-byte dtype is taken as the cache's (kv_dtype), with fp16 math (`frame.compute_dtype`).
    one_byte_rows_as_n: `Codegen.one_byte_rows_as_n`."""
    schedule = variant_schedule(config)
    if jnp.dtype(dtype).itemsize == 1:
      kv_dtype, dtype = dtype, frame.compute_dtype(dtype)
    layout = {} if schedule is None else schedule.smem_layout(rows)
    if (schedule is None and one_byte_rows_as_n and kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1
        and rows <= ONE_BYTE_ROWS_AS_N_MAX):
      layout = dict(rows_as_n=plan.round_up(rows, ROWS_AS_N_MULTIPLE))
    return cls(qk_dim=qk_dim, v_dim=v_dim, dtype=dtype, out_dtype=dtype, kv_dtype=kv_dtype, token_scales=token_scales,
               gathered_scales=token_scales and gathers_scales(page_size), query_terms=query_terms,
               block_kv=config.block_kv, num_stages=config.num_stages,
               copies_per_tile=mgpu_config.copies_per_tile(config.block_kv, page_size), **layout)


def row_blocks(rows: int) -> int:
  return plan.cdiv(rows, ROWS)


def check_config(config: MosaicMLAConfig, *, qk_dim: int, v_dim: int, dtype: Any, page_size: int,
                 rows: int = ROWS, kv_dtype: Any = None, one_byte_rows_as_n: bool = True) -> None:
  if not isinstance(config, MosaicMLAConfig) or not config.complete:
    raise ValueError(f"the MLA kernel takes a complete MosaicMLAConfig (resolve_config), got {config!r}")
  schedule = variant_schedule(config)
  if kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1 and (schedule is not None
                                                                      or config.block_kv != BLOCK_KV):
    # fp8 tiles are read into registers in wgmma's 8-bit layout, which spans 64 rows.
    raise ValueError(f"an fp8 latent cache takes the shipped schedule with block_kv={BLOCK_KV}, got {config!r}")
  if schedule is not None:
    schedule.check(block_kv=config.block_kv, rows=rows)
  reason = mgpu_config.page_size_reason(page_size)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  smem = MlaSmem.for_call(config, qk_dim=qk_dim, v_dim=v_dim, dtype=dtype, page_size=page_size, rows=rows,
                          kv_dtype=kv_dtype, token_scales=kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1,
                          one_byte_rows_as_n=one_byte_rows_as_n)
  if not smem.fits:
    raise ValueError(f"num_stages={config.num_stages} of {config.block_kv} x {qk_dim} tiles needs {smem.nbytes} "
                     f"bytes of SMEM, over the {mgpu_config.SMEM_CAPACITY_BYTES} available; use fewer stages")


def heuristic_config(problem, *, dtype: Any = "bfloat16") -> MosaicMLAConfig:
  """64-token tiles, the deepest ring that fits, per-sequence splits in batch order."""
  config = MosaicMLAConfig(block_kv=BLOCK_KV, num_stages=2, split_plan="per_sequence", sequence_order="given")
  while True:
    deeper = dataclasses.replace(config, num_stages=config.num_stages + 1)
    smem = MlaSmem.for_call(deeper, qk_dim=problem.head_dim, v_dim=problem.v_head_dim, dtype=dtype,
                            page_size=problem.page_size, rows=problem.num_queries * problem.num_heads)
    if deeper.num_stages > 4 or not smem.fits:
      return config
    config = deeper


def resolve_config(problem, config: MosaicMLAConfig | None, *, dtype: Any = "bfloat16",
                   num_sms: int | None = None) -> MosaicMLAConfig:
  """The given fields over the heuristic's; a split count left None fills about one wave
  (docs/decisions.md#split-count-one-wave). sequence_order None takes the longest sequences first
  where the programs (one per SM) make more than one wave (docs/decisions.md#mla-longest-first)."""
  if config is not None and not isinstance(config, MosaicMLAConfig):
    raise TypeError(f"the MLA kernel takes a MosaicMLAConfig, got {type(config).__name__}")
  given = config or MosaicMLAConfig()
  resolved = given.over(heuristic_config(problem, dtype=dtype))
  num_sms = num_sms or runtime.num_sms()
  blocks = row_blocks(problem.num_queries * problem.num_heads)
  resolved = plan.fill_num_splits(_one_head(problem),
                                  resolved, row_blocks=blocks, num_sms=num_sms)
  if given.sequence_order is None and plan.num_programs(_one_head(problem), resolved, row_blocks=blocks) > num_sms:
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
