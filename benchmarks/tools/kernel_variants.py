r"""Mosaic GPU decode kernel variants side by side: one GPU call measures them all.

Usage (from the repository root; GPU, <= ~6 minutes on an H200 including compiles):

  PYTHONPATH=. python3 -m benchmarks.tools.kernel_variants --json=$OUT/variants.json
  PYTHONPATH=. python3 -m benchmarks.tools.kernel_variants --smoke      # CPU, interpret mode, < 1 min

What it times (heads 32/8, head_dim 128, bf16, full lengths; benchmarks/timing.py chain-diff,
input sets rotated to overflow L2):
  op rows      the full op `pallas_kv.decode_attention(..., impl="mosaic_gpu", config=...)` (and
               `paged_decode_attention`, page 16, shuffled) for each variant of VARIANTS, on
               (B, T) in (1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 4096) and paged at
               B=8 and B=128. `baseline` runs first and `baseline_again` last in each shape:
               their spread is the noise. Every op row is checked against the float32 reference.
  probe rows   the kernel alone (`decode_partials`, no combine) at B=128 and B=1: `kernel` is
               the baseline kernel, `probe:*` leave out one consumer stage (results wrong by
               design, not checked). kernel vs baseline at B=1 = the combine's share. `plan` is
               the plan made ahead alone (XLA; for stream-K the walk's sums, which a call's own plan
               leaves to its programs). `kernel+triton_merge`, `kernel+mosaic_merge` and `kernel+xla_merge`
               add a merge launch: the op's (Triton's), where Pallas Triton is gone (Mosaic GPU's), XLA's.
`--shapes=16x32768,8x8192p16` runs other shapes, `--ragged` with lengths uniform in [1, T].
`--probe_shapes='B32 T4096,B64 T2048'` moves the kernel-only rows to other shapes, `--probe_variant=pqk+persistent`
gives them that variant's config (the tuned one at B >= 8) instead of the heuristic's.
`--load_path` adds `loads:*` rows on the probe shapes: the `loads_only` probe under each ring
shape of LOAD_PATH (tile tokens x stages, persistent, two rings); `--variants=none --load_path`
runs only the kernel-only rows (~2 minutes).
Shapes run in order of interest; once `--budget_s` is spent the rest are recorded as skipped.
Prints one table (variant x shape, TB/s of the bytes moved as in benchmarks.decode) at the end
and writes every row to --json. Exit status 1 if a non-probe variant errors or fails the check.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from benchmarks import cases
from benchmarks import cli
from benchmarks import output
from benchmarks import timing
from pallas_kv import experimental
from pallas_kv import runtime
from pallas_kv import validation
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.mosaic_gpu import backend as mgpu_backend
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode

FLAGS = flags.FLAGS

# name -> (MosaicGPUConfig fields, shapes it runs on: None = all); splits_factor scales the heuristic's
# split count. The backend fills what a variant leaves out (its heuristic, around the given fields).
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...] | None]] = {
    "baseline": ({}, None),
    "pipeline_qk": ({"pipeline_qk": True}, None),
    "persistent": ({"persistent": True}, None),
    "pqk+persistent": ({"pipeline_qk": True, "persistent": True}, None),
    "bkv128_st3": ({"block_kv": 128, "num_stages": 3}, None),
    "kv_groups2": ({"kv_groups": 2}, ("B1 T32768", "B8 T8192", "B8 T8192 p16")),
    "kv_groups3": ({"kv_groups": 3}, ("B1 T32768", "B8 T8192", "B8 T8192 p16")),
    "queries_as_n128": ({"queries_as_n": True, "block_kv": 128}, ()),   # fp8 only: traced (`kernel_trace`), not here
    "splits1": ({"num_splits": 1}, ()),     # traced only: a sequence's first-tile cost against its split count
    "splits8": ({"num_splits": 8}, ()),
    "splits32": ({"num_splits": 32}, ()),
    # Every tile through the masked step, one tile loop's code (`experimental.MosaicGPUVariantConfig`): traced only.
    "one_loop": ({"one_tile_loop": True}, ()),
    "tile_consumers2": ({"tile_consumers": 2}, None),
    "tc2+pqk+persistent": ({"tile_consumers": 2, "pipeline_qk": True, "persistent": True}, None),
    "pqk+persistent+lf": ({"pipeline_qk": True, "persistent": True, "sequence_order": "longest_first"}, None),
    "longest_first": ({"sequence_order": "longest_first"}, None),
    # Stream-K: the persistent programs walk equal shares of the batch's tiles (pieces: the heuristic's).
    "stream_k": ({"split_plan": "stream_k"}, None),
    "sk+pqk": ({"split_plan": "stream_k", "pipeline_qk": True}, None),
    "sk+tc2+pqk": ({"split_plan": "stream_k", "tile_consumers": 2, "pipeline_qk": True}, None),
    # sk+pqk with its walk made ahead in XLA inside the timed step (`pallas_kv.plan_splits`), as before the kernel
    # planned its own walk: two launches before the kernel.
    "sk+pqk+ahead": ({"split_plan": "stream_k", "pipeline_qk": True, "plan_ahead": True}, None),
    # sk+pqk with the programs' own walk, two loops over the batch, unrolled 1 / 8 (the shipped) / B steps
    # (`experimental.MosaicGPUVariantConfig.walk_unroll`; B: straight-line code, the walk shipped up to B32 before).
    "sk+pqk+loop1": ({"split_plan": "stream_k", "pipeline_qk": True, "walk_unroll": 1}, None),
    "sk+pqk+loop8": ({"split_plan": "stream_k", "pipeline_qk": True, "walk_unroll": 8}, None),
    "sk+pqk+straight": ({"split_plan": "stream_k", "pipeline_qk": True, "walk_unroll": 1 << 16}, None),
    "splits_x2": ({"splits_factor": 2}, ("B1 T32768", "B8 T8192")),
    # Twice the work items at the same bytes: the time it adds over pqk+persistent, per extra item a program
    # streams, is what an item boundary costs (q's load, the first score, the partial's store).
    "pqk+persistent+splits_x2": ({"pipeline_qk": True, "persistent": True, "splits_factor": 2},
                                 ("B32 T4096", "B64 T2048", "B128 T4096")),
    # The queries as wgmma N over a 16-bit cache (<= 16 packed rows): 16 query columns instead of 64 padded rows.
    "asn": ({"queries_as_n": True}, None),
    "asn+pqk": ({"queries_as_n": True, "pipeline_qk": True}, None),
    "asn128+pqk": ({"queries_as_n": True, "block_kv": 128, "pipeline_qk": True}, None),
    "asn+pqk+persistent": ({"queries_as_n": True, "pipeline_qk": True, "persistent": True}, None),
    "asn+sk+pqk": ({"queries_as_n": True, "split_plan": "stream_k", "pipeline_qk": True}, None),
    "baseline_again": ({}, None),
}
PROBE_SHAPES = ("B128 T4096", "B1 T32768")


@dataclasses.dataclass(frozen=True)
class ProbeMath(mgpu_decode.TileMath):
  """The kernel's tile math with some stages left out: MEASUREMENT ONLY, results wrong by design.

  skip: any of "qk" (no Q K^T wgmma), "softmax" (P = the raw scores), "pv" (no P V wgmma). The
  consumer still waits for and releases every K and V slot, so the load ring runs as in the kernel.
  """
  skip: frozenset[str] = frozenset()

  def qk(self, s_ref, q_tile, k_tile):
    if "qk" not in self.skip:
      super().qk(s_ref, q_tile, k_tile)

  def softmax(self, s, acc, m_i, l_i, *, st, **where):
    if "softmax" in self.skip:
      return acc, m_i, l_i, s.astype(st.q_dtype)
    return super().softmax(s, acc, m_i, l_i, st=st, **where)

  def pv(self, acc, p16, v_tile, p_smem=None):
    if "pv" in self.skip:
      return acc
    return super().pv(acc, p16, v_tile, p_smem)


# Each leaves out consumer stages so that a kernel-only row tells where the time goes.
# loads_only also reaches the fp8-operand consumers, which have no per-stage hooks (`TileMath.loads_only`).
PROBES = {name: ProbeMath(name=f"probe_{name}", skip=frozenset(skip), loads_only=name == "loads_only")
          for name, skip in (
    ("no_qk", {"qk"}), ("no_softmax", {"softmax"}), ("no_pv", {"pv"}), ("loads_only", {"qk", "softmax", "pv"}))}
# --load_path: the `loads_only` probe (the kernel's TMA ring with no math) under other ring
# shapes, on PROBE_SHAPES. The full kernel reads within ~2% of its loads-only rate at B=128
# (benchmarks/NOTES.md), so the ring shape that streams fastest is the kernel's ceiling.
LOAD_PATH: dict[str, dict[str, Any]] = {
    "bkv64_st4": {"block_kv": 64, "num_stages": 4},      # the shipped ring
    "bkv64_st2": {"block_kv": 64, "num_stages": 2},
    "bkv64_st6": {"block_kv": 64, "num_stages": 6},
    "bkv64_st3": {"block_kv": 64, "num_stages": 3},
    "bkv128_st2": {"block_kv": 128, "num_stages": 2},
    "bkv128_st3": {"block_kv": 128, "num_stages": 3},
    "bkv64_st4_persistent": {"block_kv": 64, "num_stages": 4, "persistent": True},
    "bkv64_st4_kvg2": {"block_kv": 64, "num_stages": 4, "kv_groups": 2},
}

# (batch, seq_len, page_size), in the order they run (most informative first).
GPU_SHAPES = ((128, 4096, None), (64, 2048, None), (1, 32768, None), (32, 4096, None),
              (8, 8192, None), (128, 4096, 16), (8, 8192, 16))
SMOKE_SHAPES = ((1, 128, None), (1, 128, 16))
SMOKE_PROBE_SHAPES = ("B1 T128",)
# In --smoke, the paged shape runs only these (interpret mode is slow; the tests cover the rest).
SMOKE_PAGED_VARIANTS = ("baseline", "pqk+persistent")
# Same code paths as others; stream-K's heuristic walk at B1 has 63 programs, slow to interpret (tests cover it).
SMOKE_SKIPPED_VARIANTS = ("splits_x2", "baseline_again", "stream_k", "sk+pqk", "sk+tc2+pqk", "sk+pqk+ahead",
                          "sk+pqk+loop1", "sk+pqk+loop8", "sk+pqk+straight",
                          "pqk+persistent+splits_x2", "queries_as_n128", "asn", "asn128+pqk", "asn+pqk+persistent",
                          "asn+sk+pqk")
# --warmup, --iters, --repeats on a GPU unless given (--smoke runs each call once, untimed).
GPU_TIMING = {"warmup": 2, "iters": 20, "repeats": 5}
# The fields of a timing.Timing that rows carry.
ROW_TIMING_FIELDS = ("time_us", "min_us", "samples_us", "timer")


def parse_shape(text: str) -> tuple[int, int, int | None]:
  """(batch, seq_len, page_size or None) of "BxT" or "BxTpPAGE"."""
  case, _, page = text.strip().lower().partition("p")
  try:
    [(batch, seq_len)] = cli.parse_cases([case], form="BxT or BxTpPAGE", example="8x8192p16")
    return batch, seq_len, int(page) if page else None
  except ValueError as e:
    raise app.UsageError(f"--shapes: {e}") from None


def shape_name(batch: int, seq_len: int, page_size: int | None) -> str:
  return f"B{batch} T{seq_len}" + (f" p{page_size}" if page_size else "")


@dataclasses.dataclass(frozen=True)
class Settings:
  smoke: bool
  num_heads: int
  num_kv_heads: int
  head_dim: int
  warmup: int
  iters: int
  repeats: int
  rotate_bytes: float
  budget_s: float
  probe_fields: tuple[tuple[str, Any], ...] = ()   # the config fields of the kernel-only rows
  ragged: bool = False   # lengths uniform in [1, T] (`cases.make_lengths`), not full


def _case(s: Settings, batch: int, seq_len: int, page_size: int | None) -> cases.Case:
  return cases.Case(
      op="decode" if page_size is None else "paged", batch=batch, seq_len=seq_len,
      num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
      v_head_dim=s.head_dim, num_queries=1, page_size=page_size or 16, shuffle_pages=True,
      dtype="bfloat16", ragged=s.ragged)


def _problem(args: tuple, paged: bool):
  return validation.validate_paged(*args) if paged else validation.validate_dense(*args)


def partial_config(fields: dict[str, Any]) -> pkv.MosaicGPUConfig:
  """A variant's config fields as a partial config: `experimental.MosaicGPUVariantConfig` where one of them is
  an experimental variant's."""
  shipped = {field.name for field in dataclasses.fields(pkv.MosaicGPUConfig)}
  return (pkv.MosaicGPUConfig if set(fields) <= shipped else experimental.MosaicGPUVariantConfig)(**fields)


def _config(fields: dict[str, Any], args: tuple, paged: bool) -> pkv.MosaicGPUConfig:
  """The complete config of a variant: its fields over the backend's choice (`resolve_config`),
  the split count the heuristic's times splits_factor (a multiple of the KV groups)."""
  fields = dict(fields)
  factor = fields.pop("splits_factor", 1)
  fields.pop("plan_ahead", None)
  config = mgpu_config.resolve_config(_problem(args, paged), partial_config(fields), dtype=args[1].dtype)
  splits = config.num_splits * factor
  groups = config.kv_groups
  splits = max(groups, split_plan.round_up(splits, groups))
  return dataclasses.replace(config, num_splits=splits)


def dense_kernel_case(s: Settings, fields: dict[str, Any], batch: int, seq_len: int, key):
  """(complete config, problem, kernel_fn's arguments) of a variant's fields at a dense shape."""
  case = _case(s, batch, seq_len, None)
  key_len, key_in = jax.random.split(key)
  args = cases.make_inputs(case, key_in, cases.make_lengths(case, key_len))
  return _config(fields, args, False), _problem(args, False), args


def _op_fn(config, paged: bool, plan_ahead: bool = False):
  """The op under jit; plan_ahead: its plan made by `pallas_kv.plan_splits` in the same step."""
  op = functools.partial(pkv.paged_decode_attention if paged else pkv.decode_attention, impl="mosaic_gpu",
                         config=config)
  if not plan_ahead:
    return jax.jit(op)
  return jax.jit(lambda *args: op(*args, plan=pkv.plan_splits(op.func, *args, **op.keywords)))


def _triton_merge(out, lse, *, rows: int, out_dtype):
  from pallas_kv.kernels.triton import merge   # pylint: disable=g-import-not-at-top
  return merge.merge_partials(out, lse, rows=rows, out_dtype=out_dtype, return_lse=False,
                              interpret=runtime.interpret_enabled())


# The split merges a kernel-only row can add (the op takes the first that imports: `backend.fused_merge`).
MERGES = {
    "triton_merge": _triton_merge,
    "mosaic_merge": lambda out, lse, *, rows, out_dtype: mgpu_backend.mosaic_merge(
        out, lse, None, rows=rows, out_dtype=out_dtype, return_lse=False),
    "xla_merge": lambda out, lse, *, rows, out_dtype: frame.merge_splits(out, lse, rows=rows),
}


def kernel_fn(config, problem, paged: bool, probe: str | None):
  """The kernel alone on the op's arguments, with the op's plan (`backend.plan_splits`): partials, no
  merge (a probe of PROBES: results wrong; "plan": the arrays of the plan made ahead, which for stream-K are the
  XLA walk a call's own plan leaves to its kernel; MERGES: the kernel and that merge)."""
  tile_math = mgpu_decode.TileMath() if probe is None or probe == "plan" or probe in MERGES else PROBES[probe]
  options = AttentionOptions(scale=problem.head_dim ** -0.5)

  def fn(q, k, v, *rest):
    block_tables, lengths = (rest[0], rest[1]) if paged else (None, rest[0])
    rows = frame.pack_queries(q[:, None], problem.num_kv_heads).astype(k.dtype)
    plan = mgpu_backend.plan_splits("paged" if paged else "decode", problem, options, config, lengths,
                                    ahead=probe == "plan")
    if probe == "plan":
      return plan.kernel_inputs() or [lengths]   # a plan with no arrays: the chain times nothing but the call
    partials = mgpu_decode.decode_partials(rows, k, v, lengths, block_tables, num_queries=1, options=options,
                                           config=config, plan=plan, tile_math=tile_math,
                                           interpret=mgpu_backend.interpret_params())
    if probe not in MERGES or partials[0].shape[2] == 1:
      return partials
    return MERGES[probe](*partials, rows=rows.shape[2], out_dtype=q.dtype)

  return jax.jit(fn)


def _time(fn, input_sets, s: Settings) -> dict[str, Any]:
  t = timing.time_jax(fn, input_sets, warmup=s.warmup, iters=s.iters, repeats=s.repeats)
  return output.timing_fields(t, ROW_TIMING_FIELDS)


def run_shape(s: Settings, batch: int, seq_len: int, page_size: int | None, key, deadline: float,
              probe_shapes: Sequence[str], load_path: bool = False) -> list[dict[str, Any]]:
  name = shape_name(batch, seq_len, page_size)
  paged = page_size is not None
  case = _case(s, batch, seq_len, page_size)
  key_len, key_in = jax.random.split(key)
  lengths = cases.make_lengths(case, key_len)
  total_keys = int(jnp.sum(lengths))
  costs = case.costs(total_keys)
  num_sets = timing.num_rotating_sets(case.kv_capacity_bytes, s.rotate_bytes)
  input_sets = [cases.make_inputs(case, k, lengths) for k in jax.random.split(key_in, num_sets)]
  ref, _ = cases.reference_output(case, input_sets[0])
  problem = _problem(input_sets[0], paged)
  base = {"shape": name, "batch": batch, "seq_len": seq_len, "page_size": page_size,
          "num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
          "num_sets": num_sets, **costs}
  todo: list[tuple[str, str | None, Any]] = []   # (variant, probe, fields)
  for variant, (fields, only) in VARIANTS.items():
    if s.smoke:
      if variant not in SMOKE_SKIPPED_VARIANTS and (not paged or variant in SMOKE_PAGED_VARIANTS):
        todo.append((variant, None, fields))
    elif only is None or name in only:
      todo.append((variant, None, fields))
  if name in probe_shapes:
    # Kernel-only rows go before baseline_again so that it still closes the shape.
    last = [todo.pop()] if todo and todo[-1][0] == "baseline_again" else []
    fields = dict(s.probe_fields)
    todo += [("kernel", None, fields)] + [(f"kernel+{m}", m, fields) for m in MERGES] + [("plan", "plan", fields)]
    todo += [(f"probe:{p}", p, fields) for p in PROBES] + last
    if load_path:
      todo += [(f"loads:{n}", "loads_only", f) for n, f in LOAD_PATH.items()]
  rows = []
  for variant, probe, fields in todo:
    row: dict[str, Any] = {**base, "variant": variant,
                           "kind": "op" if variant != "kernel" and probe is None else "kernel"}
    if time.perf_counter() > deadline:
      rows.append({**row, "status": "skipped", "reason": "over --budget_s"})
      continue
    t0 = time.perf_counter()
    try:
      config = _config(fields, input_sets[0], paged)
      row["config"] = dataclasses.asdict(config)
      if row["kind"] == "op":
        fn = _op_fn(config, paged, fields.get("plan_ahead", False))
        out = np.asarray(jnp.asarray(fn(*input_sets[0]), jnp.float32))
        row["rel_err"] = cases.relative_error(out, ref)
        row["check_ok"] = bool(row["rel_err"] <= cases.TOLERANCE["bfloat16"])
      else:
        fn = kernel_fn(config, problem, paged, probe)
        row["probe"] = probe
      if s.smoke and not (variant == "baseline" and not paged):
        jax.block_until_ready(fn(*input_sets[0]))   # interpret mode: run once, don't time
        row["status"] = "ran"
      else:
        row.update(_time(fn, input_sets, s), status="ok")
        row["tbps"] = costs["bytes"] / (row["time_us"] * 1e-6) / 1e12
    except Exception as e:  # pylint: disable=broad-except
      row.update(status="error", reason=f"{type(e).__name__}: {str(e).strip()[:300]}",
                 traceback=traceback.format_exc())
    row["wall_s"] = time.perf_counter() - t0
    rows.append(row)
    print(_row_line(row), flush=True)
  return rows


def _row_line(row: dict[str, Any]) -> str:
  head = f"{row['shape']:<14}{row['variant']:<18}"
  if row["status"] == "ok":
    err = f"  err {row['rel_err']:.1e}" if "rel_err" in row else ""
    bad = "  CHECK FAILED" if row.get("check_ok") is False else ""
    return (f"{head}{row['time_us']:9.2f} us {row['tbps']:6.3f} TB/s  ({row['timer']}, "
            f"{row['wall_s']:.1f}s wall){err}{bad}")
  if row["status"] == "ran":
    err = f"  err {row['rel_err']:.1e}" if "rel_err" in row else ""
    return f"{head}ran{err}  ({row['wall_s']:.1f}s)"
  return f"{head}{row['status']}: {row.get('reason', '')}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Variant x shape: TB/s ('-' not run, 'err', 'skip', 'FAIL' for a failed check)."""
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  cell = {(r["variant"], r["shape"]): r for r in rows}
  width = max(12, *(len(x) + 1 for x in shapes))
  lines = [f"{'TB/s':<18}" + "".join(f"{x:>{width}}" for x in shapes)]
  for v in variants:
    parts = []
    for x in shapes:
      r = cell.get((v, x))
      if r is None:
        parts.append("-")
      elif r["status"] == "ok":
        parts.append(f"{r['tbps']:.3f}" + ("!" if r.get("check_ok") is False else ""))
      else:
        parts.append({"error": "err", "skipped": "skip", "ran": "ran"}[r["status"]])
    lines.append(f"{v:<18}" + "".join(f"{p:>{width}}" for p in parts))
  lines.append("(! = failed the numerics check; probe:* rows are wrong by design, kernel-only)")
  return "\n".join(lines)


def is_probe(row: dict[str, Any]) -> bool:
  """A probe row: its results are wrong by design, so it never fails the run."""
  return row["variant"].startswith("probe:")


def run(s: Settings, shapes, probe_shapes, json_path: str | None, load_path: bool = False) -> list[dict[str, Any]]:
  start = time.perf_counter()
  deadline = start + s.budget_s
  print(f"# kernel variants  device={output.device_description()}  jax={jax.__version__}  "
        f"smoke={s.smoke}  iters={s.iters} repeats={s.repeats}  budget {s.budget_s:.0f}s",
        flush=True)
  rows = []
  key = jax.random.key(0)
  for batch, seq_len, page_size in shapes:
    key, sub = jax.random.split(key)
    try:
      rows += run_shape(s, batch, seq_len, page_size, sub, deadline, probe_shapes, load_path)
    except Exception as e:  # pylint: disable=broad-except  (input or reference failed)
      rows.append({"shape": shape_name(batch, seq_len, page_size), "variant": "baseline",
                   "kind": "op", "status": "error", "reason": f"{type(e).__name__}: {e}"[:300],
                   "traceback": traceback.format_exc()})
      print(f"{rows[-1]['shape']}: {rows[-1]['reason']}", flush=True)
  print(f"\n# total {time.perf_counter() - start:.0f}s\n" + format_table(rows), flush=True)
  meta = {"device": output.device_description(), "jax_version": jax.__version__}
  output.save([{**r, **meta} for r in rows], json_path=json_path)
  return rows


def define_flags() -> None:
  """The shared timing and --json flags (`cli`), and this program's own."""
  cli.define_timing_flags({name: f"{value} on a GPU" for name, value in GPU_TIMING.items()})
  cli.define_output_flags(("json",))
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_boolean("smoke", False, "CPU: tiny shapes in interpret mode (< 1 minute).")
  flags.DEFINE_float("budget_s", 320.0, "Wall seconds after which remaining rows are "
                     "skipped (the whole run, compiles included, should stay < 6 min).")
  flags.DEFINE_list("variants", None, f"Subset of {','.join(VARIANTS)} (default all); "
                    "'none' runs only the kernel-only rows.")
  flags.DEFINE_list("shapes", None, "Shapes to run instead of GPU_SHAPES, as BxT or BxTpPAGE (e.g. 16x32768,8x8192p16).")
  flags.DEFINE_boolean("ragged", False, "Random lengths in [1, T] (the decode benchmark's --ragged) instead of "
                       "full ones; TB/s counts the keys read.")
  flags.DEFINE_list("probe_shapes", None, f"Shapes of the kernel-only rows (default {','.join(PROBE_SHAPES)}); "
                    "names as in the table, e.g. 'B32 T4096'; 'none': no kernel-only rows.")
  flags.DEFINE_string("probe_variant", "baseline", "The variant (of VARIANTS) whose config fields the "
                      "kernel-only rows take, e.g. pqk+persistent, the tuned config at B >= 8.")
  flags.DEFINE_boolean("load_path", False, "Also time the loads-only probe under each "
                       f"ring shape of LOAD_PATH ({', '.join(LOAD_PATH)}) on the probe shapes.")


def check_flags() -> tuple[tuple, tuple[str, ...]]:
  """(GPU shapes, probe shapes) the flags select, or a UsageError naming the flag at fault (a GPU run's flags, also
  checked by the tests: a flagfile's bad value fails on a CPU, not on the GPU machine)."""
  if FLAGS.probe_variant not in VARIANTS:
    raise app.UsageError(f"--probe_variant: {FLAGS.probe_variant!r} is not among the variants {list(VARIANTS)}")
  unknown = set(FLAGS.variants or ()) - set(VARIANTS) - {"none"}
  if unknown:
    raise app.UsageError(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
  shapes = tuple(parse_shape(x) for x in FLAGS.shapes) if FLAGS.shapes else GPU_SHAPES
  probe_shapes = () if FLAGS.probe_shapes == ["none"] else tuple(FLAGS.probe_shapes or PROBE_SHAPES)
  unknown = set(probe_shapes) - {shape_name(*x) for x in shapes}
  if unknown and FLAGS.probe_shapes:
    raise app.UsageError(f"--probe_shapes: unknown {sorted(unknown)}; choose from "
                         f"{[shape_name(*x) for x in shapes]} or 'none'")
  return shapes, probe_shapes


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  shapes, probe_shapes = check_flags()
  probe_fields = tuple(VARIANTS[FLAGS.probe_variant][0].items())
  if FLAGS.variants:
    for name in list(VARIANTS):
      if name not in FLAGS.variants:
        del VARIANTS[name]
  json_path = cli.output_paths().json
  if FLAGS.smoke:
    s = Settings(smoke=True, num_heads=4, num_kv_heads=1, head_dim=64, warmup=0, iters=1,
                 repeats=1, rotate_bytes=0.0, budget_s=FLAGS.budget_s, probe_fields=probe_fields,
                 ragged=FLAGS.ragged)
    with pkv.interpret():
      rows = run(s, SMOKE_SHAPES, SMOKE_PROBE_SHAPES, json_path, FLAGS.load_path)
  else:
    if jax.default_backend() != "gpu":
      raise app.UsageError("needs a GPU; use --smoke on a CPU")
    s = Settings(smoke=False, num_heads=32, num_kv_heads=8, head_dim=128,
                 **{**GPU_TIMING, **cli.timing_flags().given()},
                 rotate_bytes=timing.DEFAULT_ROTATE_BYTES, budget_s=FLAGS.budget_s, probe_fields=probe_fields,
                 ragged=FLAGS.ragged)
    if not VARIANTS:  # kernel-only rows: only the shapes that have them
      shapes = tuple(x for x in shapes if shape_name(*x) in probe_shapes)
    rows = run(s, shapes, probe_shapes, json_path, FLAGS.load_path)
  return output.report_failures(output.failed_rows(rows, exempt=is_probe),
                                lambda r: f"{r['variant']} on {r['shape']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
