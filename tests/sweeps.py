"""The benchmark shapes the lowering tests cover: the H200 GQA sweep of `configs/gqa_h200.flags`
(its cases, head_dim 128, bf16) with its 32/8 heads and with 64/8 (Llama-3-70B), contiguous and
paged (pages of 16 and 64), and the configs the package's H200 tuned file gives them and the
shapes between them (`configs/gqa_h200_heldout.flags`)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GQA_SWEEP = os.path.join(REPO, "configs", "gqa_h200.flags")
HELDOUT_SWEEP = os.path.join(REPO, "configs", "gqa_h200_heldout.flags")   # shapes between the tuned ones
HEAD_DIM = 128
PAGE_SIZES = (None, 16, 64)


def _flag(path: str, name: str) -> str:
  with open(path) as f:
    for line in f:
      if line.startswith(f"--{name}="):
        return line.strip().split("=", 1)[1]
  raise ValueError(f"{path} sets no --{name}")


def sweep_cases(path: str = GQA_SWEEP) -> list[tuple[int, int]]:
  """(batch, context) of the GQA sweep (or of another sweep's flag file)."""
  return [tuple(int(x) for x in case.split("x")) for case in _flag(path, "cases").split(",")]


def sweep_heads() -> list[tuple[int, int]]:
  """(q heads, kv heads): the sweep's, and Llama-3-70B's 64/8."""
  heads = (int(_flag(GQA_SWEEP, "num_heads")), int(_flag(GQA_SWEEP, "num_kv_heads")))
  return [heads, (64, 8)]


def problem_args(heads, case, page_size):
  """(ShapeDtypeStruct args of the op, validated Problem) of one shape; paged if page_size."""
  from pallas_kv import validation
  (hq, hkv), (b, t) = heads, case
  q = jax.ShapeDtypeStruct((b, hq, HEAD_DIM), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((b, t, hkv, HEAD_DIM), jnp.bfloat16)
    return (q, kv, kv, lengths), validation.validate_dense(q, kv, kv, lengths)
  pages = jax.ShapeDtypeStruct((b * t // page_size, page_size, hkv, HEAD_DIM), jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((b, t // page_size), jnp.int32)
  return (q, pages, pages, tables, lengths), validation.validate_paged(q, pages, pages, tables, lengths)


def all_shapes():
  """Every (heads, case, page_size) of the sweep."""
  return [(heads, case, page_size) for heads in sweep_heads() for case in sweep_cases() for page_size in PAGE_SIZES]


def distinct_kernel_shapes(impl: str, resolve_config):
  """The shapes of `all_shapes` whose heuristic configs differ for impl: one per (heads, page_size,
  config), since the batch and length change the grid and not the kernel's code."""
  seen, shapes = set(), []
  for heads, case, page_size in all_shapes():
    _, problem = problem_args(heads, case, page_size)
    key = (heads, page_size, resolve_config(problem, None, num_sms=132))
    if key not in seen:
      seen.add(key)
      shapes.append((heads, case, page_size))
  return shapes


def shape_id(heads, case, page_size) -> str:
  return f"h{heads[0]}-{heads[1]}-b{case[0]}-t{case[1]}-page{page_size}"


def shipped_device_kinds() -> list[str]:
  """The device kinds of the tuned files shipped with the package (pallas_kv/tuned/*.json)."""
  from pallas_kv import tuned
  return sorted(json.loads(path.read_text())["device_kind"] for path in tuned.tuned_dir().glob("*.json"))


def shipped_tuned_configs(backend: str, path: str = GQA_SWEEP):
  """[(case, config)]: the distinct configs the package's tuned files (every device kind shipped) give `backend`
  at the dense 32/8 shapes of a sweep (None where a file has no entry near enough)."""
  from pallas_kv import tuned
  seen, found = set(), []
  for device_kind in shipped_device_kinds():
    for case in sweep_cases(path):
      _, problem = problem_args(sweep_heads()[0], case, None)
      config = tuned.tuned_config(backend, problem, "bfloat16", device_kind)
      if config not in seen:
        seen.add(config)
        found.append((case, config))
  return found
