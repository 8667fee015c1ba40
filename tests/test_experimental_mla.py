"""The MLA kernel's experimental schedules (`pallas_kv.experimental.MLAVariantConfig`, run by
`experimental.mla_schedules` behind `mla_config.variant_schedule`): pipeline_qk, split_scores, rows_as_n,
alternate_scores, ring_halves, P V staged in SMEM (p_in_registers=False), and the kernel's non-default
Codegen options. Numerics in GPU interpret mode, garbage past lengths, race detection, their checks,
CUDA lowering and the GPU run; the shipped schedule is tested in test_mosaic_gpu_mla.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kv as pkv
from pallas_kv.experimental import MLAVariantConfig
from pallas_kv.experimental import mla_schedules
from pallas_kv.kernels.mosaic_gpu import mla_config
from test_mosaic_gpu_mla import GPU_SHAPES, IMPL, LOWERING_SHAPES, QK, SMALL_V, V
from test_mosaic_gpu_mla import _case, _check, _poisoned, _shape_id, config, gpu_case, lower_mla
from test_mosaic_gpu_mla import benchmark_launches, lower_benchmark_launch, race_case, race_check

pytestmark = pytest.mark.experimental

# pipeline_qk with the 32-token tiles and four stages it needs; split_scores; rows_as_n (transposed
# tiles: the q rows are wgmma's N); alternate_scores (the consumers score alternate tiles);
# ring_halves (the plain schedule on slots loaded and freed in two column parts); and the plain
# schedule with P V staged in SMEM.
VARIANTS = {"pipeline_qk": dict(pipeline_qk=True, block_kv=32, num_stages=4),
            "split_scores": dict(split_scores=True), "rows_as_n": dict(rows_as_n=True),
            "alternate_scores": dict(alternate_scores=True), "ring_halves": dict(ring_halves=True),
            "alternate_halves": dict(alternate_scores=True, ring_halves=True),
            "smem_p": dict(p_in_registers=False)}


def variant(name, num_splits=1, **fields) -> MLAVariantConfig:
  """A complete variant config: BASE's fields with the variant's."""
  return config(num_splits, MLAVariantConfig, **(VARIANTS[name] | fields))


# ---------------------------------------------------------------- interpret mode (CPU)

# GPU interpret mode stages P in SMEM for every schedule, so "smem_p" is the shipped schedule's run
# there (test_mosaic_gpu_mla.py); its own check is CUDA lowering.
@pytest.mark.parametrize("page_size,num_queries,num_heads,num_splits,dtype,name", [
    (16, 1, 24, 1, jnp.bfloat16, "pipeline_qk"),
    (128, 3, 24, 1, jnp.float16, "split_scores"),
    (64, 4, 16, 3, jnp.float16, "rows_as_n"),
    (16, 2, 4, 3, jnp.bfloat16, "alternate_scores"),
    (128, 3, 24, 2, jnp.float16, "ring_halves"),
    (32, 3, 24, 2, jnp.bfloat16, "alternate_halves"),
], ids=["page16-pipeline_qk-splits1", "page128-s3-rowblocks2-split_scores-fp16", "page64-s4-h16-rows_as_n-splits3-fp16",
        "page16-s2-alternate-splits3", "page128-s3-rowblocks2-ring_halves-splits2-fp16",
        "page32-s3-rowblocks2-alternate_halves-splits2"])
def test_mla_variants_interpret(interpret_mode, page_size, num_queries, num_heads, num_splits, dtype, name):
  # Ragged lengths (not multiples of a tile), one of zero, shuffled pages; 3 x 24 heads = 72 rows
  # take two row blocks.
  args = _case(page_size + num_heads, batch=3, seq_len=256, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=[219, 0, 70], dtype=dtype)
  out = pkv.mla_decode_attention(*args, v_head_dim=SMALL_V, scale=0.11, return_lse=True, impl=IMPL,
                                 config=variant(name, num_splits))
  _check(args, out, scale=0.11)


@pytest.mark.parametrize("page_size,name", [(64, "pipeline_qk"), (32, "split_scores"), (16, "rows_as_n"),
                                            (64, "alternate_scores"), (32, "ring_halves")])
def test_mla_variants_keep_garbage_past_lengths_and_in_unnamed_pages_out(interpret_mode, page_size, name):
  q, pages, tables, lengths = _case(3, batch=3, seq_len=256, num_heads=4, num_queries=2, page_size=page_size,
                                    lengths=[200, 37, 0])
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, page_size)
  out = pkv.mla_decode_attention(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths, v_head_dim=SMALL_V,
                                 return_lse=True, impl=IMPL, config=variant(name, 2))
  _check((q, pages, tables, lengths), out)


# Each schedule; Q's descriptors held (Codegen.q_per_tile=False) on the plain schedule; the
# alternate scorers with both Codegen options.
@pytest.mark.parametrize("name,codegen", [(v, {}) for v in VARIANTS if v != "smem_p"] + [
    (None, dict(q_per_tile=False)), ("alternate_scores", dict(q_per_tile=False, slots_per_tile=True))])
def test_mla_variants_race_detection_finds_none(name, codegen):
  race_check(race_case(), config() if name is None else variant(name), codegen=mla_config.Codegen(**codegen))


# ---------------------------------------------------------------- configs

def test_mla_variant_configs_are_checked():
  check = functools.partial(mla_config.check_config, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64)
  check(variant("pipeline_qk"))   # 32-token tiles: four stages fit where 64-token ones take two
  with pytest.raises(ValueError, match="split_scores and rows_as_n take block_kv=64"):
    check(variant("split_scores", block_kv=32, num_stages=4))
  with pytest.raises(ValueError, match="pipeline_qk or split_scores, not both"):
    check(variant("split_scores", pipeline_qk=True))
  rows_as_n = variant("rows_as_n")
  check(rows_as_n, rows=64)
  with pytest.raises(ValueError, match="rows_as_n needs at most 64 packed q rows"):
    check(rows_as_n, rows=128)
  with pytest.raises(ValueError, match="rows_as_n without pipeline_qk or split_scores"):
    check(dataclasses.replace(rows_as_n, split_scores=True), rows=16)
  for field in ("rows_as_n", "split_scores", "alternate_scores", "ring_halves", "pipeline_qk", "p_in_registers"):
    with pytest.raises(ValueError, match=f"{field}=1 must be a bool"):
      MLAVariantConfig(**{field: 1})
  alternate = variant("alternate_scores")
  check(alternate)
  assert mla_config.MlaSmem.for_call(alternate, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64).fits
  with pytest.raises(ValueError, match="alternate_scores takes block_kv=64 and none of pipeline_qk"):
    check(dataclasses.replace(alternate, split_scores=True))
  with pytest.raises(ValueError, match="alternate_scores takes block_kv=64"):
    check(dataclasses.replace(alternate, block_kv=32, num_stages=4))
  halves = variant("ring_halves")
  check(halves)
  assert mla_config.MlaSmem.for_call(halves, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64).fits
  check(dataclasses.replace(halves, alternate_scores=True, p_in_registers=False))
  for other in (dict(split_scores=True), dict(rows_as_n=True)):
    with pytest.raises(ValueError, match="ring_halves takes the plain scorer schedule or alternate_scores"):
      check(dataclasses.replace(halves, p_in_registers=False, **other))
  # p_in_registers: None is on for the plain scorer schedule and off for the others; on, it takes
  # the plain scorer alone.
  assert variant("ring_halves").p_in_registers and not variant("smem_p").p_in_registers
  for name in ("pipeline_qk", "split_scores", "rows_as_n", "alternate_scores"):
    assert not variant(name).p_in_registers, name
    with pytest.raises(ValueError, match="p_in_registers takes the plain scorer schedule"):
      check(variant(name, p_in_registers=True))
  assert mla_config.variant_schedule(variant("smem_p")) == mla_schedules.Schedule(p_in_registers=False)
  assert mla_config.variant_schedule(alternate) == mla_schedules.Schedule(alternate_scores=True, p_in_registers=False)
  assert mla_config.variant_schedule(MLAVariantConfig()) is None   # the fields of the shipped schedule
  # The split-scores layout has the same SMEM footprint (P in two halves), so it fits as well.
  assert mla_config.MlaSmem.for_call(variant("split_scores"), qk_dim=QK, v_dim=V, dtype=jnp.bfloat16,
                                     page_size=64).fits
  # A partial variant config is filled around its fields and keeps its type.
  _, problem = _problem_of(LOWERING_SHAPES[0])
  resolved = mla_config.resolve_config(problem, MLAVariantConfig(split_scores=True), num_sms=132)
  assert isinstance(resolved, MLAVariantConfig) and resolved.complete and resolved.split_scores


def _problem_of(shape):
  from test_mosaic_gpu_mla import _problem
  return _problem(**shape)


# ---------------------------------------------------------------- CUDA lowering (CPU)

# Each schedule at B8 with pages of 16 (four copies per tile, 4 new tokens: 512 rows); rows as N at
# most 64 rows, with pages of 16 and fp16.
@pytest.mark.parametrize("name,shape", [
    (name, LOWERING_SHAPES[6]) for name in ("pipeline_qk", "split_scores", "alternate_scores", "ring_halves",
                                            "alternate_halves", "smem_p")] + [
    ("rows_as_n", dict(batch=8, seq_len=4096, num_heads=32, num_queries=2, page_size=16, dtype=jnp.float16))],
    ids=lambda v: _shape_id(v) if isinstance(v, dict) else v)
def test_mla_variants_lower_for_cuda(name, shape):
  module, resolved = lower_mla(shape, MLAVariantConfig(**VARIANTS[name]))
  assert isinstance(resolved, MLAVariantConfig)
  assert ("_regp" in module) == resolved.p_in_registers


# The ring halves with P from registers, in fp16.
def test_mla_ring_halves_with_p_in_registers_lowers_for_cuda():
  module, _ = lower_mla(dict(LOWERING_SHAPES[6], dtype=jnp.float16), MLAVariantConfig(ring_halves=True))
  assert "_ringhalves_regp" in module


# ---------------------------------------------------------------- the benchmark's kernel launches

def test_mla_variant_kernel_launches_match_the_baseline_in_interpret_mode():
  """benchmarks.mla's launches under the alternate scorers and the ring halves match the bf16 baseline."""
  from benchmarks import cases as bench_cases
  baseline, outs = benchmark_launches(("kernel_alt", "kernel_rh"))
  for impl, out in outs.items():
    assert bench_cases.relative_error(out, baseline) < 1e-2, impl


# Every probe stage, schedule and Codegen option at least once with the shipped schedule's
# (test_mosaic_gpu_mla.py); each lowering takes 5-9 s on 2 cores.
@pytest.mark.parametrize("impl", ["kernel_rh_no_qk", "kernel_smemp_no_pv", "kernel_heldq_no_softmax",
                                  "kernel_r232_loads_only", "kernel_alt_no_loads", "kernel_altrh_spt"])
def test_mla_kernel_launch_variants_and_probes_lower_for_cuda(impl):
  lower_benchmark_launch(impl)


def test_mla_late_waits_probe_refuses_other_schedules():
  from benchmarks import mla as mla_bench
  from harness import lower_for_cuda
  row = mla_bench.ALL_ROWS["h128_b64_t4096"]
  args, _ = _problem_of(dict(batch=row.batch, seq_len=row.seq_len, num_heads=row.num_heads))
  with pytest.raises(ValueError, match="moves the slot waits .* probes the plain scorer schedule only"):
    lower_for_cuda(mla_bench.build_fn("kernel_rh_late_waits", row), *args)


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries,page_size", GPU_SHAPES)
def test_gpu_mla_variants_match_reference(batch, seq_len, num_heads, num_queries, page_size):
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  args, bad_pages, bad_tables = gpu_case(batch, seq_len, num_heads, num_queries, page_size)
  q, _, _, lengths = args
  few_rows = num_heads * (num_queries or 1) <= mla_config.ROWS_AS_N_MAX
  for name in VARIANTS:
    if name == "rows_as_n" and not few_rows:
      continue
    for fields in (dict(), dict(split_plan="balanced", sequence_order="long_short")) if name == "smem_p" else (dict(),):
      given = MLAVariantConfig(**(VARIANTS[name] | fields))
      out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True, impl=IMPL,
                                      config=given))(q, bad_pages, bad_tables, lengths)
      _check(args, out, v_head_dim=V)
