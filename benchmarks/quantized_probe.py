r"""Where the Triton kernel's time goes with one-byte caches: widening path x scale kind x config.

  PYTHONPATH=. python3 -m benchmarks.quantized_probe --json=$OUT/qprobe.json     # GPU, ~4 minutes

Heads 32/8, head_dim 128, bf16 queries, full lengths, `impl="triton"`; each row times
`pallas_kv.decode_attention` (benchmarks/timing.py chain difference) on int8 / fp8 caches made by
`pallas_kv.cache.quantize` (per-token scales), against the bf16 cache on the same shape:
  fast      1: one-byte tiles widen to float16 with the kernel's PTX (`FAST_WIDEN`); 0: generic
            conversions
  kind      token (the cache's per-token scales), head (one per kv head), none (no scale: the
            kernel without scale loads or multiplies)
  config    None (the heuristic's) or an explicit DecodeConfig
Rows with per-token scales are checked against the float32 reference (err column).
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import pallas_kv as pkv
from benchmarks import timing
from pallas_kv import cache as kv_cache
from pallas_kv.kernels.triton import decode as triton_decode

FLAGS = flags.FLAGS
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = ((128, 4096), (8, 8192), (1, 32768))
# (cache dtype, fast widening, scale kind, config fields or None); B=1 runs the token rows only.
VARIANTS = (
    ("bfloat16", True, "none", None),
    ("int8", False, "token", None), ("int8", True, "token", None), ("int8", True, "head", None),
    ("int8", True, "none", None), ("int8", True, "token", dict(block_kv=128, num_stages=3)),
    ("int8", True, "token", dict(block_kv=64, num_stages=4)),
    ("int8", True, "token", dict(block_kv=64, num_stages=3, num_warps=8)),
    ("float8_e4m3fn", False, "token", None), ("float8_e4m3fn", True, "token", None),
    ("float8_e5m2", True, "token", None),
)


def make_inputs(batch: int, seq_len: int, dtype: str, key):
  """(q, k, v, k_scale, v_scale): normal values, quantized with per-token scales unless bf16."""
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (batch, HEADS, HEAD_DIM), jnp.bfloat16)
  k, v = (jax.random.normal(x, (batch, seq_len, KV_HEADS, HEAD_DIM), jnp.float32) for x in (kk, kv))
  if dtype == "bfloat16":
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
  (k, k_scale), (v, v_scale) = kv_cache.quantize(k, dtype), kv_cache.quantize(v, dtype)
  return q, k, v, k_scale, v_scale


def attention(kind: str, config):
  def fn(q, k, v, k_scale, v_scale, lengths):
    if kind == "head":
      k_scale = v_scale = jnp.full((KV_HEADS,), 0.02, jnp.float32)
    elif kind == "none":
      k_scale = v_scale = None
    return pkv.decode_attention(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale, impl="triton", config=config)
  return jax.jit(fn)


def main(argv):
  del argv
  rows = []
  for batch, seq_len in SHAPES:
    lengths = jnp.full((batch,), seq_len, jnp.int32)
    for dtype, fast, kind, fields in VARIANTS:
      if batch == 1 and (fields is not None or kind != "token"):
        continue
      triton_decode.FAST_WIDEN = fast   # read when the kernel is traced
      args = make_inputs(batch, seq_len, dtype, jax.random.key(0))
      fn = attention(kind, None if fields is None else pkv.DecodeConfig(**fields))
      ref = pkv.decode_attention_reference(args[0].astype(jnp.float32), *args[1:3], lengths, k_scale=args[3],
                                           v_scale=args[4])
      out = fn(*args, lengths).astype(jnp.float32)
      checked = kind == "token" or dtype == "bfloat16"
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) if checked else float("nan")
      sets = [args + (lengths,)]
      if batch < 64:   # a second input set so that the cache does not sit in L2
        sets.append(make_inputs(batch, seq_len, dtype, jax.random.key(1)) + (lengths,))
      us = timing.time_jax(fn, sets, warmup=2, iters=20, repeats=5).median_s * 1e6
      rows.append(dict(batch=batch, seq_len=seq_len, dtype=dtype, fast=fast, kind=kind, config=fields, time_us=us,
                       rel_err=err))
      print(f"B{batch:<4d} T{seq_len:<6d} {dtype:14s} fast={int(fast)} {kind:6s} {str(fields):50s} "
            f"{us:8.1f} us  err {err:.1e}", flush=True)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("json", None, "Write the rows here.")
  app.run(main)
