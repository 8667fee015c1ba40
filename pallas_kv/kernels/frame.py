"""The split-K frame both kernel backends share: everything around a kernel's partials.

Kernels see, per (batch, kv head), R = S * G packed query rows: row r = s * G + g is new token s of q head
kv_head * G + g, so one program serves a whole group and reads its KV once (`pack_queries`)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from pallas_kv import validation

KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# q heads per kv head: more packed rows than a program holds go to more row blocks, each reading its KV once.
MAX_GROUP = 128


def unsupported_reason(op: str, problem, options, dtypes, *, backend: str) -> str | None:
  """Why a split-K GQA backend cannot serve the call (MLA, other caches), or None; each backend checks
  its head dims itself."""
  _, kv_dtype = dtypes
  kv_dtype = jnp.dtype(kv_dtype)
  if op == "mla":
    return f"MLA is not implemented on the {backend} backend"
  if kv_dtype not in KV_DTYPES + QUANTIZED_DTYPES:
    return (f"the cache dtype {kv_dtype.name} is not supported "
            f"({', '.join(d.name for d in KV_DTYPES + QUANTIZED_DTYPES)})")
  if kv_dtype in KV_DTYPES and options.quantized:
    return f"k_scale / v_scale on a {kv_dtype.name} cache are not supported (they dequantize int8 / fp8 caches)"
  if problem.group_size > MAX_GROUP:
    return f"{problem.group_size} q heads per kv head is over the supported {MAX_GROUP}"
  return None


def pack_queries(q4, num_kv_heads: int):
  """[B, S, Hq, D] -> [B, Hkv, S * G, D]."""
  b, s, hq, d = q4.shape
  g = hq // num_kv_heads
  return q4.reshape(b, s, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, s * g, d)


def unpack_rows(x, num_queries: int):
  """[B, Hkv, S * G, ...] -> [B, S, Hq, ...], the inverse of pack_queries."""
  b, hkv, r = x.shape[:3]
  g = r // num_queries
  rest = x.shape[3:]
  x = x.reshape(b, hkv, num_queries, g, *rest)
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(b, num_queries, hkv * g, *rest)


def _merged_pair(a, b):
  """The reduction step of `merge_splits`: two (log of the weight, the weighted mean of the outputs, log of the
  real keys' weight) merged into one. A weight of 0 (log -inf) takes no part, and two give -inf and zeros."""
  (weight_a, mean_a, keys_a), (weight_b, mean_b, keys_b) = a, b

  def log_add(x, y):
    hi, lo = jnp.maximum(x, y), jnp.minimum(x, y)
    return jnp.where(lo == -jnp.inf, hi, hi + jnp.log1p(jnp.exp(lo - hi)))

  weight = log_add(weight_a, weight_b)
  share_a = jnp.where(weight_a == -jnp.inf, 0.0, jnp.exp(weight_a - weight))
  share_b = jnp.where(weight_b == -jnp.inf, 0.0, jnp.exp(weight_b - weight))
  return weight, share_a * mean_a + share_b * mean_b, log_add(keys_a, keys_b)


def merge_splits(out, lse, sinks=None, rows: int | None = None):
  """Merges split-K partials: out [B, Hkv, splits, R, Dv] float32 or 16-bit, each split's normalised output
  (ignored where the split saw no key, but one split without sinks is returned as is); lse [B, Hkv, splits, R]
  float32, -inf where empty; sinks: optional [Hkv, R] float32; rows: R where a kernel padded its partials past it
  (default: all). Returns (out [B, Hkv, R, Dv] float32, lse [B, Hkv, R] float32 over the real keys, -inf where
  none).

  One variadic reduction over the splits (in XLA one launch, where a max, a sum and a contraction were several):
  each split weighs exp(lse); a sink joins as a split with no output and no keys that weighs exp(sink)."""
  if rows is not None:   # drop rows a kernel padded
    out, lse = out[:, :, :, :rows], lse[:, :, :, :rows]
  if out.shape[2] == 1 and sinks is None:
    return out[:, :, 0], lse[:, :, 0]
  lse = lse.astype(jnp.float32)
  means = jnp.where((lse > -jnp.inf)[..., None], out.astype(jnp.float32), 0.0)   # an empty split's is never read
  weights, keys = lse, lse
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (*lse.shape[:2], 1, lse.shape[3]))
    weights = jnp.concatenate([lse, sink], axis=2)
    keys = jnp.concatenate([lse, jnp.full_like(sink, -jnp.inf)], axis=2)
    means = jnp.concatenate([means, jnp.zeros_like(means[:, :, :1])], axis=2)
  per_column = lambda x: jnp.broadcast_to(x[..., None], means.shape)
  _, merged, lse_total = lax.reduce((per_column(weights), means, per_column(keys)),
                                    (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(-jnp.inf)),
                                    _merged_pair, (2,))
  return merged, lse_total[..., 0]


def scale_kind(scale, k_shape) -> str | None:
  """None (no scale), "head" (float32 [Hkv]) or "token" (float32 [*k_shape[:2], Hkv], addressed like the cache)."""
  if scale is None:
    return None
  hkv = k_shape[2]
  if tuple(scale.shape) == (hkv,):
    return "head"
  if tuple(scale.shape) == (*k_shape[:2], hkv):
    return "token"
  raise ValueError(f"a scale must be [Hkv]=({hkv},) or [{k_shape[0]}, {k_shape[1]}, {hkv}]; got {tuple(scale.shape)}")


def check_packed_args(q, k, v, lengths, block_tables, *, num_queries: int, k_scale=None, v_scale=None,
                      v_tokens_last: bool = False) -> None:
  """Checks the layout every `decode_partials` takes: q [B, Hkv, R, D] bf16 / fp16; k, v in q's dtype or
  QUANTIZED_DTYPES (float32 scales: `scale_kind`); int32 lengths [B]; int32 block_tables [B, max_pages]."""
  if q.ndim != 4:
    raise ValueError(f"q must be packed rows [B, Hkv, R, D], got {q.shape=}")
  if k.ndim != 4 or v.shape != (validation.tokens_last_shape(k.shape) if v_tokens_last else k.shape):
    raise ValueError(f"k must be 4-d and v {'its dims 0, 2, 3, 1' if v_tokens_last else 'of its shape'}, "
                     f"got {k.shape=} {v.shape=}")
  B, Hkv, R, D = q.shape
  if k.shape[2:] != (Hkv, D):
    raise ValueError(f"k's heads and head_dim {k.shape[2:]=} must match q's {(Hkv, D)}")
  if jnp.dtype(q.dtype) not in KV_DTYPES:
    raise ValueError(f"q.dtype={jnp.dtype(q.dtype).name} must be bfloat16 or float16")
  if v.dtype != k.dtype or (k.dtype != q.dtype and jnp.dtype(k.dtype) not in QUANTIZED_DTYPES):
    raise ValueError(f"k and v must share q's dtype or a one-byte dtype "
                     f"({', '.join(d.name for d in QUANTIZED_DTYPES)}), got {q.dtype=} {k.dtype=} {v.dtype=}")
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is not None:
      if scale.dtype != jnp.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
      scale_kind(scale, k.shape)
  if num_queries < 1 or R % num_queries:
    raise ValueError(f"{num_queries=} must be >= 1 and divide the packed rows {R=}")
  if lengths.shape != (B,) or lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32 [{B}], got {lengths.shape=} {lengths.dtype=}")
  if block_tables is None:
    if k.shape[0] != B:
      raise ValueError(f"dense k must be [B={B}, T, Hkv, D], got {k.shape=}")
  elif block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables must be int32 [B={B}, max_pages], got {block_tables.shape=} "
                     f"{block_tables.dtype=}")


def compute_dtype(kv_dtype):
  """The matmul operand dtype: a 16-bit cache's own, else float16 (exact for one-byte values, finer than bf16)."""
  if jnp.dtype(kv_dtype) in KV_DTYPES:
    return jnp.dtype(kv_dtype)
  return jnp.dtype(jnp.float16)


def kernel_scale(scale, num_kv_heads: int):
  """A public k_scale / v_scale as kernels take it: None, float32 [Hkv] (scalars broadcast), or per token."""
  if scale is None:
    return None
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.broadcast_to(scale, (num_kv_heads,)) if scale.ndim == 0 else scale


def packed_sinks(sinks, problem):
  """Per-head sink logits [Hq] as float32 [Hkv, R] per packed row (`pack_queries`)."""
  per_head = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None],
                              (1, problem.num_queries, problem.num_heads, 1))
  return pack_queries(per_head, problem.num_kv_heads)[0, ..., 0]


def run(partials: Callable, q, k, lengths, block_tables, *, problem, sinks, return_lse: bool, k_scale=None,
        v_scale=None, merged: bool = False, merge: Callable | None = None, cast_rows: bool = True):
  """Packs q into rows, runs partials(rows, lengths, block_tables, k_scale, v_scale) -> per-split (out
  [B, Hkv, splits, >= R, D], lse), merges the splits (`merge_splits`, or merge(out, lse, row_sinks, rows=R,
  out_dtype=, return_lse=) -> (out [B, Hkv, R, D], lse or None)) and unpacks. merged=True: partials(...,
  row_sinks) merges itself. Lengths and page ids pass unclamped: kernels clamp them, so nothing launches before.
  The rows are cast to the matmuls' dtype (`compute_dtype`) here; with cast_rows=False the kernel casts 16-bit
  rows for a one-byte cache's float16 math itself (a cast here would be a launch of its own)."""
  q4, single = validation.query_as_rank4(q)
  rows = pack_queries(q4, problem.num_kv_heads)
  kernel_casts = (not cast_rows and jnp.dtype(k.dtype) in QUANTIZED_DTYPES and jnp.dtype(rows.dtype) in KV_DTYPES)
  if not kernel_casts:
    rows = rows.astype(compute_dtype(k.dtype))
  num_rows = rows.shape[2]
  lengths = lengths.astype(jnp.int32)
  if block_tables is not None:
    block_tables = block_tables.astype(jnp.int32)
  row_sinks = None if sinks is None else packed_sinks(sinks, problem)
  k_scale = kernel_scale(k_scale, problem.num_kv_heads)
  v_scale = kernel_scale(v_scale, problem.num_kv_heads)
  if merged:
    out, lse = partials(rows, lengths, block_tables, k_scale, v_scale, row_sinks)
  else:
    out, lse = partials(rows, lengths, block_tables, k_scale, v_scale)
    if merge is not None and out.shape[2] > 1:
      out, lse = merge(out, lse, row_sinks, rows=num_rows, out_dtype=q.dtype, return_lse=return_lse)
    else:
      out, lse = merge_splits(out, lse, row_sinks, rows=num_rows)
  out = unpack_rows(out, problem.num_queries)
  if not return_lse:
    return out[:, 0] if single else out
  lse = unpack_rows(lse, problem.num_queries)
  return (out[:, 0], lse[:, 0]) if single else (out, lse)
