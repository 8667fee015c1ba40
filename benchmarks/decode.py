r"""Decode-attention benchmark: pallas_kv impls and peers side by side.

Usage (from the repository root):

  python -m benchmarks decode                       # CPU: one tiny case; GPU: the GQA sweep
  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --json=/tmp/gqa.json
  python -m benchmarks decode --op=paged --page_size=64 --cases=8x8192 \
      --impl=auto,xla_einsum,jax_pallas_paged
  python -m benchmarks decode --op=mla --num_heads=128 --batch=64,128 --seq_len=4096,8192
  python -m benchmarks decode --flagfile=configs/gemma2_9b.flags --csv=/tmp/g.csv --plot=/tmp/g.png
  python -m benchmarks decode --impl=triton,mosaic_gpu --cases=1x32768 --length=2048   # a short sequence

`--length=N`: every sequence N long in caches of each case's seq_len, which sizes the configs (split counts, the
tuned entry) as a serving cache's capacity does: a short sequence's fixed costs. Input sets rotate over the
capacity, as for `--ragged`; peers that need full lengths read n/a.

Kernel config flags. Each builds a PARTIAL kernel config that holds only the fields the flags fix,
one per kernel (`pallas_kv.TritonConfig`, `MosaicGPUConfig`, `MosaicMLAConfig` for op=mla), and
passes it as `config=` to that backend's rows: `--impl=triton` takes the Triton config,
`--impl=mosaic_gpu` the Mosaic GPU one, and `auto` the config of the backend it picks (a config
narrows auto to its backend; `xla` and the peers take none). The backend fills the other fields
from its heuristic: a config, even a partial one, is not looked up in the tuned file, so compare
a flagged run with one that fixes the other value of the same flag (e.g. `--split_plan=balanced`
against `--split_plan=per_sequence`), not with an unflagged run. A row that ran with a config
lists its fields in `config`.

  --merge_in_kernel        TritonConfig(merge_in_kernel=True): the split merge in the kernel's
                           own launch instead of a second one (one split and stream-K always do)
  --split_plan=PLAN        split_plan=PLAN on every kernel that has that plan: per_sequence and
                           balanced on all three (the split count left to the backend: for
                           balanced, the plan's bound), stream_k on the GQA kernels (triton: one
                           wave of programs, `--stream_k_programs_per_sm=N` fixes num_splits to
                           the programs of N per SM; mosaic_gpu: its persistent programs, the
                           heuristic's other fields). Per-sequence is also what replaces the
                           Triton default's stream-K plan where it would take one.
  --sequence_order=ORDER   sequence_order=ORDER on every pallas_kv backend (the config it makes
                           takes the heuristic's other fields, not the tuned file's); on triton it
                           rules out the default's stream-K plan
  --convert_warpgroup      one-byte caches on mosaic_gpu: `pallas_kv.experimental.
                           MosaicGPUVariantConfig(convert_warpgroup=True)` (the backend then takes
                           one KV group and the stages that fit); 16-bit caches take no config
  --one_tile_loop          mosaic_gpu: `MosaicGPUVariantConfig(one_tile_loop=True)`, every tile
                           through the masked step (the heuristic's other fields; to compare with
                           the default's, give both runs `--sequence_order=given`)
  --triton_block_kv=N, --triton_num_stages=N    TritonConfig(block_kv=N) / (num_stages=N)

  python -m benchmarks decode --impl=triton --cases=1x32768,8x8192 --merge_in_kernel
  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --ragged --impl=triton,mosaic_gpu \
      --split_plan=balanced           # and once with --split_plan=per_sequence
  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --ragged --impl=triton --split_plan=stream_k
  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --impl=mosaic_gpu --kv_dtype=int8 \
      --convert_warpgroup

pallas_kv's own impls of the dense and paged ops read v laid out as `KVCache.create` lays it out:
tokens last for a one-byte --kv_dtype (`decode_attention(..., v_tokens_last=True)`; transposed
before the timing), like k otherwise; `--[no]v_tokens_last` chooses:

  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --impl=triton --kv_dtype=int8 --v_tokens_last


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
`--nohost_loop` skips it. Between two calls of a chain or loop nothing else runs (a merge launch of split
shapes aside), so each call finds the GPU's caches holding the op's own code; `--between_calls=xla_add` runs an
XLA elementwise kernel on the queries before each call, as a model's other kernels do, and a first row times that
kernel alone (subtract it). Exit status 1 if a pallas_kv impl raised something other than
NotImplementedError or failed the numerics check (peers never fail the run); a kernel impl
on a CPU outside interpret mode (PALLAS_KV_INTERPRET=1) reads n/a.

From Python (tests): `run(op="decode", cases=((2, 256),), impls=("xla",))` returns
the rows as dicts; `run(sweep)` takes a `cases.Sweep`; `cases.default_sweep(op, cpu)`
gives the defaults; `run(..., kernel=KernelFlags(split_plan="balanced"))` runs ours with the
configs of the kernel flags.
"""

from __future__ import annotations

import dataclasses
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
from benchmarks import timing
import pallas_kv as pkv
from pallas_kv import cache as pkv_cache
from pallas_kv import experimental
from pallas_kv import runtime
from pallas_kv.config import KernelConfig
from pallas_kv.kernels import plan
from pallas_kv.kernels.triton import config as triton_config

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class KernelFlags:
  """What the kernel config flags and --v_tokens_last ask of pallas_kv's own impls (the module doc
  says what each does); None / False where not given. ValueError for flags no config takes."""
  merge_in_kernel: bool = False
  split_plan: str | None = None
  stream_k_programs_per_sm: int | None = None
  sequence_order: str | None = None
  convert_warpgroup: bool = False
  one_tile_loop: bool = False
  triton_block_kv: int | None = None
  triton_num_stages: int | None = None
  v_tokens_last: bool | None = None   # None: `pallas_kv.cache.default_v_tokens_last` of the case's cache
  varlen: bool = False
  between_calls: str = "none"   # "xla_add": an XLA kernel on the queries before each call (`with_kernel_before`)

  def __post_init__(self):
    if self.between_calls not in BETWEEN_CALLS:
      raise ValueError(f"--between_calls={self.between_calls}: one of {', '.join(BETWEEN_CALLS)}")
    if self.stream_k_programs_per_sm is not None and self.split_plan != "stream_k":
      raise ValueError(f"--stream_k_programs_per_sm={self.stream_k_programs_per_sm} needs --split_plan=stream_k")
    for op in ("decode", "mla"):   # every config these flags build, so that a bad one fails before a run
      for backend, config_type in config_types(op, variant=True).items():
        self._config(config_type, self._fields(backend, op, one_byte=True))

  def _fields(self, backend: str, op: str, *, one_byte: bool, num_splits: int | None = None) -> dict[str, Any]:
    """The fields these flags fix on `backend`'s config for `op`, not yet filtered by its type."""
    fields = dict(split_plan=self.split_plan, sequence_order=self.sequence_order)
    if backend == "triton":
      fields.update(merge_in_kernel=self.merge_in_kernel or None, block_kv=self.triton_block_kv,
                    num_stages=self.triton_num_stages, num_splits=num_splits)
    elif op != "mla":
      fields.update(convert_warpgroup=(self.convert_warpgroup and one_byte) or None,
                    one_tile_loop=self.one_tile_loop or None)
    return fields

  @staticmethod
  def _config(config_type, fields: dict[str, Any]) -> KernelConfig | None:
    """config_type holding those of fields it has (a split plan only where it has that plan), or
    None where it has none of them."""
    names = {f.name for f in dataclasses.fields(config_type)}
    given = {name: value for name, value in fields.items() if value is not None and name in names}
    if given.get("split_plan") not in (None, *config_type.SPLIT_PLANS):
      del given["split_plan"]
    return config_type(**given) if given else None

  def configs(self, case: cases.Case) -> dict[str, KernelConfig]:
    """Backend name -> the partial config its rows of `case` take (a backend absent takes none)."""
    num_splits = self.stream_k_splits(case)
    configs = {}
    variant = (self.convert_warpgroup and case.quantized) or self.one_tile_loop
    for backend, config_type in config_types(case.op, variant=variant).items():
      fields = self._fields(backend, case.op, one_byte=case.quantized, num_splits=num_splits)
      config = self._config(config_type, fields)
      if config is not None:
        configs[backend] = config
    return configs

  def stream_k_splits(self, case: cases.Case) -> int | None:
    """--stream_k_programs_per_sm: the Triton stream-K plan's programs per (kv head, row block)
    on this GPU (`plan.stream_k_programs`); None where not given or not a Triton shape."""
    if self.stream_k_programs_per_sm is None or case.op == "mla" or triton_config.head_dim_reason(case.head_dim):
      return None
    _, row_blocks = triton_config.row_blocking(case.num_queries * (case.num_heads // case.num_kv_heads),
                                               case.head_dim)
    return plan.stream_k_programs(num_kv_heads=case.num_kv_heads, row_blocks=row_blocks, num_sms=runtime.num_sms(),
                                  programs_per_sm=self.stream_k_programs_per_sm)

  def runner(self, impl: str, case: cases.Case, args: tuple) -> tuple[peers.Runner, KernelConfig | None]:
    """(the Runner of `impl` on `case`, the config it was given or None); args: one input set
    (auto's choice is traced on it, to give auto the config of the backend it picks)."""
    spec = cases.op_spec(case)
    if impl not in peers.OUR_IMPLS:
      return peers.build_runner(impl, spec), None
    tokens_last = self.tokens_last(case)
    kw = dict(v_tokens_last=True) if tokens_last else {}
    configs = self.configs(case)
    backend = impl
    if impl == "auto" and configs:
      plain = self._runner(impl, spec, tokens_last, kw)
      jax.eval_shape(lambda *a: plain.fn(*plain.prepare(a)), *args)
      backend = peers.auto_choice()
    config = configs.get(backend)
    return self._runner(impl, spec, tokens_last, kw if config is None else dict(kw, config=config)), config

  def timed(self, runner: peers.Runner) -> peers.Runner:
    """The runner as timed: with an XLA kernel before each call under --between_calls."""
    return runner if self.between_calls == "none" else with_kernel_before(runner)

  def tokens_last(self, case: cases.Case) -> bool:
    """Whether ours read the case's v stored tokens last."""
    if case.op == "mla":
      return False
    if self.v_tokens_last is None:
      return pkv_cache.default_v_tokens_last(case.kv_dtype or case.dtype)
    return self.v_tokens_last

  def _runner(self, impl: str, spec: peers.OpSpec, tokens_last: bool, kw: dict) -> peers.Runner:
    if self.varlen:
      return _varlen_runner(impl, spec, kw)
    runner = peers.build_pallas_kv(impl, spec, **kw)
    if not tokens_last:
      return runner
    return dataclasses.replace(runner, prepare=cases.with_v_tokens_last)


BETWEEN_CALLS = ("none", "xla_add")
BETWEEN_ROW = "xla_add alone"   # the impl name of the row that times the kernel put between calls


def between_kernel(q):
  """The XLA kernel `--between_calls=xla_add` runs before a call: an elementwise add on its queries."""
  if not (isinstance(q, jax.Array) and jnp.issubdtype(q.dtype, jnp.floating)):
    raise NotImplementedError("--between_calls: an impl whose first argument is the queries")
  return q + jnp.asarray(1e-3, q.dtype)


def with_kernel_before(runner: peers.Runner) -> peers.Runner:
  """The runner with an XLA elementwise kernel on the queries before each call, as a model runs other kernels
  between its attention calls: the GPU's caches then hold that kernel's code, not the op's, when each call
  starts. The op's time in that setting: this runner's time less the `BETWEEN_ROW` row's (the add alone)."""
  if runner.timer != "jax":
    raise NotImplementedError(f"--between_calls: JAX impls only (this one is timed by {runner.timer!r})")
  return dataclasses.replace(runner, fn=lambda q, *rest: runner.fn(between_kernel(q), *rest))


def _between_row(sweep: cases.Sweep, input_sets: Sequence[tuple], host_loop: bool) -> dict[str, Any]:
  """The row of the kernel `with_kernel_before` adds, timed alone as the impls are."""
  t, host = _timed(peers.Runner(fn=lambda q, *rest: between_kernel(q)), input_sets, sweep, host_loop)
  return {"impl": BETWEEN_ROW, "ours": False, "status": "ok", **output.timing_fields(t), **host,
          **dict.fromkeys(("tbps", "tflops", "roofline_pct"), float("nan"))}   # no KV read


def _timed(runner: peers.Runner, prepared: Sequence[tuple], sweep: cases.Sweep, host_loop: bool):
  """(runner's timing by its timer, its host loop's row fields or {})."""
  count = dict(warmup=sweep.warmup, iters=sweep.iters, repeats=sweep.repeats)
  t = timing.TIMERS[runner.timer](runner.fn, prepared, **count)
  if not host_loop:
    return t, {}
  return t, output.host_loop_fields(timing.HOST_LOOP_TIMERS[runner.timer](runner.fn, prepared, **count))


def _varlen_runner(impl: str, spec: peers.OpSpec, kw: dict) -> peers.Runner:
  """Our op called in the varlen form (q [B * S, Hq, D], cu_seqlens_q), on the case's S tokens a sequence."""
  s = spec.num_queries
  padded = lambda x: x.reshape(x.shape[0] // s, *x.shape[1:]) if s == 1 else x.reshape(-1, s, *x.shape[1:])

  def prepare(args):
    q = args[0].reshape(-1, *args[0].shape[-2:])
    batch = q.shape[0] // s
    return (q, *args[1:], jnp.arange(0, (batch + 1) * s, s, dtype=jnp.int32))

  def call(*args):
    *args, cu_seqlens = args
    return op(*args, cu_seqlens_q=cu_seqlens)

  op = peers.build_pallas_kv(impl, spec, max_seqlen_q=s, **kw).fn
  return peers.Runner(fn=call, prepare=prepare,
                      to_numpy=lambda out: np.asarray(jnp.asarray(padded(out), jnp.float32)))


def config_types(op: str, *, variant: bool = False) -> dict[str, type[KernelConfig]]:
  """Backend name -> the config type of its kernel for `op` (variant: Mosaic GPU's experimental variant,
  which --convert_warpgroup and --one_tile_loop need)."""
  if op == "mla":
    return {"mosaic_gpu": pkv.MosaicMLAConfig}
  return {"triton": pkv.TritonConfig,
          "mosaic_gpu": experimental.MosaicGPUVariantConfig if variant else pkv.MosaicGPUConfig}




def run_impl(impl: str, case: cases.Case, sweep: cases.Sweep, input_sets: Sequence[tuple],
             ref: np.ndarray | None, costs: dict[str, float], host_loop: bool = True,
             kernel: KernelFlags = KernelFlags()) -> dict[str, Any]:
  """Checks and times one impl on one case (also in a host loop if `host_loop`; ours with
  `kernel`'s configs); never raises unless sweep.strict."""
  row: dict[str, Any] = {"impl": impl, "ours": impl in peers.OUR_IMPLS}
  try:
    runner, config = kernel.runner(impl, case, input_sets[0])
    if config is not None:
      row["config"] = config.given()
    if row["ours"] and kernel.tokens_last(case):
      row["v_tokens_last"] = True
    prepared = [runner.prepare(args) for args in input_sets]
    first = runner.fn(*prepared[0])  # compiles; "auto" records its choice
    if impl == "auto":
      row["auto_choice"] = peers.auto_choice()
    if ref is not None:
      row["rel_err"] = cases.relative_error(runner.to_numpy(first), ref)
    t, host = _timed(kernel.timed(runner), prepared, sweep, host_loop)
    row.update(host)
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


def run_case(case: cases.Case, sweep: cases.Sweep, key: jax.Array, host_loop: bool = True,
             kernel: KernelFlags = KernelFlags()) -> tuple[list[dict], dict]:
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
  if kernel.between_calls != "none":
    rows.append({**info, **_between_row(sweep, input_sets, host_loop)})
  for impl in sweep.impls:
    row = run_impl(impl, case, sweep, input_sets, ref, costs, host_loop, kernel)
    rows.append({**info, **row})
  return rows, info


def run(sweep: cases.Sweep | None = None, *, json_path: str | None = None,
        csv_path: str | None = None, plot_path: str | None = None,
        out: TextIO | None = None, host_loop: bool = True, kernel: KernelFlags = KernelFlags(),
        **overrides: Any) -> list[dict]:
  """Runs a sweep, prints one table per case to `out`, returns all rows.

  Every impl is timed by the chain timer and, if `host_loop`, also in a host loop (`host_us`).
  pallas_kv's own impls take `kernel`'s configs and layout (`KernelFlags`; none by default).

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
    rows, info = run_case(case, sweep, case_key, host_loop, kernel)
    print(output.format_table(info, rows), file=out, flush=True)
    print(file=out, flush=True)
    all_rows.extend({**r, **stamp} for r in rows)
    if json_path:  # after every case: a run cut short keeps the cases it finished
      output.write_json(all_rows, json_path)
  output.save(all_rows, json_path=json_path, csv_path=csv_path, plot_path=plot_path, out=out)
  return all_rows



def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags of a `cases.Sweep`, the files to write the rows to and the `KernelFlags`."""
  into = {"flag_values": flag_values}
  cli.define_sweep_flags(flag_values)
  cli.define_output_flags(("json", "csv", "plot"), flag_values)
  flags.DEFINE_boolean("merge_in_kernel", False, "triton: TritonConfig(merge_in_kernel=True), the split merge in "
                       "the kernel's own launch; the backend fills the other fields.", **into)
  flags.DEFINE_enum("split_plan", None, list(pkv.TritonConfig.SPLIT_PLANS),
                    "Every kernel config that has this plan (per_sequence, balanced: all; stream_k: the GQA kernels) "
                    "takes split_plan=PLAN, the backend filling the other fields (the split count: the plan's "
                    "own).", **into)
  flags.DEFINE_integer("stream_k_programs_per_sm", None, "--split_plan=stream_k: num_splits = the programs of this "
                       "many per SM (default: the backend's count, 2 or 3 paged).", lower_bound=1, **into)
  flags.DEFINE_boolean("convert_warpgroup", False, "mosaic_gpu, one-byte caches: pallas_kv.experimental."
                       "MosaicGPUVariantConfig(convert_warpgroup=True); the backend fills the other fields.", **into)
  flags.DEFINE_boolean("one_tile_loop", False, "mosaic_gpu: pallas_kv.experimental.MosaicGPUVariantConfig("
                       "one_tile_loop=True), every tile through the masked step; the heuristic fills the other "
                       "fields.", **into)
  flags.DEFINE_enum("sequence_order", None, list(pkv.TritonConfig.CHOICES["sequence_order"]),
                    "pallas_kv impls: the order in which programs take the sequences (sequence_order=ORDER); the "
                    "backend fills the other fields.", **into)
  flags.DEFINE_integer("triton_block_kv", None, "triton: TritonConfig(block_kv=N); the backend fills the other "
                       "fields.", **into)
  flags.DEFINE_integer("triton_num_stages", None, "triton: TritonConfig(num_stages=N); the backend fills the "
                       "other fields.", **into)
  flags.DEFINE_boolean("host_loop", True, "Also time each impl as a Python loop of separate calls (what a "
                       "user's loop sees, host dispatch included): the host us column, host_us in the rows.", **into)
  flags.DEFINE_boolean("v_tokens_last", None, "pallas_kv impls of the dense and paged ops: v stored "
                       "[B, Hkv, D, T] / [P, Hkv, D, page_size] (decode_attention's v_tokens_last); unset: "
                       "as KVCache.create lays it out (tokens last for a one-byte cache).", **into)
  flags.DEFINE_integer("triton_column_pieces", None, "triton: the most power-of-two column pieces a head dim is "
                       "cut into (pallas_kv.kernels.triton.config.MAX_COLUMN_PIECES; 1: one padded tile).",
                       lower_bound=1, **into)
  flags.DEFINE_boolean("varlen", False, "pallas_kv impls: q in the varlen form [B * S, Hq, D] with cu_seqlens_q "
                       "(S tokens a sequence), to set beside the same run without it.", **into)
  flags.DEFINE_enum("between_calls", "none", list(BETWEEN_CALLS), "xla_add: every timed call runs after an XLA "
                    "elementwise kernel on its queries, as a model's other kernels run between its attention calls "
                    "(the GPU's caches then hold their code); a row times that kernel alone, to subtract.", **into)
  flags.adopt_module_key_flags(cli, flag_values)


def kernel_flags(flag_values: flags.FlagValues = FLAGS) -> KernelFlags:
  """The parsed flags' `KernelFlags` (those of them a program defines); ValueError for flags no
  config takes."""
  names = [f.name for f in dataclasses.fields(KernelFlags) if f.name in flag_values]
  return KernelFlags(**{name: flag_values[name].value for name in names})


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    sweep, kernel = cli.sweep_from_flags(), kernel_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  paths = cli.output_paths()
  if FLAGS.triton_column_pieces is not None:   # before the first trace: traces are cached
    triton_config.MAX_COLUMN_PIECES = FLAGS.triton_column_pieces
  rows = run(sweep, json_path=paths.json, csv_path=paths.csv, plot_path=paths.plot, host_loop=FLAGS.host_loop,
             kernel=kernel)
  return output.report_failures(
      output.failed_rows(rows), lambda r: f"{r['impl']} on {r['op']} B={r['batch']} T={r['seq_len']}",
      tracebacks=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
