"""Flags the benchmark programs share: their definitions, parsing and accessors.

A program defines its flags in its own `define_flags()`, called only when it runs as a program,
so importing one (tests, another program) defines nothing and two programs' flags never clash.
The definers and accessors take the `flag_values` to use (absl's global FLAGS by default; tests
parse flagfiles into their own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags
import jax

from benchmarks import cases
from benchmarks import peers

FLAGS = flags.FLAGS


def parse_ints(values: Sequence[str], name: str) -> tuple[int, ...]:
  """The values of the list flag --`name` as integers; ValueError naming the flag if not."""
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise ValueError(f"--{name}={','.join(values)} must be integers") from None


def parse_cases(specs: Sequence[str], *, form: str = "BATCHxSEQ_LEN",
                example: str = "8x8192") -> tuple[tuple[int, int], ...]:
  """["8x8192", "1x32768"] -> ((8, 8192), (1, 32768)); ValueError showing `form` if malformed."""
  pairs = []
  for spec in specs:
    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"case {spec!r} must look like {form}, e.g. {example}")
    pairs.append((int(parts[0]), int(parts[1])))
  return tuple(pairs)


def cross_cases(batches: Sequence[int], seq_lens: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple((b, t) for b in batches for t in seq_lens)


# ------------------------------------------------------------------ timing and output

TIMING_HELP = {
    "warmup": "Warm-up calls",
    "iters": "Calls per timed loop",
    "repeats": "Timed loops; median taken",
}
OUTPUT_HELP = {
    "json": "Write all rows as a JSON list here.",
    "csv": "Write the rows' scalar fields as CSV here.",
    "plot": "Write a PNG of TB/s against context length (and batch) per impl here; needs "
            "matplotlib (the plot extra).",
}


def define_timing_flags(defaults: Mapping[str, str], flag_values: flags.FlagValues = FLAGS) -> None:
  """--warmup, --iters, --repeats: those `defaults` names, each None unless given.

  `defaults` says in each flag's help what the program takes when it is not given, e.g.
  {"iters": "CPU 3, GPU 20"}.
  """
  for name, default in defaults.items():
    flags.DEFINE_integer(name, None, f"{TIMING_HELP[name]} ({default}).", flag_values=flag_values)


def define_output_flags(names: Sequence[str] = ("json",), flag_values: flags.FlagValues = FLAGS) -> None:
  """--json, --csv, --plot: those `names`, each a path or None."""
  for name in names:
    flags.DEFINE_string(name, None, OUTPUT_HELP[name], flag_values=flag_values)


@dataclasses.dataclass(frozen=True)
class TimingFlags:
  """The timing flags as given; None where not given or not defined by the program."""

  warmup: int | None = None
  iters: int | None = None
  repeats: int | None = None

  def given(self) -> dict[str, int]:
    """The flags that were given, by name: `{**defaults, **timing.given()}` resolves them."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class OutputPaths:
  """Where to write the rows; None where not asked or not defined by the program."""

  json: str | None = None
  csv: str | None = None
  plot: str | None = None


def _values(cls, flag_values) -> dict[str, Any]:
  return {f.name: flag_values[f.name].value for f in dataclasses.fields(cls)
          if f.name in flag_values}


def timing_flags(flag_values: flags.FlagValues = FLAGS) -> TimingFlags:
  return TimingFlags(**_values(TimingFlags, flag_values))


def timing_or_defaults(cpu: Mapping[str, int], gpu: Mapping[str, int],
                       flag_values: flags.FlagValues = FLAGS) -> tuple[int, int, int]:
  """(warmup, iters, repeats): the flags given, else the defaults of this machine (a CPU's or a GPU's)."""
  defaults = cpu if jax.default_backend() == "cpu" else gpu
  given = timing_flags(flag_values)
  return tuple(defaults[f] if getattr(given, f) is None else getattr(given, f) for f in ("warmup", "iters", "repeats"))


def output_paths(flag_values: flags.FlagValues = FLAGS) -> OutputPaths:
  return OutputPaths(**_values(OutputPaths, flag_values))


# ------------------------------------------------------------------ a Sweep

# Sweep fields that are flags of the same name, taken as given or at their flag default...
SWEEP_FLAGS = ("num_queries", "shuffle_pages", "dtype", "ragged", "seed", "check", "strict",
               "peak_tbps", "peak_tflops", "mla_qk_dim", "mla_v_dim", "softcap", "window", "sinks",
               "kv_dtype", "length")
# ...and those whose flags default to None: then `cases.default_sweep` decides per platform.
SWEEP_PLATFORM_FLAGS = ("num_heads", "num_kv_heads", "head_dim", "page_size", "rotate_bytes")


def define_sweep_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags of a `cases.Sweep` (benchmarks.decode; tune and tools.profile_kernel take them too)."""
  into = {"flag_values": flag_values}
  flags.DEFINE_enum("op", "decode", cases.OPS, "Which op: dense, paged or MLA.", **into)
  flags.DEFINE_list(
      "impl", None, f"Impls to run, from {','.join(peers.ALL_IMPLS)}. Default: CPU "
      f"{','.join(cases.CPU_IMPLS)}; GPU per op, e.g. {','.join(cases.GPU_IMPLS['decode'])}.", **into)
  flags.DEFINE_list(
      "cases", None, "Cases as BATCHxSEQ_LEN, e.g. 1x32768,8x8192; overrides "
      "--batch/--seq_len. Default: CPU 2x256; GPU the H200 sweep.", **into)
  flags.DEFINE_list("batch", None, "Batch sizes (crossed with --seq_len).", **into)
  flags.DEFINE_list("seq_len", None, "KV lengths (crossed with --batch).", **into)
  flags.DEFINE_integer("num_heads", None, "Query heads (CPU 4, GPU 32, MLA 128).", **into)
  flags.DEFINE_integer("num_kv_heads", None, "KV heads (CPU 2, GPU 8).", **into)
  flags.DEFINE_integer("head_dim", None, "Head dim (CPU 64, GPU 128).", **into)
  flags.DEFINE_integer("num_queries", 1, "New tokens per sequence (S).", **into)
  flags.DEFINE_integer("page_size", None, "Page size (paged 16, MLA 64).", **into)
  flags.DEFINE_boolean("shuffle_pages", True, "Block tables are a random permutation of pages.",
                       **into)
  flags.DEFINE_enum("dtype", "bfloat16", cases.DTYPES, "Input dtype.", **into)
  flags.DEFINE_enum("kv_dtype", None, cases.DTYPES + cases.KV_QUANTIZED_DTYPES,
                    "Cache dtype if not --dtype; int8 / fp8 caches hold per-token float32 scales "
                    "(peers report n/a). Decode and paged.", **into)
  flags.DEFINE_boolean("ragged", False, "Random lengths in [num_queries, seq_len].", **into)
  flags.DEFINE_integer("length", None, "Every sequence this long in caches of each case's seq_len (the capacity, "
                       "which sizes the configs): a short sequence's fixed costs. Not with --ragged.", **into)
  flags.DEFINE_integer("seed", 0, "Random seed of inputs and lengths.", **into)
  define_timing_flags({"warmup": "CPU 1, GPU 5", "iters": "CPU 3, GPU 20",
                       "repeats": "CPU 3, GPU 10"}, flag_values)
  flags.DEFINE_float(
      "rotate_bytes", None, "Rotate among input sets until their KV totals this "
      "many bytes (L2 defeat). Default: CPU 0 (off), GPU 1.8e8.", **into)
  flags.DEFINE_boolean("check", True, "Compare each output to the reference.", **into)
  flags.DEFINE_boolean("strict", False, "Raise instead of printing n/a rows.", **into)
  flags.DEFINE_float("peak_tbps", cases.PEAK_TBPS, "Roofline HBM read TB/s.", **into)
  flags.DEFINE_float("peak_tflops", cases.PEAK_TFLOPS, "Roofline TFLOP/s.", **into)
  flags.DEFINE_integer("mla_qk_dim", cases.MLA_QK_DIM, "MLA q/k dim (latent+rope).", **into)
  flags.DEFINE_integer("mla_v_dim", cases.MLA_V_DIM, "MLA value dim.", **into)
  flags.DEFINE_float(
      "softcap", None, "Logit soft cap (logits -> c * tanh(logits / c)); decode and paged. "
      "Peers that cannot express it report n/a.", **into)
  flags.DEFINE_integer(
      "window", None, "Sliding window: a query at p sees keys in (p - window, p]; decode "
      "and paged. Bytes and flops count only the keys in the window.", **into)
  flags.DEFINE_boolean(
      "sinks", False, "Random float32 per-head sink logits (gpt-oss); decode and paged.", **into)


def sweep_from_flags(flag_values: flags.FlagValues = FLAGS) -> cases.Sweep:
  """The Sweep the parsed flags ask for; unset flags take `cases.default_sweep`'s value.

  Raises ValueError for values no Sweep takes (the programs turn it into a usage error).
  """
  fv = flag_values
  base = cases.default_sweep(fv.op)
  fields: dict[str, Any] = {name: fv[name].value for name in SWEEP_FLAGS}
  fields.update({name: fv[name].value for name in SWEEP_PLATFORM_FLAGS
                 if fv[name].value is not None})
  fields.update(timing_flags(fv).given())
  if fv.impl is not None:
    fields["impls"] = tuple(fv.impl)
  if fv.cases is not None:
    fields["cases"] = parse_cases(fv.cases)
  elif fv.batch is not None or fv.seq_len is not None:
    batches = (parse_ints(fv.batch, "batch") if fv.batch is not None
               else tuple(dict.fromkeys(b for b, _ in base.cases)))
    seq_lens = (parse_ints(fv.seq_len, "seq_len") if fv.seq_len is not None
                else tuple(dict.fromkeys(t for _, t in base.cases)))
    fields["cases"] = cross_cases(batches, seq_lens)
  return dataclasses.replace(base, **fields)
