"""Every impl a benchmark row can name: the peers of decode attention, run side by side with
pallas_kv, and pallas_kv's own impls (OUR_IMPLS, the values of its `impl=` argument).
`build_runner(impl, spec)` builds the `Runner` of either.

Each peer's `build_*` function takes an `OpSpec` and returns a `Runner` that accepts the
same inputs as the pallas_kv op (one input set at a time, in pallas_kv layouts:
q [B, Hq, D] or [B, S, Hq, D]; dense k, v [B, T, Hkv, D]; pages [P, page, Hkv, D];
MLA kv_pages [P, page, Dqk]) and returns the output in the pallas_kv layout. With
`OpSpec.sinks` every input set ends with one more array, the per-head sink logits
(float32 [Hq]). A peer that cannot run raises: `PeerUnavailable` when something it
needs is missing (torch, a GPU) or when it cannot express an attention option of
the spec (softcap, window, sinks: the row is n/a, never plain attention passed off
as the option), `NotImplementedError` when it doesn't support the op or shape.

Peers:
  xla_einsum        plain jnp einsum + softmax in the input dtype (paged: gather
                    the pages first), the naive XLA baseline; every op and option.
  cudnn             jax.nn.dot_product_attention(implementation="cudnn"), the new
                    tokens as queries with key padding from `lengths`; dense only.
  torch             torch.nn.functional.scaled_dot_product_attention(enable_gqa=...)
                    on [B, H, T, D] copies of the inputs; dense only.
  jax_pallas_gqa    jax's deprecated Pallas Triton decode kernel
                    (jax.experimental.pallas.ops.gpu.decode_attention.gqa); dense, S=1.
  jax_pallas_paged  jax's deprecated Pallas Triton paged kernel
                    (jax.experimental.pallas.ops.gpu.paged_attention); paged, S=1.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

OPS = ("decode", "paged", "mla")


class PeerUnavailable(RuntimeError):
  """A peer's dependency (a package, a GPU) is missing on this machine."""


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """What a peer needs to know about the op beyond the arrays' shapes."""

  op: str  # "decode" (dense), "paged" or "mla"
  num_queries: int = 1  # S; with S == 1 q is [B, Hq, D], else [B, S, Hq, D]
  full_lengths: bool = True  # every sequence at full capacity (no padding mask needed)
  v_head_dim: int | None = None  # MLA: V is kv[..., :v_head_dim]
  softcap: float | None = None  # logits -> softcap * tanh(logits / softcap)
  window: int | None = None  # a query at position p sees keys in (p - window, p]
  sinks: bool = False  # the last input is a float32 [Hq] array of per-head sink logits
  kv_scales: bool = False  # a one-byte cache: k_scale, v_scale follow the op's inputs (before sinks)

  @property
  def options(self) -> tuple[str, ...]:
    """The attention options set, e.g. ("softcap=50", "sinks")."""
    named = []
    if self.softcap is not None:
      named.append(f"softcap={self.softcap:g}")
    if self.window is not None:
      named.append(f"window={self.window}")
    if self.sinks:
      named.append("sinks")
    if self.kv_scales:
      named.append("kv_scales")
    return tuple(named)

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"{self.op=} must be one of {OPS}")
    if self.num_queries < 1:
      raise ValueError(f"{self.num_queries=} must be >= 1")
    if self.op == "mla" and not self.v_head_dim:
      raise ValueError(f"{self.v_head_dim=} must be set for op='mla'")
    if self.op == "mla" and self.options:
      raise ValueError(f"op='mla' takes no attention options; got {self.options}")


def _identity(args: tuple) -> tuple:
  return args


def _jax_to_numpy(out: Any) -> np.ndarray:
  return np.asarray(jnp.asarray(out, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Runner:
  """A callable under test plus how to feed it, time it and read its output."""

  fn: Callable[..., Any]  # fn(*prepared_args) -> output; traceable if timer == "jax"
  prepare: Callable[[tuple], tuple] = _identity  # untimed: op inputs -> fn's args
  to_numpy: Callable[[Any], np.ndarray] = _jax_to_numpy  # output in op layout, f32
  timer: str = "jax"  # key of benchmarks.timing.TIMERS and HOST_LOOP_TIMERS


def require_gpu(name: str) -> None:
  backend = jax.default_backend()
  if backend != "gpu":
    raise PeerUnavailable(f"{name} needs a CUDA GPU; jax backend is {backend!r}")


def _quiet(fn: Callable[..., Any]) -> Callable[..., Any]:
  """fn, with DeprecationWarnings hidden (deprecated jax ops warn when lowered)."""

  def quiet_fn(*args):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return fn(*args)

  return quiet_fn


def reject_options(name: str, spec: OpSpec) -> None:
  """Raises PeerUnavailable if `spec` asks for options the peer `name` cannot express."""
  if spec.options:
    raise PeerUnavailable(f"{name} peer cannot express {', '.join(spec.options)}")


def _import_deprecated_jax_op(name: str):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def query_positions(lengths: jax.Array, num_queries: int) -> jax.Array:
  """[B, S] absolute position of each new token: the last S of lengths[b]."""
  return lengths[:, None] - num_queries + jnp.arange(num_queries)[None, :]


def visible_mask(lengths: jax.Array, num_queries: int, capacity: int,
                 window: int | None = None) -> jax.Array:
  """[B, S, T] bool: key t is visible to query s (causal, within the length and window)."""
  pos = query_positions(lengths, num_queries)[:, :, None]
  t = jnp.arange(capacity)[None, None, :]
  mask = t <= pos
  if window is not None:
    mask &= t > pos - window
  return mask


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
  """[P, page, ...] pages + [B, n] table -> contiguous [B, n * page, ...]."""
  gathered = pages[block_tables]  # [B, n, page, ...]
  b, n, page = gathered.shape[:3]
  return gathered.reshape(b, n * page, *gathered.shape[3:])


def einsum_attention(q, k, v, lengths, *, scale: float | None = None,
                     softcap: float | None = None, window: int | None = None,
                     sinks: jax.Array | None = None):
  """Naive attention in the input dtype. q [B,S,Hq,D]; k [B,T,Hkv,D]; v [B,T,Hkv,Dv].

  softcap, window: as in pallas_kv; sinks [Hq]: per-head logit of a virtual key
  with no value that joins the softmax denominator.
  """
  b, s, hq, d = q.shape
  t, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  qg = q.reshape(b, s, hkv, g, d)
  logits = jnp.einsum("bskgd,btkd->bkgst", qg, k) * jnp.asarray(scale, q.dtype)
  if softcap is not None:
    cap = jnp.asarray(softcap, logits.dtype)
    logits = cap * jnp.tanh(logits / cap)
  mask = visible_mask(lengths, s, t, window)[:, None, None]  # [B, 1, 1, S, T]
  logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  if sinks is not None:  # one more column, dropped after the softmax
    sink = jnp.broadcast_to(sinks.astype(logits.dtype).reshape(1, hkv, g, 1, 1),
                            (b, hkv, g, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :t]
  else:
    probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
  return out.reshape(b, s, hq, v.shape[-1])


def _as_4d(fn4: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """Lifts fn(q4, ...) on [B, S, Hq, D] queries to also take [B, Hq, D]."""

  def fn(q, *args):
    if q.ndim == 3:
      return fn4(q[:, None], *args)[:, 0]
    return fn4(q, *args)

  return fn


def build_xla_einsum(spec: OpSpec) -> Runner:
  attend = functools.partial(einsum_attention, softcap=spec.softcap, window=spec.window)
  if spec.op == "decode":
    def fn4(q, k, v, lengths, sinks=None):
      return attend(q, k, v, lengths, sinks=sinks)
  elif spec.op == "paged":
    def fn4(q, k_pages, v_pages, block_tables, lengths, sinks=None):
      k = gather_pages(k_pages, block_tables)
      v = gather_pages(v_pages, block_tables)
      return attend(q, k, v, lengths, sinks=sinks)
  else:  # mla
    dv = spec.v_head_dim

    def fn4(q, kv_pages, block_tables, lengths):
      kv = gather_pages(kv_pages, block_tables)[:, :, None, :]  # [B, T, 1, Dqk]
      return einsum_attention(q, kv, kv[..., :dv], lengths)
  return Runner(fn=jax.jit(_as_4d(fn4)))


def build_cudnn(spec: OpSpec) -> Runner:
  if spec.op != "decode":
    raise NotImplementedError("cudnn peer: dense KV only (op=decode)")
  reject_options("cudnn", spec)
  require_gpu("cudnn")

  def fn4(q, k, v, lengths):
    b, s = q.shape[:2]
    mask = None
    if s > 1:  # the S new tokens are the last S: bottom-right-aligned causal
      mask = visible_mask(lengths, s, k.shape[1])[:, None]  # [B, 1, S, T]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask,
        query_seq_lengths=jnp.full((b,), s, jnp.int32),
        key_value_seq_lengths=lengths.astype(jnp.int32),
        implementation="cudnn")

  return Runner(fn=jax.jit(_as_4d(fn4)))


def _import_torch():
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise PeerUnavailable(f"torch not importable ({e})") from None
  if not torch.cuda.is_available():
    raise PeerUnavailable("torch sees no CUDA device")
  return torch


def build_torch(spec: OpSpec) -> Runner:
  if spec.op != "decode":
    raise NotImplementedError("torch peer: dense KV only (op=decode)")
  reject_options("torch", spec)
  torch = _import_torch()
  sdpa = torch.nn.functional.scaled_dot_product_attention
  squeeze = spec.num_queries == 1

  def prepare(args):
    q, k, v, lengths = jax.block_until_ready(args)
    if q.ndim == 3:
      q = q[:, None]
    s, t = q.shape[1], k.shape[1]
    tq = torch.from_dlpack(q).transpose(1, 2).contiguous()  # [B, Hq, S, D]
    tk = torch.from_dlpack(k).transpose(1, 2).contiguous()  # [B, Hkv, T, D]
    tv = torch.from_dlpack(v).transpose(1, 2).contiguous()
    mask = None
    if not (spec.full_lengths and s == 1):  # [B, 1, S, T], True = attend
      tl = torch.as_tensor(np.asarray(lengths), device=tk.device)
      pos = tl[:, None] - s + torch.arange(s, device=tk.device)[None, :]
      mask = torch.arange(t, device=tk.device)[None, None, :] <= pos[:, :, None]
      mask = mask[:, None]
    return tq, tk, tv, mask

  def fn(tq, tk, tv, mask):
    return sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=tq.shape[1] != tk.shape[1])

  def to_numpy(out):
    out = out.transpose(1, 2)  # [B, S, Hq, Dv]
    if squeeze:
      out = out[:, 0]
    return out.float().cpu().numpy()

  return Runner(fn=fn, prepare=prepare, to_numpy=to_numpy, timer="torch")


def build_jax_pallas_gqa(spec: OpSpec) -> Runner:
  if spec.op != "decode":
    raise NotImplementedError("jax_pallas_gqa peer: dense KV only (op=decode)")
  if spec.num_queries != 1:
    raise NotImplementedError("jax_pallas_gqa peer: one query per sequence only")
  reject_options("jax_pallas_gqa", spec)
  require_gpu("jax_pallas_gqa")
  mod = _import_deprecated_jax_op("decode_attention")

  def fn(q, k, v, lengths):
    return mod.gqa(q, k, v, kv_seq_len=lengths)

  return Runner(fn=_quiet(jax.jit(fn)))


def largest_divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def build_jax_pallas_paged(spec: OpSpec) -> Runner:
  if spec.op != "paged":
    raise NotImplementedError("jax_pallas_paged peer: paged KV only (op=paged)")
  if spec.num_queries != 1:
    raise NotImplementedError("jax_pallas_paged peer: one query per sequence only")
  reject_options("jax_pallas_paged", spec)
  require_gpu("jax_pallas_paged")
  mod = _import_deprecated_jax_op("paged_attention")

  def prepare(args):
    q, k_pages, v_pages, block_tables, lengths = args
    # That kernel does not scale the logits, and wants head-major pages.
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    k_pages = jnp.transpose(k_pages, (2, 0, 1, 3))  # [Hkv, P, page, D]
    v_pages = jnp.transpose(v_pages, (2, 0, 1, 3))
    return q, k_pages, v_pages, block_tables, lengths

  def fn(q, k_pages, v_pages, block_tables, lengths):
    pages_per_seq = block_tables.shape[1]
    k_splits = largest_divisor_at_most(pages_per_seq, 16)
    per_split = pages_per_seq // k_splits
    return mod.paged_attention(
        q, k_pages, v_pages, block_tables, lengths, k_splits=k_splits,
        pages_per_compute_block=largest_divisor_at_most(per_split, 8))

  return Runner(fn=_quiet(jax.jit(fn)), prepare=prepare)


PEERS: dict[str, Callable[[OpSpec], Runner]] = {
    "xla_einsum": build_xla_einsum,
    "cudnn": build_cudnn,
    "torch": build_torch,
    "jax_pallas_gqa": build_jax_pallas_gqa,
    "jax_pallas_paged": build_jax_pallas_paged,
}


# ------------------------------------------------------------------ every impl a row can name
# pallas_kv's own impls are the values of its `impl=` argument; the peers are PEERS above.

OUR_IMPLS = ("auto", "mosaic_gpu", "triton", "xla")
KERNEL_IMPLS = ("mosaic_gpu", "triton")   # run a GPU kernel: on a CPU only in interpret mode
ALL_IMPLS = OUR_IMPLS + tuple(PEERS)


def import_pallas_kv():
  """pallas_kv, or PeerUnavailable saying why it cannot be imported (its rows read n/a)."""
  try:
    import pallas_kv  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise PeerUnavailable(f"pallas_kv not importable ({e})") from None
  return pallas_kv


def with_options(fn, spec: OpSpec):
  """fn(*op_args, [k_scale, v_scale], [sinks]) calling a pallas_kv function with the spec's
  attention options."""
  if spec.op == "mla":
    return fn
  fn = functools.partial(fn, softcap=spec.softcap, window=spec.window)
  if not spec.sinks and not spec.kv_scales:
    return fn

  def with_extras(*args):  # the scales, then the sinks array, come last
    kw = {}
    if spec.sinks:
      args, kw["sinks"] = args[:-1], args[-1]
    if spec.kv_scales:
      args, kw["k_scale"], kw["v_scale"] = args[:-2], args[-2], args[-1]
    return fn(*args, **kw)

  return with_extras


def build_pallas_kv(impl: str, spec: OpSpec, **op_kwargs) -> Runner:
  """A runner for pallas_kv's own op with `impl=impl`, the spec's options and op_kwargs;
  PeerUnavailable for a kernel impl on a CPU outside interpret mode (the machine cannot run it)."""
  pkv = import_pallas_kv()
  if impl in KERNEL_IMPLS and jax.default_backend() == "cpu" and not pkv.runtime.interpret_enabled():
    raise PeerUnavailable(pkv.runtime.cpu_without_interpret_message(impl))
  fn = {
      "decode": pkv.decode_attention,
      "paged": pkv.paged_decode_attention,
      "mla": functools.partial(pkv.mla_decode_attention, v_head_dim=spec.v_head_dim),
  }[spec.op]
  return Runner(fn=jax.jit(with_options(functools.partial(fn, impl=impl, **op_kwargs), spec)))


def auto_choice() -> str | None:
  """The backend pallas_kv's impl="auto" picked in the latest trace, if it says."""
  last_impl = getattr(import_pallas_kv(), "last_impl", None)
  return last_impl() if callable(last_impl) else None


def build_runner(impl: str, spec: OpSpec) -> Runner:
  """The Runner of any impl in ALL_IMPLS: pallas_kv's own (`build_pallas_kv`) or a peer's."""
  if impl in OUR_IMPLS:
    return build_pallas_kv(impl, spec)
  if impl in PEERS and spec.kv_scales:
    raise PeerUnavailable("int8 / fp8 caches with scales: no peer of this benchmark takes them")
  if impl in PEERS:
    return PEERS[impl](spec)
  raise ValueError(f"unknown impl {impl!r}; choose from {ALL_IMPLS}")
