"""The case of benchmarks.scaling: a paged cache sharded over a device mesh.

Its shape (`Case`), the meshes of a device count (`mesh_splits`), the inputs on device 0 and
the block tables: each batch shard's page ids are local to its part of the pool, and
`global_block_tables` gives the one-device equivalent the sharded output is checked against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import peers

BATCH_AXIS, HEAD_AXIS = "data", "model"
MESH_NAMES = ("batch", "heads", "balanced")
# Pools are filled in chunks of about this many bytes, so generating a 16 GiB pool needs no
# temporary of its size.
FILL_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape: every sequence holds `context` tokens in shuffled pages of a paged cache."""

  batch: int
  context: int
  num_heads: int = 64
  num_kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 64
  dtype: str = "bfloat16"
  shuffle_pages: bool = True

  def __post_init__(self):
    for name in ("batch", "context", "num_heads", "num_kv_heads", "head_dim", "page_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
    if self.dtype not in cases.DTYPES:
      raise ValueError(f"{self.dtype=} must be one of {cases.DTYPES}")

  @property
  def pages_per_seq(self) -> int:
    return -(-self.context // self.page_size)

  @property
  def num_pages(self) -> int:
    return self.batch * self.pages_per_seq

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def kv_bytes(self) -> int:
    """KV bytes every step reads (all shards): K and V of the valid tokens."""
    return self.batch * self.context * self.num_kv_heads * self.head_dim * 2 * self.itemsize

  @property
  def pool_bytes(self) -> int:
    """Bytes of the K and V pools of one input set (whole pages)."""
    return self.num_pages * self.page_size * self.num_kv_heads * self.head_dim * 2 * self.itemsize

  @property
  def out_bytes(self) -> int:
    return self.batch * self.num_heads * self.head_dim * self.itemsize


# ------------------------------------------------------------------ meshes


def default_device_counts(available: int) -> tuple[int, ...]:
  """1 and every power of two up to `available`."""
  counts, n = [], 1
  while n <= available:
    counts.append(n)
    n *= 2
  return tuple(counts)


def balanced_split(n: int, num_kv_heads: int) -> tuple[int, int] | None:
  """(batch shards, head shards) with head shards dividing n and the kv heads, nearest to square
  (ties: more batch shards)."""
  options = [(n // h, h) for h in range(1, n + 1) if n % h == 0 and num_kv_heads % h == 0]
  if not options:
    return None
  return min(options, key=lambda bh: (abs(math.log(bh[0] / bh[1])), bh[1]))


def parse_mesh(spec: str) -> str | tuple[int, int]:
  """A mesh name of MESH_NAMES, or "BxH" -> (B, H)."""
  spec = spec.strip().lower()
  if spec in MESH_NAMES:
    return spec
  parts = spec.split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"mesh {spec!r} must be one of {MESH_NAMES} or BATCH_SHARDSxHEAD_SHARDS, e.g. 2x4")
  return int(parts[0]), int(parts[1])


def mesh_splits(n: int, specs: Sequence[str | tuple[int, int]], num_kv_heads: int) -> list[tuple[int, int]]:
  """The distinct (batch shards, head shards) splits of n that `specs` name; head shards divide the
  kv heads (splits that do not apply to n are left out)."""
  splits = []
  for spec in specs:
    if spec == "batch":
      split = (n, 1)
    elif spec == "heads":
      split = (1, n)
    elif spec == "balanced":
      split = balanced_split(n, num_kv_heads)
    else:
      split = spec
    if split is None or split[0] * split[1] != n or num_kv_heads % split[1]:
      continue
    if split not in splits:
      splits.append(split)
  return splits


def make_mesh(batch_shards: int, head_shards: int) -> jax.sharding.Mesh:
  """A ("data", "model") mesh of the first batch_shards * head_shards devices."""
  devices = jax.devices()[:batch_shards * head_shards]
  return jax.make_mesh((batch_shards, head_shards), (BATCH_AXIS, HEAD_AXIS),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


# ------------------------------------------------------------------ data


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_pool(key, shape, dtype, chunk_pages):
  """Standard normal [P, ...] filled `chunk_pages` pages at a time (no temporary of the pool's size)."""

  def fill(i, pool):
    block = jax.random.normal(jax.random.fold_in(key, i), (chunk_pages,) + shape[1:], jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(pool, block.astype(dtype), i * chunk_pages, axis=0)

  return jax.lax.fori_loop(0, shape[0] // chunk_pages, fill, jnp.zeros(shape, dtype))


def make_input_sets(case: Case, key, num_sets: int) -> list[tuple]:
  """`num_sets` of (q [B, Hq, D], k_pages, v_pages [P, page, Hkv, D]) on the default device."""
  shape = (case.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
  page_bytes = math.prod(shape[1:]) * case.itemsize
  chunk = peers.largest_divisor_at_most(case.num_pages, max(1, FILL_CHUNK_BYTES // page_bytes))
  dtype = jnp.dtype(case.dtype)
  sets = []
  for set_key in jax.random.split(key, num_sets):
    kq, kk, kv = jax.random.split(set_key, 3)
    q = jax.random.normal(kq, (case.batch, case.num_heads, case.head_dim), jnp.float32).astype(dtype)
    sets.append((q, _random_pool(kk, shape, dtype, chunk), _random_pool(kv, shape, dtype, chunk)))
  return sets


def local_block_tables(case: Case, batch_shards: int, seed: int) -> np.ndarray:
  """int32 [B, pages_per_seq]: batch shard s owns pages [s * P_local, (s + 1) * P_local) of the global
  pool (P_local = P / batch_shards); its sequences' ids are LOCAL to that range (shuffled if asked)."""
  rng = np.random.default_rng(seed)
  local_batch = case.batch // batch_shards
  local_pages = local_batch * case.pages_per_seq
  tables = [rng.permutation(local_pages) if case.shuffle_pages else np.arange(local_pages)
            for _ in range(batch_shards)]
  return np.concatenate(tables).reshape(case.batch, case.pages_per_seq).astype(np.int32)


def global_block_tables(case: Case, local_tables: np.ndarray, batch_shards: int) -> np.ndarray:
  """The one-device equivalent: local ids offset by each batch shard's pool."""
  local_batch = case.batch // batch_shards
  offsets = (np.arange(case.batch) // local_batch * (local_batch * case.pages_per_seq))[:, None]
  return (local_tables + offsets).astype(np.int32)


def gather_to_all(mesh: jax.sharding.Mesh, out_spec: P):
  """A function taking an output sharded as `out_spec` [B, Hq, D] and returning it replicated on
  every device of the mesh, by `jax.lax.all_gather` over the head axis, then the batch axis."""

  def gather(block):  # [B / batch shards, Hq / head shards, D]
    block = jax.lax.all_gather(block, HEAD_AXIS, axis=1, tiled=True)
    return jax.lax.all_gather(block, BATCH_AXIS, axis=0, tiled=True)

  return jax.shard_map(gather, mesh=mesh, in_specs=(out_spec,), out_specs=P(), check_vma=False)
