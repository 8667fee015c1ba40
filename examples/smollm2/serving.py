"""Continuous batching: a fixed number of slots that requests enter and leave at any step.

Each engine step (host side):
  1. waiting requests are admitted, first come first served, while enough slots are free and the
     page budget allows: each is prefilled alone, right-padded to a prompt-length bucket, into its
     slot (its prompt's pages reserved first), which samples its first token on the device. A
     request for n samples takes n slots: its prompt is prefilled once, then forked into the others
     (`pallas_kv.fork_sequences`: they share the prompt's full pages), and each sample draws its
     own first token;
  2. one dispatch runs `steps_per_dispatch` decode steps over every slot (`decode_steps`, idle
     ones masked): a page is reserved where a sequence's next token starts one
     (`pallas_kv.reserve_pages`), the model appends and attends, each active slot samples its next
     token and stops itself at EOS or at its token budget, all on the device;
  3. only then are the previous dispatch's tokens read on the host, while this one runs: the GPU
     never waits for the host between steps. Finished samples give their pages back
     (`pallas_kv.release_sequences`: a shared page stays until its last sharer is done) and free
     their slot for the next step's admissions.
A sequence's tokens depend only on its own prompt, seed and positions, so they are the same
whatever the batch around it and however many steps a dispatch runs.
The jitted functions take fixed shapes (slots, pages, bucket lengths), so requests coming and
going never recompile: `TRACE_COUNTS` counts their traces.

Pages: a request is admitted only when the pool can hold its whole worst case (prompt + new
tokens; the prompt's full pages once for all its samples: `Engine.pages_needed`) beside the worst
cases of the running requests. Pages are still taken step by step and returned as soon as a
sample ends, but a reservation can then never fail mid-generation: when the pool is short,
requests wait in the queue (never crash, never overwrite another's pages).

Prefix caching (`Engine(..., prefix_caching=True)`): prompts' full pages stay in the pool after
their requests, keyed by their tokens (`PrefixCache`); a prompt that starts with cached pages puts
them in its block table and prefills only the rest, its positions offset past them. The cache's
pages count against the budget and are evicted, least recently used first, when a request needs
the room (`Engine`'s docstring has the exact rule).
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
from examples.smollm2.model import copy_pages
from examples.smollm2.prefix_cache import PrefixCache

TRACE_COUNTS = collections.Counter()  # traces of each jitted function (a trace precedes a compile)
MIN_BUCKET = 16


@dataclasses.dataclass
class Request:
  """A generation request; the engine fills in the fields after `arrival`.

  n: samples of the prompt, each generated in its own slot after one shared prefill. Sample i
  draws with seed `seed + i`, so it is the output of the same request with n = 1 and that seed
  (greedy: every sample is the n = 1 output). output_ids and finish_reason are sample 0's;
  samples and finish_reasons hold all n (samples[0] is output_ids). The request is finished when
  all its samples are.
  """
  prompt_ids: list[int]
  max_new_tokens: int
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  ignore_eos: bool = False  # generate max_new_tokens even past EOS
  arrival: int = 0  # the engine step at which `Engine.run` submits it
  n: int = 1
  output_ids: list[int] = dataclasses.field(default_factory=list)
  admitted_step: int | None = None
  finished_step: int | None = None  # when its last sample finished
  finish_reason: str | None = None  # "eos" or "length"
  # Set at admission (not copied by dataclasses.replace: a replaced request starts afresh).
  samples: list[list[int]] = dataclasses.field(default_factory=list, init=False)
  finish_reasons: list[str | None] = dataclasses.field(default_factory=list, init=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
  """How each slot picks its tokens: arrays [slots] (a batch mixes greedy and sampled requests)."""
  temperature: jax.Array  # float32; 0: greedy
  top_p: jax.Array  # float32
  seed: jax.Array  # int32
  ban_eos: jax.Array  # bool: EOS is never chosen (the request ignores EOS)

  @classmethod
  def create(cls, slots: int) -> SlotSampling:
    return cls(jnp.zeros((slots,), jnp.float32), jnp.ones((slots,), jnp.float32), jnp.zeros((slots,), jnp.int32),
               jnp.zeros((slots,), bool))

  def with_slots(self, slots, other: SlotSampling) -> SlotSampling:
    """This with the entries of slots (int [n]) replaced by `other`'s ([n])."""
    return jax.tree.map(lambda mine, new: mine.at[slots].set(new), self, other)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
  """What lives on the device: the pages of every layer, each slot's block table, length, last
  token and stop state, and the pool."""
  pages: KVPages
  tables: jax.Array  # int32 [slots, max_pages_per_seq]
  lengths: jax.Array  # int32 [slots]
  pool: pkv.PagePool
  tokens: jax.Array  # int32 [slots]: the last token sampled, the next step's input
  active: jax.Array  # bool [slots]: generating (admitted and not finished)
  remaining: jax.Array  # int32 [slots]: tokens still to generate
  sampling: SlotSampling


def reserve_prompt(pool, table, length, page_size: int, start=0):
  """Reserves the pages of a length-token prompt for one sequence (table [1, M]), all or nothing.

  start: tokens the sequence already holds (whole pages, in its table's first columns: a reused
  prefix); only the pages past them are reserved. One page per `reserve_pages` call, so the
  lengths may be traced values.
  """
  held = start // page_size
  needed = (length + page_size - 1) // page_size
  ok = (needed - held <= pool.num_free) & (needed <= table.shape[1])

  def one_page(i, carry):
    pool, table = carry
    pool, table, _ = pkv.reserve_pages(pool, table, (i * page_size)[None], num_new=page_size, page_size=page_size)
    return pool, table

  pool, table = jax.lax.fori_loop(held, jnp.where(ok, needed, held), one_page, (pool, table))
  return pool, table, ok


def _stops(model: Llama, token, ban_eos):
  """True where a sampled token ends its request (EOS, where EOS is allowed)."""
  eos = model.config.eos_token_id
  return jnp.zeros(token.shape, bool) if eos is None else (token == eos) & ~ban_eos


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def prefill_slots(model: Llama, params, state: SlotState, tokens, length, slots, request: SlotSampling,
                  max_new_tokens, prefix, cached, keep):
  """Prefills a prompt of `length` tokens into the empty slots[0], forks it into the empty
  slots[1:] (int32 [n]; n static, through the shape) and samples each slot's first token; the
  slots then generate until EOS or max_new_tokens. request: the sampling (scalars); slot i draws
  with seed request.seed + i.

  prefix int32 [M]: pages reused from the prefix cache, holding the prompt's first `cached` tokens
  (whole pages; -1 past them), which the slot's table starts with (one more reference each);
  tokens [1, bucket]: the rest of the prompt (length - cached real ones), which is prefilled.
  keep bool [M]: the table columns whose pages the prefix cache keys (one reference each).
  The forked slots share the prompt's full pages; a partly filled last page is copied into a fresh
  page of each, in every layer. Returns (state, first tokens [n], ok, slots[0]'s block table [M]);
  if the pool could not hold the prompt and its copies (ok False) the slots stay empty and no
  reference is taken.
  """
  TRACE_COUNTS["prefill"] += 1
  num_samples, parent, page_size = slots.shape[0], slots[0], state.pages.page_size
  pool, table, ok = reserve_prompt(state.pool, prefix[None], length, page_size, start=cached)
  pool = pkv.retain_pages(pool, jnp.where(ok, prefix, pkv.UNALLOCATED))  # the slot's reference
  table = jnp.where(ok, table, pkv.UNALLOCATED)
  logits, pages = model.prefill(params, tokens, state.pages, table, (length - cached - 1)[None], start=cached[None])
  tables = state.tables.at[parent].set(table[0])
  lengths = state.lengths.at[parent].set(jnp.where(ok, length, 0))
  if num_samples > 1:
    pool, tables, lengths, copy_src, copy_dst, forked = pkv.fork_sequences(
        pool, tables, lengths, jnp.full((num_samples - 1,), parent), slots[1:], page_size)
    pages = copy_pages(pages, copy_src, copy_dst, model.config.num_layers)
    # All or nothing: a prompt that could not be forked leaves slots[0] empty too.
    ok = ok & forked
    pool, tables, lengths = pkv.release_sequences(pool, tables, lengths,
                                                  (jnp.arange(tables.shape[0]) == parent) & ~ok, page_size)
  group = SlotSampling(jnp.full((num_samples,), request.temperature), jnp.full((num_samples,), request.top_p),
                       request.seed + jnp.arange(num_samples, dtype=jnp.int32),
                       jnp.full((num_samples,), request.ban_eos))
  logits = sampling.mask_token(jnp.broadcast_to(logits, (num_samples, logits.shape[1])), model.config.eos_token_id,
                               group.ban_eos)
  first = sampling.sample(logits, group.seed, jnp.full((num_samples,), length), group.temperature, group.top_p)
  generating = ok & ~_stops(model, first, group.ban_eos) & (max_new_tokens > 1)
  pool = pkv.retain_pages(pool, jnp.where(ok & keep, tables[parent], pkv.UNALLOCATED))  # the prefix cache's
  return SlotState(pages, tables, lengths, pool, state.tokens.at[slots].set(first),
                   state.active.at[slots].set(generating), state.remaining.at[slots].set(max_new_tokens - 1),
                   state.sampling.with_slots(slots, group)), first, ok, tables[parent]


def decode_step(model: Llama, params, state: SlotState):
  """One token for every active slot. Returns (state, tokens [S], emitted [S], ok): a slot emitted
  a token where it was active; it stops itself at EOS or when its budget is spent. If the pool
  could not serve the step (ok False) nothing is emitted and lengths and pool are left as they were."""
  s = state.sampling
  # An idle slot asks for no page: give reserve_pages a length whose page has room (1 < page_size).
  probe = jnp.where(state.active, state.lengths, 1)
  pool, tables, ok = pkv.reserve_pages(state.pool, state.tables, probe, num_new=1, page_size=state.pages.page_size)
  logits, pages = model.decode(params, state.tokens, state.pages, tables, state.lengths)
  logits = sampling.mask_token(logits, model.config.eos_token_id, s.ban_eos)
  next_tokens = sampling.sample(logits, s.seed, state.lengths + 1, s.temperature, s.top_p)
  emitted = state.active & ok
  remaining = jnp.where(emitted, state.remaining - 1, state.remaining)
  finished = emitted & (_stops(model, next_tokens, s.ban_eos) | (remaining <= 0))
  state = SlotState(pages, tables, jnp.where(emitted, state.lengths + 1, state.lengths), pool,
                    jnp.where(emitted, next_tokens, state.tokens), state.active & ~finished, remaining, s)
  return state, next_tokens, emitted, ok


@functools.partial(jax.jit, static_argnames=("model", "num_steps"), donate_argnames=("state",))
def decode_steps(model: Llama, params, state: SlotState, num_steps: int):
  """num_steps decode steps in one dispatch (a slot that finishes emits nothing more).

  A loop of a fixed trip count, not one that ends when no slot is active: XLA runs a loop whose
  condition depends on data from the host, waiting for the device at every iteration, so the call
  would not return before the device finished (on the H200 the host then took 2.9 ms per step of
  2.9; with a fixed count, 0.1).
  Returns (state, tokens [num_steps, S], emitted [num_steps, S], ok): token [i, s] is slot s's
  output of step i where emitted; ok is False if the pool refused a step."""
  TRACE_COUNTS["decode"] += 1
  slots = state.tokens.shape[0]

  def step(i, carry):
    state, tokens, emitted, ok = carry
    state, new_tokens, new_emitted, step_ok = decode_step(model, params, state)
    return state, tokens.at[i].set(new_tokens), emitted.at[i].set(new_emitted), ok & step_ok

  start = (state, jnp.zeros((num_steps, slots), jnp.int32), jnp.zeros((num_steps, slots), bool), jnp.bool_(True))
  return jax.lax.fori_loop(0, num_steps, step, start)


@functools.partial(jax.jit, donate_argnames=("state",))
def release_slots(state: SlotState, done):
  """Returns the pages of the slots where done [S] to the pool and empties those slots."""
  TRACE_COUNTS["release"] += 1
  pool, tables, lengths = pkv.release_sequences(state.pool, state.tables, state.lengths, done,
                                                state.pages.page_size)
  return dataclasses.replace(state, tables=tables, lengths=lengths, pool=pool, active=state.active & ~done)


@functools.partial(jax.jit, donate_argnames=("state",))
def drop_cached_pages(state: SlotState, pages):
  """Drops the prefix cache's reference on pages (int32 [P], -1 padded): evicted pages it alone held."""
  TRACE_COUNTS["evict"] += 1
  return dataclasses.replace(state, pool=pkv.drop_pages(state.pool, pages))


def empty_state(model: Llama, num_slots: int, num_pages: int, page_size: int, max_pages_per_seq: int) -> SlotState:
  """No request in any slot: every page in the pool."""
  return SlotState(model.empty_pages(num_pages, page_size), pkv.empty_block_tables(num_slots, max_pages_per_seq),
                   jnp.zeros((num_slots,), jnp.int32), pkv.PagePool.create(num_pages),
                   jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots,), bool),
                   jnp.zeros((num_slots,), jnp.int32), SlotSampling.create(num_slots))


def default_buckets(capacity: int) -> tuple[int, ...]:
  """Prompt-length buckets: powers of two from MIN_BUCKET, the last one covering the capacity."""
  buckets = [min(MIN_BUCKET, capacity)]
  while buckets[-1] < capacity:
    buckets.append(min(2 * buckets[-1], capacity))
  return tuple(buckets)


@dataclasses.dataclass
class Stats:
  """What a run measured: generated tokens, wall time, and the decode steps' pace."""
  tokens: int = 0
  seconds: float = 0.0
  steps: int = 0  # decode steps dispatched (steps_per_dispatch per dispatch)
  # Host time from one dispatch's tokens reaching the host to the next's, per decode step in it:
  # the pace of the decode loop as a user sees it (dispatch, device and host work overlapped).
  step_seconds: list[float] = dataclasses.field(default_factory=list)
  prefills: int = 0
  prefill_tokens: int = 0  # prompt tokens run through a prefill
  cached_tokens: int = 0  # prompt tokens reused from the prefix cache instead
  evicted_pages: int = 0  # pages the prefix cache gave back to make room

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else float("nan")

  def summary(self) -> str:
    steps = self.step_seconds or [float("nan")]
    return (f"{self.tokens} tokens in {self.seconds:.2f} s: {self.tokens_per_s:.1f} tokens/s; "
            f"{self.steps} steps, decode step median {1e3 * statistics.median(steps):.2f} ms "
            f"(p90 {1e3 * float(np.percentile(steps, 90)):.2f} ms); {self.prefills} prefills of "
            f"{self.prefill_tokens} tokens ({self.cached_tokens} more cached)")


@dataclasses.dataclass
class _Dispatch:
  """Work dispatched in one engine step whose results the host has not read yet."""
  # (slots, tokens, ok, keys of the pages it put in the prefix cache) of the prefills before it
  first_tokens: list[tuple[list[int], jax.Array, jax.Array, list[int]]]
  decoded: tuple[jax.Array, jax.Array, jax.Array] | None  # decode_steps' (tokens, emitted, ok)


class Engine:
  """Serves requests in `num_slots` slots over a pool of `num_pages` pages per layer.

  steps_per_dispatch: decode steps per dispatch (`decode_steps`); more amortize the host's work
  per dispatch, and a request then waits up to that many steps to enter a slot freed mid-way.
  share_prefixes: the samples of a request (`Request.n`) read their shared prompt pages once per
  layer (the model's `prefix_groups`). Off by default: the shared-prefix pass costs a call per layer
  even when no request has samples; False reads the prompt once per sample (the same tokens). A model
  that already has prefix_groups keeps them.
  prefix_caching: keep prompts' full pages past their requests (`PrefixCache`); a request whose
  prompt starts with cached pages reuses them and prefills only the rest. Never its last token,
  whose logits give the first new token: at most (len(prompt) - 1) // page_size pages are reused.
  A request that matches pages whose prefill is still running waits for that prefill (reading
  their ids), so requests arriving together prefill a shared prompt once.

  The page budget with prefix caching, exactly: `committed_pages` is the running requests' worst
  cases plus the cached pages that no running request reserved. A request's worst case is
  `pages_needed` less the cached pages it reuses: those stay allocated while it runs whatever
  happens, since only pages the cache alone holds (reference count 1) are evicted, and they are
  counted once, with the cache (or with the running request whose prefill filled them, until it
  finishes: its reservation holds them, then they pass to the cache). Allocated pages never exceed
  `committed_pages`, and a request is admitted only when `committed_pages` plus its worst case fits
  the pool, so no reservation can fail mid-generation. When it does not fit, the least recently
  used pages the cache alone holds (none the request reuses) are dropped until it does (reading
  the pool's reference counts, a wait for the device, only then); if even all of them would not
  make room, nothing is dropped and the request waits.
  """

  def __init__(self, model: Llama, params, *, num_slots: int = 8, page_size: int = 16, num_pages: int = 256,
               max_pages_per_seq: int = 64, buckets: tuple[int, ...] | None = None, steps_per_dispatch: int = 1,
               share_prefixes: bool = False, prefix_caching: bool = False):
    if page_size < 2:
      raise ValueError(f"page_size={page_size} must be at least 2")
    if num_slots < 1 or num_pages < 1 or max_pages_per_seq < 1:
      raise ValueError(f"num_slots={num_slots}, num_pages={num_pages} and max_pages_per_seq={max_pages_per_seq} "
                       "must be positive")
    if steps_per_dispatch < 1:
      raise ValueError(f"steps_per_dispatch={steps_per_dispatch} must be at least 1")
    if not share_prefixes:
      model = dataclasses.replace(model, prefix_groups=None)
    elif model.prefix_groups is None and num_slots >= 2:
      # A group is one request's samples: 2 to num_slots members, so at most num_slots // 2 groups.
      model = dataclasses.replace(model, prefix_groups=(num_slots // 2, num_slots))
    self.model, self.params = model, params
    self.num_slots, self.page_size, self.num_pages = num_slots, page_size, num_pages
    self.steps_per_dispatch = steps_per_dispatch
    self.capacity = max_pages_per_seq * page_size
    self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self.capacity)
    self.state = empty_state(model, num_slots, num_pages, page_size, max_pages_per_seq)
    self.slots: list[tuple[Request, int] | None] = [None] * num_slots  # (request, sample index)
    self.queue: collections.deque[Request] = collections.deque()
    self.in_flight: _Dispatch | None = None
    self.committed_pages = 0  # worst-case pages of the running requests, and the cache's own pages
    self.prefix_cache = PrefixCache(page_size) if prefix_caching else None
    self._reused_pages: dict[int, int] = {}  # id of a running request -> cached pages it reuses
    self.step_index = 0
    self.num_finished = 0
    self.stats = Stats()
    self._last_read: float | None = None  # when the last dispatch's tokens reached the host

  # ------------------------------------------------------------------------ requests

  def shared_pages(self, request: Request) -> int:
    """The prompt's full pages: held once for all the request's samples."""
    return len(request.prompt_ids) // self.page_size

  def sample_pages(self, request: Request) -> int:
    """Pages a sample holds at most past the shared ones: a copy of the prompt's partly filled last
    page and the pages of every new token but the last (never fed back)."""
    return -(-(len(request.prompt_ids) + request.max_new_tokens - 1) // self.page_size) - self.shared_pages(request)

  def pages_needed(self, request: Request) -> int:
    """Pages a request holds at most: the prompt's full pages once, and each sample's own."""
    return self.shared_pages(request) + request.n * self.sample_pages(request)

  def validate(self, request: Request) -> None:
    """ValueError if the request could never run in this engine."""
    if not isinstance(request.n, (int, np.integer)) or not 1 <= request.n <= self.num_slots:
      raise ValueError(f"n={request.n!r} samples of a request must be an int in [1, num_slots={self.num_slots}]")
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
    return bool(self.queue) or any(held is not None for held in self.slots) or self.in_flight is not None

  # ------------------------------------------------------------------------ a step

  def _generating(self, slot: int) -> bool:
    """The slot holds a sample that has not finished."""
    held = self.slots[slot]
    return held is not None and held[0].finish_reasons[held[1]] is None

  def _emit(self, slot: int, token: int) -> bool:
    """Adds a token to the slot's sample; True when that finishes the sample (the rule
    `decode_step` applies on the device)."""
    request, sample = self.slots[slot]
    if request.finish_reasons[sample] is not None:
      raise RuntimeError(f"slot {slot} emitted a token after its sample finished")
    tokens = request.samples[sample]
    tokens.append(token)
    self.stats.tokens += 1
    eos = self.model.config.eos_token_id
    if token == eos and not request.ignore_eos:
      reason = "eos"
    elif len(tokens) >= request.max_new_tokens:
      reason = "length"
    else:
      return False
    request.finish_reasons[sample] = reason
    if sample == 0:
      request.finish_reason = reason
    if all(r is not None for r in request.finish_reasons):
      request.finished_step = self.step_index
    return True

  def _admit(self) -> list[tuple[list[int], jax.Array, jax.Array]]:
    """Prefills waiting requests into free slots while the page budget allows (dispatched, not
    waited for); returns each one's (slots, first tokens, ok, keys of the pages it puts in the
    prefix cache)."""
    admitted = []
    max_pages_per_seq = self.state.tables.shape[1]
    while self.queue and self.slots.count(None) >= self.queue[0].n:
      request = self.queue[0]
      n = len(request.prompt_ids)
      chain, reused = [], []
      if self.prefix_cache is not None:
        chain = self.prefix_cache.chain(request.prompt_ids)
        reused = self.prefix_cache.match(chain, (n - 1) // self.page_size)
      need = self.pages_needed(request) - len(reused)
      shortfall = self.committed_pages + need - self.num_pages
      if shortfall > 0 and not self._evict(shortfall, keep=set(reused)):
        break  # the pool is short: wait for running requests to finish
      slots = [i for i, held in enumerate(self.slots) if held is None][:request.n]
      cached = len(reused) * self.page_size
      bucket = next(b for b in self.buckets if b >= n - cached)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :n - cached] = request.prompt_ids[cached:]
      prefix = np.full((max_pages_per_seq,), pkv.UNALLOCATED, np.int32)
      prefix[:len(reused)] = reused
      # The prompt's newly filled full pages that the cache does not key yet (after any eviction).
      new_links = []
      if self.prefix_cache is not None:
        new_links = [(column, link) for column, link in enumerate(chain)
                     if column >= len(reused) and link[0] not in self.prefix_cache.entries]
      keep = np.zeros((max_pages_per_seq,), bool)
      keep[[column for column, _ in new_links]] = True
      sampling_args = SlotSampling(np.float32(request.temperature), np.float32(request.top_p), np.int32(request.seed),
                                   np.bool_(request.ignore_eos))
      self.state, first, ok, table = prefill_slots(self.model, self.params, self.state, tokens, np.int32(n),
                                                   np.asarray(slots, np.int32), sampling_args,
                                                   np.int32(request.max_new_tokens), prefix, np.int32(cached), keep)
      for column, link in new_links:
        self.prefix_cache.add(link, request, table, column)
      if self.prefix_cache is not None:
        self.prefix_cache.touch(chain)
      self.queue.popleft()
      request.samples = [request.output_ids] + [[] for _ in range(request.n - 1)]
      request.finish_reasons = [None] * request.n
      for sample, slot in enumerate(slots):
        self.slots[slot] = (request, sample)
      self.committed_pages += need
      self._reused_pages[id(request)] = len(reused)
      request.admitted_step = self.step_index
      self.stats.prefills += 1
      self.stats.prefill_tokens += n - cached
      self.stats.cached_tokens += cached
      admitted.append((slots, first, ok, [link[0] for _, link in new_links]))
    return admitted

  def _evict(self, shortfall: int, keep: set[int]) -> bool:
    """Drops `shortfall` least recently used cached pages that the cache alone holds, none in
    `keep`; False (dropping nothing) if there are not that many."""
    if self.prefix_cache is None:
      return False
    ref_counts = np.asarray(self.state.pool.ref_counts)  # waits for the dispatched work
    keys = self.prefix_cache.evictable(ref_counts, keep, shortfall)
    if len(keys) < shortfall:
      return False
    self._drop_cached(keys)
    self.stats.evicted_pages += len(keys)
    return True

  def _drop_cached(self, keys) -> None:
    pages = np.full((self.num_pages,), pkv.UNALLOCATED, np.int32)
    evicted = self.prefix_cache.remove(keys)
    pages[:len(evicted)] = evicted
    self.state = drop_cached_pages(self.state, pages)
    self.committed_pages -= len(evicted)

  def clear_prefix_cache(self) -> int:
    """Evicts every cached page that the cache alone holds; returns how many."""
    if self.prefix_cache is None:
      return 0
    keys = self.prefix_cache.evictable(np.asarray(self.state.pool.ref_counts), set(), len(self.prefix_cache))
    if keys:
      self._drop_cached(keys)
    return len(keys)

  def _release(self, done: np.ndarray) -> None:
    """Empties the slots of finished samples; the prompt's shared pages go with the request's last."""
    if not done.any():
      return
    self.state = release_slots(self.state, done)
    for slot in np.flatnonzero(done):
      request, _ = self.slots[slot]
      self.slots[slot] = None
      self.committed_pages -= self.sample_pages(request)
      if not any(held is not None and held[0] is request for held in self.slots):
        self.committed_pages -= self.shared_pages(request) - self._reused_pages.pop(id(request))
        if self.prefix_cache is not None:  # the pages it keyed stay, the cache's own now
          self.committed_pages += self.prefix_cache.disown(request)
        self.num_finished += 1

  def _read(self, dispatch: _Dispatch) -> None:
    """Takes in a dispatch's tokens (waiting for it) and releases the samples they finish."""
    done = np.zeros(self.num_slots, bool)
    for slots, first, ok, keyed in dispatch.first_tokens:
      if keyed:
        self.prefix_cache.resolve(keyed)
      if not bool(ok):  # cannot happen within the budget (the slots were left empty)
        raise RuntimeError(f"page pool refused a prompt of {len(self.slots[slots[0]][0].prompt_ids)} tokens "
                           "within the budget")
      for slot, token in zip(slots, np.asarray(first).tolist()):
        done[slot] = self._emit(slot, token)
    if dispatch.decoded is not None:
      tokens, emitted, ok = (np.asarray(a) for a in dispatch.decoded)
      if not ok:
        raise RuntimeError("page pool refused a decode step within the budget")
      for i in range(tokens.shape[0]):
        for slot in np.flatnonzero(emitted[i]):
          done[slot] = self._emit(slot, int(tokens[i, slot]))
      now = time.perf_counter()
      if self._last_read is not None:
        self.stats.step_seconds.append((now - self._last_read) / self.steps_per_dispatch)
      self._last_read = now
    else:
      self._last_read = None
    self._release(done)

  def step(self) -> None:
    """Admits what fits, dispatches the next decode steps, then reads the previous dispatch's
    tokens while they run and releases the requests that finished."""
    first_tokens = self._admit()
    running = any(self._generating(slot) for slot in range(self.num_slots))
    decoded = None
    if running:
      self.state, *decoded = decode_steps(self.model, self.params, self.state, self.steps_per_dispatch)
      self.stats.steps += self.steps_per_dispatch
    previous = self.in_flight
    self.in_flight = _Dispatch(first_tokens, decoded) if (first_tokens or running) else None
    if previous is not None:
      self._read(previous)
    self.step_index += self.steps_per_dispatch

  def run(self, requests, *, progress: bool = False) -> Stats:
    """Submits each request at its `arrival` step and steps until all are finished."""
    pending = sorted(requests, key=lambda r: r.arrival)
    for r in pending:  # refuse what could never run before running anything
      self.validate(r)
    first_step, start = self.step_index, time.perf_counter()
    display = ProgressLine(self, len(pending)) if progress else None
    k = 0
    self._last_read = None
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
    running = len({id(held[0]) for held in engine.slots if held is not None})
    line = (f"step {engine.step_index:5d}  running {running:3d}  waiting {len(engine.queue):3d}  done "
            f"{engine.num_finished - self.finished_before:3d}/{self.total}  "
            f"{engine.stats.tokens / max(elapsed, 1e-9):8.1f} tok/s")
    print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

  def close(self) -> None:
    if self.tty:
      print(file=sys.stderr)
