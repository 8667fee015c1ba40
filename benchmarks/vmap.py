r"""vmap of the ops against the same work as one batch: does the mapped axis cost anything?

  python -m benchmarks vmap                                               # CPU: xla, tiny shapes
  python -m benchmarks vmap --impl=mosaic_gpu,triton --json=vmap.json    # GPU: the shapes below

Each case N x (B, T): N independent problems of B sequences of T tokens (heads 32/8, head_dim 128,
bf16, full lengths; paged: page 64, a pool per element). Two rows per impl: `vmapped`, jax.vmap of
the op over inputs [N, B, ...], and `batched`, the op once on the same arrays reshaped to
[N * B, ...] (for paged, the pools concatenated and ids offset). Target: vmapped within 5% of
batched (`pallas_kv/batching.py` folds the axis; a loop of N launches would show here).
Timing: benchmarks/timing.py's chain difference, inputs rotated past L2 on a GPU.
"""

from __future__ import annotations

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import pallas_kv as pkv
from benchmarks import cli
from benchmarks import output
from benchmarks import timing

FLAGS = flags.FLAGS
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 64
GPU_CASES = ("8x1x8192", "4x8x4096", "16x1x4096", "4x8x4096p")   # N x B x T, "p": paged
CPU_CASES = ("2x2x128", "2x2x128p")
CPU_TIMING = {"warmup": 1, "iters": 2, "repeats": 3}
GPU_TIMING = {"warmup": 2, "iters": 20, "repeats": 5}


def parse_case(spec: str) -> tuple[int, int, int, bool]:
  paged = spec.endswith("p")
  n, b, t = (int(x) for x in spec.rstrip("p").split("x"))
  return n, b, t, paged


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others')."""
  cli.define_timing_flags({name: f"CPU {CPU_TIMING[name]}, GPU {GPU_TIMING[name]}" for name in GPU_TIMING})
  cli.define_output_flags(("json",))
  flags.DEFINE_list("cases", None, f"N x B x T cases, 'p' for paged (default GPU {','.join(GPU_CASES)})")
  flags.DEFINE_list("impl", None, "impls (default: mosaic_gpu,triton on a GPU; xla on a CPU)")
  flags.adopt_module_key_flags(cli)


def make_inputs(n: int, b: int, t: int, paged: bool, key):
  """(vmapped inputs [N, B, ...], the same as one batch [N * B, ...])."""
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (n, b, HEADS, HEAD_DIM), jnp.bfloat16)
  lengths = jnp.full((n, b), t, jnp.int32)
  flat = lambda x: x.reshape(n * x.shape[1], *x.shape[2:])
  if not paged:
    k = jax.random.normal(kk, (n, b, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (n, b, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return (q, k, v, lengths), (flat(q), flat(k), flat(v), flat(lengths))
  pages_per_seq = t // PAGE_SIZE
  num_pages = b * pages_per_seq
  shape = (n, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
  k_pages, v_pages = jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16)
  tables = jnp.broadcast_to(jnp.arange(num_pages, dtype=jnp.int32).reshape(b, pages_per_seq), (n, b, pages_per_seq))
  offset_tables = tables + (jnp.arange(n, dtype=jnp.int32) * num_pages)[:, None, None]
  return ((q, k_pages, v_pages, tables, lengths),
          (flat(q), flat(k_pages), flat(v_pages), flat(offset_tables), flat(lengths)))


def run(specs, impls, warmup: int, iters: int, repeats: int) -> list[dict]:
  rows = []
  for spec in specs:
    n, b, t, paged = parse_case(spec)
    vmapped_args, batched_args = make_inputs(n, b, t, paged, jax.random.key(0))
    op = pkv.paged_decode_attention if paged else pkv.decode_attention
    for impl in impls:
      f = functools.partial(op, impl=impl)
      times = {}
      for name, fn, args in (("vmapped", jax.jit(jax.vmap(f)), vmapped_args), ("batched", jax.jit(f), batched_args)):
        try:
          t_s = timing.time_jax(fn, [args], warmup=warmup, iters=iters, repeats=repeats).median_s
        except Exception as e:  # pylint: disable=broad-except
          rows.append(dict(case=spec, impl=impl, kind=name, status="error", reason=output.error_reason(e)))
          print(f"{spec:>12} {impl:>11} {name:>8}  error ({output.error_reason(e)})", flush=True)
          continue
        times[name] = t_s * 1e6
        rows.append(dict(case=spec, impl=impl, kind=name, status="ok", time_us=t_s * 1e6))
      if len(times) == 2:
        ratio = times["vmapped"] / times["batched"]
        print(f"{spec:>12} {impl:>11}  vmapped {times['vmapped']:9.1f} us  batched {times['batched']:9.1f} us"
              f"  ratio {ratio:.3f}", flush=True)
  return rows


def main(argv):
  del argv
  cpu = jax.default_backend() == "cpu"
  warmup, iters, repeats = cli.timing_or_defaults(CPU_TIMING, GPU_TIMING)
  specs = FLAGS.cases or (CPU_CASES if cpu else GPU_CASES)
  impls = FLAGS.impl or (["xla"] if cpu else ["mosaic_gpu", "triton"])
  rows = run(specs, impls, warmup, iters, repeats)
  if cli.output_paths().json:
    output.write_json(rows, cli.output_paths().json)


if __name__ == "__main__":
  define_flags()
  app.run(main)
