r"""The few Nsight Compute metrics that say what limits a decode kernel, one row per kernel.

  ncu --import prof.ncu-rep --page details --csv > prof.csv
  python3 -m benchmarks.tools.ncu_summary prof.csv [more.csv ...]
  ncu --metrics "$(python3 -m benchmarks.tools.ncu_summary --metrics_flag [--pipes])" --csv ... > raw.csv

With `--metrics` output (raw metric names) it prints DRAM and SM %, issue activity, warps per
scheduler, and the cycles per issued instruction a warp spends stalled, by reason, largest first.

Reads the "details" page CSV (one line per kernel launch x metric) and prints, per launch:
duration, DRAM throughput (% of peak and GB/s of reads where reported), registers per
thread, dynamic shared memory per block, threads, waves per SM, theoretical and achieved
occupancy and which resource limits the blocks per SM.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterable, Sequence

# (column title, ncu "Metric Name" in the details page)
COLUMNS = (
    ("duration", "Duration"),
    ("DRAM %", "DRAM Throughput"),
    ("mem %", "Memory Throughput"),
    ("regs/thr", "Registers Per Thread"),
    ("dyn smem/blk", "Dynamic Shared Memory Per Block"),
    ("threads/blk", "Block Size"),
    ("grid", "Grid Size"),
    ("waves/SM", "Waves Per SM"),
    ("blk lim regs", "Block Limit Registers"),
    ("blk lim smem", "Block Limit Shared Mem"),
    ("theo occ %", "Theoretical Occupancy"),
    ("ach occ %", "Achieved Occupancy"),
)
# The same and more as raw metrics (`ncu --metrics ...`, the suite's ncu_stalls part), printed
# where a launch has them.
RAW_COLUMNS = (
    ("duration", "gpu__time_duration.sum"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("regs/thr", "launch__registers_per_thread"),
    ("blocks/SM by regs", "launch__occupancy_limit_registers"),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps/scheduler", "smsp__warps_active.avg.per_cycle_active"),
    ("eligible/scheduler", "smsp__warps_eligible.avg.per_cycle_active"),
)
# Cycles per issued instruction a warp spends stalled, by reason: smsp__average_warps_issue_stalled_
# <reason>_per_issue_active.ratio ("selected" is the issue itself, 1).
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "not_selected", "dispatch_stall",
                 "math_pipe_throttle", "mio_throttle", "lg_throttle", "branch_resolving", "no_instruction",
                 "membar", "drain", "imc_miss", "tex_throttle", "sleeping", "misc", "selected")


# How busy each SM pipe was (the tensor pipe, which runs wgmma, first): ncu names them by pattern,
# and which names exist depends on the GPU and ncu version, so they are asked for by regex and
# printed as found.
PIPE_PREFIX, PIPE_SUFFIX = "sm__pipe_", "_cycles_active.avg.pct_of_peak_sustained_active"
PIPES_REGEX = "regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active"


def ncu_metrics_flag(pipes: bool = False) -> str:
  """The `--metrics` list of RAW_COLUMNS and the stall reasons (and every pipe's activity)."""
  metrics = [metric for _, metric in RAW_COLUMNS] + [STALL_PREFIX + r + STALL_SUFFIX for r in STALL_REASONS]
  return ",".join(metrics + ([PIPES_REGEX] if pipes else []))


def _number(text: str) -> float:
  try:
    return float(text.split()[0].replace(",", ""))
  except (ValueError, IndexError):
    return float("nan")


def read_launches(lines: Iterable[str]) -> list[dict]:
  """[{'kernel': name, 'id': launch id, metric name: 'value unit'}] from a details CSV."""
  launches: dict[str, dict] = {}
  # The profiled program's own output may come first: the CSV starts at its header line.
  lines = list(lines)
  start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), 0)
  for row in csv.DictReader(line for line in lines[start:] if line.strip() and not line.startswith("==")):
    name = row.get("Metric Name")
    if not name or "Kernel Name" not in row:
      continue
    launch = launches.setdefault(row.get("ID", ""), {"kernel": row["Kernel Name"], "id": row.get("ID", "")})
    unit = (row.get("Metric Unit") or "").strip()
    launch[name] = f"{row.get('Metric Value', '').strip()} {unit}".strip()
  return list(launches.values())


def format_rows(launches: Sequence[dict], source: str = "") -> str:
  lines = []
  for launch in launches:
    kernel = launch["kernel"]
    kernel = kernel if len(kernel) <= 60 else kernel[:57] + "..."
    # A line per metric set that the launch has, '-' for the metrics of that set it lacks.
    cells, raw = ("  ".join(f"{title}={launch.get(metric, '-')}" for title, metric in columns)
                  if any(metric in launch for _, metric in columns) else "" for columns in (COLUMNS, RAW_COLUMNS))
    stalls = sorted(((_number(launch[STALL_PREFIX + r + STALL_SUFFIX]), r) for r in STALL_REASONS
                     if STALL_PREFIX + r + STALL_SUFFIX in launch), reverse=True)
    pipes = sorted(((_number(value), name[len(PIPE_PREFIX):-len(PIPE_SUFFIX)]) for name, value in launch.items()
                    if name.startswith(PIPE_PREFIX) and name.endswith(PIPE_SUFFIX)), reverse=True)
    busy = "pipes busy %: " + "  ".join(f"{name}={v:.1f}" for v, name in pipes if v >= 1) if pipes else ""
    text = f"{source}{' ' if source else ''}[{launch['id']}] {kernel}"
    for part in (cells, raw, busy):
      text += f"\n    {part}" if part else ""
    if stalls:
      text += (f"\n    cycles per issue {sum(v for v, _ in stalls):.2f}: "
               + "  ".join(f"{r}={v:.2f}" for v, r in stalls if v >= 0.01))
    lines.append(text)
  return "\n".join(lines)


def main(paths: Sequence[str]) -> int:
  if list(paths) in (["--metrics_flag"], ["--metrics_flag", "--pipes"]):
    print(ncu_metrics_flag(pipes="--pipes" in paths))
    return 0
  if not paths:
    print(__doc__)
    return 2
  for path in paths:
    with open(path, newline="") as f:
      launches = read_launches(f)
    print(format_rows(launches, source=path) if launches else f"{path}: no kernel launches in this CSV")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
