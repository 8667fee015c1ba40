r"""Where a Python loop of jitted decode calls spends its time: per call, up to the loop's last dispatch
(`enqueue_us`) and up to its result (`per_call_us`), beside a jitted `a + 1` on four floats (the host's own
dispatch). Where the two times match, the loop is bound by the host, not the GPU.

  python -m benchmarks tools.host_dispatch --json=dispatch.json
  python -m benchmarks tools.host_dispatch --nocommand_buffers      # XLA_FLAGS=--xla_gpu_enable_command_buffer=

The calls and their inputs are `benchmarks.decode`'s (full lengths; one-byte caches with per-token scales and v
stored as pallas_kv creates them, tokens last). Each loop cycles over --sets input sets (1: the same buffers every
call).
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import cases
from benchmarks import decode

_KV_DTYPES = flags.DEFINE_list("kv_dtype", ["bfloat16", "float8_e4m3fn", "int8"], "cache dtypes")
_IMPL = flags.DEFINE_string("impl", "auto", "pallas_kv impl")
_SHAPE = flags.DEFINE_list("shape", ["1", "32768", "32", "8", "128"], "B, T, Hq, Hkv, D")
_CALLS = flags.DEFINE_integer("calls", 300, "calls per loop")
_SETS = flags.DEFINE_list("sets", ["1", "4"], "input sets a loop cycles over")
_COMMAND_BUFFERS = flags.DEFINE_bool("command_buffers", True, "leave XLA's command buffers (CUDA graphs) on")
_JSON = flags.DEFINE_string("json", None, "write the rows here")


def prepared_call(kv_dtype: str, impl: str, shape: tuple[int, ...], num_sets: int):
  """(the jitted call `benchmarks.decode` times for `impl`, num_sets of its argument tuples) on a full-length
  case of this cache dtype, laid out as pallas_kv creates such a cache."""
  b, t, hq, hkv, d = shape
  sweep = cases.Sweep(op="decode", impls=(impl,), cases=((b, t),), num_heads=hq, num_kv_heads=hkv, head_dim=d,
                      kv_dtype=kv_dtype)
  case = cases.Case.from_sweep(sweep, b, t)
  key = jax.random.key(sweep.seed)
  input_sets = cases.make_input_sets(case, key, cases.make_lengths(case, key), num_sets)
  runner, _ = decode.KernelFlags().runner(impl, case, input_sets[0])
  return runner.fn, [runner.prepare(args) for args in input_sets]


def time_loop(fn, arg_sets: list[tuple], calls: int) -> dict[str, float]:
  """Per-call µs of the second of two loops of `calls` calls: to the last dispatch and to the result."""
  jax.block_until_ready(fn(*arg_sets[0]))
  for _ in range(2):
    t0 = time.perf_counter()
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
  return dict(enqueue_us=(t1 - t0) / calls * 1e6, per_call_us=(t2 - t0) / calls * 1e6)


def run(kv_dtypes, impl: str, shape: tuple[int, ...], calls: int, set_counts: list[int]) -> list[dict]:
  rows = []
  tiny = jax.jit(lambda a: a + 1)
  rows.append(dict(call="jit(a + 1)", sets=1, **time_loop(tiny, [(jnp.ones((4,), jnp.float32),)], calls)))
  for kv_dtype in kv_dtypes:
    fn, arg_sets = prepared_call(kv_dtype, impl, shape, max(set_counts))
    for sets in set_counts:
      rows.append(dict(call=f"decode {kv_dtype}", sets=sets, **time_loop(fn, arg_sets[:sets], calls)))
  return rows


def main(argv):
  del argv
  if not _COMMAND_BUFFERS.value:   # read when the GPU backend starts, which no jax op has done yet
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  shape = tuple(int(x) for x in _SHAPE.value)
  rows = run(_KV_DTYPES.value, _IMPL.value, shape, _CALLS.value, [int(s) for s in _SETS.value])
  print(f"# host dispatch  device={jax.devices()[0].device_kind}  shape B,T,Hq,Hkv,D={shape}  impl={_IMPL.value}"
        f"  command_buffers={_COMMAND_BUFFERS.value}")
  print(f"{'call':24} {'sets':>4} {'enqueue us':>11} {'per call us':>12}")
  for row in rows:
    print(f"{row['call']:24} {row['sets']:4d} {row['enqueue_us']:11.1f} {row['per_call_us']:12.1f}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump([dict(row, impl=_IMPL.value, shape=shape, command_buffers=_COMMAND_BUFFERS.value) for row in rows],
                f, indent=1)


if __name__ == "__main__":
  app.run(main)
