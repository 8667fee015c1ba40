r"""How far attention over an int8 / fp8 cache lands from the same values in a bf16 cache.

  python -m benchmarks.tools.quantized_error [--outlier_channels=4]     # CPU, seconds

Random normal q, K, V (B 4, T 2048, heads 32/8, head_dim 128, full lengths), optionally with a
few K channels 10x larger (LLM keys have such outlier channels). Each one-byte cache is made with
`pallas_kv.cache.quantize`, per token and kv head ("token") or with one scale per kv head
("head"). Prints ||out - out_bf16|| / ||out_bf16|| of the "xla" impl, which the kernels match
within their own tolerance (tests/test_quantized.py).
"""

from __future__ import annotations

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import pallas_kv as pkv
from pallas_kv import cache as kv_cache

FLAGS = flags.FLAGS
SHAPE = dict(batch=4, seq_len=2048, heads=32, kv_heads=8, head_dim=128)
OUTLIER_FACTOR = 10.0


def relative_error(out, ref) -> float:
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def per_head_scale(x, dtype):
  """One scale per kv head over the whole cache: max |x| maps to the dtype's largest value."""
  return jnp.max(jnp.abs(x), axis=(0, 1, 3)) / kv_cache.QUANTIZED_MAX[jnp.dtype(dtype)]


def main(argv):
  del argv
  b, t, hq, hkv, d = SHAPE.values()
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, hkv, d), jnp.float32)
  v = jax.random.normal(kv, (b, t, hkv, d), jnp.float32)
  k = k.at[..., :FLAGS.outlier_channels].multiply(OUTLIER_FACTOR)
  lengths = jnp.full((b,), t, jnp.int32)
  bf16 = pkv.decode_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lengths, impl="xla")
  exact = pkv.decode_attention_reference(q.astype(jnp.float32), k, v, lengths)
  print(f"# {SHAPE}, {FLAGS.outlier_channels} K outlier channels x{OUTLIER_FACTOR:g}")
  print(f"bf16 cache vs float32 values: {relative_error(bf16, exact):.1e}")
  print("cache           scales  vs bf16 cache")
  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    for kind in ("token", "head"):
      if kind == "token":
        (k8, k_scale), (v8, v_scale) = kv_cache.quantize(k, dtype), kv_cache.quantize(v, dtype)
      else:
        k_scale, v_scale = per_head_scale(k, dtype), per_head_scale(v, dtype)
        (k8, _), (v8, _) = kv_cache.quantize(k, dtype, k_scale), kv_cache.quantize(v, dtype, v_scale)
      out = pkv.decode_attention(q, k8, v8, lengths, k_scale=k_scale, v_scale=v_scale, impl="xla")
      print(f"{jnp.dtype(dtype).name:15s} {kind:6s}  {relative_error(out, bf16):.1e}")


if __name__ == "__main__":
  flags.DEFINE_integer("outlier_channels", 0, "K channels made 10x larger.")
  app.run(main)
