r"""Hugging Face transformers decoding SmolLM2-135M-Instruct: the peer of `benchmarks.serving`.

  python -m benchmarks.tools.smollm2_transformers --gguf=/path/SmolLM2-135M-Instruct.Q4_1.gguf \
      --batch=1,16,64 --context=1024,4096,8192 --new_tokens=64 --json=smollm2_transformers.json
  python -m benchmarks.tools.smollm2_transformers --gguf=PATH --batch=1,2 --context=64 --new_tokens=4   # CPU smoke

Runs on torch alone (no jax): it needs torch, transformers 5.x, accelerate, gguf (transformers'
GGUF loader reads the file with it), absl-py and numpy. transformers loads the GGUF file,
dequantized, in --dtype (bfloat16) with --attn (sdpa) attention, on CUDA when there is one.

For each batch B and context C, B random prompts (ids in [3, vocab), seeded; the first prompt of
a row is the same for every B at one C) of C - new_tokens tokens each are prefilled into a
transformers StaticCache of C tokens, then `new_tokens` decode steps run, each one forward of the
B previous tokens (argmax on the device, EOS never stops a sequence), so the cache ends full at C.
As transformers' StaticCache does, every step attends over all C slots, the unfilled ones masked.
Each shape runs once untimed first (allocator, kernel selection, compilation with --compile).
Row fields:
  prompt_len    C - new_tokens, the tokens each prompt prefills
  prefill_s     wall time of the prefill (chunks of --prefill_chunk tokens), first token included
  decode_s      wall time of the new_tokens decode steps (device synchronized before and after)
  tok_s         B * new_tokens / decode_s: decode throughput (one token per sequence per step)
  step_ms       median decode step; p90_step_ms its 90th percentile. On CUDA, the time between
                CUDA events recorded after consecutive steps (no synchronization in between), on
                the CPU host wall time
  peak_mem_gib  torch.cuda.max_memory_allocated over the timed run (weights, cache, activations);
                kv_cache_gib the static cache alone
  tokens        greedy ids of the first prompt: the prefill's choice, then the first new_tokens - 1
                steps' (the last step's choice lies past new_tokens), as generate(max_new_tokens=
                new_tokens) returns them, to compare with another engine's
  error         why the row has no timings (out of memory: the run goes on with the next row)
Each row also names the engine, its versions, the device and the settings. One line per row goes
to stdout, and --json is rewritten after every row (a list of dicts).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time

from absl import app
from absl import flags
import numpy as np

FLAGS = flags.FLAGS
CPU_DEFAULTS = dict(batch=[1, 2], context=[64], new_tokens=4)
GPU_DEFAULTS = dict(batch=[1, 16, 64], context=[1024, 4096, 8192], new_tokens=64)
MODEL = "SmolLM2-135M-Instruct"


def define_flags():
  """Flags of this program (defined on demand so that importing it never clashes with others')."""
  flags.DEFINE_string("gguf", None, "SmolLM2 GGUF file", required=True)
  flags.DEFINE_list("batch", None, "sequences decoded together (CPU 1,2; GPU 1,16,64)")
  flags.DEFINE_list("context", None, "tokens in the cache after the last step (CPU 64; GPU 1024,4096,8192)")
  flags.DEFINE_integer("new_tokens", None, "decode steps per row (CPU 4, GPU 64)")
  flags.DEFINE_integer("seed", 0, "seed of the random prompts")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "weights, activations and cache")
  flags.DEFINE_string("attn", "sdpa", "transformers attn_implementation")
  flags.DEFINE_enum("device", "auto", ["auto", "cuda", "cpu"], "auto: CUDA when there is one")
  flags.DEFINE_integer("prefill_chunk", 2048, "prompt tokens per prefill forward (bounds the prefill's "
                       "[B, H, chunk, C] attention mask and scores; 0 = the whole prompt at once)")
  flags.DEFINE_bool("compile", False, "decode steps through torch.compile(mode='reduce-overhead') "
                    "(CUDA graphs); default eager, as transformers runs out of the box")
  flags.DEFINE_string("json", None, "write the rows here (a JSON list, rewritten after each row)")


def parse_ints(values, name: str) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise app.UsageError(f"--{name} takes integers, got {','.join(values)}") from None


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> np.ndarray:
  """[batch, prompt_len] int64 ids in [3, vocab) (0-2 are the special tokens); row 0 is the same for
  every batch at one prompt_len (rows are drawn one after another from one seeded stream)."""
  return np.random.default_rng(seed).integers(3, vocab, size=(batch, prompt_len), dtype=np.int64)


def load_model(path: pathlib.Path, dtype: str, attn: str, device: str):
  """The GGUF file as a transformers causal LM on `device`, in eval mode."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype),
                                               attn_implementation=attn)
  return model.to(device).eval()


def synchronize(device: str) -> None:
  import torch
  if device == "cuda":
    torch.cuda.synchronize()


class Decoder:
  """Prefill + greedy decode of one [B, C] shape with a StaticCache that is reused across runs (with
  --compile the compiled step keeps the addresses it captured)."""

  def __init__(self, model, context: int, device: str, *, prefill_chunk: int, compile_step: bool):
    import torch
    from transformers import StaticCache
    self.model, self.device = model, device
    self.prefill_chunk = prefill_chunk
    self.cache = StaticCache(config=model.config, max_cache_len=context)
    # Every position once on the device: a step takes a view, no host-to-device copy.
    self.positions = torch.arange(context, device=device)[None]
    self.step = model.forward
    if compile_step:
      torch.compiler.reset()  # a fresh graph per shape: no recompile limit across rows
      self.step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)

  def kv_cache_bytes(self) -> int:
    return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

  def run(self, prompts, new_tokens: int) -> dict:
    """Times one prefill and new_tokens decode steps; the first sequence's greedy ids."""
    import torch
    prompt_len = prompts.shape[1]
    ids = torch.as_tensor(prompts, device=self.device)
    chunk = self.prefill_chunk or prompt_len
    events = None
    # no_grad, not inference_mode: the cache's tensors outlive the run and are reset in place.
    with torch.no_grad():
      self.cache.reset()
      synchronize(self.device)
      start = time.perf_counter()
      for lo in range(0, prompt_len, chunk):
        hi = min(lo + chunk, prompt_len)
        logits = self.model(input_ids=ids[:, lo:hi], position_ids=self.positions[:, lo:hi],
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
      token = logits[:, -1].argmax(-1)
      synchronize(self.device)
      prefill_s = time.perf_counter() - start
      chosen = [token]
      if self.device == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(new_tokens + 1)]
      host_marks = [0.0] * (new_tokens + 1)
      start = time.perf_counter()
      if events:
        events[0].record()
      for i in range(new_tokens):
        pos = prompt_len + i
        logits = self.step(input_ids=token[:, None], position_ids=self.positions[:, pos:pos + 1],
                           past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1)
        chosen.append(token)
        if events:
          events[i + 1].record()
        else:
          host_marks[i + 1] = time.perf_counter() - start
      synchronize(self.device)
      decode_s = time.perf_counter() - start
    if events:
      steps_s = [1e-3 * a.elapsed_time(b) for a, b in zip(events, events[1:])]
    else:
      steps_s = [b - a for a, b in zip(host_marks, host_marks[1:])]
    tokens = torch.stack(chosen[:new_tokens], dim=1)[0].tolist()
    return dict(prefill_s=prefill_s, decode_s=decode_s, steps_s=steps_s, tokens=tokens)


def is_out_of_memory(e: BaseException) -> bool:
  import torch
  oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
  return isinstance(e, oom) or "out of memory" in str(e).lower()


def measure(model, device: str, batch: int, context: int, new_tokens: int, *, seed: int, prefill_chunk: int,
            compile_step: bool) -> dict:
  """One row's timings: a warm-up run, then the timed run of the same shape."""
  import torch
  prompt_len = context - new_tokens
  prompts = make_prompts(batch, prompt_len, model.config.vocab_size, seed)
  decoder = Decoder(model, context, device, prefill_chunk=prefill_chunk, compile_step=compile_step)
  decoder.run(prompts, new_tokens)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  timed = decoder.run(prompts, new_tokens)
  steps_s = timed["steps_s"]
  row = dict(prefill_s=timed["prefill_s"], decode_s=timed["decode_s"],
             tok_s=batch * new_tokens / timed["decode_s"], step_ms=1e3 * statistics.median(steps_s),
             p90_step_ms=1e3 * float(np.percentile(steps_s, 90)),
             peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
             kv_cache_gib=decoder.kv_cache_bytes() / 2**30, tokens=timed["tokens"])
  return row


def write_json(rows: list[dict], path: str) -> None:
  """Rewrites `path` whole (through a temporary file, so a reader never sees half of it)."""
  target = pathlib.Path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  partial = target.with_name(target.name + ".part")
  partial.write_text(json.dumps(rows, indent=1) + "\n")
  os.replace(partial, target)


def describe(model, device: str) -> dict:
  """Fields every row carries: which engine, on what."""
  import torch
  import transformers
  name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
  return dict(engine="transformers", transformers_version=transformers.__version__,
              torch_version=torch.__version__, device=f"{device}:{name}",
              dtype=str(model.dtype).removeprefix("torch."), attn=model.config._attn_implementation)


def format_row(row: dict) -> str:
  head = f"B={row['batch']:3d} C={row['context']:5d}"
  if "error" in row:
    return f"{head}  {row['error']}"
  peak = f"  peak {row['peak_mem_gib']:6.2f} GiB" if row["peak_mem_gib"] is not None else ""
  return (f"{head}  prefill {row['prefill_s']:7.3f} s  decode {row['tok_s']:9.1f} tok/s  step "
          f"{row['step_ms']:7.2f} ms (p90 {row['p90_step_ms']:7.2f}){peak}  kv {row['kv_cache_gib']:5.2f} GiB  "
          f"tokens {row['tokens'][:8]}")


def run(model, device: str, *, batches, contexts, new_tokens: int, seed: int = 0, prefill_chunk: int = 2048,
        compile_step: bool = False, json_path: str | None = None, out=print) -> list[dict]:
  """One row per (context, batch); rewrites json_path after each row so a run cut short keeps them."""
  import torch
  stamp = describe(model, device)
  rows = []
  for context in contexts:
    for batch in batches:
      row = dict(model=MODEL, **stamp, batch=batch, context=context, prompt_len=context - new_tokens,
                 new_tokens=new_tokens, prefill_chunk=prefill_chunk, compile=compile_step, seed=seed)
      try:
        row |= measure(model, device, batch, context, new_tokens, seed=seed, prefill_chunk=prefill_chunk,
                       compile_step=compile_step)
      except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
          raise
        row["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
      # Outside the handler, so the failed run's tensors (held by the traceback) are gone by now.
      gc.collect()
      if device == "cuda":
        torch.cuda.empty_cache()
      rows.append(row)
      out(format_row(row))
      sys.stdout.flush()
      if json_path:
        write_json(rows, json_path)
  return rows


def main(argv):
  del argv
  import torch
  device = FLAGS.device if FLAGS.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
  defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
  batches = parse_ints(FLAGS.batch, "batch") if FLAGS.batch else defaults["batch"]
  contexts = parse_ints(FLAGS.context, "context") if FLAGS.context else defaults["context"]
  new_tokens = FLAGS.new_tokens or defaults["new_tokens"]
  if min(contexts) <= new_tokens:
    raise app.UsageError(f"every --context must exceed --new_tokens ({new_tokens}): prompts are C - new_tokens")
  torch.manual_seed(FLAGS.seed)
  model = load_model(pathlib.Path(FLAGS.gguf), FLAGS.dtype, FLAGS.attn, device)
  stamp = describe(model, device)
  print(f"# {MODEL} transformers={stamp['transformers_version']} torch={stamp['torch_version']} "
        f"device={stamp['device']} dtype={stamp['dtype']} attn={stamp['attn']} new_tokens={new_tokens}"
        f"{' compile' if FLAGS.compile else ''}", flush=True)
  run(model, device, batches=batches, contexts=contexts, new_tokens=new_tokens, seed=FLAGS.seed,
      prefill_chunk=FLAGS.prefill_chunk, compile_step=FLAGS.compile, json_path=FLAGS.json)


if __name__ == "__main__":
  define_flags()
  app.run(main)
