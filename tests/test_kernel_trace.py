"""The Mosaic GPU kernel's timeline from inside (`kernels/mosaic_gpu/trace.py`, `benchmarks.tools.kernel_trace`):
the kernel lowers with the profiler on and without any trace of it off; the summary reads a trace right."""

import functools
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import trace as mgpu_trace
from pallas_kv.kernels.mosaic_gpu.trace import KernelTrace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.tools import kernel_trace  # noqa: E402
from benchmarks.tools import kernel_variants  # noqa: E402
import sweeps  # noqa: E402
from harness import mosaic_text_for_cuda  # noqa: E402

# The profiler writes two int32 (a name and the SM clock) at each region entry and exit.
CLOCK_READ = "%clock"


def _mosaic_text(monkeypatch, fn, *args) -> str:
  return mosaic_text_for_cuda(monkeypatch, fn, *args, host_callbacks=True)


@pytest.mark.parametrize("fields", [{"split_plan": "stream_k", "pipeline_qk": True},
                                    {"pipeline_qk": True, "persistent": True}])
def test_the_kernel_lowers_with_its_trace_and_without(monkeypatch, fields):
  args, problem = sweeps.problem_args((32, 8), (32, 4096), None)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(**fields), num_sms=132)
  fn = kernel_variants.kernel_fn(config, problem, False, None)
  plain = _mosaic_text(monkeypatch, fn, *args)
  with mgpu_trace.tracing(KernelTrace("unused", visits=256)):   # the same jitted function, traced again inside
    assert mgpu_trace.active() == KernelTrace("unused", visits=256)
    traced = _mosaic_text(monkeypatch, fn, *args)
  assert mgpu_trace.active() is None
  assert CLOCK_READ not in plain
  # Every region's entry and exit: item (producer, consumer), wait_free, wait_tile, wait_q and write_out.
  assert traced.count(CLOCK_READ) >= 2 * 6


@pytest.mark.parametrize("variant", ["persistent", "queries_as_n128"])
def test_a_one_byte_op_is_traced_in_the_smem_its_kernel_leaves(monkeypatch, variant):
  s = kernel_trace.settings()
  config, smem, op, args = kernel_trace.op_case(variant, 32, 4096, "float8_e4m3fn", s, jax.random.key(0),
                                                   abstract=True)
  assert smem.one_byte_operands and (config.persistent if variant == "persistent" else smem.queries_as_n)
  visits = kernel_trace.trace_visits(smem, wanted=10**6)
  assert smem.nbytes + KernelTrace("folder", visits).smem_bytes(smem.num_threads) <= mgpu_config.SMEM_CAPACITY_BYTES
  with mgpu_trace.tracing(KernelTrace("unused", visits=visits)):   # shapes only: B32 T4096's values take seconds
    text = _mosaic_text(monkeypatch, op, *args)
  assert text.count(CLOCK_READ) >= 2 * 6


def test_tracing_retraces_a_function_jit_ran_before():
  # Every jax.jit of one function shares a dispatch cache keyed on jit-key config states: a trace-context state alone
  # lets a call inside `tracing` rerun the executable compiled outside it, with no profiler (found on an H100: the
  # tool's op, run untraced first, wrote no trace).
  seen = []

  def f(x):
    seen.append(mgpu_trace.active())
    return x + 1

  jax.jit(f)(1.0)
  with mgpu_trace.tracing(KernelTrace("traces", 16)):
    jax.jit(f)(1.0)
  jax.jit(f)(1.0)
  assert seen == [None, KernelTrace("traces", 16)]


def test_a_trace_needs_a_folder_and_room():
  with pytest.raises(ValueError, match="directory"):
    KernelTrace("")
  with pytest.raises(ValueError, match="visits"):
    KernelTrace("folder", visits=2)
  with pytest.raises(TypeError, match="KernelTrace"):
    with mgpu_trace.tracing("folder"):
      pass
  assert KernelTrace("folder", visits=100).smem_bytes(3) == 100 * 16 * 3
  _, problem = sweeps.problem_args((32, 8), (32, 4096), None)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(split_plan="stream_k"), num_sms=132)
  smem = mgpu_config.DecodeSmem.for_call(config, rows=4, head_dim=128, dtype="bfloat16", page_size=None)
  visits = kernel_trace.trace_visits(smem, wanted=10**6)
  assert smem.nbytes + KernelTrace("folder", visits).smem_bytes(smem.num_threads) <= mgpu_config.SMEM_CAPACITY_BYTES
  assert kernel_trace.trace_visits(smem, wanted=40) == 40
  full = types.SimpleNamespace(nbytes=mgpu_config.SMEM_CAPACITY_BYTES - 4096, num_threads=2)   # 2 KiB past the margin
  assert kernel_trace.trace_visits(full, wanted=10**6) == 2048 // (16 * 2)
  no_room = types.SimpleNamespace(nbytes=mgpu_config.SMEM_CAPACITY_BYTES - 2048, num_threads=2)
  with pytest.raises(ValueError, match="too few"):
    kernel_trace.trace_visits(no_room, wanted=40)


def _events(tid, spans, sm=1):
  """Perfetto events of one warpgroup on SM `sm`: spans (name, start, end) in thousands of cycles, properly nested."""
  marks = [(start, 1, "B", name) for name, start, end in spans] + [(end, 0, "E", name) for name, start, end in spans]
  return [{"name": name, "ph": ph, "ts": ts, "pid": sm, "tid": tid} for ts, _, ph, name in sorted(marks)]


def test_the_summary_splits_each_role_s_span_into_its_regions(tmp_path):
  # Two programs of two warpgroups (a consumer, the producer): trace index = program * 2 + warpgroup, tid = it + 1.
  consumer = [("item", 0, 10), ("wait_tile", 0, 2), ("wait_tile", 4, 5), ("write_out", 9, 10)]
  nested = [("item", 0, 20), ("wait_tile", 0, 4), ("wait_tile", 1, 3)]   # a region inside its own name: once
  producer = [("item", 0, 8), ("wait_free", 1, 3)]
  events = _events(1, consumer) + _events(2, producer) + _events(3, nested) + _events(4, producer)
  meta = {"variant": "v", "shape": "B1 T1", "warpgroups": 2, "consumers": 1, "visits": 100}
  rows = {row["role"]: row for row in kernel_trace.summarize({"traceEvents": events}, meta)}
  assert set(rows) == {"consumer 0", "producer"}
  c, p = rows["consumer 0"], rows["producer"]
  assert c["programs"] == 2 and c["span_kcycles"] == pytest.approx(15.0) and c["items"] == 1
  assert c["wait_tile_share"] == pytest.approx((3 / 10 + 4 / 20) / 2)
  assert c["write_out_share"] == pytest.approx((1 / 10 + 0) / 2)
  assert c["first_wait_tile_kcycles"] == pytest.approx((2 + 4) / 2)
  assert p["wait_free_share"] == pytest.approx(2 / 8) and p["item_share"] == pytest.approx(1.0)
  assert c["truncated"] == 0
  assert np.isnan(c["first_tile_kcycles"])   # no program took two tiles
  # Read back from a folder as the GPU run leaves it; a run that wrote no trace says so.
  for name, trace in (("v_1x1", {"traceEvents": events}), ("w_1x1", None)):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({**meta, "variant": name[0]}))
    if trace:
      (folder / "kernel-1-trace.json").write_text(json.dumps(trace))
    if trace:   # an older call's trace beside it: the newest (the last call of a chain) is read
      (folder / "kernel-0-trace.json").write_text(json.dumps({"traceEvents": _events(1, [("item", 0, 99)])}))
  chained = tmp_path / "x_1x1"   # two chained calls asked for, one trace written: not read as the warm one
  chained.mkdir()
  (chained / "meta.json").write_text(json.dumps({**meta, "variant": "x", "calls": 2}))
  (chained / "kernel-1-trace.json").write_text(json.dumps({"traceEvents": events}))
  rows = kernel_trace.read_traces(str(tmp_path))
  assert [r.get("status") for r in rows] == [None, None, "no trace written", "1 traces for 2 chained calls: not "
                                             "summarized"]
  table = kernel_trace.format_table(rows)
  assert "consumer 0" in table and "no trace written" in table and " 15.0 " in table


def test_a_first_tile_is_timed_against_the_later_ones():
  # Tiles start (qk entries) at 0, 9, 11, 13 in one program and 0, 5 in another: first tiles 9 and 5, later 2.
  first = [("item", 0, 20), ("qk", 0, 1), ("qk", 9, 10), ("qk", 11, 12), ("qk", 13, 14)]
  second = [("item", 0, 20), ("qk", 0, 1), ("qk", 5, 6)]
  meta = {"variant": "v", "shape": "B1 T1", "warpgroups": 1, "consumers": 1, "visits": 100}
  [row] = kernel_trace.summarize({"traceEvents": _events(1, first) + _events(2, second)}, meta)
  assert row["first_tile_kcycles"] == pytest.approx(7.0) and row["later_tile_kcycles"] == pytest.approx(2.0)
  assert " 7.00  2.00 " in kernel_trace.format_table([row])


def test_a_first_tile_is_timed_apart_on_an_sm_s_first_program_and_by_region():
  # SM 1 runs a program from 0 (first tile 9, its softmax 6 of it) and one from 20 (first tile 3, a later one 2);
  # SM 2 one from 0 (first tile 8). A region entered before a tile and left inside it is not the tile's.
  sm1_first = [("item", 0, 19), ("wait_q", 0, 0.5), ("qk", 0, 1), ("softmax", 1, 7), ("qk", 9, 10)]
  sm1_later = [("item", 20, 40), ("qk", 20, 21), ("qk", 23, 24), ("qk", 25, 26)]
  sm2_first = [("item", 0, 19), ("qk", 0, 1), ("qk", 8, 9)]
  events = _events(1, sm1_first, sm=1) + _events(2, sm1_later, sm=1) + _events(3, sm2_first, sm=2)
  meta = {"variant": "v", "shape": "B1 T1", "warpgroups": 1, "consumers": 1, "visits": 100}
  [row] = kernel_trace.summarize({"traceEvents": events}, meta)
  assert row["first_tile_sm_first_kcycles"] == pytest.approx((9 + 8) / 2)
  assert row["first_tile_sm_later_kcycles"] == pytest.approx(3.0)
  assert row["first_tile_softmax_kcycles"] == pytest.approx(6 / 3) and row["first_tile_qk_kcycles"] == 1.0
  assert row["later_tile_qk_kcycles"] == 1.0 and row["later_tile_softmax_kcycles"] == 0.0
  assert row["item_to_first_tile_kcycles"] == 0.0   # each program's first item enters with its first tile
  lead = [("item", 0, 9), ("wait_q", 0, 2), ("qk", 3, 4), ("qk", 6, 7)]
  assert kernel_trace.program_summary(_events(1, lead))["lead"] == 3
  assert " 8.50  3.00 " in kernel_trace.format_table([row])
  assert kernel_trace.regions_within(_events(1, [("item", 0, 9), ("qk", 1, 2)]), 0.5, 9) == {"qk": 1}


def test_chained_calls_run_in_order_each_on_the_last_output():
  seen = []

  def op(q, k, *, scale):
    seen.append(q.shape)
    return (q + k) * scale

  run = kernel_trace.chained(op, 3)
  q, k = jnp.ones((2, 4), jnp.bfloat16), jnp.full((2, 4), 2.0, jnp.float32)
  out = jax.jit(functools.partial(run, scale=0.5))(q, k)
  assert out.dtype == jnp.bfloat16 and len(seen) == 3
  assert np.allclose(np.asarray(out, np.float32), (((1 + 2) * 0.5 + 2) * 0.5 + 2) * 0.5)
  # Another kernel between the calls (an XLA add on the queries), none before the first.
  between = kernel_trace.chained(op, 2, between="xla_add")
  out = jax.jit(functools.partial(between, scale=0.5))(jnp.ones((2, 4), jnp.float32), k)
  assert np.allclose(np.asarray(out), ((1 + 2) * 0.5 + 1e-3 + 2) * 0.5)
  with pytest.raises(ValueError, match="between='matmul'"):
    kernel_trace.chained(op, 2, between="matmul")


def test_the_tool_summarizes_anywhere_and_traces_only_on_a_gpu(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("this checks the CPU's refusal to trace")
  folder = tmp_path / "v_1x1"
  folder.mkdir()
  (folder / "meta.json").write_text(json.dumps({"variant": "v", "shape": "B1 T1", "warpgroups": 2, "consumers": 1,
                                                "visits": 100}))
  (folder / "k-1-trace.json").write_text(json.dumps({"traceEvents": _events(1, [("item", 0, 4)])}))
  run = lambda *flags: subprocess.run([sys.executable, "-m", "benchmarks", "tools.kernel_trace", *flags], cwd=REPO,
                                      capture_output=True, text=True, timeout=300)
  summary = run(f"--summarize={tmp_path}")
  assert summary.returncode == 0 and "consumer 0" in summary.stdout, summary.stderr[-2000:]
  refused = run(f"--out={tmp_path}")
  assert refused.returncode != 0 and "needs a GPU" in refused.stderr + refused.stdout
  ragged_one_byte = run("--ragged", "--kv_dtype=int8")
  assert ragged_one_byte.returncode != 0 and "a bfloat16 cache only" in ragged_one_byte.stderr + ragged_one_byte.stdout
  too_long = run("--length=5000", "--shapes=1x4096", "--kv_dtype=int8")
  assert too_long.returncode != 0 and "--length=5000" in too_long.stderr + too_long.stdout
  nothing_between = run("--between_calls=xla_add", "--calls=1")
  assert nothing_between.returncode != 0 and "give --calls >= 2" in nothing_between.stderr + nothing_between.stdout


def test_a_short_sequence_is_traced_under_its_shape_s_config():
  s = kernel_trace.settings()
  full, _, _, args = kernel_trace.op_case("baseline", 2, 1024, "int8", s, jax.random.key(0))
  short, _, _, short_args = kernel_trace.op_case("baseline", 2, 1024, "int8", s, jax.random.key(0), length=300)
  assert short == full and [int(n) for n in short_args[3]] == [300, 300] and [int(n) for n in args[3]] == [1024] * 2
  same = lambda a, b: np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert all(same(a, b) for a, b in zip(args[:3], short_args[:3]))


@pytest.mark.gpu   # the profiler's own trace, then the op's: tells a profiler that writes nothing from the op's tracing
def test_gpu_traces_are_written(tmp_path):
  assert kernel_trace.profiler_writes(str(tmp_path / "profiler"))
  s = kernel_trace.settings()
  kernel_trace.trace_run("baseline", 4, 1024, "bfloat16", s, str(tmp_path / "op"), 256, jax.random.key(0))
  rows = kernel_trace.read_traces(str(tmp_path / "op"))
  assert rows and all("status" not in row for row in rows), rows
  consumer = next(row for row in rows if row["role"].startswith("consumer"))
  assert consumer["items"] >= 1 and consumer["span_kcycles"] > 0, consumer


def test_record_trace_runs_the_function_traced_and_writes_its_meta(tmp_path):
  # What `read_traces` reads beside a trace: the caller's meta with the visits and the device added (no Mosaic GPU
  # kernel here, so no trace file: the function still runs once, inside `tracing`).
  seen = []

  def fn(x):
    seen.append(mgpu_trace.active())   # at trace time, inside the context
    return x + 1

  meta = kernel_trace.record_trace(str(tmp_path / "t"), 64, fn, (jnp.ones(3),), {"variant": "v", "calls": 2})
  assert seen and seen[0] == mgpu_trace.KernelTrace(str(tmp_path / "t"), 64)
  with open(tmp_path / "t" / "meta.json") as f:
    assert json.load(f) == meta == {"variant": "v", "calls": 2, "visits": 64, "device": jax.devices()[0].device_kind}
