"""KV cache pytrees (contiguous and paged) and appending new tokens' keys and values.

All operations are pure array code usable under jit; with the cache donated
(`jax.jit(step, donate_argnums=...)`) XLA updates the buffers in place.

Quantized caches (int8, float8_e4m3fn, float8_e5m2) hold each value as round(x / scale) in the
one-byte dtype, with `k_scale` / `v_scale` beside the cache: per token and kv head ([B, T, Hkv]
contiguous, [P, page_size, Hkv] paged; computed on append from each new token's max |x| over
head_dim: the accurate choice for int8), or one fixed scale given at creation (a number for the
whole cache or [Hkv] per kv head), or none (scale 1; fp8 only). The ops take them as their
k_scale / v_scale arguments.
Appends are all or nothing per sequence: a sequence whose new tokens do not all fit (past its
capacity, or a position whose page the block table does not hold) stores none of them and keeps
its length. `try_append` returns which sequences took their tokens (`ok` [B]); `append` reports a
refused one in checked mode (`pallas_kv.checked()`), and raises at trace time where the shapes
alone make it certain (more new tokens than the capacity).
Paged sequences may share pages (`PagedKVCache.fork`: parallel sampling, a prefix cache): the
`PagePool` counts the references on each page and frees a page when its last one is dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from pallas_kv import runtime
from pallas_kv import validation


def gather_pages(pages, block_tables):
  """[P, page_size, ...] pages + [B, max_pages] table -> dense [B, max_pages * page_size, ...].

  Page ids are clamped into [0, P), so a bad id reads a real page rather than out of bounds.
  """
  num_pages = pages.shape[0]
  ids = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1)
  dense = pages[ids]  # [B, max_pages, page_size, ...]
  b, m, ps = dense.shape[:3]
  return dense.reshape(b, m * ps, *pages.shape[2:])


# The largest finite magnitude of each one-byte cache dtype: a per-token scale maps max |x| to it.
QUANTIZED_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0,
                 jnp.dtype(jnp.float8_e5m2): 57344.0}
TOKEN_SCALES = "token"  # `scales` argument of the create methods: per token and kv head


def is_quantized(dtype) -> bool:
  return jnp.dtype(dtype) in QUANTIZED_MAX


def default_v_tokens_last(dtype) -> bool:
  """The layout of V that `KVCache.create` / `PagedKVCache.create` build unless told: tokens last for a
  one-byte cache, whose decode reads it faster on every row measured (docs/quantized.md), like k otherwise."""
  return is_quantized(dtype)


def _v_layout(v_tokens_last, dtype) -> bool:
  if v_tokens_last is None:
    return default_v_tokens_last(dtype)
  validation.check_v_tokens_last(v_tokens_last)
  return v_tokens_last


def _relaid_v(v, v_tokens_last: bool, to_tokens_last: bool):
  """v [lead, T, Hkv, D] <-> [lead, Hkv, D, T] (T: capacity or page_size), unchanged if already so laid."""
  validation.check_v_tokens_last(to_tokens_last)
  return v if v_tokens_last == to_tokens_last else validation.relaid_v(v, tokens_last=to_tokens_last)


def quantize(x, dtype, scale=None):
  """x [B, S, Hkv, D] float -> (values in the one-byte `dtype`, the scale used).

  scale None: one per token and kv head, max |x| over D / QUANTIZED_MAX (returned [B, S, Hkv]
  float32; an all-zero row gets scale 1). Else the given scale (a number or [Hkv]) divides x.
  """
  dtype = jnp.dtype(dtype)
  x = x.astype(jnp.float32)
  if scale is None:
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / QUANTIZED_MAX[dtype], 1.0)
    scaled = x / scale[..., None]
  else:
    scale = jnp.asarray(scale, jnp.float32)
    scaled = x / (scale[:, None] if scale.ndim == 1 else scale)
  limit = QUANTIZED_MAX[dtype]
  if jnp.issubdtype(dtype, jnp.integer):
    scaled = jnp.round(scaled)
  return jnp.clip(scaled, -limit, limit).astype(dtype), scale


def _initial_scale(scales, token_shape):
  """The scale field a create method starts with: None, ones of token_shape for TOKEN_SCALES
  (unwritten tokens hold 0, whatever their scale), or the fixed float32 scale given."""
  if scales is None:
    return None
  if isinstance(scales, str):
    if scales != TOKEN_SCALES:
      raise ValueError(f"scales must be None, {TOKEN_SCALES!r}, a number or an [Hkv] array; got {scales!r}")
    return jnp.ones(token_shape, jnp.float32)
  scale = jnp.asarray(scales, jnp.float32)
  if scale.ndim not in (0, 1) or (scale.ndim == 1 and scale.shape[0] != token_shape[-1]):
    raise ValueError(f"a fixed scale must be a number or [Hkv]=({token_shape[-1]},); got shape {scale.shape}")
  return scale


def _as_rank4(x, name: str):
  """[B, Hkv, D] (one token) or [B, S, Hkv, D] -> [B, S, Hkv, D]."""
  if x.ndim == 3:
    return x[:, None]
  if x.ndim == 4:
    return x
  raise ValueError(f"{name} must have rank 3 [B, Hkv, D] or 4 [B, S, Hkv, D]; got shape {tuple(x.shape)}")


def _check_new(name: str, new, batch: int, tail: tuple[int, ...], dtype) -> None:
  if new.shape[0] != batch or tuple(new.shape[2:]) != tail:
    raise ValueError(f"{name} has shape {tuple(new.shape)}; expected [B={batch}, S, {', '.join(map(str, tail))}]")
  if is_quantized(dtype):
    if not jnp.issubdtype(new.dtype, jnp.floating) or is_quantized(new.dtype):
      raise ValueError(f"{name} has dtype {jnp.dtype(new.dtype).name}; a {jnp.dtype(dtype).name} cache takes "
                       "floating-point values and quantizes them")
  elif new.dtype != dtype:
    raise ValueError(f"{name} has dtype {jnp.dtype(new.dtype).name}; the cache holds {jnp.dtype(dtype).name}")


def gather_widened(pages, block_tables, scale, dtype):
  """A latent pool's rows [B, T, D] (`gather_pages`) in `dtype`, times scale: None, a scalar, or per token
  [P, page_size] / [P, page_size, 1], gathered like the pages."""
  rows = gather_pages(pages, block_tables)
  if scale is None:
    return rows.astype(dtype)
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim:
    scale = gather_pages(scale, block_tables).reshape(rows.shape[:2] + (1,))
  return (rows.astype(jnp.float32) * scale).astype(dtype)


def _write(write, cache, scale, new, write_values=None):
  """(cache, scale) after write(array, values) puts new [B, S, Hkv, D] at the new tokens'
  places; a quantized cache stores quantize(new), and per-token scales are written alike.
  write_values, if given, writes the cache itself (v stored tokens last; its scales are not)."""
  write_values = write_values or write
  if not is_quantized(cache.dtype):
    return write_values(cache, new), scale
  per_token = scale is not None and scale.ndim == 3
  fixed = 1.0 if scale is None else scale   # no scale: the values as they are, rounded and clipped
  values, used = quantize(new, cache.dtype, None if per_token else fixed)
  return write_values(cache, values), (write(scale, used) if per_token else scale)


# A static field: the layout of v, part of the cache's type under jit.
_TOKENS_LAST_FIELD = dict(default=False, metadata=dict(static=True))
# A static field: (max groups, max members) of the shared prefixes a paged cache's steps look for in its
# block tables (`pallas_kv.shared_prefix.from_tables`); None: every sequence reads its own pages.
_PREFIX_GROUPS_FIELD = dict(default=None, metadata=dict(static=True))


def _check_prefix_groups(prefix_groups) -> None:
  if prefix_groups is None:
    return
  if (not isinstance(prefix_groups, tuple) or len(prefix_groups) != 2
      or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in prefix_groups)):
    raise ValueError(f"prefix_groups must be None or a tuple (max_groups, max_members) of ints >= 1; "
                     f"got {prefix_groups!r}")


def _new_positions(lengths, num_new: int):
  """[B, S] positions the new tokens take: lengths[b] + s."""
  return lengths[:, None] + jnp.arange(num_new, dtype=lengths.dtype)[None, :]


def _counts(num_new, batch: int, num_tokens: int, capacity: int):
  """The new tokens each sequence appends, int32 [B] (all S where num_new is None); and a
  ValueError where the shapes alone make an append impossible."""
  if num_tokens > capacity:
    raise ValueError(f"{num_tokens} new tokens per sequence cannot fit a cache of capacity {capacity}")
  if num_new is None:
    return jnp.full((batch,), num_tokens, jnp.int32)
  num_new = jnp.asarray(num_new)
  if num_new.shape != (batch,) or not jnp.issubdtype(num_new.dtype, jnp.integer):
    raise ValueError(f"num_new must be an integer array [B={batch}]; got {num_new.dtype} {tuple(num_new.shape)}")
  return jnp.clip(num_new.astype(jnp.int32), 0, num_tokens)


def _taken(fits, counts, num_tokens: int):
  """[B, S] bool: the new tokens that are stored (the first counts[b], where the sequence fits)."""
  return fits[:, None] & (jnp.arange(num_tokens, dtype=jnp.int32)[None, :] < counts[:, None])


def _report_refused(ok, where: str) -> None:
  """In checked mode, a checkify error if some sequence's append was refused."""
  if runtime.checked_enabled():
    checkify.check(jnp.all(ok), f"{where}: a sequence's new tokens do not fit (past its capacity, or on a "
                   "page its block table does not hold: reserve pages first); none of them was stored")


def _paged_fit(block_tables, lengths, counts, page_size: int, num_pages: int, num_tokens: int):
  """(page id, slot) [B, S] of each new token, and fits [B]: every one of the sequence's counts[b]
  new tokens has a page in its table. Page id num_pages (dropped by the scatter) where a token is
  not stored."""
  positions = _new_positions(lengths, num_tokens)
  table_index = positions // page_size
  max_pages = block_tables.shape[1]
  pages = jnp.take_along_axis(block_tables, jnp.clip(table_index, 0, max_pages - 1), axis=1)
  has_page = (positions >= 0) & (table_index < max_pages) & (pages >= 0) & (pages < num_pages)
  wanted = _taken(jnp.ones(lengths.shape, bool), counts, num_tokens)
  fits = jnp.all(has_page | ~wanted, axis=1)
  return jnp.where(_taken(fits, counts, num_tokens), pages, num_pages), positions % page_size, fits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Contiguous cache: k, v [B, T, Hkv, D]; lengths int32 [B] valid tokens per sequence;
  k_scale, v_scale: None, or the scales of a quantized cache ([B, T, Hkv], [Hkv] or a scalar).
  v_tokens_last: v is stored [B, Hkv, D, T] (`decode_attention`'s v_tokens_last; its scales keep
  their shape); `with_v_tokens_last` converts."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  v_tokens_last: bool = dataclasses.field(**_TOKENS_LAST_FIELD)

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16,
             k_scales=None, v_scales=None, v_tokens_last: bool | None = None) -> KVCache:
    """An empty cache. For an int8 / fp8 dtype, k_scales / v_scales: "token" (per token, computed
    on append), a fixed number or [Hkv] array, or None (scale 1). v_tokens_last: store v
    [B, Hkv, D, T]; None (the default): `default_v_tokens_last(dtype)`, tokens last for a one-byte
    cache, whose decode reads it faster (docs/quantized.md)."""
    v_tokens_last = _v_layout(v_tokens_last, dtype)
    shape = (batch, capacity, num_kv_heads, head_dim)
    v_shape = validation.tokens_last_shape(shape) if v_tokens_last else shape
    return cls(jnp.zeros(shape, dtype), jnp.zeros(v_shape, dtype), jnp.zeros((batch,), jnp.int32),
               _initial_scale(k_scales, shape[:3]), _initial_scale(v_scales, shape[:3]), v_tokens_last)

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def with_v_tokens_last(self, v_tokens_last: bool) -> KVCache:
    """This cache with v laid out tokens last ([B, Hkv, D, T]) or like k ([B, T, Hkv, D]): a transposed
    copy of v where the layout changes (the scales keep theirs)."""
    return dataclasses.replace(self, v=_relaid_v(self.v, self.v_tokens_last, v_tokens_last),
                               v_tokens_last=v_tokens_last)

  def append(self, k_new, v_new, num_new=None) -> KVCache:
    """`try_append` that reports a refused sequence in checked mode instead of returning ok."""
    cache, ok = self.try_append(k_new, v_new, num_new)
    _report_refused(ok, "KVCache.append")
    return cache

  def try_append(self, k_new, v_new, num_new=None) -> tuple[KVCache, jax.Array]:
    """Writes S new tokens per sequence ([B, S, Hkv, D] or [B, Hkv, D]) at positions lengths[b] + s.

    num_new: int [B], how many of the S tokens each sequence takes (right-padded prompts); all S
    by default. All or nothing per sequence: one whose tokens would pass the capacity stores none
    and keeps its length. Returns (cache, ok [B] bool: the sequence took its tokens).
    """
    k_new, v_new = _as_rank4(k_new, "k_new"), _as_rank4(v_new, "v_new")
    b, s = self.k.shape[0], k_new.shape[1]
    _check_new("k_new", k_new, b, self.k.shape[2:], self.k.dtype)
    _check_new("v_new", v_new, b, self.k.shape[2:], self.v.dtype)
    counts = _counts(num_new, b, s, self.capacity)
    fits = self.lengths + counts <= self.capacity
    positions = jnp.where(_taken(fits, counts, s), _new_positions(self.lengths, s), self.capacity)  # else dropped
    rows = jnp.arange(b)[:, None]
    write = lambda array, values: array.at[rows, positions].set(values, mode="drop")
    # [B, Hkv, D, T] indexed at (rows, :, :, positions) takes values [B, S, Hkv, D] as they come.
    write_tokens_last = lambda array, values: array.at[rows, :, :, positions].set(values, mode="drop")
    k, k_scale = _write(write, self.k, self.k_scale, k_new)
    v, v_scale = _write(write, self.v, self.v_scale, v_new, write_tokens_last if self.v_tokens_last else None)
    lengths = jnp.where(fits, self.lengths + counts, self.lengths)
    return KVCache(k, v, lengths, k_scale, v_scale, self.v_tokens_last), fits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Paged cache: k_pages, v_pages [P, page_size, Hkv, D]; block_tables int32 [B, max_pages];
  lengths int32 [B]. Token t of sequence b lives at [block_tables[b, t // page_size], t % page_size].
  k_scale, v_scale: None, or the scales of a quantized cache ([P, page_size, Hkv] per token,
  addressed like the pages; [Hkv] or a scalar fixed). v_tokens_last: v_pages is stored
  [P, Hkv, D, page_size] (`paged_decode_attention`'s v_tokens_last; `with_v_tokens_last` converts).
  prefix_groups: (max groups, max members) of forked sequences whose shared pages `DecodeAttention` reads once
  per group (found in the block tables each step, `pallas_kv.shared_prefix.from_tables`), or None."""
  k_pages: jax.Array
  v_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  v_tokens_last: bool = dataclasses.field(**_TOKENS_LAST_FIELD)
  prefix_groups: tuple[int, int] | None = dataclasses.field(**_PREFIX_GROUPS_FIELD)

  def __post_init__(self):
    _check_prefix_groups(self.prefix_groups)

  @classmethod
  def create(cls, batch: int, num_pages: int, page_size: int, max_pages_per_seq: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.bfloat16, k_scales=None, v_scales=None,
             v_tokens_last: bool | None = None, prefix_groups: tuple[int, int] | None = None) -> PagedKVCache:
    """An empty cache: a pool of num_pages pages and block tables with no page assigned (reserve
    pages with `reserve_pages` before appending). k_scales / v_scales / v_tokens_last as in
    `KVCache.create` (by default tokens last for a one-byte cache); prefix_groups as the field."""
    v_tokens_last = _v_layout(v_tokens_last, dtype)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    v_shape = validation.tokens_last_shape(shape) if v_tokens_last else shape
    return cls(jnp.zeros(shape, dtype), jnp.zeros(v_shape, dtype), empty_block_tables(batch, max_pages_per_seq),
               jnp.zeros((batch,), jnp.int32), _initial_scale(k_scales, shape[:3]),
               _initial_scale(v_scales, shape[:3]), v_tokens_last, prefix_groups)

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[1]

  @property
  def capacity(self) -> int:
    return self.block_tables.shape[1] * self.page_size

  def with_v_tokens_last(self, v_tokens_last: bool) -> PagedKVCache:
    """This cache with v_pages laid out tokens last ([P, Hkv, D, page_size]) or like k_pages: a transposed copy
    where the layout changes; page ids and scales are unchanged."""
    return dataclasses.replace(self, v_pages=_relaid_v(self.v_pages, self.v_tokens_last, v_tokens_last),
                               v_tokens_last=v_tokens_last)

  def append(self, k_new, v_new, num_new=None) -> PagedKVCache:
    """`try_append` that reports a refused sequence in checked mode instead of returning ok."""
    cache, ok = self.try_append(k_new, v_new, num_new)
    _report_refused(ok, "PagedKVCache.append")
    return cache

  def try_append(self, k_new, v_new, num_new=None) -> tuple[PagedKVCache, jax.Array]:
    """Writes S new tokens per sequence through the block table at positions lengths[b] + s.

    As `KVCache.try_append`; a sequence also takes none of its tokens where one of them falls on
    a page its block table does not hold (reserve pages first: `reserve_pages`).
    """
    k_new, v_new = _as_rank4(k_new, "k_new"), _as_rank4(v_new, "v_new")
    b, s = self.block_tables.shape[0], k_new.shape[1]
    _check_new("k_new", k_new, b, self.k_pages.shape[2:], self.k_pages.dtype)
    _check_new("v_new", v_new, b, self.k_pages.shape[2:], self.v_pages.dtype)
    counts = _counts(num_new, b, s, self.capacity)
    pages, slots, fits = _paged_fit(self.block_tables, self.lengths, counts, self.page_size,
                                    self.k_pages.shape[0], s)
    write = lambda array, values: array.at[pages, slots].set(values, mode="drop")
    write_tokens_last = lambda array, values: array.at[pages, :, :, slots].set(values, mode="drop")
    k_pages, k_scale = _write(write, self.k_pages, self.k_scale, k_new)
    v_pages, v_scale = _write(write, self.v_pages, self.v_scale, v_new,
                              write_tokens_last if self.v_tokens_last else None)
    lengths = jnp.where(fits, self.lengths + counts, self.lengths)
    return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages, lengths=lengths, k_scale=k_scale,
                               v_scale=v_scale), fits

  def append_reserving(self, pool: PagePool, k_new, v_new) -> tuple[PagedKVCache, PagePool, jax.Array]:
    """Reserves from `pool` the pages S new tokens per sequence need (`reserve_pages`), then appends
    them: the common path, which cannot forget the reservation. All or nothing for the batch, as
    `reserve_pages`: where the pool is short, nothing changes. Returns (cache, pool, ok)."""
    num_tokens = _as_rank4(k_new, "k_new").shape[1]
    pool, tables, reserved = reserve_pages(pool, self.block_tables, self.lengths, num_tokens, self.page_size)
    cache, ok = dataclasses.replace(self, block_tables=tables).try_append(k_new, v_new)
    return cache, pool, reserved & jnp.all(ok)

  def fork(self, pool: PagePool, parents, children) -> tuple[PagedKVCache, PagePool, jax.Array]:
    """Makes each children[k] a copy of sequence parents[k] (int [K] batch rows; the children
    empty) that shares its full pages and holds its own copy of a partly filled last page
    (`fork_sequences`: per-token scales are copied with their page). All or nothing, as
    `fork_sequences`: where the pool is short or a child is not empty, nothing changes. Returns (cache, pool, ok)."""
    pool, tables, lengths, copy_src, copy_dst, ok = fork_sequences(pool, self.block_tables, self.lengths, parents,
                                                                   children, self.page_size)
    copy = lambda pages: copy_pages(pages, copy_src, copy_dst)
    copy_scale = lambda s: copy(s) if s is not None and s.ndim == 3 else s  # fixed scales belong to no page
    return dataclasses.replace(self, k_pages=copy(self.k_pages), v_pages=copy(self.v_pages), block_tables=tables,
                               lengths=lengths, k_scale=copy_scale(self.k_scale),
                               v_scale=copy_scale(self.v_scale)), pool, ok

  def dense_view(self) -> KVCache:
    """A contiguous copy [B, max_pages * page_size, Hkv, D] of what the block tables point at
    (v [B, Hkv, D, max_pages * page_size] with v tokens last)."""
    gather_scale = lambda s: gather_pages(s, self.block_tables) if s is not None and s.ndim == 3 else s
    if self.v_tokens_last:   # pages as k's, gathered, then [B, T, Hkv, D] -> [B, Hkv, D, T]
      v = gather_pages(jnp.moveaxis(self.v_pages, 3, 1), self.block_tables)
      v = jnp.transpose(v, (0, 2, 3, 1))
    else:
      v = gather_pages(self.v_pages, self.block_tables)
    return KVCache(gather_pages(self.k_pages, self.block_tables), v, self.lengths, gather_scale(self.k_scale),
                   gather_scale(self.v_scale), self.v_tokens_last)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
  """Paged MLA cache: one latent head per token. kv_pages [P, page_size, Dqk] (latent + rope),
  block_tables int32 [B, max_pages], lengths int32 [B]; prefix_groups as `PagedKVCache`'s.
  kv_scale: for an int8 / fp8 cache, the scale that widens it (`mla_decode_attention`'s): per token
  [P, page_size] float32, written on append, or a fixed scalar; None: scale 1."""
  kv_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array
  prefix_groups: tuple[int, int] | None = dataclasses.field(**_PREFIX_GROUPS_FIELD)
  kv_scale: jax.Array | None = None

  def __post_init__(self):
    _check_prefix_groups(self.prefix_groups)

  @classmethod
  def create(cls, num_pages: int, page_size: int, head_dim: int, *, batch: int, max_pages_per_seq: int,
             dtype=jnp.bfloat16, scales=None, prefix_groups: tuple[int, int] | None = None) -> PagedLatentCache:
    """An empty paged latent cache with unallocated tables. For an int8 / fp8 dtype, scales: "token" (one per
    token, max |row| / the dtype's largest value, computed on append), a fixed number, or None (scale 1)."""
    if scales is not None and not is_quantized(dtype):
      raise ValueError(f"scales={scales!r} must be None for a {jnp.dtype(dtype).name} latent cache: they widen "
                       "an int8 / fp8 cache")
    scale = _initial_scale(scales, (num_pages, page_size, 1))
    if scale is not None and scale.ndim == 3:
      scale = scale[..., 0]
    elif scale is not None and scale.ndim != 0:
      raise ValueError(f"a fixed latent scale must be a number; got shape {scale.shape}")
    return cls(jnp.zeros((num_pages, page_size, head_dim), dtype), empty_block_tables(batch, max_pages_per_seq),
               jnp.zeros((batch,), jnp.int32), prefix_groups, scale)

  @property
  def page_size(self) -> int:
    return self.kv_pages.shape[1]

  @property
  def capacity(self) -> int:
    return self.block_tables.shape[1] * self.page_size

  def append(self, kv_new, num_new=None) -> PagedLatentCache:
    """`try_append` that reports a refused sequence in checked mode instead of returning ok."""
    cache, ok = self.try_append(kv_new, num_new)
    _report_refused(ok, "PagedLatentCache.append")
    return cache

  def try_append(self, kv_new, num_new=None) -> tuple[PagedLatentCache, jax.Array]:
    """Writes S new latent rows per sequence ([B, S, Dqk] or [B, Dqk]) through the block table;
    all or nothing per sequence, as `PagedKVCache.try_append`. Returns (cache, ok [B])."""
    if kv_new.ndim == 2:
      kv_new = kv_new[:, None]
    if kv_new.ndim != 3:
      raise ValueError(f"kv_new must have rank 2 [B, Dqk] or 3 [B, S, Dqk]; got shape {tuple(kv_new.shape)}")
    b, s = self.block_tables.shape[0], kv_new.shape[1]
    _check_new("kv_new", kv_new[..., None, :], b, (1, self.kv_pages.shape[2]), self.kv_pages.dtype)
    counts = _counts(num_new, b, s, self.capacity)
    pages, slots, fits = _paged_fit(self.block_tables, self.lengths, counts, self.page_size,
                                    self.kv_pages.shape[0], s)
    write = lambda array, rows: array.at[pages, slots].set(rows.reshape(rows.shape[:2] + array.shape[2:]), mode="drop")
    per_token = self.kv_scale is not None and self.kv_scale.ndim == 2
    scale = self.kv_scale[..., None] if per_token else self.kv_scale   # _write's per-token form [P, page_size, 1]
    kv_pages, kv_scale = _write(write, self.kv_pages, scale, kv_new[:, :, None])
    kv_scale = kv_scale[..., 0] if per_token else kv_scale
    return dataclasses.replace(self, kv_pages=kv_pages, kv_scale=kv_scale,
                               lengths=jnp.where(fits, self.lengths + counts, self.lengths)), fits

  def gather(self, dtype) -> jax.Array:
    """Every sequence's latent rows [B, T, Dqk] in `dtype`, widened by kv_scale (zeros past the written rows)."""
    return gather_widened(self.kv_pages, self.block_tables, self.kv_scale, dtype)

  def fork(self, pool: PagePool, parents, children) -> tuple[PagedLatentCache, PagePool, jax.Array]:
    """As `PagedKVCache.fork`. Returns (cache, pool, ok)."""
    pool, tables, lengths, copy_src, copy_dst, ok = fork_sequences(pool, self.block_tables, self.lengths, parents,
                                                                   children, self.page_size)
    kv_scale = self.kv_scale
    if kv_scale is not None and kv_scale.ndim == 2:   # per-token scales travel with their pages
      kv_scale = copy_pages(kv_scale, copy_src, copy_dst)
    return dataclasses.replace(self, kv_pages=copy_pages(self.kv_pages, copy_src, copy_dst), block_tables=tables,
                               lengths=lengths, kv_scale=kv_scale), pool, ok


# ---------------------------------------------------------------------------- page pool

UNALLOCATED = -1  # block table entry of a page not yet assigned


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
  """A pool of P pages: the free ones as a stack (free_pages[:num_free] are free ids) and the
  references held on each page (ref_counts).

  A page's count is the number of block-table entries that hold it (sequences hold exactly the
  pages their lengths need, in block-table order: sequence b holds ceil(lengths[b] / page_size)),
  plus the references taken with `retain_pages`. Sequences share a page by each holding a
  reference (`fork_sequences`); a shared page is full, so no append writes into it. Invariant: a
  page is on the free stack, once, iff its count is 0. All operations are array code (usable
  under jit).
  """
  free_pages: jax.Array  # int32 [P]
  num_free: jax.Array  # int32 []
  ref_counts: jax.Array  # int32 [P]: references held on each page; 0 = free

  @classmethod
  def create(cls, num_pages: int) -> PagePool:
    """Every page free."""
    if num_pages < 1:
      raise ValueError(f"num_pages must be >= 1; got {num_pages}")
    # Reversed so that pages are handed out in increasing order (pops come from the top).
    return cls(jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32), jnp.asarray(num_pages, jnp.int32),
               jnp.zeros((num_pages,), jnp.int32))

  @property
  def num_pages(self) -> int:
    return self.free_pages.shape[0]


def _pages_held(lengths, page_size: int):
  return (jnp.maximum(lengths, 0) + page_size - 1) // page_size


def _page_index(pages, num_pages: int):
  """Page ids as scatter indices: an id outside [0, P) becomes P, which a mode="drop" scatter
  drops (jnp would wrap a negative index around)."""
  pages = jnp.asarray(pages, jnp.int32)
  return jnp.where((pages >= 0) & (pages < num_pages), pages, num_pages)


def empty_block_tables(batch: int, max_pages_per_seq: int):
  """A block table with no page assigned ([B, max_pages] of UNALLOCATED)."""
  return jnp.full((batch, max_pages_per_seq), UNALLOCATED, jnp.int32)


def reserve_pages(pool: PagePool, block_tables, lengths, num_new: int, page_size: int):
  """Assigns the pages that appending num_new tokens to every sequence will need, each with one
  reference (the sequence's).

  All or nothing: if the pool has too few free pages, or a sequence would outgrow its block
  table, nothing changes and ok is False (callers must not append then; check it, e.g. with
  `jax.experimental.checkify` or on the host).

  Returns (pool, block_tables, ok: bool []).
  """
  if num_new < 0:
    raise ValueError(f"num_new must be >= 0; got {num_new}")
  batch, max_pages = block_tables.shape
  held = _pages_held(lengths, page_size)
  needed = _pages_held(lengths + num_new, page_size)
  new_counts = needed - held  # [B]
  total = jnp.sum(new_counts)
  ok = (total <= pool.num_free) & jnp.all(needed <= max_pages)
  first = jnp.cumsum(new_counts) - new_counts  # this sequence's first pop, counted from the top
  max_new = -(-num_new // page_size) + 1  # static bound on new pages per sequence
  tables, ref_counts = block_tables, pool.ref_counts
  rows = jnp.arange(batch)
  for j in range(max_new):
    take = ok & (j < new_counts)
    stack_index = jnp.clip(pool.num_free - 1 - (first + j), 0, pool.num_pages - 1)
    page = pool.free_pages[stack_index]
    column = jnp.where(take, held + j, max_pages)  # out of range: dropped
    tables = tables.at[rows, column].set(page, mode="drop")
    ref_counts = ref_counts.at[jnp.where(take, page, pool.num_pages)].set(1, mode="drop")
  num_free = jnp.where(ok, pool.num_free - total, pool.num_free)
  return PagePool(pool.free_pages, num_free, ref_counts), tables, ok


def retain_pages(pool: PagePool, pages) -> PagePool:
  """Takes one more reference on each listed page (int [...]; an id may repeat, once per
  reference), e.g. for a prefix cache that keeps pages past their sequences. Ids outside [0, P)
  are ignored, and so are free pages: a reference to one would not keep the stack from handing
  it out."""
  index = _page_index(pages, pool.num_pages).reshape(-1)
  held = pool.ref_counts.at[index].get(mode="fill", fill_value=0) > 0
  ref_counts = pool.ref_counts.at[jnp.where(held, index, pool.num_pages)].add(1, mode="drop")
  return dataclasses.replace(pool, ref_counts=ref_counts)


def drop_pages(pool: PagePool, pages) -> PagePool:
  """Drops one reference per listed page (int [...]; an id may repeat, once per reference) and
  pushes each page whose count reaches 0 onto the free stack once, in the order of its first
  listing. Ids outside [0, P) are ignored; a free page's count stays 0."""
  pages = jnp.asarray(pages, jnp.int32).reshape(-1)
  num_pages, num_listed = pool.num_pages, pages.shape[0]
  index = _page_index(pages, num_pages)
  ref_counts = jnp.maximum(pool.ref_counts.at[index].add(-1, mode="drop"), 0)
  freed = (pool.ref_counts > 0) & (ref_counts == 0)  # [P]
  order = jnp.arange(num_listed, dtype=jnp.int32)
  first_listing = jnp.full((num_pages,), num_listed, jnp.int32).at[index].min(order, mode="drop")
  push = (freed.at[index].get(mode="fill", fill_value=False)
          & (first_listing.at[index].get(mode="fill", fill_value=-1) == order))
  slot = jnp.where(push, pool.num_free + jnp.cumsum(push) - 1, num_pages)  # out of range: dropped
  free_pages = pool.free_pages.at[slot].set(pages, mode="drop")
  num_free = (pool.num_free + jnp.sum(push)).astype(jnp.int32)
  return PagePool(free_pages, num_free, ref_counts)


def release_sequences(pool: PagePool, block_tables, lengths, done, page_size: int):
  """Ends finished sequences (done: bool [B]): drops their references to their pages
  (`drop_pages`: a page another sequence or a retain still holds stays allocated) and empties them.

  Returns (pool, block_tables, lengths) with done sequences at length 0 and no pages.
  """
  max_pages = block_tables.shape[1]
  held = _pages_held(lengths, page_size)
  owned = done[:, None] & (jnp.arange(max_pages)[None, :] < held[:, None])  # [B, M]
  pool = drop_pages(pool, jnp.where(owned, block_tables, UNALLOCATED))
  tables = jnp.where(done[:, None], UNALLOCATED, block_tables)
  return pool, tables, jnp.where(done, 0, lengths)


def fork_sequences(pool: PagePool, block_tables, lengths, parents, children, page_size: int):
  """Makes each children[k] a copy of sequence parents[k] (int [K] batch rows) that shares its pages.

  The child takes the parent's length and holds the parent's full pages (one more reference
  each; no copy). A partly filled last page is not shared, since both sequences append into it:
  the child gets a fresh page from the pool there, which the caller fills with a copy of the
  parent's (copy_src[k] -> copy_dst[k]; `PagedKVCache.fork` does both). A parent may have several
  children; a parent of length 0 gives an empty child.

  All or nothing: if a child row holds a token or a page, is a parent or another child, a row is
  out of range, or the pool has too few free pages for the copies, nothing changes and ok is False.

  Returns (pool, block_tables, lengths, copy_src, copy_dst, ok: bool []). copy_src, copy_dst:
  int32 [K] page ids, UNALLOCATED (-1) both where child k needs no copy (a parent of whole pages,
  or ok False); `copy_pages` takes them as they are.
  """
  parents, children = jnp.asarray(parents, jnp.int32), jnp.asarray(children, jnp.int32)
  if parents.ndim != 1 or parents.shape != children.shape:
    raise ValueError(f"parents and children must be int [K] of one shape; got {parents.shape}, {children.shape}")
  batch, max_pages = block_tables.shape
  num_pages = pool.num_pages
  in_range = jnp.all((parents >= 0) & (parents < batch) & (children >= 0) & (children < batch))
  parents, children = jnp.clip(parents, 0, batch - 1), jnp.clip(children, 0, batch - 1)
  distinct = (jnp.sum(children[:, None] == children[None, :]) == children.shape[0]) & ~jnp.any(
      children[:, None] == parents[None, :])
  empty = jnp.all(lengths[children] == 0) & jnp.all(block_tables[children] < 0)
  parent_lengths = jnp.maximum(lengths[parents], 0)
  full = parent_lengths // page_size  # [K] pages shared
  partial = parent_lengths % page_size != 0  # [K] a last page to copy
  num_copies = jnp.sum(partial)
  ok = in_range & distinct & empty & (num_copies <= pool.num_free)

  copying = ok & partial
  pop = jnp.cumsum(partial) - partial  # this child's pop, counted from the top of the stack
  fresh = pool.free_pages[jnp.clip(pool.num_free - 1 - pop, 0, num_pages - 1)]
  parent_rows = block_tables[parents]  # [K, M]
  last = jnp.take_along_axis(parent_rows, jnp.clip(full, 0, max_pages - 1)[:, None], axis=1)[:, 0]
  copy_src = jnp.where(copying, last, UNALLOCATED)
  copy_dst = jnp.where(copying, fresh, UNALLOCATED)

  columns = jnp.arange(max_pages)[None, :]
  shared = ok & (columns < full[:, None])  # [K, M]
  child_rows = jnp.where(shared, parent_rows,
                         jnp.where(copying[:, None] & (columns == full[:, None]), fresh[:, None], UNALLOCATED))
  rows = jnp.where(ok, children, batch)  # out of range: dropped
  tables = block_tables.at[rows].set(child_rows, mode="drop")
  lengths = lengths.at[rows].set(parent_lengths.astype(lengths.dtype), mode="drop")
  ref_counts = pool.ref_counts.at[_page_index(jnp.where(shared, parent_rows, UNALLOCATED), num_pages)].add(
      1, mode="drop")
  ref_counts = ref_counts.at[_page_index(copy_dst, num_pages)].set(1, mode="drop")
  num_free = jnp.where(ok, pool.num_free - num_copies, pool.num_free).astype(jnp.int32)
  return PagePool(pool.free_pages, num_free, ref_counts), tables, lengths, copy_src, copy_dst, ok


def copy_pages(pages, copy_src, copy_dst):
  """pages [P, ...] with page copy_dst[k] set to page copy_src[k] (int [K]); a pair with an id
  outside [0, P) (UNALLOCATED) copies nothing. Any layout whose first axis is the page works
  (v tokens last, per-token scales)."""
  num_pages = pages.shape[0]
  source = pages[jnp.clip(copy_src, 0, num_pages - 1)]
  valid = (copy_src >= 0) & (copy_src < num_pages)
  return pages.at[jnp.where(valid, _page_index(copy_dst, num_pages), num_pages)].set(source, mode="drop")
