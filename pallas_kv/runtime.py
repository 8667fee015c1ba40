"""Run-time switches (interpret mode, checked mode) and facts about the target device.

A kernel impl never inspects the local devices to refuse: without interpret mode it always
emits its GPU kernel, so `jax.export(..., platforms=["cuda"])` lowers it on a CPU-only machine.
"""

from __future__ import annotations

import functools
import os

import jax
from jax._src import config as jax_config  # config states are how jit keys on a switch
from jax._src import dispatch
from jax._src import xla_bridge  # whether the CPU client has started
from jax.extend import core as jax_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

INTERPRET_ENV_VAR = "PALLAS_KV_INTERPRET"
# Heuristics assume an H100/H200 when no GPU is present (e.g. lowering on a CPU machine).
DEFAULT_NUM_SMS = 132
# The CPU client's threads in interpret mode: more than an interpreted kernel has warpgroups, each of which may
# hold one while it waits at a barrier.
INTERPRET_CPU_THREADS = 8


def synchronous_cpu_dispatch() -> bool:
  """Turns JAX's asynchronous CPU dispatch off if that can still take effect; True if it is off.

  Interpreted kernels run JAX computations inside host callbacks: with asynchronous dispatch a call
  dispatched while one still runs can take the CPU client's threads and deadlock. The CPU client
  reads the flag once, when it starts (the first JAX computation), so a later change is void.
  """
  if not jax.config.read("jax_cpu_enable_async_dispatch"):
    return True
  if xla_bridge.backends_are_initialized():
    return False
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  return True


def reserve_interpret_threads() -> bool:
  """Gives JAX's CPU client at least INTERPRET_CPU_THREADS threads (`PJRT_NPROC`, unless the environment sets it) if
  it has not started; True if it had not. Run when pallas_kv is imported.

  Each simulated warpgroup of an interpreted Mosaic GPU kernel waits at its barriers inside a host callback, holding
  one of the client's threads (by default as many as the machine has cores) until another warpgroup's callback
  runs: on 2 cores a waiting producer and consumer left none for the third warpgroup, and the kernel hung.
  """
  if xla_bridge.backends_are_initialized():
    return False
  os.environ.setdefault("PJRT_NPROC", str(max(INTERPRET_CPU_THREADS, os.cpu_count() or 1)))
  return True


reserve_interpret_threads()


def _on_interpret_set(enabled) -> None:
  if enabled:
    synchronous_cpu_dispatch()


# A jax config state, like `checked` below: jit keys its cache on it, so a function traced outside
# `interpret()` is traced again inside it (and the other way round). Its environment variable,
# PALLAS_KV_INTERPRET=1 (or true), turns it on for the whole process when pallas_kv is imported.
_interpret = jax_config.bool_state(
    name="pallas_kv_interpret", default=False, include_in_jit_key=True, include_in_trace_context=True,
    update_global_hook=_on_interpret_set, update_thread_local_hook=_on_interpret_set,
    help="pallas_kv kernel impls run their kernels in Pallas interpret mode (on the CPU).")


def interpret(enabled: bool = True):
  """Within this context, kernel impls run their kernels in Pallas interpret mode on the CPU.

  Entering it turns JAX's asynchronous CPU dispatch off where that can still take effect: before
  the process's first JAX computation (`synchronous_cpu_dispatch`). After that, a jitted loop of
  interpreted calls should `jax.block_until_ready` each step.
  """
  return _interpret(bool(enabled))


def interpret_enabled() -> bool:
  """True inside `interpret()` or when the environment variable PALLAS_KV_INTERPRET=1."""
  return bool(_interpret.value)


def cpu_without_interpret_message(impl: str) -> str:
  return (f"impl={impl!r} runs a GPU kernel and this call runs on the CPU: set {INTERPRET_ENV_VAR}=1 or use "
          f"`with pallas_kv.interpret():` to interpret it there, or impl='xla'")


# The identity on one array, whose CPU lowering raises the message above. A kernel impl passes its
# input through it outside interpret mode: the CPU refusal then comes at lowering (eager or under
# jit) instead of Pallas's bare "Only interpret mode ...", and the CUDA lowering is unchanged.
_gpu_only_p = jax_core.Primitive("pallas_kv_gpu_only")
_gpu_only_p.def_impl(functools.partial(dispatch.apply_primitive, _gpu_only_p))
_gpu_only_p.def_abstract_eval(lambda x, *, impl: x)
batching.primitive_batchers[_gpu_only_p] = lambda args, dims, *, impl: (_gpu_only_p.bind(*args, impl=impl), dims[0])
ad.primitive_jvps[_gpu_only_p] = lambda primals, tangents, *, impl: (_gpu_only_p.bind(*primals, impl=impl),
                                                                     tangents[0])
mlir.register_lowering(_gpu_only_p, lambda ctx, x, *, impl: [x])


def _refuse_cpu_lowering(ctx, x, *, impl):
  raise ValueError(cpu_without_interpret_message(impl))


mlir.register_lowering(_gpu_only_p, _refuse_cpu_lowering, platform="cpu")


def gpu_only(x, *, impl: str):
  """x, in a computation that lowers for a GPU but refuses the CPU naming the interpret switch."""
  return _gpu_only_p.bind(x, impl=impl)


# A jax config state, like `interpret` above: jit keys its cache on it, so a function traced
# outside `checked()` is traced again inside it (and the other way round). Its environment
# variable, PALLAS_KV_CHECKED=1, turns it on for a whole process.
_checked = jax_config.bool_state(
    name="pallas_kv_checked", default=False, include_in_jit_key=True, include_in_trace_context=True,
    help="pallas_kv ops trace checkify checks of their runtime values (lengths, page ids).")


def checked(enabled: bool = True):
  """Within this context the ops trace `checkify` checks of runtime values: lengths outside
  [0, T] and page ids outside [0, P) that would be read. Outside it they trace none, so a plain
  call's jaxpr carries no effect and jit dispatches it on its fast path.

  An eager call raises on a bad value; under jit, functionalize the checks with checkify:
      with pallas_kv.checked():
        err, out = checkify.checkify(jax.jit(f))(...)
      err.throw()
  """
  return _checked(bool(enabled))


def checked_enabled() -> bool:
  """True inside `checked()` or when the environment variable PALLAS_KV_CHECKED=1."""
  return bool(_checked.value)


def gpu_device():
  """The first local GPU device, or None (CPU-only machines, TPU)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def num_sms() -> int:
  """Streaming multiprocessors of the local GPU; DEFAULT_NUM_SMS when there is none."""
  device = gpu_device()
  count = getattr(device, "core_count", None) if device is not None else None
  return int(count) if count else DEFAULT_NUM_SMS


def device_kind() -> str:
  device = gpu_device()
  return device.device_kind if device is not None else "cpu"


def is_hopper_or_newer() -> bool:
  """True when the local GPU is an NVIDIA GPU of compute capability 9.0 or newer."""
  device = gpu_device()
  if device is None:
    return False
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return False
  try:
    return float(capability) >= 9.0
  except ValueError:
    return False
