r"""Where the Triton kernel's time goes with one-byte caches: widening path x scale kind x config.

  PYTHONPATH=. python3 -m benchmarks.tools.quantized_probe --json=$OUT/qprobe.json     # GPU, ~4 minutes
  PYTHONPATH=. python3 -m benchmarks.tools.quantized_probe --mode=tiles --shapes=128x4096 --json=...

`--mode=tiles` times instead tile size x stages (x half the splits at B1) for int8 and fp8 e4m3
caches with v stored like k and tokens last (`v_tokens_last`), per-token scales (~10 s a row).

Heads 32/8, head_dim 128, bf16 queries, full lengths, `impl="triton"`; each row times
`pallas_kv.decode_attention` (benchmarks/timing.py chain difference) on int8 / fp8 caches made by
`pallas_kv.cache.quantize` (per-token scales), against the bf16 cache on the same shape:
  fast      1: one-byte tiles widen to float16 with the kernel's PTX (`FAST_WIDEN`); 0: generic
            conversions
  kind      token (the cache's per-token scales), head (one per kv head), none (no scale: the
            kernel without scale loads or multiplies)
  config    None (the backend's choice) or a partial TritonConfig of these fields (the backend fills
            the rest)
Rows with per-token scales are checked against the float32 reference (err column).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import pallas_kv as pkv
from benchmarks import timing
from pallas_kv import cache as kv_cache
from pallas_kv import validation
from pallas_kv.kernels.triton import config as triton_config
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


# (block_kv, num_stages) of the tile sweep: 256-token one-byte tiles fit 3 stages but not always
# the SM's other programs, so 2 stages too.
TILES = ((64, 3), (128, 3), (256, 3), (256, 2))


def input_sets(batch: int, seq_len: int, dtype: str, lengths, tokens_last: bool = False) -> list[tuple]:
  """One or two input sets (two below B64, so that the cache does not sit in L2)."""
  sets = []
  for seed in range(1 if batch >= 64 else 2):
    q, k, v, k_scale, v_scale = make_inputs(batch, seq_len, dtype, jax.random.key(seed))
    sets.append((q, k, jnp.transpose(v, (0, 2, 3, 1)) if tokens_last else v, k_scale, v_scale, lengths))
  return sets


def tile_sweep(shapes) -> list[dict]:
  """Tile size x stages for one-byte caches, v like k and v tokens last (module doc)."""
  rows = []
  for batch, seq_len in shapes:
    lengths = jnp.full((batch,), seq_len, jnp.int32)
    for dtype, tokens_last in itertools.product(("int8", "float8_e4m3fn"), (False, True)):
      sets = input_sets(batch, seq_len, dtype, lengths, tokens_last)
      q, k, v, k_scale, v_scale, _ = sets[0]
      v_like_k = jnp.transpose(v, (0, 3, 1, 2)) if tokens_last else v
      ref = pkv.decode_attention_reference(q.astype(jnp.float32), k, v_like_k, lengths, k_scale=k_scale,
                                           v_scale=v_scale)
      problem = validation.validate_dense(q, k, v, lengths, tokens_last)
      for (block_kv, num_stages), split_divisor in itertools.product(TILES, (1, 2) if batch == 1 else (1,)):
        base = pkv.TritonConfig(block_kv=block_kv, num_stages=num_stages, split_plan="per_sequence")
        splits = triton_config.resolve_config(problem, base, dtype=k.dtype).num_splits
        if splits < split_divisor:
          continue
        config = dataclasses.replace(base, num_splits=max(1, splits // split_divisor))
        fn = jax.jit(lambda q, k, v, ks, vs, n, config=config: pkv.decode_attention(
            q, k, v, n, k_scale=ks, v_scale=vs, impl="triton", config=config, v_tokens_last=tokens_last))
        out = fn(*sets[0]).astype(jnp.float32)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        us = timing.time_jax(fn, sets, warmup=2, iters=20, repeats=5).median_s * 1e6
        rows.append(dict(batch=batch, seq_len=seq_len, dtype=dtype, tokens_last=tokens_last, block_kv=block_kv,
                         num_stages=num_stages, num_splits=config.num_splits, time_us=us, rel_err=err))
        print(f"B{batch:<4d} T{seq_len:<6d} {dtype:14s} tokens_last={int(tokens_last)} block_kv={block_kv:<4d} "
              f"stages={num_stages} splits={config.num_splits:<3d} {us:8.1f} us  err {err:.1e}", flush=True)
  return rows


def variant_sweep(shapes) -> list[dict]:
  """Widening path x scale kind x config (module doc)."""
  rows = []
  for batch, seq_len in shapes:
    lengths = jnp.full((batch,), seq_len, jnp.int32)
    for dtype, fast, kind, fields in VARIANTS:
      if batch == 1 and (fields is not None or kind != "token"):
        continue
      triton_decode.FAST_WIDEN = fast   # read when the kernel is traced
      sets = input_sets(batch, seq_len, dtype, lengths)
      args = sets[0][:-1]   # (q, k, v, k_scale, v_scale) of the first set
      fn = attention(kind, None if fields is None else pkv.TritonConfig(**fields))
      ref = pkv.decode_attention_reference(args[0].astype(jnp.float32), *args[1:3], lengths, k_scale=args[3],
                                           v_scale=args[4])
      out = fn(*args, lengths).astype(jnp.float32)
      checked = kind == "token" or dtype == "bfloat16"
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) if checked else float("nan")
      us = timing.time_jax(fn, sets, warmup=2, iters=20, repeats=5).median_s * 1e6
      rows.append(dict(batch=batch, seq_len=seq_len, dtype=dtype, fast=fast, kind=kind, config=fields, time_us=us,
                       rel_err=err))
      print(f"B{batch:<4d} T{seq_len:<6d} {dtype:14s} fast={int(fast)} {kind:6s} {str(fields):50s} "
            f"{us:8.1f} us  err {err:.1e}", flush=True)
  return rows


def main(argv):
  del argv
  shapes = [tuple(int(x) for x in s.split("x")) for s in FLAGS.shapes] if FLAGS.shapes else None
  rows = variant_sweep(shapes or SHAPES) if FLAGS.mode == "variants" else tile_sweep(shapes or SHAPES)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("json", None, "Write the rows here.")
  flags.DEFINE_enum("mode", "variants", ["variants", "tiles"], "What to sweep (module doc).")
  flags.DEFINE_list("shapes", None, "BxT shapes (default: 128x4096, 8x8192, 1x32768).")
  app.run(main)
