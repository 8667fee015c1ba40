r"""Markdown tables from the JSON rows that `benchmarks/decode.py --json=...` writes.

  python -m benchmarks.report benchmarks/results/2026-11-29_h200_gqa.json [more.json ...]

One table per file: a row per case, a column per impl, each cell "TB/s (µs)" of KV read.
"""

from __future__ import annotations

import json
import sys


def case_label(row: dict) -> str:
  label = f"B{row['batch']} T{row['seq_len']} {row['num_heads']}/{row['num_kv_heads']}"
  if row.get("page_size") and row["op"] == "paged":
    label += f" page{row['page_size']}"
  return label


def table(rows: list[dict]) -> str:
  impls: list[str] = []
  cases: dict[str, dict[str, dict]] = {}
  for row in rows:
    if row.get("time_us") is None:
      continue
    if row["impl"] not in impls:
      impls.append(row["impl"])
    cases.setdefault(case_label(row), {})[row["impl"]] = row
  lines = ["| shape | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
  for label, by_impl in cases.items():
    cells = []
    for impl in impls:
      row = by_impl.get(impl)
      cells.append("–" if row is None else f"{row['tbps']:.2f} ({row['time_us']:.0f})")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(paths: list[str]) -> None:
  for path in paths:
    with open(path) as f:
      rows = json.load(f)
    print(f"`{path}`\n")
    print(table(rows))
    print()


if __name__ == "__main__":
  main(sys.argv[1:])
