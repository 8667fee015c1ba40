r"""The benchmarks' driver: `python -m benchmarks ROUTINE [flags]`.

  python -m benchmarks decode --flagfile=configs/gqa_h200.flags --json=gqa.json
  python -m benchmarks mla --rows=h128_b64_t4096 --impl=mosaic_gpu,bf16_einsum
  python -m benchmarks serving --gguf=PATH --context=8192 --batch=1,16,64
  python -m benchmarks decode --helpfull      # a routine's flags
  python -m benchmarks                        # the routines and tools

Each routine is an absl program over the shared core (cases, cli, output, peers, timing) with
flags of its own; the driver hands it the rest of the command line and runs it as
`python -m benchmarks.ROUTINE` does (the same module run as the main program, so the same flags,
output and exit status; that form works too). `tools.NAME` runs a diagnostic of benchmarks/tools/
the same way. `python -m benchmarks.report` turns rows into RESULTS.md tables. The H200 suite
(parts -> routine + flagfile of configs/suite/): `bash benchmarks/h200_suite.sh PART ...`.
"""

from __future__ import annotations

import os
import pkgutil
import runpy
import sys
import textwrap
from collections.abc import Sequence

ROUTINES = {
    "decode": "decode attention (dense, paged, MLA): pallas_kv impls and peers side by side",
    "mla": "the MLA kernel's rows: the op, its schedules and probes against a bf16 einsum",
    "step": "a decode step of the DecodeAttention layer: time per step, tokens/s",
    "scaling": "paged decode attention sharded over 1-8 GPUs (shard_map)",
    "vmap": "jax.vmap of the ops against the same work as one batch",
    "serving": "SmolLM2-135M-Instruct in the continuous-batching engine: tokens/s, GPU idle",
    "shared_prefix": "forked sequences over a shared prompt: paged decode with and without SharedPrefix",
    "tune": "times kernel configs per shape and merges the winners into the tuned file",
}
TOOLS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools")


def tools() -> list[str]:
  """The programs of benchmarks/tools/ (modules with a main; read, not imported)."""
  def is_program(name: str) -> bool:
    with open(os.path.join(TOOLS_DIR, f"{name}.py")) as f:
      return 'if __name__ == "__main__":' in f.read()
  return sorted(m.name for m in pkgutil.iter_modules([TOOLS_DIR]) if is_program(m.name))


def usage() -> str:
  width = max(map(len, ROUTINES))
  lines = ["usage: python -m benchmarks ROUTINE [flags]   (ROUTINE --helpfull: its flags)", "", "routines:"]
  lines += [f"  {name:<{width}}  {about}" for name, about in ROUTINES.items()]
  lines += ["", "tools (python -m benchmarks tools.NAME [args]):"]
  lines += textwrap.wrap(" ".join(tools()), width=96, initial_indent="  ", subsequent_indent="  ")
  return "\n".join(lines)


def module_of(name: str) -> str:
  """The module that runs `name`, a routine or tools.NAME; ValueError for another name."""
  if name in ROUTINES or (name.startswith("tools.") and name.removeprefix("tools.") in tools()):
    return f"benchmarks.{name}"
  raise ValueError(f"unknown routine {name!r}")


def main(argv: Sequence[str]) -> int:
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage(), file=sys.stdout if len(argv) >= 2 else sys.stderr)
    return 0 if len(argv) >= 2 else 2
  try:
    module = module_of(argv[1])
  except ValueError as e:
    print(f"{e}\n\n{usage()}", file=sys.stderr)
    return 2
  sys.argv = [module, *argv[2:]]   # runpy puts the module's file in argv[0], as python -m does
  runpy.run_module(module, run_name="__main__", alter_sys=True)   # absl's app.run exits with main's status
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
