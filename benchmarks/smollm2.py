r"""SmolLM2-135M-Instruct in the continuous-batching loop: tokens/s, step latency, attention's share.

  python -m benchmarks.smollm2                                  # CPU: a tiny case, weights fetched once
  python -m benchmarks.smollm2 --gguf=/path/SmolLM2-135M-Instruct.Q4_1.gguf --json=smollm2.json   # GPU

For each batch (= slots, every request arriving at step 0 and generating --new_tokens tokens past
EOS) and impl, the loop of `examples.smollm2.serving` runs once to compile, then once timed:
  loop_tok_s    generated tokens / wall time of the whole run (prefills included)
  step_ms       median host-timed decode step (one token per slot, tokens back on the host)
  stub_step_ms  the same with decode attention replaced by a trivial op (no cache read)
  attn_share    1 - stub_step_ms / step_ms: the part of a step that attention costs
  attn_us       one layer's paged decode attention alone at the run's mid context (chain-difference
                timer), and attn_alone_share = layers * attn_us / step_ms
The GPU has no network: pass the GGUF file with --gguf (`python -m examples.smollm2.weights`
prints where the cache keeps it).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli
from benchmarks import output
from benchmarks import timing
import pallas_kv as pkv
from examples.smollm2 import gguf_loader
from examples.smollm2 import serving
from examples.smollm2 import weights
from examples.smollm2.model import Llama
from examples.smollm2.model import default_compute_dtype

FLAGS = flags.FLAGS
CPU_DEFAULTS = dict(batch=[1, 2], impl=["xla"], prompt_len=16, new_tokens=4, layers=2)
GPU_DEFAULTS = dict(batch=[1, 8, 64], impl=["auto", "xla"], prompt_len=512, new_tokens=128, layers=None)
PAGE_SIZE = 16


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others')."""
  cli.define_timing_flags({"warmup": "1", "iters": "CPU 2, GPU 20", "repeats": "CPU 2, GPU 5"})
  cli.define_output_flags(("json",))
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_string("gguf", None, "SmolLM2 GGUF file (default: fetched into the weights cache; needs network)")
  flags.DEFINE_list("batch", None, "slots = concurrent requests (CPU 1,2; GPU 1,8,64)")
  flags.DEFINE_list("impl", None, "decode attention backends (CPU xla; GPU auto,xla)")
  flags.DEFINE_integer("prompt_len", None, "longest prompt; prompts spread over [prompt_len/2, prompt_len] (CPU 16, GPU 512)")
  flags.DEFINE_integer("new_tokens", None, "tokens generated per request (CPU 4, GPU 128)")
  flags.DEFINE_integer("layers", None, "run only the first N layers (CPU 2; GPU all)")
  flags.DEFINE_integer("seed", 0, "seed of the random prompts")
  flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "matmul inputs (CPU float32, GPU bfloat16)")


def truncate(config, params, layers: int | None):
  """The model cut to its first `layers` layers (a quicker CPU run); as it is for None."""
  if layers is None or layers >= config.num_layers:
    return config, params
  return (dataclasses.replace(config, num_layers=layers),
          dict(params, layers=jax.tree.map(lambda a: a[:layers], params["layers"])))


def make_requests(batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, size=batch)
  return [serving.Request(rng.integers(3, vocab, size=int(n)).tolist(), new_tokens, ignore_eos=True) for n in lengths]


def run_loop(model: Llama, params, requests, *, page_size: int = PAGE_SIZE, progress: bool = False):
  """(stats of the timed run, the engine) after a compile run of the same shapes."""
  longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
  pages_per_seq = -(-longest // page_size)
  engine = serving.Engine(model, params, num_slots=len(requests), page_size=page_size,
                          num_pages=len(requests) * pages_per_seq, max_pages_per_seq=pages_per_seq)
  engine.run([dataclasses.replace(r, max_new_tokens=2, output_ids=[]) for r in requests])
  engine.stats = serving.Stats()
  stats = engine.run([dataclasses.replace(r, output_ids=[]) for r in requests], progress=progress)
  return stats, engine


def time_attention(config, batch: int, context: int, impl: str, counts: dict, page_size: int = PAGE_SIZE) -> float:
  """Seconds of one layer's paged decode attention at this batch and context (shuffled pages)."""
  pages_per_seq = -(-(context + 1) // page_size)
  num_pages = batch * pages_per_seq
  keys = jax.random.split(jax.random.key(context + batch), 4)
  shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
  k = jax.random.normal(keys[0], shape, jnp.bfloat16)
  v = jax.random.normal(keys[1], shape, jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, config.num_heads, config.head_dim), jnp.bfloat16)
  tables = jax.random.permutation(keys[3], num_pages).reshape(batch, pages_per_seq).astype(jnp.int32)
  lengths = jnp.full((batch,), context, jnp.int32)
  attend = lambda q, k, v, t, n: pkv.paged_decode_attention(q, k, v, t, n, impl=impl)
  # A fixed chain: at this model's size a call takes a few µs, and growing the chain to
  # timing.MIN_CHAIN_S would compile hundreds of kernel launches (minutes on the GPU).
  return timing.time_jax(attend, [(q, k, v, tables, lengths)], min_chain_s=0.0, **counts).median_s


class Phases:
  """Prints to stderr how long each phase of a row took (a slow compile shows up before the row does)."""

  def __init__(self, label: str):
    self.label, self.start = label, time.perf_counter()

  def done(self, what: str) -> None:
    now = time.perf_counter()
    print(f"# {self.label}: {what} took {now - self.start:.1f} s", file=sys.stderr, flush=True)
    self.start = now


def run(config, params, *, batches: Sequence[int], impls: Sequence[str], prompt_len: int, new_tokens: int,
        counts: dict, compute_dtype: str = "float32", seed: int = 0, out: Callable[[str], None] = print,
        json_path: str | None = None, progress: bool = False) -> list[dict]:
  """One row per (batch, impl); rewrites json_path after each row so a run cut short keeps them."""
  rows = []
  model = lambda impl, stub=False: Llama(config, impl=impl, compute_dtype=compute_dtype, attention_stub=stub)
  params = model("xla").prepare(params)
  for batch in batches:
    requests = make_requests(batch, prompt_len, new_tokens, config.vocab_size, seed)
    for impl in impls:
      row = dict(model="SmolLM2-135M-Instruct", layers=config.num_layers, batch=batch, impl=impl,
                 prompt_len=prompt_len, new_tokens=new_tokens, compute_dtype=compute_dtype)
      try:
        phases = Phases(f"B={batch} {impl}")
        stats, _ = run_loop(model(impl), params, requests, progress=progress)
        ran = pkv.last_impl()
        phases.done("loop (compile run + timed run)")
        stub, _ = run_loop(model(impl, stub=True), params, requests, progress=progress)
        phases.done("loop without attention")
        step_s, stub_s = statistics.median(stats.step_seconds), statistics.median(stub.step_seconds)
        context = int(np.mean([len(r.prompt_ids) for r in requests])) + new_tokens // 2
        attn_s = time_attention(config, batch, context, impl, counts)
        phases.done("attention alone")
        row |= dict(ran=ran, loop_tok_s=stats.tokens_per_s, decode_tok_s=batch / step_s, step_ms=1e3 * step_s,
                    p90_step_ms=1e3 * float(np.percentile(stats.step_seconds, 90)), stub_step_ms=1e3 * stub_s,
                    attn_share=1 - stub_s / step_s, attn_us=1e6 * attn_s,
                    attn_alone_share=config.num_layers * attn_s / step_s)
        out(f"B={batch:3d} {impl:10s} ({ran:10s}) loop {row['loop_tok_s']:9.1f} tok/s  step {row['step_ms']:7.2f} ms "
            f"(p90 {row['p90_step_ms']:7.2f})  no-attention step {row['stub_step_ms']:7.2f} ms  attention "
            f"{100 * row['attn_share']:5.1f}% of a step; alone {row['attn_us']:8.1f} us/layer "
            f"({100 * row['attn_alone_share']:5.1f}%)")
      except NotImplementedError as e:
        row |= dict(error=f"n/a ({e})")
        out(f"B={batch:3d} {impl:10s} {row['error']}")
      rows.append(row)
      if json_path:
        output.write_json(rows, json_path)
  return rows


def main(argv):
  del argv
  defaults = CPU_DEFAULTS if jax.default_backend() == "cpu" else GPU_DEFAULTS
  batches = cli.parse_ints(FLAGS.batch, "batch") if FLAGS.batch else defaults["batch"]
  impls = FLAGS.impl or defaults["impl"]
  layers = FLAGS.layers if FLAGS.layers is not None else defaults["layers"]
  cpu = jax.default_backend() == "cpu"
  counts = {"warmup": 1, "iters": 2 if cpu else 20, "repeats": 2 if cpu else 5, **cli.timing_flags().given()}
  path = FLAGS.gguf or weights.fetch_gguf()
  config, params, _ = gguf_loader.load(path)
  config, params = truncate(config, jax.tree.map(jnp.asarray, params), layers)
  print(f"# SmolLM2 loop  device={jax.devices()[0].device_kind}  jax={jax.__version__}  layers={config.num_layers}",
        flush=True)
  run(config, params, batches=batches, impls=impls, prompt_len=FLAGS.prompt_len or defaults["prompt_len"],
      new_tokens=FLAGS.new_tokens or defaults["new_tokens"], counts=counts,
      compute_dtype=FLAGS.compute_dtype or default_compute_dtype(), seed=FLAGS.seed,
      json_path=cli.output_paths().json, progress=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
