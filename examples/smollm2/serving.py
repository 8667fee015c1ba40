"""Continuous batching: a fixed number of slots that requests enter and leave at any step.

Each engine step (host side):
  1. finished requests give their pages back (`pallas_kv.release_sequences`) and free their slot;
  2. waiting requests are admitted, first come first served, while a slot is free and the page
     budget allows: each is prefilled alone, right-padded to a prompt-length bucket, into its slot
     (its prompt's pages reserved first), which samples its first token;
  3. one decode step runs every slot (idle ones masked): a page is reserved where a sequence's next
     token starts one (`pallas_kv.reserve_pages`), the model appends and attends, and each active
     slot samples its next token.
The jitted functions take fixed shapes (slots, pages, bucket lengths), so requests coming and
going never recompile: `TRACE_COUNTS` counts their traces.

Pages: a request is admitted only when the pool can hold its whole worst case (prompt + new
tokens) beside the worst cases of the running requests. Pages are still taken step by step and
returned as soon as a request ends, but a reservation can then never fail mid-generation: when
the pool is short, requests wait in the queue (never crash, never overwrite another's pages).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from examples.smollm2 import sampling
from examples.smollm2.model import KVPages
from examples.smollm2.model import Llama

TRACE_COUNTS = collections.Counter()  # traces of each jitted function (a trace precedes a compile)
MIN_BUCKET = 16


@dataclasses.dataclass
class Request:
  """A generation request; the engine fills in the fields after `arrival`."""
  prompt_ids: list[int]
  max_new_tokens: int
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  ignore_eos: bool = False  # generate max_new_tokens even past EOS
  arrival: int = 0  # the engine step at which `Engine.run` submits it
  output_ids: list[int] = dataclasses.field(default_factory=list)
  admitted_step: int | None = None
  finished_step: int | None = None
  finish_reason: str | None = None  # "eos" or "length"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
  """What lives on the device: the pages of every layer, one block table and length per slot, the pool."""
  pages: KVPages
  tables: jax.Array  # int32 [slots, max_pages_per_seq]
  lengths: jax.Array  # int32 [slots]
  pool: pkv.PagePool


def reserve_prompt(pool, table, length, page_size: int):
  """Reserves the pages of a length-token prompt for one empty sequence (table [1, M]), all or nothing.

  One page per `reserve_pages` call, so the prompt's length may be a traced value.
  """
  needed = (length + page_size - 1) // page_size
  ok = (needed <= pool.num_free) & (needed <= table.shape[1])

  def one_page(i, carry):
    pool, table = carry
    pool, table, _ = pkv.reserve_pages(pool, table, (i * page_size)[None], num_new=page_size, page_size=page_size)
    return pool, table

  pool, table = jax.lax.fori_loop(0, jnp.where(ok, needed, 0), one_page, (pool, table))
  return pool, table, ok


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def prefill_slot(model: Llama, params, state: SlotState, tokens, length, slot, sampling_args):
  """Prefills tokens [1, bucket] (length real ones) into an empty slot; returns (state, first token, ok)."""
  TRACE_COUNTS["prefill"] += 1
  pool, table, ok = reserve_prompt(state.pool, state.tables[slot][None], length, state.pages.page_size)
  logits, pages = model.prefill(params, tokens, state.pages, table, (length - 1)[None])
  logits = sampling.mask_token(logits, model.config.eos_token_id, sampling_args["ban_eos"])
  token = sampling.sample(logits, sampling_args["seed"], length[None], sampling_args["temperature"],
                          sampling_args["top_p"])[0]
  lengths = state.lengths.at[slot].set(jnp.where(ok, length, state.lengths[slot]))
  return SlotState(pages, state.tables.at[slot].set(table[0]), lengths, pool), token, ok


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def decode_step(model: Llama, params, state: SlotState, tokens, active, sampling_args):
  """One token for every active slot: tokens [S] are the last ones sampled. Returns (state, next [S], ok);
  if the pool could not serve the step (ok False) the state's lengths and pool are left as they were."""
  TRACE_COUNTS["decode"] += 1
  # An idle slot asks for no page: give reserve_pages a length whose page has room (1 < page_size).
  probe = jnp.where(active, state.lengths, 1)
  pool, tables, ok = pkv.reserve_pages(state.pool, state.tables, probe, num_new=1, page_size=state.pages.page_size)
  logits, pages = model.decode(params, tokens, state.pages, tables, state.lengths)
  logits = sampling.mask_token(logits, model.config.eos_token_id, sampling_args["ban_eos"])
  next_tokens = sampling.sample(logits, sampling_args["seed"], state.lengths + 1, sampling_args["temperature"],
                                sampling_args["top_p"])
  lengths = jnp.where(active & ok, state.lengths + 1, state.lengths)
  return SlotState(pages, tables, lengths, pool), next_tokens, ok


@functools.partial(jax.jit, donate_argnames=("state",))
def release_slots(state: SlotState, done):
  """Returns the pages of the slots where done [S] to the pool and empties those slots."""
  TRACE_COUNTS["release"] += 1
  pool, tables, lengths = pkv.release_sequences(state.pool, state.tables, state.lengths, done,
                                                state.pages.page_size)
  return SlotState(state.pages, tables, lengths, pool)


def default_buckets(capacity: int) -> tuple[int, ...]:
  """Prompt-length buckets: powers of two from MIN_BUCKET, the last one covering the capacity."""
  buckets = [min(MIN_BUCKET, capacity)]
  while buckets[-1] < capacity:
    buckets.append(min(2 * buckets[-1], capacity))
  return tuple(buckets)


@dataclasses.dataclass
class Stats:
  """What a run measured: generated tokens, wall time, and per decode step latency."""
  tokens: int = 0
  seconds: float = 0.0
  steps: int = 0
  step_seconds: list[float] = dataclasses.field(default_factory=list)
  prefill_seconds: float = 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else float("nan")

  def summary(self) -> str:
    steps = self.step_seconds or [float("nan")]
    return (f"{self.tokens} tokens in {self.seconds:.2f} s: {self.tokens_per_s:.1f} tokens/s; "
            f"{self.steps} steps, decode step median {1e3 * statistics.median(steps):.2f} ms "
            f"(p90 {1e3 * float(np.percentile(steps, 90)):.2f} ms); prefill {self.prefill_seconds:.2f} s")


class Engine:
  """Serves requests in `num_slots` slots over a pool of `num_pages` pages per layer."""

  def __init__(self, model: Llama, params, *, num_slots: int = 8, page_size: int = 16, num_pages: int = 256,
               max_pages_per_seq: int = 64, buckets: tuple[int, ...] | None = None):
    if page_size < 2:
      raise ValueError(f"page_size={page_size} must be at least 2")
    if num_slots < 1 or num_pages < 1 or max_pages_per_seq < 1:
      raise ValueError(f"num_slots={num_slots}, num_pages={num_pages} and max_pages_per_seq={max_pages_per_seq} "
                       "must be positive")
    self.model, self.params = model, params
    self.num_slots, self.page_size, self.num_pages = num_slots, page_size, num_pages
    self.capacity = max_pages_per_seq * page_size
    self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self.capacity)
    self.state = SlotState(model.empty_pages(num_pages, page_size), pkv.empty_block_tables(num_slots, max_pages_per_seq),
                           jnp.zeros((num_slots,), jnp.int32), pkv.PagePool.create(num_pages))
    self.slots: list[Request | None] = [None] * num_slots
    self.queue: collections.deque[Request] = collections.deque()
    self.committed_pages = 0  # worst-case pages of the running requests
    self.step_index = 0
    self.num_finished = 0
    self.stats = Stats()

  # ------------------------------------------------------------------------ requests

  def pages_needed(self, request: Request) -> int:
    """Pages a request holds at most: its prompt and every new token but the last (never fed back)."""
    return -(-(len(request.prompt_ids) + request.max_new_tokens - 1) // self.page_size)

  def validate(self, request: Request) -> None:
    """ValueError if the request could never run in this engine."""
    n, new = len(request.prompt_ids), request.max_new_tokens
    if n < 1 or new < 1:
      raise ValueError(f"a request needs a prompt and max_new_tokens >= 1; got {n} prompt tokens, {new=}")
    if n > self.buckets[-1]:
      raise ValueError(f"prompt of {n} tokens is longer than the longest prefill bucket ({self.buckets[-1]})")
    if n + new - 1 > self.capacity:
      raise ValueError(f"prompt of {n} tokens + {new} new tokens needs {n + new - 1} cache positions; a sequence "
                       f"holds {self.capacity} (max_pages_per_seq * page_size)")
    if self.pages_needed(request) > self.num_pages:
      raise ValueError(f"request needs {self.pages_needed(request)} pages; the pool has {self.num_pages}")

  def submit(self, request: Request) -> None:
    """Queues a request; ValueError if it could never run in this engine."""
    self.validate(request)
    self.queue.append(request)

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r is not None for r in self.slots)

  def _sampling_args(self, requests) -> dict:
    get = lambda name, default: np.asarray([getattr(r, name) if r else default for r in requests])
    return dict(temperature=get("temperature", 0.0).astype(np.float32), top_p=get("top_p", 1.0).astype(np.float32),
                seed=get("seed", 0).astype(np.int32), ban_eos=np.asarray([bool(r and r.ignore_eos) for r in requests]))

  # ------------------------------------------------------------------------ a step

  def _emit(self, slot: int, token: int) -> bool:
    """Adds a token to the slot's request; True when that finishes it."""
    request = self.slots[slot]
    request.output_ids.append(token)
    self.stats.tokens += 1
    eos = self.model.config.eos_token_id
    if token == eos and not request.ignore_eos:
      request.finish_reason = "eos"
    elif len(request.output_ids) >= request.max_new_tokens:
      request.finish_reason = "length"
    else:
      return False
    request.finished_step = self.step_index
    return True

  def _admit(self, done: np.ndarray) -> None:
    while self.queue and None in self.slots:
      request = self.queue[0]
      need = self.pages_needed(request)
      if self.committed_pages + need > self.num_pages:
        return  # the pool is short: wait for running requests to finish
      slot = self.slots.index(None)
      n = len(request.prompt_ids)
      bucket = next(b for b in self.buckets if b >= n)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :n] = request.prompt_ids
      start = time.perf_counter()
      self.state, token, ok = prefill_slot(self.model, self.params, self.state, tokens, np.int32(n), np.int32(slot),
                                           self._sampling_args([request]))
      token, ok = int(token), bool(ok)
      self.stats.prefill_seconds += time.perf_counter() - start
      if not ok:  # cannot happen within the budget (the state is left as it was)
        raise RuntimeError(f"page pool refused a prompt of {n} tokens within the budget")
      self.queue.popleft()
      self.slots[slot] = request
      self.committed_pages += need
      request.admitted_step = self.step_index
      done[slot] = self._emit(slot, token)

  def _release(self, done: np.ndarray) -> None:
    if not done.any():
      return
    self.state = release_slots(self.state, done)
    for slot in np.flatnonzero(done):
      self.committed_pages -= self.pages_needed(self.slots[slot])
      self.slots[slot] = None
      self.num_finished += 1

  def step(self) -> None:
    """Admits what fits, runs one decode step over the active slots, releases finished requests."""
    done = np.zeros(self.num_slots, bool)
    self._admit(done)
    active = np.asarray([r is not None and not d for r, d in zip(self.slots, done)])
    if active.any():
      last = np.asarray([r.output_ids[-1] if a else 0 for r, a in zip(self.slots, active)], np.int32)
      start = time.perf_counter()
      self.state, next_tokens, ok = decode_step(self.model, self.params, self.state, last, active,
                                                self._sampling_args([r if a else None for r, a in zip(self.slots, active)]))
      next_tokens, ok = np.asarray(next_tokens), bool(ok)
      self.stats.step_seconds.append(time.perf_counter() - start)
      if not ok:
        raise RuntimeError("page pool refused a decode step within the budget")
      for slot in np.flatnonzero(active):
        done[slot] = self._emit(slot, int(next_tokens[slot]))
    self._release(done)
    self.step_index += 1
    self.stats.steps += 1

  def run(self, requests, *, progress: bool = False) -> Stats:
    """Submits each request at its `arrival` step and steps until all are finished."""
    pending = sorted(requests, key=lambda r: r.arrival)
    for r in pending:  # refuse what could never run before running anything
      self.validate(r)
    first_step, start = self.step_index, time.perf_counter()
    display = ProgressLine(self, len(pending)) if progress else None
    k = 0
    while k < len(pending) or self.busy:
      while k < len(pending) and pending[k].arrival <= self.step_index - first_step:
        self.submit(pending[k])
        k += 1
      self.step()
      if display:
        display.update(self, time.perf_counter() - start)
    self.stats.seconds += time.perf_counter() - start
    if display:
      display.close()
    return self.stats


class ProgressLine:
  """A one-line progress display on stderr (rewritten in place on a terminal, else every few seconds)."""

  def __init__(self, engine: Engine, total: int, every_s: float = 5.0):
    self.total, self.every_s, self.last = total, every_s, -float("inf")
    self.finished_before = engine.num_finished
    self.tty = sys.stderr.isatty()

  def update(self, engine: Engine, elapsed: float) -> None:
    if not self.tty and elapsed - self.last < self.every_s:
      return
    self.last = elapsed
    running = sum(r is not None for r in engine.slots)
    line = (f"step {engine.step_index:5d}  running {running:3d}  waiting {len(engine.queue):3d}  done "
            f"{engine.num_finished - self.finished_before:3d}/{self.total}  "
            f"{engine.stats.tokens / max(elapsed, 1e-9):8.1f} tok/s")
    print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

  def close(self) -> None:
    if self.tty:
      print(file=sys.stderr)
