"""Tuned configs: the file round-trips, lookups find near shapes, the backends' config choice uses them."""

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import pallas_kv as pkv
from pallas_kv import tuned
from pallas_kv import validation
from pallas_kv.config import config_type
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "Test GPU 9000"


def _problem(batch, seq_len, page_size=None, heads=(32, 8)):
  q = jax.ShapeDtypeStruct((batch, heads[0], 128), jnp.bfloat16)
  n = jax.ShapeDtypeStruct((batch,), jnp.int32)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((batch, seq_len, heads[1], 128), jnp.bfloat16)
    return validation.validate_dense(q, kv, kv, n)
  pages = jax.ShapeDtypeStruct((batch * seq_len // page_size, page_size, heads[1], 128), jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)
  return validation.validate_paged(q, pages, pages, tables, n)


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  config = pkv.MosaicGPUConfig(block_kv=128, num_stages=3, num_splits=5)
  entries = [dict(backend="mosaic_gpu", key=tuned.shape_key("decode", _problem(8, 8192), "bfloat16"), config=config)]
  path = tmp_path / f"{tuned.device_slug(DEVICE)}.json"
  tuned.write(path, DEVICE, entries)
  yield path, config
  tuned.clear_cache()


def test_tuned_file_round_trips(tuned_file):
  path, config = tuned_file
  data = json.loads(path.read_text())
  assert data["device_kind"] == DEVICE and data["format_version"] == tuned.FORMAT_VERSION
  assert data["entries"][0]["config"] == config.given()   # only the fields the config fixes
  assert pkv.MosaicGPUConfig(**data["entries"][0]["config"]) == config
  found = tuned.lookup("mosaic_gpu", tuned.shape_key("decode", _problem(8, 8192), "bfloat16"), DEVICE)
  assert type(found) is pkv.MosaicGPUConfig and found == config


def test_entries_are_keyed_by_v_layout(tmp_path, monkeypatch):
  """A one-byte cache's entry tuned with v tokens last serves that layout only; an entry written before the
  key had the field serves v laid out like k."""
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  like_k = _problem(8, 8192)
  tokens_last = validation.Problem(**{**like_k.__dict__, "v_tokens_last": True})
  last_config, old_config = pkv.TritonConfig(block_kv=256, num_stages=2), pkv.TritonConfig(block_kv=64, num_stages=4)
  old_key = {k: v for k, v in tuned.shape_key("decode", like_k, "int8").items() if k != "v_tokens_last"}
  tuned.write(tmp_path / f"{tuned.device_slug(DEVICE)}.json", DEVICE,
              [dict(backend="triton", key=tuned.shape_key("decode", tokens_last, "int8"), config=last_config),
               dict(backend="triton", key=old_key, config=old_config)])
  tuned.clear_cache()
  try:
    assert tuned.tuned_config("triton", tokens_last, "int8", DEVICE) == last_config
    assert tuned.tuned_config("triton", like_k, "int8", DEVICE) == old_config
    assert tuned.tuned_config("triton", tokens_last, "float8_e4m3fn", DEVICE) is None
  finally:
    tuned.clear_cache()


def test_an_entry_for_v_as_stored_leaves_persistence_to_the_waves_at_other_sizes(tmp_path, monkeypatch):
  """Served at another size, a V-as-stored entry keeps its tile and ring, not its split count or persistence (the
  default's rule: persistent from three waves of work items); a stream-K entry stays persistent, and a bf16 entry
  keeps what it was tuned with."""
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  last = lambda b, t: validation.Problem(**{**_problem(b, t).__dict__, "v_tokens_last": True})
  as_stored = dict(block_kv=256, num_stages=2, num_splits=1, kv_groups=1, pipeline_qk=False, queries_as_n=True,
                   values_as_stored=True, paired_terms=True, tile_consumers=1, sequence_order="given")
  entries = {"int8": pkv.MosaicGPUConfig(**as_stored, split_plan="per_sequence", persistent=False),
             "float8_e4m3fn": pkv.MosaicGPUConfig(**{**as_stored, "num_splits": 3}, split_plan="stream_k",
                                                  persistent=True)}
  bf16 = pkv.MosaicGPUConfig(block_kv=64, num_stages=4, num_splits=1, split_plan="per_sequence", kv_groups=1,
                             pipeline_qk=True, persistent=True, tile_consumers=1, sequence_order="given")
  tuned.write(tmp_path / f"{tuned.device_slug(DEVICE)}.json", DEVICE,
              [dict(backend="mosaic_gpu", key=tuned.shape_key("decode", last(32, 4096), d), config=c)
               for d, c in entries.items()]
              + [dict(backend="mosaic_gpu", key=tuned.shape_key("decode", _problem(32, 4096), "bfloat16"),
                      config=bf16)])
  tuned.clear_cache()
  resolve = lambda problem, dtype: mgpu_config.resolve_config(problem, None, dtype=jnp.dtype(dtype), num_sms=132,
                                                              device_kind=DEVICE)
  try:
    assert resolve(last(32, 4096), "int8") == entries["int8"]   # where it was tuned: as tuned
    far = resolve(last(128, 4096), "int8")   # 1024 items on 132 SMs: ~8 waves
    assert far.persistent and far.block_kv == 256 and far.values_as_stored, far
    assert not resolve(last(16, 4096), "int8").persistent   # 128 items: one wave
    walked = resolve(last(128, 4096), "float8_e4m3fn")
    assert walked.split_plan == "stream_k" and walked.persistent, walked
    assert resolve(_problem(128, 4096), "bfloat16").persistent   # bf16: as tuned
    assert resolve(_problem(16, 4096), "bfloat16").persistent
  finally:
    tuned.clear_cache()


def test_tuner_times_a_one_byte_cache_as_created(tmp_path):
  """An int8 case is tuned with v tokens last (`cache.default_v_tokens_last`) over the one-byte space, and its
  entry is keyed by that layout."""
  from benchmarks import cases
  from benchmarks import tune
  assert all(c["block_kv"] >= 128 for c in tune.candidate_space("triton", "fast", one_byte=True))
  sweep = cases.Sweep(op="decode", impls=("xla",), cases=((1, 256),), num_heads=4, num_kv_heads=2, head_dim=64,
                      iters=1, repeats=1, warmup=0, kv_dtype="int8")
  case = cases.Case.from_sweep(sweep, 1, 256)
  with pkv.interpret():
    entry = tune.tune_case(case, sweep, "triton", [dict(block_kv=128, num_stages=2)], jax.random.key(0))
  assert entry["key"]["v_tokens_last"] is True and entry["key"]["dtype"] == "int8"
  assert entry["rel_err"] < 1e-2 and entry["config"].block_kv == 128


def test_tuner_takes_mosaic_gpus_one_byte_default():
  """The config a one-byte call runs on Mosaic GPU (the queries as N, which needs V tokens last and per-token
  scales) is a candidate the tuner keeps: were it checked as a bf16 call, every such candidate would be dropped
  unseen, and `auto` would have no Mosaic GPU entry to compare with Triton's."""
  from benchmarks import tune
  for dtype in ("int8", "float8_e4m3fn"):
    problem = validation.Problem(**{**_problem(32, 4096).__dict__, "v_tokens_last": True,
                                    "cache_dtype": jnp.dtype(dtype)})
    config = tune.make_config("mosaic_gpu", problem, tune.TUNED, dtype)
    assert config == mgpu_config.resolve_config(problem, None, dtype=jnp.dtype(dtype)) and config.queries_as_n


def test_tuner_retimes_what_each_backend_runs_in_one_run(tmp_path):
  """--backend=mosaic_gpu,triton --space=tuned: each shape timed on both backends back to back, one candidate
  each, the config a call with no config resolves to; both entries share the shape's key (what `auto` compares)."""
  from benchmarks import cases
  from benchmarks import tune
  sweep = cases.Sweep(op="decode", impls=("xla",), cases=((1, 128),), num_heads=4, num_kv_heads=2, head_dim=64,
                      iters=1, repeats=1, warmup=0)
  out = tmp_path / "cpu.json"
  with pkv.interpret():
    entries = tune.run(sweep, ("mosaic_gpu", "triton"), tune.TUNED, out=out, device_kind="cpu")
  assert [e["backend"] for e in entries] == ["mosaic_gpu", "triton"]
  assert entries[0]["key"] == entries[1]["key"] and all(e["candidates"] == 1 for e in entries)
  problem = validation.Problem(**{**_problem(1, 128, heads=(4, 2)).__dict__, "head_dim": 64})
  assert entries[0]["config"] == mgpu_config.resolve_config(problem, None, device_kind="cpu")
  written = json.loads(out.read_text())["entries"]
  assert {e["backend"] for e in written} == {"mosaic_gpu", "triton"} and all(e["time_us"] > 0 for e in written)


def test_plans_space_is_the_current_config_longest_first_and_the_walk():
  """--space=plans: the config a call runs now, that config with the sequences longest first (its other fields
  kept), and the stream-K walk; Mosaic GPU also the current config's persistent programs longest first; a
  candidate the backend refuses (Triton's walk takes no order) is skipped."""
  from benchmarks import tune
  problem = _problem(16, 32768)
  current = mgpu_config.resolve_config(problem, None)
  tuned_now, longest_first, walk, persistent = (tune.make_config("mosaic_gpu", problem, c, "bfloat16")
                                                for c in tune.candidate_space("mosaic_gpu", tune.PLANS))
  assert tuned_now == current and longest_first == dataclasses.replace(current, sequence_order="longest_first")
  assert walk.split_plan == "stream_k" and walk.pipeline_qk and walk.persistent
  assert persistent == dataclasses.replace(current, pipeline_qk=True, persistent=True, sequence_order="longest_first")
  assert len(tune.candidate_space("triton", tune.PLANS)) == 3
  triton_walk = pkv.TritonConfig(block_kv=64, num_stages=3, split_plan="stream_k", num_splits=33, num_warps=4,
                                 sequence_order="given", merge_in_kernel=False)
  with mock.patch.object(tune.BACKENDS["triton"][1], "resolve_config", return_value=triton_walk):
    assert tune.make_config("triton", problem, dict(over=tune.TUNED, sequence_order="longest_first"),
                            "bfloat16") is None


def test_one_byte_plans_space_keeps_the_one_byte_kernel():
  """--space=plans over a one-byte cache on Mosaic GPU: each candidate is a config of the kernel one-byte calls run
  (the queries as N, V read as stored; int8's terms paired as its default pairs them), per sequence, longest first,
  walked by stream-K, on 128-token tiles, persistent and with twice the splits; none is dropped, and none falls back
  to the 16-bit cache's walk."""
  from benchmarks import tune
  for dtype in ("int8", "float8_e4m3fn"):
    for batch, seq_len in ((1, 32768), (32, 4096)):
      problem = validation.Problem(**{**_problem(batch, seq_len).__dict__, "v_tokens_last": True,
                                      "cache_dtype": jnp.dtype(dtype)})
      current = mgpu_config.resolve_config(problem, None, dtype=jnp.dtype(dtype))
      configs = [tune.make_config("mosaic_gpu", problem, c, dtype)
                 for c in tune.candidate_space("mosaic_gpu", tune.PLANS, one_byte=True)]
      assert None not in configs and configs[0] == current, (dtype, batch, configs)
      assert all(c.queries_as_n and c.values_as_stored and c.paired_terms == current.paired_terms for c in configs)
      plans = [(c.split_plan, c.persistent, c.sequence_order, c.block_kv) for c in configs[1:]]
      assert plans == [("per_sequence", False, "longest_first", 256), ("stream_k", True, "given", 256),
                       ("per_sequence", False, "given", 128), ("per_sequence", True, "given", 256),
                       ("per_sequence", False, "given", 256)], (dtype, batch, plans)
      assert configs[2].num_splits >= 2 and configs[3].num_stages == 4
      assert configs[4] == dataclasses.replace(current, persistent=True)
      assert configs[5] == dataclasses.replace(current, num_splits=2 * current.num_splits)


def _keeps(resolved, config) -> bool:
  """resolved is complete and holds every field config fixes."""
  return resolved.complete and all(getattr(resolved, name) == value for name, value in config.given().items())


def test_explicit_beats_tuned_beats_heuristic(tuned_file):
  _, config = tuned_file
  problem = _problem(8, 8192)
  heuristic = mgpu_config.resolve_config(problem, None, device_kind="Other GPU")
  assert _keeps(mgpu_config.resolve_config(problem, None, device_kind=DEVICE), config)
  explicit = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=7)
  assert _keeps(mgpu_config.resolve_config(problem, explicit, device_kind=DEVICE), explicit)
  # A partial explicit config takes the heuristic's other fields, not the tuned entry's.
  partial = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(num_splits=7), device_kind=DEVICE)
  assert partial.num_splits == 7 and (partial.block_kv, partial.num_stages) == (heuristic.block_kv,
                                                                                heuristic.num_stages)
  # Another device kind has no file: the heuristic decides.
  assert not _keeps(heuristic, config)


def test_nearby_shapes_find_the_entry_and_refit_splits(tuned_file):
  _, config = tuned_file
  near = mgpu_config.resolve_config(_problem(16, 8192), None, device_kind=DEVICE, num_sms=132)
  assert (near.block_kv, near.num_stages) == (config.block_kv, config.num_stages)
  assert near.num_splits != config.num_splits  # refit by the heuristic for the other batch
  far = mgpu_config.resolve_config(_problem(128, 1024), None, device_kind=DEVICE)
  assert far.block_kv != config.block_kv or far.num_stages != config.num_stages
  # Exact fields must match: a paged call does not take a dense entry.
  paged = mgpu_config.resolve_config(_problem(8, 8192, page_size=16), None, device_kind=DEVICE)
  assert (paged.block_kv, paged.num_stages) != (config.block_kv, config.num_stages)


def test_bad_format_version_is_refused(tmp_path, monkeypatch):
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  (tmp_path / "bad_gpu.json").write_text(json.dumps(dict(format_version=99, entries=[])))
  tuned.clear_cache()
  with pytest.raises(ValueError, match="format_version"):
    tuned.lookup("mosaic_gpu", tuned.shape_key("decode", _problem(1, 1024), "bfloat16"), "Bad GPU")
  tuned.clear_cache()


@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_tuner_smoke_writes_a_file_the_config_choice_uses(tmp_path):
  out = tmp_path / "cpu.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.tune", "--smoke", f"--out={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  data = json.loads(out.read_text())
  entry = data["entries"][0]
  assert entry["backend"] == "mosaic_gpu" and entry["rel_err"] < 1e-2
  os.environ[tuned.TUNED_DIR_ENV_VAR] = str(tmp_path)
  try:
    tuned.clear_cache()
    problem = _problem(1, 128, heads=(4, 2))
    problem = validation.Problem(**{**problem.__dict__, "head_dim": 64})
    assert _keeps(mgpu_config.resolve_config(problem, None, device_kind="cpu"), pkv.MosaicGPUConfig(**entry["config"]))
  finally:
    del os.environ[tuned.TUNED_DIR_ENV_VAR]
    tuned.clear_cache()


@pytest.mark.parametrize("faster", ["mosaic_gpu", "triton", None])
def test_auto_picks_the_backend_the_tuned_file_measured_faster(tmp_path, monkeypatch, faster):
  from pallas_kv import api
  from pallas_kv.config import AttentionOptions
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  monkeypatch.setattr(api, "device_can_run", lambda name: True)  # as on a Hopper GPU
  monkeypatch.setattr(api.runtime, "device_kind", lambda: DEVICE)
  problem = _problem(32, 4096)
  key = tuned.shape_key("decode", problem, "bfloat16")
  if faster is not None:
    times = {"mosaic_gpu": 150.0, "triton": 160.0} if faster == "mosaic_gpu" else {"mosaic_gpu": 150.0,
                                                                                   "triton": 140.0}
    tuned.write(tmp_path / f"{tuned.device_slug(DEVICE)}.json", DEVICE,
                [dict(backend=b, key=key, config=config_type(b, "decode")(), time_us=t) for b, t in times.items()])
  tuned.clear_cache()
  try:
    name, _ = api.choose_impl("auto", "decode", problem, AttentionOptions(scale=0.1),
                               (jnp.bfloat16, jnp.bfloat16), None)
  finally:
    tuned.clear_cache()
  assert name == (faster or "triton")  # no tuned times: the preference order, Triton first


@pytest.mark.parametrize("ragged_us,expected", [(None, "mosaic_gpu"), ((310.0, 300.0), "triton"),
                                               ((310.0, 305.0), "mosaic_gpu")])
def test_fastest_backend_counts_the_ragged_batch_and_a_tie_goes_to_mosaic_gpu(tmp_path, monkeypatch, ragged_us,
                                                                             expected):
  """Mosaic GPU 5 µs faster at full lengths (100 / 105 µs): it wins on that alone, loses where its ragged time is
  10 µs slower, and a tie in the total (5 µs slower ragged) goes to it."""
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  key = tuned.shape_key("decode", _problem(16, 32768), "bfloat16")
  entries = [dict(backend="mosaic_gpu", key=key, config={}, time_us=100.0),
             dict(backend="triton", key=key, config={}, time_us=105.0)]
  for entry, t in zip(entries, ragged_us or ()):
    entry["ragged_time_us"] = t
  tuned.write(tmp_path / f"{tuned.device_slug(DEVICE)}.json", DEVICE, entries)
  try:
    assert tuned.fastest_backend(("triton", "mosaic_gpu"), key, DEVICE) == expected
  finally:
    tuned.clear_cache()


def test_merge_replaces_an_entry_written_before_its_key_had_every_field(tmp_path):
  """An entry of an older file (its key without v_tokens_last, then v like k) is the same shape as a new entry
  with v_tokens_last False: the merge replaces it rather than keeping both."""
  from benchmarks import tune
  key = tuned.shape_key("decode", _problem(8, 8192), "bfloat16")
  old_key = {k: v for k, v in key.items() if k != "v_tokens_last"}
  path = tmp_path / "file.json"
  tuned.write(path, DEVICE, [dict(backend="triton", key=old_key, config={}, time_us=90.0),
                             dict(backend="mosaic_gpu", key=old_key, config={}, time_us=80.0)])
  tune.merge(path, DEVICE, [dict(backend="triton", key=key, config={}, time_us=70.0)])
  entries = json.loads(path.read_text())["entries"]
  assert sorted((e["backend"], e["time_us"]) for e in entries) == [("mosaic_gpu", 80.0), ("triton", 70.0)]
  assert tuned.key_id(old_key) == tuned.key_id(key)


def test_mosaic_fast_space_has_the_stream_k_walk_and_a_tuned_entry_keeps_it(tmp_path, monkeypatch):
  """The tuner's Mosaic GPU fast space times the stream-K walk; an entry that won with it is looked up as the
  walk, with the piece cap left to the heuristic at another batch."""
  from benchmarks import tune
  walks = [c for c in tune.candidate_space("mosaic_gpu", "fast") if c.get("split_plan") == "stream_k"]
  assert len(walks) == 2
  problem = _problem(64, 8192)
  configs = [tune.make_config("mosaic_gpu", problem, fields, "bfloat16") for fields in walks]
  assert all(c is not None and c.persistent and c.split_plan == "stream_k" for c in configs)
  tuned.write(tmp_path / f"{tuned.device_slug(DEVICE)}.json", DEVICE,
              [dict(backend="mosaic_gpu", key=tuned.shape_key("decode", problem, "bfloat16"), config=configs[0])])
  monkeypatch.setenv(tuned.TUNED_DIR_ENV_VAR, str(tmp_path))
  tuned.clear_cache()
  try:
    found = mgpu_config.resolve_config(_problem(16, 8192), None, device_kind=DEVICE, num_sms=132)
  finally:
    tuned.clear_cache()
  assert found.split_plan == "stream_k" and found.persistent and found.num_splits == 4
