r"""Autotuner: times kernel configs per shape on this GPU and writes the winners to the tuned file.

  python -m benchmarks tune --flagfile=configs/gqa_h200.flags --backend=mosaic_gpu
  python -m benchmarks tune --flagfile=configs/paged16_h200.flags --backend=mosaic_gpu --space=full
  python -m benchmarks tune --flagfile=configs/gqa_h200.flags --backend=mosaic_gpu,triton --space=tuned

Shapes come from the same flags as benchmarks.decode (--op, --cases, heads, dtype, ...).
Every candidate is checked against the float32 reference before it is timed (on input sets that
rotate past L2, like benchmarks.decode's); a candidate that
fails, does not fit or raises is skipped. Candidates are fields of the backend's config type
(`pallas_kv.TritonConfig`, `MosaicGPUConfig`), the backend filling the rest; an entry holds the
complete config that won. Winners are merged into
`pallas_kv/tuned/<device kind>.json` (or --out), keyed so that nearby shapes find them
(`pallas_kv.tuned`). `--smoke` tunes a tiny case in interpret mode on a CPU (tests).

`auto` takes, per shape, the backend whose entry measured fastest (`tuned.fastest_backend`), so both backends'
times should come from one run: `--backend=mosaic_gpu,triton` tunes each shape on both, back to back, and
`--space=tuned` re-times only the config each backend runs now (`resolve_config` with no config given), and
`--space=plans` that config, that config with the sequences longest first, and the stream-K walk (Mosaic GPU: also
that config's persistent programs, longest first; over one-byte caches, the walk on the default's tiles, the
default on 128-token tiles, persistent, and with twice its splits instead). Candidates
are scored on full and ragged lengths (`--score_ragged`, on by default): serving batches are ragged.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import pathlib
from collections.abc import Iterable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import cli
from benchmarks import peers
from benchmarks import timing
import pallas_kv as pkv
from pallas_kv import cache as pkv_cache
from pallas_kv import runtime
from pallas_kv import tuned
from pallas_kv import validation
from pallas_kv.config import KernelConfig
from pallas_kv.kernels.mosaic_gpu import config as mosaic_gpu_config
from pallas_kv.kernels.triton import config as triton_config

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The shape flags of benchmarks.decode (`cli.define_sweep_flags`) and the tuner's own."""
  cli.define_sweep_flags()
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_list("backend", ["mosaic_gpu"], f"backends to tune ({', '.join(BACKENDS)}); several: each "
                    "shape on each, back to back")
  flags.register_validator("backend", lambda names: bool(names) and set(names) <= set(BACKENDS),
                           f"--backend takes one or more of {', '.join(BACKENDS)}")
  flags.DEFINE_enum("space", "fast", ["smoke", TUNED, PLANS, "fast", "full"],
                    f"candidate space; {TUNED}: the config each backend runs now, re-timed; {PLANS}: that, that "
                    "with the sequences longest first, and the stream-K walk (Mosaic GPU: and persistent programs "
                    "longest first)")
  flags.DEFINE_bool("score_ragged", True, "time each candidate on ragged lengths too (uniform in [S, T]) and "
                    "keep the least total time: serving batches are ragged")
  flags.DEFINE_string("out", None, "tuned file to merge into (default: the device kind's file)")
  flags.DEFINE_bool("smoke", False, "tiny case in interpret mode (CPU)")


def candidate_space(backend: str, space: str, *, one_byte: bool = False) -> list[dict]:
  """Config fields to try (of the backend's config type, `BACKENDS`) on a cache of 16-bit or, with one_byte,
  one-byte values; split_scale scales the heuristic's split count."""
  if space == "smoke":
    return [dict(block_kv=64, num_stages=2), dict(block_kv=64, num_stages=3)]
  if space == TUNED:
    return [TUNED]
  if space == PLANS:   # the config a call runs now, that with the sequences longest first, and the stream-K walk
    plans = [TUNED, dict(over=TUNED, sequence_order="longest_first")]
    if backend == "triton":
      return plans + [dict(split_plan="stream_k")]
    if one_byte:   # the default's V as stored, walked by stream-K; and on 128-token tiles (a ragged row's last
      # tile half the waste), 4 stages; persistent programs (an entry tuned before int8's P split moved was not);
      # twice the splits (a ragged row's longest sequences shared by more programs, as Triton's B8 entry has)
      return plans + [dict(split_plan="stream_k", persistent=True, queries_as_n=True, values_as_stored=True,
                           block_kv=256),
                      dict(over=TUNED, block_kv=128, num_stages=4), dict(over=TUNED, persistent=True),
                      dict(over=TUNED, split_scale=2)]
    # persistent programs longest first: its best ragged B128 (thirtieth set)
    return plans + [dict(split_plan="stream_k", pipeline_qk=True),
                    dict(over=TUNED, pipeline_qk=True, persistent=True, sequence_order="longest_first")]
  if backend == "triton" and space == "fast" and one_byte:   # 12 candidates, for v stored tokens last
    # 128-token tiles won at every batch and 256-token ones came within 2% at B128 (RESULTS.md, seventh set).
    tiles = [dict(block_kv=128, num_stages=n) for n in (2, 3, 4)] + [dict(block_kv=256, num_stages=2)]
    return [dict(tile, split_scale=scale) for tile in tiles for scale in (0.5, 1, 2)]
  if backend == "triton" and space == "fast":  # 12 candidates: ~1.5 minutes per shape on an H200
    # 128-token tiles and half the heuristic's splits won at B1 and B128 on the H200
    # (benchmarks/RESULTS.md, 2026-11-30 fourth set); 32-token tiles came within 1% of them at B32 and B128.
    grid = dict(block_kv=(64, 128), num_stages=(2, 3), split_scale=(0.5, 1, 2))
  elif backend == "triton":
    grid = dict(block_kv=(32, 64, 128), num_stages=(2, 3, 4), num_warps=(4, 8), split_scale=(0.5, 1, 2))
  elif space == "fast":
    # What moved the time on the H200 (benchmarks/NOTES.md): the consumer overlap, the
    # persistent grid and the split count; stages and 128-token tiles did not. Two tile consumers: the
    # consumer's serial math is what the full kernel loses against its loads alone at B32 and B64.
    grid = dict(pipeline_qk=(False, True), persistent=(False, True), split_scale=(0.5, 1), tile_consumers=(1, 2))
  else:
    grid = dict(block_kv=(64, 128), num_stages=(2, 3, 4), split_scale=(0.5, 1, 2), pipeline_qk=(False, True),
                kv_groups=(1, 2), tile_consumers=(1, 2))
  names = list(grid)
  candidates = [dict(zip(names, values)) for values in itertools.product(*grid.values())]
  if backend == "mosaic_gpu":
    # The stream-K walk (persistent programs, equal shares) with the consumer overlap, one or two tile consumers.
    candidates += [dict(split_plan="stream_k", pipeline_qk=True, tile_consumers=n) for n in (1, 2)]
  return candidates


BACKENDS = {"mosaic_gpu": (pkv.MosaicGPUConfig, mosaic_gpu_config), "triton": (pkv.TritonConfig, triton_config)}
# The candidate that stands for the config a call with no config resolves to now (tuned entry, else heuristic).
TUNED = "tuned"
PLANS = "plans"


def make_config(backend: str, problem, fields: dict | str, dtype) -> KernelConfig | None:
  """The complete config (the backend's type) that a candidate's fields resolve to, with its split
  count scaled by split_scale, or None if it is invalid for this problem; `TUNED`: the config a call
  with no config runs (`over=TUNED` among the fields: that config with the other fields replaced).

  The backend fills what the candidate leaves out (`resolve_config`: its heuristic, around the
  given fields). Triton candidates take per-sequence splits unless they name a plan: the tuner
  times tiles, stages, warps and split counts, and the stream-K plan is the heuristic's own
  choice where it pays (`triton_config.stream_k_pays`, which a lookup still applies).
  """
  config_type, module = BACKENDS[backend]
  fields = {"over": TUNED} if fields == TUNED else dict(fields)
  over_tuned = fields.pop("over", None) == TUNED
  scale = fields.pop("split_scale", 1)
  if backend == "triton" and not over_tuned:
    fields.setdefault("split_plan", "per_sequence")
  names = {f.name for f in dataclasses.fields(config_type)}
  fields = {k: v for k, v in fields.items() if k in names}  # fields this backend's kernel does not take
  try:
    if over_tuned:   # the config a call runs now, these fields replaced
      config = dataclasses.replace(module.resolve_config(problem, None, dtype=dtype), **fields)
    else:
      config = module.resolve_config(problem, config_type(**fields), dtype=dtype)
    config = dataclasses.replace(config, num_splits=max(1, int(round(config.num_splits * scale))))
    if backend == "mosaic_gpu":   # checked as the call checks it: a one-byte cache's layout and scales too
      quantized = {}
      if jnp.dtype(dtype).itemsize == 1:   # the benchmarks' one-byte caches carry per-token scales (`cases`)
        quantized = dict(k_scale_kind="token", v_scale_kind="token", num_kv_heads=problem.num_kv_heads,
                         v_tokens_last=problem.v_tokens_last)
      mosaic_gpu_config.check_config(config, rows=problem.num_queries * problem.group_size,
                                     head_dim=problem.head_dim, dtype=dtype, page_size=problem.page_size,
                                     num_splits=config.num_splits, **quantized)
    else:
      triton_config.check_config(config, head_dim=problem.head_dim, page_size=problem.page_size)
    return config
  except (ValueError, NotImplementedError):
    return None


def _problem(case: cases.Case, args: tuple, tokens_last: bool):
  """The validated shape of the op's own arguments (a quantized case's scales follow them)."""
  if case.op == "decode":
    return validation.validate_dense(*args[:4], v_tokens_last=tokens_last)
  return validation.validate_paged(*args[:5], v_tokens_last=tokens_last)



@dataclasses.dataclass(frozen=True)
class _Batch:
  """One batch of the case the candidates are timed on: its rotating input sets, reference and bytes."""
  name: str            # "full" or "ragged"
  input_sets: list
  ref: np.ndarray
  kv_bytes: float


def _batch(case: cases.Case, sweep: cases.Sweep, key, tokens_last: bool) -> _Batch:
  lengths = cases.make_lengths(case, key)
  kv_bytes = case.costs(case.attended_keys(lengths))["kv_bytes"]
  # Calls rotate among input sets that together overflow L2, as in benchmarks.decode: a small
  # case timed on one set reads its cache from L2 and would crown the wrong config.
  num_sets = timing.num_rotating_sets(case.rotation_bytes(kv_bytes), sweep.rotate_bytes)
  input_sets = cases.make_input_sets(case, key, lengths, num_sets)
  ref, _ = cases.reference_output(case, input_sets[0])
  if tokens_last:
    input_sets = [cases.with_v_tokens_last(args) for args in input_sets]
  return _Batch("ragged" if case.ragged else "full", input_sets, ref, kv_bytes)


def case_batches(case: cases.Case, sweep: cases.Sweep, key, *, score_ragged: bool = False) -> list[_Batch]:
  """The batches a case's candidates are timed on: its own lengths and, with score_ragged (a case of full
  lengths), the same shape with lengths uniform in [S, T]. Built once a case, whatever the backends."""
  # The layout a cache of this dtype is created in (one-byte caches: v tokens last), which is what calls read.
  tokens_last = pkv_cache.default_v_tokens_last(case.kv_dtype or case.dtype)
  batches = [_batch(case, sweep, key, tokens_last)]
  if score_ragged and not case.ragged:
    batches.append(_batch(dataclasses.replace(case, ragged=True), sweep, key, tokens_last))
  return batches


def tune_case(case: cases.Case, sweep: cases.Sweep, backend: str, candidates: Iterable[dict], key, *,
              score_ragged: bool = False, batches: list[_Batch] | None = None) -> dict | None:
  """Times every valid candidate on one case; returns the winning entry (or None): its config the
  complete config that was timed (`tuned.write` writes its fields).

  score_ragged (a case of full lengths): each candidate is also timed on the same shape with lengths uniform in
  [S, T], as serving batches are, and the winner is the least total time; the entry holds both
  (`ragged_time_us`), which `tuned.fastest_backend` compares. batches: `case_batches`, if already built.
  """
  cache_dtype = case.kv_dtype or case.dtype   # tuned entries are keyed by the cache's dtype and v's layout
  tokens_last = pkv_cache.default_v_tokens_last(cache_dtype)   # as `case_batches` laid the inputs out
  batches = batches or case_batches(case, sweep, key, score_ragged=score_ragged)
  args = batches[0].input_sets[0]
  problem = _problem(case, args, tokens_last)
  op = {"decode": pkv.decode_attention, "paged": pkv.paged_decode_attention}[case.op]
  op = functools.partial(op, v_tokens_last=True) if tokens_last else op
  seen, results = set(), []
  for fields in candidates:
    config = make_config(backend, problem, fields, cache_dtype)
    if config is None or config in seen:
      continue
    seen.add(config)
    fn = jax.jit(peers.with_options(functools.partial(op, impl=backend, config=config), cases.op_spec(case)))
    try:
      errs = [cases.relative_error(np.asarray(fn(*batch.input_sets[0]), np.float32), batch.ref) for batch in batches]
      if not max(errs) <= cases.TOLERANCE[case.dtype]:
        print(f"  {config.given()}: rel err {max(errs):.2e} fails the check; skipped", flush=True)
        continue
      seconds = [timing.time_jax(fn, batch.input_sets, warmup=sweep.warmup, iters=sweep.iters,
                                 repeats=sweep.repeats).median_s for batch in batches]
    except (ValueError, NotImplementedError) as e:
      print(f"  {config.given()}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
      continue
    results.append((sum(seconds), seconds, config, max(errs)))
    times = "  ".join(f"{batch.name} {t * 1e6:8.1f} us" for batch, t in zip(batches, seconds))
    print(f"  {times}  err {max(errs):.1e}  {config.given()}", flush=True)
  if not results:
    return None
  _, seconds, best, err = min(results, key=lambda r: r[0])
  entry = dict(backend=backend, key=tuned.shape_key(case.op, problem, cache_dtype), config=best,
               time_us=seconds[0] * 1e6, tbps=batches[0].kv_bytes / seconds[0] / 1e12, rel_err=err,
               candidates=len(results))
  if len(batches) == 2:
    entry["ragged_time_us"] = seconds[1] * 1e6
  return entry


def merge(path: pathlib.Path, device_kind: str, new_entries: Sequence[dict]) -> None:
  """Writes new entries into the tuned file, replacing those with the same backend and key."""
  old = []
  if path.exists():
    old = json.loads(path.read_text())["entries"]
  replaced = {(e["backend"], tuned.key_id(e["key"])) for e in new_entries}
  kept = [e for e in old if (e["backend"], tuned.key_id(e["key"])) not in replaced]
  tuned.write(path, device_kind, kept + list(new_entries), jax_version=jax.__version__)


def run(sweep: cases.Sweep, backends: str | Sequence[str], space: str, out: pathlib.Path | None = None,
        device_kind: str | None = None, score_ragged: bool = False) -> list[dict]:
  """Tunes every case of the sweep on each backend in turn (the same inputs) and merges the winners."""
  backends = (backends,) if isinstance(backends, str) else tuple(backends)
  device_kind = device_kind or runtime.device_kind()
  out = out or tuned.tuned_dir() / f"{tuned.device_slug(device_kind)}.json"
  entries = []
  key = jax.random.key(sweep.seed)
  for batch, seq_len in sweep.cases:
    key, case_key = jax.random.split(key)
    case = cases.Case.from_sweep(sweep, batch, seq_len)
    one_byte = jnp.dtype(case.kv_dtype or case.dtype).itemsize == 1
    batches = case_batches(case, sweep, case_key, score_ragged=score_ragged)   # inputs and reference, once
    for backend in backends:
      print(f"== {case.describe()}  backend={backend}", flush=True)
      entry = tune_case(case, sweep, backend, candidate_space(backend, space, one_byte=one_byte), case_key,
                        batches=batches)
      if entry is None:
        continue
      entries.append(entry)
      print(f"  best: {entry['config'].given()}  {entry['time_us']:.1f} us  {entry['tbps']:.2f} TB/s", flush=True)
      merge(out, device_kind, [entry])  # after every shape: a run cut short keeps what it finished
  print(f"# wrote {len(entries)} entries to {out}", flush=True)
  return entries


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out) if FLAGS.out else None
  if FLAGS.smoke:
    sweep = cases.Sweep(op="decode", impls=("xla",), cases=((1, 128),), num_heads=4, num_kv_heads=2, head_dim=64,
                        iters=1, repeats=1, warmup=0)
    with pkv.interpret():
      run(sweep, FLAGS.backend, "smoke", out)
    return
  sweep = cli.sweep_from_flags()
  if sweep.length is not None:   # an entry is keyed by its capacity: timed at full lengths (and ragged ones)
    raise app.UsageError(f"--length={sweep.length}: the tuner times full and ragged lengths, not one length")
  run(sweep, FLAGS.backend, FLAGS.space, out, score_ragged=FLAGS.score_ragged)


if __name__ == "__main__":
  define_flags()
  app.run(main)
