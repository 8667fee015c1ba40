r"""Decode-attention benchmark: pallas_kv impls and peers side by side.

Usage (from the repository root):

  python -m benchmarks.decode                       # CPU: one tiny case; GPU: the GQA sweep
  python -m benchmarks.decode --flagfile=configs/gqa_h200.flags --json=/tmp/gqa.json
  python -m benchmarks.decode --op=paged --page_size=64 --cases=8x8192 \
      --impl=auto,xla_einsum,jax_pallas_paged
  python -m benchmarks.decode --op=mla --num_heads=128 --batch=64,128 --seq_len=4096,8192
  python -m benchmarks.decode --flagfile=configs/gemma2_9b.flags --csv=/tmp/g.csv --plot=/tmp/g.png

Each case (op x batch x seq_len) prints one table row per impl: median time per
call, TB/s of the bytes that must move (the KV of the valid tokens, plus q and the
output), TFLOP/s, % of the roofline max(bytes / peak_tbps, flops / peak_tflops) /
time, and the relative error ||out - ref|| / ||ref|| against the pallas_kv float32
reference on float32-upcast inputs. An impl that cannot run (not built yet, no
torch, no GPU, op unsupported) prints "n/a (reason)"; an unexpected exception
prints "error (reason)".

Impls: pallas_kv's own `auto`, `mosaic_gpu`, `triton`, `xla` (the `impl=` argument),
and the peers of benchmarks/peers.py: `xla_einsum`, `cudnn`, `torch`,
`jax_pallas_gqa`, `jax_pallas_paged`.

Attention options (op=decode and paged): `--softcap=50`, `--window=4096`, `--sinks`
(random float32 per-head sink logits, one array per case) go to the pallas_kv impls,
to the reference and to the peers that can express them (`xla_einsum`); the other
peers report the row n/a. With a window the bytes and flops count only the keys
inside it (min(length, window + S - 1) per sequence), and the rotating input sets
are sized by that read, not by the capacity.

Outputs besides the tables: `--json` (every row), `--csv` (one line per impl x case,
the scalar fields of the JSON rows), `--plot=PATH.png` (TB/s against context length
per impl, and against batch when the sweep has several batches; needs the `plot`
extra, matplotlib; without it the run says so and goes on). `benchmarks/report.py`
turns the JSON into a RESULTS.md section. Named model sweeps: configs/*.flags.

Defaults: flags left unset take a per-platform default (see `default_sweep`). On a
CPU (`default_is_cpu()`), one tiny case (B=2, T=256, heads 4/2, D=64, impls
xla,xla_einsum, a few iterations); on a GPU the H200 sweep of configs/*_h200.flags.
Cases come from `--cases=BxT,...` if given, else from the product of `--batch` and
`--seq_len`.

Timing: see benchmarks/timing.py. JAX impls run as one jitted chain of `--iters`
dependent calls and one of 2x that; the per-call time is their difference over
`--iters` (host dispatch cancels), median over `--repeats`. Calls rotate among
enough input sets that the KV cache doesn't fit in L2. torch uses CUDA events.
The note column says "chain" when the difference was too noisy (tiny CPU cases)
and the plain chain time, an upper bound, is shown instead. Exit status 1 if a pallas_kv impl raised something other than
NotImplementedError or failed the numerics check (peers never fail the run).

From Python (tests): `run(op="decode", cases=((2, 256),), impls=("xla",))` returns
the rows as dicts; `run(sweep)` takes a `Sweep`; `default_sweep(op, cpu)` gives the
defaults.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import json
import math
import sys
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

try:
  from benchmarks import peers
  from benchmarks import timing
except ImportError:  # run as a script: python benchmarks/decode.py
  import peers  # type: ignore[no-redef]
  import timing  # type: ignore[no-redef]

OPS = peers.OPS
OUR_IMPLS = ("auto", "mosaic_gpu", "triton", "xla")
ALL_IMPLS = OUR_IMPLS + tuple(peers.PEERS)
DTYPES = ("bfloat16", "float16", "float32")
# Relative error allowed for pallas_kv impls (DESIGN.md); peers are reported only.
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}
PEAK_TBPS = 4.5  # H200 HBM read ceiling measured here
PEAK_TFLOPS = 790.0  # H200 dense bf16 matmul measured here
MLA_QK_DIM = 576  # 512 latent + 64 rope
MLA_V_DIM = 512

GPU_GQA_CASES = ((1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 4096))
GPU_MLA_CASES = ((64, 4096), (64, 8192), (128, 4096), (128, 8192))
GPU_IMPLS = {
    "decode": ("auto", "mosaic_gpu", "triton", "xla_einsum", "cudnn", "torch",
               "jax_pallas_gqa"),
    "paged": ("auto", "mosaic_gpu", "triton", "xla_einsum", "jax_pallas_paged"),
    "mla": ("auto", "xla_einsum"),
}
CPU_CASES = ((2, 256),)
CPU_IMPLS = ("xla", "xla_einsum")
# The float32 reference runs over batch chunks of about this many bytes of
# float32 KV and logits, so a case that fills the GPU can still be checked.
REFERENCE_CHUNK_BYTES = 2**30
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Everything one benchmark run does (the resolved flags)."""

  op: str = "decode"
  impls: tuple[str, ...] = CPU_IMPLS
  cases: tuple[tuple[int, int], ...] = CPU_CASES  # (batch, seq_len)
  num_heads: int = 4
  num_kv_heads: int = 2  # ignored by op=mla (one latent head)
  head_dim: int = 64  # ignored by op=mla (mla_qk_dim, mla_v_dim)
  num_queries: int = 1
  page_size: int = 16  # paged and mla
  shuffle_pages: bool = True
  dtype: str = "bfloat16"
  ragged: bool = False
  seed: int = 0
  warmup: int = 1
  iters: int = 3
  repeats: int = 3
  rotate_bytes: float = 0.0  # least total KV bytes of rotating input sets
  check: bool = True
  strict: bool = False  # re-raise exceptions instead of printing n/a rows
  peak_tbps: float = PEAK_TBPS
  peak_tflops: float = PEAK_TFLOPS
  mla_qk_dim: int = MLA_QK_DIM
  mla_v_dim: int = MLA_V_DIM
  softcap: float | None = None  # attention options (op=decode and paged)
  window: int | None = None
  sinks: bool = False  # random per-head sink logits

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"{self.op=} must be one of {OPS}")
    unknown = [i for i in self.impls if i not in ALL_IMPLS]
    if unknown or not self.impls:
      raise ValueError(f"{self.impls=}: unknown {unknown}; choose from {ALL_IMPLS}")
    if self.dtype not in DTYPES:
      raise ValueError(f"{self.dtype=} must be one of {DTYPES}")
    if not self.cases:
      raise ValueError(f"{self.cases=} must not be empty")
    for b, t in self.cases:
      if b < 1 or t < 1:
        raise ValueError(f"case (batch={b}, seq_len={t}) must be positive")
      if t < self.num_queries:
        raise ValueError(f"seq_len={t} must be >= {self.num_queries=}")
    for name in ("num_heads", "num_kv_heads", "head_dim", "num_queries",
                 "page_size", "iters", "repeats", "mla_qk_dim", "mla_v_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.warmup < 0:
      raise ValueError(f"{self.warmup=} must be >= 0")
    if self.op != "mla" and self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
    if self.mla_v_dim > self.mla_qk_dim:
      raise ValueError(f"{self.mla_v_dim=} must be <= {self.mla_qk_dim=}")
    if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
      raise ValueError(f"{self.softcap=} must be a finite number > 0")
    if self.window is not None and self.window < 1:
      raise ValueError(f"{self.window=} must be >= 1")
    if self.op == "mla" and (self.softcap is not None or self.window is not None
                             or self.sinks):
      raise ValueError(f"op='mla' takes no softcap, window or sinks; got "
                       f"{self.softcap=}, {self.window=}, {self.sinks=}")


def default_is_cpu() -> bool:
  """Whether the defaults are the tiny CPU case (True) or the GPU sweep (False)."""
  return jax.default_backend() == "cpu"


def default_sweep(op: str = "decode", cpu: bool | None = None) -> Sweep:
  """The defaults for `op`: one tiny case on a CPU, the H200 sweep on a GPU."""
  if cpu is None:
    cpu = default_is_cpu()
  page_size = 64 if op == "mla" else 16
  if cpu:
    return Sweep(op=op, page_size=page_size)
  return Sweep(
      op=op,
      impls=GPU_IMPLS[op],
      cases=GPU_MLA_CASES if op == "mla" else GPU_GQA_CASES,
      num_heads=128 if op == "mla" else 32,
      num_kv_heads=1 if op == "mla" else 8,
      head_dim=128,
      page_size=page_size,
      warmup=5,
      iters=20,
      repeats=10,
      rotate_bytes=timing.DEFAULT_ROTATE_BYTES,
  )


def parse_cases(specs: Sequence[str]) -> tuple[tuple[int, int], ...]:
  """["8x8192", "1x32768"] -> ((8, 8192), (1, 32768))."""
  cases = []
  for spec in specs:
    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"case {spec!r} must look like BATCHxSEQ_LEN, e.g. 8x8192")
    cases.append((int(parts[0]), int(parts[1])))
  return tuple(cases)


def cross_cases(batches: Sequence[int], seq_lens: Sequence[int]):
  return tuple((b, t) for b in batches for t in seq_lens)


# ------------------------------------------------------------------ one case


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark shape. For op=mla, num_kv_heads is 1 and head_dim the qk dim."""

  op: str
  batch: int
  seq_len: int  # KV capacity T; every sequence has this length unless ragged
  num_heads: int
  num_kv_heads: int
  head_dim: int  # D of q and k
  v_head_dim: int
  num_queries: int
  page_size: int
  shuffle_pages: bool
  dtype: str
  ragged: bool
  softcap: float | None = None
  window: int | None = None
  sinks: bool = False

  @classmethod
  def from_sweep(cls, sweep: Sweep, batch: int, seq_len: int) -> Case:
    mla = sweep.op == "mla"
    return cls(
        op=sweep.op, batch=batch, seq_len=seq_len, num_heads=sweep.num_heads,
        num_kv_heads=1 if mla else sweep.num_kv_heads,
        head_dim=sweep.mla_qk_dim if mla else sweep.head_dim,
        v_head_dim=sweep.mla_v_dim if mla else sweep.head_dim,
        num_queries=sweep.num_queries, page_size=sweep.page_size,
        shuffle_pages=sweep.shuffle_pages, dtype=sweep.dtype, ragged=sweep.ragged,
        softcap=sweep.softcap, window=sweep.window, sinks=sweep.sinks)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def pages_per_seq(self) -> int:
    return -(-self.seq_len // self.page_size)

  @property
  def q_shape(self) -> tuple[int, ...]:
    if self.num_queries == 1:
      return (self.batch, self.num_heads, self.head_dim)
    return (self.batch, self.num_queries, self.num_heads, self.head_dim)

  @property
  def kv_capacity_bytes(self) -> int:
    """Bytes of KV cache allocated for one input set."""
    if self.op == "decode":
      tokens = self.batch * self.seq_len
    else:
      tokens = self.batch * self.pages_per_seq * self.page_size
    per_token = self.head_dim if self.op == "mla" else 2 * self.num_kv_heads * self.head_dim
    return tokens * per_token * self.itemsize

  def attended_keys(self, lengths: jax.Array | np.ndarray) -> int:
    """Keys that must be read: sum of lengths, or of min(length, window + S - 1)."""
    lengths = np.asarray(lengths, np.int64)
    if self.window is not None:
      lengths = np.minimum(lengths, self.window + self.num_queries - 1)
    return int(lengths.sum())

  def rotation_bytes(self, kv_bytes: float) -> float:
    """KV bytes per input set that count for L2 defeat: the capacity, or with a
    window the windowed read `kv_bytes` (a long cache is mostly never read)."""
    if self.window is None:
      return self.kv_capacity_bytes
    return min(self.kv_capacity_bytes, kv_bytes)

  def footprint(self, rotate_bytes: float) -> tuple[int, int]:
    """(input sets, their total KV capacity bytes) at full lengths."""
    kv_bytes = self.costs(self.attended_keys(np.full(self.batch, self.seq_len)))["kv_bytes"]
    num_sets = timing.num_rotating_sets(self.rotation_bytes(kv_bytes), rotate_bytes)
    return num_sets, num_sets * self.kv_capacity_bytes

  @property
  def options(self) -> tuple[str, ...]:
    return op_spec(self).options

  def costs(self, total_keys: int) -> dict[str, float]:
    """Bytes that must move and flops, for `total_keys` = sum of lengths."""
    if self.op == "mla":  # one latent row per token, read once for K and V
      kv = total_keys * self.head_dim * self.itemsize
    else:
      kv = total_keys * self.num_kv_heads * self.head_dim * 2 * self.itemsize
    rows = self.batch * self.num_queries * self.num_heads
    q_out = rows * (self.head_dim + self.v_head_dim) * self.itemsize
    flops = (2 * self.num_heads * self.num_queries
             * (self.head_dim + self.v_head_dim) * total_keys)
    return {"kv_bytes": kv, "bytes": kv + q_out, "flops": flops}

  def describe(self) -> str:
    heads = (f"Hq={self.num_heads} latent D={self.head_dim}/{self.v_head_dim}"
             if self.op == "mla" else
             f"Hq={self.num_heads} Hkv={self.num_kv_heads} D={self.head_dim}")
    paged = ""
    if self.op != "decode":
      paged = f" page={self.page_size}{' shuffled' if self.shuffle_pages else ''}"
    options = "".join(f" {o}" for o in self.options)
    return (f"{self.op} B={self.batch} T={self.seq_len} {heads} "
            f"S={self.num_queries} {self.dtype}{paged}{options}")


def make_lengths(case: Case, key: jax.Array) -> jax.Array:
  """int32 [B]: all at seq_len, or (ragged) uniform in [num_queries, seq_len]."""
  if not case.ragged:
    return jnp.full((case.batch,), case.seq_len, jnp.int32)
  return jax.random.randint(key, (case.batch,), case.num_queries, case.seq_len + 1,
                            dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def make_inputs(case: Case, key: jax.Array, lengths: jax.Array) -> tuple:
  """Random inputs of the op, in pallas_kv's argument order."""
  dtype = jnp.dtype(case.dtype)
  kq, kk, kv, kp = jax.random.split(key, 4)
  q = jax.random.normal(kq, case.q_shape, dtype)
  b, t, hkv, d = case.batch, case.seq_len, case.num_kv_heads, case.head_dim
  if case.op == "decode":
    k = jax.random.normal(kk, (b, t, hkv, d), dtype)
    v = jax.random.normal(kv, (b, t, hkv, d), dtype)
    return q, k, v, lengths
  num_pages = b * case.pages_per_seq
  if case.shuffle_pages:
    page_ids = jax.random.permutation(kp, num_pages)
  else:
    page_ids = jnp.arange(num_pages)
  block_tables = page_ids.astype(jnp.int32).reshape(b, case.pages_per_seq)
  if case.op == "paged":
    shape = (num_pages, case.page_size, hkv, d)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    return q, k_pages, v_pages, block_tables, lengths
  kv_pages = jax.random.normal(kk, (num_pages, case.page_size, d), dtype)
  return q, kv_pages, block_tables, lengths


def make_sinks(case: Case, key: jax.Array) -> jax.Array:
  """float32 [Hq] per-head sink logits (gpt-oss learns one per head)."""
  return jax.random.normal(key, (case.num_heads,), jnp.float32)


def make_input_sets(case: Case, key: jax.Array, lengths: jax.Array,
                    num_sets: int) -> list[tuple]:
  """`num_sets` random input sets; with sinks each ends with the same sinks array."""
  key_sinks, key_sets = jax.random.split(key)
  extra = (make_sinks(case, key_sinks),) if case.sinks else ()
  return [make_inputs(case, k, lengths) + extra
          for k in jax.random.split(key_sets, num_sets)]


def _upcast(args: tuple) -> tuple:
  return tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
               for a in args)


def _import_pallas_kv():
  try:
    import pallas_kv  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise peers.PeerUnavailable(f"pallas_kv not importable ({e})") from None
  return pallas_kv


def _with_options(fn, case: Case):
  """fn(*op_args, [sinks]) calling a pallas_kv function with the case's options."""
  if case.op == "mla":
    return fn
  fn = functools.partial(fn, softcap=case.softcap, window=case.window)
  if not case.sinks:
    return fn

  def with_sinks(*args):
    return fn(*args[:-1], sinks=args[-1])

  return with_sinks


def reference_chunk(case: Case) -> int:
  """Sequences per reference call: the largest divisor of B whose float32 KV and
  logits fit in REFERENCE_CHUNK_BYTES (at least 1)."""
  tokens = case.kv_capacity_bytes // case.itemsize // case.batch  # KV elements
  logits = case.pages_per_seq * case.page_size if case.op != "decode" else case.seq_len
  per_seq = 4 * (tokens + 2 * logits * case.num_heads * case.num_queries)
  return peers.largest_divisor_at_most(case.batch, max(1, REFERENCE_CHUNK_BYTES // per_seq))


def _batch_slice(case: Case, args: tuple, b0: int, b1: int) -> tuple:
  """The inputs of sequences [b0, b1); paged: their pages, gathered in table order."""
  extra = args[-1:] if case.sinks else ()
  op_args = args[:-1] if case.sinks else args
  q, lengths = op_args[0][b0:b1], op_args[-1][b0:b1]
  if case.op == "decode":
    return (q, op_args[1][b0:b1], op_args[2][b0:b1], lengths) + extra
  tables = op_args[-2][b0:b1]
  own_tables = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape)
  pools = tuple(pool[tables.reshape(-1)] for pool in op_args[1:-2])
  return (q,) + pools + (own_tables, lengths) + extra


def reference_output(case: Case, args: tuple) -> tuple[np.ndarray, str]:
  """Float32 reference on float32-upcast inputs, and which reference ran.

  Runs over batch chunks (`reference_chunk`) so its float32 copies stay small.
  """
  try:
    pkv = _import_pallas_kv()
    ref = _with_options({
        "decode": pkv.decode_attention_reference,
        "paged": pkv.paged_decode_attention_reference,
        "mla": functools.partial(pkv.mla_decode_attention_reference,
                                 v_head_dim=case.v_head_dim),
    }[case.op], case)
    source = "pallas_kv reference"
  except peers.PeerUnavailable:  # before the library exists: the same math in f32
    ref = peers.build_xla_einsum(op_spec(case)).fn
    source = "einsum f32 (pallas_kv not importable)"
  ref_f32 = jax.jit(lambda *a: ref(*_upcast(a)))
  chunk = reference_chunk(case)
  if chunk == case.batch:
    return np.asarray(ref_f32(*args), np.float32), source
  outs = [np.asarray(ref_f32(*_batch_slice(case, args, b0, b0 + chunk)), np.float32)
          for b0 in range(0, case.batch, chunk)]
  return np.concatenate(outs), f"{source}, {case.batch // chunk} batch chunks"


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
  if out.shape != ref.shape:
    raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
  out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
  return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def op_spec(case: Case) -> peers.OpSpec:
  return peers.OpSpec(op=case.op, num_queries=case.num_queries,
                      full_lengths=not case.ragged,
                      v_head_dim=case.v_head_dim if case.op == "mla" else None,
                      softcap=case.softcap, window=case.window, sinks=case.sinks)


def build_pallas_kv(impl: str, spec: peers.OpSpec) -> peers.Runner:
  """A runner for pallas_kv's own op with `impl=impl` and the spec's options."""
  pkv = _import_pallas_kv()
  fn = {
      "decode": pkv.decode_attention,
      "paged": pkv.paged_decode_attention,
      "mla": functools.partial(pkv.mla_decode_attention, v_head_dim=spec.v_head_dim),
  }[spec.op]
  fn = functools.partial(fn, impl=impl)
  if spec.op == "mla":
    return peers.Runner(fn=jax.jit(fn))
  fn = functools.partial(fn, softcap=spec.softcap, window=spec.window)
  if spec.sinks:
    plain = fn

    def fn(*args):  # the sinks array comes last
      return plain(*args[:-1], sinks=args[-1])

  return peers.Runner(fn=jax.jit(fn))


def _auto_choice() -> str | None:
  """The backend pallas_kv's impl="auto" picked in the latest trace, if it says."""
  last_impl = getattr(_import_pallas_kv(), "last_impl", None)
  return last_impl() if callable(last_impl) else None


def build_runner(impl: str, spec: peers.OpSpec) -> peers.Runner:
  if impl in OUR_IMPLS:
    return build_pallas_kv(impl, spec)
  if impl in peers.PEERS:
    return peers.PEERS[impl](spec)
  raise ValueError(f"unknown impl {impl!r}; choose from {ALL_IMPLS}")


def _reason(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_impl(impl: str, case: Case, sweep: Sweep, input_sets: Sequence[tuple],
             ref: np.ndarray | None, costs: dict[str, float]) -> dict[str, Any]:
  """Checks and times one impl on one case; never raises unless sweep.strict."""
  row: dict[str, Any] = {"impl": impl, "ours": impl in OUR_IMPLS}
  try:
    runner = build_runner(impl, op_spec(case))
    prepared = [runner.prepare(args) for args in input_sets]
    first = runner.fn(*prepared[0])  # compiles; "auto" records its choice
    if impl == "auto":
      row["auto_choice"] = _auto_choice()
    if ref is not None:
      row["rel_err"] = relative_error(runner.to_numpy(first), ref)
    t = timing.TIMERS[runner.timer](runner.fn, prepared, warmup=sweep.warmup,
                                    iters=sweep.iters, repeats=sweep.repeats)
  except Exception as e:  # pylint: disable=broad-except
    if sweep.strict:
      raise
    unavailable = isinstance(e, (NotImplementedError, peers.PeerUnavailable))
    row.update(status="n/a" if unavailable else "error", reason=_reason(e))
    if not unavailable:
      row["traceback"] = traceback.format_exc()
    return row
  roofline_s = max(costs["bytes"] / (sweep.peak_tbps * 1e12),
                   costs["flops"] / (sweep.peak_tflops * 1e12))
  row.update(
      status="ok",
      time_us=t.median_s * 1e6,
      min_us=t.min_s * 1e6,
      samples_us=[s * 1e6 for s in t.samples_s],
      overhead_us=t.overhead_s * 1e6,
      host_bound=t.host_bound,
      timer=t.method,
      calls=t.calls,
      tbps=costs["bytes"] / t.median_s / 1e12,
      tflops=costs["flops"] / t.median_s / 1e12,
      roofline_pct=100.0 * roofline_s / t.median_s,
  )
  if "rel_err" in row:
    row["check_ok"] = bool(row["rel_err"] <= TOLERANCE[case.dtype])
  return row


def run_case(case: Case, sweep: Sweep, key: jax.Array) -> tuple[list[dict], dict]:
  """All impls on one case: (rows, case info)."""
  key_len, key_in = jax.random.split(key)
  lengths = make_lengths(case, key_len)
  total_keys = int(jnp.sum(lengths))
  attended_keys = case.attended_keys(lengths)
  costs = case.costs(attended_keys)
  num_sets = timing.num_rotating_sets(case.rotation_bytes(costs["kv_bytes"]),
                                      sweep.rotate_bytes)
  input_sets = make_input_sets(case, key_in, lengths, num_sets)
  ref, ref_source = None, "-"
  if sweep.check:
    ref, ref_source = reference_output(case, input_sets[0])
  info = {**dataclasses.asdict(case), **costs, "total_keys": total_keys,
          "attended_keys": attended_keys, "num_sets": num_sets,
          "reference": ref_source}
  rows = []
  for impl in sweep.impls:
    row = run_impl(impl, case, sweep, input_sets, ref, costs)
    rows.append({**info, **row})
  return rows, info


# ------------------------------------------------------------------ output

_HEADER = (f"{'impl':<17}{'time us':>10}{'TB/s':>8}{'TFLOP/s':>9}{'roofline':>10}"
           f"{'rel err':>10}  note")


def format_table(info: dict, rows: Sequence[dict]) -> str:
  lengths = ("ragged" if info["ragged"] else "full") + f" ({info['total_keys']} keys"
  if info["attended_keys"] != info["total_keys"]:
    lengths += f", {info['attended_keys']} in the window"
  lengths += ")"
  title = (f"== {Case(**{f.name: info[f.name] for f in dataclasses.fields(Case)}).describe()}"
           f"  lengths={lengths}  KV {info['kv_bytes'] / 1e6:.1f} MB"
           f"  sets={info['num_sets']}  check: {info['reference']}")
  lines = [title, _HEADER]
  for row in rows:
    if row["status"] != "ok":
      lines.append(f"{row['impl']:<17}{row['status']} ({row['reason']})")
      continue
    err = "-"
    notes = []
    if "rel_err" in row:
      err = f"{row['rel_err']:.1e}"
      if row["ours"] and not row["check_ok"]:
        notes.append(f"CHECK FAILED (> {TOLERANCE[info['dtype']]:g})")
    if row.get("auto_choice"):
      notes.append(f"auto -> {row['auto_choice']}")
    if row["host_bound"]:
      notes.append(f"host-bound? (enqueue {row['overhead_us']:.1f} us/call)")
    if row["timer"] != "chain-diff":
      notes.append(row["timer"])
    lines.append(
        f"{row['impl']:<17}{row['time_us']:>10.2f}{row['tbps']:>8.3f}"
        f"{row['tflops']:>9.2f}{row['roofline_pct']:>9.1f}%{err:>10}  "
        + "; ".join(notes))
  return "\n".join(lines)


def device_description() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()}"


def _is_scalar(value: Any) -> bool:
  return value is None or isinstance(value, (str, bool, int, float))


def write_csv(rows: Sequence[dict], path: str) -> None:
  """One line per row; the columns are the rows' scalar fields, in first-seen order."""
  columns: dict[str, None] = {}
  for row in rows:
    columns.update((k, None) for k, v in row.items() if _is_scalar(v))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})


def _plot_group(rows: Sequence[dict], x: str, fixed: str) -> tuple[list[dict], str]:
  """The ok rows along `x` at the `fixed` value with the most distinct x (ties: the
  largest); all rows if no value has two. Returns (rows, a label of the subset)."""
  by_fixed: dict[int, set[int]] = {}
  for r in rows:
    by_fixed.setdefault(r[fixed], set()).add(r[x])
  best = max(by_fixed, key=lambda v: (len(by_fixed[v]), v))
  if len(by_fixed[best]) < 2:
    return list(rows), f"all cases ({fixed} varies)"
  return [r for r in rows if r[fixed] == best], f"{fixed}={best}"


def plot_available() -> bool:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def write_plot(rows: Sequence[dict], path: str) -> None:
  """TB/s against context length per impl; a second panel against batch when the
  rows have several batches. Needs matplotlib (the `plot` extra)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  ok = [r for r in rows if r.get("status") == "ok"]
  panels = [("seq_len", "batch", "context length (tokens)")]
  if len({r["batch"] for r in ok}) > 1:
    panels.append(("batch", "seq_len", "batch"))
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
  impls = list(dict.fromkeys(r["impl"] for r in ok))
  for ax, (x, fixed, xlabel) in zip(axes[0], panels):
    group, subset = _plot_group(ok, x, fixed) if ok else ([], "no rows")
    # Across varying `fixed` values a connecting line would zigzag: markers only.
    style = "" if subset.startswith("all cases") else "-"
    for impl in impls:
      points = sorted((r[x], r["tbps"]) for r in group if r["impl"] == impl)
      if points:
        ax.plot(*zip(*points), marker="o", linestyle=style, label=impl)
    if group:
      ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TB/s of KV read")
    ax.set_title(subset)
    ax.grid(True, alpha=0.3)
    if impls:
      ax.legend(fontsize="small")
  if ok:
    case = Case(**{f.name: ok[0][f.name] for f in dataclasses.fields(Case)
                   if f.name in ok[0]})
    heads = case.describe().split(" ", 3)[3]  # without op, B and T
    fig.suptitle(f"{case.op} {heads}  ({ok[0].get('device', '')})", fontsize="medium")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(sweep: Sweep | None = None, *, json_path: str | None = None,
        csv_path: str | None = None, plot_path: str | None = None,
        out: TextIO | None = None, **overrides: Any) -> list[dict]:
  """Runs a sweep, prints one table per case to `out`, returns all rows.

  Also writes the rows as JSON to `json_path`, CSV to `csv_path` and a PNG plot to
  `plot_path` (if matplotlib is installed; else one line says so).

  `sweep` defaults to `default_sweep(overrides.get("op", "decode"))`; keyword
  overrides replace its fields, e.g. `run(op="paged", cases=((2, 256),))`.
  """
  out = sys.stdout if out is None else out
  if sweep is None:
    sweep = default_sweep(overrides.get("op", "decode"))
  if overrides:
    sweep = dataclasses.replace(sweep, **overrides)
  device = device_description()
  print(f"# pallas_kv decode benchmark  device={device}  jax={jax.__version__}  "
        f"warmup={sweep.warmup} iters={sweep.iters} repeats={sweep.repeats}",
        file=out, flush=True)
  all_rows = []
  date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
  key = jax.random.key(sweep.seed)
  for batch, seq_len in sweep.cases:
    key, case_key = jax.random.split(key)
    case = Case.from_sweep(sweep, batch, seq_len)
    rows, info = run_case(case, sweep, case_key)
    print(format_table(info, rows), file=out, flush=True)
    print(file=out, flush=True)
    all_rows.extend({**r, "device": device, "jax_version": jax.__version__,
                     "date": date} for r in rows)
    if json_path:  # after every case: a run cut short keeps the cases it finished
      with open(json_path, "w") as f:
        json.dump(all_rows, f, indent=1)
  if json_path:
    print(f"# wrote {len(all_rows)} rows to {json_path}", file=out, flush=True)
  if csv_path:
    write_csv(all_rows, csv_path)
    print(f"# wrote {len(all_rows)} rows to {csv_path}", file=out, flush=True)
  if plot_path:
    if plot_available():
      write_plot(all_rows, plot_path)
      print(f"# wrote the plot to {plot_path}", file=out, flush=True)
    else:
      print("# --plot: matplotlib (the plot extra, pip install -e '.[plot]') is not "
            "installed; no plot written", file=out, flush=True)
  return all_rows


def failed_rows(rows: Sequence[dict]) -> list[dict]:
  """pallas_kv rows that errored (not n/a) or failed the numerics check."""
  return [r for r in rows if r["ours"] and
          (r["status"] == "error" or r.get("check_ok") is False)]


# ------------------------------------------------------------------ flags

_OP = flags.DEFINE_enum("op", "decode", OPS, "Which op: dense, paged or MLA.")
_IMPL = flags.DEFINE_list(
    "impl", None, f"Impls to run, from {','.join(ALL_IMPLS)}. Default: CPU "
    f"{','.join(CPU_IMPLS)}; GPU per op, e.g. {','.join(GPU_IMPLS['decode'])}.")
_CASES = flags.DEFINE_list(
    "cases", None, "Cases as BATCHxSEQ_LEN, e.g. 1x32768,8x8192; overrides "
    "--batch/--seq_len. Default: CPU 2x256; GPU the H200 sweep.")
_BATCH = flags.DEFINE_list("batch", None, "Batch sizes (crossed with --seq_len).")
_SEQ_LEN = flags.DEFINE_list("seq_len", None, "KV lengths (crossed with --batch).")
_NUM_HEADS = flags.DEFINE_integer("num_heads", None, "Query heads (CPU 4, GPU 32, MLA 128).")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", None, "KV heads (CPU 2, GPU 8).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", None, "Head dim (CPU 64, GPU 128).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 1, "New tokens per sequence (S).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", None, "Page size (paged 16, MLA 64).")
_SHUFFLE = flags.DEFINE_boolean("shuffle_pages", True,
                                "Block tables are a random permutation of pages.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", DTYPES, "Input dtype.")
_RAGGED = flags.DEFINE_boolean("ragged", False,
                               "Random lengths in [num_queries, seq_len].")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of inputs and lengths.")
_WARMUP = flags.DEFINE_integer("warmup", None, "Warm-up calls (CPU 1, GPU 5).")
_ITERS = flags.DEFINE_integer("iters", None, "Calls per timed loop (CPU 3, GPU 20).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timed loops; median taken (CPU 3, GPU 10).")
_ROTATE_BYTES = flags.DEFINE_float(
    "rotate_bytes", None, "Rotate among input sets until their KV totals this "
    "many bytes (L2 defeat). Default: CPU 0 (off), GPU 1.8e8.")
_JSON = flags.DEFINE_string("json", None, "Write all rows as a JSON list here.")
_CHECK = flags.DEFINE_boolean("check", True, "Compare each output to the reference.")
_STRICT = flags.DEFINE_boolean("strict", False, "Raise instead of printing n/a rows.")
_PEAK_TBPS = flags.DEFINE_float("peak_tbps", PEAK_TBPS, "Roofline HBM read TB/s.")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", PEAK_TFLOPS, "Roofline TFLOP/s.")
_MLA_QK_DIM = flags.DEFINE_integer("mla_qk_dim", MLA_QK_DIM, "MLA q/k dim (latent+rope).")
_MLA_V_DIM = flags.DEFINE_integer("mla_v_dim", MLA_V_DIM, "MLA value dim.")
_SOFTCAP = flags.DEFINE_float(
    "softcap", None, "Logit soft cap (logits -> c * tanh(logits / c)); decode and paged. "
    "Peers that cannot express it report n/a.")
_WINDOW = flags.DEFINE_integer(
    "window", None, "Sliding window: a query at p sees keys in (p - window, p]; decode "
    "and paged. Bytes and flops count only the keys in the window.")
_SINKS = flags.DEFINE_boolean(
    "sinks", False, "Random float32 per-head sink logits (gpt-oss); decode and paged.")
_CSV = flags.DEFINE_string("csv", None, "Write the rows' scalar fields as CSV here.")
_PLOT = flags.DEFINE_string(
    "plot", None, "Write a PNG of TB/s against context length (and batch) per impl "
    "here; needs matplotlib (the plot extra).")


def _ints(values: Sequence[str], name: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise ValueError(f"--{name}={','.join(values)} must be integers") from None


def sweep_from_flags() -> Sweep:
  """The Sweep the parsed flags ask for; unset flags take `default_sweep`'s value."""
  base = default_sweep(_OP.value)
  fields: dict[str, Any] = {
      "num_queries": _NUM_QUERIES.value, "shuffle_pages": _SHUFFLE.value,
      "dtype": _DTYPE.value, "ragged": _RAGGED.value, "seed": _SEED.value,
      "check": _CHECK.value, "strict": _STRICT.value,
      "peak_tbps": _PEAK_TBPS.value, "peak_tflops": _PEAK_TFLOPS.value,
      "mla_qk_dim": _MLA_QK_DIM.value, "mla_v_dim": _MLA_V_DIM.value,
      "softcap": _SOFTCAP.value, "window": _WINDOW.value, "sinks": _SINKS.value,
  }
  optional = {"num_heads": _NUM_HEADS, "num_kv_heads": _NUM_KV_HEADS,
              "head_dim": _HEAD_DIM, "page_size": _PAGE_SIZE, "warmup": _WARMUP,
              "iters": _ITERS, "repeats": _REPEATS, "rotate_bytes": _ROTATE_BYTES}
  fields.update({k: f.value for k, f in optional.items() if f.value is not None})
  if _IMPL.value is not None:
    fields["impls"] = tuple(_IMPL.value)
  if _CASES.value is not None:
    fields["cases"] = parse_cases(_CASES.value)
  elif _BATCH.value is not None or _SEQ_LEN.value is not None:
    batches = (_ints(_BATCH.value, "batch") if _BATCH.value is not None
               else tuple(dict.fromkeys(b for b, _ in base.cases)))
    seq_lens = (_ints(_SEQ_LEN.value, "seq_len") if _SEQ_LEN.value is not None
                else tuple(dict.fromkeys(t for _, t in base.cases)))
    fields["cases"] = cross_cases(batches, seq_lens)
  return dataclasses.replace(base, **fields)


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    sweep = sweep_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  rows = run(sweep, json_path=_JSON.value, csv_path=_CSV.value, plot_path=_PLOT.value)
  failed = failed_rows(rows)
  for r in failed:
    print(f"FAILED: {r['impl']} on {r['op']} B={r['batch']} T={r['seq_len']}: "
          f"{r.get('reason') or 'rel_err %.3g' % r['rel_err']}", file=sys.stderr)
    if r.get("traceback"):
      print(r["traceback"], file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
