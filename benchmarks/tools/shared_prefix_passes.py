r"""Where a shared-prefix call's time goes: the prefix pass, the suffix pass, and the gathers and merge around
them, with the backend (and split count) of each pass chosen apart.

  python -m benchmarks tools.shared_prefix_passes --json=passes.json     # on a GPU: the three GQA cases

Rows, per case of `benchmarks.shared_prefix` (G x N x P x S, 32 / 8 D 128, page 16): `plain auto`; `shared
PRE/SUF`, the whole cascade with the prefix pass on PRE and the suffix pass on SUF (tr: Triton, mo: Mosaic GPU,
a digit: that split count), with its relative error against the plain call; on the first case also each pass
alone (the other replaced by a copy of its queries, so the gathers stay) and neither pass.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kv as pkv
from pallas_kv import shared_prefix as cascade
from pallas_kv.kernels.frame import MAX_GROUP
from benchmarks import shared_prefix as bench
from benchmarks import timing

_CASES = flags.DEFINE_list("cases", list(bench.GPU_CASES), "G x N x P x S cases; the first also times the passes apart")
_ITERS = flags.DEFINE_integer("iters", 20, "calls per short chain")
_JSON = flags.DEFINE_string("json", None, "write the rows here")

BACKENDS = {"tr": "triton", "mo": "mosaic_gpu"}
COMBOS = ("tr/tr", "mo/mo", "mo/tr", "tr/mo")
SPLIT_COMBOS = ("tr4/tr", "tr8/tr", "mo4/tr", "mo8/tr", "mo4/mo")
PASSES_ALONE = ("tr", "mo", "tr4", "tr8", "mo4", "mo8")


def backend_of(spec: str) -> tuple[str, pkv.TritonConfig | pkv.MosaicGPUConfig | None]:
  """"tr" -> ("triton", None); "mo4" -> ("mosaic_gpu", MosaicGPUConfig(num_splits=4))."""
  impl, splits = BACKENDS[spec[:2]], spec[2:]
  if not splits:
    return impl, None
  return impl, (pkv.TritonConfig if impl == "triton" else pkv.MosaicGPUConfig)(num_splits=int(splits))


def cascade_fn(prefix: str, suffix: str, page_size: int, num_kv_heads: int, only: str | None = None):
  """jit(q, tables, lengths, sharing, k_pages, v_pages) of the cascade with each pass on its own backend; only:
  "prefix" or "suffix" runs that pass alone, "none" neither (a skipped pass returns its queries)."""
  def run(q, tables, lengths, sharing, k_pages, v_pages):
    calls = []

    def attend(q, tables, lengths):
      which = "prefix" if not calls else "suffix"
      calls.append(which)
      if only is not None and only != which:
        return q, q[..., 0].astype(jnp.float32)   # depends on the gathered q, so the gathers stay
      impl, config = backend_of(prefix if which == "prefix" else suffix)
      return pkv.paged_decode_attention(q, k_pages, v_pages, tables, lengths, return_lse=True, impl=impl,
                                        config=config)
    return cascade.attend(attend, q, tables, lengths, sharing, page_size=page_size, num_kv_heads=num_kv_heads,
                          return_lse=False, max_group=MAX_GROUP)
  return jax.jit(run)


def run_case(spec: str, passes_apart: bool, shape: dict, iters: int) -> list[dict]:
  q, (k_pages, v_pages), tables, lengths, sharing, _, _ = bench.make_inputs(
      *bench.parse_case(spec), shape, False, jax.random.key(0))
  args = (q, tables, lengths, sharing, k_pages, v_pages)   # the pages as arguments, not constants of the program
  rows = []

  def time(label, fn, **extra):
    median = timing.time_jax(fn, [args], warmup=3, iters=iters, repeats=5).median_s
    rows.append(dict(case=spec, label=label, time_us=median * 1e6, **extra))
    print(f"{spec:>16} {label:<32} {median * 1e6:9.1f} us" + "".join(f"  {k} {v:.1e}" for k, v in extra.items()),
          flush=True)

  plain = jax.jit(lambda q, tables, lengths, sharing, k, v: pkv.paged_decode_attention(q, k, v, tables, lengths))
  want = np.asarray(plain(*args), np.float32)
  time("plain auto", plain)
  for combo in COMBOS + (SPLIT_COMBOS if passes_apart else ()):
    fn = cascade_fn(*combo.split("/"), shape["page_size"], shape["num_kv_heads"])
    got = np.asarray(fn(*args), np.float32)
    time(f"shared {combo}", fn, rel_err=float(np.linalg.norm(got - want) / np.linalg.norm(want)))
  if passes_apart:
    for spec_ in PASSES_ALONE:
      time(f"prefix pass {spec_}", cascade_fn(spec_, "tr", shape["page_size"], shape["num_kv_heads"], "prefix"))
    for spec_ in ("tr", "mo"):
      time(f"suffix pass {spec_}", cascade_fn("tr", spec_, shape["page_size"], shape["num_kv_heads"], "suffix"))
    time("neither pass (gathers, merge)", cascade_fn("tr", "tr", shape["page_size"], shape["num_kv_heads"], "none"))
  return rows


def main(argv):
  del argv
  if jax.default_backend() != "gpu":
    raise app.UsageError("tools.shared_prefix_passes times the kernel backends: run it on a GPU")
  rows = [row for i, spec in enumerate(_CASES.value) for row in run_case(spec, i == 0, bench.GQA, _ITERS.value)]
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
