"""What the benchmark programs write: rows and their checks, tables, JSON, CSV and a plot.

A row is a dict: the case's fields, the impl, `status` ("ok", "n/a", "error", ...), timing fields
in microseconds (the device time, and where measured the host-loop time) and, where checked,
`rel_err` and `check_ok`.
"""

from __future__ import annotations

import csv
import datetime
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax

from benchmarks import cases
from benchmarks import timing

# Row fields of a `timing.Timing`, in the order rows (and CSV columns) list them.
TIMING_FIELDS = ("time_us", "min_us", "samples_us", "overhead_us", "host_bound", "timer", "calls")
# Row fields of a host-loop `timing.Timing` (`timing.HOST_LOOP_TIMERS`).
HOST_LOOP_FIELDS = ("host_us", "host_min_us", "host_samples_us", "host_calls")


def device_description() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()}"


def today() -> str:
  return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def run_stamp() -> dict[str, str]:
  """Fields every row of a run carries: where, with which jax, and when."""
  return {"device": device_description(), "jax_version": jax.__version__, "date": today()}


def error_reason(e: BaseException) -> str:
  """"Type: first line of the message", for a row that could not run."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def timing_fields(t: timing.Timing, names: Sequence[str] = TIMING_FIELDS) -> dict[str, Any]:
  """The `names` of TIMING_FIELDS of a measurement, times in microseconds."""
  every = dict(time_us=t.median_s * 1e6, min_us=t.min_s * 1e6,
               samples_us=[s * 1e6 for s in t.samples_s], overhead_us=t.overhead_s * 1e6,
               host_bound=t.host_bound, timer=t.method, calls=t.calls)
  return {name: every[name] for name in names}


def host_loop_fields(t: timing.Timing) -> dict[str, Any]:
  """HOST_LOOP_FIELDS of a host-loop measurement, times in microseconds."""
  return dict(host_us=t.median_s * 1e6, host_min_us=t.min_s * 1e6,
              host_samples_us=[s * 1e6 for s in t.samples_s], host_calls=t.calls)


# ------------------------------------------------------------------ failures


def is_peer(row: dict) -> bool:
  """A peer's row (benchmarks/peers.py): reported, never failing the run."""
  return row.get("ours") is False


def failed_rows(rows: Sequence[dict], exempt: Callable[[dict], bool] = is_peer) -> list[dict]:
  """Rows that errored (n/a is no failure) or failed the numerics check, but for `exempt` ones."""
  return [r for r in rows if not exempt(r) and
          (r["status"] == "error" or r.get("check_ok") is False)]


def report_failures(failed: Sequence[dict], label: Callable[[dict], str], *,
                    tracebacks: bool = False) -> int:
  """A FAILED line per row on stderr (`label` names the row); the exit status: 1 if any."""
  for r in failed:
    print(f"FAILED: {label(r)}: {r.get('reason') or 'rel_err %.3g' % r['rel_err']}",
          file=sys.stderr)
    if tracebacks and r.get("traceback"):
      print(r["traceback"], file=sys.stderr)
  return 1 if failed else 0


# ------------------------------------------------------------------ files


def write_json(rows: Sequence[dict], path: str) -> None:
  with open(path, "w") as f:
    json.dump(list(rows), f, indent=1)


def _is_scalar(value: Any) -> bool:
  return value is None or isinstance(value, (str, bool, int, float))


def write_csv(rows: Sequence[dict], path: str) -> None:
  """One line per row; the columns are the rows' scalar fields, in first-seen order."""
  columns: dict[str, None] = {}
  for row in rows:
    columns.update((k, None) for k, v in row.items() if _is_scalar(v))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})


def _plot_group(rows: Sequence[dict], x: str, fixed: str) -> tuple[list[dict], str]:
  """The ok rows along `x` at the `fixed` value with the most distinct x (ties: the
  largest); all rows if no value has two. Returns (rows, a label of the subset)."""
  by_fixed: dict[int, set[int]] = {}
  for r in rows:
    by_fixed.setdefault(r[fixed], set()).add(r[x])
  best = max(by_fixed, key=lambda v: (len(by_fixed[v]), v))
  if len(by_fixed[best]) < 2:
    return list(rows), f"all cases ({fixed} varies)"
  return [r for r in rows if r[fixed] == best], f"{fixed}={best}"


def plot_available() -> bool:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def _shape_family(row: dict) -> str:
  """The op and heads of a row's case, without its batch and length: a plot's title."""
  case = cases.Case.from_row(row)
  return f"{case.op} {case.describe().split(' ', 3)[3]}"


def write_plot(rows: Sequence[dict], path: str) -> None:
  """TB/s against context length per impl; a second panel against batch when the
  rows have several batches. Needs matplotlib (the `plot` extra)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  ok = [r for r in rows if r.get("status") == "ok"]
  panels = [("seq_len", "batch", "context length (tokens)")]
  if len({r["batch"] for r in ok}) > 1:
    panels.append(("batch", "seq_len", "batch"))
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
  impls = list(dict.fromkeys(r["impl"] for r in ok))
  for ax, (x, fixed, xlabel) in zip(axes[0], panels):
    group, subset = _plot_group(ok, x, fixed) if ok else ([], "no rows")
    # Across varying `fixed` values a connecting line would zigzag: markers only.
    style = "" if subset.startswith("all cases") else "-"
    for impl in impls:
      points = sorted((r[x], r["tbps"]) for r in group if r["impl"] == impl)
      if points:
        ax.plot(*zip(*points), marker="o", linestyle=style, label=impl)
    if group:
      ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TB/s of KV read")
    ax.set_title(subset)
    ax.grid(True, alpha=0.3)
    if impls:
      ax.legend(fontsize="small")
  if ok:
    fig.suptitle(f"{_shape_family(ok[0])}  ({ok[0].get('device', '')})", fontsize="medium")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_bars(rows: Sequence[dict], path: str) -> None:
  """Per case, a group of bars: each impl's TB/s from the chain timer, and hatched beside it from a
  host loop of jitted calls where the rows have it. Needs matplotlib (the `plot` extra)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  ok = [r for r in rows if r.get("status") == "ok"]
  labels = list(dict.fromkeys(f"B{r['batch']} T{r['seq_len']}" for r in ok))
  impls = list(dict.fromkeys(r["impl"] for r in ok))
  by_key = {(f"B{r['batch']} T{r['seq_len']}", r["impl"]): r for r in ok}
  width = 0.8 / max(1, len(impls))
  fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(labels)), 4.5))
  for i, impl in enumerate(impls):
    xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(labels))]
    found = [by_key.get((label, impl)) for label in labels]
    device = [r["tbps"] if r else 0.0 for r in found]
    host = [r["kv_bytes"] / r["host_us"] / 1e6 if r and r.get("host_us") else 0.0 for r in found]
    bars = ax.bar([x - width / 4 for x in xs], device, width / 2, label=impl)
    ax.bar([x + width / 4 for x in xs], host, width / 2, color=bars.patches[0].get_facecolor(), alpha=0.45,
           hatch="//")
  ax.set_xticks(range(len(labels)), labels)
  ax.set_ylabel("TB/s of KV read")
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize="small", ncols=len(impls))
  if ok:
    ax.set_title(f"{_shape_family(ok[0])}, {ok[0].get('device', '').removeprefix('gpu:')}, {ok[0].get('date', '')}\n"
                 "solid: device time (chain timer); hatched: a Python loop of jitted calls", fontsize="medium")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def save(rows: Sequence[dict], *, json_path: str | None = None, csv_path: str | None = None,
         plot_path: str | None = None, out: TextIO | None = None) -> None:
  """Writes the rows to each file named, saying so on `out` (stdout by default)."""
  out = sys.stdout if out is None else out
  if json_path:
    write_json(rows, json_path)
    print(f"# wrote {len(rows)} rows to {json_path}", file=out, flush=True)
  if csv_path:
    write_csv(rows, csv_path)
    print(f"# wrote {len(rows)} rows to {csv_path}", file=out, flush=True)
  if plot_path:
    if plot_available():
      write_plot(rows, plot_path)
      print(f"# wrote the plot to {plot_path}", file=out, flush=True)
    else:
      print("# --plot: matplotlib (the plot extra, pip install -e '.[plot]') is not "
            "installed; no plot written", file=out, flush=True)


# ------------------------------------------------------------------ benchmarks.decode's table

# time us: device time per call (chain timer); host us: per call in a Python loop of calls.
CASE_HEADER = (f"{'impl':<17}{'time us':>10}{'host us':>10}{'TB/s':>8}{'TFLOP/s':>9}{'roofline':>10}"
               f"{'rel err':>10}  note")


def format_table(info: dict, rows: Sequence[dict]) -> str:
  """One case of benchmarks.decode: a title line with the case, then a line per impl."""
  full = "full" if info.get("length") is None else f"each {info['length']}"
  lengths = ("ragged" if info["ragged"] else full) + f" ({info['total_keys']} keys"
  if info["attended_keys"] != info["total_keys"]:
    lengths += f", {info['attended_keys']} in the window"
  lengths += ")"
  title = (f"== {cases.Case.from_row(info).describe()}"
           f"  lengths={lengths}  KV {info['kv_bytes'] / 1e6:.1f} MB"
           f"  sets={info['num_sets']}  check: {info['reference']}")
  lines = [title, CASE_HEADER]
  on_cpu = jax.default_backend() == "cpu"
  for row in rows:
    if row["status"] != "ok":
      lines.append(f"{row['impl']:<17}{row['status']} ({row['reason']})")
      continue
    err = "-"
    notes = []
    if "rel_err" in row:
      err = f"{row['rel_err']:.1e}"
      if row["ours"] and not row["check_ok"]:
        notes.append(f"CHECK FAILED (> {cases.TOLERANCE[info['dtype']]:g})")
    if row.get("auto_choice"):
      notes.append(f"auto -> {row['auto_choice']}")
    if row["host_bound"]:
      notes.append(f"host-bound? (enqueue {row['overhead_us']:.1f} us/call)")
    if row["timer"] != "chain-diff":
      notes.append(row["timer"])
    # The roofline is the H200's (--peak_tbps, --peak_tflops): meaningless on a CPU.
    roofline = f"{'-':>10}" if on_cpu else f"{row['roofline_pct']:>9.1f}%"
    host = f"{'-':>10}" if row.get("host_us") is None else f"{row['host_us']:>10.2f}"
    lines.append(
        f"{row['impl']:<17}{row['time_us']:>10.2f}{host}{row['tbps']:>8.3f}"
        f"{row['tflops']:>9.2f}{roofline}{err:>10}  "
        + "; ".join(notes))
  return "\n".join(lines)
