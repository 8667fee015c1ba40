r"""Multi-GPU scaling of paged decode attention under shard_map (`pallas_kv.sharding`).

Usage (from the repository root, one host with N GPUs):

  python -m benchmarks.scaling --flagfile=configs/scaling_h200.flags --json=scaling.json
  python -m benchmarks.scaling --devices=1,8 --meshes=batch,2x4 --batch=128 --seq_len=32768
  python -m benchmarks.scaling --smoke --json=/tmp/smoke.json     # CPU: 8 host devices, tiny shapes

Llama-3-70B-shaped attention by default: 64 q heads, 8 kv heads, head_dim 128, bf16, a paged
cache with page 64 and shuffled block tables, every sequence at full length. For each case
(batch x context), each device count n of `--devices` (default: 1 and every power of two up to
`len(jax.devices())`) and each split of n into (batch shards, head shards) from `--meshes`
(`batch` = n x 1, `heads` = 1 x n, `balanced` = the split nearest to square, or explicit `BxH`;
head shards must divide the kv heads, batch shards the batch), on a mesh of the first n devices
with axes ("data", "model"):

1. check: `sharded_paged_decode_attention(mesh, impl=--impl)` against the single-device
   `paged_decode_attention` on the same data (the same pools side by side on device 0, each
   batch shard's local page ids offset by its pool, as in tests/test_module.py), relative error
   ||sharded - single|| / ||single|| under 1e-2 for bf16 (1e-5 float32). The check reuses the
   pools already on device 0 for the 1-device baseline and adds only one output, so it runs at
   the full shape (with --impl=xla the float32 reference gathers float32 copies of the whole
   cache: keep such runs small).
2. attention row: device time per decode step by chain difference (benchmarks/timing.py: one
   jitted chain of `--iters` calls and one of 2x, each call's inputs passed with the previous
   output through `lax.optimization_barrier`), median over `--repeats`. Aggregate TB/s = KV bytes
   of all shards / time; per-GPU TB/s = that / n; speedup = 1-device time / time.
3. comm row: the cost of gathering the sharded output to every device (a shard_map of
   `jax.lax.all_gather` over both mesh axes, the output replicated), timed the same way and
   checked against the sharded output; 0 with one device. The attention row repeats it as
   `gather_us`.

Rows print as they finish; a table of all rows prints last. `--json` writes the rows (rewritten
after each mesh, so a run cut short keeps what finished). Exit status 1 if a row errored or
failed its check.

Environment: NVLink SHARP multicast stays off: the module sets `NCCL_NVLS_ENABLE=0` in
`os.environ` before importing jax unless the variable is already set. `--smoke` on a machine
without a GPU also sets `XLA_FLAGS=--xla_force_host_platform_device_count=8` (appended to any
XLA_FLAGS, unless they already set a device count) before jax is imported, and runs tiny shapes
with impl xla on devices 1/2/4/8 end to end.

Memory: the pools of one case live on device 0 for the 1-device baseline and the checks (K and
V: batch x context x kv_heads x head_dim x 2 x itemsize; 32 GiB for 256 x 32768 at 8 x 128
bf16); each mesh adds its shards. configs/scaling_h200.flags states the sizes of its sweep.
"""

from __future__ import annotations

import glob
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before jax/NCCL start

SMOKE_DEVICE_COUNT = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _smoke_requested(argv) -> bool:
  return any(a in ("--smoke", "-smoke") or a.startswith(("--smoke=t", "--smoke=T", "--smoke=1")) for a in argv)


def _gpu_present() -> bool:
  """Whether jax would find a GPU here (checked without importing jax)."""
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
    return False
  return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


if __name__ == "__main__" and _smoke_requested(sys.argv[1:]) and not _gpu_present():
  if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_COUNT_FLAG}={SMOKE_DEVICE_COUNT}").strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import datetime
import functools
import json
import math
import time
import traceback
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from pallas_kv import api as pkv_api
from pallas_kv import sharding

try:
  from benchmarks import timing
except ImportError:  # run as a script: python benchmarks/scaling.py
  import timing  # type: ignore[no-redef]

FLAGS = flags.FLAGS

BATCH_AXIS, HEAD_AXIS = "data", "model"
MESH_NAMES = ("batch", "heads", "balanced")
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}
# Pools are filled in chunks of about this many bytes, so generating a 16 GiB pool needs no
# temporary of its size.
FILL_CHUNK_BYTES = 256 * 2**20
GIB = 2**30


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
    if self.dtype not in TOLERANCE:
      raise ValueError(f"{self.dtype=} must be one of {tuple(TOLERANCE)}")

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


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


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
  chunk = _largest_divisor_at_most(case.num_pages, FILL_CHUNK_BYTES // page_bytes)
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


def relative_error(out, ref) -> float:
  out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if out64.shape != ref64.shape:
    raise ValueError(f"output shape {out64.shape} != reference shape {ref64.shape}")
  return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


@functools.lru_cache(maxsize=None)
def _single_device_op(impl: str):
  return jax.jit(functools.partial(pkv.paged_decode_attention, impl=impl))


def gather_to_all(mesh: jax.sharding.Mesh, out_spec: P):
  """A function taking an output sharded as `out_spec` [B, Hq, D] and returning it replicated on
  every device of the mesh, by `jax.lax.all_gather` over the head axis, then the batch axis."""

  def gather(block):  # [B / batch shards, Hq / head shards, D]
    block = jax.lax.all_gather(block, HEAD_AXIS, axis=1, tiled=True)
    return jax.lax.all_gather(block, BATCH_AXIS, axis=0, tiled=True)

  return jax.shard_map(gather, mesh=mesh, in_specs=(out_spec,), out_specs=P(), check_vma=False)


# ------------------------------------------------------------------ one case


@dataclasses.dataclass(frozen=True)
class RunOptions:
  impl: str = "auto"
  warmup: int = 1
  iters: int = 3
  repeats: int = 3
  rotate_bytes: float = 0.0
  seed: int = 0


def _reason(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _timed(t: timing.Timing) -> dict[str, Any]:
  return dict(time_us=t.median_s * 1e6, min_us=t.min_s * 1e6, samples_us=[s * 1e6 for s in t.samples_s],
              overhead_us=t.overhead_s * 1e6, timer=t.method)


def run_mesh(case: Case, split: tuple[int, int], input_sets: list[tuple], lengths, single_out: np.ndarray,
             local_tables: np.ndarray, opts: RunOptions) -> tuple[dict, dict]:
  """Checks and times the sharded op on one mesh: (attention row fields, comm row fields)."""
  batch_shards, head_shards = split
  n = batch_shards * head_shards
  mesh = make_mesh(batch_shards, head_shards)
  in_specs, out_spec = sharding.paged_specs(False, BATCH_AXIS, HEAD_AXIS)
  tables = jnp.asarray(local_tables)
  placed = [tuple(jax.device_put(a, NamedSharding(mesh, spec))
                  for a, spec in zip((q, k, v, tables, lengths), in_specs)) for q, k, v in input_sets]
  attend = sharding.sharded_paged_decode_attention(mesh, batch_axis=BATCH_AXIS, head_axis=HEAD_AXIS,
                                                   impl=opts.impl)
  # Jitted once and called N times inside the chains: traced and lowered once, not N times.
  attend = jax.jit(attend)
  tol = TOLERANCE[case.dtype]
  out = attend(*placed[0])
  ran = pkv.last_impl()
  rel_err = relative_error(out, single_out)
  attention = dict(status="ok", ran=ran, rel_err=rel_err, check_ok=bool(rel_err <= tol), check_tolerance=tol)
  attention |= _timed(timing.time_jax(attend, placed, warmup=opts.warmup, iters=opts.iters, repeats=opts.repeats))

  gather = jax.jit(gather_to_all(mesh, out_spec))
  gathered = gather(out)
  replicated = gathered.sharding.is_fully_replicated and len(gathered.sharding.device_set) == n
  gather_err = relative_error(gathered, out)
  comm = dict(status="ok", rel_err=gather_err, check_ok=bool(replicated and gather_err == 0.0), check_tolerance=0.0,
              replicated=replicated)
  if n == 1:  # nothing to gather
    comm |= dict(time_us=0.0, min_us=0.0, samples_us=[0.0], overhead_us=0.0, timer="none (1 device)")
  else:
    comm |= _timed(timing.time_jax(gather, [(out,)], warmup=opts.warmup, iters=opts.iters, repeats=opts.repeats))
  return attention, comm


def run_case(case: Case, device_counts: Sequence[int], mesh_specs: Sequence, opts: RunOptions,
             emit) -> list[dict]:
  """Every (device count, mesh) on one case; `emit(row)` is called as each row finishes."""
  splits = [(n, split) for n in device_counts for split in mesh_splits(n, mesh_specs, case.num_kv_heads)]
  rows: list[dict] = []
  base = dataclasses.asdict(case) | dict(impl=opts.impl, kv_bytes=case.kv_bytes, pool_bytes=case.pool_bytes,
                                         out_bytes=case.out_bytes)
  max_n = max((n for n, _ in splits), default=1)
  num_sets = timing.num_rotating_sets(case.pool_bytes / max_n, opts.rotate_bytes)
  key = jax.random.key(opts.seed * 1_000_003 + case.batch * 7919 + case.context)
  try:
    input_sets = make_input_sets(case, key, num_sets)
    lengths = jnp.full((case.batch,), case.context, jnp.int32)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row = base | dict(kind="attention", devices=0, mesh="-", status="error", reason=f"making inputs: {_reason(e)}")
    emit(row)
    return [row]
  single_outs: dict[int, np.ndarray] = {}  # batch shards -> the one-device output on set 0
  one_device_us = None
  for n, (batch_shards, head_shards) in splits:
    mesh_fields = dict(devices=n, mesh=f"{batch_shards}x{head_shards}", batch_shards=batch_shards,
                       head_shards=head_shards, num_sets=num_sets, kv_bytes_per_gpu=case.kv_bytes / n)
    attention = base | dict(kind="attention") | mesh_fields
    comm = base | dict(kind="comm") | mesh_fields
    if case.batch % batch_shards:
      reason = f"batch {case.batch} is not divisible by {batch_shards} batch shards"
      for row in (attention, comm):
        row |= dict(status="n/a", reason=reason)
    else:
      start = time.perf_counter()
      try:
        local_tables = local_block_tables(case, batch_shards, opts.seed + batch_shards)
        if batch_shards not in single_outs:
          q, k, v = input_sets[0]
          tables = jnp.asarray(global_block_tables(case, local_tables, batch_shards))
          single_outs[batch_shards] = np.asarray(_single_device_op(opts.impl)(q, k, v, tables, lengths))
        a_fields, c_fields = run_mesh(case, (batch_shards, head_shards), input_sets, lengths,
                                      single_outs[batch_shards], local_tables, opts)
        attention |= a_fields
        comm |= c_fields
        attention["wall_s"] = time.perf_counter() - start  # check, compiles and timing of both rows
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        for row in (attention, comm):
          row |= dict(status="n/a" if isinstance(e, NotImplementedError) else "error", reason=_reason(e))
    if attention["status"] == "ok":
      seconds = attention["time_us"] * 1e-6
      attention |= dict(tbps=case.kv_bytes / seconds / 1e12 if seconds > 0 else float("nan"))
      attention["tbps_per_gpu"] = attention["tbps"] / n
      if n == 1 and one_device_us is None:
        one_device_us = attention["time_us"]
      attention["speedup"] = one_device_us / attention["time_us"] if one_device_us else None
    if comm["status"] == "ok":
      attention["gather_us"] = comm["time_us"]
      received = case.out_bytes * (n - 1) / n  # bytes each device receives
      comm["gather_gbps_per_gpu"] = received / (comm["time_us"] * 1e-6) / 1e9 if comm["time_us"] > 0 else None
    for row in (attention, comm):
      rows.append(row)
      emit(row)
  return rows


# ------------------------------------------------------------------ output


def _fmt(value, spec: str, width: int) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return f"{'-':>{width}}"
  return f"{value:>{width}{spec}}"


HEADER = (f"{'kind':<10}{'devices':>8}{'mesh':>7}{'batch':>7}{'context':>9}{'time us':>11}{'agg TB/s':>10}"
          f"{'TB/s/GPU':>10}{'speedup':>9}{'gather us':>11}{'rel err':>10}  note")


def format_row(row: dict) -> str:
  head = f"{row['kind']:<10}{row['devices']:>8}{row['mesh']:>7}{row['batch']:>7}{row['context']:>9}"
  if row["status"] != "ok":
    return f"{head}  {row['status']} ({row.get('reason', '')})"
  comm = row["kind"] == "comm"
  notes = []
  if not row["check_ok"]:
    notes.append(f"CHECK FAILED (> {row['check_tolerance']:g})" if not comm else "GATHER CHECK FAILED")
  if row.get("ran") and row["ran"] != row["impl"]:
    notes.append(f"{row['impl']} -> {row['ran']}")
  if comm and row.get("gather_gbps_per_gpu"):
    notes.append(f"{row['gather_gbps_per_gpu']:.1f} GB/s in per GPU")
  if row["timer"] != "chain-diff":
    notes.append(row["timer"])
  return (f"{head}{_fmt(row['time_us'], '.1f', 11)}{_fmt(None if comm else row['tbps'], '.3f', 10)}"
          f"{_fmt(None if comm else row['tbps_per_gpu'], '.3f', 10)}{_fmt(None if comm else row['speedup'], '.2f', 9)}"
          f"{_fmt(row.get('gather_us', row['time_us'] if comm else None), '.1f', 11)}"
          f"{_fmt(row['rel_err'], '.1e', 10)}  " + "; ".join(notes))


def format_table(rows: Sequence[dict]) -> str:
  return "\n".join([HEADER] + [format_row(r) for r in rows])


def failed_rows(rows: Sequence[dict]) -> list[dict]:
  return [r for r in rows if r["status"] == "error" or r.get("check_ok") is False]


def device_description() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()}"


def run(cases: Sequence[Case], device_counts: Sequence[int], mesh_specs: Sequence, opts: RunOptions, *,
        json_path: str | None = None) -> list[dict]:
  """The whole sweep; prints a line per row, then the table; writes JSON as it goes."""
  extra = dict(device=device_description(), jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
               nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
  all_rows: list[dict] = []

  def emit(row):
    row |= extra
    all_rows.append(row)
    print(format_row(row), flush=True)

  print(f"# pallas_kv scaling  device={extra['device']}  jax={jax.__version__}  impl={opts.impl}  "
        f"warmup={opts.warmup} iters={opts.iters} repeats={opts.repeats}  NCCL_NVLS_ENABLE={extra['nccl_nvls_enable']}",
        flush=True)
  print(HEADER, flush=True)
  for case in cases:
    print(f"== B={case.batch} T={case.context} Hq={case.num_heads} Hkv={case.num_kv_heads} D={case.head_dim} "
          f"{case.dtype} page={case.page_size}{' shuffled' if case.shuffle_pages else ''}  "
          f"KV {case.kv_bytes / GIB:.2f} GiB", flush=True)
    run_case(case, device_counts, mesh_specs, opts, emit)
    if json_path:
      with open(json_path, "w") as f:
        json.dump(all_rows, f, indent=1)
  print("\n" + format_table(all_rows), flush=True)
  if json_path:
    print(f"# wrote {len(all_rows)} rows to {json_path}", flush=True)
  return all_rows


# ------------------------------------------------------------------ flags

GPU_BATCHES = (64, 128, 256)
GPU_CONTEXTS = (8192, 32768)
SMOKE = dict(batch=(8,), seq_len=(128,), num_heads=16, num_kv_heads=8, head_dim=32, page_size=16, impl="xla",
             warmup=1, iters=2, repeats=2, rotate_bytes=0.0)


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others').

  Names shared with benchmarks/decode.py mean the same there, so configs/scaling_h200.flags also
  parses as a decode sweep (tests/test_benchmarks.py reads every flagfile that way)."""
  flags.DEFINE_list("devices", None, "Device counts (default: 1 and every power of two up to the device count).")
  flags.DEFINE_list("meshes", list(MESH_NAMES), "Splits of each device count: batch (n x 1), heads (1 x n), "
                    "balanced (nearest to square), or BxH (batch shards x head shards).")
  flags.DEFINE_list("batch", None, f"Batch sizes (crossed with --seq_len; default {GPU_BATCHES}).")
  flags.DEFINE_list("seq_len", None, f"Context lengths: cached tokens per sequence (default {GPU_CONTEXTS}).")
  flags.DEFINE_list("cases", None, "Cases as BATCHxCONTEXT (overrides --batch/--seq_len).")
  flags.DEFINE_integer("num_heads", None, "Query heads (64).")
  flags.DEFINE_integer("num_kv_heads", None, "KV heads (8).")
  flags.DEFINE_integer("head_dim", None, "Head dim (128).")
  flags.DEFINE_integer("page_size", None, "Tokens per page (64).")
  flags.DEFINE_boolean("shuffle_pages", True, "Block tables are random permutations of each shard's pages.")
  flags.DEFINE_enum("dtype", "bfloat16", list(TOLERANCE), "Query and cache dtype.")
  flags.DEFINE_enum("impl", None, list(pkv_api.IMPLS), "Backend of each shard's call (default auto; xla with --smoke).")
  flags.DEFINE_integer("warmup", None, "Warm-up runs of both chains (2).")
  flags.DEFINE_integer("iters", None, "Calls per short chain (10).")
  flags.DEFINE_integer("repeats", None, "Timed samples, median taken (5).")
  flags.DEFINE_float("rotate_bytes", None, "Least KV bytes per GPU of rotating input sets (L2 defeat; default 1.8e8).")
  flags.DEFINE_integer("seed", 0, "Random seed of inputs and tables.")
  flags.DEFINE_boolean("smoke", False, "CPU smoke run: tiny shapes, impl xla, 8 host devices (set before jax starts).")
  flags.DEFINE_string("json", None, "Write all rows as a JSON list here.")


def _ints(values: Sequence[str], name: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise app.UsageError(f"--{name}={','.join(values)} must be integers") from None


def _value(name: str, smoke_default, default):
  value = FLAGS[name].value
  if value is not None:
    return value
  return smoke_default if FLAGS.smoke else default


def cases_from_flags() -> list[Case]:
  shape = dict(num_heads=_value("num_heads", SMOKE["num_heads"], 64),
               num_kv_heads=_value("num_kv_heads", SMOKE["num_kv_heads"], 8),
               head_dim=_value("head_dim", SMOKE["head_dim"], 128),
               page_size=_value("page_size", SMOKE["page_size"], 64),
               dtype=FLAGS.dtype, shuffle_pages=FLAGS.shuffle_pages)
  if FLAGS.cases:
    pairs = []
    for spec in FLAGS.cases:
      parts = spec.lower().split("x")
      if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise app.UsageError(f"case {spec!r} must look like BATCHxCONTEXT, e.g. 64x8192")
      pairs.append((int(parts[0]), int(parts[1])))
  else:
    batches = _ints(FLAGS.batch, "batch") if FLAGS.batch else (SMOKE["batch"] if FLAGS.smoke else GPU_BATCHES)
    contexts = _ints(FLAGS.seq_len, "seq_len") if FLAGS.seq_len else (SMOKE["seq_len"] if FLAGS.smoke
                                                                      else GPU_CONTEXTS)
    pairs = [(b, t) for b in batches for t in contexts]
  try:
    return [Case(b, t, **shape) for b, t in pairs]
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  available = jax.device_count()
  counts = _ints(FLAGS.devices, "devices") if FLAGS.devices else default_device_counts(available)
  too_many = [n for n in counts if n < 1 or n > available]
  if too_many:
    raise app.UsageError(f"--devices={','.join(map(str, counts))}: {too_many} not in 1..{available} "
                         f"(devices here: {device_description()})")
  try:
    mesh_specs = [parse_mesh(m) for m in FLAGS.meshes]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  cpu = jax.default_backend() == "cpu"
  rotate_default = 0.0 if cpu else timing.DEFAULT_ROTATE_BYTES
  opts = RunOptions(impl=_value("impl", SMOKE["impl"], "auto"),
                    warmup=_value("warmup", SMOKE["warmup"], 2),
                    iters=_value("iters", SMOKE["iters"], 10),
                    repeats=_value("repeats", SMOKE["repeats"], 5),
                    rotate_bytes=_value("rotate_bytes", SMOKE["rotate_bytes"], rotate_default),
                    seed=FLAGS.seed)
  rows = run(cases_from_flags(), sorted(set(counts)), mesh_specs, opts, json_path=FLAGS.json)
  failed = failed_rows(rows)
  for r in failed:
    print(f"FAILED: {r['kind']} devices={r['devices']} mesh={r['mesh']} B={r['batch']} T={r['context']}: "
          f"{r.get('reason') or 'rel_err %.3g' % r['rel_err']}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
