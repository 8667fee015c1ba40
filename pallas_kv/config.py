"""Frozen, hashable descriptions of a call's options and of the kernels' configs.

Each kernel has its own config type: `TritonConfig` (GQA on Pallas Triton), `MosaicGPUConfig` (GQA
on Mosaic GPU) and `MosaicMLAConfig` (MLA on Mosaic GPU). They share `KernelConfig`'s fields; a
field left None is filled by the backend's choice (tuned file, else heuristic), so a config may
name only what it fixes. A config holds only fields its kernel reads: a field of another kernel
is a TypeError at construction.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """The static options of one call, built by `pallas_kv.api` after `validation.check_options`
  has checked the public arguments (so it does not check them again)."""
  scale: float
  softcap: float | None = None
  window: int | None = None
  has_sinks: bool = False
  has_window_start: bool = False   # a per-sequence first visible key, int32 [B], comes with the call
  k_scale: str | None = None  # the kind of k_scale given: None, "head" or "token" (validation.scale_kind)
  v_scale: str | None = None

  @property
  def quantized(self) -> bool:
    """Scales were given (an int8 / fp8 cache, or a scaled 16-bit one)."""
    return self.k_scale is not None or self.v_scale is not None


BLOCK_KV_CHOICES = (16, 32, 64, 128, 256)
MAX_STAGES = 8
SEQUENCE_ORDERS = ("given", "longest_first", "long_short")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """What every split-K kernel takes; None lets the backend choose.

  block_kv: tokens per KV tile (one copy per tile, or one per page when pages are smaller).
  num_stages: depth of the ring of K and V tiles in flight.
  num_splits: how many pieces a sequence's tiles are cut into (split-K); what exactly depends on
    `split_plan`: "per_sequence", equal shares of each sequence (a fixed count makes a result
    independent of the rest of the batch); "balanced", the most pieces any sequence may take;
    "stream_k": Triton, programs per (kv head, row block) sharing the whole batch's tiles; Mosaic GPU, the
    most pieces a sequence may be cut into by the persistent programs' equal shares.
  split_plan: "per_sequence" | "balanced" | "stream_k". The plan of one call is a
    `pallas_kv.kernels.plan.SplitPlan`, computed once from `lengths` before the kernel runs.
  """
  block_kv: int | None = None
  num_stages: int | None = None
  num_splits: int | None = None
  split_plan: str | None = None

  backend: ClassVar[str] = ""
  SPLIT_PLANS: ClassVar[tuple[str, ...]] = ("per_sequence", "balanced")
  BLOCK_KVS: ClassVar[tuple[int, ...]] = BLOCK_KV_CHOICES
  BOOL_FIELDS: ClassVar[tuple[str, ...]] = ()
  CHOICES: ClassVar[dict[str, tuple]] = {}

  def __post_init__(self):
    _choice(self, "block_kv", self.BLOCK_KVS)
    if self.num_stages is not None and not 1 <= self.num_stages <= MAX_STAGES:
      raise ValueError(f"{self.num_stages=} must be in [1, {MAX_STAGES}]")
    if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
      raise ValueError(f"{self.num_splits=} must be a positive int or None")
    _choice(self, "split_plan", self.SPLIT_PLANS)
    for name in self.BOOL_FIELDS:
      if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
        raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} must be a bool or None")
    for name, choices in self.CHOICES.items():
      _choice(self, name, choices)

  def given(self) -> dict:
    """The fields this config fixes (not None)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

  def over(self, defaults: "KernelConfig") -> "KernelConfig":
    """This config with its None fields taken from `defaults` (of the same kernel)."""
    if defaults.backend != self.backend:
      raise TypeError(f"{type(self).__name__} cannot take defaults from {type(defaults).__name__}")
    base = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)
            if f.name in {g.name for g in dataclasses.fields(self)}}
    return dataclasses.replace(self, **{**base, **self.given()})

  def for_another_size(self) -> "KernelConfig":
    """This config with the fields tuned for one problem size only (the split count) left to the heuristic."""
    return dataclasses.replace(self, num_splits=None)

  @property
  def complete(self) -> bool:
    """Every field is fixed: what a kernel takes."""
    return all(getattr(self, f.name) is not None for f in dataclasses.fields(self))


def _choice(config, name, choices):
  value = getattr(config, name)
  if value is not None and value not in choices:
    raise ValueError(f"{type(config).__name__}.{name}={value!r} must be one of {tuple(choices)} or None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonConfig(KernelConfig):
  """The Pallas Triton GQA kernel (`pallas_kv.kernels.triton`).

  num_warps: warps per program.
  sequence_order: the order in which programs take the batch's sequences: "given", or
    "longest_first" / "long_short" (a permutation of `lengths`, so that long sequences start in
    the first wave). Only the schedule changes, not the bits.
  merge_in_kernel: the last split of a (sequence, kv head) to finish merges all its splits in the
    kernel's own launch, instead of a second launch. The stream-K plan and one split always do.
  split_plan "stream_k": num_splits programs per (kv head, row block) stream equal shares of the
    whole batch's tiles laid end to end; needs sequence_order "given".
  """
  num_warps: int | None = None
  sequence_order: str | None = None
  merge_in_kernel: bool | None = None

  backend: ClassVar[str] = "triton"
  SPLIT_PLANS: ClassVar[tuple[str, ...]] = ("per_sequence", "balanced", "stream_k")
  BOOL_FIELDS: ClassVar[tuple[str, ...]] = ("merge_in_kernel",)
  CHOICES: ClassVar[dict[str, tuple]] = {"num_warps": (1, 2, 4, 8, 16), "sequence_order": SEQUENCE_ORDERS}

  def __post_init__(self):
    super().__post_init__()
    if self.split_plan == "stream_k" and self.sequence_order not in (None, "given"):
      raise ValueError(f"split_plan='stream_k' lays the sequences end to end in batch order; sequence_order "
                       f"must be 'given', got {self.sequence_order!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGPUConfig(KernelConfig):
  """The Mosaic GPU GQA kernel (`pallas_kv.kernels.mosaic_gpu.decode`); block_kv >= 64 (wgmma K).

  kv_groups: 1, or 2 or 3 consumer warpgroups per program that each stream one split's tiles from
    their own ring (needs <= 64 packed rows, and num_splits and num_stages multiples of kv_groups).
  pipeline_qk: issue tile i+1's Q K^T before tile i's softmax (FA3's intra-warpgroup overlap).
  queries_as_n: the packed rows (<= 16) as wgmma's N, S^T = K Q^T, so that the products and the softmax cover 16
    query columns instead of 64 rows, most of them padding (one consumer a program: kv_groups 1, tile_consumers 1).
    A 16-bit cache (V either layout), or an fp8 or int8 one with V stored tokens last, int8 read as stored (Q as two
    int8 terms, s8 wgmma). One-byte caches run 128-token tiles where the pages allow; the default takes it for dense
    one-byte caches that allow it. Over a 16-bit cache it is opt-in (measured level with the padded rows where
    pipeline_qk is on: docs/decisions.md#mosaic-16-bit-queries-as-n).
  values_as_stored: with queries_as_n, wgmma reads the V tile as stored, no widened copy: P^T goes as two one-byte
    terms (fp8: two e4m3 terms, P with bf16's error instead of f16's; int8: two int8 terms on s8 wgmma, P within
    1 / 127^2). The SMEM a widened V tile took holds 256-token tiles instead: the default takes both where two
    stages fit, dense or paged (docs/decisions.md#mosaic-values-as-stored). Over pages of 64 or 128 tokens a tile
    spans pages, read a page at a time (one wgmma a page); pages of 16 or 32 are widened instead.
  paired_terms: with values_as_stored, Q's two one-byte terms are one wgmma operand of 32 columns, and so are P's:
    one product a K tile and one a V run, where terms of 16 columns take two, each reading the one-byte tile from
    SMEM as its A operand. The default takes it for int8 (measured 5-7% faster), not fp8 (5% slower).
  persistent: one program per SM looping over the work items, its ring streaming across them. The default takes it
    for V read as stored where the work items make three waves or more (measured 9-10% faster at four and eight),
    and so does a tuned entry of V read as stored served at another size (`for_another_size`).
  tile_consumers: 1, or 2 consumer warpgroups that take turns on the tiles of each work item (even ring
    steps and odd), each with its own softmax state, merged in the kernel: two tiles' math in flight per
    program (needs <= 64 packed rows, kv_groups=1 and an even num_stages, >= 4 with pipeline_qk).
  sequence_order: as `TritonConfig.sequence_order`: the order in which the work items (and so the programs,
    or a persistent program's loop) take the sequences.
  split_plan "stream_k": the persistent programs (one an SM) each stream an equal share of the batch's tiles,
    laid end to end over sequences and kv heads, and a sequence cut across programs leaves one piece per program
    for the merge; num_splits (>= 2) caps the pieces of a sequence. Needs persistent (None or True),
    kv_groups=1 and sequence_order "given"; calls with window_start are refused.
  """
  kv_groups: int | None = None
  pipeline_qk: bool | None = None
  persistent: bool | None = None
  queries_as_n: bool | None = None
  values_as_stored: bool | None = None
  paired_terms: bool | None = None
  tile_consumers: int | None = None
  sequence_order: str | None = None

  backend: ClassVar[str] = "mosaic_gpu"
  SPLIT_PLANS: ClassVar[tuple[str, ...]] = ("per_sequence", "balanced", "stream_k")
  BLOCK_KVS: ClassVar[tuple[int, ...]] = (64, 128, 256)
  BOOL_FIELDS: ClassVar[tuple[str, ...]] = ("pipeline_qk", "persistent", "queries_as_n", "values_as_stored",
                                            "paired_terms")
  CHOICES: ClassVar[dict[str, tuple]] = {"kv_groups": (1, 2, 3), "tile_consumers": (1, 2),
                                         "sequence_order": SEQUENCE_ORDERS}

  def __post_init__(self):
    super().__post_init__()
    if self.persistent and (self.kv_groups or 1) > 1:
      raise ValueError(f"persistent=True needs kv_groups=1, got {self.kv_groups=}")
    if self.tile_consumers == 2 and (self.kv_groups or 1) > 1:
      raise ValueError(f"tile_consumers=2 needs kv_groups=1, got {self.kv_groups=}")
    if self.split_plan == "stream_k":
      wrong = {name: value for name, value, ok in (("persistent", self.persistent, (None, True)),
                                                   ("kv_groups", self.kv_groups, (None, 1)),
                                                   ("sequence_order", self.sequence_order, (None, "given")))
               if value not in ok}
      if wrong or self.num_splits == 1:
        raise ValueError(f"split_plan='stream_k' is walked by persistent programs in batch order, a sequence cut "
                         f"into at most num_splits >= 2 pieces: needs persistent True, kv_groups 1 and "
                         f"sequence_order 'given' (or None), got {wrong or dict(num_splits=self.num_splits)}")

  def for_another_size(self) -> "MosaicGPUConfig":
    """As `KernelConfig.for_another_size`; with V read as stored, whether programs persist is left to the default's
    rule too (persistent from three waves of work items: `heuristic_config`), unless the stream-K walk needs them.
    (docs/decisions.md#tuned-entry-at-another-size)"""
    refit = super().for_another_size()
    if self.values_as_stored and self.split_plan != "stream_k":
      refit = dataclasses.replace(refit, persistent=None)
    return refit


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicMLAConfig(KernelConfig):
  """The Mosaic GPU MLA kernel (`pallas_kv.kernels.mosaic_gpu.mla`); block_kv 32 or 64, two stages
  or more.

  sequence_order: as `TritonConfig.sequence_order`; the default takes "longest_first" where the
    programs make more than one wave.
  """
  sequence_order: str | None = None

  backend: ClassVar[str] = "mosaic_gpu"
  BLOCK_KVS: ClassVar[tuple[int, ...]] = (32, 64)
  CHOICES: ClassVar[dict[str, tuple]] = {"sequence_order": SEQUENCE_ORDERS}

  def __post_init__(self):
    super().__post_init__()
    if self.num_stages is not None and self.num_stages < 2:
      raise ValueError(f"{self.num_stages=} must be >= 2 for MLA (the next tile loads while this one is used)")


CONFIG_TYPES = {"triton": (TritonConfig,), "mosaic_gpu": (MosaicGPUConfig, MosaicMLAConfig)}


def config_type(backend: str, op: str) -> type[KernelConfig]:
  """The config type of `backend`'s kernel for `op` ("decode", "paged" or "mla")."""
  if backend == "mosaic_gpu":
    return MosaicMLAConfig if op == "mla" else MosaicGPUConfig
  return TritonConfig
