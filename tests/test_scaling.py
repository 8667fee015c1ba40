"""benchmarks.scaling: the CPU smoke run over 8 host devices end to end, and its mesh splits (shards.py)."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import scaling  # noqa: E402  (defines no flags on import)
from benchmarks import shards  # noqa: E402

SMOKE_DEVICE_COUNTS = {1, 2, 4, 8}


def _smoke_env():
  """The CPU platform with no preset host device count, so --smoke asks for 8."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  xla_flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(scaling.DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(xla_flags)
  env.pop("NCCL_NVLS_ENABLE", None)
  return env


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_smoke_run_checks_and_times_every_device_count_and_mesh(tmp_path):
  json_path = tmp_path / "rows.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--smoke", f"--json={json_path}"],
                          capture_output=True, text=True, cwd=REPO, env=_smoke_env(), timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  rows = json.loads(json_path.read_text())
  assert {r["devices"] for r in rows} == SMOKE_DEVICE_COUNTS
  assert rows[0]["device"] == "cpu:cpu x8" and rows[0]["nccl_nvls_enable"] == "0"
  attention = [r for r in rows if r["kind"] == "attention"]
  comm = [r for r in rows if r["kind"] == "comm"]
  # 1x1; 2x1, 1x2; 4x1, 1x4, 2x2; 8x1, 1x8, 4x2 — each with its comm row.
  assert sorted(r["mesh"] for r in attention) == sorted(["1x1", "2x1", "1x2", "4x1", "1x4", "2x2", "8x1", "1x8", "4x2"])
  assert [r["mesh"] for r in comm] == [r["mesh"] for r in attention]
  for row in rows:
    assert row["status"] == "ok", row
    assert row["check_ok"] is True and row["rel_err"] <= row["check_tolerance"], row
    assert math.isfinite(row["time_us"]) and row["time_us"] >= 0, row
  for row in attention:
    assert row["impl"] == row["ran"] == "xla"
    assert row["time_us"] > 0 and math.isfinite(row["tbps"]) and math.isfinite(row["speedup"])
    assert row["tbps_per_gpu"] == row["tbps"] / row["devices"]
    assert row["kv_bytes"] == row["batch"] * row["context"] * row["num_kv_heads"] * row["head_dim"] * 2 * 2
    assert math.isfinite(row["gather_us"])
  for row in comm:
    assert row["replicated"] and (row["time_us"] > 0) == (row["devices"] > 1)
  # The table prints last.
  assert result.stdout.rstrip().splitlines()[-1].startswith("# wrote 18 rows")
  assert result.stdout.count(scaling.HEADER) == 2


def test_mesh_splits_follow_the_head_count():
  specs = [shards.parse_mesh(m) for m in shards.MESH_NAMES]
  assert shards.default_device_counts(8) == (1, 2, 4, 8)
  assert shards.default_device_counts(6) == (1, 2, 4)
  assert shards.mesh_splits(1, specs, 8) == [(1, 1)]
  assert shards.mesh_splits(8, specs, 8) == [(8, 1), (1, 8), (4, 2)]
  assert shards.mesh_splits(8, specs, 2) == [(8, 1), (4, 2)]  # head shards divide the kv heads
  assert shards.mesh_splits(16, specs, 8) == [(16, 1), (4, 4)]
  assert shards.mesh_splits(4, [(2, 2), (2, 4)], 8) == [(2, 2)]  # explicit splits of other counts are left out
