"""The masked online-softmax math both kernel bodies run per KV tile, in float32 `jnp`/`lax`.

Rows broadcast with `lax.broadcast_in_dim`, through which Mosaic GPU keeps WGMMA layouts; logits are in log2
units so that exp2 (one MUFU op) does the exponentials. Per tile: `log2_logits`, `visible` (edge tiles only),
`softmax_step`, acc += p @ v; after the last, `finalize`."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Where a value scale goes into P, the kernels divide P by c, the running max of the scales a row has met, so that
# P's 16-bit operand stays within [0, 1] (`rescale_step`'s log2_units); c starts at this floor, so that a row that
# has seen no key keeps P = 0 and acc = 0, never 0 / 0.
MIN_VALUE_SCALE = 1e-30


def per_row(x, shape, rows_axis: int = 0):
  """Row vector [rows] broadcast to `shape` [rows, cols] (or [cols, rows] with rows_axis=1)."""
  return lax.broadcast_in_dim(x, shape, [rows_axis])


def log2_logits(s, *, scale: float, softcap: float | None):
  """scale * s, then softcap * tanh(. / softcap) if softcap; in log2 units (times log2 e)."""
  return log2_logits_prescaled(s * logit_factor(scale, softcap), softcap=softcap)


def logit_factor(scale: float, softcap: float | None) -> float:
  """What `log2_logits` multiplies s by first (a kernel may fold it into a factor it applies anyway)."""
  return scale / softcap if softcap is not None else scale * LOG2E


def log2_logits_prescaled(t, *, softcap: float | None):
  """`log2_logits` of s, given t = s * logit_factor(scale, softcap)."""
  return jnp.tanh(t) * (softcap * LOG2E) if softcap is not None else t


def visible(rows, cols, *, tile_start, length, num_queries: int, group: int, window: int | None, start=None):
  """Whether packed row `rows` sees key `tile_start + cols` (broadcastable int32 arrays). Row r (at
  p = L - S + r // G) sees p - window < t <= p, i.e. with x = t - (L - S), x * G <= r < (x + window) * G;
  given a traced start (the sequence's window start), only keys t >= start."""
  x_g = (cols + (tile_start - length + num_queries)) * group
  ok = x_g <= rows
  if window is not None:
    ok = ok & (rows < x_g + window * group)
  if start is not None:
    ok = ok & (cols >= start - tile_start)
  return ok


def rescale_step(s, m_i, l_i, tile_max=None, *, rows_axis: int = 0, log2_units=None):
  """One tile of the online softmax, leaving the accumulator to the caller: s [rows, bkv] float32 log2-unit
  logits (-inf where masked; [bkv, rows] with rows_axis=1); m_i, l_i [rows] running max and sum; tile_max: the
  tile's row max when s is part of it; log2_units: (before, now) [rows], log2 of a growing per-row c that P is
  divided by (P / c: l and the accumulator kept in units of 1 / c), or None. Returns (alpha [rows], the
  accumulator's rescale; m_new; l_new; p)."""
  keys_axis = 1 - rows_axis
  m_new = jnp.maximum(m_i, s.max(axis=keys_axis) if tile_max is None else tile_max)
  m_old, shift = (m_i, m_new) if log2_units is None else (m_i + log2_units[0], m_new + log2_units[1])
  # A row with no key yet keeps m = -inf: shift by 0 so that exp2 gives 0, not NaN.
  m_use = jnp.where(m_new == -jnp.inf, 0.0, shift)
  alpha = jnp.exp2(m_old - m_use)
  p = jnp.exp2(s - per_row(m_use, s.shape, rows_axis))
  return alpha, m_new, l_i * alpha + p.sum(axis=keys_axis), p


def softmax_step(s, acc, m_i, l_i):
  """`rescale_step` that also rescales acc [rows, Dv] float32: (acc, m_new, l_new, p); the caller adds p @ v."""
  alpha, m_new, l_new, p = rescale_step(s, m_i, l_i)
  return acc * per_row(alpha, acc.shape), m_new, l_new, p


def times_key_scales(p, key_scales, *, masked: bool = True, keys_axis: int = 1):
  """P [rows, bkv] (keys_axis 0: P^T [bkv, rows]) times each key's scale (key_scales [bkv], None: P as it is). In a
  masked tile a masked key's p is 0 and stays 0 whatever scale lies past the length (inf or NaN there); an unmasked
  tile needs no select."""
  if key_scales is None:
    return p
  scaled = p * lax.broadcast_in_dim(key_scales, p.shape, [keys_axis])
  return jnp.where(p > 0, scaled, 0.0) if masked else scaled


def finalize(acc, m_i, l_i, *, rows_axis: int = 0, reciprocal: bool = False):
  """(acc / l, natural-log lse) of acc [rows, Dv] ([Dv, rows] with rows_axis=1); 0 and -inf for keyless rows.
  reciprocal: acc times each row's 1 / l (Mosaic GPU lowers a division to a full divide per element)."""
  has_keys = l_i > 0
  l_safe = jnp.where(has_keys, l_i, 1.0)
  if reciprocal:
    out = acc * per_row(1.0 / l_safe, acc.shape, rows_axis)
  else:
    out = acc / per_row(l_safe, acc.shape, rows_axis)
  lse = jnp.where(has_keys, m_i * LN2 + jnp.log(l_safe), -jnp.inf)
  return out, lse


def merge_pair(out_a, lse_a, out_b, lse_b, *, sinks=None):
  """Two partials over disjoint keys, each normalised over its own (`finalize`'s out [..., Dv] and natural-log
  lse [...], -inf where keyless), as one (out [..., Dv] f32, lse [...] over the real keys); sinks: a virtual
  key's logit, broadcast against lse, added to the denominator only. Both keyless gives 0 and -inf."""
  top = jnp.maximum(lse_a, lse_b)
  has_keys = top > -jnp.inf
  top = jnp.where(has_keys, top, 0.0)
  w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
  keys = jnp.where(has_keys, w_a + w_b, 1.0)
  total = keys if sinks is None else keys + jnp.exp(sinks - top)
  rows = lambda x: lax.broadcast_in_dim(x, out_a.shape, tuple(range(x.ndim)))   # lse's dims lead out's
  out = (out_a * rows(w_a) + out_b * rows(w_b)) / rows(total)
  return jnp.where(rows(has_keys), out, 0.0), jnp.where(has_keys, top + jnp.log(keys), -jnp.inf)
