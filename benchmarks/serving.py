r"""SmolLM2-135M-Instruct in the continuous-batching engine at long context: tokens/s, step time,
the GPU's idle time between steps, and attention's share.

  python -m benchmarks serving                                  # CPU: a tiny case, weights fetched once
  python -m benchmarks serving --gguf=/path/SmolLM2-135M-Instruct.Q4_1.gguf --json=smollm2.json   # GPU

(`python -m benchmarks.serving` runs the same.) Hugging Face transformers on the same GGUF and
shapes, the peer engine: `python -m benchmarks.tools.smollm2_transformers`.

For each batch (= slots, every request arriving at step 0), context C (prompts of C - new_tokens
tokens, so that the last token sits at position C - 1) and attention, the engine of
`examples.smollm2.serving` runs once to compile and once timed. Attentions (--impl):
  auto, xla, mosaic_gpu, triton   pallas_kv's `impl`
  cudnn                           jax.nn.dot_product_attention(implementation="cudnn") over the
                                  pages gathered into a dense cache (what a JAX user without
                                  pallas_kv would write); `dot_product` is the same on XLA's own
                                  implementation (any device)
Fields:
  loop_tok_s       generated tokens / wall time of the whole timed run (prefills included)
  decode_tok_s     batch / step_ms: the decode loop's pace once every request is in
  step_ms          median host time per decode step between two reads of the tokens (the engine
                   reads a dispatch's tokens while the next dispatch runs)
  device_step_ms   a decode step's device time: dispatches queued back to back on a state of
                   `batch` sequences at the context, the host never waiting in between
  gpu_idle         1 - device_step_ms / step_ms: the part of the loop's wall time the GPU waits
  attn_us          one layer's decode attention alone at the context (chain-difference timer);
                   attn_share = layers * attn_us / device_step_ms
  stub_step_ms     (--stub) the engine's step with attention replaced by a trivial op
  first_tokens     the greedy tokens of the first request (to compare with another engine's)
The GPU has no network: pass the GGUF file with --gguf (`python -m examples.smollm2.weights`
prints where the cache keeps it).
"""

from __future__ import annotations

import dataclasses
import itertools
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
CPU_DEFAULTS = dict(batch=[1, 2], context=[24], impl=["xla"], new_tokens=4, layers=2, steps_per_dispatch=2)
GPU_DEFAULTS = dict(batch=[1, 16, 64], context=[1024, 4096, 8192], impl=["auto", "xla", "cudnn"], new_tokens=64,
                    layers=None, steps_per_dispatch=4)
PAGE_SIZE = 16
PEER_ATTENTIONS = ("cudnn", "dot_product")


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others')."""
  cli.define_timing_flags({"warmup": "1", "iters": "CPU 2, GPU 20", "repeats": "CPU 2, GPU 5"})
  cli.define_output_flags(("json",))
  flags.adopt_module_key_flags(cli)
  flags.DEFINE_string("gguf", None, "SmolLM2 GGUF file (default: fetched into the weights cache; needs network)")
  flags.DEFINE_list("batch", None, "slots = concurrent requests (CPU 1,2; GPU 1,16,64)")
  flags.DEFINE_list("context", None, "tokens in the cache at the last step: prompts of context - new_tokens "
                    "(CPU 24; GPU 1024,4096,8192)")
  flags.DEFINE_list("impl", None, f"attentions: pallas_kv impls or {', '.join(PEER_ATTENTIONS)} (CPU xla; GPU "
                    "auto,xla,cudnn)")
  flags.DEFINE_integer("new_tokens", None, "tokens generated per request (CPU 4, GPU 64)")
  flags.DEFINE_integer("steps_per_dispatch", None, "decode steps per engine dispatch (CPU 2, GPU 4)")
  flags.DEFINE_integer("layers", None, "run only the first N layers (CPU 2; GPU all)")
  flags.DEFINE_boolean("stub", False, "also time the engine with attention replaced by a trivial op")
  flags.DEFINE_integer("seed", 0, "seed of the random prompts")
  flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "matmul inputs (CPU float32, GPU bfloat16)")
  flags.DEFINE_integer("system_prompt", 0, "tokens every prompt starts with (a shared system prompt), the engine "
                       "with prefix caching (Engine(prefix_caching=True)): rows add prefill_tokens and cached_tokens")
  flags.DEFINE_list("samples", ["1"], "samples per prompt (Request.n): batch / N prompts, each forked into N "
                    "sequences that share its pages and read them once (Engine(share_prefixes=True)); 1: batch "
                    "independent requests. Rows of N > 1 skip device_step_ms and attn_us (they time independent "
                    "sequences)")


def truncate(config, params, layers: int | None):
  """The model cut to its first `layers` layers (a quicker CPU run); as it is for None."""
  if layers is None or layers >= config.num_layers:
    return config, params
  return (dataclasses.replace(config, num_layers=layers),
          dict(params, layers=jax.tree.map(lambda a: a[:layers], params["layers"])))


def prompt_ids(batch: int, prompt_len: int, vocab: int, seed: int) -> np.ndarray:
  """Random prompts [batch, prompt_len] of ids in [3, vocab) (numpy only: peers reuse them)."""
  return np.random.default_rng(seed).integers(3, vocab, size=(batch, prompt_len))


def make_requests(batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int, samples: int = 1,
                  system_prompt: int = 0):
  """batch sequences: batch / samples prompts of `samples` samples each, the first system_prompt tokens
  of every prompt the same."""
  if batch % samples:
    raise ValueError(f"batch={batch} must be a multiple of samples={samples}")
  prompts = prompt_ids(batch // samples, prompt_len, vocab, seed)
  prompts[:, :system_prompt] = prompts[0, :system_prompt]
  return [serving.Request(p.tolist(), new_tokens, ignore_eos=True, n=samples) for p in prompts]


# ---------------------------------------------------------------------------- other attentions
# The model takes no benchmark hook: a model with other attention is a `Llama` whose `attention`
# is a `DecodeAttention` with another decode step (`PeerAttention`), built here.


def _dot_product_step(implementation: str | None, layer: pkv.DecodeAttention, params, x, cache, positions):
  """The decode step of `layer` with jax.nn.dot_product_attention over the gathered pages."""
  project = lambda w: jnp.einsum("bsh,hnd->bsnd", x, params[w])
  q = pkv.module.rope(project("wq"), positions, layer.rope_theta)
  k = pkv.module.rope(project("wk"), positions, layer.rope_theta)
  cache = cache.append(k.astype(cache.k_pages.dtype), project("wv").astype(cache.v_pages.dtype))
  keys = pkv.cache.gather_pages(cache.k_pages, cache.block_tables)
  values = pkv.cache.gather_pages(cache.v_pages, cache.block_tables)
  out = jax.nn.dot_product_attention(q.astype(keys.dtype), keys, values, scale=layer.scale,
                                     key_value_seq_lengths=cache.lengths, implementation=implementation)
  return jnp.einsum("bsnd,ndh->bsh", out.astype(x.dtype), params["wo"]), cache


def cudnn_step(layer, params, x, cache, positions):
  return _dot_product_step("cudnn", layer, params, x, cache, positions)


def dot_product_step(layer, params, x, cache, positions):
  return _dot_product_step(None, layer, params, x, cache, positions)


def stub_step(layer, params, x, cache, positions):
  """What a step costs without attention: the projections and the cache append stay; attention
  over the cache becomes the new token's own value (no read of the cache)."""
  del positions   # no RoPE: nothing attends
  k = jnp.einsum("bsh,hnd->bsnd", x, params["wk"])
  v = jnp.einsum("bsh,hnd->bsnd", x, params["wv"])
  cache = cache.append(k.astype(cache.k_pages.dtype), v.astype(cache.v_pages.dtype))
  q = jnp.einsum("bsh,hnd->bsnd", x, params["wq"])
  v_rep = jnp.repeat(v.astype(x.dtype), layer.num_heads // layer.num_kv_heads, axis=2)
  return jnp.einsum("bsnd,ndh->bsh", v_rep + 0 * q, params["wo"]), cache


DECODE_STEPS = {"cudnn": cudnn_step, "dot_product": dot_product_step}
STUB = "stub"


@dataclasses.dataclass(frozen=True)
class PeerAttention(pkv.DecodeAttention):
  """The model's attention layer with the decode step of `peer` (a key of DECODE_STEPS, or STUB);
  prefill and the rest as `DecodeAttention`'s. The step plans no kernel: it takes no config or plan."""
  peer: str = "dot_product"

  def __call__(self, params, x, cache, positions=None, *, config=None, plan=None, shared_prefix=None):
    del config, plan, shared_prefix
    single = x.ndim == 2
    if single:
      x = x[:, None]
    if positions is None:
      positions = cache.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    step = stub_step if self.peer == STUB else DECODE_STEPS[self.peer]
    y, cache = step(self, params, x, cache, positions)
    return (y[:, 0] if single else y), cache


@dataclasses.dataclass(frozen=True)
class PeerLlama(Llama):
  """`Llama` whose layers decode with `PeerAttention(peer=peer)` (its impl: "xla", for prefill)."""
  peer: str = "dot_product"

  @property
  def attention(self) -> PeerAttention:
    layer = super().attention
    return PeerAttention(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}, peer=self.peer)


def make_model(config, attention: str, compute_dtype: str, stub: bool = False) -> Llama:
  """The model with decode attention from a pallas_kv impl or a peer (PEER_ATTENTIONS)."""
  if stub:
    return PeerLlama(config, impl="xla", compute_dtype=compute_dtype, peer=STUB)
  if attention in DECODE_STEPS:
    return PeerLlama(config, impl="xla", compute_dtype=compute_dtype, peer=attention)
  return Llama(config, impl=attention, compute_dtype=compute_dtype)


# ---------------------------------------------------------------------------- timing


def engine_for(model: Llama, params, batch: int, context: int, steps_per_dispatch: int, pool_sequences: int,
               page_size: int = PAGE_SIZE, share_prefixes: bool = False,
               prefix_caching: bool = False) -> serving.Engine:
  """An engine of `batch` slots over a pool of pool_sequences full sequences (a pool of one size
  for every batch of a context: the prefill compiles once for them all)."""
  pages_per_seq = -(-context // page_size)
  return serving.Engine(model, params, num_slots=batch, page_size=page_size,
                        num_pages=max(batch, pool_sequences) * pages_per_seq, max_pages_per_seq=pages_per_seq,
                        steps_per_dispatch=steps_per_dispatch, share_prefixes=share_prefixes,
                        prefix_caching=prefix_caching)


def run_loop(engine: serving.Engine, requests, *, progress: bool = False):
  """(stats of the timed run, its requests) after a compile run of requests of the same shapes (the first
  and the last: with prefix caching, the prefill of a prompt's uncached rest compiles there too)."""
  short = lambda r: dataclasses.replace(r, max_new_tokens=2 * engine.steps_per_dispatch + 1, output_ids=[])
  engine.run([short(requests[0])] + ([short(requests[-1])] if engine.prefix_cache is not None else []))
  if engine.prefix_cache is not None:
    engine.clear_prefix_cache()   # the timed run starts with nothing cached
  engine.stats = serving.Stats()
  runs = [dataclasses.replace(r, output_ids=[]) for r in requests]
  stats = engine.run(runs, progress=progress)
  return stats, runs


def full_state(engine: serving.Engine, length: int) -> serving.SlotState:
  """Every slot generating at `length` tokens, holding its pages (the rest in the pool), as the
  engine holds them mid-run (the cache's values are zeros: they do not change the time)."""
  batch, pages_per_seq = engine.num_slots, engine.capacity // engine.page_size
  held = -(-length // engine.page_size)
  ids = np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)
  tables = np.where(np.arange(pages_per_seq) < held, ids, pkv.UNALLOCATED)
  free = np.concatenate([ids[:, held:].reshape(-1), np.arange(ids.size, engine.num_pages, dtype=np.int32)])
  pool = pkv.PagePool(jnp.asarray(np.concatenate([free, ids[:, :held].reshape(-1)])), jnp.int32(free.size),
                      jnp.asarray(np.isin(np.arange(engine.num_pages), ids[:, :held]), jnp.int32))
  state = engine.state
  slots = engine.num_slots
  return dataclasses.replace(state, tables=jnp.asarray(tables), lengths=jnp.full((slots,), length, jnp.int32),
                             pool=pool, tokens=jnp.full((slots,), 5, jnp.int32), active=jnp.ones((slots,), bool),
                             remaining=jnp.full((slots,), 2**30, jnp.int32))


def device_step_seconds(engine: serving.Engine, length: int, steps: int) -> tuple[float, float]:
  """(device seconds, host enqueue seconds) per decode step: `steps` steps dispatched back to
  back from a state of every slot at `length` tokens, read once at the end."""
  dispatches = max(1, steps // engine.steps_per_dispatch)
  state = full_state(engine, length)
  state, *out = serving.decode_steps(engine.model, engine.params, state, engine.steps_per_dispatch)  # warm-up
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(dispatches):
    state, *out = serving.decode_steps(engine.model, engine.params, state, engine.steps_per_dispatch)
  enqueued = time.perf_counter()
  jax.block_until_ready((state, out))
  done = time.perf_counter()
  n = dispatches * engine.steps_per_dispatch
  return (done - start) / n, (enqueued - start) / n


def time_attention(config, batch: int, context: int, attention: str, counts: dict, page_size: int = PAGE_SIZE) -> float:
  """Seconds of one layer's paged decode attention at this batch and context (shuffled pages)."""
  pages_per_seq = -(-context // page_size)
  num_pages = batch * pages_per_seq
  keys = jax.random.split(jax.random.key(context + batch), 4)
  shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
  k = jax.random.normal(keys[0], shape, jnp.bfloat16)
  v = jax.random.normal(keys[1], shape, jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, config.num_heads, config.head_dim), jnp.bfloat16)
  tables = jax.random.permutation(keys[3], num_pages).reshape(batch, pages_per_seq).astype(jnp.int32)
  lengths = jnp.full((batch,), context, jnp.int32)
  if attention in DECODE_STEPS:
    implementation = "cudnn" if attention == "cudnn" else None
    attend = lambda q, k, v, t, n: jax.nn.dot_product_attention(
        q[:, None], pkv.cache.gather_pages(k, t), pkv.cache.gather_pages(v, t), key_value_seq_lengths=n,
        implementation=implementation)
  else:
    attend = lambda q, k, v, t, n: pkv.paged_decode_attention(q, k, v, t, n, impl=attention)
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


def run_row(config, params, *, batch: int, context: int, attention: str, new_tokens: int, steps_per_dispatch: int,
            pool_sequences: int, counts: dict, compute_dtype: str, seed: int, stub: bool, progress: bool,
            samples: int = 1, system_prompt: int = 0) -> dict:
  """Times one (batch, context, attention, samples); the fields of the module docstring."""
  prompt_len = context - new_tokens
  requests = make_requests(batch, prompt_len, new_tokens, config.vocab_size, seed, samples, system_prompt)
  phases = Phases(f"B={batch} C={context} {attention} n={samples}")
  engine = engine_for(make_model(config, attention, compute_dtype), params, batch, context, steps_per_dispatch,
                      pool_sequences, share_prefixes=samples > 1, prefix_caching=system_prompt > 0)
  stats, runs = run_loop(engine, requests, progress=progress)
  ran = attention if attention in DECODE_STEPS else pkv.last_impl()
  phases.done("engine (compile run + timed run)")
  step_s = statistics.median(stats.step_seconds)
  device_s = enqueue_s = attn_s = float("nan")
  if samples == 1:   # both time independent sequences
    device_s, enqueue_s = device_step_seconds(engine, context - new_tokens // 2, new_tokens // 2)
    attn_s = time_attention(config, batch, context - new_tokens // 2, attention, counts)
    phases.done("device step and attention alone")
  del engine
  row = dict(ran=ran, loop_tok_s=stats.tokens_per_s, decode_tok_s=batch / step_s, step_ms=1e3 * step_s,
             p90_step_ms=1e3 * float(np.percentile(stats.step_seconds, 90)), device_step_ms=1e3 * device_s,
             enqueue_step_ms=1e3 * enqueue_s, gpu_idle=max(0.0, 1 - device_s / step_s), attn_us=1e6 * attn_s,
             attn_share=config.num_layers * attn_s / device_s, first_tokens=runs[0].output_ids,
             prefill_tokens=stats.prefill_tokens, cached_tokens=stats.cached_tokens)
  if stub:
    stub_engine = engine_for(make_model(config, attention, compute_dtype, stub=True), params, batch, context,
                             steps_per_dispatch, pool_sequences)
    stub_stats, _ = run_loop(stub_engine, requests)
    row["stub_step_ms"] = 1e3 * statistics.median(stub_stats.step_seconds)
    phases.done("engine without attention")
  return row


def run(config, params, *, batches: Sequence[int], contexts: Sequence[int], impls: Sequence[str], new_tokens: int,
        counts: dict, steps_per_dispatch: int = 4, compute_dtype: str = "float32", seed: int = 0, stub: bool = False,
        out: Callable[[str], None] = print, json_path: str | None = None, progress: bool = False,
        samples: Sequence[int] = (1,), system_prompt: int = 0) -> list[dict]:
  """One row per (context, batch, attention, samples per prompt); rewrites json_path after each row so
  a run cut short keeps them."""
  rows = []
  params = Llama(config, compute_dtype=compute_dtype).prepare(params)
  for context in contexts:
    if context <= new_tokens:
      raise ValueError(f"context={context} must exceed new_tokens={new_tokens} (prompts of context - new_tokens)")
    for batch in batches:
      for attention, n in itertools.product(impls, samples):
        row = dict(model="SmolLM2-135M-Instruct", layers=config.num_layers, batch=batch, context=context,
                   prompt_len=context - new_tokens, new_tokens=new_tokens, impl=attention, samples=n,
                   system_prompt=system_prompt,
                   steps_per_dispatch=steps_per_dispatch, compute_dtype=compute_dtype)
        try:
          row |= run_row(config, params, batch=batch, context=context, attention=attention, new_tokens=new_tokens,
                         steps_per_dispatch=steps_per_dispatch, pool_sequences=max(batches), counts=counts, compute_dtype=compute_dtype,
                         seed=seed, stub=stub, progress=progress, samples=n, system_prompt=system_prompt)
          stub_text = f"  no-attention step {row['stub_step_ms']:7.2f} ms" if stub else ""
          out(f"C={context:5d} B={batch:3d} n={n:2d} {attention:10s} ({row['ran']:10s}) loop {row['loop_tok_s']:9.1f} tok/s  "
              f"decode {row['decode_tok_s']:9.1f} tok/s  step {row['step_ms']:7.2f} ms (device "
              f"{row['device_step_ms']:7.2f}, GPU idle {100 * row['gpu_idle']:5.1f}%)  attention "
              f"{row['attn_us']:8.1f} us/layer ({100 * row['attn_share']:5.1f}% of a step){stub_text}")
        except Exception as e:  # pylint: disable=broad-except
          row |= dict(error=output.error_reason(e))
          out(f"C={context:5d} B={batch:3d} {attention:10s} error: {row['error']}")
        rows.append(row)
        if json_path:
          output.write_json(rows, json_path)
  return rows


def main(argv):
  del argv
  defaults = CPU_DEFAULTS if jax.default_backend() == "cpu" else GPU_DEFAULTS
  batches = cli.parse_ints(FLAGS.batch, "batch") if FLAGS.batch else defaults["batch"]
  contexts = cli.parse_ints(FLAGS.context, "context") if FLAGS.context else defaults["context"]
  impls = FLAGS.impl or defaults["impl"]
  layers = FLAGS.layers if FLAGS.layers is not None else defaults["layers"]
  cpu = jax.default_backend() == "cpu"
  counts = {"warmup": 1, "iters": 2 if cpu else 20, "repeats": 2 if cpu else 5, **cli.timing_flags().given()}
  path = FLAGS.gguf or weights.fetch_gguf()
  config, params, _ = gguf_loader.load(path)
  config, params = truncate(config, params, layers)
  print(f"# SmolLM2 engine  device={jax.devices()[0].device_kind}  jax={jax.__version__}  layers={config.num_layers}",
        flush=True)
  run(config, params, batches=batches, contexts=contexts, impls=impls,
      new_tokens=FLAGS.new_tokens or defaults["new_tokens"], counts=counts,
      steps_per_dispatch=FLAGS.steps_per_dispatch or defaults["steps_per_dispatch"],
      compute_dtype=FLAGS.compute_dtype or default_compute_dtype(), seed=FLAGS.seed, stub=FLAGS.stub,
      json_path=cli.output_paths().json, progress=True, samples=cli.parse_ints(FLAGS.samples, "samples"),
      system_prompt=FLAGS.system_prompt)


if __name__ == "__main__":
  define_flags()
  app.run(main)
