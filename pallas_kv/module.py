"""DecodeAttention: the attention layer of a transformer's decode step, on pallas_kv's ops.

A pure layer: `layer(params, x, cache) -> (y, cache)` projects the new tokens' hidden states to
Q/K/V, applies RoPE at their positions, appends K/V to the cache, runs decode attention over
the cache and projects out. Parameters and caches are pytrees, so the layer works under jit
(donate the cache to update it in place), vmap, lax.scan over layers and grad.

Standard attention (MHA/GQA/MQA) uses `KVCache` or `PagedKVCache`; the MLA variant (DeepSeek,
absorbed form) uses `PagedLatentCache`, whose rows are [latent (kv_lora_rank) | rope key].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kv import api
from pallas_kv import shared_prefix
from pallas_kv import varlen
from pallas_kv import xla
from pallas_kv.cache import KVCache
from pallas_kv.cache import PagedKVCache
from pallas_kv.cache import PagedLatentCache
from pallas_kv.cache import is_quantized


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Dimensions of multi-head latent attention (DeepSeek-V2/V3 defaults)."""
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128

  def __post_init__(self):
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"{self.qk_rope_head_dim=} must be even (RoPE rotates pairs)")


def rope(x, positions, theta: float):
  """Rotary position embedding (rotate-half form). x [B, S, H, D] (D even), positions [B, S]."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Queries per block of prefill attention: a block's scores are [chunk, T], never [L, T] (an 8K
# prompt's full scores would take 2.4 GB per head group and layer).
PREFILL_CHUNK = 512


def prefix_attention(q, k, v, positions, lengths, *, scale: float, softcap=None, window=None, sinks=None,
                     k_scale=None, v_scale=None):
  """Plain XLA attention of L new tokens over a cache that already holds them (prefill).

  q [B, L, Hq, D] at positions [B, L]; k, v [B, T, Hkv, *] the cache's tokens, lengths [B] of them
  valid: a token at position p sees the keys at positions <= p (the cached ones and, causally, the
  new ones). The queries go in blocks of PREFILL_CHUNK. Returns [B, L, Hq, Dv] float32."""
  blocks = []
  for start in range(0, q.shape[1], PREFILL_CHUNK):
    stop = min(start + PREFILL_CHUNK, q.shape[1])
    out, _ = xla.attend(q[:, start:stop], k, v, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks,
                        k_scale=k_scale, v_scale=v_scale, positions=positions[:, start:stop])
    blocks.append(out)
  return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def _cache_contents(cache):
  """(k, v [B, T, Hkv, D], k_scale, v_scale) of a KVCache or PagedKVCache, in token order."""
  dense = cache.dense_view() if isinstance(cache, PagedKVCache) else cache
  v = jnp.transpose(dense.v, (0, 3, 1, 2)) if dense.v_tokens_last else dense.v
  return dense.k, v, dense.k_scale, dense.v_scale


def _kv_dtype(cache):
  return cache.k.dtype if isinstance(cache, KVCache) else cache.k_pages.dtype


def _query_dtype(kv_dtype):
  """The queries' dtype: the cache's, or bfloat16 for an int8 / fp8 cache (widened in the kernel)."""
  return jnp.dtype(jnp.bfloat16) if is_quantized(kv_dtype) else jnp.dtype(kv_dtype)


def _as_cache_input(x, kv_dtype):
  """New keys / values as the cache's append takes them: its dtype, or the projections as they
  are for a quantized cache (which quantizes them)."""
  return x if is_quantized(kv_dtype) else x.astype(kv_dtype)


@dataclasses.dataclass(frozen=True)
class DecodeAttention:
  """Configuration of one attention layer; `init` makes its parameters, calling it runs a step.

  hidden_size: model width. num_heads / num_kv_heads / head_dim: query heads, KV heads (GQA) and
  their size (ignored by the MLA variant, which takes its sizes from `mla`). rope_theta: RoPE base.
  window, softcap, use_sinks: the attention options of `pallas_kv.decode_attention`.
  impl: backend of the decode attention ("auto", "mosaic_gpu", "triton", "xla").
  """
  hidden_size: int
  num_heads: int
  num_kv_heads: int = 1
  head_dim: int = 128
  rope_theta: float = 10000.0
  window: int | None = None
  softcap: float | None = None
  use_sinks: bool = False
  mla: MLAConfig | None = None
  param_dtype: str = "float32"
  impl: str = "auto"

  def __post_init__(self):
    if self.hidden_size < 1 or self.num_heads < 1:
      raise ValueError(f"hidden_size={self.hidden_size} and num_heads={self.num_heads} must be positive")
    if self.mla is None:
      if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
        raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
      if self.head_dim < 1 or self.head_dim % 2:
        raise ValueError(f"head_dim={self.head_dim} must be positive and even (RoPE rotates pairs)")
    elif self.window is not None or self.softcap is not None or self.use_sinks:
      raise NotImplementedError("window, softcap and sinks are not supported with MLA")
    if self.impl not in api.IMPLS:
      raise ValueError(f"impl must be one of {api.IMPLS}; got {self.impl!r}")

  @property
  def scale(self) -> float:
    if self.mla is None:
      return 1.0 / math.sqrt(self.head_dim)
    return 1.0 / math.sqrt(self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)

  # ------------------------------------------------------------------------ parameters

  def init(self, key) -> dict:
    """Random parameters (fan-in scaled normal)."""
    dtype = jnp.dtype(self.param_dtype)
    h, n = self.hidden_size, self.num_heads
    normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
    keys = iter(jax.random.split(key, 8))
    if self.mla is None:
      d, nkv = self.head_dim, self.num_kv_heads
      params = dict(wq=normal(next(keys), (h, n, d), h), wk=normal(next(keys), (h, nkv, d), h),
                    wv=normal(next(keys), (h, nkv, d), h), wo=normal(next(keys), (n, d, h), n * d))
      if self.use_sinks:
        params["sinks"] = jax.random.normal(next(keys), (n,), jnp.float32)
      return params
    m = self.mla
    return dict(
        wq=normal(next(keys), (h, n, m.qk_nope_head_dim + m.qk_rope_head_dim), h),
        w_dkv=normal(next(keys), (h, m.kv_lora_rank), h),  # down-projection to the latent
        w_kr=normal(next(keys), (h, m.qk_rope_head_dim), h),  # shared rope key
        w_uk=normal(next(keys), (n, m.qk_nope_head_dim, m.kv_lora_rank), m.kv_lora_rank),
        w_uv=normal(next(keys), (n, m.kv_lora_rank, m.v_head_dim), m.kv_lora_rank),
        wo=normal(next(keys), (n, m.v_head_dim, h), n * m.v_head_dim))

  # ------------------------------------------------------------------------ the step

  def __call__(self, params: dict, x, cache, positions=None, *, config=None, plan=None, cu_seqlens=None,
               max_seqlen=None, shared_prefix=None):
    """One decode step. x [B, S, hidden] (S <= 16 new tokens) or [B, hidden] -> (y like x, cache).

    positions [B, S] default to the cache's lengths + arange(S) (the new tokens follow the
    cached ones). For a paged cache the pages for the new tokens must be reserved first
    (`pallas_kv.cache.reserve_pages`). config: a kernel config (`pallas_kv.TritonConfig`, ...).
    plan: this step's `SplitPlan` from `plan_step`, shared by the layers of a model.
    shared_prefix: this step's `SharedPrefix` for a cache with `prefix_groups`, found once for layers whose
    block tables group alike (`pallas_kv.shared_prefix.from_tables`); else found here from the cache.
    cu_seqlens: int32 [B + 1], the varlen form: x is [total, hidden], sequence b's new tokens its rows
    cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (at most max_seqlen, default min(16, total)); y is [total, hidden].
    """
    if cu_seqlens is not None:
      return self._varlen_step(params, x, cache, cu_seqlens, max_seqlen, config=config, plan=plan)
    h = self.hidden_size
    if x.ndim not in (2, 3) or x.shape[-1] != h:
      raise ValueError(f"x must be [B, S, hidden_size={h}] or [B, hidden_size={h}]; got shape {tuple(x.shape)}")
    single = x.ndim == 2
    if single:
      x = x[:, None]
    self._check_cache(cache, x.shape[0])
    if positions is None:
      positions = cache.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    if self.mla is None:
      y, cache = self._standard_step(params, x, cache, positions, config, plan, shared_prefix)
    else:
      y, cache = self._mla_step(params, x, cache, positions, config, plan, shared_prefix)
    return (y[:, 0] if single else y), cache

  def _varlen_step(self, params, x, cache, cu_seqlens, max_seqlen, *, config, plan):
    """A step of different numbers of new tokens per sequence: projections per token, the cache appends
    each sequence's tokens (right-padded, `num_new`), attention in the ops' varlen form."""
    h = self.hidden_size
    if x.ndim != 2 or x.shape[-1] != h:
      raise ValueError(f"with cu_seqlens, x must be [total_tokens, hidden_size={h}]; got shape {tuple(x.shape)}")
    batch, num_queries = varlen.check(x[:, None], cu_seqlens, max_seqlen)
    self._check_cache(cache, batch)
    seq, index = varlen.token_positions(cu_seqlens, x.shape[0])
    positions = (cache.lengths[seq] + index)[None]   # [1, total]
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.int32)
    left_aligned = lambda t: varlen.to_left_aligned(t[0], cu_seqlens, num_queries)
    attend = dict(cu_seqlens_q=cu_seqlens, max_seqlen_q=num_queries, impl=self.impl, config=config, plan=plan)
    if self.mla is not None:
      q, rows = self._mla_latents(params, x[None], positions)
      cache = cache.append(_as_cache_input(left_aligned(rows), cache.kv_pages.dtype), counts)
      out = api.mla_decode_attention(q[0].astype(_query_dtype(cache.kv_pages.dtype)), cache.kv_pages,
                                     cache.block_tables, cache.lengths, v_head_dim=self.mla.kv_lora_rank,
                                     scale=self.scale, kv_scale=cache.kv_scale, **attend)
      v = jnp.einsum("tnc,ncv->tnv", out.astype(x.dtype), params["w_uv"])
      return jnp.einsum("tnv,nvh->th", v, params["wo"]), cache
    q, k, v = self._project_qkv(params, x[None], positions)
    kv_dtype = _kv_dtype(cache)
    cache = cache.append(*(_as_cache_input(left_aligned(t), kv_dtype) for t in (k, v)), counts)
    out = self._attend(params, q[0].astype(_query_dtype(kv_dtype)), cache, **attend)
    return jnp.einsum("tnd,ndh->th", out.astype(x.dtype), params["wo"]), cache

  def plan_step(self, cache, num_new: int = 1, *, config=None):
    """The `SplitPlan` of a step of num_new tokens per sequence over `cache` (as it is before the
    step appends them), or None where the step runs no kernel. Plan once per step and pass
    `plan=` to every layer whose cache has the same shapes: the plan is computed once, not per
    layer. A cache with `prefix_groups` gives None: its shared-prefix calls plan their own two passes."""
    self._check_cache(cache, cache.lengths.shape[0])
    if getattr(cache, "prefix_groups", None) is not None:
      return None
    lengths = jnp.minimum(cache.lengths + num_new, self._capacity(cache))
    batch = cache.lengths.shape[0]
    if self.mla is not None:
      q = jax.ShapeDtypeStruct((batch, num_new, self.num_heads, cache.kv_pages.shape[2]),
                               _query_dtype(cache.kv_pages.dtype))
      return api.plan_splits(api.mla_decode_attention, q, cache.kv_pages, cache.block_tables, lengths,
                             v_head_dim=self.mla.kv_lora_rank, scale=self.scale, impl=self.impl, config=config,
                             kv_scale=cache.kv_scale)
    kv_dtype = _kv_dtype(cache)
    q = jax.ShapeDtypeStruct((batch, num_new, self.num_heads, self.head_dim), _query_dtype(kv_dtype))
    options = dict(scale=self.scale, softcap=self.softcap, window=self.window, k_scale=cache.k_scale,
                   v_scale=cache.v_scale, impl=self.impl, config=config,
                   v_tokens_last=getattr(cache, "v_tokens_last", False))
    if isinstance(cache, KVCache):
      return api.plan_splits(api.decode_attention, q, cache.k, cache.v, lengths, **options)
    return api.plan_splits(api.paged_decode_attention, q, cache.k_pages, cache.v_pages, cache.block_tables, lengths,
                           **options)

  @staticmethod
  def _capacity(cache) -> int:
    if isinstance(cache, KVCache):
      return cache.k.shape[1]
    pages = cache.kv_pages if isinstance(cache, PagedLatentCache) else cache.k_pages
    return cache.block_tables.shape[1] * pages.shape[1]

  def _check_cache(self, cache, batch: int) -> None:
    """ValueError naming the cache's attribute where the cache does not match this layer or x's batch."""
    if self.mla is not None:
      if not isinstance(cache, PagedLatentCache):
        raise ValueError(f"cache must be a PagedLatentCache for MLA; got {type(cache).__name__}")
      row = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
      if cache.kv_pages.ndim != 3:
        raise ValueError(f"cache.kv_pages must have rank 3 [P, page_size, Dqk]; got shape {tuple(cache.kv_pages.shape)}")
      if cache.kv_pages.shape[2] != row:
        raise ValueError(f"cache.kv_pages has rows of {cache.kv_pages.shape[2]}; this layer has "
                         f"kv_lora_rank + qk_rope_head_dim = {row}")
      batch_name, cache_batch = "cache.block_tables", cache.block_tables.shape[0]
    else:
      if isinstance(cache, KVCache):
        (k_name, k), (v_name, v) = ("cache.k", cache.k), ("cache.v", cache.v)
        batch_name, cache_batch = "cache.k", cache.k.shape[0]
      elif isinstance(cache, PagedKVCache):
        (k_name, k), (v_name, v) = ("cache.k_pages", cache.k_pages), ("cache.v_pages", cache.v_pages)
        batch_name, cache_batch = "cache.block_tables", cache.block_tables.shape[0]
      else:
        raise ValueError(f"cache must be a KVCache or PagedKVCache for standard attention; got {type(cache).__name__}")
      # [.., Hkv, D] at dims 2, 3; a v stored tokens last ([B, Hkv, D, T] / [P, Hkv, D, page]) at 1, 2.
      for name, array, axis in ((k_name, k, 2), (v_name, v, 1 if cache.v_tokens_last else 2)):
        if array.ndim != 4:
          raise ValueError(f"{name} must have rank 4; got shape {tuple(array.shape)}")
        if array.shape[axis] != self.num_kv_heads:
          raise ValueError(f"{name} has {array.shape[axis]} kv heads; this layer has num_kv_heads={self.num_kv_heads}")
        if array.shape[axis + 1] != self.head_dim:
          raise ValueError(f"{name} has head_dim {array.shape[axis + 1]}; this layer has head_dim={self.head_dim}")
    if cache_batch != batch:
      raise ValueError(f"cache batch {cache_batch} ({batch_name}.shape[0]) does not match x's batch {batch}")
    if tuple(cache.lengths.shape) != (batch,):
      raise ValueError(f"cache.lengths has shape {tuple(cache.lengths.shape)}; expected x's batch ({batch},)")

  def _project_qkv(self, params, x, positions):
    q = jnp.einsum("bsh,hnd->bsnd", x, params["wq"])
    k = jnp.einsum("bsh,hnd->bsnd", x, params["wk"])
    v = jnp.einsum("bsh,hnd->bsnd", x, params["wv"])
    return rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta), v

  def _standard_step(self, params, x, cache, positions, config, plan, found=None):
    q, k, v = self._project_qkv(params, x, positions)
    kv_dtype = _kv_dtype(cache)
    cache = cache.append(*(_as_cache_input(t, kv_dtype) for t in (k, v)))
    out = self._attend(params, q.astype(_query_dtype(kv_dtype)), cache, impl=self.impl, config=config, plan=plan,
                       found=found)
    y = jnp.einsum("bsnd,ndh->bsh", out.astype(x.dtype), params["wo"])
    return y, cache

  def _attend(self, params, q, cache, found=None, **call):
    """The decode attention of q over a KVCache or PagedKVCache with this layer's options."""
    options = dict(scale=self.scale, softcap=self.softcap, window=self.window, sinks=params.get("sinks"),
                   k_scale=cache.k_scale, v_scale=cache.v_scale,
                   v_tokens_last=getattr(cache, "v_tokens_last", False), **call)
    if isinstance(cache, KVCache):
      return api.decode_attention(q, cache.k, cache.v, cache.lengths, **options)
    if isinstance(cache, PagedKVCache):
      return api.paged_decode_attention(q, cache.k_pages, cache.v_pages, cache.block_tables, cache.lengths,
                                        **_sharing(cache, options, found))
    raise ValueError(f"cache must be a KVCache or PagedKVCache for standard attention; got {type(cache).__name__}")

  def _mla_latents(self, params, x, positions):
    """Absorbed query [B, S, H, rank + rope] and the cache rows [B, S, rank + rope] of the new tokens."""
    m = self.mla
    q = jnp.einsum("bsh,hnd->bsnd", x, params["wq"])
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    q_latent = jnp.einsum("bsnd,ndc->bsnc", q_nope, params["w_uk"])  # W_UK absorbed into the query
    q_rope = rope(q_rope, positions, self.rope_theta)
    latent = x @ params["w_dkv"]  # [B, S, rank]
    k_rope = rope((x @ params["w_kr"])[:, :, None, :], positions, self.rope_theta)[:, :, 0]
    return jnp.concatenate([q_latent, q_rope], -1), jnp.concatenate([latent, k_rope], -1)

  def _mla_step(self, params, x, cache, positions, config, plan, found=None):
    q, rows = self._mla_latents(params, x, positions)
    cache = cache.append(_as_cache_input(rows, cache.kv_pages.dtype))
    out_latent = api.mla_decode_attention(q.astype(_query_dtype(cache.kv_pages.dtype)), cache.kv_pages,
                                          cache.block_tables, cache.lengths, **_sharing(cache, dict(
                                              v_head_dim=self.mla.kv_lora_rank, scale=self.scale, impl=self.impl,
                                              config=config, plan=plan, kv_scale=cache.kv_scale), found))
    v = jnp.einsum("bsnc,ncv->bsnv", out_latent.astype(x.dtype), params["w_uv"])
    return jnp.einsum("bsnv,nvh->bsh", v, params["wo"]), cache

  # ------------------------------------------------------------------------ prefill

  def prefill(self, params: dict, x, cache, num_new=None):
    """Runs prompts x [B, L, hidden] through the layer, continuing the cache: each sequence's new
    tokens go after its cached ones (positions and RoPE offset by `cache.lengths`) and attend to
    the cached tokens and, causally, to each other, in plain XLA (`prefix_attention`).

    num_new: int [B], each prompt's real tokens (prompts right-padded to L; all L by default):
    only those are appended. A paged cache needs their pages reserved first. A sequence whose
    tokens do not fit stores none (`cache.try_append`; reported in checked mode), and its outputs
    are not meaningful. Returns (y [B, L, hidden], cache).
    """
    positions = cache.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    self._check_cache(cache, x.shape[0])
    if self.mla is not None:
      q, rows = self._mla_latents(params, x, positions)
      cache = cache.append(_as_cache_input(rows, cache.kv_pages.dtype), num_new)
      kv = cache.gather(_query_dtype(cache.kv_pages.dtype))[:, :, None, :]   # widened where one-byte
      out = prefix_attention(q.astype(kv.dtype), kv, kv[..., :self.mla.kv_lora_rank], positions, cache.lengths,
                             scale=self.scale)
      v = jnp.einsum("bsnc,ncv->bsnv", out.astype(x.dtype), params["w_uv"])
      return jnp.einsum("bsnv,nvh->bsh", v, params["wo"]), cache
    q, k, v = self._project_qkv(params, x, positions)
    kv_dtype = _kv_dtype(cache)
    cache = cache.append(*(_as_cache_input(t, kv_dtype) for t in (k, v)), num_new)
    keys, values, k_scale, v_scale = _cache_contents(cache)
    out = prefix_attention(q.astype(_query_dtype(kv_dtype)), keys, values, positions, cache.lengths,
                           scale=self.scale, softcap=self.softcap, window=self.window, sinks=params.get("sinks"),
                           k_scale=k_scale, v_scale=v_scale)
    return jnp.einsum("bsnd,ndh->bsh", out.astype(x.dtype), params["wo"]), cache


def _sharing(cache, options: dict, found=None) -> dict:
  """options with the shared prefixes a paged cache's block tables show (`found`, else found here), where the
  cache looks for them (`prefix_groups`; a varlen call, with cu_seqlens_q, reads every sequence's pages itself)."""
  if cache.prefix_groups is None or options.get("cu_seqlens_q") is not None:
    return options
  if found is None:
    max_groups, max_members = cache.prefix_groups
    found = shared_prefix.from_tables(cache.block_tables, cache.lengths, page_size=cache.page_size,
                                      max_groups=max_groups, max_members=max_members)
  return dict(options, shared_prefix=found, plan=None)
