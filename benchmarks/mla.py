r"""MLA decode benchmark (DeepSeek-V3 absorbed form: latent 512 + rope 64, paged, bf16 or fp8).

Usage (from the repository root):

  python -m benchmarks mla                        # GPU: every row below; CPU: one tiny row
  python -m benchmarks mla --rows=h128_b64_t4096,h16_b64_t8192 --json=/tmp/mla.json
  python -m benchmarks mla --kv_dtype=float8_e4m3fn --impl=mosaic_gpu,xla   # an fp8 pool, a scale per token
  python -m benchmarks mla --impl=mosaic_gpu,bf16_einsum --iters=50

Rows (page 64, shuffled pages): 128 heads at (B, T) = (1, 32768), (16, 4096), (64, 4096),
(128, 8192), and ragged lengths (uniform in [1, 8192], mean ~4096) at B=128; 16 heads at
(64, 8192); two new tokens (S=2) at (64, 4096).

Impls: `mosaic_gpu` (our kernel), `mosaic_gpu_pqk` (the same with the experimental
`MLAVariantConfig(pipeline_qk=True)` on 32-token tiles in four stages: the next tile's Q K^T
overlaps this tile's softmax), `mosaic_gpu_bkv32` (the plain schedule on those tiles),
`mosaic_gpu_halves` (`MLAVariantConfig(split_scores=True)`: both consumers score half of each tile),
`mosaic_gpu_alt` (`MLAVariantConfig(alternate_scores=True)`: they score alternate tiles),
`mosaic_gpu_lf` / `mosaic_gpu_balanced_lf` (`MosaicMLAConfig(sequence_order="longest_first")`,
per-sequence or balanced splits: programs take the longest sequences first; `mosaic_gpu` itself
does where its programs make more than one wave), `mosaic_gpu_rh` (`MLAVariantConfig(ring_halves=True)`:
ring slots loaded and freed in two column parts), `mosaic_gpu_smemp` (`MLAVariantConfig(p_in_registers=
False)`: the scorer's P V from SMEM, the default before the twelfth set), `mosaic_gpu_sp<N>` (N splits
per sequence instead of the heuristic's count, e.g. `mosaic_gpu_sp33`). Each is a partial config
(`pallas_kv.MosaicMLAConfig`, or `pallas_kv.experimental.MLAVariantConfig` where it names another
schedule) fixing 64-token tiles in two stages (the heuristic's at Dqk 576) and its own fields; the
backend fills the rest. `kernel` (the kernel's launch alone, one split, no
merge) and its probes `kernel_no_qk`, `kernel_no_softmax`, `kernel_no_pv`, `kernel_loads_only`,
`kernel_no_loads` (the same launch with those stages left out: the TMA ring and the P hand-over
still run, and without loads the producer marks each slot full as it frees), `kernel_late_waits`
(the loads run, but the consumers compute on each slot before its copy lands and wait for it only
before releasing it: the loads' SMEM traffic without their waits; plain schedule only),
`kernel_one_loader` (only row block 0 loads its tiles: half the L2-to-SM traffic at 128 heads, a
bound on what multicasting each tile to both row blocks could save; results
wrong by design, so they are not checked; they tell where a tile's time goes),
`kernel_sp<N>_mosaic_merge` / `kernel_sp<N>_triton_merge` (the launch with N splits, then the
Mosaic GPU merge overlapped with the kernel's last wave, or the Triton merge the op runs, a plain
second launch), `auto` (what `impl="auto"` picks), `xla`
(pallas_kv's pure XLA impl), and `bf16_einsum` (written here: XLA einsums over the gathered pages with bf16 operands and
float32 accumulation, the plain-JAX baseline). Every impl's output of a row is first checked
against bf16_einsum's (relative error ||out - ref|| / ||ref||, at most 1e-2 for ours), then
timed with the chain-difference timer (benchmarks/timing.py; inputs rotate past L2). A table of
us, TFLOP/s, TB/s of KV read and % of the H200 roofline max(bytes / 4.5 TB/s, flops / 790
TFLOP/s) / time is printed last. Exit status 1 if one of ours raised (other than
NotImplementedError) or failed the check.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import cli
from benchmarks import output
from benchmarks import peers
from benchmarks import timing

PAGE_SIZE = 64
BASELINE = "bf16_einsum"
# Our kernel with its opt-in schedule: the scorer issues the next tile's Q K^T before this tile's
# softmax (kernels/mosaic_gpu/mla.py, MLAVariantConfig.pipeline_qk), on 32-token tiles in four stages
# (it holds two tiles, and a third must be loading) ...
PIPELINED = "mosaic_gpu_pqk"
# ... and the plain schedule on those tiles, to tell the tiles' cost from the schedule's gain.
TILES_32 = "mosaic_gpu_bkv32"
# ... or both consumers score half of each tile and trade row maxima and P (MLAVariantConfig.split_scores).
HALVES = "mosaic_gpu_halves"
# ... or splits balanced by tokens across a ragged batch (MosaicMLAConfig.split_plan="balanced").
BALANCED = "mosaic_gpu_balanced"
# ... or the programs take the sequences longest first (MosaicMLAConfig.sequence_order), per-sequence
# or balanced splits.
LONGEST_FIRST = "mosaic_gpu_lf"
BALANCED_LONGEST_FIRST = "mosaic_gpu_balanced_lf"
# ... or the q rows as wgmma's N, for few heads (MLAVariantConfig.rows_as_n; at most 64 rows).
ROWS_AS_N = "mosaic_gpu_rows_as_n"
# ... or the two consumers score alternate tiles (MLAVariantConfig.alternate_scores), also with ring halves.
ALTERNATE = "mosaic_gpu_alt"
ALTERNATE_HALVES = "mosaic_gpu_alt_rh"
# ... or ring slots loaded and freed in two column parts (MLAVariantConfig.ring_halves).
RING_HALVES = "mosaic_gpu_rh"
# ... or the scorer's P V with P from SMEM (MLAVariantConfig.p_in_registers=False; the default before).
P_IN_SMEM = "mosaic_gpu_smemp"
# Every variant is the heuristic's config (mla_config.heuristic_config at Dqk 576) with its fields
# changed; the consumer schedules other than the plain scorer take P from SMEM (MLAVariantConfig's
# p_in_registers None: on for the plain scorer, off for the others).
DEFAULT_FIELDS = dict(block_kv=64, num_stages=2)
# ... and what the kernel-level impls below add to make it complete: one plan of their own.
PLAN_FIELDS = dict(split_plan="per_sequence", sequence_order="given")
SMEM_P = dict(p_in_registers=False)
VARIANTS = {PIPELINED: SMEM_P | dict(pipeline_qk=True, block_kv=32, num_stages=4),
            TILES_32: SMEM_P | dict(block_kv=32, num_stages=4), HALVES: SMEM_P | dict(split_scores=True),
            BALANCED: dict(split_plan="balanced"), LONGEST_FIRST: dict(sequence_order="longest_first"),
            BALANCED_LONGEST_FIRST: dict(split_plan="balanced", sequence_order="longest_first"),
            ROWS_AS_N: SMEM_P | dict(rows_as_n=True),
            ALTERNATE: SMEM_P | dict(alternate_scores=True),
            ALTERNATE_HALVES: SMEM_P | dict(alternate_scores=True, ring_halves=True), RING_HALVES: dict(ring_halves=True), P_IN_SMEM: SMEM_P}
# ... or a fixed split count: mosaic_gpu_sp<N> (e.g. mosaic_gpu_sp33), the heuristic's schedule.
FIXED_SPLITS = re.compile(r"mosaic_gpu_sp([1-9][0-9]*)")
# The kernel's launch alone with one split (no merge), under the default schedule or another
# (`kernel_smemp`, `kernel_alt`, `kernel_rh`), compiled as by default or otherwise
# (`mla_config.Codegen`, whose default is producer 24 / consumers 240 registers with Q's wgmma
# descriptors rebuilt every tile: `_r232` the split 40 / 232, `_heldq` Q's descriptors held across
# the loop, `_r232_heldq` both, the default before the thirteenth set), and probes of each that
# leave stages of the tile's math or the loads out (MEASUREMENT ONLY: their outputs are wrong by
# design and go unchecked), e.g. `kernel_no_qk`, `kernel_alt_r232_no_loads`.
KERNEL = "kernel"
KERNEL_SCHEDULES = {"": {}, "_smemp": VARIANTS[P_IN_SMEM], "_alt": VARIANTS[ALTERNATE],
                    "_altrh": VARIANTS[ALTERNATE_HALVES], "_rh": VARIANTS[RING_HALVES]}
# Codegen's fields changed from its default (registers as (producer, consumer)); `_spt` the
# ring's slots made opaque per tile (Codegen.slots_per_tile, read by the alternate scorers); `_eb` no automatic
# barrier around each SMEM store (Codegen.explicit_barriers; the shipped schedule only).
KERNEL_CODEGEN = {"": {}, "_r232": dict(registers=(40, 232)), "_heldq": dict(q_per_tile=False),
                  "_r232_heldq": dict(registers=(40, 232), q_per_tile=False), "_spt": dict(slots_per_tile=True),
                  "_eb": dict(explicit_barriers=True)}
PROBE_STAGES = {"_no_qk": frozenset({"qk"}), "_no_softmax": frozenset({"softmax"}), "_no_pv": frozenset({"pv"}),
                "_loads_only": frozenset({"qk", "softmax", "pv"}), "_no_loads": frozenset({"loads"}),
                "_late_waits": frozenset({"waits"}), "_one_loader": frozenset({"second_loads"})}
KERNEL_IMPLS = {f"{KERNEL}{schedule}{option}{probe}": (fields, skip, codegen)
                for schedule, fields in KERNEL_SCHEDULES.items() for option, codegen in KERNEL_CODEGEN.items()
                for probe, skip in {"": frozenset(), **PROBE_STAGES}.items()}
PROBES = tuple(name for name, (_, skip, _) in KERNEL_IMPLS.items() if skip)
# The default kernel with N splits and then a split merge: the Mosaic GPU launch that overlaps
# the kernel's last wave (pallas_kv/experimental/mosaic_merge.py) or the op's, the Triton merge kernel as a
# plain second launch, e.g. kernel_sp64_mosaic_merge beside kernel_sp64_triton_merge.
MERGED_SPLITS = re.compile(r"kernel_sp([1-9][0-9]*)_(mosaic|triton)_merge")
GPU_IMPLS = ("mosaic_gpu", RING_HALVES, BASELINE, "xla")
CPU_IMPLS = ("auto", "xla", BASELINE)
OUR_IMPLS = peers.OUR_IMPLS + tuple(VARIANTS) + tuple(name for name in KERNEL_IMPLS if name not in PROBES)


@dataclasses.dataclass(frozen=True)
class Row:
  """One benchmark row: heads, batch, capacity T, new tokens, ragged lengths, latent dims."""
  name: str
  num_heads: int
  batch: int
  seq_len: int
  num_queries: int = 1
  ragged: bool = False
  qk_dim: int = cases.MLA_QK_DIM
  v_dim: int = cases.MLA_V_DIM

  def case(self, dtype: str = "bfloat16", kv_dtype: str | None = None) -> cases.Case:
    sweep = cases.Sweep(op="mla", impls=(OUR_IMPLS[0],), cases=((self.batch, self.seq_len),),
                        num_heads=self.num_heads, num_queries=self.num_queries, page_size=PAGE_SIZE,
                        ragged=self.ragged, dtype=dtype, mla_qk_dim=self.qk_dim, mla_v_dim=self.v_dim,
                        kv_dtype=kv_dtype)
    return cases.Case.from_sweep(sweep, self.batch, self.seq_len)


GPU_ROWS = (
    Row("h128_b1_t32768", 128, 1, 32768),
    Row("h128_b16_t4096", 128, 16, 4096),
    Row("h128_b64_t4096", 128, 64, 4096),
    Row("h128_b128_t8192", 128, 128, 8192),
    Row("h128_b128_ragged4096", 128, 128, 8192, ragged=True),
    Row("h16_b64_t8192", 16, 64, 8192),
    Row("h128_s2_b64_t4096", 128, 64, 4096, num_queries=2),
)


def cpu_rows() -> tuple[Row, ...]:
  """One tiny row with small latent dims (the CPU default and the test's)."""
  return (Row("tiny_cpu", 4, 2, 128, num_queries=2, qk_dim=192, v_dim=128),)


# ---------------------------------------------------------------- the bf16 XLA baseline

def bf16_einsum(q, kv_pages, block_tables, lengths, *, v_head_dim: int, scale: float):
  """MLA decode as XLA einsums: bf16 operands, float32 accumulation and softmax.

  q [B, (S,) Hq, Dqk]; kv_pages [P, page_size, Dqk]; the S new tokens are the last S of
  lengths[b]. Values past a length are zeroed (with the gather) so that stale memory cannot
  reach the output.
  """
  single = q.ndim == 3
  q4 = q[:, None] if single else q
  b, s = q4.shape[:2]
  kv = kv_pages[block_tables].reshape(b, -1, kv_pages.shape[-1])      # [B, T, Dqk]
  t = jnp.arange(kv.shape[1], dtype=jnp.int32)
  kv = jnp.where((t[None, :] < lengths[:, None])[..., None], kv, jnp.zeros((), kv.dtype))
  logits = jnp.einsum("bshd,btd->bsht", q4.astype(kv.dtype), kv, preferred_element_type=jnp.float32) * scale
  position = lengths[:, None] - s + jnp.arange(s, dtype=jnp.int32)[None, :]   # [B, S]
  visible = t[None, None, :] <= position[:, :, None]                          # [B, S, T]
  logits = jnp.where(visible[:, :, None, :], logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bsht,btd->bshd", p.astype(kv.dtype), kv[..., :v_head_dim], preferred_element_type=jnp.float32)
  out = (out / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)
  return out[:, 0] if single else out


def is_ours(impl: str) -> bool:
  """Ours and checked against the baseline (the probes are neither)."""
  return impl in OUR_IMPLS or any(p.fullmatch(impl) is not None for p in (FIXED_SPLITS, MERGED_SPLITS))


def is_probe(impl: str) -> bool:
  return impl in PROBES


def probe_math(impl: str):
  """The kernel's TileMath for a kernel impl that leaves nothing out, else a subclass that leaves
  impl's stages out."""
  from jax.experimental import pallas as pl   # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu   # pylint: disable=g-import-not-at-top
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla   # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass(frozen=True)
  class ProbeMath(mgpu_mla.TileMath):
    """MEASUREMENT ONLY: Q K^T, the softmax (P = the raw scores, alpha = 1), P V, the loads or the
    second row block's loads left out."""
    skip: frozenset = frozenset()

    def load_tile(self, load, unloaded, row_block):
      if "loads" in self.skip:
        unloaded()
      elif "second_loads" in self.skip:
        pl.when(row_block == 0)(load)
        pl.when(row_block != 0)(unloaded)
      else:
        load()

    def qk(self, s_ref, q_tile, k_tile):
      if "qk" not in self.skip:
        super().qk(s_ref, q_tile, k_tile)

    def pv(self, acc_ref, p_tile, v_tile):
      if "pv" not in self.skip:
        super().pv(acc_ref, p_tile, v_tile)

    def softmax(self, s, m_i, l_i, *, st, **where):
      if "softmax" not in self.skip:
        return super().softmax(s, m_i, l_i, st=st, **where)
      layout = plgpu.Layout.WGMMA.reduce(0 if st.rows_as_n else 1)
      return plgpu.layout_cast(jnp.ones(m_i.shape, jnp.float32), layout), m_i, l_i, s

  class LateWaits(ProbeMath):
    """MEASUREMENT ONLY: the consumers compute on a slot before its copy lands and wait for it only to
    release it (the plain scorer's schedules)."""

    def read_slot(self, ring, step):
      return ring.slot(step)

    def release_slot(self, ring, step):
      ring.wait(step)
      super().release_slot(ring, step)

  _, skip, _ = KERNEL_IMPLS[impl]
  if not skip:
    return mgpu_mla.TileMath()
  return (LateWaits if "waits" in skip else ProbeMath)(name=impl, skip=skip)


def config_of(fields: dict[str, Any]):
  """The MLA config of these fields: `pallas_kv.MosaicMLAConfig`, or the experimental
  `MLAVariantConfig` where they name another consumer schedule."""
  pkv = peers.import_pallas_kv()
  from pallas_kv import experimental   # pylint: disable=g-import-not-at-top
  shipped = {f.name for f in dataclasses.fields(pkv.MosaicMLAConfig)}
  return (pkv.MosaicMLAConfig if set(fields) <= shipped else experimental.MLAVariantConfig)(**fields)


def kernel_config(fields: dict[str, Any], num_splits: int):
  """The complete config of a kernel-level impl and its plan: per-sequence splits in batch order."""
  pkv = peers.import_pallas_kv()
  config = config_of(DEFAULT_FIELDS | PLAN_FIELDS | dict(num_splits=num_splits) | fields)
  return config, pkv.SplitPlan(kind="per_sequence", num_splits=num_splits, block_kv=config.block_kv)


def build_kernel_launch(impl: str, row: "Row", scale: float):
  """The MLA kernel's launch alone (one split, so no merge) under impl's schedule and tile math."""
  from pallas_kv.kernels.mosaic_gpu import backend, mla as mgpu_mla, mla_config   # pylint: disable=g-import-not-at-top
  fields, _, codegen_fields = KERNEL_IMPLS[impl]
  config, plan = kernel_config(fields, 1)
  codegen = mla_config.Codegen(**{name: mla_config.RegisterSplit(*value) if name == "registers" else value
                                  for name, value in codegen_fields.items()})
  math = probe_math(impl)

  def launch(q, kv_pages, block_tables, lengths):
    rows = q.reshape(q.shape[0], -1, q.shape[-1])   # [B, S * Hq, Dqk]: row s * Hq + h
    out, _ = mgpu_mla.mla_partials(rows, kv_pages, lengths, block_tables, num_queries=row.num_queries,
                                   v_head_dim=row.v_dim, scale=scale, config=config, plan=plan, tile_math=math,
                                   codegen=codegen, interpret=backend.interpret_params())
    return out[:, 0].reshape(*q.shape[:-1], row.v_dim)

  return jax.jit(launch)


def build_merged_splits(impl: str, row: "Row", scale: float):
  """The default kernel's launch with a fixed split count, then one of the two split merges: the
  Mosaic GPU merge overlapped with the kernel (`pallas_kv.experimental.mosaic_merge`, which refuses
  with NotImplementedError what its 64-row blocks cannot cover) or the op's Triton merge."""
  from pallas_kv.experimental import mosaic_merge   # pylint: disable=g-import-not-at-top
  from pallas_kv.kernels.mosaic_gpu import backend, mla as mgpu_mla   # pylint: disable=g-import-not-at-top
  splits, which = MERGED_SPLITS.fullmatch(impl).groups()
  config, plan = kernel_config({}, int(splits))
  if which == "mosaic":
    merge = functools.partial(mosaic_merge.merge_partials, interpret=backend.interpret_params())
  else:
    merge = backend.fused_merge()
    if merge is None:
      raise NotImplementedError("the Triton merge is not available (pallas_kv.kernels.triton is gone)")

  def launch(q, kv_pages, block_tables, lengths):
    rows = q.reshape(q.shape[0], -1, q.shape[-1])   # [B, S * Hq, Dqk]: row s * Hq + h
    out, lse = mgpu_mla.mla_partials(rows, kv_pages, lengths, block_tables, num_queries=row.num_queries,
                                     v_head_dim=row.v_dim, scale=scale, config=config, plan=plan,
                                     interpret=backend.interpret_params())
    merged, _ = merge(out[:, None], lse[:, None], None, rows=rows.shape[1], out_dtype=q.dtype, return_lse=False)
    return merged[:, 0].reshape(*q.shape[:-1], row.v_dim)

  return jax.jit(launch)


def variant_fields(impl: str) -> dict | None:
  """The config fields of a Mosaic GPU variant impl, or None for a plain impl."""
  fixed = FIXED_SPLITS.fullmatch(impl)
  return dict(num_splits=int(fixed.group(1))) if fixed else VARIANTS.get(impl)


def build_fn(impl: str, row: Row, quantized: bool = False):
  """The jitted function of an impl on a row's inputs (q, kv_pages, block_tables, lengths; quantized: and the fp8
  pool's per-token kv_scale, which the baseline widens the pool with)."""
  scale = float(row.qk_dim) ** -0.5
  if quantized and impl == BASELINE:
    widen = lambda pages, kv_scale: (pages.astype(jnp.float32) * kv_scale[..., None]).astype(jnp.bfloat16)
    return jax.jit(lambda q, pages, tables, lengths, kv_scale: bf16_einsum(
        q, widen(pages, kv_scale), tables, lengths, v_head_dim=row.v_dim, scale=scale))
  if quantized and (impl in KERNEL_IMPLS or MERGED_SPLITS.fullmatch(impl)):
    raise NotImplementedError(f"{impl} times bf16 pools; --kv_dtype=float8_e4m3fn runs the op's impls")
  if impl == BASELINE:
    return jax.jit(lambda *a: bf16_einsum(*a, v_head_dim=row.v_dim, scale=scale))
  if impl in KERNEL_IMPLS:
    return build_kernel_launch(impl, row, scale)
  if MERGED_SPLITS.fullmatch(impl):
    return build_merged_splits(impl, row, scale)
  if not is_ours(impl):
    raise ValueError(f"unknown impl {impl!r}; choose from {OUR_IMPLS + PROBES + (BASELINE,)} or "
                     "mosaic_gpu_sp<N>")
  pkv = peers.import_pallas_kv()
  config = None
  fields = variant_fields(impl)
  if fields is not None:
    impl, config = "mosaic_gpu", config_of(DEFAULT_FIELDS | fields)
  return jax.jit(lambda q, pages, tables, lengths, kv_scale=None: pkv.mla_decode_attention(
      q, pages, tables, lengths, v_head_dim=row.v_dim, scale=scale, impl=impl, config=config, kv_scale=kv_scale))


# ---------------------------------------------------------------- one row

def run_row(row: Row, impls: Sequence[str], *, warmup: int, iters: int, repeats: int, rotate_bytes: float,
            seed: int = 0, kv_dtype: str | None = None) -> list[dict[str, Any]]:
  """Checks every impl against the baseline's output, then times it; never raises. kv_dtype float8_e4m3fn: an
  fp8 pool with per-token scales (the baseline reads it widened)."""
  case = row.case(kv_dtype=kv_dtype)
  build = functools.partial(build_fn, quantized=case.quantized)
  key_len, key_in = jax.random.split(jax.random.key(seed))
  lengths = cases.make_lengths(case, key_len)
  costs = case.costs(case.attended_keys(lengths))
  num_sets = timing.num_rotating_sets(case.rotation_bytes(costs["kv_bytes"]), rotate_bytes)
  input_sets = cases.make_input_sets(case, key_in, lengths, num_sets)
  baseline = np.asarray(build(BASELINE, row)(*input_sets[0]), np.float32)
  rows = []
  for impl in impls:
    result: dict[str, Any] = {"row": row.name, "impl": impl, "ours": is_ours(impl), **costs,
                              **dataclasses.asdict(row), "kv_dtype": kv_dtype or "bfloat16"}
    try:
      fn = build(impl, row)
      result["rel_err"] = cases.relative_error(np.asarray(fn(*input_sets[0]), np.float32), baseline)
      if impl == "auto":
        result["auto_choice"] = peers.auto_choice()
      t = timing.time_jax(fn, input_sets, warmup=warmup, iters=iters, repeats=repeats)
    except Exception as e:  # pylint: disable=broad-except
      result.update(status="n/a" if isinstance(e, NotImplementedError) else "error",
                    reason=output.error_reason(e), traceback=traceback.format_exc())
      rows.append(result)
      continue
    roofline_s = max(costs["bytes"] / (cases.PEAK_TBPS * 1e12), costs["flops"] / (cases.PEAK_TFLOPS * 1e12))
    result.update(status="ok", **output.timing_fields(t), tbps=costs["kv_bytes"] / t.median_s / 1e12,
                  tflops=costs["flops"] / t.median_s / 1e12, roofline_pct=100.0 * roofline_s / t.median_s,
                  check_ok=result["rel_err"] <= cases.TOLERANCE["bfloat16"])
    rows.append(result)
  return rows


def format_table(rows: Sequence[dict]) -> str:
  header = (f"{'row':<22} {'impl':<12} {'us':>9} {'TFLOP/s':>8} {'TB/s':>6} {'roofline%':>9} "
            f"{'err vs ' + BASELINE:>20}  note")
  lines = [header, "-" * len(header)]
  for r in rows:
    if r["status"] != "ok":
      lines.append(f"{r['row']:<22} {r['impl']:<12} {r['status']}: {r.get('reason', '')}")
      continue
    note = "probe (unchecked)" if is_probe(r["impl"]) else "" if r["check_ok"] or not r["ours"] else "CHECK FAILED"
    if r.get("auto_choice"):
      note += f" auto->{r['auto_choice']}"
    lines.append(f"{r['row']:<22} {r['impl']:<12} {r['time_us']:>9.1f} {r['tflops']:>8.1f} {r['tbps']:>6.2f} "
                 f"{r['roofline_pct']:>9.1f} {r['rel_err']:>20.2e}  {note.strip()}")
  return "\n".join(lines)


def failed(rows: Sequence[dict]) -> list[dict]:
  """Our rows that raised something other than NotImplementedError or failed the check."""
  return [r for r in rows if r["ours"] and (r["status"] == "error" or (r["status"] == "ok" and not r["check_ok"]))]


def run(rows: Sequence[Row], *, impls: Sequence[str] | None = None, warmup: int = 1, iters: int = 3,
        repeats: int = 3, rotate_bytes: float = 0.0, json_path: str | None = None,
        out: TextIO | None = None, kv_dtype: str | None = None) -> list[dict]:
  """Runs the rows, prints a line per row as it goes and the table last; returns the results."""
  out = sys.stdout if out is None else out
  if impls is None:
    impls = CPU_IMPLS if cases.default_is_cpu() else GPU_IMPLS
  stamp = output.run_stamp()
  print(f"# pallas_kv MLA benchmark  device={stamp['device']}  jax={jax.__version__}  page={PAGE_SIZE}  "
        f"cache={kv_dtype or 'bfloat16'} warmup={warmup} iters={iters} repeats={repeats}", file=out, flush=True)
  results = []
  for row in rows:
    row_results = run_row(row, impls, warmup=warmup, iters=iters, repeats=repeats, rotate_bytes=rotate_bytes,
                          kv_dtype=kv_dtype)
    for r in row_results:
      done = f"{r['time_us']:.1f} us, err {r['rel_err']:.1e}" if r["status"] == "ok" else r["status"]
      print(f"  {row.name} {r['impl']}: {done}", file=out, flush=True)
    results.extend({**r, **stamp} for r in row_results)
    if json_path:   # after every row: a run cut short keeps what it finished
      output.write_json(results, json_path)
  print(file=out)
  print(format_table(results), file=out, flush=True)
  return results


# ---------------------------------------------------------------- the program

ALL_ROWS = {row.name: row for row in GPU_ROWS + cpu_rows()}


def define_flags() -> None:
  flags.DEFINE_list("rows", None, f"Rows to run, from {','.join(ALL_ROWS)}. Default: GPU all but "
                    "tiny_cpu; CPU tiny_cpu.")
  flags.DEFINE_list("impl", None, f"Impls, from {','.join(OUR_IMPLS + PROBES + (BASELINE,))}, or mosaic_gpu_sp<N> "
                    "(N splits fixed), kernel_sp<N>_mosaic_merge, kernel_sp<N>_triton_merge. Default: GPU "
                    f"{','.join(GPU_IMPLS)}; CPU {','.join(CPU_IMPLS)}.")
  flags.DEFINE_float("rotate_bytes", None, "Rotate among input sets until their KV totals this many bytes "
                     "(L2 defeat). Default: GPU 3 x L2, CPU 0.")
  flags.DEFINE_enum("kv_dtype", None, ["bfloat16", "float8_e4m3fn"], "The latent pool's dtype; float8_e4m3fn "
                    "with a scale per token. Default: bfloat16.")
  cli.define_timing_flags({"warmup": "CPU 1, GPU 5", "iters": "CPU 3, GPU 20", "repeats": "CPU 3, GPU 10"})
  cli.define_output_flags(("json",))


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  fv = flags.FLAGS
  cpu = cases.default_is_cpu()
  unknown = [name for name in fv.rows or () if name not in ALL_ROWS]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; choose from {','.join(ALL_ROWS)}")
  rows = [ALL_ROWS[name] for name in fv.rows] if fv.rows else list(cpu_rows() if cpu else GPU_ROWS)
  defaults = dict(warmup=1, iters=3, repeats=3) if cpu else dict(warmup=5, iters=20, repeats=10)
  timing_counts = {**defaults, **cli.timing_flags().given()}
  rotate = fv.rotate_bytes if fv.rotate_bytes is not None else (0.0 if cpu else timing.DEFAULT_ROTATE_BYTES)
  kv_dtype = None if fv.kv_dtype in (None, "bfloat16") else fv.kv_dtype
  results = run(rows, impls=fv.impl, rotate_bytes=rotate, json_path=cli.output_paths().json, kv_dtype=kv_dtype,
                **timing_counts)
  bad = failed(results)
  for r in bad:
    print(f"FAILED: {r['impl']} on {r['row']}: {r.get('reason', 'check against ' + BASELINE)}\n"
          f"{r.get('traceback', '')}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
