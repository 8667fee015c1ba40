"""How one call's KV tiles are cut into splits: the `SplitPlan`, computed once before the kernels.

`make_plan` turns a resolved config into a `SplitPlan`; nothing reads the config's plan fields after that.
  "per_sequence"  each sequence's visible tiles in num_splits equal shares: batch-invariant for a fixed count;
  "balanced"      one tile count per split for the whole batch, for ragged batches (opt-in: see
                  docs/decisions.md#balanced-plan-opt-in);
  "stream_k"      programs share the batch's tiles laid end to end: Triton's num_splits programs per (kv head,
                  row block), planned inside its kernel; Mosaic GPU's persistent programs (`StreamKWalk`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kv import runtime

# Shorter splits cost more in prologue and merge than they save.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# Balanced plan: about this many waves of work items (the block scheduler evens out the last).
BALANCE_WAVES = 4
# ... but near-equal lengths (longest <= this x mean) that fill a wave unsplit stay unsplit: their programs
# already end together (docs/decisions.md#balanced-near-equal-lengths).
NEAR_EQUAL_LENGTHS = 1.25


def cdiv(a, b):
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def choose_num_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                      num_sms: int, programs_per_sm: int = 1) -> int:
  """Splits per sequence so that the grid fills about one wave (docs/decisions.md#split-count-one-wave)."""
  programs = batch * num_kv_heads * row_blocks
  slots = num_sms * programs_per_sm
  if programs >= slots:
    return 1
  by_occupancy = slots // programs
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def balanced_chunks(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1) -> int:
  return max(1, cdiv(BALANCE_WAVES * num_sms * programs_per_sm, num_kv_heads * row_blocks))


def choose_balanced_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                           num_sms: int, programs_per_sm: int = 1) -> int:
  """The balanced plan's split extent: up to twice a sequence's even share of the work items."""
  chunks = balanced_chunks(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)
  if batch >= chunks:
    return 1
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(cdiv(2 * chunks, batch), by_length, MAX_SPLITS))


def balanced_tiles_per_split(lengths, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                             chunks: int):
  """int32 [1], the tiles of every split: about `chunks` splits over the batch, at most num_splits per
  sequence, at least MIN_TILES_PER_SPLIT tiles each, unsplit under NEAR_EQUAL_LENGTHS."""
  first_tile, end_tile = visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
  tiles = jnp.maximum(end_tile - first_tile, 0)
  longest, total = jnp.max(tiles), jnp.sum(tiles)
  per_split = jnp.maximum(cdiv(total, chunks), cdiv(longest, num_splits))
  batch = lengths.shape[0]
  if batch * BALANCE_WAVES >= chunks:
    near_equal = longest * batch <= NEAR_EQUAL_LENGTHS * total
    per_split = jnp.where(near_equal, jnp.maximum(longest, per_split), per_split)
  return jnp.maximum(per_split, MIN_TILES_PER_SPLIT).astype(jnp.int32).reshape(1)


def visible_tiles(length, *, block_kv: int, num_queries: int, window: int | None, start=None):
  """(first tile, end tile) of a sequence: the tiles that hold visible keys; start: its window start or None."""
  first_key = 0 if window is None else jnp.maximum(length - num_queries + 1 - window, 0)
  if start is not None:
    first_key = jnp.maximum(first_key, jnp.minimum(start, length))
  return first_key // block_kv, (length + block_kv - 1) // block_kv


def _split_tiles(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                 tiles_per_split=None, start=None):
  first_tile, end_tile = visible_tiles(length, block_kv=block_kv, num_queries=num_queries, window=window,
                                       start=start)
  if tiles_per_split is None:
    tiles_per_split = (jnp.maximum(end_tile - first_tile, 0) + num_splits - 1) // num_splits
  return first_tile, end_tile, tiles_per_split


def split_tile_range(length, split, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                     tiles_per_split=None, start=None):
  """(t0, t1, a, c): tiles [t0, t1) of split `split` of a sequence and their unmasked sub-range [a, c). Splits
  share the visible tiles equally (earlier ones never fewer), or take `tiles_per_split` each (balanced)."""
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split, start=start)
  t0 = jnp.minimum(first_tile + split * per_split, end_tile)
  t1 = jnp.minimum(t0 + per_split, end_tile)
  a, c = unmasked_tiles(length, t0, t1, block_kv=block_kv, num_queries=num_queries, window=window, start=start)
  return t0, t1, a, c


def unmasked_tiles(length, t0, t1, *, block_kv: int, num_queries: int, window: int | None, start=None):
  """The sub-range [a, c) of tiles [t0, t1) whose keys every new token sees: <= L - S, >= L - window and
  >= start."""
  full_hi = jnp.maximum(length - num_queries + 1, 0) // block_kv
  full_lo = 0 if window is None else (jnp.maximum(length - window, 0) + block_kv - 1) // block_kv
  if start is not None:
    full_lo = jnp.maximum(full_lo, (start + block_kv - 1) // block_kv)
  a = jnp.clip(full_lo, t0, t1)
  c = jnp.clip(full_hi, a, t1)
  return a, c


def masks_leading_tiles(*, window: int | None, start) -> bool:
  """Whether a range's first tiles can be masked (`unmasked_tiles`' a > t0): only under a window or a window start.
  Without, the kernels emit no loop for them (code that never runs, and that an SM's instruction fetch would read
  past)."""
  return window is not None or start is not None


def tile_loops(t0, t1, a, c, *, window: int | None, start, one_loop: bool = False) -> list[tuple[Any, Any, bool]]:
  """The loops a kernel runs over tiles [t0, t1) with [a, c) unmasked, as (lo, hi, masked): the leading masked
  tiles (only where `masks_leading_tiles`), the unmasked ones, the trailing masked ones. one_loop: all of them
  through the masked step, one loop's code (a masked step is right on any tile; it adds the mask's math a tile)."""
  if one_loop:
    return [(t0, t1, True)]
  leading = [(t0, a, True)] if masks_leading_tiles(window=window, start=start) else []
  return leading + [(a, c, False), (c, t1, True)]


def active_splits(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                  tiles_per_split=None, start=None):
  """n: splits 0 .. n-1 of a sequence get tiles from `split_tile_range`, the rest none."""
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split, start=start)
  num_tiles = jnp.maximum(end_tile - first_tile, 0)
  return jnp.where(num_tiles > 0, (num_tiles + per_split - 1) // jnp.maximum(per_split, 1), 0)


def longest_first(lengths):
  """int32 [B]: the batch's sequences by length, longest first (ties in batch order)."""
  return jnp.argsort(-lengths.astype(jnp.int32), stable=True).astype(jnp.int32)


def long_short(lengths):
  """int32 [B]: longest, shortest, second longest, second shortest, ..."""
  by_length = longest_first(lengths)
  n = by_length.shape[0]
  i = jnp.arange(n, dtype=jnp.int32)
  return by_length[jnp.where(i % 2 == 0, i // 2, n - 1 - i // 2)]


ORDER_FUNCTIONS = {"longest_first": longest_first, "long_short": long_short}


def stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int) -> int:
  """Programs per (kv head, row block) under stream-K: one wave, so that all start and end together."""
  return max(1, (num_sms * programs_per_sm) // (num_kv_heads * row_blocks))


def choose_stream_k_pieces(*, batch: int, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1,
                           **_) -> int:
  """The most pieces one sequence may be cut into when persistent programs walk equal shares of the batch's tiles
  (`stream_k_walk`): enough that a sequence of up to twice the mean length never makes a share longer."""
  slots = num_sms * programs_per_sm
  return max(2, min(1 + cdiv(2 * slots, batch * num_kv_heads * row_blocks), MAX_SPLITS))


def choose_stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1,
                             **_) -> int:
  return stream_k_programs(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)


SPLIT_COUNTS = {"per_sequence": choose_num_splits, "balanced": choose_balanced_splits,
                "stream_k": choose_stream_k_programs}


# A config's plan fields are read in this module alone; the kernels take the SplitPlan.

def fixes_plan(config) -> bool:
  """Whether a config fixes any part of its plan: the kind, the split count or a sequence order."""
  return (config.split_plan is not None or config.num_splits is not None
          or getattr(config, "sequence_order", None) not in (None, "given"))


def is_stream_k(config) -> bool:
  return config.split_plan == "stream_k"


def as_stream_k(config, programs: int):
  """config under stream-K with `programs` programs per (kv head, row block), in batch order."""
  return dataclasses.replace(config, split_plan="stream_k", num_splits=programs, sequence_order="given")


def has_odd_split_count(config) -> bool:
  return config.num_splits is not None and config.num_splits % 2 == 1


def num_programs(problem, config, *, row_blocks: int) -> int:
  """Programs of a complete config's grid, one per (sequence, split, row block) of each kv head."""
  return problem.batch * problem.num_kv_heads * row_blocks * config.num_splits


def fill_num_splits(problem, config, *, row_blocks: int, programs_per_sm: int = 1, num_sms: int | None = None,
                    splits_per_program: int = 1, walked: bool = False):
  """config with num_splits filled in where None (times splits_per_program, the splits one program serves);
  walked: a stream-K plan is walked by persistent programs (`stream_k_walk`), its count the pieces a sequence may
  take."""
  if config.num_splits is not None:
    return config
  choose = choose_stream_k_pieces if walked and is_stream_k(config) else SPLIT_COUNTS[config.split_plan]
  splits = choose(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                  capacity=problem.capacity, block_kv=config.block_kv, num_sms=num_sms or runtime.num_sms(),
                  programs_per_sm=programs_per_sm)
  return dataclasses.replace(config, num_splits=splits * splits_per_program)


# A call that plans for itself lets each persistent program derive its own share from the lengths (`kernel_walk`):
# two loops over the batch, unrolled by up to this many steps (a batch of at most that many: straight-line code).
# Ragged, H100: the loops unrolled 8 took 386.0 / 322.5 / 102.2 µs at B128 / B64 / B32 against the XLA walk's
# 396.8 / 334.2 / 104.0 (two launches before the kernel) and the straight-line walk's 426.1 / 401.3 / 101.7: the
# straight walk's cost was its code (docs/decisions.md#stream-k-walk).
KERNEL_WALK_UNROLL = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamKWalk:
  """A stream-K plan for persistent programs (Mosaic GPU). The batch's visible tiles are laid end to end once per
  head block (head block h's copy of sequence b at h * N + offsets[b]) and cut into equal shares of `walk_share`
  tiles, one a program (`share_bounds`).

  Made by the call itself it holds no vectors: each program computes its share from the lengths (`kernel_walk`),
  and nothing launches before the kernel. Made ahead (`pallas_kv.plan_splits`, shared by a model's layers) it
  holds the vectors of `stream_k_walk`, two reductions in XLA: offsets int32 [B + 1], the running sum of the
  sequences' tiles, N = offsets[B]; longest int32 [B + 1], every entry the longest sequence's tiles; first, end
  int32 [P]: the flat sequences h * B + b in [first, end) that program p visits (those its share meets, and the
  empty ones that start in it; the kernel extends the last program's end over the empty ones at the end)."""
  num_programs: int = dataclasses.field(metadata=dict(static=True))
  unroll: int = dataclasses.field(default=0, metadata=dict(static=True))   # the kernel's walk's (`kernel_walk`)
  offsets: jax.Array | None = None
  longest: jax.Array | None = None
  first: jax.Array | None = None
  end: jax.Array | None = None

  @property
  def in_kernel(self) -> bool:
    return self.offsets is None

  def arrays(self) -> tuple:
    return () if self.in_kernel else (self.offsets, self.longest, self.first, self.end)


def walk_programs(*, batch: int, head_blocks: int, max_pieces: int, num_sms: int, programs_per_sm: int = 1) -> int:
  """Persistent programs of a stream-K walk: a wave, but no more than there can be pieces of work."""
  return max(1, min(num_sms * programs_per_sm, batch * head_blocks * max(max_pieces - 1, 1)))


def _cdiv_nonnegative(a, b):
  return lax.div(a + b - 1, b)   # a truncating division: no sign handling, as inside a kernel


def walk_share(per_head_block, longest, *, head_blocks: int, num_programs: int, max_pieces: int):
  """Tiles a share of a stream-K walk: the batch's tiles over the programs, at least the longest sequence's over
  (max_pieces - 1) so that no sequence is cut into more pieces, and at least one. Scalars or arrays, in XLA or
  inside a kernel."""
  total = head_blocks * per_head_block
  return jnp.maximum(jnp.maximum(_cdiv_nonnegative(total, jnp.int32(num_programs)),
                                 _cdiv_nonnegative(longest, jnp.int32(max_pieces - 1))), 1)


def share_bounds(program, share, total):
  """[lo, hi): program's share of the total tiles."""
  lo = jnp.minimum(program * share, total)
  return lo, jnp.minimum(lo + share, total)


def kernel_walk(tiles_of, batch: int, program, *, head_blocks: int, num_programs: int, max_pieces: int,
                unroll: int):
  """One program's stream-K walk from each sequence's visible tile count (tiles_of(b): an int32 scalar, a load
  inside a kernel), in two loops over the batch (no prefix sum, but adds), each unrolled by the largest factor of
  B up to `unroll` (B or more: straight-line code). Returns (lo, hi, first, end, first_offset, share, per_head_block):
  its share [lo, hi) of the tiles, the flat sequences [first, end) it visits, where flat sequence `first` starts
  in its head block (offsets[first % B]), the share's size and N.

  A sequence is visited by the programs whose shares meet it; an empty one by exactly one. The flat sequences
  starting before x = h * N + r (0 <= r < N) are counted as h * B + #{b: offsets[b] < r}: consecutive programs'
  ranges meet (end of p = that count at hi, first of p + 1 = that count at its lo, less one where a sequence
  straddles lo), so every sequence lies in one range or, straddling a bound, in both ranges beside it."""
  steps = max(d for d in range(1, min(max(unroll, 1), batch) + 1) if batch % d == 0)

  def totals(b, carry):   # N (the running sum's end) and the longest sequence's tiles
    running, longest = carry
    count = tiles_of(b)
    return running + count, jnp.maximum(longest, count)

  zero = jnp.int32(0)
  per_head_block, longest = lax.fori_loop(0, batch, totals, (zero, zero), unroll=steps)
  share = walk_share(per_head_block, longest, head_blocks=head_blocks, num_programs=num_programs,
                     max_pieces=max_pieces)
  lo, hi = share_bounds(program, share, head_blocks * per_head_block)
  nonzero = jnp.maximum(per_head_block, 1)   # N = 0: every bound is 0, h = r = 0
  h_lo, h_hi = lax.div(lo, nonzero), lax.div(hi, nonzero)
  r_lo, r_hi = lo - h_lo * per_head_block, hi - h_hi * per_head_block

  def counts(b, carry):
    """Sequences starting before r_lo and r_hi, and the last of those before r_lo: its start and end."""
    offset, below_lo, below_hi, last_start, next_start = carry
    following = offset + tiles_of(b)
    starts_below = offset < r_lo
    return (following, below_lo + starts_below.astype(jnp.int32), below_hi + (offset < r_hi).astype(jnp.int32),
            jnp.where(starts_below, offset, last_start), jnp.where(starts_below, following, next_start))

  _, below_lo, below_hi, last_start, next_start = lax.fori_loop(0, batch, counts, (zero,) * 5, unroll=steps)
  # The last sequence starting before r_lo straddles lo when it ends past it.
  straddles = next_start > r_lo
  first = h_lo * batch + below_lo - straddles.astype(jnp.int32)
  end = h_hi * batch + below_hi
  return lo, hi, first, end, jnp.where(straddles, last_start, next_start), share, per_head_block


def stream_k_walk(lengths, *, block_kv: int, num_queries: int, window: int | None, head_blocks: int,
                  num_programs: int, max_pieces: int) -> StreamKWalk:
  """The `StreamKWalk` of lengths int32 [B] (clamped to the capacity) for num_programs programs."""
  if max_pieces < 2:
    raise ValueError(f"a stream-K walk cuts a sequence into at most max_pieces >= 2 pieces, got {max_pieces}")
  # Two variadic reductions and broadcasts only, so that XLA launches two kernels: jnp.cumsum lowers to a scan
  # whose fallback is a while loop (a launch a step on a GPU), and gathers or scatters would each be a launch.
  first, end = visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
  tiles = jnp.maximum(end - first, 0).astype(jnp.int32)
  batch = lengths.shape[0]
  index = jnp.arange(batch + 1, dtype=jnp.int32)
  column = jnp.broadcast_to(tiles[:, None], (batch, batch + 1))
  offsets, longest = lax.reduce(
      (jnp.where(index[:batch, None] < index[None, :], column, 0), column), (jnp.int32(0), jnp.int32(0)),
      lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (0,))
  per_head_block = offsets[batch]
  share = walk_share(per_head_block, longest[0], head_blocks=head_blocks, num_programs=num_programs,
                     max_pieces=max_pieces)
  lo, hi = share_bounds(jnp.arange(num_programs, dtype=jnp.int32), share, head_blocks * per_head_block)
  # Flat sequence h * B + b starts at h * N + offsets[b].
  head_start = jnp.arange(head_blocks, dtype=jnp.int32)[:, None] * per_head_block
  seq_start = (head_start + offsets[None, :batch]).reshape(-1)
  seq_end = (head_start + offsets[None, 1:]).reshape(-1)
  # Visited by program p: the sequences its share meets and the empty ones starting in it (prefix counts, as
  # both ends are nondecreasing in the flat order).
  before = (seq_start[None] < lo[:, None]) & (seq_end[None] <= lo[:, None])
  started = seq_start[None] < hi[:, None]
  first_seq, end_seq = lax.reduce((before.astype(jnp.int32), started.astype(jnp.int32)), (jnp.int32(0), jnp.int32(0)),
                                  lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  return StreamKWalk(num_programs=num_programs, offsets=offsets, longest=longest, first=first_seq, end=end_seq)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitPlan:
  """One call's split plan: static kind, split count and tile size; tiles_per_split int32 [1] (balanced
  only); order int32 [B], the sequences in the order programs take them (None: batch order); walk: a stream-K
  plan's shares for persistent programs (Mosaic GPU; Triton plans stream-K inside its kernel)."""
  kind: str = dataclasses.field(metadata=dict(static=True))
  num_splits: int = dataclasses.field(metadata=dict(static=True))
  block_kv: int = dataclasses.field(metadata=dict(static=True))
  tiles_per_split: jax.Array | None = None
  order: jax.Array | None = None
  walk: StreamKWalk | None = None

  def __post_init__(self):
    if self.kind not in SPLIT_COUNTS:
      raise ValueError(f"SplitPlan.kind={self.kind!r} must be one of {tuple(SPLIT_COUNTS)}")
    if (self.kind == "balanced") != (self.tiles_per_split is not None):
      raise ValueError(f"SplitPlan: tiles_per_split is given exactly for the balanced plan; got kind={self.kind!r} "
                       f"and tiles_per_split={'None' if self.tiles_per_split is None else 'an array'}")
    if self.walk is not None and self.kind != "stream_k":
      raise ValueError(f"SplitPlan: a walk is a stream-K plan's; got kind={self.kind!r}")

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
    if self.block_kv != block_kv:
      raise ValueError(f"the plan was made for {self.block_kv}-token tiles; the kernel streams {block_kv}")
    vectors = [("tiles_per_split", self.tiles_per_split, (1,)), ("order", self.order, (batch,))]
    if self.walk is not None and not self.walk.in_kernel:
      programs = (self.walk.num_programs,)
      vectors += [("walk.offsets", self.walk.offsets, (batch + 1,)), ("walk.longest", self.walk.longest, (batch + 1,)),
                  ("walk.first", self.walk.first, programs), ("walk.end", self.walk.end, programs)]
    for name, value, shape in vectors:
      if value is not None and (value.shape != shape or value.dtype != jnp.int32):
        raise ValueError(f"SplitPlan.{name} must be int32 {list(shape)}, got {value.shape} {value.dtype}")

  def check_made_for(self, config) -> None:
    """Raises unless the plan was made for a call that runs config (its kind, split count and tile)."""
    made_for = (config.split_plan, config.num_splits, config.block_kv)
    if (self.kind, self.num_splits, self.block_kv) != made_for:
      raise ValueError(f"plan (kind, num_splits, block_kv) = {(self.kind, self.num_splits, self.block_kv)} was made "
                       f"for another call; this one runs {made_for}: plan with the call's own arguments")

  def kernel_inputs(self) -> tuple:
    """The runtime vectors a kernel takes, in its order: the sequence order, the tile count, the walk's."""
    vectors = tuple(v for v in (self.order, self.tiles_per_split) if v is not None)
    return vectors + (() if self.walk is None else self.walk.arrays())


def make_plan(lengths, *, problem, config, window: int | None, row_blocks: int, programs_per_sm: int = 1,
              num_sms: int | None = None, walked: bool = False, ahead: bool = False) -> SplitPlan:
  """The plan of a resolved config; one without runtime vectors traces nothing, so no op precedes the kernel.
  walked: a stream-K plan is walked by persistent programs (`StreamKWalk`), else planned in the kernel (Triton).
  ahead: made once for several calls (`pallas_kv.plan_splits`): a walk's vectors are computed here, in XLA, not by
  each call's programs."""
  order_of = ORDER_FUNCTIONS.get(getattr(config, "sequence_order", None) or "given")
  walk = walked and is_stream_k(config)
  if walk:
    head_blocks = problem.num_kv_heads * row_blocks
    programs = walk_programs(batch=problem.batch, head_blocks=head_blocks, max_pieces=config.num_splits,
                             num_sms=num_sms or runtime.num_sms(), programs_per_sm=programs_per_sm)
    if not ahead:   # an experimental config's walk_unroll: the loops unrolled otherwise
      unroll = min(getattr(config, "walk_unroll", 0) or KERNEL_WALK_UNROLL, problem.batch)
      return SplitPlan(kind="stream_k", num_splits=config.num_splits, block_kv=config.block_kv,
                       walk=StreamKWalk(num_programs=programs, unroll=unroll))
  if config.split_plan != "balanced" and order_of is None and not walk:
    return SplitPlan(kind=config.split_plan, num_splits=config.num_splits, block_kv=config.block_kv)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, problem.capacity)
  if walk:
    return SplitPlan(kind="stream_k", num_splits=config.num_splits, block_kv=config.block_kv,
                     walk=stream_k_walk(lengths, block_kv=config.block_kv, num_queries=problem.num_queries,
                                        window=window, head_blocks=head_blocks, num_programs=programs,
                                        max_pieces=config.num_splits))
  tiles = None
  if config.split_plan == "balanced":
    chunks = balanced_chunks(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                             num_sms=num_sms or runtime.num_sms(), programs_per_sm=programs_per_sm)
    tiles = balanced_tiles_per_split(lengths, block_kv=config.block_kv, num_queries=problem.num_queries,
                                     num_splits=config.num_splits, window=window, chunks=chunks)
  return SplitPlan(kind=config.split_plan, num_splits=config.num_splits, block_kv=config.block_kv,
                   tiles_per_split=tiles, order=None if order_of is None else order_of(lengths))
