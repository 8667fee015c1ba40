"""Tuned kernel configs per device kind: the file format, loading and the nearest-shape lookup.

`benchmarks/tune.py` writes `<dir>/<device slug>.json`; the backends' configs consult it when no
explicit config is given (explicit > tuned > heuristic). The directory is `pallas_kv/tuned/`
(shipped with the package) unless the environment variable PALLAS_KV_TUNED_DIR names another.

A file holds entries {"backend", "key": {...}, "config": {...}}. A lookup matches the key's
exact fields (op, head_dim, group size, new tokens, page size, dtype, v's layout) and, among those, takes the
entry nearest in log2(batch x kv heads) and log2(capacity); entries further than
MAX_LOG2_DISTANCE away are ignored, so a far shape falls back to the heuristic.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re

from pallas_kv import runtime
from pallas_kv import config as kernel_configs

TUNED_DIR_ENV_VAR = "PALLAS_KV_TUNED_DIR"
FORMAT_VERSION = 2   # 2: each entry's config holds only its kernel's fields
MAX_LOG2_DISTANCE = 2.0
EXACT_FIELDS = ("op", "head_dim", "group_size", "num_queries", "page_size", "dtype", "v_tokens_last")
# A key field that older files leave out, and the value it had there.
_DEFAULTS = {"v_tokens_last": False}


def tuned_dir() -> pathlib.Path:
  override = os.environ.get(TUNED_DIR_ENV_VAR)
  return pathlib.Path(override) if override else pathlib.Path(__file__).parent / "tuned"


def device_slug(device_kind: str) -> str:
  """'NVIDIA H200' -> 'nvidia_h200' (the file name of a device kind)."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def shape_key(op: str, problem, dtype) -> dict:
  """The key of a call: exact fields plus the sizes that the nearest-shape match uses."""
  import jax.numpy as jnp
  return dict(op=op, head_dim=problem.head_dim, group_size=problem.group_size, num_queries=problem.num_queries,
              page_size=problem.page_size, dtype=jnp.dtype(dtype).name,
              v_tokens_last=bool(problem.v_tokens_last), programs=problem.batch * problem.num_kv_heads,
              capacity=problem.capacity)


def _field(key: dict, name: str):
  return key.get(name, _DEFAULTS.get(name))


def key_id(key: dict) -> str:
  """A key as one string, the fields older files leave out filled in: two entries of one shape share it."""
  return json.dumps(_DEFAULTS | key, sort_keys=True)


def _distance(a: dict, b: dict) -> float:
  return (abs(math.log2(a["programs"]) - math.log2(b["programs"])) +
          abs(math.log2(a["capacity"]) - math.log2(b["capacity"])))


@functools.lru_cache(maxsize=None)
def _load(path: str) -> tuple:
  p = pathlib.Path(path)
  if not p.exists():
    return ()
  data = json.loads(p.read_text())
  if data.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{p}: format_version {data.get('format_version')!r}; expected {FORMAT_VERSION}")
  return tuple(data["entries"])


def clear_cache() -> None:
  _load.cache_clear()


def nearest_entry(backend: str, key: dict, device_kind: str) -> tuple[dict, float] | None:
  """(entry, distance) of the nearest entry of this backend matching key's exact fields, or None."""
  entries = _load(str(tuned_dir() / f"{device_slug(device_kind)}.json"))
  best, best_distance = None, MAX_LOG2_DISTANCE
  for entry in entries:
    if entry["backend"] != backend or any(_field(entry["key"], f) != _field(key, f) for f in EXACT_FIELDS):
      continue
    distance = _distance(entry["key"], key)
    if distance <= best_distance:
      best, best_distance = entry, distance
  return None if best is None else (best, best_distance)


def lookup(backend: str, key: dict, device_kind: str):
  """The tuned config (the backend's config type for key's op) of the nearest matching entry, or None."""
  found = nearest_entry(backend, key, device_kind)
  if found is None:
    return None
  entry, distance = found
  config = kernel_configs.config_type(backend, key["op"])(**entry["config"])
  if distance > 0:  # the split count was tuned for another size: let the heuristic refit it
    config = config.for_another_size()
  return config


def tuned_config(backend: str, problem, dtype, device_kind: str | None = None):
  """The tuned config of `backend` for this call on the local (or named) device kind, if any."""
  op = "decode" if problem.page_size is None else "paged"
  return lookup(backend, shape_key(op, problem, dtype), device_kind or runtime.device_kind())


def fastest_backend(backends, key: dict, device_kind: str) -> str | None:
  """Among backends tuned on the same nearest shape, the one that measured fastest (else None): the least time
  at full lengths plus, where every entry has one, on ragged lengths (`ragged_time_us`); a tie goes to
  Mosaic GPU, the backend jax keeps (Pallas Triton is deprecated)."""
  found = {b: nearest_entry(b, key, device_kind) for b in backends}
  entries = {b: f[0] for b, f in found.items() if f is not None and "time_us" in f[0]}
  if len(entries) < 2 or len({key_id(e["key"]) for e in entries.values()}) != 1:
    return None  # nothing to compare, or tuned on different shapes
  ragged = all("ragged_time_us" in e for e in entries.values())
  total = {b: e["time_us"] + (e["ragged_time_us"] if ragged else 0.0) for b, e in entries.items()}
  return min(total, key=lambda b: (total[b], b != "mosaic_gpu"))


def write(path, device_kind: str, entries: list[dict], **metadata) -> None:
  """Writes a tuned file: entries are {"backend", "key", "config": a kernel config or its dict, ...}."""
  rows = []
  for entry in entries:
    config = entry["config"]
    rows.append(entry | {"config": config.given() if isinstance(config, kernel_configs.KernelConfig) else config})
  data = dict(format_version=FORMAT_VERSION, device_kind=device_kind, **metadata, entries=rows)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
  clear_cache()
