r"""Shared prefixes: groups of sequences forked from one prompt, with and without `SharedPrefix`.

  python -m benchmarks shared_prefix                                          # CPU: xla, tiny shapes
  python -m benchmarks shared_prefix --impl=auto,triton,mosaic_gpu --json=shared.json   # GPU

Each case G x N x P x S: G groups of N sequences, each group's prompt P tokens in pages that all its
members' block tables start with, then S private tokens per sequence (the last is the new one). Two
rows per impl: `plain`, paged decode over the whole tables (the prompt read once per member, as
today), and `shared`, the same call with `shared_prefix=` (the prompt read once per group). Also
`op=mla` (DeepSeek's latent shapes). Time per call by the chain timer and by a Python loop of jitted
calls; bytes read counted as the cache's pages each row reads. Target (H200): 8 x 16 x 8192 x 256,
shared >= 6x faster than plain.
"""

from __future__ import annotations

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from benchmarks import cli
from benchmarks import output
from benchmarks import timing

FLAGS = flags.FLAGS
GPU_CASES = ("8x16x8192x256", "4x64x2048x128", "1x32x32768x512")
CPU_CASES = ("2x3x64x8",)
CPU_TIMING = {"warmup": 1, "iters": 2, "repeats": 3}
GPU_TIMING = {"warmup": 3, "iters": 20, "repeats": 5}
GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
MLA = dict(num_heads=16, num_kv_heads=1, head_dim=576, page_size=64, v_head_dim=512)
CPU_SHAPES = dict(num_heads=4, num_kv_heads=2, head_dim=32, page_size=4, v_head_dim=16)


def define_flags():
  cli.define_timing_flags({name: f"CPU {CPU_TIMING[name]}, GPU {GPU_TIMING[name]}" for name in GPU_TIMING})
  cli.define_output_flags(("json",))
  flags.DEFINE_list("cases", None, f"G x N x P x S cases (default GPU {','.join(GPU_CASES)})")
  flags.DEFINE_list("impl", None, "impls (default: auto,triton,mosaic_gpu,xla on a GPU; xla on a CPU)")
  flags.DEFINE_enum("op", "paged", ["paged", "mla"], "paged GQA (32 / 8, D 128, page 16) or MLA (16 heads, page 64)")
  flags.adopt_module_key_flags(cli)


def parse_case(spec: str) -> tuple[int, int, int, int]:
  groups, members, prompt, private = (int(x) for x in spec.split("x"))
  return groups, members, prompt, private


def make_inputs(groups: int, members: int, prompt: int, private: int, shape: dict, mla: bool, key):
  """(q, pages (k, v or the latent), block tables, lengths, SharedPrefix, pages the plain call reads,
  pages the shared call reads). Pages are shuffled in the pool, as a serving pool's are."""
  page = shape["page_size"]
  prompt_pages, private_pages = -(-prompt // page), -(-private // page)
  batch = groups * members
  num_pages = groups * prompt_pages + batch * private_pages
  ids = np.random.default_rng(0).permutation(num_pages).astype(np.int32)
  shared_ids = ids[:groups * prompt_pages].reshape(groups, prompt_pages)
  own_ids = ids[groups * prompt_pages:].reshape(batch, private_pages)
  tables = np.concatenate([np.repeat(shared_ids, members, axis=0), own_ids], axis=1)
  lengths = jnp.full((batch,), prompt_pages * page + private, jnp.int32)
  members_of = np.arange(batch, dtype=np.int32).reshape(groups, members)
  sharing = pkv.SharedPrefix(jnp.asarray(members_of), jnp.full((groups,), prompt_pages, jnp.int32))
  kq, kk, kv = jax.random.split(key, 3)
  heads, kv_heads, dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
  q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
  if mla:
    pages = (jax.random.normal(kk, (num_pages, page, dim), jnp.bfloat16),)
  else:
    pages = tuple(jax.random.normal(k, (num_pages, page, kv_heads, dim), jnp.bfloat16) for k in (kk, kv))
  plain_pages = batch * (prompt_pages + private_pages)
  return q, pages, jnp.asarray(tables), lengths, sharing, plain_pages, num_pages


def run(specs, impls, op: str, warmup: int, iters: int, repeats: int, shapes: dict) -> list[dict]:
  rows = []
  mla = op == "mla"
  for spec in specs:
    groups, members, prompt, private = parse_case(spec)
    q, pages, tables, lengths, sharing, plain_pages, shared_pages = make_inputs(
        groups, members, prompt, private, shapes, mla, jax.random.key(0))
    page_bytes = pages[0][0].size * pages[0].dtype.itemsize * len(pages)
    for impl in impls:
      if mla:
        op_fn = functools.partial(pkv.mla_decode_attention, v_head_dim=shapes["v_head_dim"], impl=impl)
        call = lambda q, tables, lengths, sharing, pages: op_fn(q, *pages, tables, lengths, shared_prefix=sharing)
      else:
        op_fn = functools.partial(pkv.paged_decode_attention, impl=impl)
        call = lambda q, tables, lengths, sharing, pages: op_fn(q, *pages, tables, lengths, shared_prefix=sharing)
      times, outs = {}, {}
      for kind, sharing_arg, num_pages in (("plain", None, plain_pages), ("shared", sharing, shared_pages)):
        fn = jax.jit(functools.partial(call, sharing=sharing_arg))
        args = [(q, tables, lengths, pages)]
        try:
          chain = timing.time_jax(lambda *a: fn(*a[:3], pages=a[3]), args, warmup=warmup, iters=iters,
                                  repeats=repeats)
          host = timing.time_host_loop_jax(lambda *a: fn(*a[:3], pages=a[3]), args, warmup=warmup, iters=iters,
                                           repeats=repeats)
          outs[kind] = np.asarray(fn(q, tables, lengths, pages=pages), np.float32)
        except Exception as e:  # pylint: disable=broad-except
          rows.append(dict(case=spec, op=op, impl=impl, kind=kind, status="error", reason=output.error_reason(e)))
          print(f"{spec:>16} {impl:>11} {kind:>6}  error ({output.error_reason(e)})", flush=True)
          continue
        times[kind] = chain.median_s
        tbps = num_pages * page_bytes / chain.median_s / 1e12
        rows.append(dict(case=spec, op=op, impl=impl, kind=kind, status="ok", time_us=chain.median_s * 1e6,
                         host_us=host.median_s * 1e6, pages_read=num_pages, tbps=tbps))
        print(f"{spec:>16} {impl:>11} {kind:>6}  {chain.median_s * 1e6:9.1f} us  (host loop "
              f"{host.median_s * 1e6:9.1f})  {tbps:6.2f} TB/s of pages read", flush=True)
      if len(times) == 2:
        rows[-1].update(_compared(times, outs))
        print(f"{spec:>16} {impl:>11}  shared is {rows[-1]['speedup']:.2f}x plain "
              f"(rel err {rows[-1]['rel_err_vs_plain']:.1e})", flush=True)
  return rows


def _compared(times: dict, outs: dict) -> dict:
  """The shared row's speedup over the plain one and its output's relative distance from the plain output."""
  err = np.linalg.norm(outs["shared"] - outs["plain"]) / np.linalg.norm(outs["plain"])
  return dict(speedup=times["plain"] / times["shared"], rel_err_vs_plain=float(err))


def main(argv):
  del argv
  on_cpu = jax.default_backend() == "cpu"
  shapes = CPU_SHAPES if on_cpu else (MLA if FLAGS.op == "mla" else GQA)
  if on_cpu and FLAGS.op == "mla":
    shapes = dict(shapes, head_dim=64)
  rows = run(FLAGS.cases or (CPU_CASES if on_cpu else GPU_CASES),
             FLAGS.impl or (["xla"] if on_cpu else ["auto", "triton", "mosaic_gpu", "xla"]),
             FLAGS.op, *cli.timing_or_defaults(CPU_TIMING, GPU_TIMING), shapes)
  json_path = cli.output_paths().json
  if json_path:
    output.write_json(rows, json_path)


if __name__ == "__main__":
  define_flags()
  app.run(main)
