r"""Multi-GPU scaling of paged decode attention under shard_map (`pallas_kv.sharding`).

Usage (from the repository root, one host with N GPUs):

  python -m benchmarks scaling --flagfile=configs/scaling_h200.flags --json=scaling.json
  python -m benchmarks scaling --devices=1,8 --meshes=batch,2x4 --batch=128 --seq_len=32768
  python -m benchmarks scaling --smoke --json=/tmp/smoke.json     # CPU: 8 host devices, tiny shapes

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
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _smoke_requested(argv) -> bool:
  return any(a in ("--smoke", "-smoke") or a.startswith(("--smoke=t", "--smoke=T", "--smoke=1")) for a in argv)


def _gpu_present() -> bool:
  """Whether jax would find a GPU here (checked without importing jax)."""
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
    return False
  return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


if __name__ == "__main__" and _smoke_requested(sys.argv[1:]) and not _gpu_present():
  if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {DEVICE_COUNT_FLAG}={SMOKE_DEVICE_COUNT}").strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools
import math
import time
import traceback
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
from jax.sharding import NamedSharding
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import cli
from benchmarks import output
from benchmarks import peers
from benchmarks import timing
from benchmarks.tools import shards
import pallas_kv as pkv
from pallas_kv import sharding

FLAGS = flags.FLAGS

# The fields of a timing.Timing that rows carry.
ROW_TIMING_FIELDS = ("time_us", "min_us", "samples_us", "overhead_us", "timer")
GIB = 2**30


# ------------------------------------------------------------------ one case


@functools.lru_cache(maxsize=None)
def _single_device_op(impl: str):
  return jax.jit(functools.partial(pkv.paged_decode_attention, impl=impl))


@dataclasses.dataclass(frozen=True)
class RunOptions:
  impl: str = "auto"
  warmup: int = 1
  iters: int = 3
  repeats: int = 3
  rotate_bytes: float = 0.0
  seed: int = 0


def _timed(t: timing.Timing) -> dict[str, Any]:
  return output.timing_fields(t, ROW_TIMING_FIELDS)


def run_mesh(case: shards.Case, split: tuple[int, int], input_sets: list[tuple], lengths, single_out: np.ndarray,
             local_tables: np.ndarray, opts: RunOptions) -> tuple[dict, dict]:
  """Checks and times the sharded op on one mesh: (attention row fields, comm row fields)."""
  batch_shards, head_shards = split
  n = batch_shards * head_shards
  mesh = shards.make_mesh(batch_shards, head_shards)
  in_specs, out_spec = sharding.paged_specs(False, shards.BATCH_AXIS, shards.HEAD_AXIS)
  tables = jnp.asarray(local_tables)
  placed = [tuple(jax.device_put(a, NamedSharding(mesh, spec))
                  for a, spec in zip((q, k, v, tables, lengths), in_specs)) for q, k, v in input_sets]
  attend = sharding.sharded_paged_decode_attention(mesh, batch_axis=shards.BATCH_AXIS, head_axis=shards.HEAD_AXIS,
                                                   impl=opts.impl)
  # Jitted once and called N times inside the chains: traced and lowered once, not N times.
  attend = jax.jit(attend)
  tol = cases.TOLERANCE[case.dtype]
  out = attend(*placed[0])
  ran = pkv.last_impl()
  rel_err = cases.relative_error(out, single_out)
  attention = dict(status="ok", ran=ran, rel_err=rel_err, check_ok=bool(rel_err <= tol), check_tolerance=tol)
  attention |= _timed(timing.time_jax(attend, placed, warmup=opts.warmup, iters=opts.iters, repeats=opts.repeats))

  gather = jax.jit(shards.gather_to_all(mesh, out_spec))
  gathered = gather(out)
  replicated = gathered.sharding.is_fully_replicated and len(gathered.sharding.device_set) == n
  gather_err = cases.relative_error(gathered, out)
  comm = dict(status="ok", rel_err=gather_err, check_ok=bool(replicated and gather_err == 0.0), check_tolerance=0.0,
              replicated=replicated)
  if n == 1:  # nothing to gather
    comm |= dict(time_us=0.0, min_us=0.0, samples_us=[0.0], overhead_us=0.0, timer="none (1 device)")
  else:
    comm |= _timed(timing.time_jax(gather, [(out,)], warmup=opts.warmup, iters=opts.iters, repeats=opts.repeats))
  return attention, comm


def run_case(case: shards.Case, device_counts: Sequence[int], mesh_specs: Sequence, opts: RunOptions,
             emit) -> list[dict]:
  """Every (device count, mesh) on one case; `emit(row)` is called as each row finishes."""
  splits = [(n, split) for n in device_counts for split in shards.mesh_splits(n, mesh_specs, case.num_kv_heads)]
  rows: list[dict] = []
  base = dataclasses.asdict(case) | dict(impl=opts.impl, kv_bytes=case.kv_bytes, pool_bytes=case.pool_bytes,
                                         out_bytes=case.out_bytes)
  max_n = max((n for n, _ in splits), default=1)
  num_sets = timing.num_rotating_sets(case.pool_bytes / max_n, opts.rotate_bytes)
  key = jax.random.key(opts.seed * 1_000_003 + case.batch * 7919 + case.context)
  try:
    input_sets = shards.make_input_sets(case, key, num_sets)
    lengths = jnp.full((case.batch,), case.context, jnp.int32)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row = base | dict(kind="attention", devices=0, mesh="-", status="error",
                      reason=f"making inputs: {output.error_reason(e)}")
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
        local_tables = shards.local_block_tables(case, batch_shards, opts.seed + batch_shards)
        if batch_shards not in single_outs:
          q, k, v = input_sets[0]
          tables = jnp.asarray(shards.global_block_tables(case, local_tables, batch_shards))
          single_outs[batch_shards] = np.asarray(_single_device_op(opts.impl)(q, k, v, tables, lengths))
        a_fields, c_fields = run_mesh(case, (batch_shards, head_shards), input_sets, lengths,
                                      single_outs[batch_shards], local_tables, opts)
        attention |= a_fields
        comm |= c_fields
        attention["wall_s"] = time.perf_counter() - start  # check, compiles and timing of both rows
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        for row in (attention, comm):
          row |= dict(status="n/a" if isinstance(e, NotImplementedError) else "error", reason=output.error_reason(e))
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


def run(shapes: Sequence[shards.Case], device_counts: Sequence[int], mesh_specs: Sequence, opts: RunOptions, *,
        json_path: str | None = None) -> list[dict]:
  """The whole sweep; prints a line per row, then the table; writes JSON as it goes."""
  extra = output.run_stamp() | dict(nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
  all_rows: list[dict] = []

  def emit(row):
    row |= extra
    all_rows.append(row)
    print(format_row(row), flush=True)

  print(f"# pallas_kv scaling  device={extra['device']}  jax={jax.__version__}  impl={opts.impl}  "
        f"warmup={opts.warmup} iters={opts.iters} repeats={opts.repeats}  NCCL_NVLS_ENABLE={extra['nccl_nvls_enable']}",
        flush=True)
  print(HEADER, flush=True)
  for case in shapes:
    print(f"== B={case.batch} T={case.context} Hq={case.num_heads} Hkv={case.num_kv_heads} D={case.head_dim} "
          f"{case.dtype} page={case.page_size}{' shuffled' if case.shuffle_pages else ''}  "
          f"KV {case.kv_bytes / GIB:.2f} GiB", flush=True)
    run_case(case, device_counts, mesh_specs, opts, emit)
    if json_path:
      output.write_json(all_rows, json_path)
  print("\n" + format_table(all_rows), flush=True)
  output.save(all_rows, json_path=json_path)
  return all_rows


# ------------------------------------------------------------------ flags

GPU_BATCHES = (64, 128, 256)
GPU_CONTEXTS = (8192, 32768)
GPU_TIMING = dict(warmup=2, iters=10, repeats=5)
SMOKE = dict(batch=(8,), seq_len=(128,), num_heads=16, num_kv_heads=8, head_dim=32, page_size=16, impl="xla",
             warmup=1, iters=2, repeats=2, rotate_bytes=0.0)


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others').

  Names shared with benchmarks.decode mean the same there, so configs/scaling_h200.flags also
  parses as a decode sweep (tests/test_benchmarks.py reads every flagfile that way)."""
  flags.DEFINE_list("devices", None, "Device counts (default: 1 and every power of two up to the device count).")
  flags.DEFINE_list("meshes", list(shards.MESH_NAMES), "Splits of each device count: batch (n x 1), heads (1 x n), "
                    "balanced (nearest to square), or BxH (batch shards x head shards).")
  flags.DEFINE_list("batch", None, f"Batch sizes (crossed with --seq_len; default {GPU_BATCHES}).")
  flags.DEFINE_list("seq_len", None, f"Context lengths: cached tokens per sequence (default {GPU_CONTEXTS}).")
  flags.DEFINE_list("cases", None, "Cases as BATCHxCONTEXT (overrides --batch/--seq_len).")
  flags.DEFINE_integer("num_heads", None, "Query heads (64).")
  flags.DEFINE_integer("num_kv_heads", None, "KV heads (8).")
  flags.DEFINE_integer("head_dim", None, "Head dim (128).")
  flags.DEFINE_integer("page_size", None, "Tokens per page (64).")
  flags.DEFINE_boolean("shuffle_pages", True, "Block tables are random permutations of each shard's pages.")
  flags.DEFINE_enum("dtype", "bfloat16", list(cases.DTYPES), "Query and cache dtype.")
  flags.DEFINE_enum("impl", None, list(peers.OUR_IMPLS),
                    "Backend of each shard's call (default auto; xla with --smoke).")
  cli.define_timing_flags({name: f"{value}; --smoke {SMOKE[name]}" for name, value in GPU_TIMING.items()})
  flags.DEFINE_float("rotate_bytes", None, "Least KV bytes per GPU of rotating input sets (L2 defeat; default 1.8e8).")
  flags.DEFINE_integer("seed", 0, "Random seed of inputs and tables.")
  flags.DEFINE_boolean("smoke", False, "CPU smoke run: tiny shapes, impl xla, 8 host devices (set before jax starts).")
  cli.define_output_flags(("json",))
  flags.adopt_module_key_flags(cli)


def _value(name: str, smoke_default, default):
  value = FLAGS[name].value
  if value is not None:
    return value
  return smoke_default if FLAGS.smoke else default


def cases_from_flags() -> list[shards.Case]:
  """The cases the flags ask for; ValueError for values that make none."""
  shape = dict(num_heads=_value("num_heads", SMOKE["num_heads"], 64),
               num_kv_heads=_value("num_kv_heads", SMOKE["num_kv_heads"], 8),
               head_dim=_value("head_dim", SMOKE["head_dim"], 128),
               page_size=_value("page_size", SMOKE["page_size"], 64),
               dtype=FLAGS.dtype, shuffle_pages=FLAGS.shuffle_pages)
  if FLAGS.cases:
    pairs = cli.parse_cases(FLAGS.cases, form="BATCHxCONTEXT", example="64x8192")
  else:
    batches = cli.parse_ints(FLAGS.batch, "batch") if FLAGS.batch else (SMOKE["batch"] if FLAGS.smoke else GPU_BATCHES)
    contexts = cli.parse_ints(FLAGS.seq_len, "seq_len") if FLAGS.seq_len else (SMOKE["seq_len"] if FLAGS.smoke
                                                                               else GPU_CONTEXTS)
    pairs = cli.cross_cases(batches, contexts)
  return [shards.Case(b, t, **shape) for b, t in pairs]


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  available = jax.device_count()
  try:
    counts = cli.parse_ints(FLAGS.devices, "devices") if FLAGS.devices else shards.default_device_counts(available)
    mesh_specs = [shards.parse_mesh(m) for m in FLAGS.meshes]
    shapes = cases_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  too_many = [n for n in counts if n < 1 or n > available]
  if too_many:
    raise app.UsageError(f"--devices={','.join(map(str, counts))}: {too_many} not in 1..{available} "
                         f"(devices here: {output.device_description()})")
  cpu = jax.default_backend() == "cpu"
  rotate_default = 0.0 if cpu else timing.DEFAULT_ROTATE_BYTES
  timing_defaults = {name: SMOKE[name] for name in GPU_TIMING} if FLAGS.smoke else GPU_TIMING
  opts = RunOptions(impl=_value("impl", SMOKE["impl"], "auto"),
                    **timing_defaults | cli.timing_flags().given(),
                    rotate_bytes=_value("rotate_bytes", SMOKE["rotate_bytes"], rotate_default),
                    seed=FLAGS.seed)
  rows = run(shapes, sorted(set(counts)), mesh_specs, opts, json_path=cli.output_paths().json)
  return output.report_failures(
      output.failed_rows(rows),
      lambda r: f"{r['kind']} devices={r['devices']} mesh={r['mesh']} B={r['batch']} T={r['context']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
