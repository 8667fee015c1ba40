"""Frozen, hashable descriptions of a call's options and of kernel configs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """The static options of one call, built by `pallas_kv.api` after `validation.check_options`
  has checked the public arguments (so it does not check them again)."""
  scale: float
  softcap: float | None = None
  window: int | None = None
  has_sinks: bool = False
  k_scale: str | None = None  # the kind of k_scale given: None, "head" or "token" (validation.scale_kind)
  v_scale: str | None = None

  @property
  def quantized(self) -> bool:
    """Scales were given (an int8 / fp8 cache, or a scaled 16-bit one)."""
    return self.k_scale is not None or self.v_scale is not None


BLOCK_KV_CHOICES = (16, 32, 64, 128, 256)  # the mosaic_gpu backend needs >= 64 (wgmma K)
MAX_STAGES = 8
SPLIT_PLANS = ("per_sequence", "balanced", "stream_k")
BOOL_FIELDS = ("pipeline_qk", "persistent", "merge_in_kernel", "split_scores", "convert_warpgroup", "rows_as_n",
               "alternate_scores", "ring_halves", "p_in_registers")   # DecodeConfig's on/off options
SEQUENCE_ORDERS = ("given", "longest_first", "long_short")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling and pipelining of the split-K decode kernels.

  block_kv: tokens per KV tile (one TMA copy per tile, or one per page when pages are smaller).
  num_stages: depth of the SMEM ring of K and V tiles in flight.
  num_splits: splits of each sequence's KV (split-K). None lets the heuristic fill the GPU from
    the batch and length. A fixed number makes a sequence's result independent of what else is
    in the batch: each split's share of tiles depends only on that sequence's length.
  num_warps: warps per program (triton backend only).
  kv_groups: 1, or 2 to have two consumer warpgroups per program each stream one split's tiles
    (mosaic_gpu only; needs <= 64 packed rows and even num_splits and num_stages).
  pipeline_qk: issue the QK^T wgmma of tile i+1 before the softmax of tile i, so that the tensor
    cores and the softmax overlap (FA3-style intra-warpgroup pipelining; mosaic_gpu only). MLA
    holds two tiles at once with it: use block_kv=32 and num_stages=4 there, so that a third loads
    (measured no faster than the plain schedule on those tiles, both slower than the default
    64-token tiles: benchmarks/RESULTS.md, tenth set).
  persistent: launch one program per SM that loops over the (kv head, split, batch) work items,
    keeping the KV ring streaming across items (mosaic_gpu only; kv_groups must be 1).
  merge_in_kernel: merge the splits in the kernel's own launch instead of the merge kernel's
    (triton only; measured slower at batch 1 on the H200: the last split merges alone): each split writes its partial and bumps a per-(sequence, kv head) counter with an
    acq_rel atomic; the split that arrives last merges every split's partial in split order (so
    the result does not depend on the order in which they finish) and writes the output. It costs
    a memset of one int32 counter per (sequence, kv head, row block) each call. A sequence whose
    tiles fit one split writes its output directly (and so does every call with num_splits=1,
    whatever this flag says). Not on mosaic_gpu: its atomics
    (`plgpu.atomic_add`) return no value and its global semaphores can be waited on but not read,
    so a split cannot learn that it arrived last; a fixed merger waiting on a semaphore would
    deadlock if it held an SM before the splits it waits for had one.
  split_plan: how a sequence's tiles are cut into splits. "per_sequence": each sequence's own
    tiles in num_splits equal shares, so its result depends only on its own length (with a fixed
    num_splits: batch-invariant). "balanced": one tile count per split for the whole batch,
    computed each call from `lengths` (`split_k.balanced_tiles_per_split`), so that a ragged batch
    gives every SM about the same number of tiles: long sequences take more splits, short ones
    fewer; num_splits is then the most splits any sequence may take. A sequence's result then
    depends (in its last bits) on the other lengths in the batch. Measured on the H200 it gains on
    ragged batches (MLA B128: 349.8 against 423.7 us) and loses on full-length ones that do not
    fill the GPU (GQA B1 T32768 on triton: 76.6 against 40.6 us; MLA B16 T4096: 76.7 against
    38.4; benchmarks/RESULTS.md, eleventh set), so `auto` keeps "per_sequence".
    "stream_k" (triton only): num_splits programs per (kv head, row block), one wave of the GPU
    (`split_k.stream_k_programs`), each streaming an equal share of the whole batch's tiles laid
    end to end, crossing sequence boundaries (`split_k.StreamKLayout`, planned inside the kernel
    from `lengths`); a sequence cut across programs is merged in the launch by its last piece to
    arrive, so the merge is always in the kernel. Needs sequence_order "given". As with
    "balanced", a sequence's last bits depend on the other lengths in the batch. The default
    triton config takes it where measured to pay (`triton_config.stream_k_pays`; ragged batches
    6-29% faster on an H200, full length within 2.4%; benchmarks/RESULTS.md, eighteenth set), on
    paged caches with three programs per SM (twentieth set).
  convert_warpgroup: one-byte caches on mosaic_gpu only: a converter warpgroup between the TMA
    producer and the consumers widens each one-byte K / V tile (and applies its per-token scales)
    into a ring of q-dtype tiles that the consumers' wgmma reads as it reads a bf16 cache, as
    FA3's fp8 path prepares V in its producer; the consumers then do no conversion. Needs
    kv_groups=1 and no persistent grid. Measured on an H200 it is slower than the default (the one
    converter widening every tile is the bound; benchmarks/RESULTS.md), so it is opt-in.
  sequence_order: the order in which programs take the sequences of a batch (triton, and MLA on
    mosaic_gpu).
    "given": batch order. "longest_first": by length, longest first (an argsort of `lengths` each
    call, one small launch), so that the long sequences of a ragged batch start in the first wave
    instead of trailing the last one (list scheduling's longest-processing-time rule).
    "long_short": longest, shortest, second longest, second shortest, ...: the long sequences
    still start early, and the short ones (mostly fixed cost per program) run beside them instead
    of all at the end. Only the schedule changes: every sequence's result is the same bits as with
    "given". The MLA heuristic takes "longest_first" where its programs make more than one wave
    (`mla_config.resolve_config`); the GQA heuristics keep "given".
  split_scores: MLA on mosaic_gpu only: both consumer warpgroups score half of each tile's keys
    and trade row maxima and their halves of P through SMEM (FlashMLA's balance), instead of one
    scorer computing all of Q K^T and the softmax while its partner only runs P V. Measured
    slower on the H200 (412 against 465 TFLOP/s at B64 T4096; benchmarks/RESULTS.md).
  alternate_scores: MLA on mosaic_gpu only: the two consumer warpgroups score alternate tiles
    (FlashMLA's "seesaw"), in pairs: one scores a pair's first tile, the other its second from the
    first's running max, and each runs P V of both tiles for its half of the value columns (its
    own P from registers, the other's through SMEM, rescaled to the pair's max). Only the max
    passes between the softmaxes, so neither waits on a P V, and Q K^T keeps its 64 keys (N = 64:
    split_scores halves it). An earlier schedule (each tile's P, rescale and max handed over
    together, behind the other tile's P V) measured 28% slower than the default (168.5 against
    131.5 us at B64 T4096; benchmarks/RESULTS.md, thirteenth set). This one is not yet timed.
  rows_as_n: MLA on mosaic_gpu only, for few packed rows (S x Hq <= 64, e.g. 16 heads under
    tensor parallelism): the rows become wgmma's N instead of being padded to its M of 64, so
    the kernel computes S^T = K Q^T and O^T = V^T P^T (keys and value columns as M) and the
    softmax reduces across warps. At 16 rows that is a quarter of the padded tensor work; all
    SMEM operands then take the swizzle of the rows' width (32 bytes at 16 rows). Measured
    slower on the H200 (188 against 160 us at 16 heads B64 T8192: P V then takes four times the
    wgmma instructions, each of N = 16; benchmarks/RESULTS.md, ninth set).
  ring_halves: MLA on mosaic_gpu only, with the plain scorer schedule or alternate_scores (not
    yet timed there: each consumer frees the part its P V reads): each ring slot is loaded
    and freed in two column parts, the scorer's value half and the rest (the partner's value
    half and the rope columns), each with its own barriers (FlashMLA's K tiles). The scorer's
    Q K^T starts on the first part while the second lands, and each part is refilled as soon as
    its one reader's P V is done instead of when both are. Measured on the H200 within the run's
    spread of the default (148.5 against 145.5 us at B64 T4096, 565.7 against 608.7 at B128
    T8192, 45.1 against 38.4 at B16; benchmarks/RESULTS.md, eleventh set), so it is opt-in.
  p_in_registers: MLA on mosaic_gpu only, with the plain scorer schedule (ring_halves allowed; the
    alternate scorers always read their own P from registers):
    the scorer's P V takes P from its registers (wgmma's A operand) and is issued before P is
    stored to SMEM for the partner, so that the store, its fence and the hand-over run while the
    tensor cores do (FlashMLA's "local P"); its P V also reads 8 KiB less SMEM per tile. GPU
    interpret mode cannot run register operands, so there the P in SMEM is used. The MLA
    heuristic config sets it: faster in 7 of 8 same-run comparisons on the H200, by 1-7% (147.7
    against 150.9 us at B64 T4096, 574.9 against 598.3 at B128 T8192; 2.5% slower at B16 T4096;
    benchmarks/RESULTS.md, twelfth set). An explicit DecodeConfig leaves it off unless given.
  """
  block_kv: int = 64
  num_stages: int = 4
  num_splits: int | None = None
  num_warps: int = 4
  kv_groups: int = 1
  pipeline_qk: bool = False
  persistent: bool = False
  merge_in_kernel: bool = False
  split_plan: str = "per_sequence"
  split_scores: bool = False
  sequence_order: str = "given"
  convert_warpgroup: bool = False
  rows_as_n: bool = False
  alternate_scores: bool = False
  ring_halves: bool = False
  p_in_registers: bool = False

  def __post_init__(self):
    if self.block_kv not in BLOCK_KV_CHOICES:
      raise ValueError(f"{self.block_kv=} must be one of {BLOCK_KV_CHOICES}")
    if not 1 <= self.num_stages <= MAX_STAGES:
      raise ValueError(f"{self.num_stages=} must be in [1, {MAX_STAGES}]")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"{self.num_splits=} must be a positive int or None")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.num_warps=} must be a power of two in [1, 16]")
    if self.kv_groups not in (1, 2):
      raise ValueError(f"{self.kv_groups=} must be 1 or 2")
    for name in BOOL_FIELDS:
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"self.{name}={getattr(self, name)!r} must be a bool")
    if self.split_plan not in SPLIT_PLANS:
      raise ValueError(f"{self.split_plan=} must be one of {SPLIT_PLANS}")
    if self.sequence_order not in SEQUENCE_ORDERS:
      raise ValueError(f"{self.sequence_order=} must be one of {SEQUENCE_ORDERS}")
    if self.persistent and self.kv_groups != 1:
      raise ValueError(f"{self.persistent=} needs kv_groups=1, got {self.kv_groups=}")
