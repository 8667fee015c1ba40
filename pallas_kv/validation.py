"""Trace-time checks of the public arguments, shared by the ops and their references.

Every check raises ValueError (bad value) or NotImplementedError (valid but unsupported) with a
message naming the argument, what it got and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp
import numpy as np

MAX_NEW_TOKENS = 16
QUERY_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Cache dtypes; int8 and fp8 caches are dequantised with k_scale / v_scale.
QUANTIZED_CACHE_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
CACHE_DTYPES = QUERY_DTYPES + QUANTIZED_CACHE_DTYPES


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static description of one call, after validation."""
  batch: int
  num_queries: int  # S, new tokens per sequence
  num_heads: int  # Hq
  num_kv_heads: int  # Hkv
  head_dim: int  # D of q and k
  v_head_dim: int
  capacity: int  # T: tokens a sequence can hold (max_pages * page_size when paged)
  page_size: int | None  # None for a contiguous cache
  num_pages: int | None
  v_tokens_last: bool = False  # v is [B, Hkv, D, T] ([P, Hkv, D, page_size] paged), not like k
  cache_dtype: jnp.dtype | None = None  # the dtype of the cache (k, k_pages or kv_pages)

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def scale_token_shape(self) -> tuple[int, int, int]:
    """Shape of a per-token scale: the cache's leading dims and Hkv ([B, T, Hkv] or [P, page_size, Hkv])."""
    if self.page_size is None:
      return (self.batch, self.capacity, self.num_kv_heads)
    return (self.num_pages, self.page_size, self.num_kv_heads)


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def is_quantized_dtype(dtype) -> bool:
  """Whether a cache of this dtype is int8 / fp8 (dequantised with k_scale / v_scale)."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in QUANTIZED_CACHE_DTYPES]


def _describe(x) -> str:
  return repr(x) if isinstance(x, numbers.Number) else f"an array of shape {tuple(getattr(x, 'shape', ()))}"


def _check_dtype(name: str, x, allowed) -> None:
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
    raise ValueError(
        f"{name} has dtype {_dtype_name(x.dtype)}; expected one of "
        f"{', '.join(_dtype_name(d) for d in allowed)}")


def _check_integer(name: str, x, shape: tuple[int, ...]) -> None:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise ValueError(f"{name} must be an int32 array of shape {shape}; got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array (int32); got dtype {_dtype_name(x.dtype)}")
  if tuple(x.shape) != shape:
    raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {shape}")


def lengths_as_int32(lengths, capacity: int):
  """lengths as int32 for the kernels. A wider integer type (int64, uint32) is clamped to
  [0, capacity] in its own type first, so a value past int32's range clamps like any other
  instead of wrapping (2**32 + 5 would otherwise read as 5). NumPy arrays are clamped in NumPy:
  JAX would wrap them to int32 on the way in."""
  if isinstance(lengths, np.ndarray):
    return jnp.asarray(np.clip(lengths, 0, capacity).astype(np.int32))
  if lengths.dtype == jnp.int32:
    return lengths
  return jnp.clip(lengths, 0, capacity).astype(jnp.int32)


def query_shape(q) -> tuple[int, int, int, int]:
  """(B, S, Hq, D) of q [B, Hq, D] (S = 1) or [B, S, Hq, D]; works on arrays and ShapeDtypeStructs."""
  shape = tuple(q.shape)
  if len(shape) in (3, 4) and shape[-1] < 1:
    raise ValueError(f"q must have a head dim D >= 1 (its last dim); got q.shape={shape}")
  if len(shape) == 3:
    return shape[0], 1, shape[1], shape[2]
  if len(shape) == 4:
    if shape[1] > MAX_NEW_TOKENS:
      raise NotImplementedError(
          f"q has {shape[1]} new tokens (q.shape={shape}); at most {MAX_NEW_TOKENS} are supported per "
          "decode step")
    if shape[1] < 1:
      raise ValueError(f"q has no new tokens: q.shape={shape}")
    return shape
  raise ValueError(f"q must have rank 3 [B, Hq, D] or rank 4 [B, S, Hq, D]; got shape {shape}")


def query_as_rank4(q):
  """Returns (q as [B, S, Hq, D], whether the caller passed the single-token form [B, Hq, D])."""
  query_shape(q)
  return (q[:, None], True) if q.ndim == 3 else (q, False)


def scale_kind(scale, token_shape: tuple[int, ...]) -> str | None:
  """The kind of a k_scale / v_scale argument: None, "head" (a number, a scalar or [Hkv]: one
  per kv head or for the whole cache) or "token" (token_shape = the cache's [B, T, Hkv] or
  [P, page_size, Hkv]: one per token and kv head). Call after `check_options`."""
  if scale is None:
    return None
  if isinstance(scale, numbers.Real) or tuple(scale.shape) in ((), token_shape[-1:]):
    return "head"
  return "token"


def check_options(*, scale, softcap, window, sinks, k_scale, v_scale, num_heads: int,
                  num_kv_heads: int, token_shape: tuple[int, ...], cache_dtype=None) -> None:
  """token_shape: the cache's leading dims and Hkv ([B, T, Hkv] or [P, page_size, Hkv]), the
  shape of a per-token scale. cache_dtype: the cache's dtype (`Problem.cache_dtype`); given,
  k_scale / v_scale are refused on a bfloat16 / float16 / float32 cache."""
  if scale is not None:
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
      raise ValueError(f"scale must be a finite positive Python number or None; got {scale!r}")
  if softcap is not None:
    if not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap <= 0:
      raise ValueError(f"softcap must be a finite positive Python number or None; got {softcap!r}")
  if window is not None:
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
      raise ValueError(f"window must be a positive Python int or None; got {window!r}")
  if sinks is not None:
    if not hasattr(sinks, "shape") or tuple(sinks.shape) != (num_heads,):
      raise ValueError(f"sinks must be an array of shape [Hq]=({num_heads},); got "
                       f"{getattr(sinks, 'shape', type(sinks).__name__)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"sinks must be floating point; got dtype {_dtype_name(sinks.dtype)}")
  if cache_dtype is not None and not is_quantized_dtype(cache_dtype):
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
      if s is not None:
        raise ValueError(f"{name}={_describe(s)} must be None for a {_dtype_name(cache_dtype)} cache: "
                         "scales only apply to int8 / fp8 caches")
  shapes = [(), (num_kv_heads,), tuple(token_shape)]
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    if s is None or isinstance(s, numbers.Real) and not isinstance(s, bool):
      continue
    if not hasattr(s, "shape") or tuple(s.shape) not in shapes:
      raise ValueError(f"{name} must be a number, a scalar array, an array of shape [Hkv]=({num_kv_heads},), "
                       f"or per token and kv head {list(token_shape)}; got {getattr(s, 'shape', type(s).__name__)}")
    if not jnp.issubdtype(s.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point; got dtype {_dtype_name(s.dtype)}")


def check_window_start(window_start, batch: int) -> None:
  """window_start: None or an integer array [B], each sequence's first visible key."""
  if window_start is not None:
    _check_integer("window_start", window_start, (batch,))


def _check_heads(num_heads: int, num_kv_heads: int, kv_name: str) -> None:
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"q has {num_heads} heads and {kv_name} has {num_kv_heads} kv heads; the number of "
                     "q heads must be a multiple of the number of kv heads (MHA, GQA or MQA)")


def check_v_tokens_last(v_tokens_last) -> None:
  if not isinstance(v_tokens_last, bool):
    raise ValueError(f"v_tokens_last must be a bool; got {v_tokens_last!r}")


def tokens_last_shape(shape) -> tuple[int, ...]:
  """The shape of a v stored tokens last, from k's [B, T, Hkv, D] ([P, page_size, Hkv, D]):
  [B, Hkv, D, T] ([P, Hkv, D, page_size])."""
  return (shape[0], shape[2], shape[3], shape[1])


def relaid_v(v, *, tokens_last: bool):
  """v laid out like k ([B, T, Hkv, D] / [P, page_size, Hkv, D]) -> tokens last ([B, Hkv, D, T] /
  [P, Hkv, D, page_size]), or back with tokens_last=False."""
  return jnp.transpose(v, (0, 2, 3, 1) if tokens_last else (0, 3, 1, 2))


def _check_v_shape(k, v, k_name: str, v_name: str, v_tokens_last: bool) -> None:
  if not v_tokens_last:
    if k.shape != v.shape:
      raise ValueError(f"{k_name} and {v_name} must have the same shape; got {k_name} {tuple(k.shape)} and "
                       f"{v_name} {tuple(v.shape)}")
  elif tuple(v.shape) != tokens_last_shape(k.shape):
    raise ValueError(f"with v_tokens_last=True, {v_name} must have shape {list(tokens_last_shape(k.shape))} "
                     f"({k_name}'s dims 0, 2, 3, 1); got {tuple(v.shape)}")


def validate_dense(q, k, v, lengths, v_tokens_last: bool = False) -> Problem:
  b, s, hq, d = query_shape(q)
  _check_dtype("q", q, QUERY_DTYPES)
  check_v_tokens_last(v_tokens_last)
  for name, x, dims in (("k", k, "[B, T, Hkv, D]"), ("v", v, "[B, Hkv, D, T]" if v_tokens_last else "[B, T, Hkv, D]")):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 {dims}; got shape {tuple(x.shape)}")
    _check_dtype(name, x, CACHE_DTYPES)
  _check_v_shape(k, v, "k", "v", v_tokens_last)
  if k.dtype != v.dtype:
    raise ValueError(f"k and v must have the same dtype; got {_dtype_name(k.dtype)} and {_dtype_name(v.dtype)}")
  if k.shape[0] != b:
    raise ValueError(f"k has batch {k.shape[0]} but q has batch {b}")
  if k.shape[3] != d:
    raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {d}")
  _check_heads(hq, k.shape[2], "k")
  _check_integer("lengths", lengths, (b,))
  return Problem(batch=b, num_queries=s, num_heads=hq, num_kv_heads=k.shape[2], head_dim=d,
                 v_head_dim=d, capacity=k.shape[1], page_size=None, num_pages=None, v_tokens_last=v_tokens_last,
                 cache_dtype=jnp.dtype(k.dtype))


def _check_block_tables(block_tables, batch: int) -> None:
  if block_tables.ndim != 2:
    raise ValueError(f"block_tables must have rank 2 [B, max_pages_per_seq]; got shape {tuple(block_tables.shape)}")
  _check_integer("block_tables", block_tables, (batch, block_tables.shape[1]))


def validate_paged(q, k_pages, v_pages, block_tables, lengths, v_tokens_last: bool = False) -> Problem:
  b, s, hq, d = query_shape(q)
  _check_dtype("q", q, QUERY_DTYPES)
  check_v_tokens_last(v_tokens_last)
  v_dims = "[P, Hkv, D, page_size]" if v_tokens_last else "[P, page_size, Hkv, D]"
  for name, x, dims in (("k_pages", k_pages, "[P, page_size, Hkv, D]"), ("v_pages", v_pages, v_dims)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 {dims}; got shape {tuple(x.shape)}")
    _check_dtype(name, x, CACHE_DTYPES)
  _check_v_shape(k_pages, v_pages, "k_pages", "v_pages", v_tokens_last)
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages and v_pages must have the same dtype; got {_dtype_name(k_pages.dtype)} and "
                     f"{_dtype_name(v_pages.dtype)}")
  if k_pages.shape[3] != d:
    raise ValueError(f"k_pages has head_dim {k_pages.shape[3]} but q has head_dim {d}")
  _check_heads(hq, k_pages.shape[2], "k_pages")
  _check_block_tables(block_tables, b)
  _check_integer("lengths", lengths, (b,))
  num_pages, page_size = k_pages.shape[:2]
  return Problem(batch=b, num_queries=s, num_heads=hq, num_kv_heads=k_pages.shape[2], head_dim=d,
                 v_head_dim=d, capacity=block_tables.shape[1] * page_size, page_size=page_size,
                 num_pages=num_pages, v_tokens_last=v_tokens_last, cache_dtype=jnp.dtype(k_pages.dtype))


def validate_mla(q, kv_pages, block_tables, lengths, v_head_dim) -> Problem:
  b, s, hq, d = query_shape(q)
  _check_dtype("q", q, QUERY_DTYPES)
  if kv_pages.ndim != 3:
    raise ValueError(f"kv_pages must have rank 3 [P, page_size, Dqk]; got shape {tuple(kv_pages.shape)}")
  _check_dtype("kv_pages", kv_pages, CACHE_DTYPES)
  if kv_pages.shape[2] != d:
    raise ValueError(f"kv_pages has Dqk {kv_pages.shape[2]} but q has head_dim {d}")
  if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, numbers.Integral) or not 0 < v_head_dim <= d:
    raise ValueError(f"v_head_dim must be an int in [1, Dqk={d}]; got {v_head_dim!r}")
  _check_block_tables(block_tables, b)
  _check_integer("lengths", lengths, (b,))
  num_pages, page_size = kv_pages.shape[:2]
  return Problem(batch=b, num_queries=s, num_heads=hq, num_kv_heads=1, head_dim=d,
                 v_head_dim=int(v_head_dim), capacity=block_tables.shape[1] * page_size,
                 page_size=page_size, num_pages=num_pages, cache_dtype=jnp.dtype(kv_pages.dtype))


def latent_scale(kv_scale, kv_pages):
  """An MLA call's kv_scale as the ops' k_scale: None, a number or scalar array as given, or a per-token
  [P, page_size] array as [P, page_size, 1] (the shape of a per-token scale of one kv head)."""
  if kv_scale is None:
    return None
  if not is_quantized_dtype(kv_pages.dtype):
    raise ValueError(f"kv_scale={_describe(kv_scale)} must be None for a {_dtype_name(kv_pages.dtype)} latent "
                     "cache: it dequantizes an int8 / fp8 cache")
  if isinstance(kv_scale, numbers.Real) and not isinstance(kv_scale, bool):
    return kv_scale
  token_shape = tuple(kv_pages.shape[:2])
  if not hasattr(kv_scale, "shape") or tuple(kv_scale.shape) not in ((), token_shape):
    raise ValueError(f"kv_scale must be a number, a scalar array or per token [P, page_size]={list(token_shape)}; "
                     f"got {getattr(kv_scale, 'shape', type(kv_scale).__name__)}")
  if not jnp.issubdtype(kv_scale.dtype, jnp.floating):
    raise ValueError(f"kv_scale must be floating point; got dtype {_dtype_name(kv_scale.dtype)}")
  return kv_scale if kv_scale.ndim == 0 else kv_scale[..., None]


def default_scale(head_dim: int) -> float:
  if head_dim < 1:
    raise ValueError(f"head_dim={head_dim} must be >= 1 for the default scale 1/sqrt(head_dim)")
  return 1.0 / float(np.sqrt(head_dim))
