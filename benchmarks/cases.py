"""What a benchmark runs: a `Sweep` of `Case`s, their inputs, bytes and flops, and the reference.

A `Sweep` is the resolved flags of one run of benchmarks.decode (also tune and tools.profile_kernel);
a `Case` is one op x batch x seq_len of it. Every output is checked against pallas_kv's float32
reference on float32-upcast inputs: `reference_output`, `relative_error`, `TOLERANCE`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import peers
from benchmarks import timing

OPS = peers.OPS
DTYPES = ("bfloat16", "float16", "float32")
# Relative error allowed for pallas_kv's outputs (DESIGN.md); peers are reported only.
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
# One-byte caches (--kv_dtype), stored with a float32 scale per token and kv head.
KV_QUANTIZED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
SCALE_BYTES = 4


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
  kv_dtype: str | None = None  # the cache's dtype if not `dtype`: int8 / fp8 with per-token scales
  length: int | None = None  # every sequence this long in each case's capacity (a short sequence's fixed costs)

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"{self.op=} must be one of {OPS}")
    unknown = [i for i in self.impls if i not in peers.ALL_IMPLS]
    if unknown or not self.impls:
      raise ValueError(f"{self.impls=}: unknown {unknown}; choose from {peers.ALL_IMPLS}")
    if self.dtype not in DTYPES:
      raise ValueError(f"{self.dtype=} must be one of {DTYPES}")
    if self.kv_dtype is not None and self.kv_dtype not in DTYPES + KV_QUANTIZED_DTYPES:
      raise ValueError(f"{self.kv_dtype=} must be one of {DTYPES + KV_QUANTIZED_DTYPES}")
    if self.op == "mla" and self.kv_dtype not in (None, self.dtype, "float8_e4m3fn"):
      raise ValueError(f"op='mla' takes kv_dtype float8_e4m3fn or none; got {self.kv_dtype=}")
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
    if self.length is not None and (self.ragged or not all(self.num_queries <= self.length <= t
                                                           for _, t in self.cases)):
      raise ValueError(f"length={self.length}: every sequence's length, at least num_queries={self.num_queries} and "
                       f"at most each case's seq_len ({[t for _, t in self.cases]}), and not with ragged")


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
  kv_dtype: str | None = None  # None: `dtype`
  length: int | None = None  # every sequence this long (< seq_len); None: seq_len, or ragged

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
        softcap=sweep.softcap, window=sweep.window, sinks=sweep.sinks,
        kv_dtype=None if sweep.kv_dtype in (None, sweep.dtype) else sweep.kv_dtype,
        length=None if sweep.length == seq_len else sweep.length)

  @classmethod
  def from_row(cls, row: dict) -> Case:
    """The case a benchmark row (or its case info) was run on."""
    return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})

  @property
  def itemsize(self) -> int:
    """Bytes of one cache element."""
    return jnp.dtype(self.kv_dtype or self.dtype).itemsize

  @property
  def quantized(self) -> bool:
    """A one-byte cache with per-token float32 scales (k_scale, v_scale inputs)."""
    return self.kv_dtype in KV_QUANTIZED_DTYPES

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
    scales = (1 if self.op == "mla" else 2 * self.num_kv_heads) * SCALE_BYTES if self.quantized else 0
    return tokens * (per_token * self.itemsize + scales)

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
    if self.op == "mla":  # one latent row per token (and its scale), read once for K and V
      kv = total_keys * (self.head_dim * self.itemsize + (SCALE_BYTES if self.quantized else 0))
    else:   # K and V of each kv head, and their per-token scales in a quantized cache
      per_head = self.head_dim * self.itemsize + (SCALE_BYTES if self.quantized else 0)
      kv = total_keys * self.num_kv_heads * 2 * per_head
    rows = self.batch * self.num_queries * self.num_heads
    q_out = rows * (self.head_dim + self.v_head_dim) * jnp.dtype(self.dtype).itemsize
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
    cache = f" cache={self.kv_dtype}" if self.kv_dtype else ""
    return (f"{self.op} B={self.batch} T={self.seq_len} {heads} "
            f"S={self.num_queries} {self.dtype}{cache}{paged}{options}")


def make_lengths(case: Case, key: jax.Array) -> jax.Array:
  """int32 [B]: all at seq_len (or case.length), or (ragged) uniform in [num_queries, seq_len]."""
  if not case.ragged:
    return jnp.full((case.batch,), case.seq_len if case.length is None else case.length, jnp.int32)
  return jax.random.randint(key, (case.batch,), case.num_queries, case.seq_len + 1,
                            dtype=jnp.int32)


def make_inputs(case: Case, key: jax.Array, lengths: jax.Array) -> tuple:
  """Random inputs of the op, in pallas_kv's argument order; a quantized cache's k_scale and
  v_scale (per token, from quantizing normal values) follow."""
  args = _make_op_inputs(case, key, lengths)
  if not case.quantized:
    return args
  quantize = peers.import_pallas_kv().cache.quantize
  if case.op == "mla":   # the latent pool [P, page_size, Dqk], one scale per token: kv_scale last
    pages, kv_scale = quantize(args[1], case.kv_dtype)
    return (args[0], pages, *args[2:], kv_scale)
  (k, k_scale), (v, v_scale) = (quantize(x, case.kv_dtype) for x in args[1:3])
  return (args[0], k, v) + args[3:] + (k_scale, v_scale)


@functools.partial(jax.jit, static_argnums=0)
def _make_op_inputs(case: Case, key: jax.Array, lengths: jax.Array) -> tuple:
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


def with_v_tokens_last(args: tuple) -> tuple:
  """An input set (q, k, v, ...) with v stored tokens last (`decode_attention(..., v_tokens_last=True)`)."""
  relaid_v = peers.import_pallas_kv().validation.relaid_v
  return (*args[:2], relaid_v(args[2], tokens_last=True), *args[3:])


def _upcast(args: tuple) -> tuple:
  return tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
               for a in args)


def reference_chunk(case: Case) -> int:
  """Sequences per reference call: the largest divisor of B whose float32 KV and
  logits fit in REFERENCE_CHUNK_BYTES (at least 1)."""
  tokens = case.kv_capacity_bytes // case.itemsize // case.batch  # KV elements
  logits = case.pages_per_seq * case.page_size if case.op != "decode" else case.seq_len
  per_seq = 4 * (tokens + 2 * logits * case.num_heads * case.num_queries)
  return peers.largest_divisor_at_most(case.batch, max(1, REFERENCE_CHUNK_BYTES // per_seq))


def _batch_slice(case: Case, args: tuple, b0: int, b1: int) -> tuple:
  """The inputs of sequences [b0, b1); paged: their pages (and per-token scales), gathered in
  table order."""
  extra = args[-1:] if case.sinks else ()
  op_args = args[:-1] if case.sinks else args
  scales = op_args[-2:] if case.quantized else ()
  op_args = op_args[:-2] if case.quantized else op_args
  q, lengths = op_args[0][b0:b1], op_args[-1][b0:b1]
  if case.op == "decode":
    return (q, op_args[1][b0:b1], op_args[2][b0:b1], lengths) + tuple(s[b0:b1] for s in scales) + extra
  tables = op_args[-2][b0:b1]
  own_tables = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape)
  pools = tuple(pool[tables.reshape(-1)] for pool in op_args[1:-2])
  scales = tuple(s[tables.reshape(-1)] for s in scales)
  return (q,) + pools + (own_tables, lengths) + scales + extra


def reference_output(case: Case, args: tuple) -> tuple[np.ndarray, str]:
  """Float32 reference on float32-upcast inputs, and which reference ran.

  Runs over batch chunks (`reference_chunk`) so its float32 copies stay small.
  """
  try:
    pkv = peers.import_pallas_kv()
    ref = peers.with_options({
        "decode": pkv.decode_attention_reference,
        "paged": pkv.paged_decode_attention_reference,
        "mla": functools.partial(pkv.mla_decode_attention_reference,
                                 v_head_dim=case.v_head_dim),
    }[case.op], op_spec(case))
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


def relative_error(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64 (any arrays of one shape)."""
  out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if out64.shape != ref64.shape:
    raise ValueError(f"output shape {out64.shape} != reference shape {ref64.shape}")
  return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def op_spec(case: Case) -> peers.OpSpec:
  return peers.OpSpec(op=case.op, num_queries=case.num_queries,
                      full_lengths=not case.ragged and case.length is None,
                      v_head_dim=case.v_head_dim if case.op == "mla" else None,
                      softcap=case.softcap, window=case.window, sinks=case.sinks,
                      kv_scales=case.quantized)
