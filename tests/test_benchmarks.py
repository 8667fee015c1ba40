"""The benchmark programs run their CPU defaults end to end; flagfiles parse; rows are checked."""

import csv
import dataclasses
import functools
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import types

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import cases  # noqa: E402
from benchmarks import cli  # noqa: E402
from benchmarks import decode as decode_bench  # noqa: E402
from benchmarks import output  # noqa: E402
from benchmarks import peers  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import step as step_bench  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks.tools import operand_precision  # noqa: E402

# Each GPU case's rotating input sets must fit well inside an H200 (~139 GiB) beside the
# peers' copies and the float32 reference (which runs in batch chunks).
MAX_CASE_KV_BYTES = 60 * 2**30
OPTIONS = {"softcap": {"softcap": 0.5}, "window": {"window": 5}, "sinks": {"sinks": True}}


@pytest.mark.parametrize("op", ["decode", pytest.param("paged", marks=pytest.mark.slow), "mla"])
def test_decode_benchmark_rows_are_timed_and_checked(op):
  out = io.StringIO()
  rows = decode_bench.run(op=op, cases=((2, 128),), impls=("xla", "xla_einsum"), num_heads=4, num_kv_heads=2,
                          head_dim=64, page_size=16, mla_qk_dim=72, mla_v_dim=64, iters=2, repeats=2, out=out)
  assert [r["impl"] for r in rows] == ["xla", "xla_einsum"]
  for row in rows:
    assert row["time_us"] > 0 and np.isfinite(row["tbps"])
    assert row["rel_err"] < 1e-2
    # The host loop too: positive, finite, one sample per repeat of `iters` calls (on a CPU not lengthened).
    assert row["host_us"] > 0 and np.isfinite(row["host_us"])
    assert len(row["host_samples_us"]) == 2 and row["host_calls"] >= 2
    assert row["host_calls"] == 2 or jax.default_backend() != "cpu"
  assert not output.failed_rows(rows)
  table = out.getvalue()
  assert "xla_einsum" in table and "host us" in table.splitlines()[2]
  for row in rows:  # each impl's line shows its host-loop time
    line = next(l for l in table.splitlines() if l.startswith(row["impl"] + " "))
    assert f"{row['host_us']:.2f}" in line


def test_one_short_length_in_a_long_cache_counts_its_keys_and_refuses_what_it_cannot_be():
  out = io.StringIO()
  rows = decode_bench.run(op="decode", cases=((2, 128),), impls=("xla",), num_heads=4, num_kv_heads=2, head_dim=64,
                          length=40, warmup=0, iters=1, repeats=1, host_loop=False, out=out)
  assert rows[0]["total_keys"] == 2 * 40 and rows[0]["length"] == 40 and rows[0]["rel_err"] < 1e-2
  assert rows[0]["kv_bytes"] == 2 * 40 * 2 * 2 * 64 * 2   # sequences x keys x kv heads x (K, V) x D x bf16
  assert "lengths=each 40 (80 keys)" in out.getvalue()
  assert not cases.op_spec(cases.Case.from_row(rows[0])).full_lengths   # peers that need full lengths say n/a
  for bad in (dict(length=129), dict(length=40, ragged=True), dict(length=0)):
    with pytest.raises(ValueError, match="length="):
      cases.Sweep(cases=((2, 128),), **bad)


def test_calls_can_run_after_another_kernel_whose_own_row_comes_first():
  out = io.StringIO()
  rows = decode_bench.run(op="decode", cases=((2, 128),), impls=("xla",), num_heads=4, num_kv_heads=2, head_dim=64,
                          warmup=0, iters=1, repeats=1, out=out,
                          kernel=decode_bench.KernelFlags(between_calls="xla_add"))
  assert [r["impl"] for r in rows] == [decode_bench.BETWEEN_ROW, "xla"]
  assert all(r["status"] == "ok" and r["time_us"] > 0 and r["host_us"] > 0 for r in rows), rows
  assert rows[1]["check_ok"] and "xla_add alone" in out.getvalue()
  # The wrapped call runs on the queries plus the add's 1e-3; an impl whose queries are not first is refused.
  seen = []
  runner = decode_bench.with_kernel_before(peers.Runner(fn=lambda q, k: seen.append((q, k)) or q))
  runner.fn(jnp.ones((2,), jnp.float32), 5)
  assert np.allclose(np.asarray(seen[0][0]), 1.001) and seen[0][1] == 5
  with pytest.raises(NotImplementedError, match="queries"):
    runner.fn(jnp.ones((2,), jnp.int32), 5)
  with pytest.raises(NotImplementedError, match="JAX impls only"):
    decode_bench.with_kernel_before(peers.Runner(fn=lambda q: q, timer="torch"))
  with pytest.raises(ValueError, match="between_calls=matmul"):
    decode_bench.KernelFlags(between_calls="matmul")


def test_host_loop_can_be_turned_off():
  out = io.StringIO()
  rows = decode_bench.run(op="decode", cases=((1, 32),), impls=("xla",), num_heads=2, num_kv_heads=1, head_dim=64,
                          warmup=0, iters=1, repeats=1, check=False, host_loop=False, out=out)
  assert rows[0]["status"] == "ok" and rows[0]["time_us"] > 0
  assert not set(output.HOST_LOOP_FIELDS) & set(rows[0])
  line = next(l for l in out.getvalue().splitlines() if l.startswith("xla "))
  assert line.split()[2] == "-"  # impl, time us, host us


def test_unbuilt_or_unavailable_impls_are_reported_not_raised():
  rows = decode_bench.run(op="decode", cases=((1, 64),), impls=("xla", "torch"), num_heads=2, num_kv_heads=1,
                          head_dim=64, iters=1, repeats=1, out=io.StringIO())
  torch_row = rows[1]
  if torch_row["status"] == "n/a":  # torch or CUDA missing: a reason, and the run goes on
    assert "torch" in torch_row["reason"]
  else:
    assert torch_row["time_us"] > 0
  assert rows[0]["time_us"] > 0


def test_kernel_impls_on_a_cpu_outside_interpret_mode_read_n_a_and_the_run_passes():
  if jax.default_backend() != "cpu":
    pytest.skip("a GPU is present: the kernel impls run there")
  import pallas_kv
  with pallas_kv.interpret(False):
    rows = decode_bench.run(op="decode", cases=((1, 32),), impls=("xla", "triton", "mosaic_gpu"), num_heads=2,
                            num_kv_heads=1, head_dim=64, warmup=0, iters=1, repeats=1, out=io.StringIO())
  assert rows[0]["status"] == "ok"
  for row in rows[1:]:
    assert row["status"] == "n/a", row.get("traceback")
    assert f"impl='{row['impl']}' runs a GPU kernel" in row["reason"] and "PALLAS_KV_INTERPRET=1" in row["reason"]
  assert not output.failed_rows(rows)
  env = {k: v for k, v in os.environ.items() if k != "PALLAS_KV_INTERPRET"}
  result = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--impl=triton", "--cases=1x32",
                           "--num_heads=2", "--num_kv_heads=1", "--head_dim=64", "--warmup=0", "--iters=1",
                           "--repeats=1", "--nohost_loop"], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "n/a (PeerUnavailable: impl='triton' runs a GPU kernel" in result.stdout


@pytest.mark.parametrize("flagfile", sorted(glob.glob(os.path.join(REPO, "configs", "*.flags"))),
                         ids=os.path.basename)
def test_flagfiles_parse_into_valid_sweeps(flagfile):
  with open(flagfile) as f:
    header = f.readline()
  assert header.startswith("# "), f"{flagfile} must start with a comment naming the model/sweep"
  flag_values = flags.FlagValues()
  cli.define_sweep_flags(flag_values)
  flag_values(["decode", f"--flagfile={flagfile}"])
  sweep = cli.sweep_from_flags(flag_values)
  assert sweep.cases and sweep.impls
  if os.path.basename(flagfile).startswith("cpu_"):
    return
  rotate_bytes = max(sweep.rotate_bytes, timing.DEFAULT_ROTATE_BYTES)  # the GPU default
  for batch, seq_len in sweep.cases:
    _, kv_bytes = cases.Case.from_sweep(sweep, batch, seq_len).footprint(rotate_bytes)
    assert kv_bytes <= MAX_CASE_KV_BYTES, (batch, seq_len, kv_bytes / 2**30)


# ------------------------------------------------------------------ the driver and the H200 suite

SUITE_SCRIPT = os.path.join(REPO, "benchmarks", "h200_suite.sh")


def _driver():
  from benchmarks import __main__ as driver  # pylint: disable=g-import-not-at-top
  return driver


def _suite_parts() -> dict[str, list[tuple[str, str]]]:
  """The script's table: part -> [(routine, run name)]."""
  import re  # pylint: disable=g-import-not-at-top
  with open(SUITE_SCRIPT) as f:
    table = re.findall(r'\[(\w+)\]="([^"]+)"', f.read())   # one or more entries a line
  return {part: [tuple(entry.split(":")) for entry in runs.split()] for part, runs in table}


def _suite_runs_by_routine() -> dict[str, list[str]]:
  by_routine: dict[str, list[str]] = {}
  for runs in _suite_parts().values():
    for routine, name in runs:
      by_routine.setdefault(routine, []).append(name)
  return by_routine


def test_benchmarks_top_level_is_the_core_and_the_routines():
  driver = _driver()
  top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "benchmarks", "*.py")))
  core = {"__init__.py", "__main__.py", "cases.py", "cli.py", "output.py", "peers.py", "timing.py", "report.py"}
  routines = {f"{routine}.py" for routine in driver.ROUTINES}
  assert set(top) == core | routines, top   # diagnostics belong in benchmarks/tools/
  tools = driver.tools()
  assert "profile_kernel" in tools and "smollm2_transformers" in tools
  assert "shards" not in tools and "__init__" not in tools   # helpers, not programs
  assert driver.module_of("decode") == "benchmarks.decode"
  assert driver.module_of("tools.ncu_summary") == "benchmarks.tools.ncu_summary"
  for name in ("report", "tools.nosuch", "cases"):
    with pytest.raises(ValueError, match="unknown routine"):
      driver.module_of(name)
  with open(SUITE_SCRIPT) as f:
    assert len(f.read().splitlines()) <= 60   # a table, not a program


def test_moved_modules_import_under_their_former_names():
  import benchmarks  # pylint: disable=g-import-not-at-top
  from benchmarks import serving, shards, smollm2  # pylint: disable=g-import-not-at-top
  from benchmarks.tools import shards as tools_shards  # pylint: disable=g-import-not-at-top
  assert smollm2 is serving and shards is tools_shards
  with pytest.raises(AttributeError):
    benchmarks.nosuch  # pylint: disable=pointless-statement


def test_driver_lists_its_routines_and_refuses_others():
  for argv, code in ((["--help"], 0), ([], 2), (["nosuch"], 2)):
    result = subprocess.run([sys.executable, "-m", "benchmarks", *argv], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == code, result.stderr[-2000:]
    text = result.stdout + result.stderr
    assert "serving" in text and "tools.NAME" in text and "smollm2_transformers" in text, text
    assert ("unknown routine 'nosuch'" in text) == (argv == ["nosuch"])


def test_driver_hands_a_routine_its_flags_and_returns_its_exit_status():
  # A whole run through the driver: test_decode_benchmark_cpu_default_runs_end_to_end.
  driven, direct = (subprocess.run([sys.executable, "-m", *module, "--helpshort"], capture_output=True, text=True,
                                   cwd=REPO, timeout=120) for module in (["benchmarks", "vmap"], ["benchmarks.vmap"]))
  assert "benchmarks/vmap.py:" in driven.stdout and "--cases: N x B x T cases" in driven.stdout, driven.stderr[-2000:]
  assert "--repeats" in driven.stdout   # the shared timing flags too
  assert (driven.returncode, driven.stdout) == (direct.returncode, direct.stdout)   # absl's help exits 1
  bad = subprocess.run([sys.executable, "-m", "benchmarks", "vmap", "--nosuch_flag"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
  assert bad.returncode == 1 and "Unknown command line flag 'nosuch_flag'" in bad.stderr


def test_suite_table_names_every_suite_flagfile_once():
  driver = _driver()
  names = [name for runs in _suite_parts().values() for _, name in runs]
  assert len(names) == len(set(names)), names
  on_disk = {os.path.basename(p)[:-len(".flags")] for p in glob.glob(os.path.join(REPO, "configs", "suite", "*.flags"))}
  assert set(names) == on_disk
  for routine in _suite_runs_by_routine():
    driver.module_of(routine)   # a routine or a tool
  for part in ("gqa", "host_loop", "rows", "models", "mla", "smollm2"):   # what RESULTS.md's latest sets ran
    assert part in _suite_parts()
  for name in on_disk:
    with open(os.path.join(REPO, "configs", "suite", f"{name}.flags")) as f:
      assert f.readline().startswith("# "), f"configs/suite/{name}.flags must start with a comment saying what it measures"


def test_suite_runs_each_part_through_the_driver(tmp_path):
  # A python3 that prints its arguments stands in for the machine's: the script's commands, not the runs.
  fake = tmp_path / "bin" / "python3"
  fake.parent.mkdir()
  fake.write_text('#!/bin/sh\necho "python3 $*"\n')
  fake.chmod(0o755)
  env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
             SMOLLM2_GGUF="/models/smollm2.gguf", SUITE_FLAGS="--cases=8x8192")
  result = subprocess.run(["bash", SUITE_SCRIPT, "gqa", "smollm2", "mla_rows_b128", "tune", "nosuch"], env=env,
                          capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 2, result.stdout + result.stderr   # the unknown part; the rest ran
  lines = result.stdout.splitlines()
  out = tmp_path / "out"
  assert lines[:5] == [
      f"python3 -m benchmarks decode --flagfile=configs/suite/gqa.flags --json={out}/gqa.json --cases=8x8192",
      f"python3 -m benchmarks serving --flagfile=configs/suite/smollm2_engine.flags --json={out}/smollm2_engine.json "
      "--gguf=/models/smollm2.gguf --cases=8x8192",
      "python3 -m benchmarks tools.smollm2_transformers --flagfile=configs/suite/smollm2_transformers.flags "
      f"--json={out}/smollm2_transformers.json --gguf=/models/smollm2.gguf --cases=8x8192",
      f"python3 -m benchmarks mla --flagfile=configs/suite/mla_rows_b128.flags --json={out}/mla_rows_b128.json "
      "--cases=8x8192",
      "python3 -m benchmarks tune --flagfile=configs/suite/tune.flags --cases=8x8192",   # tune writes the tuned file
  ]
  assert lines[5].startswith("unknown part: nosuch; parts: gqa host_loop merges mla mla_fp8 models")
  assert (out / "gqa.log").read_text() == lines[0] + "\n"
  assert {p.name for p in out.glob("*.json")} == {os.path.basename(p) for p in glob.glob(
      os.path.join(REPO, "pallas_kv", "tuned", "*.json"))}   # tune's output: the tuned file, copied
  # A spent SUITE_BUDGET skips the runs left, and says so; each run is given what is left of it.
  spent = subprocess.run(["bash", SUITE_SCRIPT, "merges", "vmap"], env=dict(env, SUITE_BUDGET="0"),
                         capture_output=True, text=True, cwd=REPO, timeout=120)
  assert (spent.returncode, spent.stdout.splitlines()) == (
      1, ["skipped merges: SUITE_BUDGET spent", "skipped vmap: SUITE_BUDGET spent"])


# Parses a routine's suite flagfiles with its own flags (a flagfile with a flag the routine lacks,
# or a bad value, fails here, not on the GPU machine); decode's and tune's also as sweeps.
_PARSE_SUITE_FLAGFILES = r"""
import importlib, json, sys
from absl import flags
routine, paths = sys.argv[1], sys.argv[2:]
module = importlib.import_module("benchmarks." + routine)
module.define_flags()
extra = ["--gguf=model.gguf"] if routine in ("serving", "tools.smollm2_transformers") else []
kv_bytes = {}
for path in paths:
  flags.FLAGS.unparse_flags()
  flags.FLAGS([routine, f"--flagfile={path}", *extra])
  kv_bytes[path] = []
  if routine == "mla":
    assert set(flags.FLAGS.rows) <= set(module.ALL_ROWS), flags.FLAGS.rows
  if routine == "tools.mosaic_one_byte":
    assert set(flags.FLAGS.only or ()) <= module.ROW_NAMES, set(flags.FLAGS.only) - module.ROW_NAMES
  if routine == "tools.kernel_variants":
    module.check_flags()   # variants, probe variant and probe shapes among those it runs
  if routine in ("decode", "tune"):
    from benchmarks import cases, cli, timing
    sweep = cli.sweep_from_flags()
    rotate = max(sweep.rotate_bytes, timing.DEFAULT_ROTATE_BYTES)
    kv_bytes[path] = [cases.Case.from_sweep(sweep, b, t).footprint(rotate)[1] for b, t in sweep.cases]
print(json.dumps(kv_bytes))
"""


@pytest.mark.parametrize("routine", sorted(_suite_runs_by_routine()))
def test_suite_flagfiles_parse_under_their_routine(routine):
  paths = [f"configs/suite/{name}.flags" for name in _suite_runs_by_routine()[routine]]
  result = subprocess.run([sys.executable, "-c", _PARSE_SUITE_FLAGFILES, routine, *paths], capture_output=True,
                          text=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  kv_bytes = json.loads(result.stdout.splitlines()[-1])
  assert sorted(kv_bytes) == sorted(paths)
  for path, sizes in kv_bytes.items():
    assert all(size <= MAX_CASE_KV_BYTES for size in sizes), (path, [s / 2**30 for s in sizes])


def test_shared_flags_read_back_as_given():
  flag_values = flags.FlagValues()
  cli.define_timing_flags({"iters": "3", "repeats": "5"}, flag_values)
  cli.define_output_flags(("json",), flag_values)
  flag_values(["program", "--iters=7", "--json=rows.json"])
  assert cli.timing_flags(flag_values) == cli.TimingFlags(iters=7)
  assert {"iters": 2, "repeats": 5, **cli.timing_flags(flag_values).given()} == {"iters": 7, "repeats": 5}
  assert cli.output_paths(flag_values) == cli.OutputPaths(json="rows.json")
  assert cli.parse_cases(["8x8192", "1X32"]) == ((8, 8192), (1, 32))
  with pytest.raises(ValueError, match="must look like BATCHxCONTEXT, e.g. 64x8192"):
    cli.parse_cases(["8x"], form="BATCHxCONTEXT", example="64x8192")
  with pytest.raises(ValueError, match="--batch=1,b must be integers"):
    cli.parse_ints(["1", "b"], "batch")


def test_decode_benchmark_cpu_default_runs_end_to_end(tmp_path):
  csv_path, json_path = tmp_path / "rows.csv", tmp_path / "rows.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks", "decode", "--flagfile=configs/cpu_smoke.flags",
                           f"--csv={csv_path}", f"--json={json_path}"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "xla_einsum" in result.stdout
  with open(csv_path, newline="") as f:
    csv_rows = list(csv.DictReader(f))
  with open(json_path) as f:
    json_rows = json.load(f)
  assert [r["impl"] for r in csv_rows] == [r["impl"] for r in json_rows] == ["xla", "xla_einsum"]
  assert "samples_us" not in csv_rows[0] and "host_samples_us" not in csv_rows[0]  # lists stay in the JSON
  for c, j in zip(csv_rows, json_rows):
    assert float(c["time_us"]) == pytest.approx(j["time_us"]) and c["device"] == j["device"]
    assert float(c["host_us"]) == pytest.approx(j["host_us"]) and j["host_us"] > 0
  assert "host us" in result.stdout


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_reaches_impls_and_reference(option):
  sweep = cases.Sweep(cases=((2, 16),), num_heads=4, num_kv_heads=2, head_dim=64, **OPTIONS[option])
  case = cases.Case.from_sweep(sweep, 2, 16)
  plain = cases.Case.from_sweep(cases.Sweep(num_heads=4, num_kv_heads=2, head_dim=64), 2, 16)
  lengths = cases.make_lengths(case, jax.random.key(0))
  args = cases.make_input_sets(case, jax.random.key(1), lengths, 1)[0]
  ref, _ = cases.reference_output(case, args)
  ref_plain, _ = cases.reference_output(plain, args[:4])
  assert cases.relative_error(ref_plain, ref) > 1e-3  # the option changed the reference
  for impl in ("xla", "xla_einsum"):  # each with the option matches the reference with it
    out = peers.build_runner(impl, cases.op_spec(case)).fn(*args)
    assert cases.relative_error(np.asarray(out, np.float32), ref) < 1e-2, impl


def test_option_rows_match_reference_and_peers_without_it_are_na():
  rows = decode_bench.run(op="decode", cases=((2, 64),), impls=("xla", "cudnn", "torch", "jax_pallas_gqa"),
                          num_heads=4, num_kv_heads=2, head_dim=64, softcap=2.0, window=24, sinks=True,
                          warmup=0, iters=1, repeats=1, out=io.StringIO())
  xla_row = rows[0]
  assert (xla_row["softcap"], xla_row["window"], xla_row["sinks"]) == (2.0, 24, True)
  assert xla_row["status"] == "ok" and xla_row["rel_err"] < 1e-2
  assert xla_row["attended_keys"] == 2 * 24 and xla_row["kv_bytes"] == 2 * 24 * 2 * 2 * 64 * 2
  for row in rows[1:]:
    assert row["status"] == "n/a" and "cannot express softcap=2, window=24, sinks" in row["reason"], row
  assert not output.failed_rows(rows)


@pytest.mark.parametrize("peer", ["cudnn", "torch", "jax_pallas_gqa", "jax_pallas_paged"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_peers_without_an_option_report_it_unavailable(peer, option):
  op = "paged" if peer == "jax_pallas_paged" else "decode"
  with pytest.raises(peers.PeerUnavailable, match=f"{peer} peer cannot express {option}"):
    peers.PEERS[peer](peers.OpSpec(op=op, **OPTIONS[option]))


def test_mla_rejects_options():
  with pytest.raises(ValueError, match="op='mla' takes no"):
    cases.Sweep(op="mla", window=128)


@pytest.mark.slow
def test_reference_in_batch_chunks_matches_one_call(monkeypatch):
  for op in ("decode", "paged"):
    sweep = cases.Sweep(op=op, cases=((4, 32),), num_heads=4, num_kv_heads=2, head_dim=64,
                        page_size=8, softcap=3.0, sinks=True)
    case = cases.Case.from_sweep(sweep, 4, 32)
    lengths = cases.make_lengths(case, jax.random.key(0))
    args = cases.make_input_sets(case, jax.random.key(1), lengths, 1)[0]
    whole, _ = cases.reference_output(case, args)
    monkeypatch.setattr(cases, "REFERENCE_CHUNK_BYTES", 1)
    chunked, source = cases.reference_output(case, args)
    monkeypatch.undo()
    assert "4 batch chunks" in source
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["decode", pytest.param("paged", marks=pytest.mark.slow)])
def test_quantized_cache_rows_count_one_byte_elements_and_their_scales(op):
  rows = decode_bench.run(op=op, cases=((2, 64),), impls=("xla", "xla_einsum"), num_heads=4, num_kv_heads=2,
                          head_dim=64, page_size=16, kv_dtype="int8", sinks=True, warmup=0, iters=1, repeats=1,
                          out=io.StringIO())
  xla_row, peer_row = rows
  assert xla_row["status"] == "ok" and xla_row["rel_err"] < 1e-2 and xla_row["kv_dtype"] == "int8"
  # 2 x 64 keys x 2 kv heads x (K and V) x (64 int8 values + a float32 scale)
  assert xla_row["kv_bytes"] == 2 * 64 * 2 * 2 * (64 + 4)
  assert peer_row["status"] == "n/a" and "int8 / fp8" in peer_row["reason"]
  # The scales reach the reference: dropping them changes it.
  case = cases.Case.from_row(xla_row)
  lengths = cases.make_lengths(case, jax.random.key(0))
  args = cases.make_input_sets(case, jax.random.key(1), lengths, 1)[0]
  ref, _ = cases.reference_output(case, args)
  unscaled = dataclasses.replace(case, kv_dtype=None)
  ref_unscaled, _ = cases.reference_output(unscaled, args[:-3] + args[-1:])
  assert cases.relative_error(ref_unscaled, ref) > 1e-2


def _fake_rows():
  rows = []
  for batch, seq_len in ((1, 1024), (1, 8192), (8, 8192), (32, 8192)):
    for impl, tbps in (("auto", 3.0), ("xla_einsum", 1.0), ("cudnn", None)):
      row = {"op": "decode", "batch": batch, "seq_len": seq_len, "num_heads": 32, "num_kv_heads": 8,
             "head_dim": 128, "v_head_dim": 128, "num_queries": 1, "page_size": 16, "shuffle_pages": True,
             "dtype": "bfloat16", "ragged": False, "softcap": 50.0, "window": None, "sinks": False,
             "impl": impl, "ours": impl == "auto", "device": "gpu:NVIDIA H200 x1", "jax_version": "0.11.2",
             "date": "2026-11-29"}
      if tbps is None:
        row.update(status="n/a", reason="PeerUnavailable: cudnn peer cannot express softcap=50")
      else:
        row.update(status="ok", tbps=tbps, time_us=batch * seq_len / tbps / 1e3, roofline_pct=tbps / 0.045,
                   rel_err=1e-3, check_ok=True)
      rows.append(row)
  return rows


def test_plot_is_written_when_matplotlib_is_installed(tmp_path):
  pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
  path = tmp_path / "sweep.png"
  output.write_plot(_fake_rows(), str(path))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so_and_goes_on(tmp_path, monkeypatch):
  monkeypatch.setattr(output, "plot_available", lambda: False)
  out = io.StringIO()
  rows = decode_bench.run(op="decode", cases=((1, 32),), impls=("xla",), num_heads=2, num_kv_heads=1, head_dim=64,
                          warmup=0, iters=1, repeats=1, check=False, plot_path=str(tmp_path / "p.png"), out=out)
  assert rows[0]["status"] == "ok" and not (tmp_path / "p.png").exists()
  assert "matplotlib" in out.getvalue() and "not installed" in out.getvalue()


def test_report_renders_a_section_from_json_rows(tmp_path, capsys):
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(_fake_rows()))
  report.main([str(path)])  # the old usage: one TB/s (µs) table per file
  assert "| B1 T1024 32/8 | 3.00 (0) | 1.00 (1) |" in capsys.readouterr().out
  report.main(["--command=python -m benchmarks.decode --flagfile=configs/gemma2_9b.flags", str(path)])
  text = capsys.readouterr().out
  assert text.startswith("## 2026-11-29 — NVIDIA H200, jax 0.11.2\n")
  assert "Command: `python -m benchmarks.decode --flagfile=configs/gemma2_9b.flags`" in text
  assert "### Dense, heads 32/8, head_dim 128, bfloat16, 1 new token, full lengths, softcap 50" in text
  assert "| B × T | auto | xla_einsum | cudnn |" in text
  assert "| 8 × 8192 | 3.00 | 1.00 | n/a |" in text  # TB/s
  assert "| 8 × 8192 | 21.8 | 65.5 | n/a |" in text  # µs
  assert "| 8 × 8192 | 67% | 22% | n/a |" in text  # roofline
  assert "cudnn peer cannot express softcap=50" in text
  assert "in a Python loop" not in text  # rows without host-loop times: no such table


def test_report_names_a_short_length_apart_from_the_full_one(tmp_path, capsys):
  rows = _fake_rows()
  short = [{**row, "length": 512} for row in rows]
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(rows + short))
  report.main([str(path)])
  text = capsys.readouterr().out
  assert "| B1 T1024 32/8 |" in text and "| B1 T1024 L512 32/8 |" in text
  report.main(["--command=x", str(path)])
  text = capsys.readouterr().out
  assert "1 new token, full lengths" in text and "1 new token, each 512 long" in text


def test_report_adds_the_host_loop_table_where_rows_have_it(tmp_path, capsys):
  rows = _fake_rows()
  for row in rows:
    if row["status"] == "ok" and row["batch"] != 1:  # B1 rows as written before the host loop
      row["host_us"] = 250.0 if row["impl"] == "auto" else 80.0
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(rows))
  report.main(["--section", str(path)])
  text = capsys.readouterr().out
  times, host = text.index("Median time per call (µs)"), text.index("Median time per call in a Python loop")
  assert times < host < text.index("TB/s of KV read:")
  host_table = text[host:text.index("TB/s of KV read:")]
  assert "| 8 × 8192 | 250.0 | 80.0 | n/a |" in host_table
  assert "| 1 × 1024 | – | – | n/a |" in host_table
  report.main(["--auto", str(path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].endswith("| auto host-loop µs | peer host-loop µs |")
  assert next(l for l in lines if "B8 T8192" in l).endswith("| 250.0 | 80.0 |")
  assert next(l for l in lines if "B1 T1024" in l).endswith("| – | – |")


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_step_benchmark_runs():
  cases = [step_bench.StepCase(batch=2, context=40, hidden=32, num_heads=4, num_kv_heads=2, head_dim=16,
                               page_size=8, headroom=4)]
  rows = step_bench.run(cases, ["xla"], iters=2, repeats=1)
  assert np.isfinite(rows[0]["step_us"])  # a timed number (it can be noise around 0 on a CPU)
  assert rows[0]["ran"] == "xla"


@pytest.mark.parametrize("per_call_s,iters,expected", [
    (45e-6, 20, 112),    # 0.9 ms chain lengthened to >= 5 ms
    (10e-6, 20, 128),    # capped
    (530e-6, 20, 20),    # already long enough
    (-1e-6, 20, 20),     # a noisy negative pilot keeps the given length
])
def test_chain_length_grows_short_chains_up_to_the_cap(per_call_s, iters, expected):
  n = timing.chain_length(per_call_s, iters, min_chain_s=5e-3, max_calls=128)
  assert n == expected
  assert n * max(per_call_s, 0) >= 5e-3 or n in (iters, 128)


class _CountedChain:
  """A compiled chain that says how many calls it holds."""

  def __init__(self, compiled, num_calls):
    self.compiled, self.num_calls = compiled, num_calls

  def __call__(self, arg_sets):
    return self.compiled(arg_sets)


@pytest.mark.parametrize("min_chain_s,lengths", [
    (4.5 * 2**-10, [2, 5]),  # the pilot's 2 calls of 2**-10 s run short of it: recompiled at 5
    (0.0, [2]),              # no least duration: the given length
    (None, None),            # the default: none on a CPU, MIN_CHAIN_S (5.12 calls) on accelerators
])
def test_time_jax_lengthens_the_chain_when_asked(monkeypatch, min_chain_s, lengths):
  # A fake clock (a chain of n calls "takes" c + n * t, exact in binary) replaces the wall-clock
  # readings, so the length rule is tested, not the machine's timing.
  per_call_s, fixed_s = 2**-10, 2**-8
  if lengths is None:
    lengths = [2] if jax.default_backend() == "cpu" else [2, 6]
  compiled_lengths = []
  real_compile = timing._compile_chains

  def compile_chains(fn, arg_sets, iters):
    compiled_lengths.append(iters)
    short, long = real_compile(fn, arg_sets, iters)
    return _CountedChain(short, iters), _CountedChain(long, 2 * iters)

  def fake_wall(chain, arg_sets):
    jax.block_until_ready(chain(arg_sets))
    return fixed_s + chain.num_calls * per_call_s

  monkeypatch.setattr(timing, "_compile_chains", compile_chains)
  monkeypatch.setattr(timing, "_wall", fake_wall)
  x = jnp.ones((8,), jnp.float32)
  t = timing.time_jax(lambda a: a * 2.0, [(x,)], warmup=1, iters=2, repeats=2, min_chain_s=min_chain_s,
                      queued=False)
  assert compiled_lengths == lengths and t.calls == lengths[-1]
  assert (t.method, t.median_s, t.overhead_s) == ("chain-diff", per_call_s, fixed_s)


def test_host_loop_jax_makes_the_calls_it_counts_rotating_over_the_input_sets():
  # The callback runs on every execution of the jitted program, so it counts the device's calls.
  seen = []
  fn = jax.jit(lambda a: (jax.debug.callback(lambda v: seen.append(int(v)), a[0]), a * 2.0)[1])
  arg_sets = [(jnp.full((8,), i, jnp.float32),) for i in range(3)]
  t = timing.time_host_loop_jax(fn, arg_sets, warmup=2, iters=3, repeats=4, min_loop_s=0.0)
  jax.effects_barrier()
  assert seen == [i % 3 for i in range(2 + 4 * 3)]  # 2 warm-up calls, then 4 loops of 3
  assert t.method == timing.HOST_LOOP and t.calls == 3 and len(t.samples_s) == 4
  assert 0 < t.min_s <= t.median_s and np.isfinite(t.median_s)


def test_host_loop_jax_jits_a_plain_function_as_a_user_would():
  traces = []

  def plain(a):  # Python runs it only while jax traces it
    traces.append(a.shape)
    return jnp.sin(a)

  assert not isinstance(plain, jax.stages.Wrapped)
  t = timing.time_host_loop_jax(plain, [(jnp.ones((8,), jnp.float32),)], warmup=1, iters=3, repeats=2,
                                min_loop_s=0.0)
  assert traces == [(8,)]  # traced once, then 7 calls of the compiled program
  assert t.median_s > 0 and t.calls == 3
  jitted = jax.jit(plain)
  assert timing.user_jitted(jitted) is jitted


def test_host_loop_torch_times_calls_per_loop_by_wall_clock(monkeypatch):
  # A fake torch (its CUDA synchronize counted) and a fake clock that each call advances by
  # 2**-12 s: the loop is lengthened to min_loop_s and each sample reads exactly one call's time.
  clock = {"now": 0.0, "calls": 0, "syncs": 0}

  def fn(x):
    clock["now"] += 2**-12
    clock["calls"] += 1
    return x

  def synchronize():
    clock["syncs"] += 1

  fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=synchronize))
  monkeypatch.setitem(sys.modules, "torch", fake_torch)
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
  t = timing.time_host_loop_torch(fn, [(0,), (1,)], warmup=1, iters=2, repeats=3, min_loop_s=5 * 2**-12)
  # 1 warm-up call, a pilot loop of 2, then 3 loops lengthened to 5 calls; a synchronize after each loop.
  assert (clock["calls"], clock["syncs"]) == (1 + 2 + 3 * 5, 1 + 1 + 3)
  assert (t.method, t.calls, t.samples_s) == (timing.HOST_LOOP, 5, (2**-12,) * 3)
  assert timing.HOST_LOOP_TIMERS == {"jax": timing.time_host_loop_jax, "torch": timing.time_host_loop_torch}


def test_chain_uses_every_barrier_output_so_xla_cannot_merge_the_calls():
  # An unused barrier output lets XLA drop it; the barriers over the same inputs then merge, and
  # the calls behind them (the GPU did this to the xla MLA impl: 2 of 4 calls left).
  x = jnp.ones((8,), jnp.float32)
  jaxpr = jax.make_jaxpr(timing.chain(lambda a: jnp.sin(a) * 2.0, 4))([(x,)]).jaxpr
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert len(barriers) == 3
  used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
  for barrier in barriers:
    assert all(id(v) in used for v in barrier.outvars), barrier


def test_profile_kernel_lists_what_a_compiled_call_launches():
  from benchmarks.tools import profile_kernel
  text = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: f32[4], b: s32[2]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = s32[2]{0} parameter(1)
  %pad_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused
  %cc = (f32[4]{0}, s8[16]{0}) custom-call(%pad_fusion, %b), custom_call_target="mosaic_gpu_v2"
  %gte = f32[4]{0} get-tuple-element(%cc), index=0
  %copy.1 = f32[4]{0} copy(%gte)
  %bc = f32[4]{0} bitcast(%copy.1)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%gte, %bc)
}
"""
  assert profile_kernel.launched_ops(text) == ["fusion", "custom-call:mosaic_gpu_v2", "copy"]
  sweep = cases.Sweep(op="decode", impls=("xla",), cases=((2, 64),), num_heads=4, num_kv_heads=2, head_dim=32)
  (line,) = profile_kernel.launches(sweep)
  assert line.startswith("xla: ") and int(line.split()[1]) > 0, line


def test_profile_kernel_runs_each_impl_once_per_call_on_cpu(capsys):
  from benchmarks.tools import profile_kernel
  sweep = cases.Sweep(op="decode", impls=("xla", "cudnn"), cases=((2, 64),), num_heads=4, num_kv_heads=2,
                      head_dim=32, iters=1, repeats=1, warmup=1)
  lines = profile_kernel.run(sweep, calls=2)
  assert lines[0].startswith("xla: 2 calls of decode B=2 T=64")
  assert lines[1].startswith("cudnn: not run")  # a peer that needs a GPU says so, the rest go on


def test_profile_kernel_times_say_why_they_cannot_run_here():
  # This machine has no torch with CUDA: every impl's line says so instead of a table.
  from benchmarks.tools import profile_kernel
  sweep = cases.Sweep(op="decode", impls=("xla",), cases=((2, 64),), num_heads=4, num_kv_heads=2, head_dim=32,
                      iters=1, repeats=1, warmup=1)
  try:
    import torch
    if torch.cuda.is_available():
      pytest.skip("torch with CUDA is installed: the profile would run")
  except ImportError:
    pass
  (line,) = profile_kernel.kernel_time_lines(sweep, calls=1)
  assert line.startswith("xla: not profiled") and "needs torch with CUDA" in line, line
  (line,) = profile_kernel.chain_lines(sweep, calls=2)
  assert line.startswith("xla: not profiled") and "needs torch with CUDA" in line, line
  (line,) = profile_kernel.timer_check_lines(sweep, calls=2)
  assert line.startswith("xla: not checked") and "needs torch with CUDA" in line, line


def test_profile_kernel_chain_summary():
  from benchmarks.tools import profile_kernel
  kernels = [(0.0, 10.0, "decode"), (10.5, 12.0, "merge"), (12.0, 22.0, "decode"), (25.0, 26.0, "merge")]
  line = profile_kernel.chain_summary(kernels, calls=2)
  assert line.startswith("busy 11.2 us, elapsed 13.0 us per call over 4 kernels"), line
  assert "longest gaps: 3.0 us after decode, 0.5 us after decode, 0.0 us after merge" in line, line
  assert profile_kernel.chain_summary([], calls=2) == "no kernels recorded"


def test_clocks_summary_keeps_only_samples_under_load():
  from benchmarks.tools import clocks
  lines = ["1980, 85.0", "1530, 693.5", "1515, 700.1", "[N/A], 650", "1665, 693.0\n"]
  assert clocks.summarise(lines, 300.0) == ("3 samples above 300 W: SM clock median 1530 MHz (range 1515-1665), "
                                            "power median 694 W (range 693-700)")
  assert clocks.summarise(lines[:1], 300.0) == "no samples above 300 W (of 1)"


def test_ncu_summary_reads_a_details_csv():
  from benchmarks.tools import ncu_summary
  header = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
  rows = [
      '"0","7","pallas_kv_decode_dense_r4","GPU Speed Of Light Throughput","DRAM Throughput","%","91.52"',
      '"0","7","pallas_kv_decode_dense_r4","Launch Statistics","Registers Per Thread","register/thread","168"',
      '"0","7","pallas_kv_decode_dense_r4","Occupancy","Block Limit Registers","block","1"',
      '"1","7","flash_fwd_splitkv_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","97.10"',
  ]
  launches = ncu_summary.read_launches(["==PROF== noise", header, *rows])
  assert [l["kernel"] for l in launches] == ["pallas_kv_decode_dense_r4", "flash_fwd_splitkv_kernel"]
  assert launches[0]["Registers Per Thread"] == "168 register/thread"
  text = ncu_summary.format_rows(launches)
  assert "DRAM %=91.52 %" in text and "blk lim regs=1 block" in text and "DRAM %=97.10 %" in text
  assert "ach occ %=-" in text  # metrics a launch lacks show as '-'


def test_ncu_summary_reads_raw_metrics_and_ranks_stalls():
  from benchmarks.tools import ncu_summary
  header = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
  stall = lambda reason, value: (f'"0","7","k","Command line profiler metrics","{ncu_summary.STALL_PREFIX}{reason}'
                                 f'{ncu_summary.STALL_SUFFIX}","inst","{value}"')
  rows = ['"0","7","k","Command line profiler metrics","gpu__time_duration.sum","ns","270,112"',
          stall("wait", "0.60"), stall("short_scoreboard", "0.69"), stall("selected", "1"), stall("drain", "0.00")]
  # The profiled program's own output comes before the CSV's header.
  launches = ncu_summary.read_launches(["==PROF== Connected", "ran ['int8']", header, *rows])
  text = ncu_summary.format_rows(launches)
  assert "duration=270,112 ns" in text and "DRAM %=-" in text and "ach occ" not in text, text
  assert "cycles per issue 2.29: selected=1.00  short_scoreboard=0.69  wait=0.60" in text, text
  assert "drain" not in text
  assert ncu_summary.STALL_PREFIX + "long_scoreboard" + ncu_summary.STALL_SUFFIX in ncu_summary.ncu_metrics_flag()
  assert "regex:" not in ncu_summary.ncu_metrics_flag() and "regex:" in ncu_summary.ncu_metrics_flag(pipes=True)


def test_ncu_summary_ranks_busy_pipes():
  from benchmarks.tools import ncu_summary
  header = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
  pipe = lambda name, value: (f'"0","7","mla","Command line profiler metrics","{ncu_summary.PIPE_PREFIX}{name}'
                              f'{ncu_summary.PIPE_SUFFIX}","%","{value}"')
  rows = [pipe("alu", "12.5"), pipe("tensor_op_gmma", "61.25"), pipe("fp64", "0.0")]
  text = ncu_summary.format_rows(ncu_summary.read_launches([header, *rows]))
  assert "pipes busy %: tensor_op_gmma=61.2  alu=12.5" in text, text
  assert "fp64" not in text


# ptxas's report of two kernels as Mosaic GPU dumps it: the first as the H200 machine's ptxas wrote
# it for the alternate scorers (name shortened), the second made up, with a wgmma warning.
PTXAS_REPORT = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 1010 by compiler to allow use of registers in GMMA in function 'mla_alt_kernel'
ptxas info    : (C7519) warpgroup.arrive is injected in around line 2236 by compiler to allow use of registers in GMMA in function 'mla_alt_kernel'
ptxas warning : Registers are spilled to local memory in function 'mla_alt_kernel', 1932 bytes spill stores, 2232 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mla_alt_kernel' for 'sm_90a'
ptxas info    : Function properties for mla_alt_kernel
    760 bytes stack frame, 1932 bytes spill stores, 2232 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 760 bytes cumulative stack size, 1 bytes smem
ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized in function 'mla_kernel'
ptxas info    : Compiling entry function 'mla_kernel' for 'sm_90a'
ptxas info    : Function properties for mla_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 1 bytes smem
"""


def test_ptxas_summary_reads_registers_spills_and_warnings(tmp_path):
  from benchmarks.tools import ptxas_summary
  alt, plain = ptxas_summary.parse(PTXAS_REPORT)
  assert (alt.name, alt.registers, alt.stack_bytes, alt.spill_store_bytes, alt.spill_load_bytes) == \
      ("mla_alt_kernel", 168, 760, 1932, 2232)
  assert alt.spills and alt.injected_arrives == 2 and alt.warnings == ()   # the spill warning is in the columns
  assert (plain.registers, plain.spills, plain.injected_arrives) == (128, False, 0)
  assert plain.warnings == ("(C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                            "in function 'mla_kernel'",)
  # A folder of dumps (one file per compile; a kernel compiled twice is listed once).
  for i in range(2):
    (tmp_path / f"mla_{i}.ptxas").write_text(PTXAS_REPORT)
  (tmp_path / "mla_0.ptx").write_text("not a report")
  reports = ptxas_summary.read_folder(str(tmp_path))
  assert [r.name for r in reports] == ["mla_alt_kernel", "mla_kernel"]
  table = ptxas_summary.format_table(reports).splitlines()
  assert table[2].split()[:6] == ["mla_alt_kernel", "168", "760", "1932", "2232", "2"]
  assert "serialized" in table[3]


def test_ptxas_summary_keeps_one_ptx_per_kernel_and_rewrites_register_counts(tmp_path):
  import gzip
  from benchmarks.tools import ptxas_summary
  ptx = """.visible .entry mla_kernel(
\t.param .u64 .ptr .align 256 mla_kernel_param_0
)
\tsetmaxnreg.dec.sync.aligned.u32 40;
\tsetmaxnreg.inc.sync.aligned.u32 232;
\tsetmaxnreg.inc.sync.aligned.u32 232;
"""
  dump, keep = tmp_path / "dump", tmp_path / "keep"
  dump.mkdir()
  for i in range(2):   # a kernel compiled twice
    (dump / f"mla_{i}.ptx").write_text(ptx)
  (dump / "other_2.ptx").write_text(ptx.replace("mla_kernel", "other_kernel"))
  assert ptxas_summary.keep_ptx(str(dump), str(keep)) == ["mla_kernel", "other_kernel"]
  assert gzip.open(keep / "mla_kernel.ptx.gz", "rt").read() == ptx
  both = ptxas_summary.with_registers(ptx, consumer=240, producer=24)
  assert both.count("setmaxnreg.inc.sync.aligned.u32 240;") == 2 and "dec.sync.aligned.u32 24;" in both
  assert ptxas_summary.with_registers(ptx, consumer=None, producer=None) == ptx
  sass = """
        /*0060*/                   LDL.LU R8, [R1+0x80] ;
        /*09b0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
        /*0a00*/                   STL [R1+0x4], R3 ;
        /*1a40*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
        /*3ce0*/                   LDL R7, [R1+0x50] ;
        /*4e50*/                   STL.64 [R1+0x38], R190 ;
        /*4e60*/                   LDS R9, [R2] ;
"""
  assert ptxas_summary.spills_by_role(sass) == {"launch": 1, "producer": 1, "consumer": 2}


@pytest.mark.skipif(not (shutil.which("ptxas") and shutil.which("nvdisasm")),
                    reason="needs the CUDA toolkit's ptxas and nvdisasm on the PATH")
def test_ptxas_summary_compiles_a_ptx_here(tmp_path):
  from benchmarks.tools import ptxas_summary
  path = tmp_path / "tiny.ptx"
  path.write_text(".version 8.0\n.target sm_90a\n.address_size 64\n\n.visible .entry tiny_kernel()\n"
                  ".maxntid 256, 1, 1\n{\n\tsetmaxnreg.inc.sync.aligned.u32 240;\n\tret;\n}\n")
  report, sass = ptxas_summary.compile_ptx_locally(str(path), consumer=232, producer=None)
  (kernel,) = ptxas_summary.parse(report)
  assert kernel.name == "tiny_kernel" and not kernel.spills
  assert "EXIT" in sass and ptxas_summary.spills_by_role(sass) == {}


def test_kernel_variants_merge_rows_merge_the_kernels_partials(interpret_mode):
  # Each kernel-only merge row (Triton's launch, Mosaic GPU's, XLA's) on the same two-split partials: one result.
  from benchmarks.tools import kernel_variants as kv
  s = kv.Settings(smoke=True, num_heads=4, num_kv_heads=1, head_dim=64, warmup=0, iters=1, repeats=1,
                  rotate_bytes=0.0, budget_s=600.0)
  args = cases.make_inputs(kv._case(s, 2, 256, None), jax.random.PRNGKey(0), jnp.asarray([256, 100], jnp.int32))
  problem = kv._problem(args, False)
  config = kv._config(dict(block_kv=64, num_stages=2, num_splits=2), args, False)
  assert config.num_splits == 2
  merged = {m: np.asarray(jnp.asarray(kv.kernel_fn(config, problem, False, m)(*args)[0], jnp.float32))
            for m in kv.MERGES}
  assert merged["xla_merge"].shape == (2, 1, 4, 64)
  for m in ("triton_merge", "mosaic_merge"):
    np.testing.assert_allclose(merged[m], merged["xla_merge"], atol=1e-2, rtol=1e-2)


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_kernel_variants_load_path_rows_run_in_interpret_mode(monkeypatch):
  import pallas_kv
  from benchmarks.tools import kernel_variants as kv
  monkeypatch.setattr(kv, "VARIANTS", {})
  monkeypatch.setattr(kv, "LOAD_PATH", dict(list(kv.LOAD_PATH.items())[:2]))
  s = kv.Settings(smoke=True, num_heads=4, num_kv_heads=1, head_dim=64, warmup=0, iters=1, repeats=1,
                  rotate_bytes=0.0, budget_s=600.0)
  with pallas_kv.interpret():
    rows = kv.run(s, kv.SMOKE_SHAPES[:1], kv.SMOKE_PROBE_SHAPES, None, load_path=True)
  names = [r["variant"] for r in rows]
  assert names == ["kernel", *(f"kernel+{m}" for m in kv.MERGES), "plan", *(f"probe:{p}" for p in kv.PROBES),
                   *(f"loads:{n}" for n in kv.LOAD_PATH)]
  assert all(r["status"] == "ran" for r in rows), [(r["variant"], r.get("reason")) for r in rows]
  assert rows[-1]["config"]["num_stages"] == list(kv.LOAD_PATH.values())[-1]["num_stages"]


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_vmap_benchmark_times_vmapped_and_batched_rows():
  from benchmarks import vmap as vmap_bench
  rows = vmap_bench.run(["2x2x64", "2x2x64p"], ["xla"], warmup=0, iters=1, repeats=1)
  assert [(r["case"], r["kind"], r["status"]) for r in rows] == [
      ("2x2x64", "vmapped", "ok"), ("2x2x64", "batched", "ok"), ("2x2x64p", "vmapped", "ok"),
      ("2x2x64p", "batched", "ok")]
  # The two forms compute the same attention.
  vmapped, batched = vmap_bench.make_inputs(2, 2, 64, True, jax.random.key(0))
  import pallas_kv as pkv
  a = jax.vmap(pkv.paged_decode_attention)(*vmapped)
  b = pkv.paged_decode_attention(*batched)
  np.testing.assert_array_equal(np.asarray(a, np.float32).reshape(b.shape), np.asarray(b, np.float32))



def test_shared_prefix_benchmark_times_plain_and_shared_rows():
  from benchmarks import shared_prefix as bench
  rows = bench.run(["2x3x16x4"], ["xla"], "paged", warmup=0, iters=1, repeats=1, shapes=bench.CPU_SHAPES)
  assert [(r["kind"], r["status"]) for r in rows] == [("plain", "ok"), ("shared", "ok")]
  # The plain call reads the prompt's 4 pages once per member, the shared call once per group.
  assert (rows[0]["pages_read"], rows[1]["pages_read"]) == (2 * 3 * (4 + 1), 2 * 4 + 2 * 3 * 1)
  assert rows[1]["rel_err_vs_plain"] < 1e-2

def test_report_auto_mode_compares_auto_with_the_fastest_backend_and_peer(tmp_path, capsys):
  rows = [r for r in _fake_rows() if r["batch"] == 8 and r["status"] == "ok"]
  auto = next(r for r in rows if r["impl"] == "auto")
  auto["auto_choice"] = "triton"
  auto["timer"] = "chain-diff"
  rows += [dict(auto, impl="triton", ours=True, time_us=auto["time_us"] / 2, timer="chain-diff+dispatch"),
           dict(auto, impl="mosaic_gpu", ours=True, time_us=auto["time_us"] * 2)]
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(rows))
  report.main(["--auto", str(path)])
  line = [l for l in capsys.readouterr().out.splitlines() if "B8 T8192" in l][0]
  # auto ran triton, whose own row is the fastest backend here: the same kernel read twice as fast
  # there, and that row's chains were dispatch-bound.
  assert "| triton | 21.8 | 10.9 (triton) | 2.000 | 10.9 (2.000) | triton | 65.5 (xla_einsum) | 0.333 |" in line


def test_decode_benchmark_kernel_flags_build_partial_configs():
  # Each kernel flag fixes its fields in a partial config of every kernel that has them; the
  # backend fills the rest (here as its heuristic would: no tuned file for a CPU).
  import pallas_kv as pkv
  import sweeps
  from pallas_kv import experimental
  from pallas_kv import runtime
  from pallas_kv.kernels import plan
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  from pallas_kv.kernels.triton import config as triton_config
  _, problem = sweeps.problem_args((32, 8), (16, 32768), None)
  case = cases.Case.from_sweep(cases.Sweep(num_heads=32, num_kv_heads=8, head_dim=128), 16, 32768)
  modules = {"triton": triton_config, "mosaic_gpu": mgpu_config}
  plain = {backend: module.resolve_config(problem, None, num_sms=132) for backend, module in modules.items()}

  def resolved(dtype="bfloat16", on=case, **flag_fields):
    configs = decode_bench.KernelFlags(**flag_fields).configs(on)
    return {b: modules[b].resolve_config(problem, c, dtype=dtype, num_sms=132) for b, c in configs.items()}

  assert decode_bench.KernelFlags().configs(case) == {}
  assert decode_bench.KernelFlags(split_plan="balanced").configs(case) == {
      "triton": pkv.TritonConfig(split_plan="balanced"), "mosaic_gpu": pkv.MosaicGPUConfig(split_plan="balanced")}
  for backend, config in resolved(split_plan="balanced").items():
    assert config.split_plan == "balanced" and config.block_kv == plain[backend].block_kv
    assert config.num_splits >= plan.choose_balanced_splits(
        batch=16, num_kv_heads=8, row_blocks=1, capacity=32768, block_kv=config.block_kv, num_sms=132)
  merged = resolved(merge_in_kernel=True)
  assert set(merged) == {"triton"} and merged["triton"].merge_in_kernel
  ordered = resolved(sequence_order="longest_first")
  assert set(ordered) == {"triton", "mosaic_gpu"}
  assert ordered["triton"].sequence_order == "longest_first" and ordered["triton"].split_plan == "per_sequence"
  assert ordered["mosaic_gpu"].sequence_order == "longest_first"
  # This shape takes stream-K by default; the flag forces either plan.
  assert plain["triton"].split_plan == "stream_k"
  per_sequence = resolved(split_plan="per_sequence")
  assert {c.split_plan for c in per_sequence.values()} == {"per_sequence"}
  assert per_sequence["triton"].block_kv == plain["triton"].block_kv
  assert decode_bench.KernelFlags(split_plan="stream_k", stream_k_programs_per_sm=3).configs(case) == {
      "triton": pkv.TritonConfig(split_plan="stream_k", num_splits=runtime.num_sms() * 3 // 8),
      "mosaic_gpu": pkv.MosaicGPUConfig(split_plan="stream_k")}   # the programs per SM are Triton's
  streamed = resolved(split_plan="stream_k")
  assert streamed["triton"] == plain["triton"]   # the backend's own program count
  assert streamed["mosaic_gpu"].split_plan == "stream_k" and streamed["mosaic_gpu"].persistent
  retiled = resolved(triton_block_kv=32)["triton"]
  assert retiled.block_kv == 32 and retiled.num_splits == plain["triton"].num_splits
  staged = resolved(triton_num_stages=5 - plain["triton"].num_stages)["triton"]
  assert dataclasses.replace(staged, num_stages=plain["triton"].num_stages) == plain["triton"]
  # --convert_warpgroup: one-byte caches only, as the experimental variant.
  assert decode_bench.KernelFlags(convert_warpgroup=True).configs(case) == {}
  int8 = dataclasses.replace(case, kv_dtype="int8")
  assert decode_bench.KernelFlags(convert_warpgroup=True).configs(int8) == {
      "mosaic_gpu": experimental.MosaicGPUVariantConfig(convert_warpgroup=True)}
  converted = resolved(dtype="int8", on=int8, convert_warpgroup=True)["mosaic_gpu"]
  assert converted.convert_warpgroup and converted.kv_groups == 1 and not converted.persistent
  assert mgpu_config.fits_smem(converted, rows=4, head_dim=128, dtype="int8", k_scale_kind="token",
                               v_scale_kind="token")
  # --one_tile_loop: Mosaic GPU's GQA kernel on any cache, as the experimental variant.
  for on in (case, int8):
    assert decode_bench.KernelFlags(one_tile_loop=True, sequence_order="given").configs(on)["mosaic_gpu"] == (
        experimental.MosaicGPUVariantConfig(one_tile_loop=True, sequence_order="given"))
  assert resolved(one_tile_loop=True)["mosaic_gpu"].one_tile_loop
  # MLA takes the plan and order fields; flags no config takes are refused before a run.
  mla = cases.Case.from_sweep(cases.Sweep(op="mla", num_heads=16, page_size=64), 4, 4096)
  assert decode_bench.KernelFlags(split_plan="balanced", sequence_order="long_short", merge_in_kernel=True,
                                  triton_block_kv=32).configs(mla) == {
      "mosaic_gpu": pkv.MosaicMLAConfig(split_plan="balanced", sequence_order="long_short")}
  for bad in (dict(split_plan="stream_k", sequence_order="longest_first"), dict(triton_block_kv=48),
              dict(stream_k_programs_per_sm=2)):
    with pytest.raises(ValueError):
      decode_bench.KernelFlags(**bad)
  # v's layout follows KVCache.create's unless a flag says: tokens last for one-byte caches (never MLA).
  fp8 = dataclasses.replace(case, kv_dtype="float8_e4m3fn")
  assert [decode_bench.KernelFlags().tokens_last(c) for c in (case, int8, fp8, mla)] == [False, True, True, False]
  assert not decode_bench.KernelFlags(v_tokens_last=False).tokens_last(int8)
  assert decode_bench.KernelFlags(v_tokens_last=True).tokens_last(case)


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_decode_benchmark_kernel_flags_parse_and_reach_the_kernel_rows(monkeypatch):
  import pallas_kv as pkv
  flag_values = flags.FlagValues()
  decode_bench.define_flags(flag_values)
  assert flag_values["split_plan"].parser.enum_values == list(pkv.TritonConfig.SPLIT_PLANS)
  flag_values(["decode", "--split_plan=balanced", "--merge_in_kernel", "--sequence_order=longest_first"])
  kernel = decode_bench.kernel_flags(flag_values)
  assert kernel == decode_bench.KernelFlags(split_plan="balanced", merge_in_kernel=True, sequence_order="longest_first")
  monkeypatch.setattr(pkv.api, "device_can_run", lambda name: name == "triton")   # auto picks triton here
  run = functools.partial(decode_bench.run, op="decode", cases=((2, 64),), num_heads=4, num_kv_heads=2, head_dim=64,
                          ragged=True, warmup=0, iters=1, repeats=1, host_loop=False, out=io.StringIO())
  with pkv.interpret():
    rows = {r["impl"]: r for r in run(impls=("auto", "triton", "mosaic_gpu", "xla"), kernel=kernel)}
    assert all(r["status"] == "ok" and r["check_ok"] for r in rows.values()), rows
    triton_fields = {"split_plan": "balanced", "sequence_order": "longest_first", "merge_in_kernel": True}
    assert rows["triton"]["config"] == triton_fields
    assert rows["mosaic_gpu"]["config"] == {"split_plan": "balanced", "sequence_order": "longest_first"}
    assert rows["auto"]["auto_choice"] == "triton" and rows["auto"]["config"] == triton_fields
    assert "config" not in rows["xla"]
    tokens_last = decode_bench.KernelFlags(v_tokens_last=True, triton_num_stages=2)
    rows = {r["impl"]: r for r in run(impls=("triton", "mosaic_gpu"), kernel=tokens_last)}
  assert rows["triton"]["status"] == "ok" and rows["triton"]["check_ok"] and rows["triton"]["config"] == {"num_stages": 2}
  assert rows["mosaic_gpu"]["status"] == "ok" and rows["mosaic_gpu"]["check_ok"]
  assert all(row["v_tokens_last"] for row in rows.values())


_QUEUED_WALL_CHECK = """
import jax, jax.numpy as jnp
from benchmarks import timing
x, big = jnp.ones((8,)), jnp.ones((768, 768))
slow = jax.jit(lambda m: [m := jnp.tanh(m @ m) for _ in range(40)][-1])  # ~0.2 s on 2 cores
double = jax.jit(lambda sets: sets[0][0] * 2.0)
ready = jax.block_until_ready((slow(big), double([(x,)])))[0]  # compiled: both dispatch asynchronously
print(timing._queued_wall(double, [(x,)], lambda sets: ready)[1], timing._queued_wall(double, [(x,)], lambda sets: slow(big))[1])
"""


def test_queued_wall_says_whether_the_lead_hid_the_dispatch():
  # In a fresh process: conftest turns CPU async dispatch off, and the slow lead must run async.
  result = subprocess.run([sys.executable, "-c", _QUEUED_WALL_CHECK], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert result.returncode == 0, result.stderr[-2000:]
  # A lead already done cannot hide the call's dispatch; one still computing does.
  assert result.stdout.split() == ["False", "True"]


def test_time_jax_queued_mode_gives_a_chain_difference():
  x = jnp.ones((64, 64), jnp.float32)
  t = timing.time_jax(lambda a: jnp.tanh(a @ a), [(x,)], warmup=1, iters=4, repeats=2, queued=True)
  assert t.method in ("chain-diff", "chain-diff+dispatch", "chain") and len(t.samples_s) == 2
  assert t.median_s > 0


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/              @!P0 LDS.U8 R2, [R3] ;
        /*0020*/                   IMAD.WIDE R4, R2, 0x2, R6 ;
        /*0030*/                   LDS.64 R8, [R3+0x8] ;
        /*0040*/                   HMMA.16816.F32 R10, R12, R14, R10 ;
        /*0050*/              @P1 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
.L_x_1:
        /*0070*/                   BRA `(.L_x_1);
"""


def test_triton_sass_counts_each_loop_by_opcode():
  from benchmarks.tools import triton_sass
  [(size, opcodes)] = triton_sass.loop_counts(_SASS)   # the trap loop at the end is not a loop body
  assert size == 5
  assert opcodes == {"LDS.U8": 1, "IMAD": 1, "LDS.64": 1, "HMMA": 1, "BRA": 1}


def test_triton_sass_lowers_the_decode_kernel_here():
  import pallas_kv as pkv
  from benchmarks.tools import triton_sass
  ttir = triton_sass.kernel_ttir("int8", scales="token", batch=2, seq_len=256,
                                 config=pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=1))
  assert "tt.func public @pallas_kv_triton_decode_dense" in ttir and "kstoken_vstoken" in ttir
  try:
    import triton  # noqa: F401
  except ImportError:
    with pytest.raises(RuntimeError, match="pip install triton"):
      triton_sass.compile_sass(ttir, num_warps=4, num_stages=3)


@pytest.mark.parametrize("v_tokens_contiguous, keep_offset", [(False, False), (True, True)])
def test_triton_sass_lowers_the_minimal_loop_here(v_tokens_contiguous, keep_offset):
  from benchmarks.tools import triton_sass
  ttir = triton_sass.minimal_loop_ttir("int8", v_tokens_contiguous=v_tokens_contiguous, keep_offset=keep_offset,
                                       block_kv=64, num_stages=3, num_warps=4, seq_len=256)
  assert "tt.dot" in ttir
  # The widening is the kernel's PTX, or the same without its subtraction.
  assert ("sub.f16x2" in ttir) != keep_offset
  # V's tile is [D, bkv] when its tokens are contiguous; otherwise every tile is [bkv, D], as K's.
  assert ("tensor<128x64xi8>" in ttir) == v_tokens_contiguous


def test_triton_sass_lowers_the_paged_kernel_with_v_tokens_last_here():
  import pallas_kv as pkv
  from benchmarks.tools import triton_sass
  ttir = triton_sass.kernel_ttir("int8", scales="token", batch=2, seq_len=256, page_size=64, v_tokens_last=True,
                                 config=pkv.TritonConfig(block_kv=64, num_stages=3, num_splits=1))
  assert "tt.func public @pallas_kv_triton_decode_paged64" in ttir and "_vt" in ttir


def test_one_byte_operands_cost_accuracy_that_the_bf16_path_does_not():
  # Small shape: the bf16 operand path stays within the bf16 tolerance; e4m3 q (3 mantissa bits)
  # adds an error several times larger, which is what the measurement exists to show.
  errors = operand_precision.measure(jnp.dtype(jnp.float8_e4m3fn), peaked=False, seed=0, batch=1, seq_len=256,
                                     num_kv_heads=2, group_size=4, head_dim=64)
  assert errors["bf16"] < 1e-2
  assert errors["qk8"] > 3 * errors["bf16"]
  assert errors["qk8_pv8"] > errors["bf16"]


@pytest.mark.slow   # two interpreted kernels; make test-slow
def test_mosaic_one_byte_tool_checks_and_times_its_rows_here():
  from benchmarks.tools import mosaic_one_byte
  import jax.numpy as jnp
  seen = []   # the rows so far after each row: what --json writes then
  rows = mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.float8_e4m3fn), cpu=True,
                              only=["mosaic_gpu token", "mosaic_gpu none bkv128"],
                              on_row=lambda so_far: seen.append([r["name"] for r in so_far]))
  assert [r["name"] for r in rows] == ["mosaic_gpu token", "mosaic_gpu none bkv128"]
  assert seen == [["mosaic_gpu token"], ["mosaic_gpu token", "mosaic_gpu none bkv128"]]
  assert all(r["err"] < 1e-2 and r["us"] > 0 for r in rows), rows
  rows = mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.float8_e4m3fn), cpu=True, only=["mosaic_gpu token asn"],
                              page_size=64)
  assert rows[0]["page_size"] == 64 and rows[0]["err"] < 1e-2 and rows[0]["us"] > 0, rows
  # The kernel's call alone on inputs prepared outside the timing, scales laid out by head.
  rows = mosaic_one_byte.rows(1, 256, 64, jnp.dtype(jnp.float8_e4m3fn), cpu=True, only=["bare loads byhead asn256 v8"])
  assert rows[0]["kernel_only"] == "bare loads" and rows[0]["us"] > 0 and "error" not in rows[0], rows
  # Each timed call after an XLA kernel on its queries, that kernel timed alone in a first row.
  rows = mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.int8), cpu=True, only=["mosaic_gpu token asn128 v8"],
                              between_calls="xla_add")
  assert [r["name"] for r in rows] == ["xla_add alone", "mosaic_gpu token asn128 v8"]
  assert rows[1]["between_calls"] == "xla_add" and rows[1]["err"] < 1e-2 and rows[0]["us"] > 0, rows
  with pytest.raises(ValueError, match="between_calls"):
    mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.int8), cpu=True, between_calls="matmul")


def test_mosaic_one_byte_tool_pages_hold_the_dense_cache():
  # --page_size: the same cache in shuffled pages gives the same attention (xla over both).
  from benchmarks.tools import mosaic_one_byte
  import jax.numpy as jnp
  import pallas_kv as pkv
  x = mosaic_one_byte.inputs(2, 256, 64, jnp.dtype(jnp.float8_e4m3fn))
  p = mosaic_one_byte.paged(x, 64)
  assert p["block_tables"].shape == (2, 4) and sorted(np.ravel(p["block_tables"])) == list(range(8))
  assert (np.ravel(p["block_tables"]) != np.arange(8)).any()   # shuffled
  for kind in ("token", "head"):
    assert x["scales"][kind][0] is not x["scales"][kind][1]   # K's and V's scales: two arrays
    scales = dict(zip(("k_scale", "v_scale"), x["scales"][kind]))
    dense = pkv.decode_attention(x["q"], x["k"], x["v"], x["lengths"], impl="xla", v_tokens_last=True, **scales)
    scales = dict(zip(("k_scale", "v_scale"), p["scales"][kind]))
    pages = pkv.paged_decode_attention(x["q"], p["k"], p["v"], p["block_tables"], x["lengths"], impl="xla",
                                       v_tokens_last=True, **scales)
    np.testing.assert_allclose(np.asarray(pages, np.float32), np.asarray(dense, np.float32), rtol=2e-3, atol=2e-3)
  with pytest.raises(ValueError, match="--only names no row"):
    mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.float8_e4m3fn), cpu=True, only=["mosaic_gpu token nosuch"])
  with pytest.raises(ValueError, match="dense cache"):
    mosaic_one_byte.rows(1, 128, 64, jnp.dtype(jnp.float8_e4m3fn), cpu=True, only=["loads token asn128"],
                         page_size=64)


def test_host_dispatch_tool_times_each_cache_dtype_beside_a_trivial_jit(tmp_path):
  out = tmp_path / "dispatch.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks", "tools.host_dispatch", "--impl=xla",
                           "--shape=1,64,4,2,64", "--calls=5", "--sets=1,2", f"--json={out}"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [(r["call"], r["sets"]) for r in rows] == [("jit(a + 1)", 1)] + [
      (f"decode {d}", s) for d in ("bfloat16", "float8_e4m3fn", "int8") for s in (1, 2)]
  # The result comes after the last dispatch.
  assert all(0 < r["enqueue_us"] <= r["per_call_us"] for r in rows), rows
  assert "per call us" in result.stdout


_PROFILE_KERNEL_LAYOUT = """
import dataclasses
from absl import flags
from benchmarks import cases, cli, decode
from benchmarks.tools import profile_kernel
profile_kernel.define_flags()
flags.FLAGS(["profile_kernel", "--cases=2x64", "--num_heads=4", "--num_kv_heads=2", "--head_dim=32", *EXTRA])
kernel, sweep = decode.kernel_flags(), cli.sweep_from_flags()
print([kernel.tokens_last(cases.Case.from_sweep(dataclasses.replace(sweep, kv_dtype=d), 2, 64))
       for d in ("int8", "bfloat16")])
"""


@pytest.mark.parametrize("extra, expected", [([], "[True, False]"), (["--nov_tokens_last"], "[False, False]")])
def test_profile_kernel_profiles_the_layout_caches_are_created_in(extra, expected):
  """Unset, --v_tokens_last follows `pallas_kv.cache.default_v_tokens_last`, as benchmarks.decode's does."""
  script = _PROFILE_KERNEL_LAYOUT.replace("*EXTRA", ", ".join(repr(e) for e in extra) or "")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().splitlines()[-1] == expected
