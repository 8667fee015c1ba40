"""Records Hugging Face transformers' greedy generations of SmolLM2 as the reference of the tests.

Runs outside the project's venv, on any machine with torch, transformers, accelerate and gguf
(`pip install torch transformers accelerate gguf`; transformers 5.24 and torch 2.13 made the record):

  python -m examples.smollm2.record_reference [--gguf=PATH] [--out=tests/data/smollm2_reference.json]

transformers loads the same GGUF file (dequantized to float32, Q/K un-permuted by its own GGUF
loader) and its tokenizer; for each prompt this writes the prompt's token ids, 32 greedy tokens
and the top logits of the first steps. The model runs in float32, and again with its weights
rounded to bfloat16 (the weights pallas_kv's example uses, computing in float32), so the tests can
tell a weight-rounding effect from a model bug.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from examples.smollm2.weights import fetch_gguf

NEW_TOKENS = 32
LOGIT_STEPS = 3  # steps whose top logits are recorded
TOP_K = 16
# (kind, text): "chat" prompts go through the model's chat template, "raw" ones as they are.
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a short poem about the sea."),
    ("chat", "Explain in simple words how a rainbow forms."),
    ("chat", "Give me 3 tips for learning to play the guitar in 2025."),
    ("raw", "The history of the printing press begins"),
    ("raw", "def fibonacci(n):\n    \"\"\""),
]
# Texts whose token ids are recorded to check the tokenizer on its corner cases.
TOKENIZER_TEXTS = [
    "Hello  world!\n\n  Multiple   spaces\tand\ttabs \n",
    "Numbers: 12345, 3.14159 and 2025-01-31; 1st 2nd 3rd",
    "Unicode: naïve café, 日本語, Привет, ½ ² ⅷ, emoji 🚀🎉",
    "Contractions: I'm, you're, they'll, it's, we've, I'd, DON'T, O'Neil's",
    "code:\n    for i in range(10):\n        print(f\"{i!r}\")  # done\r\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>   trailing   ",
]


def _generate(model, input_ids):
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor([input_ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, output_logits=True, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=model.config.eos_token_id)
  tokens = out.sequences[0, len(input_ids):].tolist()
  steps = []
  for logits in out.logits[:LOGIT_STEPS]:
    values, indices = torch.topk(logits[0].float(), TOP_K)
    steps.append(dict(indices=indices.tolist(), values=[round(v, 4) for v in values.tolist()]))
  # The margin of each greedy choice: best minus second-best score (EOS is masked while
  # min_new_tokens holds, so these are the processed scores).
  margins = [round(float(v[0, 0] - v[0, 1]), 4) for v in (torch.topk(s.float(), 2).values for s in out.scores)]
  return tokens, steps, margins


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", default=None, help="GGUF file (default: fetched into the weights cache)")
  parser.add_argument("--out", default="tests/data/smollm2_reference.json")
  args = parser.parse_args(argv)

  import torch
  import transformers
  from transformers import AutoModelForCausalLM
  from transformers import AutoTokenizer

  path = pathlib.Path(args.gguf) if args.gguf else fetch_gguf()
  torch.manual_seed(0)
  tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  model_bf16_weights = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
  with torch.no_grad():
    for p in model_bf16_weights.parameters():
      p.copy_(p.to(torch.bfloat16).to(torch.float32))

  records = []
  for kind, text in PROMPTS:
    if kind == "chat":
      prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    else:
      prompt = text
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tokens, logits, margins = _generate(model, ids)
    tokens_bf16, logits_bf16, margins_bf16 = _generate(model_bf16_weights, ids)
    records.append(dict(kind=kind, message=text, prompt=prompt, prompt_ids=ids, greedy_tokens=tokens,
                        text=tokenizer.decode(tokens), top_logits=logits, margins=margins,
                        bf16_weights=dict(greedy_tokens=tokens_bf16, top_logits=logits_bf16, margins=margins_bf16)))
    same = sum(a == b for a, b in zip(tokens, tokens_bf16))
    print(f"{kind:4s} {len(ids):3d} prompt tokens; bf16 weights agree on {same}/{NEW_TOKENS}: "
          f"{tokenizer.decode(tokens)!r}", file=sys.stderr)

  document = dict(
      model=path.name, new_tokens=NEW_TOKENS, top_k=TOP_K,
      recorded_with=dict(torch=torch.__version__, transformers=transformers.__version__,
                         dtype="float32", decoding="greedy, min_new_tokens = max_new_tokens (EOS masked)"),
      prompts=records,
      tokenizer_cases=[dict(text=t, ids=tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TOKENIZER_TEXTS])
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(document, indent=1) + "\n")
  print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
  main()
