r"""Runs one decode case a few times per impl, for a profiler (Nsight Compute) to watch.

  ncu --kernel-name regex:'pallas_kv|flash|fmha|sdpa' --launch-skip 3 --launch-count 2 \
      --section LaunchStats --section Occupancy --section SpeedOfLight --export prof \
      python3 -m benchmarks.tools.profile_kernel --impl=mosaic_gpu --cases=128x4096
  python3 -m benchmarks.tools.ncu_summary prof.csv    (after `ncu --import prof.ncu-rep --page details --csv`)

Shape and impl flags are benchmarks.decode's (`--flagfile` works); each impl runs `--calls`
calls of its first case after `--warmup` (compilation, autotuning), each call synchronised, so a
profiler that skips the first launches lands on steady-state calls. Nothing is timed or checked
here: benchmarks.decode does that. RESULTS.md's runs added `--clock-control none` (the GPU's own
clocks) and `--launch-count 1`; with `--metrics "$(python3 -m benchmarks.tools.ncu_summary
--metrics_flag)" --csv > raw.csv` instead of the sections, ncu_summary ranks the stall reasons.

  python3 -m benchmarks.tools.profile_kernel --launches --impl=triton,cudnn --cases=1x32768

`--launches` instead prints, per JAX impl, what the compiled call launches: the top-level ops of
its optimized program (fusions, custom calls, copies; each at least one kernel on a GPU), without
a profiler. A decode call's fixed cost grows with this count.

  python3 -m benchmarks.tools.profile_kernel --kernel_times --impl=triton,cudnn,torch --cases=1x32768

`--kernel_times` prints, per impl (JAX or torch), every kernel of one call with its GPU time
(the mean over --calls synchronised calls), recorded by torch.profiler's CUDA activity tracing:
CUPTI sees every kernel of the process, JAX's included. It needs torch with CUDA.
`--chain_calls=N` profiles one run of the chain timer's own program of N calls instead
(`timing.chain`, JAX impls): the GPU's busy time per call, the elapsed time from the first kernel's
start to the last one's end per call, and the longest gaps between kernels. Set against the
timer's figure for the same N, it tells GPU time from whatever else the chain-diff includes.

  python3 -m benchmarks.tools.profile_kernel --timer_check --impl=triton,cudnn --cases=32x4096

`--timer_check` prints, per JAX impl, the chain-diff timer plain and queued behind a lead run
(`timing.time_jax(queued=...)`; the module doc there says why), beside the GPU's busy time per
call in a profiled chain of `--chain_calls` (default 40) calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax

from benchmarks import cases
from benchmarks import cli
from benchmarks import decode
from benchmarks import output
from benchmarks import timing

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The flags of benchmarks.decode's sweep (`cli.define_sweep_flags`) and --calls."""
  cli.define_sweep_flags()
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_integer("calls", 5, "synchronised calls per impl after the warm-up")
  flags.DEFINE_bool("launches", False, "print each JAX impl's compiled top-level ops instead of running it")
  flags.DEFINE_integer("chain_calls", 0, "with --kernel_times, JAX impls: profile one run of the chain timer's "
                       "program of this many calls instead, and print the GPU's busy and elapsed time per call")
  flags.DEFINE_bool("timer_check", False, "JAX impls: the chain-diff timer plain and queued, beside the GPU's "
                    "busy time per call in a profiled chain of --chain_calls (default 40) calls")
  flags.DEFINE_bool("v_tokens_last", None, "pallas_kv impls of the dense and paged ops: v stored tokens last; "
                    "unset: the layout a cache of the dtype is created in (benchmarks.decode's flag of that name)")
  flags.DEFINE_integer("triton_num_stages", None, "triton impl: TritonConfig(num_stages=N), the backend filling "
                       "the other fields (benchmarks.decode's flag of that name)")
  flags.DEFINE_bool("kernel_times", False, "print the GPU time of every kernel a call launches (torch.profiler's "
                    "CUDA activity, which records JAX's kernels too) instead of only running the calls")


# Top-level instructions of an optimized program that launch nothing.
_NOT_LAUNCHED = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier"}
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\(")


def _first_case(sweep: cases.Sweep):
  """(case, op inputs) of the sweep's first case."""
  batch, seq_len = sweep.cases[0]
  case = cases.Case.from_sweep(sweep, batch, seq_len)
  key_len, key_in = jax.random.split(jax.random.key(sweep.seed))
  return case, cases.make_inputs(case, key_in, cases.make_lengths(case, key_len))


def launched_ops(compiled_text: str) -> list[str]:
  """The ENTRY computation's instructions that launch work ("fusion", "custom-call:<target>", ...)."""
  entry = compiled_text[compiled_text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  ops = []
  for line in entry.splitlines()[1:]:
    match = _INSTRUCTION.match(line)
    if not match or match.group(2) in _NOT_LAUNCHED:
      continue
    op = match.group(2)
    target = re.search(r'custom_call_target="([^"]+)"', line)
    ops.append(f"{op}:{target.group(1)}" if target else op)
  return ops


def _per_impl(sweep: cases.Sweep, describe: Callable[..., str], failed: str,
              kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """One printed line per impl of the sweep: "impl: " + describe(runner, case, args) on its first
  case (ours with `kernel`'s configs and layout), or "impl: <failed> (why)" where that raises."""
  case, args = _first_case(sweep)
  lines = []
  for impl in sweep.impls:
    try:
      runner, _ = kernel.runner(impl, case, args)
      lines.append(f"{impl}: {describe(runner, case, args)}")
    except Exception as e:  # pylint: disable=broad-except
      lines.append(f"{impl}: {failed} ({output.error_reason(e)})")
    print(lines[-1], flush=True)
  return lines


def _check_jax(runner) -> None:
  if runner.timer != "jax":
    raise ValueError(f"not a JAX impl (timer {runner.timer!r})")


def launches(sweep: cases.Sweep, kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """Per JAX impl, one line: how many top-level ops its compiled call on the first case launches."""
  def describe(runner, case, args):
    _check_jax(runner)
    ops = launched_ops(jax.jit(runner.fn).lower(*runner.prepare(args)).compile().as_text())
    return f"{len(ops)} ops launched per call of {case.describe()}: {', '.join(ops)}"
  return _per_impl(sweep, describe, "not compiled", kernel)


def _calls(runner, args) -> Callable[[], Any]:
  """A call of the runner on its prepared args that waits for its result (jax or torch)."""
  prepared = runner.prepare(args)
  return lambda: runner.to_numpy(runner.fn(*prepared))


def run(sweep: cases.Sweep, calls: int, kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """Runs each impl on the sweep's first case; returns one line per impl."""
  def describe(runner, case, args):
    call = _calls(runner, args)
    for _ in range(max(1, sweep.warmup) + calls):
      call()
    return f"{calls} calls of {case.describe()} after {max(1, sweep.warmup)} warm-up"
  return _per_impl(sweep, describe, "not run", kernel)


def _cuda_profile(fn: Callable[[], Any], calls: int = 1):
  """torch.profiler's CUDA activity over `calls` calls of fn; RuntimeError without torch's CUDA."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from torch import profiler  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError(f"--kernel_times needs torch with CUDA ({e})") from None
  if not torch.cuda.is_available():
    raise RuntimeError("--kernel_times needs torch with CUDA (torch.cuda.is_available() is False)")
  with profiler.profile(activities=[profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      fn()
    torch.cuda.synchronize()
  return prof


def kernel_times(fn: Callable[[], Any], calls: int) -> list[tuple[str, float, float]]:
  """[(kernel name, launches per call, GPU µs per call)] of `calls` calls of fn (which waits for
  its call), slowest first; raises RuntimeError without torch's CUDA profiler."""
  rows = []
  for event in _cuda_profile(fn, calls).key_averages():
    total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
    if total:
      rows.append((event.key, event.count / calls, total / calls))
  return sorted(rows, key=lambda row: -row[2])


def _profiled_kernels(fn: Callable[[], Any]) -> list[tuple[float, float, str]]:
  """[(start µs, end µs, name)] of every kernel of one call of fn, in start order."""
  return sorted((e.time_range.start, e.time_range.end, e.name) for e in _cuda_profile(fn).events()
                if str(e.device_type).endswith("CUDA"))


def chain_summary(kernels: Sequence[tuple[float, float, str]], calls: int) -> str:
  """Busy and elapsed GPU µs per call of a profiled chain, and its three longest gaps."""
  if not kernels:
    return "no kernels recorded"
  busy = sum(end - start for start, end, _ in kernels)
  elapsed = max(end for _, end, _ in kernels) - kernels[0][0]
  gaps = sorted(((later[0] - earlier[1], earlier[2][:40], later[2][:40])
                 for earlier, later in zip(kernels, kernels[1:])), reverse=True)[:3]
  gap_text = ", ".join(f"{gap:.1f} us after {a}" for gap, a, _ in gaps) or "none"
  return (f"busy {busy / calls:.1f} us, elapsed {elapsed / calls:.1f} us per call over {len(kernels)} kernels; "
          f"longest gaps: {gap_text}")


def chain_lines(sweep: cases.Sweep, calls: int, kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """Per JAX impl, one line: `chain_summary` of one run of its chain of `calls` calls."""
  def describe(runner, case, args):
    _check_jax(runner)
    arg_sets = [runner.prepare(args)]
    program = jax.jit(timing.chain(runner.fn, calls)).lower(arg_sets).compile()
    run_once = lambda: jax.block_until_ready(program(arg_sets))
    for _ in range(max(1, sweep.warmup)):
      run_once()
    return f"chain of {calls} calls of {case.describe()}: {chain_summary(_profiled_kernels(run_once), calls)}"
  return _per_impl(sweep, describe, "not profiled", kernel)


def timer_check_lines(sweep: cases.Sweep, calls: int, kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """Per JAX impl, one line: the timer plain and queued, and the GPU busy µs per call of a chain."""
  def describe(runner, case, args):
    _check_jax(runner)
    arg_sets = [runner.prepare(args)]
    counts = dict(warmup=sweep.warmup, iters=sweep.iters, repeats=sweep.repeats)
    plain = timing.time_jax(runner.fn, arg_sets, queued=False, **counts)
    queued = timing.time_jax(runner.fn, arg_sets, queued=True, **counts)
    program = jax.jit(timing.chain(runner.fn, calls)).lower(arg_sets).compile()
    run_once = lambda: jax.block_until_ready(program(arg_sets))
    run_once()
    busy = sum(end - start for start, end, _ in _profiled_kernels(run_once)) / calls
    return (f"{case.describe()}: timer plain {plain.median_s * 1e6:.1f} us, queued {queued.median_s * 1e6:.1f} us "
            f"({queued.method}), GPU busy {busy:.1f} us per call in a chain of {calls}")
  return _per_impl(sweep, describe, "not checked", kernel)


def kernel_time_lines(sweep: cases.Sweep, calls: int, kernel: decode.KernelFlags = decode.KernelFlags()) -> list[str]:
  """Per impl, one line: the kernels of one call of the sweep's first case and their GPU µs."""
  def describe(runner, case, args):
    call = _calls(runner, args)
    for _ in range(max(1, sweep.warmup)):
      call()
    rows = kernel_times(call, calls)
    kernels = "; ".join(f"{name[:60]} x{count:g} {us:.1f}" for name, count, us in rows)
    return f"{sum(us for _, _, us in rows):.1f} us of kernels per call of {case.describe()}: {kernels}"
  return _per_impl(sweep, describe, "not profiled", kernel)


def main(argv: Sequence[str]) -> None:
  del argv
  try:
    sweep, kernel = cli.sweep_from_flags(), decode.kernel_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.timer_check:
    timer_check_lines(sweep, FLAGS.chain_calls or 40, kernel)
  elif FLAGS.kernel_times and FLAGS.chain_calls:
    chain_lines(sweep, FLAGS.chain_calls, kernel)
  elif FLAGS.kernel_times:
    kernel_time_lines(sweep, FLAGS.calls, kernel)
  elif FLAGS.launches:
    launches(sweep, kernel)
  else:
    run(sweep, FLAGS.calls, kernel)


if __name__ == "__main__":
  define_flags()
  app.run(main)
