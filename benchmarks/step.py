r"""Decode-step benchmark of the DecodeAttention layer: time per step and tokens per second.

  python -m benchmarks step                                   # CPU: one tiny case on xla
  python -m benchmarks step --impl=auto,xla --batch=1,8,32,128 --context=1024,8192,32768 --json=step.json

A Llama-3-8B-shaped layer by default on a GPU (hidden 4096, heads 32/8, head_dim 128, bf16 paged
cache, page 64): each step projects one new token per sequence, applies RoPE, appends K/V to the
paged cache and attends over `context` cached tokens. Timing: one jitted chain of N steps and
one of 2N, each step taking the cache the previous one returned (so the append is in place after
the first step, as with a donated cache); time per step = difference / N (dispatch cancels).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import cli
from benchmarks import output
import pallas_kv as pkv

FLAGS = flags.FLAGS
# --iters (steps per timed chain) and --repeats unless given.
CPU_TIMING = {"iters": 2, "repeats": 5}
GPU_TIMING = {"iters": 10, "repeats": 5}


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others')."""
  cli.define_timing_flags({name: f"CPU {CPU_TIMING[name]}, GPU {GPU_TIMING[name]}" for name in GPU_TIMING})
  cli.define_output_flags(("json",))
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_list("impl", None, "decode attention backends (default: auto,xla on GPU; xla on CPU)")
  flags.DEFINE_list("batch", None, "batch sizes")
  flags.DEFINE_list("context", None, "cached tokens per sequence")
  flags.DEFINE_integer("hidden", None, "model width")
  flags.DEFINE_integer("num_heads", 32, "query heads")
  flags.DEFINE_integer("num_kv_heads", 8, "kv heads")
  flags.DEFINE_integer("head_dim", None, "head dim")
  flags.DEFINE_integer("page_size", 64, "tokens per page")


@dataclasses.dataclass(frozen=True)
class StepCase:
  batch: int
  context: int
  hidden: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  headroom: int  # cache capacity beyond the context, for the steps of a chain


def make_state(case: StepCase, impl: str, key):
  """(layer, params, x, cache) with `context` random tokens already cached in shuffled pages."""
  layer = pkv.DecodeAttention(hidden_size=case.hidden, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                              head_dim=case.head_dim, param_dtype="bfloat16", impl=impl)
  k_params, k_x, k_pages, k_perm = jax.random.split(key, 4)
  params = layer.init(k_params)
  pages_per_seq = -(-(case.context + case.headroom) // case.page_size)
  num_pages = case.batch * pages_per_seq
  shape = (num_pages, case.page_size, case.num_kv_heads, case.head_dim)
  k1, k2 = jax.random.split(k_pages)
  tables = jax.random.permutation(k_perm, num_pages).reshape(case.batch, pages_per_seq).astype(jnp.int32)
  cache = pkv.PagedKVCache(jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16),
                           tables, jnp.full((case.batch,), case.context, jnp.int32))
  x = jax.random.normal(k_x, (case.batch, 1, case.hidden), jnp.bfloat16)
  return layer, params, x, cache


def time_steps(layer, params, x, cache, *, iters: int, repeats: int) -> float:
  """Median seconds per decode step (chain difference)."""
  def chain(n):
    def run(params, x, cache):
      for _ in range(n):
        y, cache = layer(params, x, cache)
        x = x + 1e-3 * y  # each step depends on the last
      return x, cache
    return jax.jit(run).lower(params, x, cache).compile()

  short, long = chain(iters), chain(2 * iters)
  jax.block_until_ready((short(params, x, cache), long(params, x, cache)))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter(); jax.block_until_ready(short(params, x, cache))
    t1 = time.perf_counter(); jax.block_until_ready(long(params, x, cache))
    t2 = time.perf_counter()
    samples.append(((t2 - t1) - (t1 - t0)) / iters)
  return statistics.median(samples)


def run(cases: Sequence[StepCase], impls: Sequence[str], *, iters: int, repeats: int,
        json_path: str | None = None) -> list[dict]:
  """Times every (case, impl); rewrites `json_path` after each row so a run cut short keeps them."""
  rows = []
  for case in cases:
    for impl in impls:
      row = dataclasses.asdict(case) | dict(impl=impl)
      try:
        state = make_state(case, impl, jax.random.key(case.batch * 7919 + case.context))
        seconds = time_steps(*state, iters=iters, repeats=repeats)
        row |= dict(step_us=seconds * 1e6, tokens_per_s=case.batch / seconds if seconds > 0 else float("nan"),
                    ran=pkv.last_impl())
      except NotImplementedError as e:
        row |= dict(error=f"n/a ({e})")
      rows.append(row)
      detail = (f"{row['step_us']:10.1f} us/step {row['tokens_per_s']:12.0f} tok/s  ({row['ran']})"
                if "step_us" in row else row["error"])
      print(f"B={case.batch:4d} ctx={case.context:6d} {impl:11s} {detail}", flush=True)
      if json_path:
        output.write_json(rows, json_path)
  return rows


def main(argv):
  del argv
  cpu = jax.default_backend() == "cpu"
  impls = FLAGS.impl or (["xla"] if cpu else ["auto", "xla"])
  batches = [int(b) for b in FLAGS.batch or (["2"] if cpu else ["1", "8", "32", "128"])]
  contexts = [int(c) for c in FLAGS.context or (["128"] if cpu else ["1024", "8192", "32768"])]
  hidden = FLAGS.hidden or (64 if cpu else 4096)
  head_dim = FLAGS.head_dim or (64 if cpu else 128)
  heads, kv_heads = (4, 2) if cpu and FLAGS["num_heads"].using_default_value else (FLAGS.num_heads,
                                                                                    FLAGS.num_kv_heads)
  counts = {**(CPU_TIMING if cpu else GPU_TIMING), **cli.timing_flags().given()}
  cases = [StepCase(b, c, hidden, heads, kv_heads, head_dim, FLAGS.page_size, headroom=2 * counts["iters"])
           for b in batches for c in contexts]
  print(f"# DecodeAttention step  device={jax.devices()[0].device_kind}  jax={jax.__version__}")
  run(cases, impls, **counts, json_path=cli.output_paths().json)


if __name__ == "__main__":
  define_flags()
  app.run(main)
