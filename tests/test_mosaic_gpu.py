"""What only the Mosaic GPU kernel has: race detection in GPU interpret mode, its opt-in pipeline
variants and their checks, measurement probes, more shapes lowered for CUDA, `auto` on Hopper.
The checks every backend passes are in test_kernels.py."""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kv as pkv
import sweeps
from harness import check_against_reference, lower_for_cuda, make_case
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode

IMPL = "mosaic_gpu"


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("page_size", [None, 16])
def test_race_detection_finds_none(page_size):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  # 7 tiles through a 2-slot ring: every slot is refilled several times.
  case = make_case(9, batch=1, seq_len=448, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[440], page_size=page_size)
  q = case.q.reshape(1, 1, 4, 64)
  args = (case.k, case.v, case.lengths) if page_size is None else (
      case.k_pages, case.v_pages, case.lengths, case.block_tables)
  out, lse = mgpu_decode.decode_partials(q, *args, num_queries=1, options=AttentionOptions(scale=0.125),
                                         config=pkv.DecodeConfig(block_kv=64, num_stages=2, num_splits=1),
                                         interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  # No public accessor exists for the interpreter's race state in jax 0.11.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found


# ---------------------------------------------------------------- CUDA lowering (CPU)

@pytest.mark.parametrize("num_queries,head_dim,group", [(4, 128, 8), (1, 64, 16), (1, 256, 4), (16, 128, 4)])
def test_other_shapes_lower_for_cuda(num_queries, head_dim, group):
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  lower_for_cuda(functools.partial(pkv.decode_attention, impl=IMPL, softcap=30.0, window=1024,
                                   sinks=jnp.zeros((2 * group,))), q, kv, kv, lengths)


@pytest.mark.gpu
def test_gpu_auto_runs_mla_here_and_untuned_gqa_on_triton():
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  # A GQA shape the tuned file does not hold (head_dim 64, 2 kv heads): Triton first (api.KERNEL_IMPLS).
  case = make_case(5, batch=2, seq_len=1000, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == "triton"
  q = jnp.ones((1, 16, 576), jnp.bfloat16)
  pages = jnp.ones((4, 64, 576), jnp.bfloat16)
  pkv.mla_decode_attention(q, pages, jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray([200], jnp.int32),
                           v_head_dim=512)
  assert pkv.last_impl() == IMPL


# ---------------------------------------------------------------- opt-in pipeline variants

def _partials_case(case, config, num_programs=None):
  """decode_partials + the split merge for a [B, Hq, D] case (dense, or paged when case.page_size)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows = split_k.pack_queries(case.q[:, None], case.k.shape[2])
  args = ((rows, case.k_pages, case.v_pages, case.lengths, case.block_tables) if case.page_size
          else (rows, case.k, case.v, case.lengths))
  out, lse = mgpu_decode.decode_partials(*args, num_queries=1, options=AttentionOptions(scale=case.q.shape[-1] ** -0.5),
                                         config=config, num_programs=num_programs,
                                         interpret=plgpu.InterpretGPUParams())
  out, lse = split_k.merge_splits(out, lse)
  return split_k.unpack_rows(out, 1)[:, 0].astype(case.q.dtype), split_k.unpack_rows(lse, 1)[:, 0]


@pytest.mark.parametrize("page_size,fields,num_programs", [
    (None, dict(pipeline_qk=True, num_splits=3), None),
    (None, dict(pipeline_qk=True, persistent=True, num_splits=2), 4),
    (16, dict(persistent=True, num_splits=2), 3),
    (64, dict(pipeline_qk=True, persistent=True, num_splits=1), 5),
], ids=["pqk-splits3", "pqk-persistent4", "persistent3-page16", "pqk-persistent5-page64"])
def test_pipeline_variants_interpret(page_size, fields, num_programs):
  # Persistent programs fewer than the work items (B x Hkv x splits) so that each loops over several.
  case = make_case(40, batch=3, seq_len=256, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   page_size=page_size, lengths=[201, 0, 256])
  config = pkv.DecodeConfig(block_kv=64, num_stages=2, **fields)
  check_against_reference(case, _partials_case(case, config, num_programs))


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
  check = functools.partial(mgpu_config.check_config, head_dim=64, dtype=jnp.bfloat16, page_size=None)
  with pytest.raises(ValueError, match="num_stages"):
    check(pkv.DecodeConfig(num_stages=1, num_splits=1, pipeline_qk=True), rows=4)
  with pytest.raises(NotImplementedError, match="kv_groups=2 needs <= 64 packed rows"):
    check(pkv.DecodeConfig(num_stages=2, num_splits=2, kv_groups=2), rows=65)
  with pytest.raises(ValueError, match="even num_splits"):
    check(pkv.DecodeConfig(num_stages=2, num_splits=3, kv_groups=2), rows=4)
  with pytest.raises(ValueError, match="block_kv=32 must be a multiple of 64"):
    check(pkv.DecodeConfig(block_kv=32, num_splits=1), rows=4)
  with pytest.raises(ValueError, match="SMEM"):
    check(pkv.DecodeConfig(block_kv=256, num_stages=8, num_splits=1), rows=128)
  # decode_partials runs the same checks on the config it is given.
  q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="num_stages"):
    mgpu_decode.decode_partials(q, kv, kv, jnp.array([128], jnp.int32), num_queries=1,
                                options=AttentionOptions(scale=0.1),
                                config=pkv.DecodeConfig(num_stages=1, num_splits=1, pipeline_qk=True))


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
  args, problem = sweeps.problem_args((32, 8), case, page_size)
  config = mgpu_config.resolve_config(problem, pkv.DecodeConfig(**fields), num_sms=132)
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  lower_for_cuda(functools.partial(op, impl=IMPL, config=config), *args)


def _probes():
  from benchmarks import kernel_variants
  return kernel_variants.PROBES


@pytest.mark.parametrize("probe", list(_probes()))
def test_probes_lower_for_cuda(probe):
  # Measurement-only kernels (benchmarks/kernel_variants.py: TileMath subclasses that leave a stage
  # out); their results are wrong by design.
  q = jax.ShapeDtypeStruct((128, 8, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((128, 4096, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((128,), jnp.int32)
  exported = lower_for_cuda(functools.partial(
      mgpu_decode.decode_partials, num_queries=1, options=AttentionOptions(scale=0.1),
      config=pkv.DecodeConfig(block_kv=64, num_stages=4, num_splits=1), tile_math=_probes()[probe]),
      q, kv, kv, lengths)
  assert probe in exported.mlir_module()   # the probe's name is in the kernel's


def _load_path_cases():
  from benchmarks import kernel_variants
  return [pytest.param(fields, id=name) for name, fields in kernel_variants.LOAD_PATH.items()]


@pytest.mark.parametrize("fields", _load_path_cases())
@pytest.mark.parametrize("probe", ["loads_only", None])
def test_load_path_rings_lower_for_cuda(fields, probe):
  # benchmarks/kernel_variants.py --load_path times these rings with no math (probe) on the H200;
  # the full kernel (probe None) must lower with each too, so that a faster ring can ship.
  from benchmarks import kernel_variants
  args, problem = sweeps.problem_args((32, 8), (128, 4096), None)
  config = mgpu_config.resolve_config(problem, pkv.DecodeConfig(**fields), num_sms=132)
  lower_for_cuda(kernel_variants.kernel_fn(config, problem, paged=False, probe=probe), *args)


@pytest.mark.parametrize("page_size", [4, 12, 48])
def test_page_sizes_it_cannot_tile_are_refused_so_auto_moves_on(page_size):
  case = make_case(42, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=64,
                   dtype=jnp.bfloat16, page_size=page_size)
  with pytest.raises(NotImplementedError, match=f"mosaic_gpu.*page_size {page_size} is not supported"):
    pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths, impl=IMPL)
