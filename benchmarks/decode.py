r"""Decode-attention benchmark: pallas_kv impls and peers side by side.

Usage (from the repository root):

  python -m benchmarks.decode                       # CPU: one tiny case; GPU: the GQA sweep
  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --json=/tmp/gqa.json
  python -m benchmarks.decode --op=paged --page_size=64 --cases=8x8192 \
      --impl=auto,xla_einsum,jax_pallas_paged
  python -m benchmarks.decode --op=mla --num_heads=128 --batch=64,128 --seq_len=4096,8192
  python -m benchmarks.decode --flagfile=configs/gemma2_9b.flags --csv=/tmp/g.csv --plot=/tmp/g.png

`--merge_in_kernel` runs the triton impl (and auto where it picks triton) with the split merge
in the kernel's launch (`DecodeConfig.merge_in_kernel`), its config otherwise as resolved; run
once with and once without it to compare against the two-launch path:

  python -m benchmarks.decode --impl=triton --cases=1x32768,8x8192 --merge_in_kernel

`--split_plan=balanced` runs both kernel backends (and auto) with the balanced split plan
(`DecodeConfig.split_plan`): each config as resolved, its split count then the plan's bound
(`split_k.choose_balanced_splits`). Compare on ragged batches (`--ragged`):

  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --ragged --impl=triton,mosaic_gpu \
      --split_plan=balanced

`--split_plan=stream_k` runs the triton impl (and auto where it picks triton) with the stream-K
plan: one wave of programs (`--stream_k_programs_per_sm` per SM) over the batch's tiles laid end
to end, block size and stages as resolved:

  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --ragged --impl=triton --split_plan=stream_k

`--convert_warpgroup` runs the mosaic_gpu impl (and auto where it picks it) on one-byte caches
with a converter warpgroup (`DecodeConfig.convert_warpgroup`), the config otherwise as resolved
(with kv_groups=1):

  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=mosaic_gpu --kv_dtype=int8 \
      --convert_warpgroup

`--v_tokens_last` gives pallas_kv's own impls of the dense and paged ops v stored tokens last
(`decode_attention(..., v_tokens_last=True)`; transposed before the timing; mosaic_gpu refuses it):

  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=triton --kv_dtype=int8 --v_tokens_last

`--sequence_order=longest_first` (or `long_short`) runs the triton impl (and auto where it picks
triton) with programs taking the sequences in that order (`DecodeConfig.sequence_order`), the
config otherwise as resolved; compare with the default on ragged batches.

Each case (op x batch x seq_len) prints one table row per impl: median device time
per call, median time per call in a Python loop of calls (host us), TB/s of the
bytes that must move (the KV of the valid tokens, plus q and the output), TFLOP/s,
% of the roofline max(bytes / peak_tbps, flops / peak_tflops) / time (the last
three of the device time), and the relative error ||out - ref|| / ||ref|| against
the pallas_kv float32 reference on float32-upcast inputs. An impl that cannot run
(not built yet, no torch, no GPU, op unsupported) prints "n/a (reason)"; an
unexpected exception prints "error (reason)".

Impls: pallas_kv's own `auto`, `mosaic_gpu`, `triton`, `xla` (the `impl=` argument),
and the peers of benchmarks/peers.py: `xla_einsum`, `cudnn`, `torch`,
`jax_pallas_gqa`, `jax_pallas_paged`.

Attention options (op=decode and paged): `--softcap=50`, `--window=4096`, `--sinks`
(random float32 per-head sink logits, one array per case) go to the pallas_kv impls,
to the reference and to the peers that can express them (`xla_einsum`); the other
peers report the row n/a. With a window the bytes and flops count only the keys
inside it (min(length, window + S - 1) per sequence), and the rotating input sets
are sized by that read, not by the capacity.

Outputs besides the tables: `--json` (every row), `--csv` (one line per impl x case,
the scalar fields of the JSON rows), `--plot=PATH.png` (TB/s against context length
per impl, and against batch when the sweep has several batches; needs the `plot`
extra, matplotlib; without it the run says so and goes on). `benchmarks/report.py`
turns the JSON into a RESULTS.md section. Named model sweeps: configs/*.flags.

Defaults: flags left unset take a per-platform default (see `cases.default_sweep`). On a
CPU (`cases.default_is_cpu()`), one tiny case (B=2, T=256, heads 4/2, D=64, impls
xla,xla_einsum, a few iterations); on a GPU the H200 sweep of configs/*_h200.flags.
Cases come from `--cases=BxT,...` if given, else from the product of `--batch` and
`--seq_len`.

Timing: see benchmarks/timing.py. JAX impls run as one jitted chain of `--iters`
dependent calls and one of 2x that; the per-call time is their difference over
`--iters` (host dispatch cancels), median over `--repeats`. Calls rotate among
enough input sets that the KV cache doesn't fit in L2. torch uses CUDA events.
The note column says "chain" when the difference was too noisy (tiny CPU cases)
and the plain chain time, an upper bound, is shown instead. The chain hides host
dispatch, which a user's Python loop of jitted calls pays on every call: the host us
column (`host_us`) times such a loop (`timing.HOST_LOOP_TIMERS`), wall clock per call;
`--nohost_loop` skips it. Exit status 1 if a pallas_kv impl raised something other than
NotImplementedError or failed the numerics check (peers never fail the run); a kernel impl
on a CPU outside interpret mode (PALLAS_KV_INTERPRET=1) reads n/a.

From Python (tests): `run(op="decode", cases=((2, 256),), impls=("xla",))` returns
the rows as dicts; `run(sweep)` takes a `cases.Sweep`; `cases.default_sweep(op, cpu)`
gives the defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import cli
from benchmarks import output
from benchmarks import peers
from benchmarks import runners
from benchmarks import timing
from pallas_kv import config as config_lib
from pallas_kv import runtime


def run_impl(impl: str, case: cases.Case, sweep: cases.Sweep, input_sets: Sequence[tuple],
             ref: np.ndarray | None, costs: dict[str, float], host_loop: bool = True) -> dict[str, Any]:
  """Checks and times one impl on one case (also in a host loop if `host_loop`); never raises
  unless sweep.strict."""
  row: dict[str, Any] = {"impl": impl, "ours": impl in runners.OUR_IMPLS}
  try:
    runner = runners.build_runner(impl, cases.op_spec(case))
    prepared = [runner.prepare(args) for args in input_sets]
    first = runner.fn(*prepared[0])  # compiles; "auto" records its choice
    if impl == "auto":
      row["auto_choice"] = runners.auto_choice()
    if ref is not None:
      row["rel_err"] = cases.relative_error(runner.to_numpy(first), ref)
    t = timing.TIMERS[runner.timer](runner.fn, prepared, warmup=sweep.warmup,
                                    iters=sweep.iters, repeats=sweep.repeats)
    if host_loop:
      row.update(output.host_loop_fields(timing.HOST_LOOP_TIMERS[runner.timer](
          runner.fn, prepared, warmup=sweep.warmup, iters=sweep.iters, repeats=sweep.repeats)))
  except Exception as e:  # pylint: disable=broad-except
    if sweep.strict:
      raise
    unavailable = isinstance(e, (NotImplementedError, peers.PeerUnavailable))
    row.update(status="n/a" if unavailable else "error", reason=output.error_reason(e))
    if not unavailable:
      row["traceback"] = traceback.format_exc()
    return row
  roofline_s = max(costs["bytes"] / (sweep.peak_tbps * 1e12),
                   costs["flops"] / (sweep.peak_tflops * 1e12))
  row.update(
      status="ok",
      **output.timing_fields(t),
      tbps=costs["bytes"] / t.median_s / 1e12,
      tflops=costs["flops"] / t.median_s / 1e12,
      roofline_pct=100.0 * roofline_s / t.median_s,
  )
  if "rel_err" in row:
    row["check_ok"] = bool(row["rel_err"] <= cases.TOLERANCE[case.dtype])
  return row


def run_case(case: cases.Case, sweep: cases.Sweep, key: jax.Array,
             host_loop: bool = True) -> tuple[list[dict], dict]:
  """All impls on one case: (rows, case info)."""
  key_len, key_in = jax.random.split(key)
  lengths = cases.make_lengths(case, key_len)
  total_keys = int(jnp.sum(lengths))
  attended_keys = case.attended_keys(lengths)
  costs = case.costs(attended_keys)
  num_sets = timing.num_rotating_sets(case.rotation_bytes(costs["kv_bytes"]),
                                      sweep.rotate_bytes)
  input_sets = cases.make_input_sets(case, key_in, lengths, num_sets)
  ref, ref_source = None, "-"
  if sweep.check:
    ref, ref_source = cases.reference_output(case, input_sets[0])
  info = {**dataclasses.asdict(case), **costs, "total_keys": total_keys,
          "attended_keys": attended_keys, "num_sets": num_sets,
          "reference": ref_source}
  rows = []
  for impl in sweep.impls:
    row = run_impl(impl, case, sweep, input_sets, ref, costs, host_loop)
    rows.append({**info, **row})
  return rows, info


def run(sweep: cases.Sweep | None = None, *, json_path: str | None = None,
        csv_path: str | None = None, plot_path: str | None = None,
        out: TextIO | None = None, host_loop: bool = True, **overrides: Any) -> list[dict]:
  """Runs a sweep, prints one table per case to `out`, returns all rows.

  Every impl is timed by the chain timer and, if `host_loop`, also in a host loop (`host_us`).

  Also writes the rows as JSON to `json_path`, CSV to `csv_path` and a PNG plot to
  `plot_path` (if matplotlib is installed; else one line says so).

  `sweep` defaults to `cases.default_sweep(overrides.get("op", "decode"))`; keyword
  overrides replace its fields, e.g. `run(op="paged", cases=((2, 256),))`.
  """
  out = sys.stdout if out is None else out
  if sweep is None:
    sweep = cases.default_sweep(overrides.get("op", "decode"))
  if overrides:
    sweep = dataclasses.replace(sweep, **overrides)
  stamp = output.run_stamp()
  print(f"# pallas_kv decode benchmark  device={stamp['device']}  jax={jax.__version__}  "
        f"warmup={sweep.warmup} iters={sweep.iters} repeats={sweep.repeats}",
        file=out, flush=True)
  all_rows = []
  key = jax.random.key(sweep.seed)
  for batch, seq_len in sweep.cases:
    key, case_key = jax.random.split(key)
    case = cases.Case.from_sweep(sweep, batch, seq_len)
    rows, info = run_case(case, sweep, case_key, host_loop)
    print(output.format_table(info, rows), file=out, flush=True)
    print(file=out, flush=True)
    all_rows.extend({**r, **stamp} for r in rows)
    if json_path:  # after every case: a run cut short keeps the cases it finished
      output.write_json(all_rows, json_path)
  output.save(all_rows, json_path=json_path, csv_path=csv_path, plot_path=plot_path, out=out)
  return all_rows


@contextlib.contextmanager
def _resolved_configs_rewritten(modules, rewrite):
  """While open, each backend config module in `modules` resolves a config as usual, then returns
  rewrite(resolve, problem, resolved, kw) instead (resolve: its own resolve_config)."""
  originals = {module: module.resolve_config for module in modules}
  for module, resolve in originals.items():
    module.resolve_config = functools.partial(_rewritten_resolve, resolve, rewrite)
  try:
    yield
  finally:
    for module, resolve in originals.items():
      module.resolve_config = resolve


def _rewritten_resolve(resolve, rewrite, problem, config=None, **kw):
  return rewrite(resolve, problem, resolve(problem, config, **kw), kw)


@contextlib.contextmanager
def triton_merge_in_kernel(enabled: bool):
  """While open (if enabled), the triton backend resolves its configs as usual, then sets
  merge_in_kernel=True."""
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top
  merged = lambda resolve, problem, config, kw: dataclasses.replace(config, merge_in_kernel=True)
  with _resolved_configs_rewritten([triton_config] if enabled else [], merged):
    yield


@contextlib.contextmanager
def balanced_split_plan(enabled: bool):
  """While open (if enabled), both kernel backends resolve their configs as usual, then switch
  them to the balanced split plan with the plan's own split bound."""
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config  # pylint: disable=g-import-not-at-top
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top
  balanced = lambda resolve, problem, config, kw: resolve(
      problem, dataclasses.replace(config, split_plan="balanced", num_splits=None), **kw)
  with _resolved_configs_rewritten([mgpu_config, triton_config] if enabled else [], balanced):
    yield


@contextlib.contextmanager
def triton_stream_k(enabled: bool, programs_per_sm: int | None = None):
  """While open (if enabled), the triton backend resolves its configs as usual, then switches them
  to the stream-K plan: one program per (kv head, row block) and programs_per_sm per SM (the
  backend's `stream_k_programs_per_sm` if None), block size and stages as resolved."""
  from pallas_kv.kernels import split_k  # pylint: disable=g-import-not-at-top
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top

  def stream_k(resolve, problem, config, kw):
    _, row_blocks = triton_config.row_blocking(problem.num_queries * problem.group_size, problem.head_dim)
    programs = split_k.stream_k_programs(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                                         num_sms=kw.get("num_sms") or runtime.num_sms(),
                                         programs_per_sm=programs_per_sm or triton_config.stream_k_programs_per_sm(problem))
    return resolve(problem, dataclasses.replace(config, split_plan="stream_k", num_splits=programs,
                                                merge_in_kernel=False), **kw)

  with _resolved_configs_rewritten([triton_config] if enabled else [], stream_k):
    yield


@contextlib.contextmanager
def triton_per_sequence(enabled: bool):
  """While open (if enabled), a triton config that resolved to the stream-K plan (the default
  where `triton_config.stream_k_pays`) takes per-sequence splits instead, counted as usual."""
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top

  def per_sequence(resolve, problem, config, kw):
    if config.split_plan != "stream_k":
      return config
    return resolve(problem, dataclasses.replace(config, split_plan="per_sequence", num_splits=None), **kw)

  with _resolved_configs_rewritten([triton_config] if enabled else [], per_sequence):
    yield


@contextlib.contextmanager
def triton_fields(**fields):
  """While open, the triton backend resolves its configs as usual, then takes the given
  `DecodeConfig` fields (those not None; e.g. block_kv, num_stages) and checks the config again."""
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top
  fields = {name: value for name, value in fields.items() if value is not None}
  rewritten = lambda resolve, problem, config, kw: resolve(problem, dataclasses.replace(config, **fields), **kw)
  with _resolved_configs_rewritten([triton_config] if fields else [], rewritten):
    yield


@contextlib.contextmanager
def triton_sequence_order(order: str):
  """While open (unless order is "given"), the triton backend resolves its configs as usual, then
  sets sequence_order=order; a stream-K config (which lays the sequences out in batch order)
  takes per-sequence splits for it."""
  from pallas_kv.kernels.triton import config as triton_config  # pylint: disable=g-import-not-at-top

  def ordered(resolve, problem, config, kw):
    if config.split_plan == "stream_k":
      config = resolve(problem, dataclasses.replace(config, split_plan="per_sequence", num_splits=None), **kw)
    return dataclasses.replace(config, sequence_order=order)

  with _resolved_configs_rewritten([triton_config] if order != "given" else [], ordered):
    yield


@contextlib.contextmanager
def mosaic_convert_warpgroup(enabled: bool):
  """While open (if enabled), the mosaic_gpu backend resolves its configs as usual, then gives
  one-byte caches a converter warpgroup (kv_groups=1, as the converter needs)."""
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config  # pylint: disable=g-import-not-at-top

  def converted(resolve, problem, config, kw):
    dtype = jnp.dtype(kw.get("dtype", "bfloat16"))
    if dtype.itemsize != 1:
      return config
    config = dataclasses.replace(config, convert_warpgroup=True, kv_groups=1, persistent=False)
    # The converted rings take SMEM: fewer one-byte stages until it fits (per-token scales counted).
    fits = lambda c: mgpu_config.fits_smem(c, rows=problem.num_queries * problem.group_size,
                                           head_dim=problem.head_dim, dtype=dtype, page_size=problem.page_size,
                                           k_scale_kind="token", v_scale_kind="token")
    while config.num_stages > 2 and not fits(config):
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return resolve(problem, config, **kw)

  with _resolved_configs_rewritten([mgpu_config] if enabled else [], converted):
    yield


@contextlib.contextmanager
def values_tokens_last(enabled: bool):
  """While open (if enabled), pallas_kv's own impls of the dense and paged ops take v stored tokens
  last ([B, Hkv, D, T] / [P, Hkv, D, page_size], `v_tokens_last=True`), transposed before the
  timing; the peers take v as it is."""
  if not enabled:
    yield
    return
  original = runners.build_pallas_kv

  def build(impl: str, spec: peers.OpSpec) -> peers.Runner:
    if spec.op not in ("decode", "paged"):
      return original(impl, spec)
    tokens_last = lambda args: (*args[:2], jnp.transpose(args[2], (0, 2, 3, 1)), *args[3:])   # v is argument 2
    return dataclasses.replace(original(impl, spec, v_tokens_last=True), prepare=tokens_last)

  runners.build_pallas_kv = build
  try:
    yield
  finally:
    runners.build_pallas_kv = original


def define_flags() -> None:
  """The flags of a `cases.Sweep` and the files to write the rows to."""
  cli.define_sweep_flags()
  cli.define_output_flags(("json", "csv", "plot"))
  flags.DEFINE_boolean("merge_in_kernel", False, "triton impl: merge the splits in the kernel's own launch "
                       "(DecodeConfig.merge_in_kernel), the config otherwise as resolved.")
  flags.DEFINE_enum("split_plan", "per_sequence", list(config_lib.SPLIT_PLANS),
                    "kernel impls: how sequences are cut into splits (DecodeConfig.split_plan); balanced "
                    "takes each resolved config with the plan's split bound (both backends); stream_k the "
                    "triton impl's, with --stream_k_programs_per_sm programs per SM. Given explicitly, "
                    "per_sequence also replaces the triton default's stream-K plan where it takes one.")
  flags.DEFINE_integer("stream_k_programs_per_sm", None, "--split_plan=stream_k: programs per SM (default: the "
                       "triton backend's, 2 or 3 paged).", lower_bound=1)
  flags.DEFINE_boolean("convert_warpgroup", False, "mosaic_gpu impl, one-byte caches: a converter warpgroup "
                       "(DecodeConfig.convert_warpgroup), the config otherwise as resolved.")
  flags.DEFINE_enum("sequence_order", "given", list(config_lib.SEQUENCE_ORDERS),
                    "triton impl: the order in which programs take the sequences (DecodeConfig.sequence_order), "
                    "the config otherwise as resolved.")
  flags.DEFINE_integer("triton_block_kv", None, "triton impl: tiles of this many tokens, the config otherwise "
                       "as resolved.")
  flags.DEFINE_integer("triton_num_stages", None, "triton impl: tiles pipelined (DecodeConfig.num_stages), the "
                       "config otherwise as resolved.")
  flags.DEFINE_boolean("host_loop", True, "Also time each impl as a Python loop of separate calls (what a "
                       "user's loop sees, host dispatch included): the host us column, host_us in the rows.")
  flags.DEFINE_boolean("v_tokens_last", False, "pallas_kv impls of the dense and paged ops: v stored "
                       "[B, Hkv, D, T] / [P, Hkv, D, page_size] (decode_attention's v_tokens_last).")
  flags.adopt_module_key_flags(cli)


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    sweep = cli.sweep_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  paths = cli.output_paths()
  with (triton_merge_in_kernel(flags.FLAGS.merge_in_kernel), balanced_split_plan(flags.FLAGS.split_plan == "balanced"),
        triton_stream_k(flags.FLAGS.split_plan == "stream_k", flags.FLAGS.stream_k_programs_per_sm),
        triton_per_sequence(flags.FLAGS["split_plan"].present and flags.FLAGS.split_plan == "per_sequence"),
        triton_sequence_order(flags.FLAGS.sequence_order), mosaic_convert_warpgroup(flags.FLAGS.convert_warpgroup),
        values_tokens_last(flags.FLAGS.v_tokens_last),
        triton_fields(block_kv=flags.FLAGS.triton_block_kv, num_stages=flags.FLAGS.triton_num_stages)):
    rows = run(sweep, json_path=paths.json, csv_path=paths.csv, plot_path=paths.plot,
               host_loop=flags.FLAGS.host_loop)
  return output.report_failures(
      output.failed_rows(rows), lambda r: f"{r['impl']} on {r['op']} B={r['batch']} T={r['seq_len']}",
      tracebacks=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
