"""vmap of the kernel impls: the mapped axis folds into the op's batch, one launch.

The kernels see batch through their grid, not through Pallas' batching rules, so each op's
kernel call carries a `jax.custom_batching.custom_vmap` rule (`fold_when_vmapped`) that reshapes
the mapped axis N into the batch (N x B sequences) and runs the op once:

  contiguous   q, k, v, lengths, window_start [N, B, ...] -> [N * B, ...]
  paged        a pool shared by the mapped axis: block tables [N, B, M] -> [N * B, M];
               a pool per element [N, P, ...] -> [N * P, ...] with element n's page ids offset
               by n * P (ids are clamped into [0, P) first, as the op would, so a bad id never
               reaches another element's pages)

Arguments the mapped axis does not touch are broadcast, except where that would copy a cache:
a contiguous cache shared by the mapped axis, a pool batched in K but not V (or scales not like
their pages), sinks or per-head scales that differ along the mapped axis. Those calls loop
(`lax.map`: one launch per element). Per-token scales follow their cache.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

CACHES = ("k", "v")
SCALES = ("k_scale", "v_scale")


def _mapped(x, batched: bool, n: int):
  """x with the leading mapped axis n: as it is if batched, else broadcast."""
  return x if batched else jnp.broadcast_to(x, (n, *jnp.shape(x)))


def _merge(x):
  """[N, B, ...] -> [N * B, ...]."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _split(x, n: int):
  """[N * B, ...] -> [N, B, ...]."""
  return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def _per_token_scales(arrays) -> list[str]:
  """The scales given per token: they have the cache's leading dims ([B, T, Hkv] / [P, ps, Hkv])."""
  return [name for name in SCALES if name in arrays and jnp.ndim(arrays[name]) == 3]


def _per_sequence(arrays) -> tuple[str, ...]:
  """The arguments with one row per sequence: q, lengths and window_start if given."""
  return ("q", "lengths") + (("window_start",) if "window_start" in arrays else ())


def _loops(arrays, batched) -> bool:
  """Whether an argument that is not per sequence varies along the mapped axis (sinks, per-head scales)."""
  unfoldable = ["sinks"] + [name for name in SCALES if name in arrays and jnp.ndim(arrays[name]) <= 1]
  return any(batched.get(name, False) for name in unfoldable if name in arrays)


def fold_dense(n: int, arrays: dict, batched: dict, call: Callable):
  """The contiguous op on arrays mapped over n (batched[name]: has the leading n axis); None to loop."""
  if _loops(arrays, batched) or not all(batched[name] for name in CACHES):
    return None
  folded = dict(arrays)
  for name in _per_sequence(arrays) + CACHES + tuple(_per_token_scales(arrays)):
    folded[name] = _merge(_mapped(arrays[name], batched[name], n))
  return jax.tree_util.tree_map(lambda r: _split(r, n), call(**folded))


def fold_paged(n: int, arrays: dict, batched: dict, call: Callable):
  """The paged op (or MLA, whose latent pool is both k and v) mapped over n; None to loop."""
  pools = list(CACHES) + _per_token_scales(arrays)   # per-token scales are pool-shaped
  pools_batched = {batched[name] for name in pools}
  if _loops(arrays, batched) or len(pools_batched) != 1:
    return None
  folded = dict(arrays)
  for name in _per_sequence(arrays):
    folded[name] = _merge(_mapped(arrays[name], batched[name], n))
  tables = _mapped(arrays["block_tables"], batched["block_tables"], n)
  if pools_batched == {True}:   # a pool per element: stack them, offset each element's ids
    num_pages = arrays["k"].shape[1]
    tables = jnp.clip(tables.astype(jnp.int32), 0, num_pages - 1)
    tables = tables + (jnp.arange(n, dtype=jnp.int32) * num_pages)[:, None, None]
    for name in pools:
      folded[name] = _merge(arrays[name])
  folded["block_tables"] = _merge(tables)
  return jax.tree_util.tree_map(lambda r: _split(r, n), call(**folded))


def fold_when_vmapped(fn: Callable, names: tuple[str, ...], fold: Callable | None):
  """fn(*arrays) (named `names`) on unbatched arrays, with a vmap rule: fold(n, arrays, batched)
  runs the op once on folded arrays, or returns None, and then the mapped axis loops."""
  fn = jax.custom_batching.custom_vmap(fn)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    out = None
    if fold is not None:
      out = fold(axis_size, dict(zip(names, args)), dict(zip(names, in_batched)))
    if out is None:
      batched = [a for a, b in zip(args, in_batched) if b]

      def one(slices):
        it = iter(slices)
        return fn(*[next(it) if b else a for a, b in zip(args, in_batched)])

      out = jax.lax.map(one, batched)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return fn
