r"""The few Nsight Compute metrics that say what limits a decode kernel, one row per kernel.

  ncu --import prof.ncu-rep --page details --csv > prof.csv
  python3 -m benchmarks.ncu_summary prof.csv [more.csv ...]

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


def read_launches(lines: Iterable[str]) -> list[dict]:
  """[{'kernel': name, 'id': launch id, metric name: 'value unit'}] from a details CSV."""
  launches: dict[str, dict] = {}
  for row in csv.DictReader(line for line in lines if line.strip() and not line.startswith("==")):
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
    cells = "  ".join(f"{title}={launch.get(metric, '-')}" for title, metric in COLUMNS)
    lines.append(f"{source}{' ' if source else ''}[{launch['id']}] {kernel}\n    {cells}")
  return "\n".join(lines)


def main(paths: Sequence[str]) -> int:
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
