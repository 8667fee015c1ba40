r"""Where the Mosaic GPU GQA kernel's time goes, seen from inside: Mosaic GPU's on-device profiler
(`pallas_kv.kernels.mosaic_gpu.trace`) records each warpgroup's entries into and exits from the kernel's regions
with the SM clock.

  python -m benchmarks tools.kernel_trace --variants=pqk+persistent,sk+pqk --shapes=32x4096 --json=$OUT/trace.json
  python -m benchmarks tools.kernel_trace --summarize=DIR      # any machine: the table of traces written before

Each (variant of `kernel_variants.VARIANTS`, shape BxT) runs the op (`decode_attention`, impl mosaic_gpu; heads
32/8, D 128; a bf16 cache at full lengths, `--ragged` or `--length`, or `--kv_dtype` one-byte) once untraced, then
traced (`--calls` calls in a chain: the profiler records a kernel's first launch, cold, and the chain's last call is
warm; `--between_calls=xla_add` puts another kernel between the calls, as a model does): its GQA kernel's trace
(Perfetto JSON, ui.perfetto.dev; the merge launch is not in it) and what it needs to be read (`meta.json`) land
in --out/VARIANT_BxT[_LN]_DTYPE/ (default: beside --json, its name without .json and `_traces`); --json gets the
table's rows. The table: per warpgroup role (consumer N, producer), the mean over programs of the span (first
entry to last exit, thousands of SM cycles: ~2 per µs at the H100's and H200's boost clock), the share of it inside
each region (a region inside one of its own name counted once), the items a program took, its first tile's wait
(the ring's fill), and its first tile's time against a later tile's (from one `qk` entry to the next: a start-up
cost), that first tile on programs that ran first on their SM and on those that ran after another there (a cold
code fetch is the first's alone); the JSON rows add each region's time inside a first tile and a later one.
`truncated`: a program's warpgroup visited regions past --visits (SMEM left over by the kernel bounds it); its
later visits are missing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import json
import os
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from benchmarks import decode as decode_bench
from benchmarks.tools import kernel_variants
from benchmarks.tools import mosaic_one_byte
from pallas_kv import validation
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import trace as kernel_trace
from pallas_kv.kernels.mosaic_gpu.trace import KernelTrace

FLAGS = flags.FLAGS
REGIONS = ("item", "wait_free", "wait_tile", "wait_q", "write_out", "qk", "softmax", "pv", "widen",
           "wait_values", "wait_p", "wait_p_free")   # the last three: the MLA kernel's hand-overs
SMEM_MARGIN_BYTES = 2048   # left free beside the kernel's own SMEM and the trace's buffer
BETWEEN_CALLS = decode_bench.BETWEEN_CALLS   # what runs between chained calls (`chained`)


def role(warpgroup: int, consumers: int) -> str:
  """The kernel's warpgroups: consumers first, then the TMA producer, then a converter (if any)."""
  if warpgroup < consumers:
    return f"consumer {warpgroup}"
  return "producer" if warpgroup == consumers else "converter"


TILE_REGIONS = ("qk", "wait_tile", "widen", "softmax", "pv")   # timed inside a first tile and a later one


def outermost_visits(events: Sequence[dict[str, Any]], lo: float = -np.inf, hi: float = np.inf):
  """(name, entry, exit) of each region visit entered and left within [lo, hi], in order of exit, but for a visit
  inside one of its own name (a region's time counted once)."""
  stack: list[tuple[str, float]] = []
  for event in events:
    if not lo <= event["ts"] <= hi:
      continue
    if event["ph"] == "B":
      stack.append((event["name"], event["ts"]))
      continue
    opened = [k for k, (name, _) in enumerate(stack) if name == event["name"]]
    if not opened:   # entered before lo
      continue
    name, start = stack.pop(opened[-1])
    if not any(open_name == name for open_name, _ in stack):
      yield name, start, event["ts"]


def regions_within(events: Sequence[dict[str, Any]], lo: float, hi: float) -> dict[str, float]:
  """Time in each region (outermost visits of its name) between lo and hi, of regions entered and left there."""
  inside: dict[str, float] = collections.defaultdict(float)
  for name, start, end in outermost_visits(events, lo, hi):
    inside[name] += end - start
  return dict(inside)


def program_summary(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One warpgroup's events ({"name", "ph": "B" / "E", "ts", "pid"}, in order; ts in µs as the trace writes it, i.e.
  thousands of SM cycles after the program's start; pid names the SM): its span, time in each region (outermost
  visits of a name), visits per region, the first visit's time, each `qk` visit's start (all in thousands of
  cycles), its start and SM, the time from its first item's entry to its first tile's (`lead`: Q's rows and the
  item's set-up), and the regions' time inside its first tile and inside its later tiles (a tile: from one `qk`
  entry to the next)."""
  tile_starts = [event["ts"] for event in events if event["name"] == "qk" and event["ph"] == "B"]
  inside: dict[str, float] = collections.defaultdict(float)
  visits: dict[str, int] = collections.defaultdict(int)
  first: dict[str, float] = {}
  for name, start, end in outermost_visits(events):
    inside[name] += end - start
    visits[name] += 1
    first.setdefault(name, end - start)
  span = events[-1]["ts"] - events[0]["ts"] if events else 0.0
  item_starts = [event["ts"] for event in events if event["name"] == "item" and event["ph"] == "B"]
  first_tile = regions_within(events, *tile_starts[:2]) if len(tile_starts) >= 2 else {}
  later_tiles = regions_within(events, tile_starts[1], tile_starts[-1]) if len(tile_starts) >= 3 else {}
  return {"span": span, "inside": dict(inside), "visits": dict(visits), "first": first, "events": len(events),
          "tile_starts": tile_starts, "start": events[0]["ts"] if events else 0.0,
          "sm": events[0].get("pid") if events else None, "first_tile_regions": first_tile,
          "lead": tile_starts[0] - item_starts[0] if tile_starts and item_starts else None,
          "later_tile_regions": {k: v / (len(tile_starts) - 2) for k, v in later_tiles.items()}}


def tile_times(programs: Sequence[dict[str, Any]]) -> tuple[float, float]:
  """(the first tile's time, a later tile's) in thousands of cycles, means over the programs of two or more
  tiles: from one tile's `qk` entry to the next's. A first tile far above the later ones is a start-up cost
  (a cold call's code and data, or the ring's fill); NaN where no program took two tiles."""
  gaps = [np.diff(p["tile_starts"]) for p in programs if len(p["tile_starts"]) >= 2]
  if not gaps:
    return float("nan"), float("nan")
  later = [g[1:].mean() for g in gaps if len(g) > 1]
  return float(np.mean([g[0] for g in gaps])), float(np.mean(later)) if later else float("nan")


def first_on_their_sm(programs: Sequence[dict[str, Any]]) -> list[bool]:
  """Per program: whether it started first of the programs on its SM (the launch's first wave; a later program on
  the SM finds the kernel's code in that SM's caches)."""
  earliest: dict[Any, float] = {}
  for p in programs:
    earliest[p["sm"]] = min(earliest.get(p["sm"], float("inf")), p["start"])
  return [p["start"] == earliest[p["sm"]] for p in programs]


def _mean_or_nan(values) -> float:
  values = list(values)
  return float(np.mean(values)) if values else float("nan")


def summarize(trace: dict[str, Any], meta: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per warpgroup role: means over the programs of `program_summary`'s figures, each region's time as a
  share of the span."""
  per_trace: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    per_trace[event["tid"] - 1].append(event)
  by_role: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
  for index, events in sorted(per_trace.items()):
    warpgroup = index % meta["warpgroups"]
    by_role[role(warpgroup, meta["consumers"])].append(program_summary(events))
  rows = []
  for name, programs in sorted(by_role.items()):
    spans = np.array([p["span"] for p in programs])
    row = {"variant": meta["variant"], "shape": meta["shape"], "role": name, "programs": len(programs),
           "span_kcycles": float(spans.mean()),
           "items": float(np.mean([p["visits"].get("item", 0) for p in programs])),
           "first_wait_tile_kcycles": float(np.mean([p["first"].get("wait_tile", 0.0) for p in programs])),
           "truncated": sum(p["events"] >= 2 * (meta["visits"] - 1) for p in programs)}
    row["first_tile_kcycles"], row["later_tile_kcycles"] = tile_times(programs)
    # A first tile slow only on an SM's first program is the kernel's code fetched cold (`tile_times`).
    firsts = first_on_their_sm(programs)
    for label, wanted in (("sm_first", True), ("sm_later", False)):
      row[f"first_tile_{label}_kcycles"] = _mean_or_nan(
          p["tile_starts"][1] - p["tile_starts"][0] for p, f in zip(programs, firsts)
          if f == wanted and len(p["tile_starts"]) >= 2)
    row["item_to_first_tile_kcycles"] = _mean_or_nan(p["lead"] for p in programs if p["lead"] is not None)
    for region in TILE_REGIONS:
      for when in ("first", "later"):
        row[f"{when}_tile_{region}_kcycles"] = _mean_or_nan(
            p[f"{when}_tile_regions"].get(region, 0.0) for p in programs if p[f"{when}_tile_regions"])
    for region in REGIONS:
      share = [p["inside"].get(region, 0.0) / p["span"] for p in programs if p["span"] > 0]
      row[f"{region}_share"] = float(np.mean(share)) if share else 0.0
    rows.append(row)
  return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  header = (["variant", "shape", "role", "programs", "span", "items", "1st wait", "1st tile", "tile", "1st@SM",
             "1st@SM+"] + list(REGIONS)
            + ["truncated"])
  lines = ["  ".join(header)]
  for r in rows:
    if "role" not in r:
      lines.append(f"{r['variant']}  {r['shape']}  {r['status']}")
      continue
    cells = [r["variant"], r["shape"], r["role"], str(r["programs"]), f"{r['span_kcycles']:.1f}", f"{r['items']:.2f}",
             f"{r['first_wait_tile_kcycles']:.2f}", f"{r['first_tile_kcycles']:.2f}",
             f"{r['later_tile_kcycles']:.2f}", f"{r.get('first_tile_sm_first_kcycles', np.nan):.2f}",
             f"{r.get('first_tile_sm_later_kcycles', np.nan):.2f}"]
    cells += [f"{100 * r[f'{x}_share']:.1f}%" for x in REGIONS]
    lines.append("  ".join(cells + [str(r["truncated"])]))
  return "\n".join(lines) + ("\n(span, 1st wait, 1st tile and tile: thousands of SM cycles; 1st@SM / 1st@SM+: the "
                             "first tile of a program that ran first on its SM / after another there; region "
                             "columns: share of the span)")


def read_traces(directory: str) -> list[dict[str, Any]]:
  """`summarize` of every traced run under directory (its VARIANT_SHAPE folders: meta.json and one trace)."""
  rows = []
  for meta_path in sorted(glob.glob(os.path.join(directory, "*", "meta.json"))):
    with open(meta_path) as f:
      meta = json.load(f)
    traces = sorted(glob.glob(os.path.join(os.path.dirname(meta_path), "*-trace.json")))
    if not traces:
      rows.append({"variant": meta["variant"], "shape": meta["shape"], "status": "no trace written"})
      continue
    if len(traces) < meta.get("calls", 1):   # the last trace would be a cold call's, not the warm one asked for
      rows.append({"variant": meta["variant"], "shape": meta["shape"],
                   "status": f"{len(traces)} traces for {meta['calls']} chained calls: not summarized"})
      continue
    with open(traces[-1]) as f:   # the last call's (names: the kernel's, then the time it was lowered)
      rows += summarize(json.load(f), meta)
  return rows


def profiler_writes(directory: str) -> bool:
  """Whether Mosaic GPU's profiler writes a trace on this machine at all: a one-region kernel, traced into
  directory (the check the tool runs when a traced op wrote none, to tell the profiler from the op's tracing)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu   # imported here: CPU-only runs of the tool need none
  os.makedirs(directory, exist_ok=True)

  def body(x_ref, out_ref):
    with jax.named_scope("add"):
      out_ref[...] = x_ref[...] + 1.0

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                        compiler_params=plgpu.CompilerParams(**KernelTrace(directory, 16).compiler_params()))
  jax.block_until_ready(jax.jit(kernel)(jnp.arange(128, dtype=jnp.float32)))
  jax.effects_barrier()
  return bool(glob.glob(os.path.join(directory, "*-trace.json")))


def trace_visits(smem: mgpu_config.DecodeSmem, wanted: int) -> int:
  """The visits per warpgroup that the SMEM the kernel leaves holds, at most `wanted`."""
  free = mgpu_config.SMEM_CAPACITY_BYTES - SMEM_MARGIN_BYTES - smem.nbytes
  visits = min(wanted, free // (kernel_trace.BYTES_PER_VISIT * smem.num_threads))
  if visits < 16:
    raise ValueError(f"{free} bytes of SMEM left beside the kernel: too few for a trace")
  return int(visits)


def op_case(variant: str, batch: int, seq_len: int, kv_dtype: str, s: kernel_variants.Settings, key,
            length: int | None = None, abstract: bool = False):
  """(complete config, its `DecodeSmem`, the op under that config, its arguments) of a variant at a dense shape:
  bf16, or a one-byte cache stored as the library stores it (V tokens last, per-token scales: the op's last two
  arguments); length: every sequence's (the config is still the shape's, as a call's is); abstract: one-byte
  arguments as ShapeDtypeStructs (enough to lower the op)."""
  fields = dict(kernel_variants.VARIANTS[variant][0])
  rows = s.num_heads // s.num_kv_heads
  if jnp.dtype(kv_dtype) == jnp.bfloat16:
    config, _, args = kernel_variants.dense_kernel_case(s, fields, batch, seq_len, key)
    op = functools.partial(pkv.decode_attention, impl="mosaic_gpu", config=config)
    quantized = {}
  else:
    x = mosaic_one_byte.inputs(batch, seq_len, s.head_dim, jnp.dtype(kv_dtype), abstract=abstract)
    args = (x["q"], x["k"], x["v"], x["lengths"], *x["scales"]["token"])
    problem = validation.validate_dense(*args[:4], v_tokens_last=True)
    partial = kernel_variants.partial_config({k: v for k, v in fields.items()
                                              if k not in ("splits_factor", "plan_ahead")})
    config = mgpu_config.resolve_config(problem, partial, dtype=args[1].dtype)
    quantized = dict(q_dtype=args[0].dtype, k_scale_kind="token", v_scale_kind="token",
                     num_kv_heads=s.num_kv_heads, v_tokens_last=True)

    def op(q, k, v, lengths, k_scale, v_scale):
      return pkv.decode_attention(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale, v_tokens_last=True,
                                  impl="mosaic_gpu", config=config)
  smem = mgpu_config.DecodeSmem.for_call(config, rows=rows, head_dim=s.head_dim, dtype=args[1].dtype, page_size=None,
                                         **quantized)
  if length is not None:
    args = (*args[:3], jnp.full_like(args[3], length), *args[4:])
  return config, smem, op, args


def settings(ragged: bool = False) -> kernel_variants.Settings:
  """The shapes' heads and head dim, traced once each (no timing)."""
  return kernel_variants.Settings(smoke=False, num_heads=32, num_kv_heads=8, head_dim=128, warmup=0, iters=1,
                                  repeats=1, rotate_bytes=0.0, budget_s=0.0, ragged=ragged)


def chained(op, calls: int, between: str = "none"):
  """op(q, *rest) called `calls` times in one function, each call's queries the previous call's output: the calls
  run in order, and each after the first finds the kernel's code, and as much of the cache as L2 kept, as a loop
  of calls does. between="xla_add": an XLA elementwise kernel on the queries between calls, as a model's other
  kernels run between its attention calls (whether another kernel leaves the SMs' code caches cold). Each call is
  its own kernel to the profiler, whose trace file is named when it is lowered."""
  if between not in BETWEEN_CALLS:
    raise ValueError(f"between={between!r}: one of {BETWEEN_CALLS}")

  def run(q, *rest, **keywords):
    for call in range(calls):
      if call and between == "xla_add":
        q = decode_bench.between_kernel(q)
      q = op(q, *rest, **keywords).astype(q.dtype)
    return q
  return run


def trace_run(variant: str, batch: int, seq_len: int, kv_dtype: str, s: kernel_variants.Settings, out: str,
              wanted_visits: int, key, length: int | None = None, calls: int = 1,
              between: str = "none") -> dict[str, Any]:
  """Runs the op of one (variant, shape, cache dtype; every sequence `length` long, if given) untraced, then
  traced (a fresh jit inside `trace.tracing`; `calls` calls in a chain, `chained`) into out/VARIANT_BxT[_LN]_DTYPE/
  (_cN after the shape where calls > 1); returns its meta.json. The profiler records a kernel's first launch only:
  with calls > 1 the table reads the last call's trace (code and data warm, as in a loop of calls)."""
  config, smem, op, args = op_case(variant, batch, seq_len, kv_dtype, s, key, length)
  visits = trace_visits(smem, wanted_visits)
  at = (("" if length is None else f"_L{length}") + ("" if calls == 1 else f"_c{calls}")
        + ("" if between == "none" else f"_{between}"))
  name = f"{variant}_{batch}x{seq_len}{at}_{jnp.dtype(kv_dtype).name}".replace("+", "_")
  jax.block_until_ready(jax.jit(op)(*args))   # compiled, and the data's first touch done
  shape = (kernel_variants.shape_name(batch, seq_len, None) + ("" if length is None else f" L{length}")
           + ("" if calls == 1 else f" call {calls}") + ("" if between == "none" else f" after {between}"))
  meta = {"variant": variant, "shape": shape,
          "kv_dtype": jnp.dtype(kv_dtype).name, "warpgroups": smem.num_threads, "consumers": smem.num_wgs,
          "calls": calls, "between_calls": between, "config": dataclasses.asdict(config)}
  return record_trace(os.path.join(out, name), visits, chained(op, calls, between), args, meta)


def record_trace(directory: str, visits: int, fn, args, meta: dict[str, Any]) -> dict[str, Any]:
  """fn(*args) jitted and run inside `trace.tracing` into directory, with its meta.json (meta, the visits and the
  device added; what `read_traces` reads beside the trace); returns that meta."""
  os.makedirs(directory, exist_ok=True)
  with kernel_trace.tracing(KernelTrace(directory, visits)):
    jax.block_until_ready(jax.jit(fn)(*args))
  jax.effects_barrier()   # the trace is written by a host callback after the kernel
  meta = {**meta, "visits": visits, "device": str(jax.devices()[0].device_kind)}
  with open(os.path.join(directory, "meta.json"), "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def define_flags() -> None:
  flags.DEFINE_list("variants", ["pqk+persistent", "sk+pqk"], f"Of {', '.join(kernel_variants.VARIANTS)}.")
  flags.DEFINE_list("shapes", ["32x4096"], "BxT shapes (dense).")
  flags.DEFINE_boolean("ragged", False, "Lengths uniform in [1, T] instead of full (bfloat16 only).")
  flags.DEFINE_integer("length", None, "Every sequence this long (1 <= length <= each shape's T) in a cache of the "
                       "shape's T, under the shape's config: a short sequence's fixed costs. Not with --ragged.")
  flags.DEFINE_integer("calls", 1, "Calls of the op in one chain (`chained`); the table reads the last one's "
                       "trace: 2 or more for a warm call's timeline (the profiler records a kernel's first launch).",
                       lower_bound=1)
  flags.DEFINE_enum("between_calls", "none", list(BETWEEN_CALLS), "What runs between chained calls: xla_add, an "
                    "XLA elementwise kernel on the queries (as a model's other kernels), with --calls >= 2.")
  flags.DEFINE_enum("kv_dtype", "bfloat16", ["bfloat16", "int8", "float8_e4m3fn"],
                    "The cache: one-byte ones with V tokens last and per-token scales, as the library stores them.")
  flags.DEFINE_integer("visits", 1024, "Region visits recorded per warpgroup, at most (SMEM bounds it).")
  flags.DEFINE_string("out", None, "Folder of the traces (default: beside --json, else bench_out/kernel_trace).")
  flags.DEFINE_string("json", None, "Where the table's rows go as JSON.")
  flags.DEFINE_string("summarize", None, "Only print the table of the traces already under this folder (and write "
                      "its rows to --json).")


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.summarize:
    rows = read_traces(FLAGS.summarize)
    if FLAGS.json:
      with open(FLAGS.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(format_table(rows))
    return 0
  if FLAGS.ragged and FLAGS.kv_dtype != "bfloat16":
    raise app.UsageError("--ragged: a bfloat16 cache only (one-byte caches: full lengths or --length)")
  shapes = [kernel_variants.parse_shape(shape) for shape in FLAGS.shapes]
  if FLAGS.length is not None and (FLAGS.ragged or not all(1 <= FLAGS.length <= t for _, t, _ in shapes)):
    raise app.UsageError(f"--length={FLAGS.length}: every sequence's length, at least 1 and at most each shape's T "
                         f"({', '.join(FLAGS.shapes)}), and not with --ragged")
  if FLAGS.between_calls != "none" and FLAGS.calls < 2:
    raise app.UsageError(f"--between_calls={FLAGS.between_calls}: runs between chained calls; give --calls >= 2")
  if jax.default_backend() != "gpu":
    raise app.UsageError("needs a GPU (the profiler runs in the compiled kernel); --summarize reads traces anywhere")
  unknown = set(FLAGS.variants) - set(kernel_variants.VARIANTS)
  if unknown:
    raise app.UsageError(f"--variants: unknown {sorted(unknown)}; choose from {list(kernel_variants.VARIANTS)}")
  s = settings(ragged=FLAGS.ragged)
  out = FLAGS.out or (FLAGS.json.removesuffix(".json") + "_traces" if FLAGS.json else "bench_out/kernel_trace")
  failed = 0
  for shape, (batch, seq_len, page_size) in zip(FLAGS.shapes, shapes):
    if page_size is not None:
      raise app.UsageError(f"--shapes: {shape}: dense shapes only")
    for variant in FLAGS.variants:
      try:
        meta = trace_run(variant, batch, seq_len, FLAGS.kv_dtype, s, out, FLAGS.visits, jax.random.key(0),
                         FLAGS.length, FLAGS.calls, FLAGS.between_calls)
        print(f"{variant} {shape}: traced, {meta['visits']} visits per warpgroup", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        failed += 1
        print(f"{variant} {shape}: {type(e).__name__}: {str(e).strip()[:300]}", flush=True)
  rows = read_traces(out)
  if any(row.get("status") == "no trace written" for row in rows):
    works = profiler_writes(os.path.join(out, "profiler_check"))
    print("no trace from a traced op; Mosaic GPU's profiler " + ("writes a one-region kernel's trace: the op's "
          "tracing is at fault" if works else "writes none even for a one-region kernel"), flush=True)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=1)
  print(format_table(rows), flush=True)
  return int(failed > 0)


if __name__ == "__main__":
  define_flags()
  app.run(main)
