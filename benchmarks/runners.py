"""Every impl a benchmark row can name, and the `peers.Runner` that calls it.

pallas_kv's own impls are the values of its `impl=` argument; the peers are benchmarks/peers.py's.
"""

from __future__ import annotations

import functools

import jax

from benchmarks import peers

OUR_IMPLS = ("auto", "mosaic_gpu", "triton", "xla")
KERNEL_IMPLS = ("mosaic_gpu", "triton")   # run a GPU kernel: on a CPU only in interpret mode
ALL_IMPLS = OUR_IMPLS + tuple(peers.PEERS)


def import_pallas_kv():
  """pallas_kv, or PeerUnavailable saying why it cannot be imported (its rows read n/a)."""
  try:
    import pallas_kv  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise peers.PeerUnavailable(f"pallas_kv not importable ({e})") from None
  return pallas_kv


def with_options(fn, spec: peers.OpSpec):
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


def build_pallas_kv(impl: str, spec: peers.OpSpec, **op_kwargs) -> peers.Runner:
  """A runner for pallas_kv's own op with `impl=impl`, the spec's options and op_kwargs;
  PeerUnavailable for a kernel impl on a CPU outside interpret mode (the machine cannot run it)."""
  pkv = import_pallas_kv()
  if impl in KERNEL_IMPLS and jax.default_backend() == "cpu" and not pkv.runtime.interpret_enabled():
    raise peers.PeerUnavailable(pkv.runtime.cpu_without_interpret_message(impl))
  fn = {
      "decode": pkv.decode_attention,
      "paged": pkv.paged_decode_attention,
      "mla": functools.partial(pkv.mla_decode_attention, v_head_dim=spec.v_head_dim),
  }[spec.op]
  return peers.Runner(fn=jax.jit(with_options(functools.partial(fn, impl=impl, **op_kwargs), spec)))


def auto_choice() -> str | None:
  """The backend pallas_kv's impl="auto" picked in the latest trace, if it says."""
  last_impl = getattr(import_pallas_kv(), "last_impl", None)
  return last_impl() if callable(last_impl) else None


def build_runner(impl: str, spec: peers.OpSpec) -> peers.Runner:
  if impl in OUR_IMPLS:
    return build_pallas_kv(impl, spec)
  if impl in peers.PEERS and spec.kv_scales:
    raise peers.PeerUnavailable("int8 / fp8 caches with scales: no peer of this benchmark takes them")
  if impl in peers.PEERS:
    return peers.PEERS[impl](spec)
  raise ValueError(f"unknown impl {impl!r}; choose from {ALL_IMPLS}")
