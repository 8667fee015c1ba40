r"""The error of one-byte tensor-core operands for decode over a one-byte cache, on any machine.

  python -m benchmarks.tools.operand_precision [--kv_dtype=float8_e4m3fn,int8] [--json=out.json]

Hopper has no bf16 x fp8 (or bf16 x int8) wgmma, so a kernel over a one-byte cache either widens
each tile to bf16 (what both backends do) or brings q and P down to one byte and runs the
one-byte tensor cores (fp8 e4m3 x e4m3 -> f32, s8 x s8 -> s32). This measures what the second
choice costs in accuracy before anyone builds it: the same attention computed with each operand
path in plain JAX, against the float32 reference on the dequantized cache (the kernels'
reference), as relative L2 error of the output.

Operand paths (scores, softmax and accumulation in float32 throughout):
  bf16        q in bf16, the cache widened to bf16 (exact for e4m3 and int8), P (times the
              per-token value scale) in bf16: the kernels' path today.
  qk8         q quantized to the cache dtype with one scale per row (max |q| / the dtype's max);
              P as in bf16.
  qk8_pv8     also P quantized to the cache dtype, one scale per row and 64-token tile (a
              kernel knows the tile's row maxima when it forms P).

Inputs: normal q, k, v (per-token scales from `pallas_kv.cache.quantize`); "peaked" multiplies q
by 4 so that a few keys take most of each row's weight.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kv import cache as kv_cache

TILE = 64


def define_flags() -> None:
  flags.DEFINE_list("kv_dtype", ["float8_e4m3fn", "int8"], "one-byte cache dtypes")
  flags.DEFINE_integer("batch", 4, "batch")
  flags.DEFINE_integer("seq_len", 4096, "tokens per sequence")
  flags.DEFINE_integer("num_kv_heads", 8, "kv heads")
  flags.DEFINE_integer("group_size", 4, "q heads per kv head")
  flags.DEFINE_integer("head_dim", 128, "head dim")
  flags.DEFINE_integer("draws", 4, "random draws per row (the table gives the largest error)")
  flags.DEFINE_string("json", None, "write the rows here")


def _quantize_rows(x, dtype):
  """x quantized to the one-byte dtype with one scale per slice of its last axis (the cache's own
  per-token quantizer), back in float32: what the tensor cores would see, times the scale."""
  values, scale = kv_cache.quantize(x, dtype)
  return values.astype(jnp.float32) * scale[..., None]


def attention(q, k, v, k_scale, v_scale, *, path: str, kv_dtype):
  """q [B, Hkv, G, D] f32; k, v [B, Hkv, T, D] one-byte; scales [B, Hkv, T] f32 -> [B, Hkv, G, D]."""
  d = q.shape[-1]
  k_wide, v_wide = k.astype(jnp.float32), v.astype(jnp.float32)   # exact: e4m3 and int8 fit bf16
  if path == "reference":
    q_used = q
  elif path == "bf16":
    q_used = q.astype(jnp.bfloat16).astype(jnp.float32)
  else:
    q_used = _quantize_rows(q, kv_dtype)
  scores = jnp.einsum("bhgd,bhtd->bhgt", q_used, k_wide) * k_scale[:, :, None, :] / np.sqrt(d)
  weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  norm = jnp.sum(weights, axis=-1, keepdims=True)
  p = weights * v_scale[:, :, None, :]
  if path == "bf16" or path == "qk8":
    p = p.astype(jnp.bfloat16).astype(jnp.float32)
  elif path == "qk8_pv8":
    b, h, g, t = p.shape
    p = _quantize_rows(p.reshape(b, h, g, t // TILE, TILE), kv_dtype).reshape(b, h, g, t)
  return jnp.einsum("bhgt,bhtd->bhgd", p, v_wide) / norm


def _relative_error(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure(kv_dtype, *, peaked: bool, seed: int, batch: int, seq_len: int, num_kv_heads: int,
            group_size: int, head_dim: int) -> dict[str, float]:
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, num_kv_heads, group_size, head_dim)) * (4.0 if peaked else 1.0)
  k, k_scale = kv_cache.quantize(jax.random.normal(keys[1], (batch, seq_len, num_kv_heads, head_dim)), kv_dtype)
  v, v_scale = kv_cache.quantize(jax.random.normal(keys[2], (batch, seq_len, num_kv_heads, head_dim)), kv_dtype)
  # [B, T, Hkv, ...] -> [B, Hkv, T, ...]
  k, v, k_scale, v_scale = (jnp.moveaxis(x, 2, 1) for x in (k, v, k_scale, v_scale))
  run = jax.jit(attention, static_argnames=("path", "kv_dtype"))
  ref = run(q, k, v, k_scale, v_scale, path="reference", kv_dtype=kv_dtype)
  return {path: _relative_error(run(q, k, v, k_scale, v_scale, path=path, kv_dtype=kv_dtype), ref)
          for path in ("bf16", "qk8", "qk8_pv8")}


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  shape = dict(batch=f.batch, seq_len=f.seq_len, num_kv_heads=f.num_kv_heads, group_size=f.group_size,
               head_dim=f.head_dim)
  rows = []
  print(f"relative L2 error of the output vs the float32 reference on the dequantized cache, "
        f"largest of {f.draws} draws; {shape}")
  print(f"{'cache':16}{'inputs':8}{'bf16':>10}{'qk8':>10}{'qk8_pv8':>10}")
  for kv_dtype in f.kv_dtype:
    for peaked in (False, True):
      draws = [measure(jnp.dtype(kv_dtype), peaked=peaked, seed=seed, **shape) for seed in range(f.draws)]
      worst = {path: max(d[path] for d in draws) for path in draws[0]}
      rows.append(dict(kv_dtype=kv_dtype, inputs="peaked" if peaked else "normal", draws=f.draws, **shape, **worst))
      print(f"{kv_dtype:16}{rows[-1]['inputs']:8}" + "".join(f"{worst[p]:10.2e}" for p in worst))
  if f.json:
    with open(f.json, "w") as out:
      json.dump(rows, out, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
