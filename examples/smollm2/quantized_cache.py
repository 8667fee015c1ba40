r"""How closely SmolLM2 follows its bf16-cache self with an int8 / fp8 KV cache.

  python -m examples.smollm2.quantized_cache [--new_tokens=64] [--impl=xla] [--gguf=PATH]

The six prompts of `record_reference.py` (greedy, EOS ignored) run once with a bfloat16 KV cache
and once per other cache: float32 (xla only; how far bfloat16's own rounding moves the run) and
the one-byte caches int8, float8_e4m3fn, float8_e5m2 (one scale per token and kv head, computed
on append). Per cache it prints:
  agree      greedy tokens generated before the first one that differs from the bf16 cache's run,
             per prompt (the rest of a run follows its own text, so it is not compared);
  forced     the same prompts fed the bf16 run's tokens (teacher forcing): the share of steps whose
             greedy choice equals the bf16 run's, and the relative error of the logits,
             ||logits - logits_bf16|| / ||logits_bf16||, median and largest over prompts x steps.
The prompt itself is attended unquantized (prefill), so only decode steps read quantized keys and
values. Matmuls in float32 on a CPU, bfloat16 on a GPU (`default_compute_dtype`).
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
flags.DEFINE_enum("impl", "xla", ["auto", "mosaic_gpu", "triton", "xla"], "decode attention backend")
flags.DEFINE_list("cache_dtypes", ["float32", "int8", "float8_e4m3fn", "float8_e5m2"],
                  "cache dtypes to compare with bfloat16 (float32: how far bfloat16 itself moves the run)")
flags.DEFINE_string("gguf", None, "a local GGUF file (default: fetch SmolLM2-135M-Instruct into the cache)")
flags.DEFINE_string("json", None, "also write the results here")
FLAGS = flags.FLAGS


def leading_agreement(tokens, reference) -> list[int]:
  """Per row: how many tokens match the reference's before the first that differs."""
  same = np.asarray(tokens) == np.asarray(reference)
  return [int(np.argmin(row)) if not row.all() else int(row.size) for row in same]


def logit_errors(logits, reference) -> np.ndarray:
  """||logits - reference|| / ||reference|| per (row, step) over the vocabulary."""
  logits, reference = np.asarray(logits, np.float64), np.asarray(reference, np.float64)
  return np.linalg.norm(logits - reference, axis=-1) / np.linalg.norm(reference, axis=-1)


def prompt_ids(tokenizer) -> list[list[int]]:
  from examples.smollm2.record_reference import PROMPTS
  return [tokenizer.encode(tokenizer.chat_prompt(text) if kind == "chat" else text) for kind, text in PROMPTS]


def compare(model_for, params, prompts, new_tokens: int, cache_dtypes) -> list[dict]:
  """model_for(cache_dtype) -> Llama. One row per cache dtype compared with bfloat16 (module doc)."""
  from examples.smollm2.model import generate_greedy
  run = lambda dtype, **kw: generate_greedy(model_for(dtype), params, prompts, new_tokens, ignore_eos=True, **kw)
  base_tokens, base_logits = run("bfloat16", logit_steps=new_tokens)
  rows = []
  for dtype in cache_dtypes:
    free_tokens, _ = run(dtype)
    forced_tokens, forced_logits = run(dtype, logit_steps=new_tokens, forced=base_tokens)
    errors = logit_errors(forced_logits, base_logits)
    rows.append(dict(cache_dtype=dtype, agree=leading_agreement(free_tokens, base_tokens),
                     forced_same_choice=float(np.mean(forced_tokens == base_tokens)),
                     logit_error_median=float(np.median(errors)), logit_error_max=float(np.max(errors))))
  return rows


def main(argv):
  del argv
  from examples.smollm2 import gguf_loader
  from examples.smollm2 import weights
  from examples.smollm2.model import Llama
  from examples.smollm2.model import default_compute_dtype
  from examples.smollm2.tokenizer import Tokenizer

  config, params, tokenizer_data = gguf_loader.load(FLAGS.gguf or weights.fetch_gguf())
  model_for = lambda dtype: Llama(config, impl=FLAGS.impl, compute_dtype=default_compute_dtype(), cache_dtype=dtype)
  params = model_for("bfloat16").prepare(params)
  prompts = prompt_ids(Tokenizer(tokenizer_data))
  rows = compare(model_for, params, prompts, FLAGS.new_tokens, FLAGS.cache_dtypes)
  print(f"# SmolLM2-135M-Instruct, {len(prompts)} prompts x {FLAGS.new_tokens} greedy tokens, impl={FLAGS.impl}, "
        f"compute {default_compute_dtype()}; against the same model with a bfloat16 cache")
  print(f"{'cache':<15} {'agree (per prompt)':<28} {'forced: same choice':>20} {'logit error median / max':>26}")
  for r in rows:
    print(f"{r['cache_dtype']:<15} {str(r['agree']):<28} {r['forced_same_choice']:>20.3f} "
          f"{r['logit_error_median']:>13.1e} / {r['logit_error_max']:.1e}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(dict(new_tokens=FLAGS.new_tokens, impl=FLAGS.impl, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
