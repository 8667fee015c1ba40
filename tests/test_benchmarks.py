"""The benchmark programs run their CPU defaults end to end; flagfiles parse; rows are checked."""

import glob
import io
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import decode as decode_bench  # noqa: E402
from benchmarks import step as step_bench  # noqa: E402


@pytest.mark.parametrize("op", ["decode", "paged", "mla"])
def test_decode_benchmark_rows_are_timed_and_checked(op):
  out = io.StringIO()
  rows = decode_bench.run(op=op, cases=((2, 128),), impls=("xla", "xla_einsum"), num_heads=4, num_kv_heads=2,
                          head_dim=64, page_size=16, mla_qk_dim=72, mla_v_dim=64, iters=2, repeats=2, out=out)
  assert [r["impl"] for r in rows] == ["xla", "xla_einsum"]
  for row in rows:
    assert row["time_us"] > 0 and np.isfinite(row["tbps"])
    assert row["rel_err"] < 1e-2
  assert not decode_bench.failed_rows(rows)
  assert "xla_einsum" in out.getvalue()


def test_unbuilt_or_unavailable_impls_are_reported_not_raised():
  rows = decode_bench.run(op="decode", cases=((1, 64),), impls=("xla", "torch"), num_heads=2, num_kv_heads=1,
                          head_dim=64, iters=1, repeats=1, out=io.StringIO())
  torch_row = rows[1]
  if torch_row["status"] == "n/a":  # torch or CUDA missing: a reason, and the run goes on
    assert "torch" in torch_row["reason"]
  else:
    assert torch_row["time_us"] > 0
  assert rows[0]["time_us"] > 0


@pytest.mark.parametrize("flagfile", sorted(glob.glob(os.path.join(REPO, "configs", "*.flags"))),
                         ids=os.path.basename)
def test_flagfiles_parse_into_valid_sweeps(flagfile):
  code = ("import sys; from absl import flags; from benchmarks import decode as d; "
          "flags.FLAGS(['decode', '--flagfile=' + sys.argv[1]]); s = d.sweep_from_flags(); "
          "print('SWEEP', s.op, len(s.cases), ','.join(s.impls))")
  result = subprocess.run([sys.executable, "-c", code, flagfile], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
  assert "SWEEP" in result.stdout, result.stderr[-2000:]


def test_decode_benchmark_cpu_default_runs_end_to_end():
  result = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--flagfile=configs/cpu_smoke.flags"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "xla_einsum" in result.stdout


def test_step_benchmark_runs():
  cases = [step_bench.StepCase(batch=2, context=40, hidden=32, num_heads=4, num_kv_heads=2, head_dim=16,
                               page_size=8, headroom=4)]
  rows = step_bench.run(cases, ["xla"], iters=2, repeats=1)
  assert np.isfinite(rows[0]["step_us"])  # a timed number (it can be noise around 0 on a CPU)
  assert rows[0]["ran"] == "xla"
