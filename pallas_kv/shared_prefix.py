"""Shared prefixes: sequences whose block tables start with the same pages read those pages once.

A batch of forked sequences (parallel sampling, RL rollouts, a common system prompt) holds, per
group, one run of pages that every member's block table starts with. Attention splits at the end of
that run (FlashInfer's cascade):
  - the prefix pass stacks the group's queries as extra q heads of one sequence per group and
    attends over the shared pages: one wider GQA call that reads the prefix once;
  - the suffix pass attends each sequence over its own pages, the block table shifted past the
    shared ones;
  - the two merge by their log-sum-exps.
Every new token sits past the prefix, so the prefix pass needs no causal mask. Sinks join the
softmax once, in the merge (the passes' LSEs count real keys only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kv.cache import UNALLOCATED
from pallas_kv import online_softmax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """Which sequences of a paged batch share their first pages.

  members: int32 [G, N], group g's sequences (batch rows); -1 marks an empty slot.
  num_pages: int32 [G], pages at the start of every member's block table that the group shares.

  A sequence belongs to at most one group; sequences in no group attend alone. Where a member's
  new tokens would fall inside the shared pages, the group shares only the pages before them.
  """
  members: jax.Array
  num_pages: jax.Array


def from_tables(block_tables, lengths, *, page_size: int, max_groups: int, max_members: int) -> SharedPrefix:
  """The groups that `block_tables` shows: sequences whose tables start with the same page share every
  leading page their tables agree on (below both lengths). Found by comparing tables, so the grouping can
  never claim a page a member does not hold. A group's leader is its lowest row; groups past max_groups
  and members past max_members attend alone (the result is the same, read without sharing)."""
  batch, width = block_tables.shape
  held = (jnp.maximum(lengths.astype(jnp.int32), 0) + page_size - 1) // page_size
  column = jnp.arange(width, dtype=jnp.int32)
  owned = column[None, :] < held[:, None]                                            # [B, M]
  first = jnp.where(held > 0, block_tables[:, 0], UNALLOCATED)
  same_first = (first[:, None] == first[None, :]) & (first[:, None] >= 0)            # [B, B]
  leader = jnp.argmax(same_first, axis=1).astype(jnp.int32)                          # lowest row, or itself
  agree = (block_tables == block_tables[leader]) & owned & owned[leader]
  common = jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)            # leading pages in common
  rows = jnp.arange(batch, dtype=jnp.int32)
  in_group = (held > 0) & (jnp.sum(same_first, axis=1) > 1)
  is_leader = in_group & (leader == rows)
  group = jnp.cumsum(is_leader) - 1                                                  # of each leader row
  group_of = jnp.where(in_group, group[leader], max_groups)                          # out of range: alone
  slot = jnp.sum(same_first & (rows[None, :] < rows[:, None]), axis=1)               # rank among its group
  keep = (group_of < max_groups) & (slot < max_members)
  members = jnp.full((max_groups, max_members), -1, jnp.int32).at[
      jnp.where(keep, group_of, max_groups), jnp.where(keep, slot, max_members)].set(rows, mode="drop")
  num_pages = jnp.full((max_groups,), width, jnp.int32).at[jnp.where(keep, group_of, max_groups)].min(
      common, mode="drop")
  return SharedPrefix(members, jnp.where(jnp.any(members >= 0, axis=1), num_pages, 0))


def check(sharing) -> None:
  """Raises, naming the field, where `sharing` is not a SharedPrefix of int [G, N] members and [G] pages."""
  if not isinstance(sharing, SharedPrefix):
    raise TypeError(f"shared_prefix must be a pallas_kv.SharedPrefix, got {type(sharing).__name__}")
  members, num_pages = sharing.members, sharing.num_pages
  if members.ndim != 2 or num_pages.ndim != 1 or members.shape[0] != num_pages.shape[0]:
    raise ValueError(f"SharedPrefix: members must be [G, N] and num_pages [G]; got members.shape="
                     f"{tuple(members.shape)}, num_pages.shape={tuple(num_pages.shape)}")
  for name, x in (("members", members), ("num_pages", num_pages)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"SharedPrefix.{name} must be an integer array (int32); got dtype {jnp.dtype(x.dtype).name}")


def _shared_pages(sharing: SharedPrefix, lengths, num_queries: int, page_size: int):
  """(pages group g shares [G], pages sequence b's table skips in the suffix pass [B], member mask [G, N])."""
  batch = lengths.shape[0]
  members = sharing.members.astype(jnp.int32)
  present = (members >= 0) & (members < batch)
  rows = jnp.clip(members, 0, batch - 1)
  # Pages wholly before every member's first new token: the new tokens stay in the suffix pass.
  before_new = jnp.maximum(lengths[rows] - num_queries, 0) // page_size
  limit = jnp.min(jnp.where(present, before_new, jnp.iinfo(jnp.int32).max), axis=1)
  pages = jnp.clip(sharing.num_pages.astype(jnp.int32), 0, limit)
  pages = jnp.where(jnp.any(present, axis=1), pages, 0)
  skip = jnp.zeros((batch,), jnp.int32).at[jnp.where(present, members, batch)].set(
      jnp.broadcast_to(pages[:, None], members.shape), mode="drop")
  return pages, skip, present


def _shift_tables(block_tables, skip):
  """Each row of block_tables moved left by skip[b] entries, UNALLOCATED after its end."""
  width = block_tables.shape[1]
  column = skip[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
  shifted = jnp.take_along_axis(block_tables, jnp.clip(column, 0, width - 1), axis=1)
  return jnp.where(column < width, shifted, UNALLOCATED)


def _chunks(num_members: int, rows_per_member: int, max_rows: int | None) -> int:
  """Members stacked per prefix-pass sequence: all of them, or as many as max_rows q heads per kv head allow."""
  if max_rows is None:
    return num_members
  return max(1, min(num_members, max_rows // rows_per_member))


def attend(attend_fn, q, block_tables, lengths, sharing: SharedPrefix, *, page_size: int, num_kv_heads: int,
           return_lse: bool, max_group: int | None, sinks=None):
  """The cascade over `sharing`'s groups. attend_fn(q, block_tables, lengths) is the plain paged op, without
  sinks, returning (out, lse); q is [B, (S,) Hq, D]; sinks [Hq] or None. max_group: the most q heads per kv
  head the backend takes (the prefix pass stacks a group's members as heads, in chunks that fit)."""
  squeeze = q.ndim == 3
  q4 = q[:, None] if squeeze else q
  batch, num_queries, num_heads, head_dim = q4.shape
  per_kv = num_heads // num_kv_heads
  # Clamped as the ops clamp them, so that no suffix runs past its shifted table's real pages.
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, block_tables.shape[1] * page_size)
  pages, skip, present = _shared_pages(sharing, lengths, num_queries, page_size)

  # Prefix pass: [G, N] members -> [G * C, chunk] pseudo-sequences, their queries stacked per kv head.
  num_groups, num_members = sharing.members.shape
  chunk = _chunks(num_members, num_queries * per_kv, max_group)
  num_chunks = -(-num_members // chunk)
  pad = num_chunks * chunk - num_members
  members = jnp.pad(jnp.where(present, sharing.members, -1), ((0, 0), (0, pad)), constant_values=-1)
  members = members.reshape(num_groups * num_chunks, chunk)
  chunk_present = members >= 0
  rows = jnp.clip(members, 0, batch - 1)
  chunk_pages = jnp.repeat(pages, num_chunks)
  first = rows[jnp.arange(rows.shape[0]), jnp.argmax(chunk_present, axis=1)]
  stacked = q4[rows].reshape(*rows.shape, num_queries, num_kv_heads, per_kv, head_dim)
  stacked = jnp.moveaxis(stacked, 3, 1).reshape(rows.shape[0], -1, head_dim)   # heads [Hkv, chunk, S, per_kv]
  prefix_lengths = jnp.where(jnp.any(chunk_present, axis=1), chunk_pages * page_size, 0)
  out_p, lse_p = attend_fn(stacked, block_tables[first], prefix_lengths)

  def unstack(x):   # [G * C, Hkv * chunk * S * per_kv, ...] -> [G * C, chunk, S, Hq, ...]
    x = x.reshape(rows.shape[0], num_kv_heads, chunk, num_queries, per_kv, *x.shape[2:])
    return jnp.moveaxis(x, 1, 3).reshape(*rows.shape, num_queries, num_heads, *x.shape[5:])

  target = jnp.where(chunk_present, members, batch)   # out of range: dropped
  out_prefix = jnp.zeros((batch, num_queries, num_heads, out_p.shape[-1]), out_p.dtype).at[target].set(
      unstack(out_p), mode="drop")
  lse_prefix = jnp.full((batch, num_queries, num_heads), -jnp.inf, jnp.float32).at[target].set(
      unstack(lse_p), mode="drop")

  # Suffix pass: each sequence over its own pages, its table shifted past the shared ones.
  out_s, lse_s = attend_fn(q4, _shift_tables(block_tables, skip), lengths - skip * page_size)

  out, lse = merge(out_prefix, lse_prefix, out_s, lse_s, dtype=q.dtype, sinks=sinks)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


def merge(out_a, lse_a, out_b, lse_b, *, dtype, sinks=None):
  """Two attentions over disjoint keys, each normalized over its own keys, as one: weights exp(lse), and
  exp(sinks[h]) more in each head's denominator (a virtual key with no value). The LSE counts real keys."""
  out, lse = online_softmax.merge_pair(out_a.astype(jnp.float32), lse_a.astype(jnp.float32),
                                       out_b.astype(jnp.float32), lse_b.astype(jnp.float32),
                                       sinks=None if sinks is None else sinks.astype(jnp.float32))
  return out.astype(dtype), lse
