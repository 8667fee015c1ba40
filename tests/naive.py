"""An independent float64 numpy decode attention, written with explicit loops, to check the references."""

import numpy as np


def _f64(x):
  return np.asarray(x, dtype=np.float32).astype(np.float64) if x is not None else None


def naive_attention(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None, k_scale=None,
                    v_scale=None):
  """q [B, S, Hq, D]; k [B, T, Hkv, D]; v [B, T, Hkv, Dv]. Returns (out [B, S, Hq, Dv], lse [B, S, Hq])."""
  import jax.numpy as jnp
  q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
  k = np.asarray(jnp.asarray(k, jnp.float32), np.float64)
  v = np.asarray(jnp.asarray(v, jnp.float32), np.float64)
  lengths = np.asarray(lengths)
  b, s, hq, d = q.shape
  t, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  if k_scale is not None:
    k = k * np.broadcast_to(_f64(k_scale), (hkv,))[None, None, :, None]
  if v_scale is not None:
    v = v * np.broadcast_to(_f64(v_scale), (hkv,))[None, None, :, None]
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  sinks = _f64(sinks)
  out = np.zeros((b, s, hq, v.shape[-1]))
  lse = np.full((b, s, hq), -np.inf)
  for bi in range(b):
    length = min(max(int(lengths[bi]), 0), t)
    for si in range(s):
      pos = length - s + si
      keys = [j for j in range(t) if j < length and j <= pos and (window is None or j > pos - window)]
      for h in range(hq):
        kvh = h // group
        if not keys:
          continue
        logits = np.array([scale * np.dot(q[bi, si, h], k[bi, j, kvh]) for j in keys])
        if softcap is not None:
          logits = softcap * np.tanh(logits / softcap)
        m = logits.max()
        if sinks is not None:
          m = max(m, sinks[h])
        e = np.exp(logits - m)
        denom = e.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
        out[bi, si, h] = sum(e[i] * v[bi, j, kvh] for i, j in enumerate(keys)) / denom
        lse[bi, si, h] = np.log(e.sum()) + m
  return out, lse
