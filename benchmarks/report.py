r"""Markdown for RESULTS.md from the JSON rows that `python -m benchmarks.decode --json=...` writes.

  python -m benchmarks.report benchmarks/results/2026-11-29_h200_gqa.json [more.json ...]
      One table per file: a row per case, a column per impl, each cell "TB/s (µs)" of KV read.

  python -m benchmarks.report llama3_8b.json [more.json ...] \
      --command="python -m benchmarks.decode --flagfile=configs/llama3_8b.flags --json=llama3_8b.json"
      A whole RESULTS.md section: a header with the date, GPU and jax version (from the rows;
      --date overrides), the command, then per shape family (op, heads, dtype, options) the
      tables: median time (µs), median time in a host loop (µs; rows that have it), TB/s of KV
      read and % of the roofline, a column per impl, and the reasons of n/a or error cells and
      the largest relative error of the pallas_kv rows.

  python -m benchmarks.report FILE.json --auto
      Per case, `auto` against the fastest kernel backend and the fastest peer of the same run:
      what auto ran, its time, the fastest backend's, and the ratios (does auto pick the faster
      kernel; is the library ahead of the peers), and auto's and that peer's host-loop times.

  --plot=FILE.png also saves the TB/s plot of the rows (needs the `plot` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence

_OPTION_FIELDS = ("softcap", "window", "sinks")


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


# ------------------------------------------------------------------ sections

METRICS = (  # (title, row field, format)
    ("Median time per call (µs)", "time_us", "{:.1f}"),
    ("TB/s of KV read", "tbps", "{:.2f}"),
    ("% of roofline max(bytes / peak TB/s, flops / peak TFLOP/s)", "roofline_pct", "{:.0f}%"),
)
# Shown after the time table where the rows have it (rows written before it existed do not).
HOST_LOOP_METRIC = ("Median time per call in a Python loop of calls, host dispatch included (µs)",
                    "host_us", "{:.1f}")


def gpu_name(device: str) -> str:
  """"gpu:NVIDIA H200 x1" -> "NVIDIA H200"; "x4" is kept as "4x NVIDIA H200"."""
  platform, _, kind = device.partition(":")
  kind = kind or platform
  match = re.fullmatch(r"(.*) x(\d+)", kind)
  if not match:
    return kind
  name, count = match.group(1), int(match.group(2))
  return name if count == 1 else f"{count}x {name}"


def family(row: dict) -> str:
  """What the rows of one table share: op, heads, head dims, dtype, S, paging, options."""
  if row["op"] == "mla":
    heads = f"{row['num_heads']} heads, latent {row['head_dim']}/{row['v_head_dim']}"
  else:
    heads = f"heads {row['num_heads']}/{row['num_kv_heads']}, head_dim {row['head_dim']}"
  parts = [{"decode": "dense", "paged": "paged", "mla": "MLA"}[row["op"]], heads, row["dtype"],
           f"{row['num_queries']} new token{'s' if row['num_queries'] > 1 else ''}",
           "ragged lengths" if row.get("ragged") else "full lengths"]
  if row["op"] != "decode":
    parts.append(f"page {row['page_size']}" + (" shuffled" if row.get("shuffle_pages") else ""))
  if row.get("softcap") is not None:
    parts.append(f"softcap {row['softcap']:g}")
  if row.get("window") is not None:
    parts.append(f"window {row['window']}")
  if row.get("sinks"):
    parts.append("sinks")
  return ", ".join(parts)


def _cell(row: dict | None, field: str, fmt: str) -> str:
  if row is None:
    return "–"
  if row.get("status", "ok") != "ok":
    return row["status"]
  if row.get(field) is None:
    return "–"
  text = fmt.format(row[field])
  if row.get("ours") and row.get("check_ok") is False:
    text += " ✗"
  return text


def section(rows: Sequence[dict], *, command: str | None = None, date: str | None = None,
            sources: Sequence[str] = ()) -> str:
  """A RESULTS.md section (markdown) for `rows` of one or more runs."""
  rows = list(rows)
  devices = list(dict.fromkeys(gpu_name(r["device"]) for r in rows if r.get("device")))
  versions = list(dict.fromkeys(r["jax_version"] for r in rows if r.get("jax_version")))
  if date is None:
    dates = sorted({r["date"] for r in rows if r.get("date")})
    date = " to ".join(dict.fromkeys((dates[0], dates[-1]))) if dates else "date unknown"
  lines = [f"## {date} — {', '.join(devices) or 'device unknown'}, "
           f"jax {', '.join(versions) or 'unknown'}", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  if sources:
    lines += ["Rows: " + ", ".join(f"`{s}`" for s in sources) + ".", ""]
  lines += ["Cells are medians per call; n/a: the impl cannot run this case (reasons below); "
            "✗: failed the numerics check.", ""]
  families: dict[str, list[dict]] = {}
  for row in rows:
    families.setdefault(family(row), []).append(row)
  for name, group in families.items():
    impls = list(dict.fromkeys(r["impl"] for r in group))
    cases: dict[tuple[int, int], dict[str, dict]] = {}
    for r in group:
      cases.setdefault((r["batch"], r["seq_len"]), {})[r["impl"]] = r
    lines += [f"### {name[0].upper()}{name[1:]}", ""]
    metrics = list(METRICS)
    if any(r.get("host_us") is not None for r in group):
      metrics.insert(1, HOST_LOOP_METRIC)
    for title, field, fmt in metrics:
      lines += [f"{title}:", "", "| B × T | " + " | ".join(impls) + " |",
                "|---" * (len(impls) + 1) + "|"]
      for (b, t), by_impl in cases.items():
        cells = [_cell(by_impl.get(i), field, fmt) for i in impls]
        lines.append(f"| {b} × {t} | " + " | ".join(cells) + " |")
      lines.append("")
    reasons = dict.fromkeys(f"{r['impl']}: {r['status']} ({r.get('reason', '')})"
                            for r in group if r.get("status", "ok") != "ok")
    if reasons:
      lines += ["Not run: " + "; ".join(reasons) + ".", ""]
    errs = [r["rel_err"] for r in group if r.get("ours") and r.get("rel_err") is not None]
    if errs:
      failed = sum(r.get("check_ok") is False for r in group)
      lines += [f"Largest relative error of the pallas_kv rows against the float32 reference: "
                f"{max(errs):.1e}" + (f" ({failed} failed the check)." if failed else "."), ""]
  return "\n".join(lines).rstrip() + "\n"


KERNEL_IMPLS = ("mosaic_gpu", "triton")


def auto_table(rows: Sequence[dict]) -> str:
  """Markdown: per case, auto's time against the fastest kernel backend and the fastest peer.

  auto runs the same kernel with the same config as the backend it picked, so two more columns
  say how far to trust a ratio: that backend's own row against auto's (the same kernel timed
  twice: the run's spread) and whether a row's chains were dispatch-bound (timer
  "chain-diff+dispatch": the host could not queue calls as fast as the GPU ran them, so those
  figures hold host time). The last two: auto's and that peer's time in a host loop (what a
  user's Python loop of calls sees), where the rows have it.
  """
  cases: dict[tuple, dict[str, dict]] = {}
  for row in rows:
    if row.get("time_us") is not None:
      cases.setdefault((family(row), case_label(row)), {})[row["impl"]] = row
  lines = ["| case | auto ran | auto µs | fastest backend µs | auto / fastest | same kernel, other row | "
           "dispatch-bound | fastest peer µs | auto / peer | auto host-loop µs | peer host-loop µs |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (fam, label), by_impl in cases.items():
    auto = by_impl.get("auto")
    if auto is None:
      continue
    kernels = [r for name, r in by_impl.items() if name in KERNEL_IMPLS]
    peers = [r for r in by_impl.values() if not r.get("ours", r["impl"] in KERNEL_IMPLS + ("auto", "xla"))]
    best = min(kernels, key=lambda r: r["time_us"], default=None)
    peer = min(peers, key=lambda r: r["time_us"], default=None)
    ran = by_impl.get(auto.get("auto_choice") or "")
    ratio = lambda other: f"{auto['time_us'] / other['time_us']:.3f}" if other else "–"
    host = lambda r: f"{r['host_us']:.1f}" if r and r.get("host_us") is not None else "–"
    bound = [r["impl"] for r in (auto, best) if r and str(r.get("timer", "")).endswith("+dispatch")]
    lines.append(f"| {fam} {label} | {auto.get('auto_choice') or '?'} | {auto['time_us']:.1f} | "
                 + (f"{best['time_us']:.1f} ({best['impl']})" if best else "–") + f" | {ratio(best)} | "
                 + (f"{ran['time_us']:.1f} ({ratio(ran)})" if ran else "–") + " | "
                 + (", ".join(dict.fromkeys(bound)) or "no") + " | "
                 + (f"{peer['time_us']:.1f} ({peer['impl']})" if peer else "–") + f" | {ratio(peer)} | "
                 + f"{host(auto)} | {host(peer)} |")
  return "\n".join(lines)


def _date_from_path(path: str) -> str | None:
  match = re.match(r"(\d{4}-\d{2}-\d{2})", os.path.basename(path))
  return match.group(1) if match else None


def main(argv: Sequence[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("paths", nargs="+", help="JSON files from python -m benchmarks.decode --json")
  parser.add_argument("--command", help="the command that made the rows; prints a whole section")
  parser.add_argument("--date", help="the section's date (default: the rows' date, else the "
                      "file name's YYYY-MM-DD prefix)")
  parser.add_argument("--section", action="store_true",
                      help="print a whole section even without --command")
  parser.add_argument("--plot", help="also save the rows' TB/s plot (benchmarks.decode --plot's) as this PNG")
  parser.add_argument("--auto", action="store_true", help="auto against the fastest backend and peer, per case")
  args = parser.parse_args(argv)
  loaded = []
  for path in args.paths:
    with open(path) as f:
      loaded.append((path, json.load(f)))
  if args.plot:
    from benchmarks import output  # pylint: disable=g-import-not-at-top  (imports jax)
    if output.plot_available():
      output.write_plot([r for _, rs in loaded for r in rs], args.plot)
      print(f"# wrote {args.plot}")
    else:
      print("# --plot needs matplotlib (pip install 'pallas-kv[plot]'); no plot written")
  if args.auto:
    print(auto_table([r for _, rs in loaded for r in rs]))
    return
  if args.command is None and not args.section:
    for path, rows in loaded:
      print(f"`{path}`\n")
      print(table(rows))
      print()
    return
  rows = [r for _, rs in loaded for r in rs]
  date = args.date
  if date is None and not any(r.get("date") for r in rows):
    date = next(filter(None, (_date_from_path(p) for p, _ in loaded)), None)
  print(section(rows, command=args.command, date=date, sources=[p for p, _ in loaded]))


if __name__ == "__main__":
  main(sys.argv[1:])
