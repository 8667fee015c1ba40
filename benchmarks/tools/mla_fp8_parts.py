r"""Where an fp8 MLA tile's time goes: the MLA kernel's launch alone (one split, no merge) over a bf16 pool and
over its fp8 copy (a scale per token), with Q as two fp8 terms or one, and with a stage left out.

  python -m benchmarks tools.mla_fp8_parts --json=parts.json          # on a GPU; CPU: the tiny row, interpreted

Impls: `bf16`, `fp8` (the shipped kernel: Q as two fp8 terms), `fp8_q1` (one term: fp8's error, half Q K^T's
MMA work), `fp8_scalar` (one scale for the pool: no scale ring, S and P unscaled in the kernel), and probes
whose results are wrong by design (unchecked): `bf16_no_qk`, `fp8_no_qk` (Q K^T left out), `fp8_no_widen` (the
partner hands the value tiles over without widening them), `bf16_eb` and `fp8_eb` (compiled without the automatic
barriers around SMEM stores). Up to 32 packed rows (16 heads) `fp8` takes them as wgmma's N; `fp8_rows_as_m` pads
them to M = 64 as before (`Codegen.one_byte_rows_as_n=False`), `fp8_st3` is `fp8` on a 3-stage ring (which only
rows as N leave SMEM for), `fp8_own` has each consumer widen its own value columns (`Codegen.widen_own_values`).
Each checked impl's relative error is given against bf16_einsum over the bf16 pool and over the fp8 pool widened
exactly. With --trace_dir (GPU), each impl is also traced from inside (`tools.kernel_trace`'s table: the scorer
as consumer 0, the partner as consumer 1, the producer), two chained calls, the second's timeline read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
from benchmarks import cases
from benchmarks import mla as bench
from benchmarks import timing


# impl: (pool: bf16, fp8 with a scale per token or one scalar; Q's fp8 terms; the stages left out); `_eb`: compiled
# without the automatic barriers around SMEM stores (`mla_config.Codegen.explicit_barriers`)
IMPLS = {"bf16": ("bf16", 2, ()), "fp8": ("token", 2, ()), "fp8_q1": ("token", 1, ()),
         "fp8_scalar": ("scalar", 2, ()), "bf16_no_qk": ("bf16", 2, ("qk",)), "fp8_no_qk": ("token", 2, ("qk",)),
         "fp8_no_widen": ("token", 2, ("widen",)), "bf16_eb": ("bf16", 2, ()), "fp8_eb": ("token", 2, ()),
         "fp8_rows_as_m": ("token", 2, ()), "fp8_st3": ("token", 2, ()), "fp8_own": ("token", 2, ())}
# impl: its Codegen fields and config fields beside the 2-stage default
CODEGEN = {"bf16_eb": dict(explicit_barriers=True), "fp8_eb": dict(explicit_barriers=True),
           "fp8_rows_as_m": dict(one_byte_rows_as_n=False), "fp8_own": dict(widen_own_values=True)}
CONFIG = {"fp8_st3": dict(num_stages=3)}


def probe_math(skip: tuple[str, ...]):
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla   # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass(frozen=True)
  class Probe(mgpu_mla.TileMath):
    """MEASUREMENT ONLY: Q K^T or the widening left out."""
    name: str = "probe_" + "_".join(skip)

    def qk(self, s_ref, q_tile, k_tile):
      if "qk" not in skip:
        super().qk(s_ref, q_tile, k_tile)

    def widen(self, slot, widened, w, st, valid_rows=None):
      if "widen" in skip:
        plgpu.commit_smem()
      else:
        super().widen(slot, widened, w, st, valid_rows)

  return Probe() if skip else mgpu_mla.TileMath()


def launch(row: bench.Row, impl: str):
  """The jitted kernel launch of impl on (q, pages, tables, lengths[, kv_scale]): out [B, (S,) Hq, Dv]."""
  from pallas_kv.kernels.mosaic_gpu import backend, mla as mgpu_mla, mla_config   # pylint: disable=g-import-not-at-top
  pool, terms, skip = IMPLS[impl]
  codegen = mla_config.Codegen(**CODEGEN.get(impl, {}))
  config, plan = bench.kernel_config(CONFIG.get(impl, {}), 1)
  math = probe_math(skip)

  def run(q, pages, tables, lengths, kv_scale=None):
    rows = q.reshape(q.shape[0], -1, q.shape[-1])   # [B, S * Hq, Dqk]: row s * Hq + h
    if pool != "bf16":
      rows = rows.astype(jnp.float16)   # the op's compute dtype over a one-byte pool
    out, _ = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=row.num_queries, v_head_dim=row.v_dim,
                                   scale=row.qk_dim ** -0.5, config=config, plan=plan, kv_scale=kv_scale,
                                   query_terms=terms, tile_math=math, codegen=codegen,
                                   interpret=backend.interpret_params())
    return out[:, 0].reshape(*q.shape[:-1], row.v_dim).astype(q.dtype)

  return jax.jit(run)


def chain_step(row: bench.Row, impl: str):
  """impl's launch as a step of `kernel_trace.chained`: q in, q out, its first v_dim columns the launch's output
  (an MLA output has v_dim columns, its queries qk_dim), so that each call of a chain reads the last one's."""
  op = launch(row, impl)

  def step(q, *rest):
    return q.at[..., :row.v_dim].set(op(q, *rest).astype(q.dtype))
  return step


def run_row(row: bench.Row, impls, *, cpu: bool, trace_dir: str | None = None, visits: int = 256
            ) -> list[dict[str, Any]]:
  case = row.case()
  lengths = cases.make_lengths(case, jax.random.key(0))
  bf16_sets = cases.make_input_sets(case, jax.random.key(1), lengths, 1 if cpu else 3)
  pool_sets = {"bf16": bf16_sets, "token": [], "scalar": []}
  for q, pages, tables, lens in bf16_sets:   # the same pools in fp8: kv_scale last
    for kind in ("token", "scalar"):
      fp8_pages, kv_scale = quantize(pages, kind)
      pool_sets[kind].append((q, fp8_pages, tables, lens, kv_scale))
  q, pages, tables, lens = bf16_sets[0]
  einsum = jax.jit(lambda *a: bench.bf16_einsum(*a, v_head_dim=row.v_dim, scale=row.qk_dim ** -0.5))
  refs = {"bf16": einsum(q, pages, tables, lens)}
  for kind in ("token", "scalar"):
    _, fp8_pages, _, _, kv_scale = pool_sets[kind][0]
    scale = kv_scale[..., None] if kind == "token" else kv_scale
    refs[kind] = einsum(q, (fp8_pages.astype(jnp.float32) * scale).astype(jnp.bfloat16), tables, lens)
  results = []
  for impl in impls:
    pool, _, skip = IMPLS[impl]
    sets = pool_sets[pool]
    fn = launch(row, impl)
    result = dict(row=row.name, impl=impl, probe=bool(skip))
    try:
      out = fn(*sets[0])
    except ValueError as e:   # a config this row's SMEM does not fit (fp8_st3 at rows padded to 64)
      print(f"{row.name} {impl}: n/a ({e})", flush=True)
      continue
    if not skip:
      result.update(err_vs_bf16_pool=cases.relative_error(out, refs["bf16"]),
                    err_vs_widened=cases.relative_error(out, refs[pool]) if pool != "bf16" else None)
    t = timing.time_jax(fn, sets, warmup=0 if cpu else 3, iters=1 if cpu else 10, repeats=1 if cpu else 5)
    result["us"] = t.median_s * 1e6
    print(result, flush=True)
    results.append(result)
    if trace_dir:
      trace_impl(row, impl, sets[0], trace_dir, visits)
  return results


def trace_impl(row: bench.Row, impl: str, args, trace_dir: str, visits: int) -> None:
  """impl's kernel traced from inside into trace_dir/IMPL_ROW/ (`tools.kernel_trace`'s layout and meta.json): two
  calls in a chain, each on the last one's output, so that the second runs warm."""
  from benchmarks.tools import kernel_trace   # pylint: disable=g-import-not-at-top
  meta = {"variant": impl, "shape": f"{row.name} call 2", "warpgroups": 3, "consumers": 2, "calls": 2}
  while True:   # fewer visits where the trace's buffer does not fit the SMEM the kernel leaves
    try:
      kernel_trace.record_trace(os.path.join(trace_dir, f"{impl}_{row.name}"), visits,
                                kernel_trace.chained(chain_step(row, impl), 2), args, meta)
      return
    except Exception as e:  # pylint: disable=broad-except
      if "shared memory" in str(e) and visits >= 32:
        visits //= 2
        continue
      print(f"{row.name} {impl}: not traced ({type(e).__name__}: {str(e).strip()[:200]})", flush=True)
      return


def quantize(pages, kind: str):
  """(fp8 pages, kv_scale): a scale per token [P, page_size], or one for the pool (its max over 448)."""
  from pallas_kv import cache as kv_cache   # pylint: disable=g-import-not-at-top
  if kind == "token":
    return kv_cache.quantize(pages, jnp.float8_e4m3fn)
  scale = jnp.max(jnp.abs(pages.astype(jnp.float32))) / 448.0
  return kv_cache.quantize(pages, jnp.float8_e4m3fn, scale)[0], scale


def define_flags() -> None:
  flags.DEFINE_list("rows", None, "benchmarks.mla rows; default: GPU h128_b64_t4096, h16_b64_t8192; CPU tiny_cpu")
  flags.DEFINE_list("impl", ["bf16", "fp8", "fp8_q1", "fp8_scalar", "bf16_no_qk", "fp8_no_qk", "fp8_no_widen"],
                    "impls")
  flags.DEFINE_string("json", None, "write the rows here")
  flags.DEFINE_string("trace_dir", None, "GPU: also trace each impl's kernel from inside into this folder and print "
                      "`tools.kernel_trace`'s table of it")
  flags.DEFINE_integer("visits", 256, "--trace_dir: region visits recorded per warpgroup (16 bytes of SMEM each)",
                       lower_bound=16)


def main(argv) -> None:
  del argv
  cpu = cases.default_is_cpu()
  fv = flags.FLAGS
  names = fv.rows or (["tiny_cpu"] if cpu else ["h128_b64_t4096", "h16_b64_t8192"])
  unknown = [i for i in fv.impl if i not in IMPLS]
  if unknown:
    raise app.UsageError(f"--impl: unknown {unknown}; choose from {','.join(IMPLS)}")
  if fv.trace_dir and cpu:
    raise app.UsageError("--trace_dir: the profiler runs in the compiled kernel, on a GPU")
  with pkv.interpret(cpu):   # on a CPU the kernels run in GPU interpret mode
    results = [r for name in names
               for r in run_row(bench.ALL_ROWS[name], fv.impl, cpu=cpu, trace_dir=fv.trace_dir, visits=fv.visits)]
  for r in results:
    errors = "probe (unchecked)" if r["probe"] else (
        f"err vs bf16 pool {r['err_vs_bf16_pool']:.2e}"
        + (f", vs widened fp8 pool {r['err_vs_widened']:.2e}" if r["err_vs_widened"] is not None else ""))
    print(f"{r['row']:<18} {r['impl']:<14} {r['us']:9.1f} us  {errors}")
  if fv.json:
    with open(fv.json, "w") as f:
      json.dump(results, f, indent=1)
  if fv.trace_dir:
    from benchmarks.tools import kernel_trace   # pylint: disable=g-import-not-at-top
    rows = kernel_trace.read_traces(fv.trace_dir)
    with open(os.path.join(fv.trace_dir, "summary.json"), "w") as f:
      json.dump(rows, f, indent=1)
    print(kernel_trace.format_table(rows), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
