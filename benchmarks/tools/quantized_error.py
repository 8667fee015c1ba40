r"""How far attention over an int8 / fp8 cache lands from the same values in a bf16 cache.

  python -m benchmarks.tools.quantized_error [--outlier_channels=4]     # CPU, seconds

Random normal q, K, V (B 4, T 2048, heads 32/8, head_dim 128, full lengths), optionally with a
few K channels 10x larger (LLM keys have such outlier channels). Each one-byte cache is made with
`pallas_kv.cache.quantize`, per token and kv head ("token") or with one scale per kv head
("head"). Prints ||out - out_bf16|| / ||out_bf16|| of the "xla" impl, which the kernels match
within their own tolerance (tests/test_quantized.py).
Then MLA (DeepSeek's latent rows: 16 heads, Dqk 576 = latent 512 + rope 64, pages of 64, same B and
T), its one latent row per token quantized as `PagedLatentCache` does: per token ("token") or one
scale for the cache ("cache"), outlier channels in the latent alike.
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
  mla_errors(kq, b, t)


def mla_errors(key, batch: int, seq_len: int, heads: int = 16, dim: int = 576, v_dim: int = 512, page: int = 64):
  """The MLA rows: a latent cache in pages (in order), one-byte against bf16."""
  kq, kc = jax.random.split(key)
  q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
  rows = jax.random.normal(kc, (batch * seq_len // page, page, dim), jnp.float32)
  rows = rows.at[..., :FLAGS.outlier_channels].multiply(OUTLIER_FACTOR)
  tables = jnp.arange(rows.shape[0], dtype=jnp.int32).reshape(batch, seq_len // page)
  lengths = jnp.full((batch,), seq_len, jnp.int32)
  call = lambda pages, scale=None: pkv.mla_decode_attention(q, pages, tables, lengths, v_head_dim=v_dim,
                                                            kv_scale=scale, impl="xla")
  bf16 = call(rows.astype(jnp.bfloat16))
  print(f"# MLA: {heads} heads, Dqk {dim}, Dv {v_dim}, page {page}, {FLAGS.outlier_channels} latent outlier "
        f"channels x{OUTLIER_FACTOR:g}")
  print("latent cache    scales  vs bf16 cache")
  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    for kind in ("token", "cache"):
      fixed = None if kind == "token" else jnp.max(jnp.abs(rows)) / kv_cache.QUANTIZED_MAX[jnp.dtype(dtype)]
      pages, scale = kv_cache.quantize(rows[:, :, None], dtype, fixed)
      scale = scale[..., 0] if kind == "token" else scale
      print(f"{jnp.dtype(dtype).name:15s} {kind:6s}  {relative_error(call(pages[:, :, 0], scale), bf16):.1e}")


if __name__ == "__main__":
  flags.DEFINE_integer("outlier_channels", 0, "K channels made 10x larger.")
  app.run(main)
