"""What the Mosaic GPU GQA kernel supports, its SMEM layout (`DecodeSmem`) and its config: the tuned one
when none is given, else the given fields over `heuristic_config`'s; `check_config` adds this kernel's
needs (page sizes, kv_groups, the SMEM fit) to `MosaicGPUConfig`'s own rules."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import runtime
from pallas_kv import tuned
from pallas_kv.config import MAX_STAGES
from pallas_kv.config import MosaicGPUConfig
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

NAME = "mosaic_gpu"
# wgmma's K (P @ V contracts over the tile's tokens) is a multiple of 64; a TMA box is at most 256 rows.
MIN_BLOCK_KV = 64
MAX_BLOCK_KV = 256
# A swizzled tile starts on an 8-row boundary: smaller pages are copied a column tile at a time (GQA, 16-bit).
MIN_PAGE_SIZE = 8
# Q K^T contracts over D (wgmma's K: 16 for 16-bit operands; one-byte rows need a 32-byte swizzle); P V's N is at
# most 256, and a [64, D] float32 accumulator fills a warpgroup's registers there.
HEAD_DIM_MULTIPLE = {1: 32, 2: 16}
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256
ROWS_PER_WG = 64            # wgmma M: packed query rows per consumer warpgroup
CONVERTED_STAGES = 2
MAX_COMPUTE_WGS = 2
# Stream-K's -inf lse rows: a program's rows at most, and a splat stores whole warpgroups of 128 lanes.
LSE_FILL_ROWS = MAX_COMPUTE_WGS * ROWS_PER_WG
SMEM_CAPACITY_BYTES = 227 * 1024   # per thread block on Hopper
_REDUCTION_SCRATCH_BYTES = plgpu.CompilerParams().reduction_scratch_bytes


def row_blocking(rows: int) -> tuple[int, int]:
  """(consumer warpgroups per program, row blocks in the grid) for `rows` packed rows; past 2 x 64
  rows, more programs, each re-reading its head's KV."""
  num_wgs = min(plan.cdiv(rows, ROWS_PER_WG), MAX_COMPUTE_WGS)
  return num_wgs, plan.cdiv(rows, num_wgs * ROWS_PER_WG)


def copies_per_tile(block_kv: int, page_size: int | None) -> int:
  """Runs of tokens that fill one KV tile: one per page when a tile spans several pages (`tiling.KVTiling`)."""
  return 1 if page_size is None else block_kv // math.gcd(page_size, block_kv)


def page_size_reason(page_size: int) -> str | None:
  """Why MLA cannot tile pages of `page_size` tokens, or None."""
  if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
    return f"page_size {page_size} is not supported (a power of two >= {MIN_PAGE_SIZE})"
  return None


def gqa_page_size_reason(page_size: int, head_dim: int, dtype: Any) -> str | None:
  """Why the GQA kernel cannot tile pages of `page_size` tokens of a [.., head_dim] `dtype` cache, or None. Runs of
  gcd(page_size, block_kv) tokens are copied; those of fewer than 8 rows one swizzle column tile at a time, each
  from a 128-byte boundary of SMEM."""
  if page_size < 1 or page_size & (page_size - 1) and page_size % 16:
    return f"page_size {page_size} is not supported (a power of two, or a multiple of 16)"
  if page_size >= MIN_PAGE_SIZE:
    return None
  if jnp.dtype(dtype).itemsize == 1:
    return f"page_size {page_size} is not supported for a one-byte cache (pages of >= {MIN_PAGE_SIZE} tokens)"
  swizzle = tiling.smem_transforms(dtype, head_dim)[-1].swizzle
  if page_size * swizzle % pipeline.TMA_SMEM_ALIGNMENT:
    multiple = pipeline.TMA_SMEM_ALIGNMENT // page_size // jnp.dtype(dtype).itemsize
    return (f"page_size {page_size} is not supported for head_dim {head_dim} (pages this small need head_dim a "
            f"multiple of {multiple})")
  return None


def head_dim_reason(head_dim: int, dtype: Any = "bfloat16") -> str | None:
  """Why the GQA kernel cannot serve head_dim for a cache of `dtype`, or None."""
  multiple = HEAD_DIM_MULTIPLE[min(jnp.dtype(dtype).itemsize, 2)]
  if head_dim % multiple or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
    return (f"head_dim {head_dim} is not supported for a cache of {jnp.dtype(dtype).name} (a multiple of {multiple} "
            f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM})")
  return None


def tokens_last_reason(head_dim: int, page_size: int | None, *, dtype: Any = None, rows: int | None = None
                       ) -> str | None:
  """Why the GQA kernel cannot read v stored tokens last ([B, Hkv, D, T] / [P, Hkv, D, page_size]) of a `dtype`
  cache for `rows` packed rows, or None. Its V tiles are [D, block_kv], zeroed and widened 64 rows (a WGMMA register
  block) at a time, one TMA copy each; or, from pages smaller than a tile, one [D, page_size] copy a page
  (`value_pages`), which the queries-as-N consumer widens a page at a time (one-byte caches, <= 16 rows)."""
  if head_dim % ROWS_PER_WG:
    return (f"v_tokens_last needs head_dim a multiple of {ROWS_PER_WG} on Mosaic GPU (V tiles [D, block_kv] are "
            f"held {ROWS_PER_WG} rows at a time), got {head_dim}")
  if page_size is None or page_size % MIN_BLOCK_KV == 0:
    return None
  one_byte = dtype is not None and jnp.dtype(dtype).itemsize == 1
  if page_size in SMALL_VALUE_PAGES and one_byte and rows is not None and rows <= AS_N_COLUMNS:
    return None
  return (f"v_tokens_last needs pages of a multiple of {MIN_BLOCK_KV} tokens on Mosaic GPU (a page holds whole "
          f"[D, block_kv] V tiles), or pages of {' or '.join(map(str, SMALL_VALUE_PAGES))} tokens of a one-byte "
          f"cache with <= {AS_N_COLUMNS} packed rows (widened a page at a time with the queries as N); got pages of "
          f"{page_size} tokens, {'a one-byte' if one_byte else 'a 16-bit'} cache and {rows} packed rows")


def unsupported_reason(op: str, problem, options, dtypes) -> str | None:
  """Why the GQA kernel cannot serve the call, or None if it can (MLA: `mla_config.unsupported_reason`)."""
  reason = frame.unsupported_reason(op, problem, options, dtypes, backend="Mosaic GPU")
  if reason is None:
    reason = head_dim_reason(problem.head_dim, dtypes[1])
  if reason is None and problem.v_tokens_last:
    reason = tokens_last_reason(problem.head_dim, problem.page_size, dtype=dtypes[1],
                                rows=problem.num_queries * problem.group_size)
  if reason is None and problem.page_size is not None:
    reason = gqa_page_size_reason(problem.page_size, problem.head_dim, dtypes[1])
  if reason is None and jnp.dtype(dtypes[1]) in frame.QUANTIZED_DTYPES:
    reason = quantized_reason(dtypes[1], options.k_scale, options.v_scale, problem)
  return reason


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_OPERAND_DTYPE = jnp.float8_e4m3fn   # Q's and P's terms on fp8 wgmma
INT8_DTYPE = jnp.dtype(jnp.int8)
# queries_as_n: the packed rows as wgmma N, padded to 16 columns; wgmma takes one swizzle for both operands, so the
# V slot widened [D, bkv] f16 follows P^T's rows of 16 f16 (32 bytes).
AS_N_COLUMNS = 16
AS_N_SWIZZLE = AS_N_COLUMNS * 2
AS_N_BLOCK_KV = 128   # the heuristic's tile with the queries as N: 18% faster than 64 tokens at B32 T4096 (H100)
AS_STORED_BLOCK_KV = 256   # ... with V read as stored (no widened V tile): 0-14% faster than 128 widened (H100)
# Pages of V tokens last smaller than a tile, copied a page at a time: [D, page_size] one-byte runs of 16 or 32
# bytes a row (TMA's least is 16), widened by the queries-as-N consumer.
SMALL_VALUE_PAGES = (16, 32)


def quantized_reason(kv_dtype, k_scale_kind: str | None, v_scale_kind: str | None, problem) -> str | None:
  """Why the kernel cannot serve a one-byte cache call with these `frame.scale_kind`s, or None."""
  kv_dtype = jnp.dtype(kv_dtype)
  if kv_dtype not in frame.QUANTIZED_DTYPES:
    return (f"the cache dtype {kv_dtype.name} is not a one-byte type the kernel dequantizes "
            f"({', '.join(d.name for d in frame.QUANTIZED_DTYPES)})")
  reason = quantized_call_reason(kv_dtype, k_scale_kind, v_scale_kind, num_kv_heads=problem.num_kv_heads,
                                 page_size=problem.page_size)
  if reason:
    return reason
  if problem.page_size is not None and gqa_page_size_reason(problem.page_size, problem.head_dim, kv_dtype):
    return gqa_page_size_reason(problem.page_size, problem.head_dim, kv_dtype)
  rows = problem.num_queries * problem.group_size
  config = heuristic_config(problem, dtype=kv_dtype)
  if not fits_smem(config, rows=rows, head_dim=problem.head_dim, dtype=kv_dtype, page_size=problem.page_size,
                   k_scale_kind=k_scale_kind, v_scale_kind=v_scale_kind, num_kv_heads=problem.num_kv_heads,
                   v_tokens_last=problem.v_tokens_last):
    return f"no KV ring fits SMEM for head_dim {problem.head_dim} and {rows} packed rows of a one-byte cache"
  return None


def quantized_call_reason(kv_dtype, k_scale_kind: str | None, v_scale_kind: str | None, *,
                          num_kv_heads: int, page_size: int | None = None) -> str | None:
  """Why `decode.decode_partials` cannot take a cache of kv_dtype (pages of page_size tokens, None: contiguous)
  with these scale kinds, or None."""
  kv_dtype = jnp.dtype(kv_dtype)
  for name, kind in (("k_scale", k_scale_kind), ("v_scale", v_scale_kind)):
    if kind not in (None, "head", "token"):
      raise ValueError(f"{name} kind {kind!r} must be None, 'head' or 'token'")
  if kv_dtype not in frame.QUANTIZED_DTYPES:
    if k_scale_kind or v_scale_kind:
      return f"k_scale / v_scale need a one-byte cache, got {kv_dtype.name}"
    return None
  if "token" in (k_scale_kind, v_scale_kind):
    return tiling.token_scale_reason(page_size, tiling.token_scale_width(num_kv_heads, page_size))
  return None


@dataclasses.dataclass(frozen=True)
class DecodeSmem:
  """The SMEM layout of one GQA program; the single source for scratch and for the fit check.

  q_smem       [q_buffers, row_wgs, 64, D] q_dtype, swizzled    packed queries (wgmma A); fp8 operands:
               [q_buffers, row_wgs, 2, 64, D] e4m3, Q's two terms, and q_factors [q_buffers, row_wgs, 64] f32, their
               rows' factors; the queries as N: made by the consumer from q's rows [q_buffers, row_wgs, 64, D]
               q_dtype landed in the same bytes (a union; `splits_queries`). Persistent, where they fit: two
               buffers, the next item's rows copied while this one streams
  union        streaming | (out [num_wgs, 64, D] out_dtype, lse [num_wgs, 64] f32) after the loop; separate_out
               (persistent): side by side, as the rings stream on during the stores
   streaming   g{g}_k, g{g}_v [stages / kv_groups, bkv, D] dtype   rings of KV group g (v_tokens_last: V's
               slots [D, bkv], or [pages, D, page_size] from pages smaller than a tile: `value_pages`)
               g{g}_ks, g{g}_vs [stages / kv_groups, bkv(, 4)] f32  per-token scales (v_tokens_last: V's [bkv],
               the head's own, laid out tokens last by `decode.decode_partials`)
               dequantized: num_wgs * dequant_tiles x [bkv, D] q_dtype (one-byte cache; V's [D, bkv] with
               v_tokens_last; separate refs, as a statically indexed tile does not lower inside wgmma's
               run_state); an experimental
               converter's g0_ck, g0_cv [CONVERTED_STAGES, bkv, D] in their place
  tiles        the KV rings again as swizzle tiles (`pipeline.RingSpec.tiles_type`), aliasing them in the union
               (persistent: in a union with streaming), for copies of fewer rows than a tile (small pages); not in
               interpret mode
  p_smem       [num_wgs, 64, bkv] q_dtype (interpret mode); fp8 operands: p_terms 2 * num_wgs x [64, bkv] e4m3
  lse_fill     [128] f32, -inf (stream-K: the lse of unused piece slots)
  barriers     per ring slot, q per row warpgroup, done; with tile_consumers=2, partner staged and read
  num_wgs = row_wgs (split the rows) x kv_groups (split the tiles) x tile_consumers (take turns on the tiles);
  num_stages: K slots of all groups.
  """
  head_dim: int
  dtype: Any
  block_kv: int
  num_stages: int
  row_wgs: int = 1
  kv_groups: int = 1
  copies_per_tile: int = 1
  stage_p: bool = False
  separate_out: bool = False
  q_dtype: Any = None       # None: dtype, or bf16 for a one-byte cache
  token_scales: tuple[str, ...] = ()   # roles ("k", "v") with per-token scales
  scale_width: int = tiling.SCALE_ROW
  scales_by_head: bool = False   # per-token scales laid out [B, Hkv, T] before the call (`tiling`)
  pipeline_qk: bool = False
  converter: bool = False
  tile_aliases: bool = False
  v_tokens_last: bool = False
  tile_consumers: int = 1
  stream_k: bool = False
  queries_as_n: bool = False   # one-byte operands: the rows as wgmma N (`fp8_operands.consume_as_n`)
  values_in_registers: bool = False   # queries_as_n: V widened in registers, no v_wide (experimental)
  values_as_stored: bool = False   # queries_as_n: V as stored, P^T as two one-byte terms
  paired_terms: bool = False   # values_as_stored: Q's and P's two terms one wgmma B operand of 32 rows
  q_buffers: int = 1        # 2: a persistent program copies the next item's q rows while it streams
  out_dtype: Any = jnp.float32   # the partials' (q's 16-bit dtype where one split is the output, one tile consumer)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.tile_consumers == 2 and self.one_byte_operands:
      raise NotImplementedError("tile_consumers=2 has no schedule for fp8 wgmma operands (an fp8 cache with v "
                                "tokens last); use tile_consumers=1")
    if self.tile_consumers == 2 and (self.converter or self.row_wgs != 1 or self.kv_groups != 1):
      raise ValueError(f"tile_consumers=2 needs one row warpgroup (<= {ROWS_PER_WG} packed rows), kv_groups=1 and "
                       f"no converter, got {self.row_wgs=} {self.kv_groups=} {self.converter=}")
    if self.out_dtype != jnp.float32 and self.tile_consumers == 2:
      raise ValueError("two tile consumers hand a partial over in the float32 staging: out_dtype must be float32")
    if self.q_dtype is None:
      object.__setattr__(self, "q_dtype", self.dtype if self.dtype.itemsize > 1 else jnp.dtype(jnp.bfloat16))
    object.__setattr__(self, "q_dtype", jnp.dtype(self.q_dtype))
    object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))
    if self.num_stages % self.kv_groups:
      raise ValueError(f"{self.num_stages=} must be a multiple of {self.kv_groups=}")
    if self.token_scales and not self.quantized:
      raise ValueError(f"{self.token_scales=} need a one-byte cache, got dtype {self.dtype.name}")
    if self.converter and not self.quantized:
      raise ValueError(f"a converter warpgroup needs a one-byte cache, got dtype {self.dtype.name}")
    if self.tile_aliases and self.quantized:
      raise ValueError(f"tile aliases (copies of fewer rows than a tile) need a 16-bit cache, got {self.dtype.name}")
    if self.v_tokens_last and self.converter:
      raise ValueError("v_tokens_last has no converter warpgroup")
    run = self.block_kv // self.copies_per_tile   # tokens a copy
    for role in self.token_scales:   # a head's run of scales a copy: whole 128-byte SMEM runs
      if (self.scales_tokens_last(role) or self.scale_width == 1) and run * 4 % pipeline.TMA_SMEM_ALIGNMENT:
        raise ValueError(f"{role}'s per-token scales come a head's run of {run} tokens a copy, under TMA's "
                         f"{pipeline.TMA_SMEM_ALIGNMENT}-byte SMEM alignment")
    if self.value_pages > 1 and not (self.queries_as_n and self.quantized and not self.values_in_registers):
      raise ValueError(f"V tokens last in pages smaller than a tile ({self.value_pages} a tile) is read a page at a "
                       f"time by the queries-as-N consumer over a one-byte cache, got {self.queries_as_n=} "
                       f"{self.dtype.name} {self.values_in_registers=}")
    if self.paired_terms and not (self.values_as_stored and self.one_byte_operands):
      raise ValueError(f"paired_terms=True pairs the one-byte terms of Q and P for the queries-as-N consumer with V "
                       f"as stored: it needs values_as_stored=True, got {self.values_as_stored=} {self.dtype.name}")
    if self.value_pages > 1 and self.values_as_stored and self.value_run < MIN_BLOCK_KV:
      raise ValueError(f"V read as stored takes pages of >= {MIN_BLOCK_KV} tokens (a swizzled [D, page_size] run a "
                       f"page), got runs of {self.value_run}")

  @classmethod
  def for_call(cls, config: MosaicGPUConfig, *, rows: int, head_dim: int, dtype: Any, page_size: int | None,
               interpret: bool = False, q_dtype: Any = None, k_scale_kind: str | None = None,
               v_scale_kind: str | None = None, num_kv_heads: int = 1, v_tokens_last: bool = False,
               out_dtype: Any = jnp.float32) -> "DecodeSmem":
    """The layout a config needs for `rows` packed rows (before padding) of a cache of `dtype` (in interpret
    mode: P staged in SMEM, no tile aliases), its partials stored as out_dtype."""
    row_wgs, _ = row_blocking(rows)
    token_scales = tuple(role for role, kind in (("k", k_scale_kind), ("v", v_scale_kind)) if kind == "token")
    scale_width = tiling.token_scale_width(num_kv_heads, page_size)
    smem = cls(head_dim=head_dim, dtype=dtype, block_kv=config.block_kv, num_stages=config.num_stages,
               row_wgs=row_wgs, kv_groups=config.kv_groups,
               copies_per_tile=copies_per_tile(config.block_kv, page_size), stage_p=interpret,
               separate_out=config.persistent, q_dtype=q_dtype, token_scales=token_scales,
               scale_width=scale_width, scales_by_head=bool(token_scales) and num_kv_heads > 1 and (
                   scale_width == 1 or bool(getattr(config, "scales_by_head", False))),
               pipeline_qk=config.pipeline_qk, converter=converter(config), v_tokens_last=v_tokens_last,
               tile_consumers=config.tile_consumers or 1, stream_k=config.split_plan == "stream_k",
               out_dtype=out_dtype, queries_as_n=bool(config.queries_as_n),
               values_in_registers=bool(getattr(config, "values_in_registers", False)) and not interpret,
               values_as_stored=bool(config.values_as_stored),
               paired_terms=bool(config.paired_terms))
    if smem.ring_spec().splits_rows and not interpret:
      smem = dataclasses.replace(smem, tile_aliases=True)
    if config.persistent and dataclasses.replace(smem, q_buffers=2).fits:   # never at the cost of a stage
      smem = dataclasses.replace(smem, q_buffers=2)
    return smem

  @property
  def num_wgs(self) -> int:
    return self.row_wgs * self.kv_groups * self.tile_consumers

  @property
  def one_byte_operands(self) -> bool:
    """Whether wgmma reads the one-byte tiles as they are (`fp8_operands`): V stored tokens last, so that both of
    its operands are K-major, over an fp8 cache, or an int8 one with the queries as N (s8 wgmma for Q K^T)."""
    if not self.v_tokens_last or self.converter:
      return False
    return self.dtype in FP8_DTYPES or (self.queries_as_n and self.dtype == INT8_DTYPE)

  @property
  def splits_queries(self) -> bool:
    """Whether the consumer makes Q's one-byte terms and factors from q's rows (`fp8_operands.split_queries`): the
    queries as N, so that no XLA op runs before the kernel."""
    return self.queries_as_n and self.one_byte_operands

  @property
  def q_copies(self) -> int:
    """TMA copies an item's q takes: q's rows (twice: paired terms), or Q's two terms and their factors."""
    if self.splits_queries:
      return 2 if self.paired_terms else 1
    return 3 if self.one_byte_operands else 1

  @property
  def operand_dtype(self):
    """Q's terms (and P's, keys as S's columns) on wgmma: int8 over an int8 cache, else e4m3."""
    return INT8_DTYPE if self.dtype == INT8_DTYPE else jnp.dtype(FP8_OPERAND_DTYPE)

  @property
  def num_threads(self) -> int:
    """Consumers, the TMA producer, and the converter if any."""
    return self.num_wgs + 1 + int(self.converter)

  @property
  def quantized(self) -> bool:
    return self.dtype.itemsize == 1

  @property
  def dequant_tiles(self) -> int:
    """Per consumer: K and V take turns in one, unless pipeline_qk still reads K while V is converted or V's
    tiles are laid out tokens last."""
    if not self.quantized or self.converter or self.one_byte_operands:
      return 0
    return 2 if self.pipeline_qk or self.v_tokens_last else 1

  def tile_shape(self, role: str) -> tuple[int, int]:
    """A K ("k") or V ("v") tile: [bkv, D], or [D, bkv] for V stored tokens last."""
    if role == "v" and self.v_tokens_last:
      return (self.head_dim, self.block_kv)
    return (self.block_kv, self.head_dim)

  @property
  def value_pages(self) -> int:
    """Pages a V tile stored tokens last spans: 1, or (pages smaller than a tile) a slot [pages, D, page_size] of
    one untiled [D, page_size] run a page, as a run of 16 or 32 bytes a row fits no swizzled tile."""
    return self.copies_per_tile if self.v_tokens_last else 1

  @property
  def value_run(self) -> int:
    """Tokens of a V slot's run: the tile, or a page of it (`value_pages`)."""
    return self.block_kv // self.value_pages

  def dequantized_types(self) -> tuple[Any, ...]:
    """One consumer's widened tiles: K's first, V's last (one tile where they take turns)."""
    roles = {0: (), 1: ("k",), 2: ("k", "v")}[self.dequant_tiles]
    return tuple(plgpu.SMEM(shape, self.q_dtype, transforms=tiling.smem_transforms(self.q_dtype, shape[1]))
                 for shape in (self.tile_shape(role) for role in roles))

  @property
  def _tma_ring_readers(self) -> int:
    return 1 if self.converter else self.row_wgs

  def ring_spec(self, role: str = "k") -> pipeline.RingSpec:
    shape = self.tile_shape(role)
    transforms = tiling.smem_transforms(self.dtype, shape[1])
    if role == "v" and self.value_pages > 1:
      # A page's run as stored is a wgmma operand of its own (swizzled as P's terms: `p_t`); widened, untiled.
      shape = (self.value_pages, self.head_dim, self.value_run)
      transforms = tiling.smem_transforms(self.dtype, self.value_run) if self.values_as_stored else ()
    return pipeline.RingSpec(
        num_stages=self.num_stages // self.kv_groups, block_shape=shape, dtype=self.dtype, transforms=transforms,
        copies_per_slot=self.copies_per_tile, num_consumers=self._tma_ring_readers)

  def scales_tokens_last(self, role: str) -> bool:
    """Whether role's per-token scales are laid out tokens last ([B, Hkv, T] / [P, Hkv, page_size], by
    `decode.decode_partials`): a tile's scales are then the head's own run, loaded as WGMMA columns (V's tokens
    last; both with fp8 operands, where the keys are S's columns). With the queries as N the keys are S^T's rows,
    as the scales are stored: no transpose. Scales by head are laid out so for every kernel: a tile's scales of
    one head are one run, loaded as a vector over the keys (`tiling.load_token_scales`) or as columns."""
    if self.scales_by_head:
      return True
    return not self.queries_as_n and ((role == "v" and self.v_tokens_last) or self.one_byte_operands)

  def scale_ring_spec(self, role: str = "k") -> pipeline.RingSpec:
    one_run = self.scale_width == 1 or self.scales_tokens_last(role)
    block = (self.block_kv,) if one_run else (self.block_kv, self.scale_width)
    return pipeline.RingSpec(num_stages=self.num_stages // self.kv_groups, block_shape=block, dtype=jnp.float32,
                             copies_per_slot=self.copies_per_tile, num_consumers=self._tma_ring_readers)

  def converted_ring_specs(self) -> dict[str, pipeline.RingSpec]:
    if not self.converter:
      return {}
    spec = pipeline.RingSpec(num_stages=CONVERTED_STAGES, block_shape=(self.block_kv, self.head_dim),
                             dtype=self.q_dtype, transforms=tiling.smem_transforms(self.q_dtype, self.head_dim),
                             copies_per_slot=1, num_consumers=self.row_wgs)
    return {"k": spec, "v": spec}

  @staticmethod
  def converted_ring_name(role: str) -> str:
    return f"g0_c{role}"

  def ring_specs(self) -> dict[str, pipeline.RingSpec]:
    """A KV group's rings by role, in the producer's fill order: "k", "ks" (K's scales) if any, "v", "vs"."""
    specs = {}
    for role in ("k", "v"):
      specs[role] = self.ring_spec(role)
      if role in self.token_scales:
        specs[f"{role}s"] = self.scale_ring_spec(role)
    return specs

  @staticmethod
  def ring_name(role: str, group: int) -> str:
    # Scratch is allocated in sorted name order: group by group, each group's rings in role order.
    return f"g{group}_{role}"

  def _all_ring_specs(self) -> dict[str, pipeline.RingSpec]:
    specs = {self.ring_name(role, g): spec
             for g in range(self.kv_groups) for role, spec in self.ring_specs().items()}
    specs.update((self.converted_ring_name(role), spec) for role, spec in self.converted_ring_specs().items())
    return specs

  @property
  def _dequantized_tile_bytes(self) -> int:
    return self.block_kv * self.head_dim * self.q_dtype.itemsize

  def scratch_types(self) -> dict[str, Any]:
    streaming, barriers = {}, {}
    for name, spec in self._all_ring_specs().items():
      streaming[name] = spec.buffer_type()
      barriers[f"{name}_produced"], barriers[f"{name}_consumed"] = spec.barrier_types()
    if self.quantized:
      streaming["dequantized"] = self.dequantized_types() * self.num_wgs
    out_stage = (plgpu.SMEM((self.num_wgs, ROWS_PER_WG, self.head_dim), self.out_dtype),
                 plgpu.SMEM((self.num_wgs, ROWS_PER_WG), jnp.float32))
    # Same names, so same order and offsets as the rings they alias.
    tiles = [{name: spec.tiles_type() for name, spec in self._all_ring_specs().items()}] if self.tile_aliases else []
    if self.separate_out:
      buffers = dict(streaming=plgpu.RefUnion(streaming, *tiles) if tiles else streaming, out_stage=out_stage)
    else:
      buffers = dict(union=plgpu.RefUnion(streaming, out_stage, *tiles))
    q_smem = plgpu.SMEM(self._q_shape, self._q_smem_dtype,
                        transforms=tiling.smem_transforms(self._q_smem_dtype, self.head_dim))
    if self.splits_queries:   # q's rows land where their terms then go: (terms, rows)
      q_smem = plgpu.RefUnion(q_smem, plgpu.SMEM(self._q_rows_shape, self.q_dtype,
                                                 transforms=tiling.smem_transforms(self.q_dtype, self.head_dim)))
    scratch = dict(
        q_smem=q_smem,
        **buffers,
        q_barrier=plgpu.Barrier(num_arrivals=self.q_copies, num_barriers=self.q_buffers * self.row_wgs),
        consumers_done=plgpu.Barrier(num_arrivals=self.num_wgs),
        **barriers)
    if self.tile_consumers == 2:
      # The second consumer's partial staged for the first to merge, and the first's reads of it done.
      scratch["partner_staged"] = plgpu.Barrier(num_arrivals=1)
      scratch["partner_read"] = plgpu.Barrier(num_arrivals=1)
    if self.stream_k:   # -inf, the lse of the piece slots a sequence leaves unused (`work.fill_unused_slots`)
      scratch["lse_fill"] = plgpu.SMEM((LSE_FILL_ROWS,), jnp.float32)
    if self.stage_p:
      scratch["p_smem"] = plgpu.SMEM(self._p_shape, self.q_dtype)
    if self.one_byte_operands:
      scratch["q_factors"] = plgpu.SMEM((self.q_buffers, self.row_wgs, ROWS_PER_WG), jnp.float32)
    if self.queries_as_n and self.one_byte_operands:   # P^T and V widened, both swizzled as P^T's rows (AS_N_SWIZZLE)
      transforms = tiling.smem_transforms(jnp.float16, self.block_kv, max_swizzle=AS_N_SWIZZLE)
      if self.values_as_stored:   # P as two one-byte terms [16, bkv] (wgmma's K-major B), swizzled as V's slot:
        # a [16, run] block per run of V's slot (a page's, over pages smaller than the tile); paired: the two
        # terms' blocks one [32, run] block a run
        p_shape = ((self.value_pages, 2 * AS_N_COLUMNS) if self.paired_terms else (2, self.value_pages, AS_N_COLUMNS))
        p_t = plgpu.SMEM((*p_shape, self.value_run), self.operand_dtype,
                         transforms=tiling.smem_transforms(self.operand_dtype, self.value_run))
      else:
        p_t = plgpu.SMEM((self.block_kv, AS_N_COLUMNS), jnp.float16,
                         transforms=tiling.smem_transforms(jnp.float16, AS_N_COLUMNS))
      scratch["p_t"] = (p_t,) * self.num_wgs
      scratch["v_wide"] = tuple(None if self.values_in_registers or self.values_as_stored else
                                plgpu.SMEM((self.head_dim, self.block_kv), jnp.float16, transforms=transforms)
                                for _ in range(self.num_wgs))
    elif self.queries_as_n:   # 16-bit: P [16, bkv] in q's dtype, swizzled as the V slot it meets in wgmma
      swizzle = tiling.smem_transforms(self.dtype, self.tile_shape("v")[1])[-1].swizzle
      scratch["p_t"] = (plgpu.SMEM((AS_N_COLUMNS, self.block_kv), self.q_dtype, transforms=tiling.smem_transforms(
          self.q_dtype, self.block_kv, max_swizzle=swizzle)),) * self.num_wgs
    elif self.one_byte_operands:   # (fp8: an int8 cache takes these operands with the queries as N only)
      # Separate refs: a statically indexed tile does not lower inside wgmma's run_state.
      scratch["p_terms"] = tuple(
          plgpu.SMEM((ROWS_PER_WG, self.block_kv), FP8_OPERAND_DTYPE,
                     transforms=tiling.smem_transforms(FP8_OPERAND_DTYPE, self.block_kv))
          for _ in range(2 * self.num_wgs))
    return scratch

  def buffers(self, scratch) -> tuple[Any, Any, Any]:
    """(streaming, (out, lse) staging, tiles or None) among the kernel's scratch refs."""
    if not self.separate_out:
      streaming, out_stage, *tiles = scratch["union"]
    elif self.tile_aliases:
      (streaming, *tiles), out_stage = scratch["streaming"], scratch["out_stage"]
    else:
      streaming, out_stage, tiles = scratch["streaming"], scratch["out_stage"], []
    return streaming, out_stage, (tiles[0] if tiles else None)

  @property
  def _p_shape(self) -> tuple[int, int, int]:
    return (self.num_wgs, ROWS_PER_WG, self.block_kv)

  @property
  def _q_shape(self) -> tuple[int, ...]:
    # Q's two terms; paired, both in the first term's block (rows 0-15 and 16-31)
    terms = ((1,) if self.paired_terms else (2,)) if self.one_byte_operands else ()
    return (self.q_buffers, self.row_wgs, *terms, ROWS_PER_WG, self.head_dim)

  @property
  def _q_rows_shape(self) -> tuple[int, ...]:
    return (self.q_buffers, self.row_wgs, ROWS_PER_WG, self.head_dim)

  @property
  def _q_smem_dtype(self):
    return self.operand_dtype if self.one_byte_operands else self.q_dtype

  @property
  def nbytes(self) -> int:
    """SMEM bytes the kernel asks for (allocations aligned as Mosaic GPU aligns them)."""
    align = pipeline.align_up
    specs = self._all_ring_specs().values()
    rings = sum(align(spec.buffer_bytes) for spec in specs)
    dequantized = self.num_wgs * self.dequant_tiles * align(self._dequantized_tile_bytes)
    outputs = (align(self.num_wgs * ROWS_PER_WG * self.head_dim * self.out_dtype.itemsize)
               + self.num_wgs * ROWS_PER_WG * 4)
    q = math.prod(self._q_shape) * self._q_smem_dtype.itemsize
    if self.splits_queries:
      q = max(q, math.prod(self._q_rows_shape) * self.q_dtype.itemsize)
    barriers = (sum(spec.barrier_bytes for spec in specs)
                + (self.q_buffers * self.row_wgs + 1 + 2 * (self.tile_consumers == 2)) * pipeline.BARRIER_BYTES)
    p = math.prod(self._p_shape) * self.q_dtype.itemsize if self.stage_p else 0
    fill = align(LSE_FILL_ROWS * 4) if self.stream_k else 0
    if self.one_byte_operands:
      factors = align(self.q_buffers * self.row_wgs * ROWS_PER_WG * 4)
      p = factors + 2 * self.num_wgs * align(ROWS_PER_WG * self.block_kv)
    if self.queries_as_n and self.one_byte_operands:   # (check_config refuses queries_as_n over other caches)
      p_t = align(self.block_kv * AS_N_COLUMNS * 2)   # f16 P^T, or P's two e4m3 terms: as many bytes
      v_wide = 0 if self.values_in_registers or self.values_as_stored else align(self.head_dim * self.block_kv * 2)
      p = factors + self.num_wgs * (p_t + v_wide)
    elif self.queries_as_n:
      p += self.num_wgs * align(self.block_kv * AS_N_COLUMNS * self.q_dtype.itemsize)
    streaming = rings + dequantized
    streaming = streaming + align(outputs) if self.separate_out else max(streaming, outputs)
    return (align(q) + align(streaming) + align(p) + fill
            + align(_REDUCTION_SCRATCH_BYTES) + barriers)

  @property
  def fits(self) -> bool:
    return self.nbytes <= SMEM_CAPACITY_BYTES


def smem_bytes(config: MosaicGPUConfig, *, rows: int, head_dim: int, dtype: Any = "bfloat16",
               page_size: int | None = None, **quantized) -> int:
  """SMEM bytes of one program (`DecodeSmem.for_call`'s arguments)."""
  return DecodeSmem.for_call(config, rows=rows, head_dim=head_dim, dtype=dtype, page_size=page_size,
                             **quantized).nbytes


def fits_smem(config: MosaicGPUConfig, **kwargs) -> bool:
  return smem_bytes(config, **kwargs) <= SMEM_CAPACITY_BYTES


def converter(config) -> bool:
  """Whether a converter warpgroup widens one-byte tiles (`experimental.MosaicGPUVariantConfig`)."""
  return bool(getattr(config, "convert_warpgroup", False))


def explicit_barriers(config) -> bool:
  """Whether the kernel runs without Mosaic GPU's automatic barriers around SMEM stores
  (`experimental.MosaicGPUVariantConfig`)."""
  return bool(getattr(config, "explicit_barriers", False))


def check_tokens_last_fields(config: MosaicGPUConfig, page_size: int | None) -> None:
  """Raises where a (partial) config's fields cannot read v stored tokens last."""
  if converter(config):
    raise ValueError("convert_warpgroup=True converts tiles of v laid out like k; v_tokens_last has no converter")
  if page_size in SMALL_VALUE_PAGES:
    ruled_out = {name: value for name, value, ok in (
        ("queries_as_n", config.queries_as_n, (None, True)), ("kv_groups", config.kv_groups, (None, 1)),
        ("tile_consumers", config.tile_consumers, (None, 1)),
        ("values_in_registers", getattr(config, "values_in_registers", False), (False,)),
        ("values_as_stored", config.values_as_stored, (None, False))) if value not in ok}
    if ruled_out:
      raise ValueError(f"v_tokens_last in pages of {page_size} tokens is widened a page at a time by the queries-as-N "
                       f"consumer (queries_as_n True, one consumer, V widened in SMEM), got {ruled_out}")
  elif page_size is not None and config.block_kv is not None and page_size % config.block_kv:
    if config.values_as_stored and config.block_kv % page_size == 0:
      return   # V read as stored a page at a time: a [D, page_size] run a page (`DecodeSmem.value_pages`)
    raise ValueError(f"v_tokens_last copies a [D, block_kv] tile from one page: block_kv={config.block_kv} must "
                     f"divide page_size {page_size}, or be a multiple of it with values_as_stored=True")


def check_config(config: MosaicGPUConfig, *, rows: int, head_dim: int, dtype: Any, page_size: int | None,
                 num_splits: int, **quantized) -> None:
  """Raises unless the kernel can run a complete config (`DecodeSmem.for_call`'s arguments) with num_splits
  splits. kv_groups=n runs n splits per program, sharing the slots out; pipeline_qk holds two K slots."""
  if not isinstance(config, MosaicGPUConfig) or not config.complete:
    raise ValueError(f"the mosaic_gpu GQA kernel takes a complete MosaicGPUConfig (resolve_config), got {config!r}")
  bkv = config.block_kv
  reason = head_dim_reason(head_dim, dtype)
  if reason is None and page_size is not None:
    reason = gqa_page_size_reason(page_size, head_dim, dtype)
  if reason:
    raise NotImplementedError(f"mosaic_gpu: {reason}")
  groups = config.kv_groups
  if groups > 1:
    if rows > ROWS_PER_WG:
      raise NotImplementedError(f"kv_groups={groups} needs <= {ROWS_PER_WG} packed rows, got {rows}")
    if num_splits % groups:
      raise ValueError(f"kv_groups={groups} needs num_splits a multiple of {groups}, got {num_splits}")
    if config.num_stages % groups:
      raise ValueError(f"kv_groups={groups} needs num_stages a multiple of {groups}, got {config.num_stages=}")
  if config.tile_consumers == 2:
    if rows > ROWS_PER_WG:
      raise NotImplementedError(f"tile_consumers=2 needs <= {ROWS_PER_WG} packed rows, got {rows}")
    # Each consumer takes the steps of one parity: an even ring gives every slot one reader. pipeline_qk holds a
    # K slot until the consumer's next tile (two steps on) has landed.
    if config.num_stages % 2 or (config.pipeline_qk and config.num_stages < 4):
      raise ValueError(f"tile_consumers=2 needs an even num_stages (>= 4 with pipeline_qk), got "
                       f"{config.num_stages=} {config.pipeline_qk=}")
    if converter(config):
      raise ValueError("tile_consumers=2 has no converter warpgroup (convert_warpgroup=True)")
  if converter(config) and explicit_barriers(config):
    raise ValueError("explicit_barriers=True has no converter warpgroup (convert_warpgroup=True)")
  if converter(config):
    if jnp.dtype(dtype).itemsize != 1:
      raise ValueError(f"convert_warpgroup=True converts one-byte caches; the cache is {jnp.dtype(dtype).name}")
    if config.kv_groups != 1 or config.persistent:
      raise ValueError(f"convert_warpgroup=True needs kv_groups=1 and persistent=False, got "
                       f"{config.kv_groups=} {config.persistent=}")
    if head_dim > 128:
      raise NotImplementedError(f"convert_warpgroup=True: head_dim={head_dim} > 128 (the converter "
                                "holds a whole float32 tile in its registers)")
  if getattr(config, "values_in_registers", False) and not config.queries_as_n:
    raise ValueError("values_in_registers=True widens V for the queries_as_n consumer: it needs queries_as_n=True")
  one_byte = jnp.dtype(dtype) in frame.QUANTIZED_DTYPES
  if config.values_as_stored and not (
      config.queries_as_n and one_byte and not getattr(config, "values_in_registers", False)):
    raise ValueError(f"values_as_stored=True reads one-byte V as stored for the queries_as_n consumer: it needs "
                     f"queries_as_n=True, an fp8 or int8 cache and values_in_registers=False, got "
                     f"{config.queries_as_n=} {jnp.dtype(dtype).name}")
  if config.queries_as_n:
    tokens_last = (not one_byte or quantized.get("v_tokens_last")) and not converter(config)
    if not (config.kv_groups == 1 and config.tile_consumers == 1 and tokens_last and rows <= AS_N_COLUMNS):
      raise ValueError(f"queries_as_n=True needs a 16-bit cache or an fp8 or int8 one with v_tokens_last, <= "
                       f"{AS_N_COLUMNS} packed rows and one consumer (kv_groups 1, tile_consumers 1), got "
                       f"{jnp.dtype(dtype).name} v_tokens_last={bool(quantized.get('v_tokens_last'))} {rows=} "
                       f"{config.kv_groups=} {config.tile_consumers=}")
  if config.pipeline_qk and config.num_stages < 2 * config.kv_groups:   # a K slot held while the next lands
    raise ValueError(f"pipeline_qk=True needs num_stages >= 2 a KV group, got {config.num_stages=} for "
                     f"{config.kv_groups=}")
  if quantized.get("v_tokens_last"):
    reason = tokens_last_reason(head_dim, page_size, dtype=dtype, rows=rows)
    if reason:
      raise NotImplementedError(f"mosaic_gpu: {reason}")
    check_tokens_last_fields(config, page_size)
  smem = DecodeSmem.for_call(config, rows=rows, head_dim=head_dim, dtype=dtype, page_size=page_size, **quantized)
  if not smem.fits:
    raise ValueError(
        f"block_kv={bkv} x num_stages={config.num_stages} needs {smem.nbytes} bytes of SMEM for head_dim "
        f"{head_dim} and {rows} packed rows{' (persistent)' if config.persistent else ''} of a "
        f"{smem.dtype.name} cache, over the {SMEM_CAPACITY_BYTES} available; use fewer stages")


PERSISTENT_WAVES = 3   # V as stored persistent: 9-10% faster at 4 and 8 waves of items, level at 2 (H100)
DEFAULT = MosaicGPUConfig(block_kv=64, num_stages=4, split_plan="per_sequence", kv_groups=1, pipeline_qk=False,
                          persistent=False, tile_consumers=1, sequence_order="given", queries_as_n=False,
                          values_as_stored=False, paired_terms=False)


def heuristic_config(problem, *, dtype: Any = "bfloat16", given: MosaicGPUConfig | None = None,
                     num_sms: int | None = None) -> MosaicGPUConfig:
  """The tile and the deepest ring that fits a cache of `dtype`, around the fields `given` fixes. A one-byte
  cache doubles the stages (as many bytes in flight) and, where the rows fit one warpgroup, takes two
  consumers: widening the tiles, not HBM, bounds it (docs/decisions.md#mosaic-one-byte-two-consumers). The
  queries as N (asked for, or `_takes_queries_as_n`) take 128-token tiles where the pages allow them
  (docs/decisions.md#mosaic-queries-as-n), and on a dense cache 256-token tiles with V read as stored where two
  stages fit (docs/decisions.md#mosaic-values-as-stored), persistent over PERSISTENT_WAVES waves of items."""
  given = MosaicGPUConfig() if given is None else given
  rows = problem.num_queries * problem.group_size
  one_byte = jnp.dtype(dtype).itemsize == 1
  quantized = dict(k_scale_kind="token", v_scale_kind="token", num_kv_heads=problem.num_kv_heads) if one_byte else {}
  quantized["v_tokens_last"] = getattr(problem, "v_tokens_last", False)
  start = dataclasses.replace(DEFAULT, num_stages=min(2 * DEFAULT.num_stages, MAX_STAGES)) if one_byte else DEFAULT
  if plan.is_stream_k(given):   # walked by the persistent programs
    start = dataclasses.replace(start, persistent=True)
  deepest = functools.partial(_deepest_ring, problem=problem, rows=rows, dtype=dtype,
                              stages_given=given.num_stages is not None, **quantized)
  small_pages = quantized["v_tokens_last"] and problem.page_size in SMALL_VALUE_PAGES   # read by nothing else
  fits = functools.partial(fits_smem, rows=rows, head_dim=problem.head_dim, dtype=dtype,
                           page_size=problem.page_size, **quantized)
  taken = _takes_queries_as_n(given, problem=problem, rows=rows, dtype=dtype)
  if given.queries_as_n or small_pages or taken:
    # A tokens-last V tile comes from one page, or a page at a time from pages smaller than a tile.
    fits_page = problem.page_size is None or problem.page_size % AS_N_BLOCK_KV == 0 or small_pages
    as_n = dataclasses.replace(start, queries_as_n=True,
                               block_kv=AS_N_BLOCK_KV if fits_page and one_byte else start.block_kv)
    if _reads_values_as_stored(given, problem=problem, dtype=dtype):
      as_stored = deepest(given.over(dataclasses.replace(   # int8's terms paired: 5-7% faster (fp8: 5% slower)
          as_n, block_kv=AS_STORED_BLOCK_KV, values_as_stored=True, paired_terms=jnp.dtype(dtype) == jnp.int8)))
      if fits(as_stored):
        waves = problem.batch * problem.num_kv_heads / (num_sms or runtime.num_sms())
        free = given.persistent is None and given.split_plan in (None, "per_sequence") and as_stored.kv_groups == 1
        if free and waves >= PERSISTENT_WAVES:
          persistent = dataclasses.replace(as_stored, persistent=True)
          return persistent if fits(persistent) else as_stored
        return as_stored
    as_n = deepest(given.over(as_n))
    # Taken by the heuristic alone: other consumers where it does not fit (D256), and over pages (V as stored led).
    if (fits(as_n) and problem.page_size is None) or not taken:
      return as_n
  if one_byte and given.kv_groups is None and rows <= ROWS_PER_WG and not _needs_one_group(given):
    two = deepest(given.over(dataclasses.replace(start, kv_groups=2)))
    if (two.num_stages >= 4 or given.num_stages is not None) and fits(two):
      return two
  return deepest(given.over(start))


def _takes_queries_as_n(given: MosaicGPUConfig, *, problem, rows: int, dtype: Any) -> bool:
  """Whether the heuristic runs the queries as wgmma N: a one-byte cache with V tokens last and <= 16 packed rows,
  dense or in pages that V read as stored tiles (`_pages_read_as_stored`), unless the given fields rule it out
  (docs/decisions.md#mosaic-queries-as-n, #mosaic-values-as-stored)."""
  return (given.queries_as_n is None and jnp.dtype(dtype) in frame.QUANTIZED_DTYPES and rows <= AS_N_COLUMNS
          and bool(getattr(problem, "v_tokens_last", False)) and _pages_read_as_stored(problem.page_size)
          and given.block_kv in (None, AS_N_BLOCK_KV, AS_STORED_BLOCK_KV) and given.kv_groups in (None, 1)
          and given.tile_consumers in (None, 1) and not converter(given))


def _pages_read_as_stored(page_size: int | None) -> bool:
  """Whether 256-token tiles with V as stored read pages of page_size tokens: dense, whole pages of >= 64 tokens a
  tile (a page's [D, page_size] run a wgmma operand), or whole tiles a page."""
  return (page_size is None or page_size % AS_STORED_BLOCK_KV == 0
          or (page_size >= MIN_BLOCK_KV and AS_STORED_BLOCK_KV % page_size == 0))


def _reads_values_as_stored(given: MosaicGPUConfig, *, problem, dtype: Any) -> bool:
  """Whether the queries-as-N consumer reads V as stored on 256-token tiles: a one-byte cache, dense or in pages it
  tiles, unless the given fields rule it out (docs/decisions.md#mosaic-values-as-stored)."""
  return (_pages_read_as_stored(problem.page_size) and jnp.dtype(dtype) in frame.QUANTIZED_DTYPES
          and given.values_as_stored in (None, True)
          and given.block_kv in (None, AS_STORED_BLOCK_KV) and not given.pipeline_qk
          and not getattr(given, "values_in_registers", False))


def _needs_one_group(config: MosaicGPUConfig) -> bool:
  """Whether the fields a config fixes rule out kv_groups=2 (`check_config`)."""
  return bool(config.persistent or converter(config) or plan.has_odd_split_count(config) or (config.num_stages or 2) % 2
              or config.tile_consumers == 2 or plan.is_stream_k(config) or config.queries_as_n)


def _deepest_ring(config: MosaicGPUConfig, *, problem, rows: int, dtype: Any, stages_given: bool = False,
                  **quantized) -> MosaicGPUConfig:
  """config with num_stages lowered (in steps of kv_groups, or 2 where two tile consumers need an even ring, to
  kv_groups or 2 at least) until it fits, unless given."""
  if stages_given:
    return config
  step = config.kv_groups if config.kv_groups > 1 else 2 if config.tile_consumers == 2 else 1
  config = dataclasses.replace(config, num_stages=max(step, config.num_stages // step * step))   # equal shares
  while config.num_stages > max(2, step) and not fits_smem(
      config, rows=rows, head_dim=problem.head_dim, dtype=dtype, page_size=problem.page_size, **quantized):
    config = dataclasses.replace(config, num_stages=config.num_stages - step)
  return config


def resolve_config(problem, config: MosaicGPUConfig | None, *, dtype: Any = "bfloat16", num_sms: int | None = None,
                   device_kind: str | None = None) -> MosaicGPUConfig:
  """The call's complete config, with a split count: the tuned one when none is given, else the given
  fields over the heuristic's."""
  if config is not None and not isinstance(config, MosaicGPUConfig):
    raise TypeError(f"the mosaic_gpu GQA kernel takes a MosaicGPUConfig, got {type(config).__name__}")
  tokens_last = getattr(problem, "v_tokens_last", False)
  resolved = (tuned.tuned_config(NAME, problem, dtype, device_kind) if config is None else None) or config
  resolved = resolved or MosaicGPUConfig()
  if tokens_last:
    check_tokens_last_fields(resolved, problem.page_size)
  resolved = resolved.over(heuristic_config(problem, dtype=dtype, given=resolved, num_sms=num_sms))
  _, row_blocks = row_blocking(problem.num_queries * problem.group_size)
  return plan.fill_num_splits(problem, resolved, row_blocks=row_blocks, num_sms=num_sms,
                              splits_per_program=resolved.kv_groups, walked=True)
