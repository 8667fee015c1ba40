"""Summarise `nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` samples.

Only samples drawing more than `--min_watts` count: those taken while kernels ran, not while the
benchmark compiled. Prints the median and range of the SM clock and the power over them.
  python -m benchmarks.tools.clocks clocks.csv --label=kernel
"""
import statistics
import sys

from absl import app, flags

_LABEL = flags.DEFINE_string("label", "", "Name printed before the summary.")
_MIN_WATTS = flags.DEFINE_float("min_watts", 300.0, "Samples at or under this power are left out.")


def summarise(lines: list[str], min_watts: float) -> str:
  samples = []
  for line in lines:
    fields = [f.strip() for f in line.split(",")]
    try:
      mhz, watts = float(fields[0]), float(fields[1])
    except (IndexError, ValueError):
      continue
    if watts > min_watts:
      samples.append((mhz, watts))
  if not samples:
    return f"no samples above {min_watts:.0f} W (of {len(lines)})"
  mhz = [m for m, _ in samples]
  watts = [w for _, w in samples]
  return (f"{len(samples)} samples above {min_watts:.0f} W: SM clock median {statistics.median(mhz):.0f} MHz "
          f"(range {min(mhz):.0f}-{max(mhz):.0f}), power median {statistics.median(watts):.0f} W "
          f"(range {min(watts):.0f}-{max(watts):.0f})")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m benchmarks.tools.clocks FILE.csv [--label=NAME]")
  with open(argv[1]) as f:
    lines = f.readlines()
  print(f"{_LABEL.value}: {summarise(lines, _MIN_WATTS.value)}")


if __name__ == "__main__":
  sys.exit(app.run(main))
