"""KV cache pytrees (contiguous and paged) and appending new tokens' keys and values.

All operations are pure array code usable under jit; with the cache donated
(`jax.jit(step, donate_argnums=...)`) XLA updates the buffers in place.
Tokens appended past a sequence's capacity are dropped (never written out of bounds) and
`lengths` still grows, so `lengths > capacity` marks the overflow; the ops' checked mode
(`pallas_kv.checked()`) reports it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kv import reference


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
  if new.dtype != dtype:
    raise ValueError(f"{name} has dtype {jnp.dtype(new.dtype).name}; the cache holds {jnp.dtype(dtype).name}")


def _new_positions(lengths, num_new: int):
  """[B, S] positions the new tokens take: lengths[b] + s."""
  return lengths[:, None] + jnp.arange(num_new, dtype=lengths.dtype)[None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Contiguous cache: k, v [B, T, Hkv, D]; lengths int32 [B] valid tokens per sequence."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (batch, capacity, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def append(self, k_new, v_new) -> KVCache:
    """Writes S new tokens per sequence ([B, S, Hkv, D] or [B, Hkv, D]) at positions lengths[b] + s."""
    k_new, v_new = _as_rank4(k_new, "k_new"), _as_rank4(v_new, "v_new")
    b = self.k.shape[0]
    _check_new("k_new", k_new, b, self.k.shape[2:], self.k.dtype)
    _check_new("v_new", v_new, b, self.v.shape[2:], self.v.dtype)
    positions = _new_positions(self.lengths, k_new.shape[1])
    rows = jnp.arange(b)[:, None]
    k = self.k.at[rows, positions].set(k_new, mode="drop")
    v = self.v.at[rows, positions].set(v_new, mode="drop")
    return KVCache(k, v, self.lengths + k_new.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Paged cache: k_pages, v_pages [P, page_size, Hkv, D]; block_tables int32 [B, max_pages];
  lengths int32 [B]. Token t of sequence b lives at [block_tables[b, t // page_size], t % page_size]."""
  k_pages: jax.Array
  v_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[1]

  @property
  def capacity(self) -> int:
    return self.block_tables.shape[1] * self.page_size

  def _slots(self, num_new: int):
    """(page id, slot) of each new token; the page id is P (dropped) past the table's end."""
    positions = _new_positions(self.lengths, num_new)
    table_index = positions // self.page_size
    in_table = (positions >= 0) & (table_index < self.block_tables.shape[1])
    pages = jnp.take_along_axis(self.block_tables, jnp.clip(table_index, 0, self.block_tables.shape[1] - 1),
                                axis=1)
    pages = jnp.where(in_table, pages, self.k_pages.shape[0])
    return pages, positions % self.page_size

  def append(self, k_new, v_new) -> PagedKVCache:
    """Writes S new tokens per sequence through the block table at positions lengths[b] + s."""
    k_new, v_new = _as_rank4(k_new, "k_new"), _as_rank4(v_new, "v_new")
    b = self.block_tables.shape[0]
    _check_new("k_new", k_new, b, self.k_pages.shape[2:], self.k_pages.dtype)
    _check_new("v_new", v_new, b, self.v_pages.shape[2:], self.v_pages.dtype)
    pages, slots = self._slots(k_new.shape[1])
    k_pages = self.k_pages.at[pages, slots].set(k_new, mode="drop")
    v_pages = self.v_pages.at[pages, slots].set(v_new, mode="drop")
    return PagedKVCache(k_pages, v_pages, self.block_tables, self.lengths + k_new.shape[1])

  def dense_view(self) -> KVCache:
    """A contiguous copy [B, max_pages * page_size, Hkv, D] of what the block tables point at."""
    return KVCache(reference.gather_pages(self.k_pages, self.block_tables),
                   reference.gather_pages(self.v_pages, self.block_tables), self.lengths)
