"""SmolLM2-135M-Instruct answers a chat prompt through pallas_kv (what `make demo` runs).

  python -m examples.smollm2 [--prompt="..."] [--max_new_tokens=96] [--impl=auto]
                             [--temperature=0 --top_p=0.9 --seed=0] [--gguf=PATH]

Fetches the weights once into the cache (`PALLAS_KV_CACHE_DIR`, default ~/.cache/pallas_kv)
unless --gguf names a local file, then prints the reply and the decode speed.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

DEFAULT_PROMPT = "What are three good reasons to learn a second language?"

flags.DEFINE_string("prompt", DEFAULT_PROMPT, "the user's message (sent through the chat template)")
flags.DEFINE_integer("max_new_tokens", 96, "tokens to generate at most")
flags.DEFINE_enum("impl", "auto", ["auto", "mosaic_gpu", "triton", "xla"], "decode attention backend")
flags.DEFINE_float("temperature", 0.0, "0: greedy; else sample with top-p")
flags.DEFINE_float("top_p", 0.9, "nucleus sampling threshold (with --temperature > 0)")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "matmul inputs (default: CPU float32, GPU bfloat16)")
flags.DEFINE_string("gguf", None, "a local GGUF file (default: fetch SmolLM2-135M-Instruct into the cache)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax

  import pallas_kv as pkv
  from pallas_kv import runtime
  from examples.smollm2 import gguf_loader
  from examples.smollm2 import serving
  from examples.smollm2 import weights
  from examples.smollm2.model import Llama
  from examples.smollm2.model import default_compute_dtype
  from examples.smollm2.tokenizer import Tokenizer

  if FLAGS.impl in ("mosaic_gpu", "triton") and jax.default_backend() == "cpu" and not runtime.interpret_enabled():
    raise SystemExit(f"error: {runtime.cpu_without_interpret_message(FLAGS.impl)}")
  path = FLAGS.gguf or weights.fetch_gguf()
  start = time.perf_counter()
  config, params, tokenizer_data = gguf_loader.load(path)
  model = Llama(config, impl=FLAGS.impl, compute_dtype=FLAGS.compute_dtype or default_compute_dtype())
  params = model.prepare(params)
  tokenizer = Tokenizer(tokenizer_data)
  print(f"loaded {path} in {time.perf_counter() - start:.1f} s: {config.num_layers} layers, hidden "
        f"{config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads}; device {jax.devices()[0].device_kind}")

  prompt_ids = tokenizer.encode(tokenizer.chat_prompt(FLAGS.prompt))
  engine = serving.Engine(model, params, num_slots=1, page_size=16, num_pages=64,
                          max_pages_per_seq=64)
  request = lambda n: serving.Request(prompt_ids, n, temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed)
  start = time.perf_counter()
  engine.run([request(2)])  # compiles the prefill of this prompt's bucket and the decode step
  compile_s = time.perf_counter() - start
  engine.stats = serving.Stats()
  reply = request(FLAGS.max_new_tokens)
  stats = engine.run([reply])

  print(f"\nuser: {FLAGS.prompt}\nassistant: {tokenizer.decode(reply.output_ids, skip_special=True).strip()}\n")
  print(f"impl={FLAGS.impl} (attention ran on {pkv.last_impl()}); compile {compile_s:.1f} s; {stats.summary()}")


if __name__ == "__main__":
  app.run(main)
