"""The varlen query form: q [total, Hq, D] with cu_seqlens_q [B + 1], sequence b's new tokens in rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (vLLM's and flash-attn's layout for mixed decode batches and
speculative decoding with per-request draft lengths).

The ops run it as the padded form [B, S, Hq, D], S = max_seqlen_q: sequence b's n_b tokens go right-aligned
into slots S - n_b .. S - 1, which the padded form places at positions lengths[b] - n_b .. lengths[b] - 1, as
the varlen form means. The kernels read each sequence's K/V once whatever S is; the padded slots cost only
their rows of math and are dropped on the way back."""

from __future__ import annotations

import numbers

import jax.numpy as jnp

from pallas_kv import validation


def check(q, cu_seqlens_q, max_seqlen_q) -> tuple[int, int]:
  """Checks the varlen arguments; returns (B, S), S the padded form's new tokens per sequence."""
  if q.ndim != 3:
    raise ValueError(f"with cu_seqlens_q, q must be [total_tokens, Hq, D]; got q.shape={tuple(q.shape)}")
  if not hasattr(cu_seqlens_q, "shape") or cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape[0] < 2:
    raise ValueError(f"cu_seqlens_q must be an int32 array [B + 1] with B >= 1; got "
                     f"{getattr(cu_seqlens_q, 'shape', type(cu_seqlens_q).__name__)}")
  if not jnp.issubdtype(cu_seqlens_q.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens_q must be an integer array (int32); got dtype {jnp.dtype(cu_seqlens_q.dtype).name}")
  total = q.shape[0]
  if max_seqlen_q is None:
    max_seqlen_q = min(validation.MAX_NEW_TOKENS, max(total, 1))
  if (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, numbers.Integral)
      or not 1 <= max_seqlen_q <= validation.MAX_NEW_TOKENS):
    raise ValueError(f"max_seqlen_q must be a Python int in [1, {validation.MAX_NEW_TOKENS}] (the most new "
                     f"tokens of a sequence); got {max_seqlen_q!r}")
  return cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)


def _slots(cu_seqlens_q, num_queries: int):
  """(first row of each sequence's slot 0 [B, 1]: row of slot s is first + s; tokens per sequence [B, 1])."""
  cu = cu_seqlens_q.astype(jnp.int32)
  count = (cu[1:] - cu[:-1])[:, None]
  return cu[1:, None] - num_queries, count


def to_padded(q, cu_seqlens_q, num_queries: int):
  """q [total, Hq, D] -> [B, S, Hq, D], each sequence's tokens right-aligned, zeros before them."""
  first, count = _slots(cu_seqlens_q, num_queries)
  slot = jnp.arange(num_queries, dtype=jnp.int32)[None, :]
  row = first + slot
  real = (slot >= num_queries - count) & (row >= 0) & (row < q.shape[0])
  padded = q[jnp.clip(row, 0, max(q.shape[0] - 1, 0))]
  return jnp.where(real[..., None, None], padded, jnp.zeros((), q.dtype))


def token_positions(cu_seqlens_q, total: int):
  """(sequence [total], index among its sequence's new tokens [total]) of each varlen row."""
  cu = cu_seqlens_q.astype(jnp.int32)
  token = jnp.arange(total, dtype=jnp.int32)
  # compare_all: the default scan method is a while loop, which on a GPU syncs with the host each step.
  seq = jnp.searchsorted(cu[1:], token, side="right", method="compare_all")
  seq = jnp.clip(seq, 0, cu.shape[0] - 2).astype(jnp.int32)
  return seq, token - cu[seq]


def to_left_aligned(x, cu_seqlens_q, num_queries: int):
  """x [total, ...] -> [B, S, ...], each sequence's tokens first, zeros after them: the right-padded form
  that a cache's append takes with num_new = the counts."""
  cu = cu_seqlens_q.astype(jnp.int32)
  slot = jnp.arange(num_queries, dtype=jnp.int32)[None, :]
  row = cu[:-1, None] + slot
  real = (row < cu[1:, None]) & (row < x.shape[0])
  rows = x[jnp.clip(row, 0, max(x.shape[0] - 1, 0))]
  return jnp.where(real.reshape(*real.shape, *(1,) * (x.ndim - 1)), rows, jnp.zeros((), x.dtype))


def from_padded(x, cu_seqlens_q, total: int, *, fill=0.0):
  """x [B, S, ...] (the padded form's out or lse) -> [total, ...]: each token's row from its slot. A token
  no slot holds (its sequence has more than S tokens, or cu_seqlens_q is not a valid prefix sum) gets
  `fill` (-inf for an LSE)."""
  num_queries = x.shape[1]
  cu = cu_seqlens_q.astype(jnp.int32)
  seq, index = token_positions(cu, total)
  slot = index - (cu[seq + 1] - cu[seq]) + num_queries
  held = (slot >= 0) & (slot < num_queries) & (index >= 0)
  rows = x[seq, jnp.clip(slot, 0, num_queries - 1)]
  return jnp.where(held.reshape(-1, *(1,) * (rows.ndim - 1)), rows, jnp.asarray(fill, x.dtype))


def counts_fit(cu_seqlens_q, num_queries: int, total: int):
  """Whether cu_seqlens_q is a valid prefix sum from 0 to total with at most num_queries tokens a sequence
  (a scalar bool array, for checked mode)."""
  cu = cu_seqlens_q.astype(jnp.int32)
  count = cu[1:] - cu[:-1]
  return (cu[0] == 0) & (cu[-1] == total) & jnp.all((count >= 0) & (count <= num_queries))
