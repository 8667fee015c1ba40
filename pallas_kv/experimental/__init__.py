"""Kernel variants not shipped, kept runnable for experiments: those that lost to the shipped kernels
(docs/decisions.md) and candidates not yet measured on a GPU (said so in their docstrings).

Each is a config subclass naming a variant that the production kernel runs behind a seam (the MLA kernel's
`mla_config.variant_schedule`, the GQA kernel's `converter`); pass one to an op with impl "mosaic_gpu". `auto`
never takes one; their tests run under the `experimental` marker.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kv.config import MosaicGPUConfig
from pallas_kv.config import MosaicMLAConfig
from pallas_kv.experimental import mla_schedules


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGPUVariantConfig(MosaicGPUConfig):
  """convert_warpgroup: one-byte caches; a converter warpgroup between the TMA producer and the
  consumers widens each K / V tile (and applies its per-token scales) into a ring of q-dtype
  tiles (FA3's fp8 path). Measured slower than the consumers' own widening: the one converter is
  the bound (docs/decisions.md#mosaic-converter-warpgroup). Needs kv_groups=1, no persistent grid,
  head_dim <= 128.
  explicit_barriers: Mosaic GPU's automatic warpgroup barriers around every SMEM store turned off
  (`CompilerParams.unsafe_no_auto_barriers`); the kernel syncs where its stores need it. Removes four of a one-byte
  tile's barriers (P's two fp8 terms). Measured 2.3% faster with per-token fp8 scales, 0.2% without (H100, B32
  T4096; benchmarks/RESULTS.md, thirty-second set): not shipped; no converter.
  values_in_registers: with queries_as_n, the V tile widened to f16 in registers, wgmma's A operand of O^T = V^T P^T,
  instead of stored to SMEM and read from there (not in interpret mode, which runs no register operand).
  (values_as_stored, V read as stored, and paired_terms are shipped: fields of MosaicGPUConfig.)
  scales_by_head: per-token scales laid out [B, Hkv, T] before the call for any kv head count (as for 2, 3, 5...
  heads), so that a tile's scales of a head are one contiguous run a copy instead of a [bkv, 4] box of 16-byte
  rows: what a cache storing its scales by head would give the kernel (`decode.kernel_call` lays them out outside
  the kernel, so that a kernel-only timing leaves the transposes out). Measured no faster: fp8 B32 T4096 109.9 µs
  against 108.4 as stored, B1 T32768 33.4 against 31.9 (H100, kernel alone; benchmarks/RESULTS.md, thirty-ninth
  set).
  one_tile_loop: every tile of a range through the masked step, one tile loop in place of two (the unmasked tiles,
  then the masked last ones): a program's code is fetched once for its tiles, at the mask's math a tile
  (`plan.tile_loops`). Built to test whether a ragged batch's masked last tiles pay a first pass over code of their
  own; not measured: another kernel between calls measured no first-pass cost (benchmarks/RESULTS.md, forty-sixth
  set).
  walk_unroll: split_plan='stream_k' planned by the call: each program's walk (`plan.kernel_walk`), two loops over
  the batch, unrolled this many steps (the largest factor of B up to it; B or more: straight-line code) in place of
  the shipped `plan.KERNEL_WALK_UNROLL`. 0: the shipped walk. Ragged B128 T4096 on an H100: 1 step 391.5 µs, 8 (the
  shipped) 386.0, straight-line 426.1 (docs/decisions.md#stream-k-walk)."""
  convert_warpgroup: bool = False
  explicit_barriers: bool = False
  values_in_registers: bool = False
  scales_by_head: bool = False
  one_tile_loop: bool = False
  walk_unroll: int = 0

  BOOL_FIELDS: ClassVar[tuple[str, ...]] = MosaicGPUConfig.BOOL_FIELDS + ("convert_warpgroup", "explicit_barriers",
                                                                          "values_in_registers", "scales_by_head",
                                                                          "one_tile_loop")

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.walk_unroll, int) or self.walk_unroll < 0:
      raise ValueError(f"{self.walk_unroll=} must be an int >= 0 (0: the shipped walk)")
    if self.walk_unroll and self.split_plan != "stream_k":
      raise ValueError(f"walk_unroll={self.walk_unroll} is the stream-K walk's; needs split_plan='stream_k', "
                       f"got {self.split_plan!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAVariantConfig(MosaicMLAConfig):
  """Other consumer schedules of the MLA kernel (`mla_schedules`; docs/decisions.md#mla-schedules):

  pipeline_qk: the next tile's Q K^T issued before the softmax (32-token tiles, 4 stages).
  split_scores: both consumers score half of each tile's keys and trade row maxima (FlashMLA's
    balance).
  alternate_scores: the consumers score alternate tiles (FlashMLA's "seesaw").
  rows_as_n: few packed rows (<= 64) as wgmma's N instead of padding them to M = 64.
  ring_halves: ring slots loaded and freed in two column parts.
  p_in_registers: the shipped schedule's P V from registers; False stages P in SMEM. None: on for
    the plain scorer schedule, off for the others.
  """
  pipeline_qk: bool = False
  split_scores: bool = False
  alternate_scores: bool = False
  rows_as_n: bool = False
  ring_halves: bool = False
  p_in_registers: bool | None = None

  BOOL_FIELDS: ClassVar[tuple[str, ...]] = ("pipeline_qk", "split_scores", "alternate_scores", "rows_as_n",
                                            "ring_halves", "p_in_registers")

  def __post_init__(self):
    super().__post_init__()
    if self.p_in_registers is None:   # P from registers is the plain scorer's alone
      plain = not (self.pipeline_qk or self.split_scores or self.alternate_scores or self.rows_as_n)
      object.__setattr__(self, "p_in_registers", plain)

  @property
  def mla_schedule(self) -> mla_schedules.Schedule | None:
    """The consumer schedule the MLA kernel runs (`mla_config.variant_schedule`); None: the shipped one."""
    return mla_schedules.schedule_of(self)
