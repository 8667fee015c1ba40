r"""Mosaic GPU against Triton over a one-byte cache with v stored tokens last: scale kinds x Mosaic GPU configs.

  python -m benchmarks tools.mosaic_one_byte --json=parts.json     # on a GPU (~5 minutes); CPU: a tiny shape
  python -m benchmarks tools.mosaic_one_byte --only="triton token,mosaic_gpu token"

Heads 32/8, head_dim 128 (CPU: 64), fp16 queries, full lengths; each row times `pallas_kv.decode_attention(...,
v_tokens_last=True)` (benchmarks/timing.py chain difference) with per-token scales ("token"), one per kv head
("head") or none, on the backend's config or a partial MosaicGPUConfig. An fp8 cache runs Mosaic GPU's fp8 wgmma
operands, an int8 one its widening consumers. err: against `xla` on the same inputs. Rows "kernel ..." and
"loads ..." (KERNEL_ROWS) time the kernel alone, the latter with no math: the load path's own time.
`--page_size=64` runs the op rows over a paged cache instead (`paged_decode_attention`, pages shuffled).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from pallas_kv import validation
from pallas_kv.config import AttentionOptions
from pallas_kv.experimental import MosaicGPUVariantConfig
from pallas_kv.kernels import frame
from pallas_kv.kernels.mosaic_gpu import backend as mgpu_backend
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from benchmarks import cases
from benchmarks import decode as decode_bench
from benchmarks import output
from benchmarks import timing
from benchmarks.tools import kernel_variants


M = pkv.MosaicGPUConfig
# (name, impl, scale kind, Mosaic GPU config or None)
VARIANTS = [(f"{impl} {kind}", impl, kind, None)
            for impl in ("triton", "mosaic_gpu") for kind in ("token", "head", "none")]
# tc2: two consumers taking turns on one split's tiles (the widening consumers only: int8, not fp8 operands);
# groups3: three consumers, each on its own split (152 registers each, 232 with two); pqk: the next tile's Q K^T
# issued before this tile's softmax;
# sk: the stream-K walk of the persistent programs; eb: no automatic barrier around each SMEM store
# (`experimental.MosaicGPUVariantConfig.explicit_barriers`); asn: the queries as wgmma N (fp8, one consumer;
# asn128: on 128-token tiles; vreg: V widened in registers, P V's A operand; v8: V as stored, P^T as two one-byte
# terms; sk: the stream-K walk of persistent programs; persist: one program an SM, its ring streaming on across the
# work items; pair: Q's and P's two terms one wgmma operand of 32 columns). The default over fp8 and int8 is
# asn256 v8 (int8: pair; both: persist at >= 3 waves of items); the other named variants keep the keys as S's
# columns (queries_as_n=False), groups2 being the earlier default.
VARIANTS += [(f"mosaic_gpu {kind} {name}", "mosaic_gpu", kind,
              config if name.startswith("asn") else dataclasses.replace(config, queries_as_n=False))
             for name, config in (("groups1", M(kv_groups=1)), ("groups2", M(kv_groups=2)), ("groups3", M(kv_groups=3)),
                                  ("pqk", M(pipeline_qk=True)), ("groups3 pqk", M(kv_groups=3, pipeline_qk=True)),
                                  ("bkv128", M(block_kv=128)), ("bkv128 groups1", M(block_kv=128, kv_groups=1)),
                                  ("tc2", M(kv_groups=1, tile_consumers=2, persistent=True)),
                                  ("sk", M(split_plan="stream_k")),
                                  ("eb", MosaicGPUVariantConfig(explicit_barriers=True)),
                                  ("asn", M(queries_as_n=True, block_kv=64)),
                                  ("asn128", M(queries_as_n=True, block_kv=128)),
                                  ("asn pqk", M(queries_as_n=True, block_kv=64, pipeline_qk=True)),
                                  ("asn128 pqk", M(queries_as_n=True, block_kv=128, pipeline_qk=True)),
                                  ("asn128 vreg", MosaicGPUVariantConfig(queries_as_n=True, block_kv=128,
                                                                         values_in_registers=True)),
                                  ("asn vreg", MosaicGPUVariantConfig(queries_as_n=True, block_kv=64,
                                                                      values_in_registers=True)),
                                  ("asn128 v8", MosaicGPUVariantConfig(queries_as_n=True, block_kv=128,
                                                                       values_as_stored=True)),
                                  ("asn v8", MosaicGPUVariantConfig(queries_as_n=True, block_kv=64,
                                                                    values_as_stored=True)),
                                  ("asn256 v8", MosaicGPUVariantConfig(queries_as_n=True, block_kv=256,
                                                                       values_as_stored=True)),
                                  ("asn v8 pair", M(queries_as_n=True, block_kv=64, values_as_stored=True,
                                                    paired_terms=True)),
                                  ("asn128 v8 pair", M(queries_as_n=True, block_kv=128, values_as_stored=True,
                                                       paired_terms=True)),
                                  ("asn256 v8 persist", M(queries_as_n=True, block_kv=256, values_as_stored=True,
                                                          persistent=True)),
                                  ("asn256 v8 pair", M(queries_as_n=True, block_kv=256, values_as_stored=True,
                                                       paired_terms=True)),
                                  ("asn256 v8 persist pair", M(queries_as_n=True, block_kv=256, values_as_stored=True,
                                                               persistent=True, paired_terms=True)),
                                  ("asn128 sk", M(queries_as_n=True, block_kv=128, split_plan="stream_k")),
                                  ("asn256 v8 sk", M(queries_as_n=True, block_kv=256, values_as_stored=True,
                                                     split_plan="stream_k")))
             for kind in ("token", "none")]
# Kernel-only rows (`decode_partials` on the op's config and plan, no merge; results not checked): "kernel" with its
# math, "loads" the `loads_only` probe (each slot waited for and freed, no math): what the load path alone takes.
# "bare" and "bare loads": the kernel's custom call alone, its inputs (scales laid out where the kernel reads them
# so) prepared outside the timed function (`decode.kernel_call`); scale kind "byhead": per-token scales laid out
# [B, Hkv, T] there, one run a copy (`experimental.MosaicGPUVariantConfig.scales_by_head`), as a cache storing its
# scales by head would hold them.
_ASN256_V8 = MosaicGPUVariantConfig(queries_as_n=True, block_kv=256, values_as_stored=True)
KERNEL_ROWS = [(f"{probe} {kind} {name}", kind, config, probe)
               for probe in ("kernel", "loads") for kind in ("token", "none")
               for name, config in (("asn128", M(queries_as_n=True, block_kv=128)), ("asn256 v8", _ASN256_V8),
                                    ("groups2", M(kv_groups=2, queries_as_n=False)))]
KERNEL_ROWS += [(f"{probe} {kind} asn256 v8", kind, dataclasses.replace(_ASN256_V8, scales_by_head=kind == "byhead"),
                 probe) for probe in ("bare", "bare loads") for kind in ("token", "byhead", "none")]
ROW_NAMES = frozenset(v[0] for v in VARIANTS) | frozenset(r[0] for r in KERNEL_ROWS)   # what --only may name


def inputs(batch: int, seq_len: int, head_dim: int, kv_dtype, seed: int = 0, q_dtype=jnp.float16,
           abstract: bool = False) -> dict[str, Any]:
  """q [B, 32, D] q_dtype, k [B, T, 8, D] and v [B, 8, D, T] (tokens last) one-byte, full lengths, and per scale
  kind K's and V's scales (two arrays, as a cache holds them: one array for both would serve V's from L2).
  abstract: ShapeDtypeStructs in the arrays' place, for a lowering (no values drawn)."""
  rng = np.random.default_rng(seed)

  def array(shape, dtype, draw):
    return jax.ShapeDtypeStruct(shape, dtype) if abstract else jnp.asarray(draw(shape), dtype)

  one_byte = lambda shape: array(shape, kv_dtype, lambda s: np.clip(rng.standard_normal(s) * 40, -127, 127)
                                 if kv_dtype == jnp.int8 else rng.standard_normal(s) * 8)
  scales = lambda shape: array(shape, jnp.float32, lambda s: rng.uniform(0.005, 0.02, s))
  return dict(q=array((batch, 32, head_dim), q_dtype, rng.standard_normal),
              k=one_byte((batch, seq_len, 8, head_dim)), v=one_byte((batch, 8, head_dim, seq_len)),
              lengths=array((batch,), jnp.int32, lambda s: np.full(s, seq_len)),
              scales=dict(token=(scales((batch, seq_len, 8)), scales((batch, seq_len, 8))),
                          head=(scales((8,)), scales((8,))), none=(None, None)))


def paged(x: dict[str, Any], page_size: int, seed: int = 0) -> dict[str, Any]:
  """`inputs` as a paged cache: pages of page_size tokens in shuffled order ([P, page, 8, D]; V [P, 8, D, page]),
  block_tables [B, T / page], per-token scales [P, page, 8]."""
  batch, seq_len, heads, head_dim = x["k"].shape
  per_seq = seq_len // page_size
  order = np.random.default_rng(seed).permutation(batch * per_seq)   # page j of sequence b lives at order[b, j]

  def placed(blocks):   # [B * per_seq, ...] in sequence order -> the pool, page order[i] holding block i
    return blocks.at[order].set(blocks)

  v = x["v"].reshape(batch, heads, head_dim, per_seq, page_size).transpose(0, 3, 1, 2, 4)
  token = tuple(placed(s.reshape(batch * per_seq, page_size, heads)) for s in x["scales"]["token"])
  return dict(x, k=placed(x["k"].reshape(batch * per_seq, page_size, heads, head_dim)),
              v=placed(v.reshape(batch * per_seq, heads, head_dim, page_size)),
              block_tables=jnp.asarray(order.reshape(batch, per_seq), jnp.int32),
              scales=dict(x["scales"], token=token))


def kernel_only(config, probe: str, args):
  """(the Mosaic GPU kernel alone on the op's complete config and plan (partials, no merge), its arguments) on the
  op's args; probe "loads": with the `loads_only` probe's tile math; "bare ...": the kernel's call alone on inputs
  prepared here."""
  tile_math = kernel_variants.PROBES["loads_only"] if probe.endswith("loads") else mgpu_decode.TileMath()

  def call(q, k, v, lengths, k_scale, v_scale, *, partials=mgpu_decode.decode_partials):
    problem = validation.validate_dense(q, k, v, lengths, True)
    options = AttentionOptions(scale=q.shape[-1] ** -0.5)
    full = mgpu_backend.resolve_config("decode", problem, config, dtype=k.dtype)
    plan = mgpu_backend.plan_splits("decode", problem, options, full, lengths)
    return partials(frame.pack_queries(q[:, None], problem.num_kv_heads), k, v, lengths, num_queries=1,
                    options=options, config=full, plan=plan, k_scale=k_scale, v_scale=v_scale, tile_math=tile_math,
                    interpret=mgpu_backend.interpret_params(), v_tokens_last=True)
  if not probe.startswith("bare"):
    return jax.jit(call), args
  kernel, inputs, _ = call(*args, partials=mgpu_decode.kernel_call)
  return jax.jit(kernel), tuple(jax.block_until_ready(inputs))


def rows(batch: int, seq_len: int, head_dim: int, kv_dtype, *, cpu: bool, only=None, page_size: int | None = None,
         on_row: Callable[[list[dict[str, Any]]], None] | None = None, q_dtype=jnp.float16,
         between_calls: str = "none") -> list[dict[str, Any]]:
  """The rows named in `only` (default: every op row on a GPU); page_size: over a paged cache (op rows only);
  on_row(rows so far) after each row, so that a command stopped at its time limit keeps what it measured;
  between_calls "xla_add": each timed call after an XLA kernel on its first argument (`decode.with_kernel_before`),
  and a first row timing that kernel alone."""
  if between_calls not in decode_bench.BETWEEN_CALLS:
    raise ValueError(f"between_calls={between_calls!r}: one of {decode_bench.BETWEEN_CALLS}")
  only = only or ([v[0] for v in VARIANTS] if not cpu else ["triton token", "mosaic_gpu token"])
  todo = [(name, impl, kind, config, None) for name, impl, kind, config in VARIANTS]
  todo += [(name, "mosaic_gpu", kind, config, probe) for name, kind, config, probe in KERNEL_ROWS]
  unknown = set(only) - ROW_NAMES
  if unknown:
    raise ValueError(f"--only names no row: {sorted(unknown)}")
  if page_size is not None and set(only) & {r[0] for r in KERNEL_ROWS}:
    raise ValueError("the kernel-only rows run over a dense cache: leave --page_size out for them")
  x = inputs(batch, seq_len, head_dim, kv_dtype, q_dtype=q_dtype)
  if page_size is None:
    cache, attention = (x["k"], x["v"], x["lengths"]), pkv.decode_attention
  else:
    x = paged(x, page_size)
    cache, attention = (x["k"], x["v"], x["block_tables"], x["lengths"]), pkv.paged_decode_attention

  def op(impl, config=None):   # (q, *cache, k_scale, v_scale) -> the attention over that cache
    def call(q, *cache_and_scales):
      *kv, k_scale, v_scale = cache_and_scales
      return attention(q, *kv, k_scale=k_scale, v_scale=v_scale, impl=impl, config=config, v_tokens_last=True)
    return jax.jit(call)

  refs = {kind: op("xla")(x["q"], *cache, *scales) for kind, scales in x["scales"].items()}
  results = []

  def time_row(fn, args):
    settings = dict(warmup=0, iters=1, repeats=1) if cpu else dict(warmup=2, iters=20, repeats=5)
    if between_calls != "none":
      fn = jax.jit(lambda first, *rest, fn=fn: fn(decode_bench.between_kernel(first), *rest))
    return timing.time_jax(fn, [args], **settings).median_s * 1e6

  if between_calls != "none":
    alone = time_row(lambda first, *rest: first, (x["q"],))
    print(f"{decode_bench.BETWEEN_ROW:32s} {alone:8.1f} us  (subtract from the rows below)", flush=True)
    results.append(dict(name=decode_bench.BETWEEN_ROW, batch=batch, seq_len=seq_len, us=alone))
  for name, impl, kind, config, probe in todo:
    if name not in only:
      continue
    args = (x["q"], *cache, *x["scales"]["token" if kind == "byhead" else kind])
    row = dict(name=name, impl=impl, scale=kind, config=None if config is None else config.given(),
               batch=batch, seq_len=seq_len, page_size=page_size, kv_dtype=jnp.dtype(kv_dtype).name,
               q_dtype=jnp.dtype(q_dtype).name,
               kernel_only=probe)
    try:
      with pkv.interpret(cpu):
        if probe is None:
          fn = op(impl, config)
          row["err"] = cases.relative_error(fn(*args), refs[kind])
        else:
          fn, args = kernel_only(config, probe, args)
          jax.block_until_ready(fn(*args))
        row["us"] = time_row(fn, args)
      row["between_calls"] = between_calls
    except Exception as e:   # a config that does not fit says so in its row
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    err = f"  err {row['err']:.1e}" if "err" in row else "  (kernel only)"
    print(f"{name:32s} " + (f"{row['us']:8.1f} us{err}" if "us" in row else row["error"]), flush=True)
    results.append(row)
    if on_row is not None:
      on_row(results)
  return results


def define_flags() -> None:
  flags.DEFINE_string("kv_dtype", "float8_e4m3fn", "the cache's one-byte dtype")
  flags.DEFINE_string("shape", None, "BxT; default 32x4096 on a GPU, 2x256 on a CPU")
  flags.DEFINE_string("json", None, "write the rows here")
  flags.DEFINE_list("only", None, "variant names to run; default all on a GPU, the two per-token defaults on a CPU")
  flags.DEFINE_integer("page_size", None, "run the op rows over a paged cache of these pages (shuffled)")
  flags.DEFINE_enum("q_dtype", "float16", ["float16", "bfloat16"], "the queries' dtype")
  flags.DEFINE_enum("between_calls", "none", list(decode_bench.BETWEEN_CALLS), "xla_add: each timed call after an "
                    "XLA kernel on its queries, as in a model (the decode benchmark's flag), and a row timing it.")


def main(argv):
  del argv
  cpu = jax.default_backend() == "cpu"
  fv = flags.FLAGS
  batch, seq_len = (int(n) for n in (fv.shape or ("2x256" if cpu else "32x4096")).split("x"))
  rows(batch, seq_len, 64 if cpu else 128, jnp.dtype(fv.kv_dtype), cpu=cpu, only=fv.only, page_size=fv.page_size,
       on_row=(lambda so_far: output.write_json(so_far, fv.json)) if fv.json else None, q_dtype=jnp.dtype(fv.q_dtype),
       between_calls=fv.between_calls)


if __name__ == "__main__":
  define_flags()
  app.run(main)
