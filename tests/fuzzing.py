"""Seeded random decode calls over every API axis, each checked against the float32 reference.

A case is a `Structure` (everything static: op, shapes, dtypes, options, config; one compile)
drawn from a structure seed, and runtime values drawn from a value seed: data, ragged lengths
(0, 1, the capacity), shuffled and repeated page ids, -1 table entries past a sequence's pages,
NaN / inf in every slot no valid output may read, and (hostile draws) lengths past the capacity
or negative and page ids out of range, which the ops clamp. A call must either be refused with
`NotImplementedError` (the backend does not serve it) or match the reference.

  PYTHONPATH=.:tests python tests/fuzzing.py --impl=triton --structures=40 --draws=50
  PYTHONPATH=.:tests python tests/fuzzing.py --impl=mosaic_gpu --structures=36 --draws=60 --processes=6 \
      --time_limit=240      # the GPU: compiles dominate, so many draws per structure and processes
  PYTHONPATH=.:tests python tests/fuzzing.py --impl=mosaic_gpu --replay=STRUCTURE_SEED:VALUE_SEED

`tests/test_fuzzing.py` runs a few small structures in interpret mode on every CI run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from pallas_kv import shared_prefix
from harness import TOLERANCE, Case, assert_lse_matches, assert_matches_reference, poison_unread_slots, read_page_slots

KV_DTYPES = ("bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")
PAGE_SIZES = (8, 16, 32, 64, 128)
# Shapes of real models past the common ones: head dims, q heads per kv head, small pages.
ODD_HEAD_DIMS = (32, 40, 80, 96, 192, 512)
SMALL_ODD_HEAD_DIMS = (32, 40, 80, 96)
WIDE_GROUPS = (20, 48)
SMALL_PAGE_SIZES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Structure:
  """The static part of a case: one compiled call."""
  seed: int
  op: str                     # "dense" | "paged" | "mla"
  batch: int
  capacity: int               # T, or max_pages * page_size
  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int             # MLA only (else head_dim)
  num_queries: int | None     # None: q [B, Hq, D]
  page_size: int | None
  num_pages: int
  q_dtype: str
  kv_dtype: str
  k_scale: str | None         # None | "number" | "head" | "token"
  v_scale: str | None
  softcap: float | None
  window: int | None
  sinks: bool
  return_lse: bool
  config: tuple | None        # kernel config fields (of any kernel), or None for the backend's choice
  window_start: bool = False  # a per-sequence window start, int32 [B]
  varlen: bool = False        # q in the varlen form [total, Hq, D] with cu_seqlens_q (num_queries >= 2)
  shared_prefix: bool = False  # rows whose tables start with the same pages, read once (`SharedPrefix`)
  v_tokens_last: bool = False  # v stored [B, Hkv, D, T] / [P, Hkv, D, page_size] (one-byte caches' default)

  @property
  def quantized(self) -> bool:
    return jnp.dtype(self.kv_dtype).itemsize == 1

  def decode_config(self, impl: str):
    """The drawn config as `impl`'s kernel for this op takes it: its config type, with the fields
    of other kernels dropped. None for "xla" and "auto" (a kernel config names its backend, which
    would narrow "auto" to it). A drawn value the kernel's config refuses raises ValueError."""
    if self.config is None or impl not in ("triton", "mosaic_gpu"):
      return None
    op = {"dense": "decode", "paged": "paged", "mla": "mla"}[self.op]
    config_type = pkv.config.config_type(impl, op)
    names = {f.name for f in dataclasses.fields(config_type)}
    return config_type(**{name: value for name, value in self.config if name in names})


def draw_structure(seed: int, *, small: bool = False) -> Structure:
  """small: sizes for interpret mode on a CPU (head_dim 64, at most 256 tokens)."""
  rng = np.random.default_rng([seed, 1])
  pick = lambda options: options[rng.integers(len(options))]
  op = pick(("dense", "dense", "paged", "paged", "mla"))
  s = pick((None, None, 1, 2, 4, 8))
  if op == "mla":
    num_kv_heads, head_dim, v_head_dim = 1, (192 if small else 576), (128 if small else 512)
    num_heads = pick((4, 16) if small else (16, 32, 64, 128))
    kv_dtype = q_dtype = pick(("bfloat16", "float16"))
  else:
    num_kv_heads = pick((1, 2, 4) if small else (1, 2, 4, 8))
    num_heads = num_kv_heads * pick((1, 2, 4, 8, 16))
    head_dim = 64 if small else pick((64, 128, 256))
    v_head_dim = head_dim
    kv_dtype = pick(KV_DTYPES)
    q_dtype = kv_dtype if kv_dtype in ("bfloat16", "float16") else pick(("bfloat16", "float16"))
  page_size = None if op == "dense" else pick(PAGE_SIZES[:4] if small else PAGE_SIZES)
  if small:
    capacity = pick((128, 192, 256))
  else:
    capacity = pick((256, 1024, 2048))
  if page_size:
    capacity = -(-capacity // page_size) * page_size
  batch = pick((1, 2, 3) if small else (1, 2, 3, 5))
  num_pages = 0 if page_size is None else batch * capacity // page_size + int(rng.integers(0, 4))
  scale_kinds = (None, "number", "head", "token")
  k_scale = pick(scale_kinds) if kv_dtype == "int8" or (kv_dtype.startswith("float8") and rng.random() < .7) \
      else None
  v_scale = pick(scale_kinds) if k_scale is not None else None
  gqa = op != "mla"
  config = None
  if rng.random() < 0.5:
    config = (("block_kv", pick((64, 128))), ("num_stages", pick((2, 3, 4))),
              ("num_splits", pick((1, 2, 3, 5))))
    if rng.random() < 0.3:
      config += (("pipeline_qk", True),)
    if rng.random() < 0.2:
      config += (("persistent", True),)
    if rng.random() < 0.4:
      config += (("merge_in_kernel", True),)
  st = Structure(
      seed=seed, op=op, batch=batch, capacity=capacity, num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, v_head_dim=v_head_dim, num_queries=s, page_size=page_size, num_pages=num_pages,
      q_dtype=q_dtype, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale,
      softcap=pick((None, None, 30.0)) if gqa else None,
      window=pick((None, None, None, 17, capacity // 3)) if gqa else None,
      sinks=bool(gqa and rng.random() < 0.25), return_lse=bool(rng.random() < 0.5), config=config)
  # Drawn last, so that the draws above stay what they were for every seed.
  if config is not None and gqa and rng.random() < 0.3:
    st = dataclasses.replace(st, config=config + (("split_plan", "balanced"),))
  elif config is not None and gqa and rng.random() < 0.3:   # triton only; mosaic_gpu refuses it
    st = dataclasses.replace(st, config=config + (("split_plan", "stream_k"),))
  st = _draw_new_axes(rng, st, small=small) if gqa else st
  # Drawn after every other axis, for the same reason.
  if st.op != "dense" and not st.varlen and rng.random() < 0.25:
    st = dataclasses.replace(st, shared_prefix=True)
  # Drawn last of all, for the same reason; likelier for one-byte caches, whose default it is.
  if gqa and rng.random() < (0.6 if st.quantized else 0.2):
    st = dataclasses.replace(st, v_tokens_last=True)
  return st


def _draw_new_axes(rng, st: Structure, *, small: bool) -> Structure:
  """The axes added last (so that earlier draws stay what they were for every seed): window starts, varlen
  queries, odd head dims, wide groups, small pages."""
  draws = rng.random(5)
  pick = lambda options: options[rng.integers(len(options))]
  new = dict(window_start=bool(draws[0] < 0.2), varlen=bool(st.num_queries and st.num_queries > 1 and draws[1] < 0.3))
  if draws[2] < 0.2:
    new["head_dim"] = new["v_head_dim"] = pick(SMALL_ODD_HEAD_DIMS if small else ODD_HEAD_DIMS)
  if draws[3] < 0.15:
    new["num_heads"] = st.num_kv_heads * pick(WIDE_GROUPS)
  if st.page_size is not None and draws[4] < 0.2:
    new["page_size"] = pick(SMALL_PAGE_SIZES)
    new["num_pages"] = st.batch * st.capacity // new["page_size"] + 2
  return dataclasses.replace(st, **new)


@dataclasses.dataclass
class Values:
  """One draw of runtime values: the call's arguments (poisoned) and the clean ones for the reference."""
  args: dict
  clean: dict
  hostile: bool


def _lengths(rng, st: Structure, hostile: bool):
  lengths = rng.integers(1, st.capacity + 1, size=st.batch)
  for i, special in enumerate(rng.permutation([0, 1, st.capacity])[:st.batch - 1]):
    if rng.random() < 0.5:
      lengths[i] = special
  if hostile:   # clamped into [0, capacity] by every impl
    lengths[rng.integers(st.batch)] = pick_hostile_length(rng, st.capacity)
  return lengths.astype(np.int32)


def pick_hostile_length(rng, capacity: int) -> int:
  return int(rng.choice([capacity + 1, capacity + 1000, -1, -(2**31) + 1, 2**31 - 1]))


def _tables(rng, st: Structure, lengths, hostile: bool):
  """Shuffled page ids, some shared between sequences, -1 past each sequence's pages."""
  max_pages = st.capacity // st.page_size
  tables = rng.permutation(st.num_pages)[: st.batch * max_pages].reshape(st.batch, max_pages)
  if st.batch > 1 and rng.random() < 0.3:   # a shared prefix page
    tables[1, 0] = tables[0, 0]
  clamped = np.clip(lengths, 0, st.capacity)
  for b in range(st.batch):
    tables[b, -(-int(clamped[b]) // st.page_size):] = -1
  if hostile:   # out-of-range ids, clamped into the pool by every impl
    b = rng.integers(st.batch)
    tables[b, rng.integers(max_pages)] = rng.choice([st.num_pages, st.num_pages + 7, -5, 2**31 - 1])
  return tables.astype(np.int32)


def _forked(rng, st: Structure, tables, lengths):
  """tables with some rows starting with row 0's first pages (up to the pages both hold), as forks do."""
  tables = tables.copy()
  held = -(-np.clip(lengths, 0, st.capacity) // st.page_size)
  for b in range(1, st.batch):
    if rng.random() < 0.7:
      common = int(rng.integers(0, min(held[0], held[b]) + 1))
      tables[b, :common] = tables[0, :common]
  return tables


def _cache_values(rng, shape, dtype):
  x = rng.standard_normal(shape, dtype=np.float32)
  if dtype == "int8":
    return jnp.asarray(np.clip(np.round(x * 40), -127, 127), jnp.int8)
  if dtype == "float8_e5m2" or dtype == "float8_e4m3fn":
    return jnp.asarray(x * 8, dtype)
  return jnp.asarray(x, dtype)


def _scale(rng, kind, token_shape, num_kv_heads):
  if kind is None:
    return None
  if kind == "number":
    return float(rng.uniform(0.01, 0.05))
  if kind == "head":
    return jnp.asarray(rng.uniform(0.01, 0.05, num_kv_heads), jnp.float32)
  return jnp.asarray(rng.uniform(0.01, 0.05, token_shape), jnp.float32)


def draw_values(st: Structure, seed: int, *, hostile: bool | None = None) -> Values:
  """hostile: force (True) or forbid (False) a hostile draw; None draws one 15% of the time."""
  rng = np.random.default_rng([st.seed, seed, 2])
  hostile = bool(rng.random() < 0.15) if hostile is None else hostile
  lengths = _lengths(rng, st, hostile)
  s = st.num_queries or 1
  q = jnp.asarray(rng.standard_normal((st.batch, s, st.num_heads, st.head_dim)), st.q_dtype)
  if st.num_queries is None:
    q = q[:, 0]
  if st.op == "dense":
    kv_shape = (st.batch, st.capacity, st.num_kv_heads, st.head_dim)
  elif st.op == "paged":
    kv_shape = (st.num_pages, st.page_size, st.num_kv_heads, st.head_dim)
  else:
    kv_shape = (st.num_pages, st.page_size, st.head_dim)
  k = _cache_values(rng, kv_shape, st.kv_dtype)
  v = _cache_values(rng, kv_shape, st.kv_dtype) if st.op != "mla" else None
  options = {}
  if st.op != "mla":
    options = dict(softcap=st.softcap, window=st.window,
                   k_scale=_scale(rng, st.k_scale, kv_shape[:3], st.num_kv_heads),
                   v_scale=_scale(rng, st.v_scale, kv_shape[:3], st.num_kv_heads))
    if st.sinks:
      options["sinks"] = jnp.asarray(rng.standard_normal(st.num_heads), jnp.float32)
  tables = None if st.op == "dense" else _tables(rng, st, lengths, hostile)
  clean = dict(q=q, k=k, v=v, lengths=jnp.asarray(lengths), block_tables=tables, **options)
  # Drawn last, so that the values above stay what they were for every seed.
  if st.window_start:
    clean["window_start"] = jnp.asarray(rng.integers(0, np.clip(lengths, 0, st.capacity) + 2), jnp.int32)
  if st.varlen:   # sequence b brings counts[b] of its S tokens: the last ones
    clean["counts"] = rng.integers(1, st.num_queries + 1, size=st.batch).astype(np.int32)
  if st.shared_prefix:
    clean["block_tables"] = _forked(rng, st, tables, lengths)
  if hostile:   # the clamped values: every impl reads real (finite) memory, nothing to poison
    return Values(args=clean, clean=clean, hostile=True)
  args = dict(clean)
  args.update(_poisoned(st, clean))
  return Values(args=args, clean=clean, hostile=False)


def _poisoned(st: Structure, clean: dict) -> dict:
  """NaN / inf (integer caches: extremes) in every slot no valid output reads; per-token scales too."""
  lengths = np.asarray(clean["lengths"])
  if st.op == "dense":
    case = Case(q=clean["q"], k=clean["k"], v=clean["v"], lengths=clean["lengths"])
    bad = poison_unread_slots(case)
    out = dict(k=bad.k, v=bad.v)
    for name in ("k_scale", "v_scale"):
      if _is_token_scale(clean[name]):
        past = np.arange(st.capacity)[None, :, None] >= lengths[:, None, None]
        out[name] = jnp.where(past, jnp.nan, clean[name])
    return out
  v = clean["v"] if st.op == "paged" else clean["k"][..., None, :]
  k = clean["k"] if st.op == "paged" else clean["k"][..., None, :]
  tables = np.where(clean["block_tables"] < 0, 0, clean["block_tables"])   # -1 entries read nothing
  case = Case(q=clean["q"], k=k[:0], v=v[:0], lengths=clean["lengths"], page_size=st.page_size, k_pages=k,
              v_pages=v, block_tables=jnp.asarray(tables))
  bad = poison_unread_slots(case, dense=False)
  if st.op == "mla":   # one latent pool: poison it as V is (NaN)
    return dict(k=bad.v_pages[..., 0, :])
  out = dict(k=bad.k_pages, v=bad.v_pages)
  unread = ~read_page_slots(tables, lengths, st.page_size, st.num_pages)
  for name in ("k_scale", "v_scale"):
    if _is_token_scale(clean[name]):
      out[name] = jnp.where(jnp.asarray(unread)[..., None], jnp.nan, clean[name])
  return out


def _is_token_scale(scale) -> bool:
  return scale is not None and jnp.ndim(scale) == 3


def _reference(st: Structure, clean: dict):
  """The float32 reference (jitted per structure) on the clean values."""
  q, k, v = (None if x is None else x if jnp.dtype(x.dtype).itemsize == 1 else x.astype(jnp.float32)
             for x in (clean["q"], clean["k"], clean["v"]))
  tables = None if clean["block_tables"] is None else jnp.asarray(clean["block_tables"])
  arrays = {name: clean.get(name) for name in ("sinks", "k_scale", "v_scale", "window_start")}
  out, lse = _reference_fn(st)(q, k, v, clean["lengths"], tables, **arrays)
  if st.varlen:   # the rows of the tokens the varlen call brings, from the padded form's reference
    out, lse = (x[_varlen_rows(clean["counts"], st.num_queries)] for x in (out, lse))
  return out, lse


def _varlen_rows(counts, num_queries: int):
  """(sequence, slot) index arrays of the varlen rows in the padded form: each sequence's last counts[b]."""
  seq = np.repeat(np.arange(len(counts)), counts)
  slot = np.concatenate([np.arange(num_queries - c, num_queries) for c in counts])
  return seq, slot


@functools.lru_cache(maxsize=None)
def _reference_fn(st: Structure):
  def ref(q, k, v, lengths, tables, sinks=None, k_scale=None, v_scale=None, window_start=None):
    if st.op == "mla":
      return pkv.mla_decode_attention_reference(q, k, tables, lengths, v_head_dim=st.v_head_dim, return_lse=True)
    opts = dict(softcap=st.softcap, window=st.window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                return_lse=True, window_start=window_start)
    if st.op == "dense":
      return pkv.decode_attention_reference(q, k, v, lengths, **opts)
    return pkv.paged_decode_attention_reference(q, k, v, tables, lengths, **opts)
  return jax.jit(ref)


@functools.lru_cache(maxsize=None)
def _compiled(st: Structure, impl: str, scale_kinds: tuple):
  """The op of a structure, jitted with its static options bound; arrays go in positionally."""
  config = st.decode_config(impl)
  common = dict(return_lse=st.return_lse, impl=impl, config=config)
  sharing = lambda tables, lengths: None if not st.shared_prefix else shared_prefix.from_tables(
      tables, lengths, page_size=st.page_size, max_groups=st.batch, max_members=st.batch)
  if st.op == "mla":
    return jax.jit(lambda q, kv, tables, lengths: pkv.mla_decode_attention(
        q, kv, tables, lengths, v_head_dim=st.v_head_dim, shared_prefix=sharing(tables, lengths), **common))
  number_scales = {name: value for name, value in scale_kinds if value is not None}
  static = dict(softcap=st.softcap, window=st.window, v_tokens_last=st.v_tokens_last, **common)
  if st.varlen:
    static["max_seqlen_q"] = st.num_queries

  def call(q, k, v, lengths, tables, sinks, k_scale, v_scale, window_start, cu_seqlens_q):
    scales = dict(k_scale=number_scales.get("k_scale", k_scale), v_scale=number_scales.get("v_scale", v_scale))
    extra = dict(sinks=sinks, window_start=window_start, cu_seqlens_q=cu_seqlens_q)
    if st.op == "dense":
      return pkv.decode_attention(q, k, v, lengths, **extra, **scales, **static)
    return pkv.paged_decode_attention(q, k, v, tables, lengths, shared_prefix=sharing(tables, lengths), **extra,
                                      **scales, **static)

  return jax.jit(call)


def _call(st: Structure, impl: str, a: dict):
  """The structure's op, compiled once, on the argument dict of a draw."""
  # Python-number scales are static (a compile-time constant), array scales are arguments.
  numbers = tuple((name, a.get(name)) for name in ("k_scale", "v_scale") if isinstance(a.get(name), float))
  fn = _compiled(st, impl, numbers)
  tables = None if a["block_tables"] is None else jnp.asarray(a["block_tables"])
  if st.op == "mla":
    return fn(a["q"], a["k"], tables, a["lengths"])
  arrays = {name: (None if isinstance(a.get(name), float) else a.get(name)) for name in ("k_scale", "v_scale")}
  q, cu_seqlens = a["q"], None
  if st.varlen:
    q = q[_varlen_rows(a["counts"], st.num_queries)]
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(a["counts"])]), jnp.int32)
  v = jnp.transpose(a["v"], (0, 2, 3, 1)) if st.v_tokens_last else a["v"]   # [lead, tokens, Hkv, D] -> tokens last
  return fn(q, a["k"], v, a["lengths"], tables, a.get("sinks"), arrays["k_scale"], arrays["v_scale"],
            a.get("window_start"), cu_seqlens)


def _first_sequence(st: Structure, a: dict) -> dict:
  """The draw's arguments for its first sequence alone (a paged pool is shared as it is)."""
  one = dict(a, q=a["q"][:1], lengths=a["lengths"][:1])
  for name in ("window_start", "counts"):
    if a.get(name) is not None:
      one[name] = a[name][:1]
  if a["block_tables"] is not None:
    one["block_tables"] = a["block_tables"][:1]
  if st.op == "dense":
    one.update(k=a["k"][:1], v=a["v"][:1])
    for name in ("k_scale", "v_scale"):
      if _is_token_scale(a.get(name)):
        one[name] = a[name][:1]
  return one


def _bitwise_equal(x, y) -> bool:
  x, y = np.asarray(x), np.asarray(y)
  return x.shape == y.shape and x.tobytes() == y.tobytes()


def run_case(st: Structure, value_seed: int, impl: str, *, hostile: bool | None = None,
             reference: bool = True, rerun: bool = False, invariance: bool = False) -> str:
  """'ok', or 'refused: reason' when the backend does not serve the structure. Raises on a mismatch.

  reference=False only checks that the output is finite (compute-sanitizer runs: fewer compiles).
  rerun: the same call again gives bit-identical results. invariance: with a fixed split count
  (a drawn config), the first sequence alone gives bit-identically its row of the batch."""
  values = draw_values(st, value_seed, hostile=hostile)
  a = values.args
  try:
    result = _call(st, impl, a)
  except NotImplementedError as e:
    return f"refused: {e}"
  except ValueError as e:
    if st.config is None or impl not in ("triton", "mosaic_gpu"):
      raise
    return f"refused: the drawn config: {e}"   # an explicit config this backend's rules reject
  out, lse = result if st.return_lse else (result, None)
  if rerun:
    again = _call(st, impl, a)
    assert _bitwise_equal(out, again[0] if st.return_lse else again), "a rerun differs"
  # The balanced and stream-K plans cut each sequence by the whole batch's lengths: not
  # batch-invariant by design.
  fixed_splits = (st.config is not None and impl in ("triton", "mosaic_gpu") and dict(st.config).get("num_splits")
                  and dict(st.config).get("split_plan", "per_sequence") == "per_sequence")
  if invariance and fixed_splits and st.batch > 1:
    alone = _call(dataclasses.replace(st, batch=1), impl, _first_sequence(st, a))
    alone = alone[0] if st.return_lse else alone
    assert _bitwise_equal(out[:1], alone), "the first sequence alone differs from its row of the batch"
  if not reference:
    assert np.isfinite(np.asarray(out, np.float32)).all(), "non-finite output"
    return "ok"
  ref, ref_lse = _reference(st, values.clean)
  dtype = jnp.dtype(st.q_dtype)
  assert out.dtype == dtype, f"output dtype {out.dtype} != q's {dtype}"
  assert_matches_reference(out, ref, dtype, tolerance=TOLERANCE[dtype])
  if lse is not None:
    assert_lse_matches(lse, ref_lse, dtype)
  return "ok"


def fuzz(impl: str, structure_seeds, value_seeds, *, small: bool = False, hostile: bool | None = None,
         reference: bool = True, rerun: bool = False, invariance: bool = False, deadline: float | None = None,
         log=print) -> dict:
  """Runs every (structure, value) pair; returns counts and the failing seeds.

  deadline: a time.perf_counter() value after which no new case starts."""
  counts = {"ok": 0, "refused": 0, "failed": 0}
  failures = []
  past_deadline = lambda: deadline is not None and time.perf_counter() > deadline
  for structure_seed in structure_seeds:
    if past_deadline():
      log(f"time limit: stopped before structure {structure_seed}")
      break
    st = draw_structure(structure_seed, small=small)
    for value_seed in value_seeds:
      if past_deadline():
        break
      try:
        status = run_case(st, value_seed, impl, hostile=hostile, reference=reference, rerun=rerun,
                          invariance=invariance)
      except Exception as e:  # pylint: disable=broad-except
        counts["failed"] += 1
        failures.append((structure_seed, value_seed, f"{type(e).__name__}: {e}".splitlines()[0][:300]))
        log(f"FAILED {impl} --replay={structure_seed}:{value_seed}  {st}\n{traceback.format_exc(limit=6)}")
        continue
      if status.startswith("refused"):
        counts["refused"] += 1
        log(f"refused {impl} {structure_seed}: {status[9:][:160]}")
        break   # the structure decides it: the other draws would be refused alike
      counts["ok"] += 1
    log(f"after structure {structure_seed} {impl}: {counts}")
  return dict(counts=counts, failures=failures)


def main(argv=None) -> int:
  # Interpret-mode kernels run JAX computations inside callbacks: with asynchronous dispatch the
  # next call can take the CPU client's threads first and deadlock (docs/reliability.md, "Interpret mode").
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impl", default="xla", help="mosaic_gpu, triton, xla or auto (comma-separated)")
  parser.add_argument("--structures", type=int, default=20)
  parser.add_argument("--first_structure", type=int, default=0)
  parser.add_argument("--draws", type=int, default=10, help="value draws per structure")
  parser.add_argument("--small", action="store_true", help="interpret-mode sizes")
  parser.add_argument("--replay", default=None, help="STRUCTURE_SEED:VALUE_SEED of one case")
  parser.add_argument("--hostile", action="store_true", help="every draw hostile (for compute-sanitizer runs)")
  parser.add_argument("--no_reference", action="store_true", help="only check outputs are finite")
  parser.add_argument("--rerun", action="store_true", help="also check a second call is bit-identical")
  parser.add_argument("--invariance", action="store_true",
                      help="also check fixed-split calls: the first sequence alone equals its batch row bitwise")
  parser.add_argument("--time_limit", type=float, default=None, help="seconds; no new case starts after")
  parser.add_argument("--processes", type=int, default=1,
                      help="split the structures over this many processes (they share the GPU)")
  args = parser.parse_args(argv)
  if args.processes > 1:
    return _run_processes(args, argv if argv is not None else sys.argv[1:])
  bad = 0
  for impl in args.impl.split(","):
    if args.replay:
      s, v = (int(x) for x in args.replay.split(":"))
      print(draw_structure(s, small=args.small))
      print(impl, run_case(draw_structure(s, small=args.small), v, impl))
      continue
    start = time.perf_counter()
    deadline = None if args.time_limit is None else start + args.time_limit
    result = fuzz(impl, range(args.first_structure, args.first_structure + args.structures), range(args.draws),
                  small=args.small, hostile=True if args.hostile else None, reference=not args.no_reference,
                  rerun=args.rerun, invariance=args.invariance, deadline=deadline)
    c = result["counts"]
    print(f"{impl}: {c['ok']} cases ok, {c['failed']} failed, {c['refused']} structures refused "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    for s, v, why in result["failures"]:
      print(f"  --replay={s}:{v}  {why}")
    bad += c["failed"]
  return 1 if bad else 0


def _run_processes(args, argv) -> int:
  """Runs this program in args.processes processes over disjoint structure ranges; sums their counts.

  The GPU memory fraction (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.8) is shared among them.
  Failures are printed as they come, and the totals so far also when the run is stopped (SIGTERM,
  as `timeout` sends, or Ctrl-C): the children are stopped with it.
  """
  import ast
  import os
  import re
  import signal
  import subprocess
  import threading
  passed = [a for a in argv if not a.startswith(("--processes", "--structures", "--first_structure"))]
  per = -(-args.structures // args.processes)
  share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")) / args.processes
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{share:.3f}", PYTHONUNBUFFERED="1")
  children = []
  for p in range(args.processes):
    first = args.first_structure + p * per
    count = min(per, args.first_structure + args.structures - first)
    if count > 0:
      children.append(subprocess.Popen(
          [sys.executable, __file__, *passed, f"--first_structure={first}", f"--structures={count}"],
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
  latest = [{} for _ in children]  # per child: impl -> its counts after its last finished structure
  failed = [False] * len(children)
  lock = threading.Lock()

  def follow(index, child):
    for line in child.stdout:
      progress = re.match(r"after structure \d+ (\w+): (\{.*\})", line)
      if progress:
        latest[index][progress[1]] = ast.literal_eval(progress[2])
      elif line.startswith(("FAILED", "  --replay")):
        failed[index] = True
        with lock:
          print(line, end="", flush=True)

  def report(stopped: bool):
    totals = {}
    for counts in latest:
      for impl, c in counts.items():
        t = totals.setdefault(impl, dict(ok=0, failed=0, refused=0))
        for key in t:
          t[key] += c[key]
    for impl, t in totals.items():
      print(f"total {impl}: {t['ok']} cases ok, {t['failed']} failed, {t['refused']} structures refused "
            f"({len(children)} processes{', stopped early' if stopped else ''})", flush=True)

  def stop(signum, frame):
    del frame
    for child in children:
      child.kill()
    report(stopped=True)
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  readers = [threading.Thread(target=follow, args=(i, c), daemon=True) for i, c in enumerate(children)]
  for reader in readers:
    reader.start()
  for child, reader in zip(children, readers):
    child.wait()
    reader.join()
  report(stopped=False)
  return 1 if any(failed) or any(child.returncode for child in children) else 0


if __name__ == "__main__":
  sys.exit(main())
