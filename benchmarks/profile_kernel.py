r"""Runs one decode case a few times per impl, for a profiler (Nsight Compute) to watch.

  ncu --kernel-name regex:'pallas_kv|flash|fmha|sdpa' --launch-skip 3 --launch-count 2 \
      --section LaunchStats --section Occupancy --section SpeedOfLight --export prof \
      python3 -m benchmarks.profile_kernel --impl=mosaic_gpu --cases=128x4096
  python3 -m benchmarks.ncu_summary prof.csv    (after `ncu --import prof.ncu-rep --page details --csv`)

Shape and impl flags are benchmarks/decode.py's (`--flagfile` works); each impl runs `--calls`
calls of its first case after `--warmup` (compilation, autotuning), each call synchronised, so a
profiler that skips the first launches lands on steady-state calls. Nothing is timed or checked
here: benchmarks/decode.py does that. `bash benchmarks/h200_suite.sh ncu` runs it under ncu.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app
from absl import flags
import jax

from benchmarks import decode as bench

_CALLS = flags.DEFINE_integer("calls", 5, "synchronised calls per impl after the warm-up")


def run(sweep: bench.Sweep, calls: int) -> list[str]:
  """Runs each impl on the sweep's first case; returns one line per impl."""
  batch, seq_len = sweep.cases[0]
  case = bench.Case.from_sweep(sweep, batch, seq_len)
  key_len, key_in = jax.random.split(jax.random.key(sweep.seed))
  args = bench.make_inputs(case, key_in, bench.make_lengths(case, key_len))
  lines = []
  for impl in sweep.impls:
    try:
      runner = bench.build_runner(impl, bench.op_spec(case))
      prepared = runner.prepare(args)
      for _ in range(max(1, sweep.warmup) + calls):
        runner.to_numpy(runner.fn(*prepared))  # waits for the call (jax or torch)
      lines.append(f"{impl}: {calls} calls of {case.describe()} after {max(1, sweep.warmup)} warm-up")
    except Exception as e:  # pylint: disable=broad-except
      lines.append(f"{impl}: not run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    print(lines[-1], flush=True)
  return lines


def main(argv: Sequence[str]) -> None:
  del argv
  run(bench.sweep_from_flags(), _CALLS.value)


if __name__ == "__main__":
  app.run(main)
