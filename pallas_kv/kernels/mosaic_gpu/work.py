"""The work items of the Mosaic GPU GQA kernel: what each program streams, in which order.

An item is one (sequence, kv head [x row block], split) and its tile range. Without a persistent grid a program
has one, its grid position. A persistent program loops over items program, program + P, ... Under the stream-K
plan it walks its equal share of the batch's tiles instead (`plan.StreamKWalk`): each item is a segment, the
part of one sequence's tiles that falls in the share, written to that sequence's piece slot. The producer and
every consumer walk the same items, so the ring runs on across them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels import plan as split_plan


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


@dataclasses.dataclass(frozen=True)
class WalkRefs:
  """A stream-K plan's vectors as the kernel reads them (`plan.StreamKWalk`): offsets and longest int32 [B + 1],
  each program's flat sequences [first, end) int32 [P]."""
  offsets: Any
  longest: Any
  first: Any
  end: Any

  def program(self, program, st):
    """(lo, hi, first, end, share, per_head_block): the program's share [lo, hi) of the tiles, the flat sequences
    it visits and its share's size (`plan.walk_share`, as the plan computed it), from four scalar loads."""
    head_blocks = st.num_kv_heads * st.num_row_blocks
    flat_sequences = head_blocks * st.batch
    per_head_block = self.offsets[st.batch]
    share = split_plan.walk_share(per_head_block, self.longest[0], head_blocks=head_blocks,
                                  num_programs=st.num_programs, max_pieces=st.num_splits)
    lo, hi = split_plan.share_bounds(program, share, head_blocks * per_head_block)
    first = jnp.clip(self.first[program], 0, flat_sequences)
    # The last program also takes the empty sequences after the last tile.
    end = jnp.where(program == st.num_programs - 1, flat_sequences, jnp.clip(self.end[program], first, flat_sequences))
    return lo, hi, first, end, share, per_head_block


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


def _loads_of_flat(flat, sequences: Sequences, walk: WalkRefs, st):
  """Stream-K: (offsets[b], offsets[b + 1], length, window start or None) of flat sequence `flat`, its sequence
  b = flat % B: a segment's scalar loads, issued a segment ahead by `for_each_item`."""
  b = lax.rem(flat, jnp.int32(st.batch))
  return (walk.offsets[b], walk.offsets[b + 1], *sequences.bounds(b, st))


def segment_of(flat, program, lo, hi, share, per_head_block, sequences: Sequences, walk: WalkRefs, st,
               loaded=None) -> Item:
  """Stream-K: the part of flat sequence `flat` (head block flat // B, sequence flat % B) that falls in this
  program's share [lo, hi) of the tiles laid end to end (per_head_block = walk.offsets[B] tiles a head block),
  and its piece slot; loaded: its `_loads_of_flat`, if already issued."""
  head_block, b = lax.div(flat, jnp.int32(st.batch)), lax.rem(flat, jnp.int32(st.batch))
  head, row_block = _head_of(head_block, st)
  offset, next_offset, length, start = loaded if loaded is not None else _loads_of_flat(flat, sequences, walk, st)
  seq_start = head_block * per_head_block + offset
  seq_end = head_block * per_head_block + next_offset
  first_tile, end_tile = split_plan.visible_tiles(length, start=start, **_tile_window(st))
  seg_lo = jnp.maximum(lo, seq_start)
  seg_hi = jnp.maximum(jnp.minimum(hi, seq_end), seg_lo)
  # Clamped to the sequence's own tiles: a plan made for other lengths never reads past them.
  t0 = jnp.minimum(first_tile + (seg_lo - seq_start), end_tile)
  t1 = jnp.minimum(t0 + (seg_hi - seg_lo), end_tile)
  a, c = split_plan.unmasked_tiles(length, t0, t1, start=start, **_tile_window(st))
  # Piece j of a sequence is written by the j-th program its tiles meet; an empty sequence's one item by slot 0.
  slot = jnp.where(seq_end > seq_start, program - lax.div(seq_start, share), 0)
  slot = jnp.clip(slot, 0, st.num_splits - 1)
  fill_from = jnp.where(seq_end <= hi, slot + 1, st.num_splits)
  return Item(b=b, head=head, row_block=row_block, length=length, start=start, splits=[slot],
              ranges=[(t0, t1, a, c)], fill_from=fill_from)


def for_each_item(body, sequences: Sequences, st, tiles_per_split=None, walk: WalkRefs | None = None):
  """Calls body(item, steps_before) -> its step count for each of this program's work items; the ring steps
  (KV group 0's tiles) run on across items. Returns the program's total step count."""
  if not st.persistent:
    item = item_of(lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("split"), sequences, st,
                   tiles_per_split)
    return body(item, jnp.int32(0))
  program = lax.axis_index("program")
  if st.stream_k:
    lo, hi, first, end, share, per_head_block = walk.program(program, st)   # loaded once, not per segment

    last = jnp.maximum(end - 1, first)

    def segment(k, carry):
      steps_before, loaded = carry
      after = first + k + 1
      # The next segment's loads, issued now: their latency overlaps this segment's tiles.
      loaded_next = _loads_of_flat(jnp.minimum(after, last), sequences, walk, st)
      item = segment_of(first + k, program, lo, hi, share, per_head_block, sequences, walk, st, loaded=loaded)
      head_block, b = lax.div(after, jnp.int32(st.batch)), lax.rem(after, jnp.int32(st.batch))
      item = dataclasses.replace(item, index=k, following=(b, *_head_of(head_block, st), after < end))
      return steps_before + body(item, steps_before), loaded_next

    first_loads = _loads_of_flat(first, sequences, walk, st)
    return lax.fori_loop(0, end - first, segment, (jnp.int32(0), first_loads))[0]

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
