"""Public ops: validate, pick a backend and a config, run the kernels, combine.

`impl` chooses the backend:
  "xla"         the float32 reference (`pallas_kv.reference`), cast to q's dtype; runs anywhere.
  "mosaic_gpu"  Mosaic GPU kernels (Hopper and newer).
  "triton"      Pallas Triton kernels (portable GPUs).
  "auto"        the fastest backend that serves the request on the local device, else "xla".
A kernel backend that cannot serve a request raises NotImplementedError saying why; only "auto"
moves on to the next one, and `last_impl()` tells which one it picked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from pallas_kv import reference
from pallas_kv import runtime
from pallas_kv import validation
from pallas_kv.config import AttentionOptions

IMPLS = ("auto", "mosaic_gpu", "triton", "xla")
KERNEL_IMPLS = ("mosaic_gpu", "triton")  # in the order "auto" tries them

_last_impl: str | None = None


def last_impl() -> str | None:
  """The backend the most recent traced call ran (useful to see what impl="auto" chose)."""
  return _last_impl


def _kernel_backend(name: str):
  """The module implementing a kernel backend; NotImplementedError if it is not available."""
  raise NotImplementedError(f"impl={name!r}: this backend is not built yet; use impl='xla' or impl='auto'")


def _device_can_run(name: str) -> bool:
  if name == "mosaic_gpu":
    return runtime.is_hopper_or_newer()
  return runtime.gpu_device() is not None


def _choose_impl(impl: str, op: str, problem, options, dtypes, config) -> tuple[str, object | None]:
  """Returns (backend name, backend module or None for xla)."""
  global _last_impl
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if impl == "xla":
    if config is not None:
      raise ValueError(f"config={config!r} was given but impl='xla' takes no kernel config")
    _last_impl = "xla"
    return "xla", None
  if impl != "auto":
    backend = _kernel_backend(impl)
    reason = backend.unsupported_reason(op, problem, options, dtypes)
    if reason:
      raise NotImplementedError(f"impl={impl!r} cannot run this {op} call: {reason}")
    _last_impl = impl
    return impl, backend
  for name in KERNEL_IMPLS:
    if not _device_can_run(name):
      continue
    try:
      backend = _kernel_backend(name)
    except NotImplementedError:
      continue
    if backend.unsupported_reason(op, problem, options, dtypes) is None:
      _last_impl = name
      return name, backend
  _last_impl = "xla"
  return "xla", None


def _options(problem, scale, softcap, window, sinks, k_scale, v_scale) -> AttentionOptions:
  validation.check_options(scale=scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads)
  return AttentionOptions(
      scale=float(validation.default_scale(problem.head_dim) if scale is None else scale),
      softcap=None if softcap is None else float(softcap),
      window=None if window is None else int(window),
      has_sinks=sinks is not None,
      quantized=k_scale is not None or v_scale is not None)


def _check_runtime_values(problem, lengths, block_tables=None) -> None:
  """In checked mode, report lengths outside [0, T] and page ids outside [0, P) that would be read."""
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
    return out.astype(dtype), lse
  return result.astype(dtype)


def decode_attention(q, k, v, lengths, *, scale=None, softcap=None, window=None, sinks=None, k_scale=None,
                     v_scale=None, return_lse=False, impl="auto", config=None):
  """Attention of a few new tokens per sequence over a contiguous KV cache.

  Args:
    q: [B, Hq, D] (one new token) or [B, S, Hq, D] (S <= 16 new tokens, causal among themselves;
      they are the last S of the lengths[b] valid tokens).
    k, v: [B, T, Hkv, D], T the capacity; Hq % Hkv == 0. bf16/fp16/fp32, or int8/fp8 with scales.
    lengths: int32 [B], valid tokens per sequence, 0 <= lengths <= T (values outside are clamped).
    scale: logit scale, default 1/sqrt(D).
    softcap: logits become softcap * tanh(logits / softcap) after scaling.
    window: a query at position p attends to keys in (p - window, p].
    sinks: [Hq] per-head logit of a virtual token with no value that joins the softmax denominator.
    k_scale, v_scale: dequantization scales (a number, a scalar or [Hkv]) for int8/fp8 caches.
    return_lse: also return the natural-log LSE [B, (S,) Hq] float32 over the real keys (-inf if none).
    impl: "auto" | "mosaic_gpu" | "triton" | "xla".
    config: an explicit kernel config for the chosen backend, else tuned, else heuristic.

  Returns:
    out [B, (S,) Hq, D] in q's dtype, and lse when return_lse. Sequences of length 0 give zeros.
  """
  problem = validation.validate_dense(q, k, v, lengths)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale)
  _check_runtime_values(problem, lengths)
  name, backend = _choose_impl(impl, "decode", problem, options, (q.dtype, k.dtype), config)
  kwargs = dict(scale=options.scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                v_scale=v_scale, return_lse=return_lse)
  if backend is None:
    result = reference.decode_attention_reference(q, k, v, lengths, **kwargs)
  else:
    result = backend.decode_attention(q, k, v, lengths, problem=problem, options=options, config=config,
                                      **kwargs)
  return _cast_output(result, q.dtype, return_lse)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, softcap=None, window=None,
                           sinks=None, k_scale=None, v_scale=None, return_lse=False, impl="auto", config=None):
  """Attention of a few new tokens per sequence over a paged KV cache.

  k_pages, v_pages: [P, page_size, Hkv, D]; block_tables: int32 [B, max_pages_per_seq]; token t of
  sequence b lives in page block_tables[b, t // page_size] at slot t % page_size. Page ids are
  clamped into [0, P) and pages past a sequence's length are never used. Other arguments and the
  result are as in `decode_attention`, with T = max_pages_per_seq * page_size.
  """
  problem = validation.validate_paged(q, k_pages, v_pages, block_tables, lengths)
  options = _options(problem, scale, softcap, window, sinks, k_scale, v_scale)
  _check_runtime_values(problem, lengths, block_tables)
  name, backend = _choose_impl(impl, "paged", problem, options, (q.dtype, k_pages.dtype), config)
  kwargs = dict(scale=options.scale, softcap=softcap, window=window, sinks=sinks, k_scale=k_scale,
                v_scale=v_scale, return_lse=return_lse)
  if backend is None:
    result = reference.paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, **kwargs)
  else:
    result = backend.paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, problem=problem,
                                            options=options, config=config, **kwargs)
  return _cast_output(result, q.dtype, return_lse)


def mla_decode_attention(q, kv_pages, block_tables, lengths, *, v_head_dim=512, scale=None, return_lse=False,
                         impl="auto", config=None):
  """Multi-head latent attention (DeepSeek MLA, absorbed form) over a paged latent cache.

  q: [B, (S,) Hq, Dqk]; kv_pages: [P, page_size, Dqk], one latent head shared by all q heads (keys
  are the whole Dqk = latent + rope; values are kv[..., :v_head_dim]); block_tables, lengths as in
  `paged_decode_attention`. scale defaults to 1/sqrt(Dqk): models that fold a different softmax
  scale into the absorbed query (DeepSeek-V3 uses 1/sqrt(192)) pass it explicitly.
  Returns out [B, (S,) Hq, v_head_dim] in q's dtype, and lse when return_lse.
  """
  problem = validation.validate_mla(q, kv_pages, block_tables, lengths, v_head_dim)
  options = _options(problem, scale, None, None, None, None, None)
  _check_runtime_values(problem, lengths, block_tables)
  name, backend = _choose_impl(impl, "mla", problem, options, (q.dtype, kv_pages.dtype), config)
  kwargs = dict(v_head_dim=v_head_dim, scale=options.scale, return_lse=return_lse)
  if backend is None:
    result = reference.mla_decode_attention_reference(q, kv_pages, block_tables, lengths, **kwargs)
  else:
    result = backend.mla_decode_attention(q, kv_pages, block_tables, lengths, problem=problem, options=options,
                                          config=config, **kwargs)
  return _cast_output(result, q.dtype, return_lse)
