"""The stream-K plan's layout of a batch's tiles: which program streams which tiles, and where a sequence
cut across programs leaves its pieces. Planned inside the kernel from `lengths`, so nothing launches before it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kv.kernels import plan

@dataclasses.dataclass(frozen=True)
class StreamKLayout:
  """The batch's visible tiles end to end (sequence b's at [ends[b] - tiles[b], ends[b])); program w streams
  [w * chunk, (w + 1) * chunk). Traced int32 fields, [B'] vectors with B' >= B (padding has no tiles)."""
  first: object
  tiles: object
  ends: object     # inclusive running sum of tiles
  chunk: object    # tiles per program (>= 1)
  total: object

  @classmethod
  def of(cls, lengths, *, block_kv: int, num_queries: int, window: int | None, num_programs: int, start=None):
    first, end = plan.visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window,
                                    start=start)
    tiles = jnp.maximum(end - first, 0).astype(jnp.int32)
    total = jnp.sum(tiles)
    first = jnp.broadcast_to(first, tiles.shape).astype(jnp.int32)   # 0 (an int) without a window
    return cls(first=first, tiles=tiles, ends=jnp.cumsum(tiles).astype(jnp.int32),
               chunk=jnp.maximum(plan.cdiv(total, num_programs), 1), total=total)

  def program_range(self, w):
    lo = jnp.minimum(w * self.chunk, self.total)
    return lo, jnp.minimum(lo + self.chunk, self.total)

  def locate(self, g):
    """(b, start) of batch tile g < total: its sequence and that sequence's first tile, in two reductions."""
    before = self.ends <= g
    return jnp.sum(before.astype(jnp.int32)), jnp.sum(jnp.where(before, self.tiles, 0))

  def pieces(self, b):
    """(first program holding sequence b's tiles, how many do (0 without tiles), whether it starts mid-chunk)."""
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
    """A piece's slot: 1 for a sequence's first piece starting mid-chunk (no other can), else 0: two suffice."""
    return jnp.where(is_first_piece & starts_mid_chunk, 1, 0)


def pick(vector, index):
  """vector[index] as a masked sum: a Pallas Triton kernel cannot index a value in registers."""
  hit = jnp.arange(vector.shape[0], dtype=jnp.int32) == index
  return jnp.sum(jnp.where(hit, vector, jnp.zeros_like(vector)))
