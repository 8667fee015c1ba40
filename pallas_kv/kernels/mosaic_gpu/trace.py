"""A timeline of one Mosaic GPU kernel call from inside it: Mosaic GPU's on-device profiler records, per
warpgroup, each entry into and exit from the kernel's named regions (`region`) with the SM clock, and writes a
Perfetto trace after the call. A diagnostic: off outside `tracing(...)`, and the regions cost nothing then.

Regions of the GQA kernel: `item` (a work item, producer and consumers), `wait_free` (the producer waiting for a
ring slot), `wait_tile` (a consumer waiting for a tile to land), `wait_q` and `write_out` (a consumer waiting for
its q rows, and storing its output at an item's end), and a tile's `qk` (without `pipeline_qk`: issued and
awaited), `softmax` and `pv` (its wgmma's wait included); the queries-as-N consumer's `widen` (V's slot widened, or
zeroed past a length when read as stored). A region's time includes the regions inside it (a `wait_tile` in `qk`).
The MLA kernel's: the ring's `wait_free` and `wait_tile`, the scorer's `qk`, `softmax` and `pv` (`wait_p_free`
inside it: P's slot not yet handed back), the partner's `widen`, `wait_p` (P not yet handed over) and `pv`, and
`wait_values` (the scorer waiting for its widened values, the partner for their buffer's release)."""

from __future__ import annotations

import dataclasses
import json

import jax
from jax._src import config as jax_config  # config states are how jit keys on a switch

# The profiler stores 4 int32 per region visit (entry and exit: name and clock) in SMEM, per warpgroup.
BYTES_PER_VISIT = 16


@dataclasses.dataclass(frozen=True)
class KernelTrace:
  """directory: where the trace (JSON, named after the kernel) is written after the call; visits: region
  visits recorded per warpgroup: later ones are dropped, and they cost visits x 16 bytes of SMEM per warpgroup."""
  directory: str
  visits: int = 512

  def __post_init__(self):
    if not isinstance(self.directory, str) or not self.directory:
      raise ValueError(f"directory must be a non-empty path, got {self.directory!r}")
    if not isinstance(self.visits, int) or self.visits < 4:
      raise ValueError(f"visits must be an int >= 4, got {self.visits!r}")

  def compiler_params(self) -> dict:
    """The `plgpu.CompilerParams` fields that turn the profiler on."""
    return dict(profile_space=self.visits, profile_dir=self.directory, profile_bounds_check=True)

  def smem_bytes(self, num_warpgroups: int) -> int:
    """The trace buffer's SMEM in a program of num_warpgroups warpgroups."""
    return self.visits * BYTES_PER_VISIT * num_warpgroups


def region(name: str):
  """A named region of the kernel body (a context manager): timed per warpgroup when the call is traced."""
  return jax.named_scope(name)


def _check_fields(value):
  if value is not None and not isinstance(value, str):
    raise ValueError(f"pallas_kv_kernel_trace takes a KernelTrace's fields as JSON or None, got {value!r}")


# A jax config state, as `pallas_kv.interpret()` is: part of the trace context and of the key of jit's dispatch
# cache (which every jax.jit of one function shares), so that a function run outside `tracing` is traced again
# inside it, its kernels with the profiler on, rather than rerun as compiled.
_ACTIVE = jax_config.string_or_object_state(
    name="pallas_kv_kernel_trace", default=None, validator=_check_fields, include_in_jit_key=True,
    include_in_trace_context=True,
    help="pallas_kv's Mosaic GPU GQA and MLA kernels record their timelines: a KernelTrace's fields as JSON.")


def tracing(trace: KernelTrace):
  """Within this context, the Mosaic GPU GQA and MLA kernels that jit traces record their timelines into
  trace.directory (one file per kernel, written after its first call)."""
  if not isinstance(trace, KernelTrace):
    raise TypeError(f"tracing takes a KernelTrace, got {type(trace).__name__}")
  return _ACTIVE(json.dumps(dataclasses.astuple(trace)))


def active() -> KernelTrace | None:
  """The `tracing` context's KernelTrace, or None."""
  return None if _ACTIVE.value is None else KernelTrace(*json.loads(_ACTIVE.value))
