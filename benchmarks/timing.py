"""Timing for the decode benchmarks, without a profiler: device time, and a user's host loop.

JAX impls ("chain-diff"): host dispatch of one jitted call costs tens of µs (66-96 µs
measured on the H200 machine here for a 4-argument jit), as much as a whole decode
step at batch 1, so a host-timed loop of calls measures dispatch, not the kernel.
Instead, one jitted program runs the op N times in a row, each call's inputs passed
through `lax.optimization_barrier` together with the previous call's output (so
XLA can neither merge identical calls nor overlap them, and nothing is copied),
rotating among the input sets. Such a program takes about c + N * t on the host
clock (c: dispatch and sync, paid once). Each sample times a chain of N = `iters`
calls and one of 2N back to back and takes t = (T_2N - T_N) / N, which cancels c.
The result is the median over `repeats` samples.

The dispatch of a chain is not a fixed c: on the H200 it grew by 15-35 µs per call in the
chain, and the GPU finished later by about that much (B32 T4096: the GPU was busy 123 µs per
call by the profiler while T_2N - T_N read 133-137). So on accelerators each chain runs
queued behind a lead run (the long chain): its host dispatch happens while the device still
works on the lead, and the clock starts when the lead's results are ready, so it reads the
chain's device time plus a constant wake-up. A sample whose dispatch outlasted the lead (the
device idled) is kept but marks the result's method "chain-diff+dispatch".

Compilation and `warmup` runs of both chains come first. Host jitter on the two wall-clock readings is ~0.1 ms, so a
short chain of a fast op (20 calls of 45 µs = 0.9 ms) gives samples ±10% apart; the
chain is therefore lengthened until it runs for `MIN_CHAIN_S` of device time (from
one pilot sample), up to `MAX_CHAIN_CALLS` calls.

torch ("cuda-events"): CUDA events around a loop of `iters` calls, per repeat;
the median. Such a loop is host-bound if enqueueing a call takes about as long
as running it; the row says so.

Host loop ("host-loop", JAX and torch): what a user's Python loop of separate calls sees, host
dispatch included: `iters` calls in a loop, one wait for the device at the end, wall clock per
call, median over `repeats` loops (lengthened on accelerators to `MIN_LOOP_S`, as the chain is).
The chain hides dispatch, so it cannot see an op whose host cost per call exceeds its device
time (a pallas_kv call once cost ~250 µs in such a loop against ~80 µs for cuDNN through
jax.jit, unseen by the chain); the decode benchmark reports both.

Rotating among input sets keeps a small KV cache from being served from L2
(~60 MB on an H200): `num_rotating_sets` picks how many sets to make.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

# L2 cache of an H200 is ~60 MB; rotate through at least 3x that.
L2_BYTES = 60e6
DEFAULT_ROTATE_BYTES = 3 * L2_BYTES
MAX_ROTATING_SETS = 64
# Shortest device time of the short chain, and the most calls one chain may hold
# (each call is a call site in the compiled program, so compile time grows with it).
MIN_CHAIN_S = 5e-3
MAX_CHAIN_CALLS = 128
# A torch loop whose enqueue time is above this fraction of the sample is host-bound.
HOST_BOUND_FRACTION = 0.8
# Shortest host-loop sample on accelerators (so the one wait at its end is a small part of it),
# and the most calls one loop may hold.
MIN_LOOP_S = 5e-3
MAX_LOOP_CALLS = 1024
HOST_LOOP = "host-loop"


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-call time in seconds (device time, or wall time in a host loop), and how it was measured."""

  median_s: float
  min_s: float
  samples_s: tuple[float, ...]
  # "chain-diff" (JAX), "chain-diff+dispatch" (JAX, some dispatch not hidden), "chain" (JAX,
  # fallback), "cuda-events" or "host-loop"
  method: str
  # chain-diff: fixed cost of one dispatch + sync; cuda-events: enqueue time per call; host-loop: 0.
  overhead_s: float
  host_bound: bool = False
  calls: int = 0  # calls per short chain (chain-diff) or per timed loop (cuda-events, host-loop)


def num_rotating_sets(bytes_per_set: float, rotate_bytes: float,
                      max_sets: int = MAX_ROTATING_SETS) -> int:
  """How many input sets to rotate among so that together they overflow L2.

  `rotate_bytes` is the least total size of the sets (0 turns rotation off).
  """
  if rotate_bytes <= 0 or bytes_per_set <= 0:
    return 1
  return max(1, min(max_sets, math.ceil(rotate_bytes / bytes_per_set)))


def _check_counts(arg_sets: Sequence[tuple], iters: int, repeats: int) -> None:
  if not arg_sets:
    raise ValueError("arg_sets must hold at least one input set")
  if iters < 1:
    raise ValueError(f"{iters=} must be >= 1")
  if repeats < 1:
    raise ValueError(f"{repeats=} must be >= 1")


def chain(fn: Callable[..., Any], num_calls: int) -> Callable[[list], list]:
  """fn applied `num_calls` times in sequence, rotating over a list of arg sets."""

  def run(arg_sets):
    outs = []
    for i in range(num_calls):
      args = arg_sets[i % len(arg_sets)]
      if outs:
        # Depend on the previous call. The barrier's copy of that output replaces it in the
        # results: were it unused, XLA would drop it from the barrier, and the barriers (now
        # over the same inputs) and the calls behind them would merge into one.
        args, outs[-1] = lax.optimization_barrier((args, outs[-1]))
      outs.append(fn(*args))
    return outs

  return run


def _wall(fn: Callable[[list], Any], arg_sets: list) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(arg_sets))
  return time.perf_counter() - t0


def _queued_wall(fn: Callable[[list], Any], arg_sets: list, lead: Callable[[list], Any]) -> tuple[float, bool]:
  """Wall time of one run of fn queued behind a run of `lead`, timed from when lead's results are
  ready; and whether fn's dispatch was over by then (so the time holds no dispatch)."""
  lead_out = lead(arg_sets)
  out = fn(arg_sets)
  hidden = not jax.tree.leaves(lead_out)[-1].is_ready()   # the lead's last call still running
  jax.block_until_ready(lead_out)
  t0 = time.perf_counter()
  jax.block_until_ready(out)
  return time.perf_counter() - t0, hidden


def chain_length(per_call_s: float, iters: int, *, min_chain_s: float = MIN_CHAIN_S,
                 max_calls: int = MAX_CHAIN_CALLS) -> int:
  """Calls per short chain: at least `iters`, more while the chain is shorter than `min_chain_s`."""
  if per_call_s <= 0 or iters * per_call_s >= min_chain_s:
    return iters
  return max(iters, min(max_calls, math.ceil(min_chain_s / per_call_s)))


def _compile_chains(fn, arg_sets, iters):
  with warnings.catch_warnings():  # deprecated peers warn while lowering
    warnings.simplefilter("ignore", DeprecationWarning)
    short = jax.jit(chain(fn, iters)).lower(arg_sets).compile()
    long = jax.jit(chain(fn, 2 * iters)).lower(arg_sets).compile()
  return short, long


def time_jax(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int,
             iters: int, repeats: int, min_chain_s: float | None = None,
             queued: bool | None = None) -> Timing:
  """Device time of `fn(*args)` (a traceable JAX function) by chain differences.

  `iters` is the least number of calls per short chain; it grows (see module doc) when the
  chain would run for less than `min_chain_s` (default: `MIN_CHAIN_S` on accelerators, 0 =
  fixed on CPU, where interpret-mode calls are slow and compiles are what cost). `queued`
  (default: on accelerators) times each chain behind a lead run so that its dispatch is hidden.
  """
  _check_counts(arg_sets, iters, repeats)
  on_cpu = jax.default_backend() == "cpu"
  if min_chain_s is None:
    min_chain_s = 0.0 if on_cpu else MIN_CHAIN_S
  if queued is None:
    queued = not on_cpu
  arg_sets = list(arg_sets)

  def compile_and_warm_up(iters):
    short, long = _compile_chains(fn, arg_sets, iters)
    for _ in range(max(1, warmup)):
      jax.block_until_ready((short(arg_sets), long(arg_sets)))
    return short, long

  short, long = compile_and_warm_up(iters)
  pilot = (_wall(long, arg_sets) - _wall(short, arg_sets)) / iters
  longer = chain_length(pilot, iters, min_chain_s=min_chain_s)
  if longer != iters:
    # Warmed up again: the GPU idles (and clocks down) while the longer chains compile; with a
    # single run the first sample came out 1.5-3x slow on the H200 (benchmarks/results, 2026-11-29).
    iters = longer
    short, long = compile_and_warm_up(iters)
  diffs, overheads, longs = [], [], []
  all_hidden = True
  for _ in range(repeats):
    if queued:
      (t_short, hidden_short), (t_long, hidden_long) = (_queued_wall(short, arg_sets, long),
                                                        _queued_wall(long, arg_sets, long))
      all_hidden = all_hidden and hidden_short and hidden_long
    else:
      t_short, t_long = _wall(short, arg_sets), _wall(long, arg_sets)
    per_call = (t_long - t_short) / iters
    diffs.append(per_call)
    overheads.append(t_short - iters * per_call)
    longs.append(t_long / (2 * iters))
  if statistics.median(diffs) > 0:
    method = "chain-diff" if all_hidden else "chain-diff+dispatch"
    return _summarize(diffs, method, statistics.median(overheads), iters)
  # Too noisy to difference (tiny CPU cases): per-call time of the long chain,
  # an upper bound that includes the dispatch cost.
  return _summarize(longs, "chain", 0.0, iters)


def time_torch(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int,
               iters: int, repeats: int) -> Timing:
  """Device time of a torch CUDA `fn(*args)` with CUDA events around loops."""
  import torch  # pylint: disable=g-import-not-at-top

  _check_counts(arg_sets, iters, repeats)
  n = len(arg_sets)
  for i in range(max(1, warmup)):
    fn(*arg_sets[i % n])
  torch.cuda.synchronize()
  samples, enqueues = [], []
  k = 0
  for _ in range(repeats):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
      fn(*arg_sets[k % n])
      k += 1
    end.record()
    t1 = time.perf_counter()
    end.synchronize()
    samples.append(start.elapsed_time(end) * 1e-3 / iters)
    enqueues.append((t1 - t0) / iters)
  enqueue = statistics.median(enqueues)
  timing = _summarize(samples, "cuda-events", enqueue, iters)
  return dataclasses.replace(
      timing, host_bound=enqueue > HOST_BOUND_FRACTION * timing.median_s)


TIMERS: dict[str, Callable[..., Timing]] = {"jax": time_jax, "torch": time_torch}


def _time_host_loop(fn: Callable[..., Any], arg_sets: Sequence[tuple], wait: Callable[[Any], Any], *,
                    warmup: int, iters: int, repeats: int, min_loop_s: float) -> Timing:
  """Wall time per call of loops of `fn` calls, each loop ended by one `wait(last output)`."""
  _check_counts(arg_sets, iters, repeats)
  num_sets = len(arg_sets)
  calls_made = 0

  def per_call_s(num_calls: int) -> float:
    nonlocal calls_made
    t0 = time.perf_counter()
    for _ in range(num_calls):
      out = fn(*arg_sets[calls_made % num_sets])
      calls_made += 1
    wait(out)
    return (time.perf_counter() - t0) / num_calls

  per_call_s(max(1, warmup))  # compiles on a first call
  if min_loop_s > 0:
    iters = chain_length(per_call_s(iters), iters, min_chain_s=min_loop_s,
                         max_calls=max(iters, MAX_LOOP_CALLS))
  samples = [per_call_s(iters) for _ in range(repeats)]
  return _summarize(samples, HOST_LOOP, 0.0, iters)


def user_jitted(fn: Callable[..., Any]) -> Callable[..., Any]:
  """fn as a user calls it in a loop: jitted, else wrapped in `jax.jit` as a user would.

  pallas_kv's runners, xla_einsum and cudnn are jitted; the jax_pallas_* peers wrap their jitted
  function in a warning filter (a Python wrapper), so they are jitted here (compiled once more).
  """
  return fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)


def time_host_loop_jax(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int, iters: int,
                       repeats: int, min_loop_s: float | None = None) -> Timing:
  """Wall time per call of a Python loop of jitted `fn` calls, host dispatch included.

  The loop blocks once, on its last output: calls on one device run in the order dispatched.
  `min_loop_s` defaults to `MIN_LOOP_S` on accelerators, 0 (loops of `iters` calls) on CPU.
  """
  if min_loop_s is None:
    min_loop_s = 0.0 if jax.default_backend() == "cpu" else MIN_LOOP_S
  with warnings.catch_warnings():  # deprecated peers warn while lowering
    warnings.simplefilter("ignore", DeprecationWarning)
    return _time_host_loop(user_jitted(fn), list(arg_sets), jax.block_until_ready, warmup=warmup,
                           iters=iters, repeats=repeats, min_loop_s=min_loop_s)


def time_host_loop_torch(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int, iters: int,
                         repeats: int, min_loop_s: float = MIN_LOOP_S) -> Timing:
  """Wall time per call of a Python loop of torch CUDA `fn` calls, one synchronize at its end."""
  import torch  # pylint: disable=g-import-not-at-top

  return _time_host_loop(fn, list(arg_sets), lambda out: torch.cuda.synchronize(), warmup=warmup,
                         iters=iters, repeats=repeats, min_loop_s=min_loop_s)


HOST_LOOP_TIMERS: dict[str, Callable[..., Timing]] = {"jax": time_host_loop_jax, "torch": time_host_loop_torch}


def _summarize(samples: Sequence[float], method: str, overhead_s: float, calls: int) -> Timing:
  return Timing(median_s=statistics.median(samples), min_s=min(samples),
                samples_s=tuple(samples), method=method, overhead_s=overhead_s, calls=calls)
