"""The Mosaic GPU decode kernel: interpret-mode numerics on the CPU, CUDA lowering, GPU runs."""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kv as pkv
from pallas_kv import heuristics
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from harness import (BENCH_CASES, BENCH_HEADS, bench_problem, check_against_reference,
                     lower_for_cuda, make_case, shipped_tuned_h200_configs)

IMPL = "mosaic_gpu"


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("group,num_queries,num_splits", [
    (1, None, 1), (4, None, 3), (8, 2, 2), (4, 3, 1),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dense_interpret(interpret_mode, group, num_queries, num_splits, dtype):
  case = make_case(group * 10 + num_splits, batch=3, seq_len=320, num_heads=2 * group, num_kv_heads=2,
                   head_dim=64, num_queries=num_queries, dtype=dtype, lengths=[320, 147, 0])
  config = pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=num_splits)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config)
  check_against_reference(case, out)


@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_paged_interpret_shuffled(interpret_mode, page_size):
  case = make_case(page_size, batch=2, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=[201, 256])
  config = pkv.DecodeConfig(block_kv=64, num_stages=3, num_splits=2)
  out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                   return_lse=True, impl=IMPL, config=config)
  check_against_reference(case, out)


def test_options_interpret(interpret_mode):
  case = make_case(5, batch=2, seq_len=320, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, lengths=[320, 95])
  kw = dict(softcap=1.5, window=100, sinks=jnp.linspace(-1.0, 2.0, 8), scale=0.2)
  config = pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=3)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config,
                             **kw)
  check_against_reference(case, out, **kw)


def test_race_detection_finds_none():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  case = make_case(9, batch=1, seq_len=192, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[180])
  q = case.q.reshape(1, 1, 4, 64)
  out, lse = mgpu_decode.decode_partials(q, case.k, case.v, case.lengths, num_queries=1, num_splits=2, block_kv=64,
                                         num_stages=2, scale=0.125,
                                         interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  # No public accessor exists for the interpreter's race state in jax 0.11.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found


# ---------------------------------------------------------------- CUDA lowering (CPU)

# The benchmark shapes: (heads, kv heads) x (batch, context) x (contiguous, page 16, page 64).
def _shipped_configs():
  """Every distinct (problem shape, config) the heuristic returns for the benchmark shapes."""
  cases = []
  for heads in BENCH_HEADS:
    for case in BENCH_CASES:
      for page_size in (None, 16, 64):
        args, problem = bench_problem(heads, case, page_size)
        config = heuristics.mosaic_gpu_config(problem, None, num_sms=132)
        cases.append(pytest.param(heads, case, page_size, config,
                                  id=f"h{heads[0]}-{heads[1]}-b{case[0]}-t{case[1]}-page{page_size}"))
  return cases


@pytest.mark.parametrize("heads,case,page_size,config", _shipped_configs())
def test_heuristic_configs_lower_for_cuda(heads, case, page_size, config):
  args, _ = bench_problem(heads, case, page_size)
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  exported = lower_for_cuda(functools.partial(op, impl=IMPL, config=config), *args)
  module = exported.mlir_module()
  assert "custom_call @mosaic_gpu" in module and "pallas_kv_decode" in module  # our kernel, not a fallback


@pytest.mark.parametrize("num_queries,head_dim,group", [(4, 128, 8), (1, 64, 16), (1, 256, 4), (16, 128, 4)])
def test_other_shapes_lower_for_cuda(num_queries, head_dim, group):
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  lower_for_cuda(functools.partial(pkv.decode_attention, impl=IMPL, softcap=30.0, window=1024,
                                   sinks=jnp.zeros((2 * group,))), q, kv, kv, lengths)


@pytest.mark.gpu
def test_gpu_auto_picks_mosaic_on_hopper():
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  case = make_case(5, batch=2, seq_len=1024, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
  pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == IMPL


# ---------------------------------------------------------------- opt-in pipeline variants

def _partials_case(case, **kw):
  """decode_partials + combine for a [B, Hq, D] case (dense, or paged when case.page_size)."""
  from pallas_kv import combine
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows = combine.pack_queries(case.q[:, None], case.k.shape[2])
  args = ((rows, case.k_pages, case.v_pages, case.lengths, case.block_tables) if case.page_size
          else (rows, case.k, case.v, case.lengths))
  out, lse = mgpu_decode.decode_partials(*args, num_queries=1, scale=case.q.shape[-1] ** -0.5,
                                         interpret=plgpu.InterpretGPUParams(), **kw)
  out, lse = combine.merge_splits(out, lse)
  return combine.unpack_rows(out, 1)[:, 0].astype(case.q.dtype), combine.unpack_rows(lse, 1)[:, 0]


@pytest.mark.parametrize("page_size,options", [
    (None, dict(pipeline_qk=True, num_splits=3)),
    (None, dict(pipeline_qk=True, persistent_programs=4, num_splits=2)),
    (16, dict(persistent_programs=3, num_splits=2)),
    (64, dict(pipeline_qk=True, persistent_programs=5, num_splits=1)),
], ids=["pqk-splits3", "pqk-persistent4", "persistent3-page16", "pqk-persistent5-page64"])
def test_pipeline_variants_interpret(page_size, options):
  # Persistent programs fewer than the work items (B x Hkv x splits) so that each loops over several.
  case = make_case(40, batch=3, seq_len=256, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   page_size=page_size, lengths=[201, 0, 256])
  check_against_reference(case, _partials_case(case, block_kv=64, num_stages=2, **options))


def test_variant_configs_through_the_api_interpret(interpret_mode):
  case = make_case(41, batch=2, seq_len=192, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[150, 192])
  for config in (pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=2, pipeline_qk=True, persistent=True),
                 pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=2, kv_groups=2)):
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config)
    check_against_reference(case, out)


def test_variant_options_are_validated():
  with pytest.raises(ValueError, match="kv_groups"):
    pkv.DecodeConfig(kv_groups=3)
  with pytest.raises(ValueError, match="persistent"):
    pkv.DecodeConfig(persistent=True, kv_groups=2)
  with pytest.raises(ValueError, match="pipeline_qk"):
    pkv.DecodeConfig(pipeline_qk=1)
  q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  call = functools.partial(mgpu_decode.decode_partials, q, kv, kv, jnp.array([128], jnp.int32), num_queries=1,
                           num_splits=1, block_kv=64, scale=0.1)
  with pytest.raises(ValueError, match="num_stages"):
    call(num_stages=1, pipeline_qk=True)
  with pytest.raises(ValueError, match="_probe"):
    call(num_stages=2, _probe="no_such_stage")


def _variant_lowering_cases():
  full = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 4096)]
  cases = [(dict(pipeline_qk=True, persistent=True), c, None) for c in full]
  cases += [(dict(pipeline_qk=True, persistent=True), c, 16) for c in [(8, 8192), (128, 4096)]]
  for fields in (dict(pipeline_qk=True), dict(persistent=True), dict(block_kv=128, num_stages=3),
                 dict(kv_groups=2, num_splits=2)):
    cases += [(fields, (128, 4096), None), (fields, (8, 8192), 16)]
  return [pytest.param(f, c, p, id="-".join(f"{k}={v}" for k, v in f.items()) + f"-b{c[0]}-t{c[1]}-page{p}")
          for f, c, p in cases]


@pytest.mark.parametrize("fields,case,page_size", _variant_lowering_cases())
def test_variant_configs_lower_for_cuda(fields, case, page_size):
  args, problem = bench_problem((32, 8), case, page_size)
  config = heuristics.mosaic_gpu_config(problem, pkv.DecodeConfig(**fields), num_sms=132)
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  lower_for_cuda(functools.partial(op, impl=IMPL, config=config), *args)


@pytest.mark.parametrize("case,config", shipped_tuned_h200_configs(IMPL))
def test_shipped_tuned_configs_lower_for_cuda(case, config):
  # impl="auto" on an H200 runs these (pallas_kv/tuned/nvidia_h200.json, shipped with the package).
  assert config is not None, "the package's H200 tuned file has no entry for a shape it was tuned on"
  args, problem = bench_problem((32, 8), case, None)
  config = heuristics.mosaic_gpu_config(problem, config, num_sms=132)
  lower_for_cuda(functools.partial(pkv.decode_attention, impl=IMPL, config=config), *args)


@pytest.mark.parametrize("probe", mgpu_decode.PROBES)
def test_probes_lower_for_cuda(probe):
  # Measurement-only kernels (benchmarks/kernel_variants.py); their results are wrong by design.
  q = jax.ShapeDtypeStruct((128, 8, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((128, 4096, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((128,), jnp.int32)
  lower_for_cuda(functools.partial(mgpu_decode.decode_partials, num_queries=1, num_splits=1, block_kv=64,
                                   num_stages=4, scale=0.1, _probe=probe), q, kv, kv, lengths)


def _load_path_cases():
  from benchmarks import kernel_variants
  return [pytest.param(fields, id=name) for name, fields in kernel_variants.LOAD_PATH.items()]


@pytest.mark.parametrize("fields", _load_path_cases())
@pytest.mark.parametrize("probe", ["loads_only", None])
def test_load_path_rings_lower_for_cuda(fields, probe):
  # benchmarks/kernel_variants.py --load_path times these rings with no math (probe) on the H200;
  # the full kernel (probe None) must lower with each too, so that a faster ring can ship.
  from benchmarks import kernel_variants
  args, problem = bench_problem((32, 8), (128, 4096), None)
  config = heuristics.mosaic_gpu_config(problem, pkv.DecodeConfig(**fields), num_sms=132)
  lower_for_cuda(kernel_variants._kernel_fn(config, problem, paged=False, probe=probe), *args)
