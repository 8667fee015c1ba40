"""The work items of the Mosaic GPU GQA kernel: what each program streams, in which order.

An item is one (sequence, kv head [x row block], split) and its tile range. Without a persistent grid a program
has one, its grid position. A persistent program loops over items program, program + P, ... Under the stream-K
plan it walks its equal share of the batch's tiles instead (`plan.StreamKWalk`): each item is a segment, the
part of one sequence's tiles that falls in the share, written to that sequence's piece slot. The producer and
every consumer walk the same items, so the ring runs on across them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.mosaic_gpu.trace import region


@dataclasses.dataclass(frozen=True)
class Sequences:
  """The per-sequence refs: lengths int32 [B] and, where the call has them, window starts int32 [B] and the
  sequence order (batch slot -> sequence) int32 [B]."""
  lengths: Any
  starts: Any = None
  order: Any = None

  def bounds(self, b, st):
    """(length, window start or None) of sequence b, clamped into [0, capacity]."""
    start = None if self.starts is None else jnp.clip(self.starts[b], 0, st.capacity)
    return jnp.clip(self.lengths[b], 0, st.capacity), start


class Share(NamedTuple):
  """A stream-K program's share [lo, hi) of the tiles laid end to end (`size` tiles at most; per_head_block: N,
  the tiles of a head block) and the flat sequences [first, end) it visits; flat sequence `first` starts at
  first_offset in its head block."""
  lo: Any
  hi: Any
  first: Any
  end: Any
  first_offset: Any
  size: Any
  per_head_block: Any


@dataclasses.dataclass(frozen=True)
class WalkRefs:
  """A stream-K plan's vectors as the kernel reads them (`plan.StreamKWalk` made ahead): offsets and longest int32
  [B + 1], each program's flat sequences [first, end) int32 [P]; all None where the kernel plans the walk."""
  offsets: Any = None
  longest: Any = None
  first: Any = None
  end: Any = None

  def program(self, program, sequences: "Sequences", st) -> Share:
    """The program's `Share`: from five scalar loads of the plan's vectors, or computed from the B lengths
    (`plan.kernel_walk`). Either way a sequence's start is then carried along the walk, not loaded."""
    head_blocks = st.num_kv_heads * st.num_row_blocks
    flat_sequences = head_blocks * st.batch
    if self.offsets is None:
      lo, hi, first, end, first_offset, share, per_head_block = split_plan.kernel_walk(
          lambda b: _sequence_tiles(*sequences.bounds(b, st), st), st.batch, program, head_blocks=head_blocks,
          num_programs=st.num_programs, max_pieces=st.num_splits, unroll=st.walk_unroll)
    else:
      per_head_block = self.offsets[st.batch]
      share = split_plan.walk_share(per_head_block, self.longest[0], head_blocks=head_blocks,
                                    num_programs=st.num_programs, max_pieces=st.num_splits)
      lo, hi = split_plan.share_bounds(program, share, head_blocks * per_head_block)
      first, end = self.first[program], self.end[program]
      first_offset = self.offsets[lax.rem(jnp.clip(first, 0, flat_sequences - 1), jnp.int32(st.batch))]
    first = jnp.clip(first, 0, flat_sequences)
    # The last program also takes the empty sequences after the last tile.
    end = jnp.where(program == st.num_programs - 1, flat_sequences, jnp.clip(end, first, flat_sequences))
    return Share(lo, hi, first, end, first_offset, share, per_head_block)


@dataclasses.dataclass(frozen=True)
class Item:
  """One work item: a (batch, kv head [x row block], split) and its tile ranges. fill_from: under stream-K, the
  first piece slot past the sequence's pieces when this segment is its last (else the slot count), else None."""
  b: Any
  head: Any
  row_block: Any
  length: Any
  start: Any
  splits: list[Any]
  ranges: list[tuple[Any, ...]]    # (t0, t1, a, c) per KV group
  fill_from: Any = None
  index: Any = 0            # the item's place in its program's loop
  following: tuple[Any, ...] | None = None   # persistent: (b, head, row block, whether any) of the next item

  @property
  def counts(self) -> list[Any]:
    return [t1 - t0 for t0, t1, _, _ in self.ranges]   # counts[0] >= counts[1]


def _tile_window(st) -> dict:
  return dict(block_kv=st.tiling.block_kv, num_queries=st.num_queries, window=st.options.window)


def _head_of(head_block, st):
  """(kv head, row block) of a head block."""
  if st.num_row_blocks == 1:
    return head_block, 0
  return lax.div(head_block, jnp.int32(st.num_row_blocks)), lax.rem(head_block, jnp.int32(st.num_row_blocks))


def _sequence_of(b, sequences: Sequences, st):
  """The sequence batch slot b takes."""
  if sequences.order is None:
    return b
  return jnp.clip(sequences.order[b], 0, st.batch - 1)   # clamped: a runtime value never addresses past the batch


def _loads_of_slot(slot, sequences: Sequences, st):
  """(sequence, length, window start or None) of batch slot `slot`: an item's scalar loads from GMEM, which a
  persistent program issues ahead so that their latency is off the consumers' path (`for_each_item`)."""
  b = _sequence_of(slot, sequences, st)
  return (b, *sequences.bounds(b, st))


def item_of(b, head_block, program_split, sequences: Sequences, st, tiles_per_split, loaded=None) -> Item:
  """The item of batch slot b, a head block and a split program (kv_groups splits); loaded: slot b's
  `_loads_of_slot`, if already issued."""
  b, length, start = loaded if loaded is not None else _loads_of_slot(b, sequences, st)
  head, row_block = _head_of(head_block, st)
  splits = [program_split * st.kv_groups + g for g in range(st.kv_groups)]
  ranges = [split_plan.split_tile_range(length, split, num_splits=st.num_splits, tiles_per_split=tiles_per_split,
                                        start=start, **_tile_window(st)) for split in splits]
  return Item(b=b, head=head, row_block=row_block, length=length, start=start, splits=splits, ranges=ranges)


def _sequence_tiles(length, start, st):
  """The visible tile count of a sequence of this length and window start: its length in the walk."""
  first_tile, end_tile = split_plan.visible_tiles(length, start=start, **_tile_window(st))
  return jnp.maximum(end_tile - first_tile, 0)


def _loads_of_flat(flat, sequences: Sequences, st):
  """Stream-K: (length, window start or None) of flat sequence `flat`, its sequence b = flat % B: a segment's
  scalar loads, issued a segment ahead by `for_each_item`."""
  return sequences.bounds(lax.rem(flat, jnp.int32(st.batch)), st)


def segment_of(flat, offset, program, share: Share, st, loaded) -> tuple[Item, Any]:
  """Stream-K: the part of flat sequence `flat` (head block flat // B, sequence flat % B), which starts at `offset`
  in its head block, that falls in this program's share; and where flat sequence flat + 1 starts in its head block
  (0 past the last sequence: a head block starts afresh). loaded: its `_loads_of_flat`."""
  head_block, b = lax.div(flat, jnp.int32(st.batch)), lax.rem(flat, jnp.int32(st.batch))
  head, row_block = _head_of(head_block, st)
  length, start = loaded
  first_tile, end_tile = split_plan.visible_tiles(length, start=start, **_tile_window(st))
  seq_start = head_block * share.per_head_block + offset
  seq_end = seq_start + jnp.maximum(end_tile - first_tile, 0)
  seg_lo = jnp.maximum(share.lo, seq_start)
  seg_hi = jnp.maximum(jnp.minimum(share.hi, seq_end), seg_lo)
  # Clamped to the sequence's own tiles: a plan made for other lengths never reads past them.
  t0 = jnp.minimum(first_tile + (seg_lo - seq_start), end_tile)
  t1 = jnp.minimum(t0 + (seg_hi - seg_lo), end_tile)
  a, c = split_plan.unmasked_tiles(length, t0, t1, start=start, **_tile_window(st))
  # Piece j of a sequence is written by the j-th program its tiles meet; an empty sequence's one item by slot 0.
  slot = jnp.where(seq_end > seq_start, program - lax.div(seq_start, share.size), 0)
  slot = jnp.clip(slot, 0, st.num_splits - 1)
  fill_from = jnp.where(seq_end <= share.hi, slot + 1, st.num_splits)
  item = Item(b=b, head=head, row_block=row_block, length=length, start=start, splits=[slot],
              ranges=[(t0, t1, a, c)], fill_from=fill_from)
  return item, jnp.where(b == st.batch - 1, 0, seq_end - head_block * share.per_head_block)


def for_each_item(body, sequences: Sequences, st, tiles_per_split=None, walk: WalkRefs | None = None):
  """Calls body(item, steps_before) -> its step count for each of this program's work items; the ring steps
  (KV group 0's tiles) run on across items. Returns the program's total step count."""
  body = region("item")(body)   # each item a region of the kernel's trace (`trace.KernelTrace`)
  if not st.persistent:
    item = item_of(lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("split"), sequences, st,
                   tiles_per_split)
    return body(item, jnp.int32(0))
  program = lax.axis_index("program")
  if st.stream_k:
    share = walk.program(program, sequences, st)   # once, not per segment
    last = jnp.maximum(share.end - 1, share.first)

    def segment(k, carry):
      steps_before, loaded, offset = carry
      after = share.first + k + 1
      # The next segment's loads, issued now: their latency overlaps this segment's tiles.
      loaded_next = _loads_of_flat(jnp.minimum(after, last), sequences, st)
      item, next_offset = segment_of(share.first + k, offset, program, share, st, loaded)
      head_block, b = lax.div(after, jnp.int32(st.batch)), lax.rem(after, jnp.int32(st.batch))
      item = dataclasses.replace(item, index=k, following=(b, *_head_of(head_block, st), after < share.end))
      return steps_before + body(item, steps_before), loaded_next, next_offset

    first_loads = _loads_of_flat(share.first, sequences, st)
    return lax.fori_loop(0, share.end - share.first, segment, (jnp.int32(0), first_loads, share.first_offset))[0]

  num_heads, num_split_programs, _ = st.grid_shape
  # Items program, program + P, ...; the grid has P <= num_items programs.
  mine = (st.num_items - program + st.num_programs - 1) // st.num_programs

  def position(w):
    """(batch slot, head block, split program) of item w."""
    rest = lax.div(w, jnp.int32(num_heads))
    return (lax.div(rest, jnp.int32(num_split_programs)), lax.rem(w, jnp.int32(num_heads)),
            lax.rem(rest, jnp.int32(num_split_programs)))

  def slot_of(k):   # batch slot of the program's k-th item (clamped past its last)
    return position(jnp.minimum(program + k * st.num_programs, st.num_items - 1))[0]

  def one(k, carry):
    steps_before, loaded, next_b = carry
    w = program + k * st.num_programs
    # Loads issued now, their latency overlapping this item's tiles: the next item's bounds (its sequence came
    # with the item before) and, with a sequence order, the sequence of the item after it.
    loaded_next = (next_b, *sequences.bounds(next_b, st))
    after_next_b = _sequence_of(slot_of(k + 2), sequences, st)
    item = item_of(*position(w), sequences, st, tiles_per_split, loaded=loaded)
    _, head_block, _ = position(jnp.minimum(w + st.num_programs, st.num_items - 1))
    following = (next_b, *_head_of(head_block, st), k + 1 < mine)
    steps = steps_before + body(dataclasses.replace(item, index=k, following=following), steps_before)
    return steps, loaded_next, after_next_b

  first = (jnp.int32(0), _loads_of_slot(slot_of(0), sequences, st), _sequence_of(slot_of(1), sequences, st))
  return lax.fori_loop(0, mine, one, first)[0]


def fill_unused_slots(item: Item, neg_inf, lse_ref, st) -> None:
  """Stream-K, from the producer: lse -inf into the piece slots past a sequence's pieces, by the segment that
  ends it, so that the merge skips them (no other program writes them). neg_inf: SMEM f32 [rows per program]
  holding -inf, committed."""
  if st.num_row_blocks == 1:
    rows, first_row = st.lse_rows, 0
  else:
    rows, first_row = st.rows_per_program, item.row_block * st.rows_per_program
  for slot in range(1, st.num_splits):
    @pl.when(slot >= item.fill_from)
    def _():
      plgpu.copy_smem_to_gmem(neg_inf.at[pl.ds(0, rows)],
                              lse_ref.at[item.b, item.head, slot, pl.ds(first_row, rows)])


def check_stream_k(plan, config, options, num_programs) -> None:
  """Raises unless a stream-K plan and config agree: the plan's walk (`plan.make_plan(..., walked=True)`) sets the
  persistent program count. plan: a `plan.SplitPlan`; config: a `MosaicGPUConfig`; options: `AttentionOptions`."""
  if not plan.stream_k:
    return
  if plan.walk is None or config.split_plan != "stream_k" or not config.persistent:
    raise ValueError(f"the mosaic_gpu GQA kernel walks a stream-K plan with persistent programs: it needs a config "
                     f"with split_plan='stream_k' and persistent=True and a plan made for it (plan.make_plan(..., "
                     f"walked=True)), got {config} and a plan {'without' if plan.walk is None else 'with'} a walk")
  if num_programs is not None and num_programs != plan.walk.num_programs:
    raise ValueError(f"{num_programs=} differs from the stream-K plan's {plan.walk.num_programs} programs")
  if options.has_window_start:
    raise NotImplementedError("mosaic_gpu: split_plan='stream_k' with window_start (the plan is made from the "
                              "lengths alone); use split_plan='per_sequence'")
