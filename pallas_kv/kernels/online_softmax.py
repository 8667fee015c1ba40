"""The masked online-softmax math both kernel bodies run per KV tile, in float32.

Plain `jnp`/`lax` on register values, written so that it lowers on both backends: row vectors
are broadcast with `lax.broadcast_in_dim` (Mosaic GPU keeps WGMMA layouts through it, where
`x[:, None]` would need a reshape it cannot lay out), and the caller supplies the row and column
indices in whatever layout its backend needs. Logits are kept in log2 units so that exp2 (one
MUFU instruction) does the exponentials.

Per tile, with s the raw scores q.k of the tile:
    s = log2_logits(s, ...)
    s = jnp.where(visible(rows, cols, ...), s, -inf)      # head / tail tiles only
    acc, m, l, p = softmax_step(s, acc, m, l)              # then acc += p @ v
and after the last tile: out, lse = finalize(acc, m, l).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def per_row(x, shape, rows_axis: int = 0):
  """Row vector [rows] broadcast to `shape` [rows, cols] (or [cols, rows] with rows_axis=1)."""
  return lax.broadcast_in_dim(x, shape, [rows_axis])


def log2_logits(s, *, scale: float, softcap: float | None):
  """scale * s, then softcap * tanh(. / softcap) if softcap; in log2 units (times log2 e)."""
  if softcap is not None:
    return jnp.tanh(s * (scale / softcap)) * (softcap * LOG2E)
  return s * (scale * LOG2E)


def visible(rows, cols, *, tile_start, length, num_queries: int, group: int, window: int | None):
  """Whether packed row `rows` sees key `tile_start + cols` (broadcastable int32 arrays).

  Row r is new token s_r = r // G at position p = L - S + s_r; it sees keys t <= p and, with a
  window, t > p - window. With x = t - (L - S):  t <= p  <=>  x * G <= r  and
  t > p - window  <=>  r < (x + window) * G  (integer math, no division in the kernel).
  Keys at or past L are never visible: x * G > r for every row there.
  """
  x_g = (cols + (tile_start - length + num_queries)) * group
  ok = x_g <= rows
  if window is not None:
    ok = ok & (rows < x_g + window * group)
  return ok


def rescale_step(s, m_i, l_i, tile_max=None, *, rows_axis: int = 0):
  """One tile of the online softmax, leaving the accumulator to the caller.

  s: [rows, bkv] float32 logits in log2 units (-inf where masked), or [bkv, rows] with
  rows_axis=1 (a transposed tile); m_i, l_i: [rows] running max (log2 units) and sum. tile_max:
  the tile's row max when s is only part of the tile (default s's own); l_new then sums only s's
  part. Returns (alpha [rows], the factor that rescales an accumulator to the new max, m_new,
  l_new, p float32 shaped as s).
  """
  keys_axis = 1 - rows_axis
  m_new = jnp.maximum(m_i, s.max(axis=keys_axis) if tile_max is None else tile_max)
  # A row with no valid key yet keeps m = -inf: shift by 0 then, so that exp2 gives 0, not NaN.
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s - per_row(m_use, s.shape, rows_axis))
  return alpha, m_new, l_i * alpha + p.sum(axis=keys_axis), p


def softmax_step(s, acc, m_i, l_i):
  """`rescale_step` with acc [rows, Dv] float32 rescaled: (acc, m_new, l_new, p); the caller adds
  p @ v to the returned acc."""
  alpha, m_new, l_new, p = rescale_step(s, m_i, l_i)
  return acc * per_row(alpha, acc.shape), m_new, l_new, p


def finalize(acc, m_i, l_i, *, rows_axis: int = 0):
  """(out = acc / l, natural-log lse) of one split; a row that saw no key gives 0 and -inf.
  acc is [rows, Dv], or [Dv, rows] with rows_axis=1."""
  has_keys = l_i > 0
  l_safe = jnp.where(has_keys, l_i, 1.0)
  out = acc / per_row(l_safe, acc.shape, rows_axis)
  lse = jnp.where(has_keys, m_i * LN2 + jnp.log(l_safe), -jnp.inf)
  return out, lse
