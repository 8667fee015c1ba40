"""Run-time switches (interpret mode, checked mode) and facts about the target device.

A kernel impl never inspects the local devices to refuse: without interpret mode it always
emits its GPU kernel, so `jax.export(..., platforms=["cuda"])` lowers it on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
from jax._src import config as jax_config  # config states are how jit keys on a switch

INTERPRET_ENV_VAR = "PALLAS_KV_INTERPRET"
# Heuristics assume an H100/H200 when no GPU is present (e.g. lowering on a CPU machine).
DEFAULT_NUM_SMS = 132

_interpret = contextvars.ContextVar("pallas_kv_interpret", default=False)


@contextlib.contextmanager
def interpret(enabled: bool = True):
  """Within this context, kernel impls run their kernels in Pallas interpret mode on the CPU."""
  token = _interpret.set(enabled)
  try:
    yield
  finally:
    _interpret.reset(token)


def interpret_enabled() -> bool:
  """True inside `interpret()` or when the environment variable PALLAS_KV_INTERPRET=1."""
  return _interpret.get() or os.environ.get(INTERPRET_ENV_VAR, "0").strip().lower() in ("1", "true", "yes")


# A jax config state rather than a context variable: jit keys its cache on it, so a function traced
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
