"""How one call's KV tiles are cut into splits: the `SplitPlan`, computed once before the kernels.

The backend resolves a config (its heuristic fills what the caller left None), then
`make_plan(lengths, ...)` turns it into a `SplitPlan`: the kind of plan, the split count and the
runtime vectors that the kernels and the merge read (the balanced plan's tiles per split, the
order in which programs take the sequences). Nothing reads a config's `split_plan` or
`num_splits` after that. A model whose layers share shapes plans once per step and passes the
plan to every layer (`pallas_kv.plan_splits`).

  "per_sequence"  each sequence's visible tiles in num_splits equal shares (`split_tile_range`):
                  a result depends only on its own length (batch-invariant with a fixed count);
  "balanced"      one tile count per split for the whole batch (`balanced_tiles_per_split`), so
                  that a ragged batch gives every SM about the same work; num_splits bounds one
                  sequence's splits;
  "stream_k"      (Triton) num_splits programs per (kv head, row block), each streaming an equal
                  share of the batch's tiles laid end to end (`kernels.triton.stream_k_plan`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kv import runtime

# A split shorter than this many tiles spends more on its prologue and the merge than it saves.
MIN_TILES_PER_SPLIT = 4


MAX_SPLITS = 64


# The balanced plan cuts a batch into about this many waves of work items (the SMs' block
# scheduler evens out the last one), and assumes a ragged batch fills at least half its capacity
# when it sizes the grid.
BALANCE_WAVES = 4


# ... but a batch of near-equal lengths (longest at most this times the mean) that fills a wave of
# programs unsplit stays unsplit: its programs already end together, and cutting them only adds
# programs, merges and short remainders (measured on the H200, MLA B128 T8192: 655 us unsplit,
# 702 us cut into 63 + 63 + 2 tiles; benchmarks/RESULTS.md, ninth set). The grid still holds the
# empty splits, which launch and join the merge (and then also loaded q and wrote empty partials):
# 663 us against 579 for the per-sequence plan at that row (tenth set), so the balanced plan is
# for ragged batches.
NEAR_EQUAL_LENGTHS = 1.25


def cdiv(a, b):
  """Ceiling division of ints (or traced int arrays)."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def choose_num_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                      num_sms: int, programs_per_sm: int = 1) -> int:
  """Splits per sequence so that the grid fills the GPU in about one wave.

  No split when batch x kv heads already fill it, or when the context is short.
  """
  programs = batch * num_kv_heads * row_blocks
  slots = num_sms * programs_per_sm
  if programs >= slots:
    return 1
  by_occupancy = slots // programs
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def balanced_chunks(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1) -> int:
  """Work items (sequence, split) the balanced plan aims for per (kv head, row block): about
  BALANCE_WAVES waves of programs over the whole grid."""
  return max(1, cdiv(BALANCE_WAVES * num_sms * programs_per_sm, num_kv_heads * row_blocks))


def choose_balanced_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                           num_sms: int, programs_per_sm: int = 1) -> int:
  """The most splits a sequence may take under the balanced plan (the grid's split extent).

  A batch whose sequences alone make BALANCE_WAVES waves needs no splits. Otherwise a sequence
  may take up to twice its even share of the work items, so a batch that fills at least half its
  capacity is cut evenly; emptier ones get longer splits (`balanced_tiles_per_split`).
  """
  chunks = balanced_chunks(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)
  if batch >= chunks:
    return 1
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(cdiv(2 * chunks, batch), by_length, MAX_SPLITS))


def balanced_tiles_per_split(lengths, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                             chunks: int):
  """The balanced plan of one call: int32 [1], the tiles of every split of every sequence.

  About `chunks` splits over the batch's visible tiles, never more than num_splits for one
  sequence, never fewer than MIN_TILES_PER_SPLIT tiles (a split that short costs more than it
  saves); one split per sequence when the lengths are near-equal and the batch alone fills a wave
  (NEAR_EQUAL_LENGTHS). `split_tile_range(..., tiles_per_split=)` then cuts each sequence with
  it; a sequence needing fewer splits leaves the rest empty.
  """
  first_tile, end_tile = visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
  tiles = jnp.maximum(end_tile - first_tile, 0)
  longest, total = jnp.max(tiles), jnp.sum(tiles)
  per_split = jnp.maximum(cdiv(total, chunks), cdiv(longest, num_splits))
  batch = lengths.shape[0]
  if batch * BALANCE_WAVES >= chunks:   # the sequences alone make a wave of programs
    near_equal = longest * batch <= NEAR_EQUAL_LENGTHS * total
    per_split = jnp.where(near_equal, jnp.maximum(longest, per_split), per_split)
  return jnp.maximum(per_split, MIN_TILES_PER_SPLIT).astype(jnp.int32).reshape(1)


def visible_tiles(length, *, block_kv: int, num_queries: int, window: int | None):
  """(first tile, end tile) of a sequence: the tiles that hold visible keys."""
  first_key = 0 if window is None else jnp.maximum(length - num_queries + 1 - window, 0)
  return first_key // block_kv, (length + block_kv - 1) // block_kv


def _split_tiles(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                 tiles_per_split=None):
  """(first tile, end tile, tiles per split) of a sequence: its own equal shares, or the
  balanced plan's `tiles_per_split`."""
  first_tile, end_tile = visible_tiles(length, block_kv=block_kv, num_queries=num_queries, window=window)
  if tiles_per_split is None:
    tiles_per_split = (jnp.maximum(end_tile - first_tile, 0) + num_splits - 1) // num_splits
  return first_tile, end_tile, tiles_per_split


def split_tile_range(length, split, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                     tiles_per_split=None):
  """Tiles [t0, t1) of split `split` of a sequence of `length` tokens, and the sub-range [a, c)
  whose tiles every new token sees whole (no masking needed).

  New token s (0 <= s < S) sits at p = L - S + s and sees keys t <= p, t > p - window. Every
  split gets an equal share of the tiles that hold visible keys (earlier splits never fewer than
  later ones), so a sequence's partials depend only on its own length and num_splits; tiles
  before the window or past the length belong to no split and are never loaded. With
  `tiles_per_split` (the balanced plan, a runtime scalar) every split takes that many tiles
  instead, and the splits past the sequence's last tile are empty.
  """
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split)
  t0 = jnp.minimum(first_tile + split * per_split, end_tile)
  t1 = jnp.minimum(t0 + per_split, end_tile)
  a, c = unmasked_tiles(length, t0, t1, block_kv=block_kv, num_queries=num_queries, window=window)
  return t0, t1, a, c


def unmasked_tiles(length, t0, t1, *, block_kv: int, num_queries: int, window: int | None):
  """The sub-range [a, c) of tiles [t0, t1) that every new token sees whole (no masking needed):
  keys <= L - S (the first token's position) and, with a window, keys >= L - window (the last
  token's window start)."""
  full_hi = jnp.maximum(length - num_queries + 1, 0) // block_kv
  full_lo = 0 if window is None else (jnp.maximum(length - window, 0) + block_kv - 1) // block_kv
  a = jnp.clip(full_lo, t0, t1)
  c = jnp.clip(full_hi, a, t1)
  return a, c


def active_splits(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                  tiles_per_split=None):
  """How many splits of a sequence get tiles from `split_tile_range`: splits 0 .. n-1 do, the
  rest are empty (0 for a sequence with no visible key)."""
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split)
  num_tiles = jnp.maximum(end_tile - first_tile, 0)
  return jnp.where(num_tiles > 0, (num_tiles + per_split - 1) // jnp.maximum(per_split, 1), 0)


def longest_first(lengths):
  """int32 [B]: the batch's sequences by length, longest first (ties in batch order)."""
  return jnp.argsort(-lengths.astype(jnp.int32), stable=True).astype(jnp.int32)


def long_short(lengths):
  """int32 [B]: longest, shortest, second longest, second shortest, ... (`longest_first` order
  taken from both ends in turn)."""
  by_length = longest_first(lengths)
  n = by_length.shape[0]
  i = jnp.arange(n, dtype=jnp.int32)
  return by_length[jnp.where(i % 2 == 0, i // 2, n - 1 - i // 2)]


# DecodeConfig.sequence_order -> the permutation it takes; "given" (batch order) needs none.
ORDER_FUNCTIONS = {"longest_first": longest_first, "long_short": long_short}


def stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int) -> int:
  """Programs per (kv head, row block) under the stream-K plan: one wave of the GPU's program
  slots, so that every program starts at once and, streaming the same number of tiles, they all
  end together."""
  return max(1, (num_sms * programs_per_sm) // (num_kv_heads * row_blocks))



def choose_stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1,
                             **_) -> int:
  """`stream_k_programs` with `choose_num_splits`' signature (the batch and length do not matter)."""
  return stream_k_programs(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)


SPLIT_COUNTS = {"per_sequence": choose_num_splits, "balanced": choose_balanced_splits,
                "stream_k": choose_stream_k_programs}


def fill_num_splits(problem, config, *, row_blocks: int, programs_per_sm: int = 1, num_sms: int | None = None,
                    splits_per_program: int = 1):
  """config with num_splits chosen where it is None, so that the grid of row_blocks programs per
  (sequence, kv head) fills the GPU (times splits_per_program: a Mosaic GPU program with two KV
  groups serves two splits)."""
  if config.num_splits is not None:
    return config
  choose = SPLIT_COUNTS[config.split_plan]
  splits = choose(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                  capacity=problem.capacity, block_kv=config.block_kv, num_sms=num_sms or runtime.num_sms(),
                  programs_per_sm=programs_per_sm)
  return dataclasses.replace(config, num_splits=splits * splits_per_program)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitPlan:
  """One call's split plan: static kind, split count and tile size, and the runtime vectors.

  tiles_per_split: int32 [1], the balanced plan's tiles per split (None otherwise).
  order: int32 [B], the batch's sequences in the order programs take them (None: batch order).
  """
  kind: str = dataclasses.field(metadata=dict(static=True))
  num_splits: int = dataclasses.field(metadata=dict(static=True))
  block_kv: int = dataclasses.field(metadata=dict(static=True))
  tiles_per_split: jax.Array | None = None
  order: jax.Array | None = None

  def __post_init__(self):
    if self.kind not in SPLIT_COUNTS:
      raise ValueError(f"SplitPlan.kind={self.kind!r} must be one of {tuple(SPLIT_COUNTS)}")
    if (self.kind == "balanced") != (self.tiles_per_split is not None):
      raise ValueError(f"SplitPlan: tiles_per_split is given exactly for the balanced plan; got kind={self.kind!r} "
                       f"and tiles_per_split={'None' if self.tiles_per_split is None else 'an array'}")

  @property
  def balanced(self) -> bool:
    return self.kind == "balanced"

  @property
  def stream_k(self) -> bool:
    return self.kind == "stream_k"

  @property
  def ordered(self) -> bool:
    return self.order is not None

  def check(self, *, block_kv: int, batch: int) -> None:
    """That this plan fits a kernel call with tiles of block_kv tokens over a batch of `batch`."""
    if self.block_kv != block_kv:
      raise ValueError(f"the plan was made for {self.block_kv}-token tiles; the kernel streams {block_kv}")
    for name, value, shape in (("tiles_per_split", self.tiles_per_split, (1,)), ("order", self.order, (batch,))):
      if value is not None and (value.shape != shape or value.dtype != jnp.int32):
        raise ValueError(f"SplitPlan.{name} must be int32 {list(shape)}, got {value.shape} {value.dtype}")

  def kernel_inputs(self) -> tuple:
    """The runtime vectors a kernel takes, in its order: the sequence order, then the tile count."""
    return tuple(v for v in (self.order, self.tiles_per_split) if v is not None)


def make_plan(lengths, *, problem, config, window: int | None, row_blocks: int, programs_per_sm: int = 1,
              num_sms: int | None = None) -> SplitPlan:
  """The plan of a resolved config (num_splits set) for these lengths (clamped into [0, capacity],
  as the kernels clamp them). A plan without runtime vectors traces nothing: the call's program
  then holds no XLA op before the kernel (the kernels clamp the lengths themselves)."""
  order_of = ORDER_FUNCTIONS.get(getattr(config, "sequence_order", None) or "given")
  if config.split_plan != "balanced" and order_of is None:
    return SplitPlan(kind=config.split_plan, num_splits=config.num_splits, block_kv=config.block_kv)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, problem.capacity)
  tiles = None
  if config.split_plan == "balanced":
    chunks = balanced_chunks(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                             num_sms=num_sms or runtime.num_sms(), programs_per_sm=programs_per_sm)
    tiles = balanced_tiles_per_split(lengths, block_kv=config.block_kv, num_queries=problem.num_queries,
                                     num_splits=config.num_splits, window=window, chunks=chunks)
  return SplitPlan(kind=config.split_plan, num_splits=config.num_splits, block_kv=config.block_kv,
                   tiles_per_split=tiles, order=None if order_of is None else order_of(lengths))
