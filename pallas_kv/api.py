"""Public ops: validate, pick a backend and a config, run the kernels, combine.

`impl` chooses the backend:
  "xla"         plain XLA ops (`pallas_kv.xla`, float32 math), cast to q's dtype; runs anywhere.
  "mosaic_gpu"  Mosaic GPU kernels (Hopper and newer).
  "triton"      Pallas Triton kernels (portable GPUs).
  "auto"        the fastest backend that serves the request on the local device, else "xla".
A kernel backend that cannot serve a request raises NotImplementedError saying why; only "auto"
moves on to the next one, and `last_impl()` tells which one it picked.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from pallas_kv import batching
from pallas_kv import runtime
from pallas_kv import shared_prefix as sharing
from pallas_kv import tuned
from pallas_kv import validation
from pallas_kv import varlen
from pallas_kv import xla
from pallas_kv import config as kernel_configs
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels.frame import MAX_GROUP
from pallas_kv.kernels.plan import SplitPlan

IMPLS = ("auto", "mosaic_gpu", "triton", "xla")
# The order "auto" tries them where the tuned file has not timed both on the shape. Triton first:
# on the H200 it measured faster than Mosaic GPU on every GQA row where the two ran in one run
# (benchmarks/RESULTS.md): dense 32/8 at B1-B128 (2.68-4.13 TB/s against 2.75-4.35), ragged and
# paged page 16, Gemma-2 (D 256, 5% faster at B32) and gpt-oss (64/8, D 64, 15-25% faster), and
# int8 / fp8 caches (108-116 us against 178 at B32 T4096). MLA runs on Mosaic GPU only.
KERNEL_IMPLS = ("triton", "mosaic_gpu")
# Except for wide groups: 64 or more q heads per kv head (MQA models, a shared prefix's stacked samples) over a
# two-byte cache, contiguous or in pages of 16+ tokens, go to Mosaic GPU first (docs/decisions.md#auto-wide-groups).
MOSAIC_MIN_GROUP = 64
MOSAIC_MIN_PAGE = 16

_last_impl: str | None = None
_logger = logging.getLogger("pallas_kv")
_fallbacks_logged: set[str] = set()


def _log_fallback_once(op: str, reasons: dict[str, str]) -> None:
  """Logs (a warning, once per distinct message) that "auto" runs a kernel-capable device's call on xla."""
  message = f"impl='auto' runs this {op} call on xla: " + "; ".join(f"{n}: {r}" for n, r in reasons.items())
  if message not in _fallbacks_logged:
    _fallbacks_logged.add(message)
    _logger.warning(message)


def last_impl() -> str | None:
  """The backend the most recent traced call ran (useful to see what impl="auto" chose)."""
  return _last_impl


def kernel_backend(name: str):
  """The module implementing a kernel backend; NotImplementedError if it is not available."""
  if name == "mosaic_gpu":
    from pallas_kv.kernels.mosaic_gpu import backend
    return backend
  if name == "triton":
    try:
      from pallas_kv.kernels.triton import backend
    except ImportError as e:   # jax deprecates Pallas Triton: a jax without it leaves Mosaic GPU and xla
      raise NotImplementedError(f"impl='triton': the Pallas Triton backend cannot be imported ({e})") from e
    return backend
  raise NotImplementedError(f"impl={name!r}: this backend is not built yet; use impl='xla' or impl='auto'")


def device_can_run(name: str) -> bool:
  if name == "mosaic_gpu":
    return runtime.is_hopper_or_newer()
  return runtime.gpu_device() is not None


def _check_config(impl: str, op: str, config) -> str:
  """The impl a call with this config runs: a kernel config names its backend, which narrows
  "auto" to it; it must be the config type of that backend's kernel for `op`."""
  if config is None:
    return impl
  if not isinstance(config, kernel_configs.KernelConfig):
    raise TypeError(f"config must be a kernel config (pallas_kv.TritonConfig, MosaicGPUConfig or MosaicMLAConfig), "
                    f"got {type(config).__name__}")
  if impl == "xla":
    raise ValueError(f"config={config!r} was given but impl='xla' takes no kernel config")
  if impl not in ("auto", config.backend):
    raise ValueError(f"config is a {type(config).__name__}, a config of the {config.backend} backend; "
                     f"impl={impl!r} runs another")
  expected = kernel_configs.config_type(config.backend, op)
  if not isinstance(config, expected):
    raise TypeError(f"a {op} call on {config.backend} takes a {expected.__name__}, got {type(config).__name__}")
  return config.backend


def choose_impl(impl: str, op: str, problem, options, dtypes, config) -> tuple[str, object | None]:
  """Returns (backend name, backend module or None for xla)."""
  global _last_impl
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  impl = _check_config(impl, op, config)
  if impl == "xla":
    _last_impl = "xla"
    return "xla", None
  if impl != "auto":
    backend = kernel_backend(impl)
    reason = backend.unsupported_reason(op, problem, options, dtypes)
    if reason:
      raise NotImplementedError(f"impl={impl!r} cannot run this {op} call: {reason}")
    _last_impl = impl
    return impl, backend
  serving = {}  # kernel backends that run on this device and serve this call, in preference order
  refusals = {}
  for name in KERNEL_IMPLS:
    if not device_can_run(name):
      continue
    try:
      backend = kernel_backend(name)
    except NotImplementedError as e:
      refusals[name] = str(e)
      continue
    reason = backend.unsupported_reason(op, problem, options, dtypes)
    if reason is None:
      serving[name] = backend
    else:
      refusals[name] = reason
  if not serving:
    if refusals:   # a GPU whose kernels refuse the call: say why, once
      _log_fallback_once(op, refusals)
    _last_impl = "xla"
    return "xla", None
  name = next(iter(serving))
  if "mosaic_gpu" in serving and _wide_group(problem, dtypes[1]):
    name = "mosaic_gpu"
  if op != "mla":  # where the tuned file timed several backends on this shape, the fastest wins
    key = tuned.shape_key(op, problem, dtypes[1])
    name = tuned.fastest_backend(tuple(serving), key, runtime.device_kind()) or name
  _last_impl = name
  return name, serving[name]


def _options(problem, scale, softcap, window, sinks, k_scale, v_scale, window_start=None) -> AttentionOptions:
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads,
                           token_shape=problem.scale_token_shape, cache_dtype=problem.cache_dtype)
  validation.check_window_start(window_start, problem.batch)
  if window is not None and window >= problem.capacity + problem.num_queries:
    window = None   # every key is inside it (and the kernels' int32 math stays in range)
  return AttentionOptions(
      scale=float(validation.default_scale(problem.head_dim) if scale is None else scale),
      softcap=None if softcap is None else float(softcap),
      window=None if window is None else int(window),
      has_sinks=sinks is not None,
      has_window_start=window_start is not None,
      k_scale=validation.scale_kind(k_scale, problem.scale_token_shape),
      v_scale=validation.scale_kind(v_scale, problem.scale_token_shape))


def _check_runtime_values(problem, lengths, block_tables=None) -> None:
  """In checked mode (`pallas_kv.checked()`), report lengths outside [0, T] and page ids outside
  [0, P) that would be read. Outside it nothing is traced: a check is an effect, and a jaxpr with
  an effect leaves jit's fast dispatch path (~10x the host time per call)."""
  if not runtime.checked_enabled():
    return
  checkify.check(jnp.all((lengths >= 0) & (lengths <= problem.capacity)),
                 f"lengths must lie in [0, {problem.capacity}] (the cache capacity)")
  if block_tables is not None:
    pages_needed = (jnp.clip(lengths, 0, problem.capacity) + problem.page_size - 1) // problem.page_size
    used = jnp.arange(block_tables.shape[1])[None, :] < pages_needed[:, None]
    in_range = (block_tables >= 0) & (block_tables < problem.num_pages)
    checkify.check(jnp.all(in_range | ~used),
                   f"block_tables holds page ids outside [0, {problem.num_pages}) for tokens below lengths")


def _cast_output(result, dtype, return_lse: bool):
  if return_lse:
    out, lse = result
    return out.astype(dtype), lse.astype(jnp.float32)
  return result.astype(dtype)


def _with_xla_gradient(kernel_fn, xla_fn, fold, **arrays):
  """kernel_fn(**arrays) forward; gradients from the float32 xla_fn(**arrays) (custom VJP); under
  vmap, fold(n, arrays, batched) runs the op once on the folded batch (`pallas_kv.batching`).

  Entries that are None stay out of the differentiated arguments.
  """
  names = tuple(name for name, value in arrays.items() if value is not None)
  call = lambda fn, values: fn(**dict(zip(names, values)))
  kernel = batching.fold_when_vmapped(lambda *values: call(kernel_fn, values), names, fold)

  @jax.custom_vjp
  def op(*values):
    return kernel(*values)

  def op_fwd(*values):
    return kernel(*values), values

  def op_bwd(values, cotangent):
    _, vjp = jax.vjp(lambda *vs: call(xla_fn, vs), *values)
    return vjp(cotangent)

  op.defvjp(op_fwd, op_bwd)
  return op(*(arrays[name] for name in names))


def _empty(problem, q, return_lse: bool):
  """The result of a call with no sequences, no capacity or no pages: zeros (and -inf LSE)."""
  rows = q.shape[:-1]
  out = jnp.zeros((*rows, problem.v_head_dim), q.dtype)
  return (out, jnp.full(rows, -jnp.inf, jnp.float32)) if return_lse else out


def _empty_call(problem) -> bool:
  return problem.batch == 0 or problem.capacity == 0 or problem.num_pages == 0


def _wide_group(problem, cache_dtype) -> bool:
  """Whether `auto` takes Mosaic GPU before Triton for this call (docs/decisions.md#auto-wide-groups)."""
  return (problem.group_size >= MOSAIC_MIN_GROUP and not validation.is_quantized_dtype(cache_dtype)
          and (problem.page_size is None or problem.page_size >= MOSAIC_MIN_PAGE))


def _plan(op: str, impl: str, config, problem, options, q, k, lengths):
  """(backend name, backend or None, complete config or None, SplitPlan or None) of a call."""
  name, backend = choose_impl(impl, op, problem, options, (q.dtype, k.dtype), config)
  if backend is None or _empty_call(problem):
    return name, backend, None, None
  config = backend.resolve_config(op, problem, config, dtype=k.dtype)
  return name, backend, config, backend.plan_splits(op, problem, options, config, lengths, ahead=True)


def _run(op: str, impl: str, config, problem, options, q, k, v, lengths, block_tables, *, sinks, k_scale, v_scale,
         return_lse, xla_fn, refold, plan, window_start=None):
  """Runs the chosen backend; xla_fn(q, k, v, lengths, block_tables, sinks, k_scale, v_scale, window_start) is the
  "xla" impl (float32 results), which also gives the kernels their gradients; refold(**arrays)
  runs the public op again on arrays whose batch holds a vmapped axis. plan: a SplitPlan made
  for this call's shapes (`plan_splits`), else planned here from `lengths`."""
  name, backend = choose_impl(impl, op, problem, options, (q.dtype, k.dtype), config)
  dtype = q.dtype
  if _empty_call(problem):
    return _empty(problem, q, return_lse)

  def xla_call(q, k, v, lengths, block_tables=None, sinks=None, k_scale=None, v_scale=None, window_start=None):
    return _cast_output(xla_fn(q, k, v, lengths, block_tables, sinks, k_scale, v_scale, window_start), dtype,
                        return_lse)

  if backend is None:
    return xla_call(q, k, v, lengths, block_tables, sinks, k_scale, v_scale, window_start)

  config = backend.resolve_config(op, problem, config, dtype=k.dtype)
  if plan is not None:
    _check_plan(plan, config)

  def kernel_call(q, k, v, lengths, block_tables=None, sinks=None, k_scale=None, v_scale=None, window_start=None):
    if not runtime.interpret_enabled():   # a CPU lowering (eager or under jit) then names the interpret switch
      q = runtime.gpu_only(q, impl=name)
    split_plan = plan if plan is not None else backend.plan_splits(op, problem, options, config, lengths)
    result = backend.run(op, q, k, v, lengths, block_tables, problem=problem, options=options, config=config,
                         split_plan=split_plan, sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                         window_start=window_start)
    return _cast_output(result, dtype, return_lse)

  fold_op = batching.fold_dense if block_tables is None else batching.fold_paged
  fold = lambda n, arrays, batched: fold_op(n, arrays, batched, refold)
  return _with_xla_gradient(kernel_call, xla_call, fold, q=q, k=k, v=v, lengths=lengths,
                            block_tables=block_tables, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                            window_start=window_start)


def _check_plan(plan, config) -> None:
  if not isinstance(plan, SplitPlan):
    raise TypeError(f"plan must be a SplitPlan (pallas_kv.plan_splits), got {type(plan).__name__}")
  plan.check_made_for(config)


_PLANNERS = {}   # public op -> the function that builds its call's plan


def plan_splits(op, *args, **kwargs):
  """The `SplitPlan` that `op(*args, **kwargs)` would compute (op: `decode_attention`,
  `paged_decode_attention` or `mla_decode_attention`), or None where that call runs no kernel
  (impl "xla", or nothing to attend).

  A model whose layers share shapes plans once per step and passes `plan=` to every layer's
  call, so that the balanced plan and the sequence order are computed once, not per layer.
  """
  if op not in _PLANNERS:
    raise ValueError(f"op must be one of {[f.__name__ for f in _PLANNERS]}, got {op!r}")
  return _PLANNERS[op](*args, **kwargs)


def _run_varlen(call, q, lengths, cu_seqlens_q, max_seqlen_q, return_lse: bool):
  """call(q_padded [B, S, Hq, D]) for q in the varlen form [total, Hq, D] (`pallas_kv.varlen`)."""
  batch, num_queries = varlen.check(q, cu_seqlens_q, max_seqlen_q)
  if tuple(getattr(lengths, "shape", ())) != (batch,):
    raise ValueError(f"cu_seqlens_q has {batch + 1} entries, so lengths must have shape [B]=({batch},); got "
                     f"{getattr(lengths, 'shape', type(lengths).__name__)}")
  total = q.shape[0]
  if runtime.checked_enabled():
    checkify.check(varlen.counts_fit(cu_seqlens_q, num_queries, total),
                   f"cu_seqlens_q must rise from 0 to q.shape[0]={total} by at most max_seqlen_q={num_queries} "
                   "tokens a sequence")
  result = call(varlen.to_padded(q, cu_seqlens_q, num_queries))
  if not return_lse:
    return varlen.from_padded(result, cu_seqlens_q, total)
  out, lse = result
  return varlen.from_padded(out, cu_seqlens_q, total), varlen.from_padded(lse, cu_seqlens_q, total, fill=-jnp.inf)


def _padded_query(q, lengths, cu_seqlens_q, max_seqlen_q):
  """The padded form's q [B, S, Hq, D] (a ShapeDtypeStruct) of a varlen call, for planning."""
  return jax.ShapeDtypeStruct((lengths.shape[0], varlen.check(q, cu_seqlens_q, max_seqlen_q)[1], *q.shape[1:]),
                              q.dtype)


def _v_like_k(v, v_tokens_last: bool):
  """v in k's layout: [B, Hkv, D, T] ([P, Hkv, D, page_size]) back to [B, T, Hkv, D]."""
  return validation.relaid_v(v, tokens_last=False) if v_tokens_last else v


def decode_attention(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None, k_scale=None,
                     v_scale=None, return_lse=False, impl="auto", config=None, v_tokens_last=False, plan=None,
                     window_start=None, cu_seqlens_q=None, max_seqlen_q=None):
  """Attention of a few new tokens per sequence over a contiguous KV cache.

  Args:
    q: [B, Hq, D] (one new token) or [B, S, Hq, D] (S <= 16 new tokens, causal among themselves;
      they are the last S of the lengths[b] valid tokens); with cu_seqlens_q, [total, Hq, D].
    k, v: [B, T, Hkv, D], T the capacity; Hq % Hkv == 0. bf16/fp16/fp32, or int8/fp8 with scales.
    lengths: int32 [B], valid tokens per sequence, 0 <= lengths <= T (values outside are clamped).
    scale: logit scale, default 1/sqrt(D).
    softcap: logits become softcap * tanh(logits / softcap) after scaling.
    window: a query at position p attends to keys in (p - window, p].
    window_start: int32 [B], the first visible key of each sequence: keys before window_start[b]
      are hidden from all its queries (with `window` too, both apply).
    sinks: [Hq] per-head logit of a virtual token with no value that joins the softmax denominator.
    k_scale, v_scale: dequantization scales of an int8/fp8 cache: a number or a scalar (the whole
      cache), [Hkv] (one per kv head), or [B, T, Hkv] (one per token and kv head); the values
      used are cache * scale.
    return_lse: also return the natural-log LSE [B, (S,) Hq] float32 over the real keys (-inf if none).
    impl: "auto" | "mosaic_gpu" | "triton" | "xla".
    config: a kernel config (`pallas_kv.TritonConfig` or `MosaicGPUConfig`): it names its backend
      (narrowing "auto" to it) and fixes the fields it sets; the backend fills the rest.
    v_tokens_last: v is stored [B, Hkv, D, T] instead of like k: each kv head's values with their
      tokens contiguous, which P V reads without byte-wise loads for a one-byte cache (the layout
      `KVCache.create` gives one-byte caches). Triton takes 128-token tiles for it, a tile spanning
      pages loaded page by page; Mosaic GPU reads [D, block_kv] tiles transposed (head_dim a
      multiple of 64, pages of a multiple of 64 tokens); xla transposes v.
    plan: the call's `SplitPlan`, made once for several calls of the same shapes and lengths
      (`plan_splits`); else planned here.
    cu_seqlens_q: int32 [B + 1], the varlen query form: sequence b's new tokens are q's rows
      cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (at most max_seqlen_q of them, causal among
      themselves, the last of its lengths[b] tokens); out and lse come back in q's rows.
    max_seqlen_q: with cu_seqlens_q, a Python int bound on any sequence's new tokens (default
      min(16, total)); it sets the padded form's S the kernels run, so a tight bound is faster.

  Returns:
    out [B, (S,) Hq, D] ([total, Hq, D] with cu_seqlens_q) in q's dtype, and lse when return_lse.
    Sequences of length 0 give zeros.
    Gradients flow to q, k, v, sinks and the scales (kernel forward, float32 "xla" backward).
  """
  if cu_seqlens_q is not None:
    padded = lambda q: decode_attention(q, k, v, lengths, scale=scale, softcap=softcap, window=window, sinks=sinks,
                                        k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, impl=impl,
                                        config=config, v_tokens_last=v_tokens_last, plan=plan,
                                        window_start=window_start)
    return _run_varlen(padded, q, lengths, cu_seqlens_q, max_seqlen_q, return_lse)
  problem = validation.validate_dense(q, k, v, lengths, v_tokens_last)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale, window_start)
  _check_runtime_values(problem, lengths)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)

  def xla_fn(q, k, v, lengths, block_tables, sinks, k_scale, v_scale, window_start):
    return xla.decode_attention(q, k, _v_like_k(v, v_tokens_last), lengths, scale=options.scale,
                                softcap=options.softcap, window=options.window, sinks=sinks, k_scale=k_scale,
                                v_scale=v_scale, return_lse=return_lse, window_start=window_start)

  def refold(q, k, v, lengths, sinks=None, k_scale=None, v_scale=None, window_start=None):
    return decode_attention(q, k, v, lengths, scale=options.scale, softcap=softcap, window=window, sinks=sinks,
                            k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, impl=impl, config=config,
                            v_tokens_last=v_tokens_last, window_start=window_start)

  return _run("decode", impl, config, problem, options, q, k, v, lengths, None, sinks=sinks, k_scale=k_scale,
              v_scale=v_scale, return_lse=return_lse, xla_fn=xla_fn, refold=refold, plan=plan,
              window_start=window_start)


def _plan_decode(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None, k_scale=None, v_scale=None,
                 return_lse=False, impl="auto", config=None, v_tokens_last=False, plan=None, window_start=None,
                 cu_seqlens_q=None, max_seqlen_q=None):
  del return_lse, plan
  if cu_seqlens_q is not None:
    q = _padded_query(q, lengths, cu_seqlens_q, max_seqlen_q)
  problem = validation.validate_dense(q, k, v, lengths, v_tokens_last)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale, window_start)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  return _plan("decode", impl, config, problem, options, q, k, lengths)[3]


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None, window=None,
                           sinks=None, k_scale=None, v_scale=None, return_lse=False, impl="auto", config=None,
                           v_tokens_last=False, plan=None, window_start=None, cu_seqlens_q=None, max_seqlen_q=None,
                           shared_prefix=None):
  """Attention of a few new tokens per sequence over a paged KV cache.

  k_pages, v_pages: [P, page_size, Hkv, D] (v_pages [P, Hkv, D, page_size] with v_tokens_last);
  block_tables: int32 [B, max_pages_per_seq]; token t of sequence b lives in page
  block_tables[b, t // page_size] at slot t % page_size. Page ids are clamped into [0, P) and pages
  past a sequence's length are never read. Per-token scales are [P, page_size, Hkv], addressed like
  the pages. Other arguments and the result are as in `decode_attention`, with
  T = max_pages_per_seq * page_size.

  shared_prefix: a `pallas_kv.SharedPrefix`, groups of sequences whose block tables start with the same
  pages; each group's shared pages are read once for all its members (`pallas_kv.shared_prefix`). The
  result equals the call without it. With `window` or `window_start` each member sees its own part of
  the prefix, so such a call runs without sharing.
  """
  if shared_prefix is not None:
    _check_shared_prefix(shared_prefix, plan, cu_seqlens_q)
    unshared = window is not None or window_start is not None
    attend = lambda q, tables, lens: paged_decode_attention(
        q, k_pages, v_pages, tables, lens, scale=scale, softcap=softcap, window=window,
        sinks=sinks if unshared else None, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse or not unshared,
        impl=impl, config=config, v_tokens_last=v_tokens_last, window_start=window_start)
    if unshared:
      return attend(q, block_tables, lengths)
    return sharing.attend(attend, q, block_tables, lengths, shared_prefix, page_size=k_pages.shape[1],
                          num_kv_heads=k_pages.shape[2], return_lse=return_lse, max_group=MAX_GROUP, sinks=sinks)
  if cu_seqlens_q is not None:
    padded = lambda q: paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                              softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                                              v_scale=v_scale, return_lse=return_lse, impl=impl, config=config,
                                              v_tokens_last=v_tokens_last, plan=plan, window_start=window_start)
    return _run_varlen(padded, q, lengths, cu_seqlens_q, max_seqlen_q, return_lse)
  problem = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths, v_tokens_last)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale, window_start)
  _check_runtime_values(problem, lengths, block_tables)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)

  def xla_fn(q, k, v, lengths, block_tables, sinks, k_scale, v_scale, window_start):
    return xla.paged_decode_attention(q, k, _v_like_k(v, v_tokens_last), block_tables, lengths,
                                      scale=options.scale, softcap=options.softcap, window=options.window,
                                      sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                                      window_start=window_start)

  def refold(q, k, v, lengths, block_tables, sinks=None, k_scale=None, v_scale=None, window_start=None):
    return paged_decode_attention(q, k, v, block_tables, lengths, scale=options.scale, softcap=softcap,
                                  window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                  return_lse=return_lse, impl=impl, config=config, v_tokens_last=v_tokens_last,
                                  window_start=window_start)

  return _run("paged", impl, config, problem, options, q, k_pages, v_pages, lengths, block_tables, sinks=sinks,
              k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, xla_fn=xla_fn, refold=refold, plan=plan,
              window_start=window_start)


def _plan_paged(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None, window=None, sinks=None,
                k_scale=None, v_scale=None, return_lse=False, impl="auto", config=None, v_tokens_last=False, plan=None,
                window_start=None, cu_seqlens_q=None, max_seqlen_q=None):
  del return_lse, plan
  if cu_seqlens_q is not None:
    q = _padded_query(q, lengths, cu_seqlens_q, max_seqlen_q)
  problem = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths, v_tokens_last)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale, window_start)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  return _plan("paged", impl, config, problem, options, q, k_pages, lengths)[3]


def mla_decode_attention(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None, return_lse=False,
                         impl="auto", config=None, plan=None, cu_seqlens_q=None, max_seqlen_q=None,
                         shared_prefix=None, kv_scale=None):
  """Multi-head latent attention (DeepSeek MLA, absorbed form) over a paged latent cache.

  q: [B, (S,) Hq, Dqk]; kv_pages: [P, page_size, Dqk], one latent head shared by all q heads (keys
  are the whole Dqk = latent + rope; values are kv[..., :v_head_dim]); block_tables, lengths as in
  `paged_decode_attention`. scale defaults to 1/sqrt(Dqk): models that fold a different softmax
  scale into the absorbed query (DeepSeek-V3 uses 1/sqrt(192)) pass it explicitly.
  config: a `pallas_kv.MosaicMLAConfig`; plan, cu_seqlens_q, max_seqlen_q: as in `decode_attention`;
  shared_prefix: as in `paged_decode_attention`.
  kv_scale: for an int8 / fp8 latent cache, the scale that widens it: a number or scalar array, or one per
  token [P, page_size] float32 (`PagedLatentCache` with scales="token" writes these on append); None is 1.
  Returns out [B, (S,) Hq, v_head_dim] ([total, Hq, v_head_dim] with cu_seqlens_q) in q's dtype, and lse
  when return_lse.
  """
  if shared_prefix is not None:
    _check_shared_prefix(shared_prefix, plan, cu_seqlens_q)
    attend = lambda q, tables, lens: mla_decode_attention(
        q, kv_pages, tables, lens, v_head_dim=v_head_dim, scale=scale, return_lse=True, impl=impl, config=config,
        kv_scale=kv_scale)
    return sharing.attend(attend, q, block_tables, lengths, shared_prefix, page_size=kv_pages.shape[1],
                          num_kv_heads=1, return_lse=return_lse, max_group=None)
  if cu_seqlens_q is not None:
    padded = lambda q: mla_decode_attention(q, kv_pages, block_tables, lengths, v_head_dim=v_head_dim, scale=scale,
                                            return_lse=return_lse, impl=impl, config=config, plan=plan,
                                            kv_scale=kv_scale)
    return _run_varlen(padded, q, lengths, cu_seqlens_q, max_seqlen_q, return_lse)
  problem = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  kv_scale = validation.latent_scale(kv_scale, kv_pages)   # per token: [P, page_size, 1], as k_scale is
  options = _options(problem, scale, None, None, None, kv_scale, None)
  _check_runtime_values(problem, lengths, block_tables)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)

  def xla_fn(q, kv, unused_v, lengths, block_tables, sinks, k_scale, v_scale, window_start):
    return xla.mla_decode_attention(q, kv, block_tables, lengths, v_head_dim=v_head_dim, scale=options.scale,
                                    return_lse=return_lse, kv_scale=k_scale)

  # The latent cache goes in as both k and v; the xla impl reads it as k only, so its whole
  # gradient arrives there.
  def refold(q, k, v, lengths, block_tables, k_scale=None):
    del v  # the same latent pool as k
    per_token = k_scale is not None and jnp.ndim(k_scale) == 3
    return mla_decode_attention(q, k, block_tables, lengths, v_head_dim=v_head_dim, scale=options.scale,
                                return_lse=return_lse, impl=impl, config=config,
                                kv_scale=k_scale[..., 0] if per_token else k_scale)

  return _run("mla", impl, config, problem, options, q, kv_pages, kv_pages, lengths, block_tables, sinks=None,
              k_scale=kv_scale, v_scale=None, return_lse=return_lse, xla_fn=xla_fn, refold=refold, plan=plan)


def _check_shared_prefix(shared_prefix, plan, cu_seqlens_q) -> None:
  sharing.check(shared_prefix)
  if plan is not None or cu_seqlens_q is not None:
    raise ValueError("shared_prefix does not combine with plan= or cu_seqlens_q: its two passes plan their own "
                     "shapes, and take q in the padded [B, (S,) Hq, D] form")


def _plan_mla(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None, return_lse=False, impl="auto",
              config=None, plan=None, cu_seqlens_q=None, max_seqlen_q=None, kv_scale=None):
  del return_lse, plan
  if cu_seqlens_q is not None:
    q = _padded_query(q, lengths, cu_seqlens_q, max_seqlen_q)
  problem = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  options = _options(problem, scale, None, None, None, validation.latent_scale(kv_scale, kv_pages), None)
  lengths = validation.lengths_as_int32(lengths, problem.capacity)
  return _plan("mla", impl, config, problem, options, q, kv_pages, lengths)[3]


_PLANNERS.update({decode_attention: _plan_decode, paged_decode_attention: _plan_paged,
                  mla_decode_attention: _plan_mla})
