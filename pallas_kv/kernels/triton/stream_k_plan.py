"""The stream-K plan's layout of a batch's tiles (`TritonConfig(split_plan="stream_k")`): which
program streams which tiles, and where a sequence cut across programs leaves its pieces. Planned
inside the kernel from `lengths`, so nothing launches before it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kv.kernels import plan

@dataclasses.dataclass(frozen=True)
class StreamKLayout:
  """One call's stream-K plan over the batch's visible tiles, laid end to end in batch order
  (sequence b's tiles occupy [ends[b] - tiles[b], ends[b])); program w of a (kv head, row block)
  streams [w * chunk, (w + 1) * chunk) of them, crossing sequence boundaries. Vectors are [B'],
  B' >= B (padding sequences have no tiles); every field is a traced int32 value, so the same
  code plans in the kernel and in tests."""
  first: object    # [B'] first visible tile of each sequence
  tiles: object    # [B'] visible tiles of each sequence
  ends: object     # [B'] inclusive running sum of tiles
  chunk: object    # scalar: tiles per program (>= 1)
  total: object    # scalar: the batch's visible tiles

  @classmethod
  def of(cls, lengths, *, block_kv: int, num_queries: int, window: int | None, num_programs: int):
    """The plan of lengths [B'] (already clamped into [0, capacity]) for num_programs programs."""
    first, end = plan.visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
    tiles = jnp.maximum(end - first, 0).astype(jnp.int32)
    total = jnp.sum(tiles)
    first = jnp.broadcast_to(first, tiles.shape).astype(jnp.int32)   # 0 (an int) without a window
    return cls(first=first, tiles=tiles, ends=jnp.cumsum(tiles).astype(jnp.int32),
               chunk=jnp.maximum(plan.cdiv(total, num_programs), 1), total=total)

  def program_range(self, w):
    """Program w's tiles [lo, hi) in the batch's tile order."""
    lo = jnp.minimum(w * self.chunk, self.total)
    return lo, jnp.minimum(lo + self.chunk, self.total)

  def locate(self, g):
    """(b, start) of batch tile g < total: the sequence that holds it and the position of that
    sequence's first tile in the batch's tile order. Two reductions over [B'] and no pick, so
    that the stream-K kernel's tile loop finds each tile's sequence from the tile alone."""
    before = self.ends <= g   # sequences wholly before g (empty ones too)
    return jnp.sum(before.astype(jnp.int32)), jnp.sum(jnp.where(before, self.tiles, 0))

  def pieces(self, b):
    """(the first program holding sequence b's tiles, how many programs do, whether the first
    program's piece starts mid-chunk). A sequence without tiles has 0 pieces."""
    seq_end = pick(self.ends, b)
    return self.pieces_of_span(seq_end - pick(self.tiles, b), seq_end)

  def pieces_of_span(self, seq_start, seq_end):
    """`pieces` of the sequence whose tiles are [seq_start, seq_end) in the batch's tile order."""
    first_program = seq_start // self.chunk
    last_program = (seq_end - 1) // self.chunk
    count = jnp.where(seq_end > seq_start, last_program - first_program + 1, 0)
    return first_program, count, seq_start != first_program * self.chunk

  @staticmethod
  def piece_slot(starts_mid_chunk, is_first_piece):
    """Where a piece's partial goes among its program's two slots: 0 for a piece that starts at
    its program's chunk start (a program's first segment), 1 for one that starts inside it (its
    last segment, continued by the next program). Only the first piece of a sequence can start
    inside a chunk, so a program never needs a third slot."""
    return jnp.where(is_first_piece & starts_mid_chunk, 1, 0)


def pick(vector, index):
  """vector[index] for a traced index, as a masked sum (a Pallas Triton kernel cannot index a
  value it holds in registers)."""
  hit = jnp.arange(vector.shape[0], dtype=jnp.int32) == index
  return jnp.sum(jnp.where(hit, vector, jnp.zeros_like(vector)))
