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

  --plot=FILE.png also saves the TB/s plot of the rows; --bars=FILE.png a bar chart per case (README's
  docs/performance.png); both need the `plot` extra.

  python -m benchmarks.report --performance-md docs/performance.md
      The performance page: for each suite of PERFORMANCE_SUITES, the newest set's JSON under
      benchmarks/results/ (files `<date>_<gpu>_set<N>_<suite>.json`), one table each, with the
      command that wrote it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence

_OPTION_FIELDS = ("softcap", "window", "sinks")


def case_label(row: dict) -> str:
  label = f"B{row['batch']} T{row['seq_len']}{_length_label(row)} {row['num_heads']}/{row['num_kv_heads']}"
  if row.get("page_size") and row["op"] == "paged":
    label += f" page{row['page_size']}"
  return label


def _length_label(row: dict) -> str:   # " L{length}" where the sequences are shorter than the capacity (--length)
  return "" if row.get("length") is None else f" L{row['length']}"


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
    cells = ["–" if (r := by_impl.get(impl)) is None else f"{r['tbps']:.2f} ({r['time_us']:.0f})" for impl in impls]
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
  name, count = (match.group(1), int(match.group(2))) if match else (kind, 1)
  return name if count == 1 else f"{count}x {name}"


def family(row: dict) -> str:
  """What the rows of one table share: op, heads, head dims, dtype, S, paging, options."""
  if row["op"] == "mla":
    heads = f"{row['num_heads']} heads, latent {row['head_dim']}/{row['v_head_dim']}"
  else:
    heads = f"heads {row['num_heads']}/{row['num_kv_heads']}, head_dim {row['head_dim']}"
  parts = [{"decode": "dense", "paged": "paged", "mla": "MLA"}[row["op"]], heads, row["dtype"],
           f"{row['num_queries']} new token{'s' if row['num_queries'] > 1 else ''}",
           "ragged lengths" if row.get("ragged") else f"each {row['length']} long" if row.get("length") is not None
           else "full lengths"]
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


# ------------------------------------------------------------------ docs/performance.md

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SET_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})_([a-z0-9]+)_set(\d+)_(.+)\.json")


@dataclasses.dataclass(frozen=True)
class Suite:
  """A section of the performance page: the newest set's file of each of `names` (a results file's
  name after `<date>_<gpu>_set<N>_`, also the H200 suite's run of configs/suite/<name>.flags) and
  the command that wrote them (RESULTS.md records it; the rows do not). kind: "decode"
  (benchmarks.decode rows), "mla" (benchmarks.mla) or "engine" (the serving engine, another
  engine's rows as a column). labels: a column label per name, where files differ by more than impl."""
  title: str
  names: tuple[str, ...]
  command: str
  kind: str = "decode"
  labels: tuple[str, ...] = ()
  note: str = ""


_DECODE = "python3 -m benchmarks.decode --flagfile=configs/"
PERFORMANCE_SUITES = (
    Suite("GQA sweep: device time and a Python loop of calls", ("gqa_host_loop",),
          _DECODE + "gqa_h200.flags --impl=auto,cudnn,torch,xla_einsum --repeats=5"),
    Suite("GQA sweep: every impl", ("gqa",), _DECODE + "gqa_h200.flags --repeats=5",
          note="jax_pallas_gqa: jax's deprecated Pallas Triton decode op."),
    Suite("Ragged batches (lengths uniform in [1, T]) and the same shapes at full length",
          ("rows_ragged", "rows_full"), _DECODE + "gqa_h200.flags [--ragged] --cases=16x32768,64x8192,128x4096 "
          "--impl=auto,triton,mosaic_gpu,cudnn --warmup=2 --repeats=5"),
    Suite("Paged, page 16, ragged and full length", ("rows_paged16_ragged", "rows_paged16_full"),
          _DECODE + "paged16_h200.flags [--ragged] --cases=16x32768,64x8192,128x4096 "
          "--impl=auto,triton,mosaic_gpu --warmup=2 --repeats=5",
          note="Paged stream-K ran two programs per SM here; the default now runs three (RESULTS.md, twentieth "
          "set, \"Stream-K on paged caches\")."),
    Suite("Llama-3-8B shapes", ("llama3_8b",), _DECODE + "llama3_8b.flags --impl=auto,triton,mosaic_gpu "
          "--warmup=2 --repeats=5"),
    Suite("Qwen-2.5-7B shapes (heads 28/4)", ("qwen25_7b_tuned",), _DECODE + "qwen25_7b.flags "
          "--impl=auto,triton,mosaic_gpu --cases=32x8192,128x8192,256x8192 --warmup=2 --repeats=5"),
    Suite("Gemma-2-9B shapes (head_dim 256, softcap: cuDNN and torch SDPA cannot express it)", ("gemma2_9b",),
          _DECODE + "gemma2_9b.flags --impl=auto,triton,mosaic_gpu --warmup=2 --repeats=5",
          note="Before the Triton SMEM budget rose to 227 KiB on Hopper (three stages at D 256); the next "
          "table is after it."),
    Suite("Gemma-2-9B, after the SMEM budget change", ("gemma_auto",), _DECODE + "gemma2_9b.flags "
          "--impl=auto,triton --cases=16x8192,64x8192,128x8192 --warmup=2 --repeats=5"),
    Suite("Head dims past 128, MQA groups, page 1 (bf16)", ("shapes_d192", "shapes_d512", "shapes_heads48_1",
          "shapes_heads71_1", "shapes_page16", "shapes_page1"), "bash benchmarks/h200_suite.sh shapes shapes_more",
          labels=("D 192", "D 512", "48 / 1", "71 / 1", "page 16", "page 1")),
    Suite("One-byte caches (Triton kernel, per-token scales)",
          ("vlast_bfloat16_nov_tokens_last", "vlast_int8_v_tokens_last", "vlast_float8_e4m3fn_v_tokens_last"),
          _DECODE + "gqa_h200.flags --impl=triton --kv_dtype=K --[no]v_tokens_last --warmup=2 --repeats=5",
          labels=("bf16", "int8, v tokens last", "fp8 e4m3, v tokens last"),
          note="TB/s counts the bytes read: one-byte K and V plus 4 bytes of scale per token and kv head."),
    Suite("MLA (DeepSeek absorbed form: latent 512 + rope 64, page 64, bf16)",
          ("mla_rows", "mla_rows_b128", "mla_rows_s2_h16"), "python3 -m benchmarks.mla --impl=mosaic_gpu "
          "--iters=10 --repeats=10, then --rows=... --impl=mosaic_gpu,mosaic_gpu_sp1", kind="mla",
          note="mosaic_gpu: the op with auto's config; mosaic_gpu_sp1: one split, batch order. Two figures in "
          "a cell: two commands ran the row."),
    Suite("SmolLM2-135M-Instruct in the continuous-batching engine: decode tokens/s",
          ("smollm2_engine", "smollm2_transformers"), "python3 -m benchmarks.smollm2 --gguf=PATH "
          "--context=8192,1024 --batch=16,64,1 --impl=auto,xla,cudnn; python3 -m benchmarks.smollm2_transformers "
          "--gguf=PATH --context=... --batch=...", kind="engine",
          note="Prompts of context - 64 tokens, 64 greedy tokens each. cudnn: cuDNN attention over the pages "
          "gathered to a dense cache; transformers: Hugging Face transformers on the same GGUF (bf16, SDPA)."),
)
_ONES = "first second third fourth fifth sixth seventh eighth ninth".split()
_TEENS = "tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth".split()
_TENS = {2: ("twentieth", "twenty"), 3: ("thirtieth", "thirty"), 4: ("fortieth", "forty")}


def ordinal(n: int) -> str:
  """21 -> "twenty-first", as RESULTS.md names its sets."""
  tens, ones = divmod(n, 10)
  if n < 20:
    return _ONES[n - 1] if n < 10 else _TEENS[n - 10]
  return f"{n}th" if tens not in _TENS else _TENS[tens][0] if not ones else f"{_TENS[tens][1]}-{_ONES[ones - 1]}"


def newest_file(name: str, results_dir: str = RESULTS_DIR) -> tuple[str, str, int] | None:
  """(path, date, set number) of the newest set's file of suite `name`, or None."""
  matches = (_SET_FILE.fullmatch(entry) for entry in os.listdir(results_dir))
  found = [(m.group(1), int(m.group(3)), os.path.join(results_dir, m.group(0))) for m in matches
           if m and m.group(4) == name]
  date, number, path = max(found, default=(None, None, None))
  return None if path is None else (path, date, number)


def _bold_fastest(cells: dict[str, list[dict]], value) -> dict[str, str]:
  """Cell texts per column, the fastest (least time) in bold; several rows in a cell join with "; "."""
  times = {c: min(r["time_us"] for r in rs) for c, rs in cells.items()
           if all(r.get("status", "ok") == "ok" and r.get("time_us") is not None for r in rs)}
  fastest = min(times.values(), default=None)
  texts = {}
  for column, rs in cells.items():
    text = "; ".join(value(r) for r in rs) if column in times else "; ".join(r.get("status", "–") for r in rs)
    texts[column] = f"**{text}**" if times.get(column) == fastest and len(cells) > 1 else text
  return texts


def _pivot(items, case_of):
  """{case: {column: [rows]}} of (column, row) items, cases in first-seen order."""
  cases: dict = {}
  for column, row in items:
    cases.setdefault(case_of(row), {}).setdefault(column, []).append(row)
  return cases


def _grid(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
          + ["| " + " | ".join(cells) + " |" for cells in body])


def _decode_tables(items: list[tuple[str, dict]]) -> list[str]:
  lines = []
  families: dict[str, list] = {}
  for column, row in items:
    families.setdefault(family(row), []).append((column, row))
  for name, group in families.items():
    columns = list(dict.fromkeys(c for c, _ in group))
    cases = _pivot(group, lambda r: f"B{r['batch']} T{r['seq_len']}{_length_label(r)}")
    cell = lambda r: f"{r['time_us']:.1f} ({r['tbps']:.2f})"
    body = [[case] + [_bold_fastest(cells, cell).get(c, "–") for c in columns] for case, cells in cases.items()]
    lines += [f"{name[0].upper()}{name[1:]}. µs per call (TB/s of KV read):", ""]
    lines += _grid(["shape"] + columns, body) + [""]
    hosted = [c for c in columns if any(r.get("host_us") is not None for cc, r in group if cc == c)]
    if hosted:
      body = [[case] + [f"{min(r['host_us'] for r in cells[c]):.1f}" if c in cells else "–" for c in hosted]
              for case, cells in cases.items()]
      lines += ["The same calls in a Python loop of jitted calls, host dispatch included, µs per call:", ""]
      lines += _grid(["shape"] + hosted, body) + [""]
    ran = sorted({r["auto_choice"] for _, r in group if r["impl"] == "auto" and r.get("auto_choice")})
    errs = [r["rel_err"] for _, r in group if r.get("ours") and r.get("rel_err") is not None]
    lines += [(f"`auto` ran {' or '.join(ran)}. " if ran else "") + (f"Largest relative error of the pallas_kv "
              f"rows against the float32 reference: {max(errs):.1e}." if errs else ""), ""]
  return lines


def _mla_tables(items: list[tuple[str, dict]]) -> list[str]:
  columns = list(dict.fromkeys(c for c, _ in items))

  def case(r):
    label = f"{r['num_heads']} heads, B{r['batch']} T{r['seq_len']}"
    return label + (", ragged" if r.get("ragged") else "") + (
        f", {r['num_queries']} new tokens" if r.get("num_queries", 1) > 1 else "")

  body = []
  for label, cells in _pivot(items, case).items():
    texts = _bold_fastest(cells, lambda r: f"{r['time_us']:.1f} ({r['tflops']:.0f}, {r['tbps']:.2f})")
    body.append([label] + [texts.get(c, "–") for c in columns])
  errs = [r["rel_err"] for _, r in items if r.get("rel_err") is not None]
  return (["µs per call (TFLOP/s, TB/s of the latent cache read); ragged: lengths uniform in [1, T]:", ""]
          + _grid(["row"] + columns, body) + ["", f"Largest relative error against the bf16 einsum: "
                                                  f"{max(errs):.1e}." if errs else "", ""])


def _engine_tables(items: list[tuple[str, dict]]) -> list[str]:
  """Decode tokens/s per (context, batch): the engine's impls, then the other engines' rows (tok_s)."""
  impls = list(dict.fromkeys(column for column, _ in items))
  cells: dict[tuple[int, int], dict[str, float]] = {}
  for column, r in items:   # the engine's rows come first; another engine's only where the engine ran
    if "decode_tok_s" in r or (r["context"], r["batch"]) in cells:
      cells.setdefault((r["context"], r["batch"]), {})[column] = r.get("decode_tok_s", r.get("tok_s"))
  auto = {(r["context"], r["batch"]): r for c, r in items if c == "auto"}
  body = []
  for key, by_impl in cells.items():
    a = auto.get(key)
    extra = [f"{a['step_ms']:.2f} ({a['device_step_ms']:.2f})", f"{100 * a['gpu_idle']:.1f}%"] if a else ["–", "–"]
    body.append([str(key[0]), str(key[1])] + [f"{by_impl[i]:,.0f}" if i in by_impl else "–" for i in impls] + extra)
  return _grid(["context", "batch"] + impls + ["auto step ms (device)", "auto GPU idle"], body) + [""]


def suite_section(suite: Suite, results_dir: str = RESULTS_DIR) -> list[str]:
  """The markdown of one suite (an empty list where no file of it exists)."""
  items, sources, sets = [], [], []
  for i, name in enumerate(suite.names):
    found = newest_file(name, results_dir)
    if found is None:
      continue
    path, date, number = found
    with open(path) as f:
      rows = json.load(f)
    label = suite.labels[i] if suite.labels else None
    multi = len({r.get("impl") for r in rows}) > 1
    items += [(r.get("impl", r.get("engine")) if label is None else
               (f"{r['impl']} {label}" if multi else label), r) for r in rows]
    sources.append(os.path.relpath(path, _REPO))
    sets.append((date, number))
  if not items:
    return []
  devices = list(dict.fromkeys(gpu_name(r["device"]).removeprefix("cuda:") for _, r in items if r.get("device")))
  versions = list(dict.fromkeys(r["jax_version"] for _, r in items if r.get("jax_version")))
  when = "; ".join(f"{d}, RESULTS.md {ordinal(n)} set" for d, n in dict.fromkeys(sets))
  rerun = [n for n in suite.names if os.path.exists(os.path.join(_REPO, "configs", "suite", f"{n}.flags"))]
  lines = [f"## {suite.title}", "",
           f"{when}; {', '.join(devices) or '?'}" + (f", jax {', '.join(versions)}" if versions else "") + ".",
           f"Command: `{suite.command}`.", "Rows: " + ", ".join(f"`{s}`" for s in sources) + "."]
  lines += [f"Rerun: `bash benchmarks/h200_suite.sh {' '.join(rerun)}` (flags in `configs/suite/`)."] if rerun else []
  lines += ["", suite.note, ""] if suite.note else [""]
  render = {"decode": _decode_tables, "mla": _mla_tables, "engine": _engine_tables}[suite.kind]
  return lines + render(items)


PERFORMANCE_HEADER = """# Performance

Generated by `python -m benchmarks.report --performance-md docs/performance.md` from the newest set
of each suite under `benchmarks/results/`; do not edit by hand. Every figure is a row of those JSON
files; `benchmarks/RESULTS.md` tells each set's story, `docs/tuning.md` how to measure.

- Time: median µs per call of the chain-difference timer (`benchmarks/timing.py`: chains of N
  and 2N calls in one jitted program, queued behind a lead run, inputs rotated past L2), what a
  step inside a jitted model sees; torch rows use CUDA events. The host loop, where shown, is a
  Python loop of jitted calls with one wait at the end: jit's dispatch included.
- TB/s counts the KV bytes the call must read; an H200 reads at most ~4.5 TB/s.
- `auto` and the backend it ran are one kernel and config timed twice: their gap is the run's
  spread (a few percent), so gaps that small do not rank impls.
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`; torch: torch SDPA; xla_einsum:
  plain bf16 einsums that do not mask values past the lengths.
"""


def performance_page(results_dir: str = RESULTS_DIR, suites: Sequence[Suite] = PERFORMANCE_SUITES) -> str:
  """docs/performance.md: the header, then one section per suite found under results_dir."""
  lines = [PERFORMANCE_HEADER]
  for suite in suites:
    lines += suite_section(suite, results_dir)
  return "\n".join(lines).rstrip() + "\n"


def _date_from_path(path: str) -> str | None:
  match = re.match(r"(\d{4}-\d{2}-\d{2})", os.path.basename(path))
  return match.group(1) if match else None


def main(argv: Sequence[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("paths", nargs="*", help="JSON files from python -m benchmarks.decode --json")
  parser.add_argument("--command", help="the command that made the rows; prints a whole section")
  parser.add_argument("--date", help="the section's date (default: the rows' date, else the "
                      "file name's YYYY-MM-DD prefix)")
  parser.add_argument("--section", action="store_true",
                      help="print a whole section even without --command")
  parser.add_argument("--plot", help="also save the rows' TB/s plot (benchmarks.decode --plot's) as this PNG")
  parser.add_argument("--bars", help="save a bar chart per case of each impl's TB/s (chain and host loop) as this PNG")
  parser.add_argument("--auto", action="store_true", help="auto against the fastest backend and peer, per case")
  parser.add_argument("--performance-md", help="write the performance page (docs/performance.md) from the newest "
                      "set of each suite under --results-dir")
  parser.add_argument("--results-dir", default=RESULTS_DIR, help="where --performance-md finds the JSON")
  args = parser.parse_args(argv)
  if args.performance_md:
    with open(args.performance_md, "w") as f:
      f.write(performance_page(args.results_dir))
    print(f"# wrote {args.performance_md}")
    if not args.paths:
      return
  elif not args.paths:
    parser.error("the following arguments are required: paths")
  loaded = []
  for path in args.paths:
    with open(path) as f:
      loaded.append((path, json.load(f)))
  if args.plot or args.bars:
    from benchmarks import output  # pylint: disable=g-import-not-at-top  (imports jax)
    for path, write in ((args.plot, output.write_plot), (args.bars, output.write_bars)):
      if path and output.plot_available():
        write([r for _, rs in loaded for r in rs], path)
        print(f"# wrote {path}")
      elif path:
        print("# --plot and --bars need matplotlib (pip install 'pallas-kv[plot]'); nothing written")
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
