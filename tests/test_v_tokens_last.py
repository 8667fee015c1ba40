"""v stored tokens last (`v_tokens_last=True`: v [B, Hkv, D, T], paged [P, Hkv, D, page_size]):
the Triton kernel in interpret mode and the xla impl against the same call with v laid out like k,
its checks, and its CUDA lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from jax.experimental.pallas import mosaic_gpu as plgpu
from harness import TRITON_CUSTOM_CALL, lower_for_cuda, make_case, poison_unread_slots, random_lengths
from harness import assert_lse_matches, assert_matches_reference, relative_error, tiered


def tokens_last(v):
  """[B, T, Hkv, D] ([P, page_size, Hkv, D]) -> [B, Hkv, D, T] ([P, Hkv, D, page_size])."""
  return jnp.transpose(v, (0, 2, 3, 1))


def _scales(rng, kind, shape):
  if kind == "token":
    return jnp.asarray(rng.uniform(0.005, 0.02, shape), jnp.float32)
  if kind == "head":
    return jnp.asarray(rng.uniform(0.005, 0.02, shape[-1:]), jnp.float32)
  return None


def _run(case, *, paged: bool, v_tokens_last: bool, **kw):
  if paged:
    v = tokens_last(case.v_pages) if v_tokens_last else case.v_pages
    return pkv.paged_decode_attention(case.q, case.k_pages, v, case.block_tables, case.lengths,
                                      v_tokens_last=v_tokens_last, return_lse=True, **kw)
  v = tokens_last(case.v) if v_tokens_last else case.v
  return pkv.decode_attention(case.q, case.k, v, case.lengths, v_tokens_last=v_tokens_last, return_lse=True, **kw)


@pytest.mark.parametrize("kv_dtype, scale_kind, page_size, num_queries, config", [
    (jnp.int8, "token", None, None, pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2)),
    (jnp.int8, "token", 16, 2, pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2)),   # tiles span pages
    (jnp.float8_e4m3fn, "head", 32, None, pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=1)),
    (jnp.int8, "token", None, None,
     pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2, merge_in_kernel=True, sequence_order="longest_first")),
    (jnp.float16, None, 16, None, pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=2)),
], ids=["int8-token-dense", "int8-token-page16-s2", "e4m3-head-page32", "int8-merged-longest-first", "fp16-page16"])
def test_triton_matches_v_like_k_interpret(kv_dtype, scale_kind, page_size, num_queries, config):
  # Garbage (NaN or extremes) in every slot past a length or unread: the tokens-last loads mask too.
  case = make_case(3, batch=3, seq_len=96, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=num_queries,
                   dtype=jnp.float16, kv_dtype=kv_dtype, page_size=page_size)
  case = poison_unread_slots(case, dense=page_size is None)
  rng = np.random.default_rng(4)
  paged = page_size is not None
  token_shape = case.k_pages.shape[:3] if paged else case.k.shape[:3]
  scales = dict(k_scale=_scales(rng, scale_kind, token_shape), v_scale=_scales(rng, scale_kind, token_shape))
  ref, ref_lse = _run(case, paged=paged, v_tokens_last=False, impl="xla", **scales)
  with pkv.interpret():
    out, lse = _run(case, paged=paged, v_tokens_last=True, impl="triton", config=config, **scales)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_matches_reference(out, ref, jnp.float16)
  assert_lse_matches(lse, ref_lse, jnp.float16)


# Mosaic GPU: V tiles [D, bkv] read transposed by wgmma; one-byte tiles widened without their per-token scales,
# which fold into P (the kernel lays V's scales tokens last). Every layout the kernel takes (dense; pages of one
# and of two tiles), every V scale kind, and the pipeline options that change who reads the V tiles.
MOSAIC = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2, split_plan="per_sequence", kv_groups=1,
                             pipeline_qk=False, persistent=False, tile_consumers=1, sequence_order="given",
                             queries_as_n=False, values_as_stored=False, paired_terms=False)


def _mosaic(**fields):
  """MOSAIC with fields, as the experimental variant config where one of them is its own (values_as_stored)."""
  from pallas_kv import experimental
  if "values_as_stored" in fields:
    return experimental.MosaicGPUVariantConfig(**{**MOSAIC.given(), **fields})
  return dataclasses.replace(MOSAIC, **fields)


slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)   # a case only make test-slow runs


@pytest.mark.parametrize("kv_dtype, scale_kind, page_size, num_queries, fields", [
    (jnp.bfloat16, None, None, 2, {}),
    (jnp.bfloat16, None, 64, 2, dict(queries_as_n=True, pipeline_qk=True)),   # V^T as stored: wgmma's A as is
    (jnp.int8, "token", None, None, {}),
    (jnp.float8_e4m3fn, "head", 64, None, dict(kv_groups=2)),
    (jnp.float8_e4m3fn, "token", None, None, dict(kv_groups=3, num_stages=3, num_splits=3)),
    slow(jnp.float8_e4m3fn, "token", None, None, dict(kv_groups=2, num_stages=4, pipeline_qk=True)),
    slow(jnp.float8_e4m3fn, "token", None, 2, dict(queries_as_n=True)),
    (jnp.float8_e5m2, "head", 64, None, dict(queries_as_n=True, num_stages=3)),
    slow(jnp.float8_e4m3fn, "token", None, None, dict(queries_as_n=True, num_stages=3, pipeline_qk=True)),
    (jnp.float8_e4m3fn, "token", None, None, dict(queries_as_n=True, split_plan="stream_k", persistent=True)),
    (jnp.int8, "token", None, 2, dict(queries_as_n=True)),
    (jnp.int8, "head", 64, None, dict(queries_as_n=True, num_stages=3, pipeline_qk=True)),
    slow(jnp.float8_e4m3fn, "token", None, 2, dict(queries_as_n=True, values_as_stored=True)),
    (jnp.float8_e5m2, "head", 64, None, dict(queries_as_n=True, num_stages=3, pipeline_qk=True, values_as_stored=True)),
    (jnp.float8_e4m3fn, "token", None, None, dict(queries_as_n=True, values_as_stored=True, block_kv=256,
                                                  num_stages=2)),
    (jnp.float8_e4m3fn, "token", 16, 2, dict(queries_as_n=True, block_kv=128, num_stages=2)),
    (jnp.int8, "token", None, 2, dict(queries_as_n=True, values_as_stored=True)),
    slow(jnp.int8, "head", 64, None, dict(queries_as_n=True, num_stages=3, pipeline_qk=True, values_as_stored=True)),
    (jnp.int8, "head", 32, None, dict(queries_as_n=True, num_stages=3, pipeline_qk=True)),
    # V as stored a page at a time: a 256-token tile of four (two) page runs, one wgmma each
    (jnp.float8_e4m3fn, "token", 64, 2, dict(queries_as_n=True, values_as_stored=True, block_kv=256, num_stages=2)),
    (jnp.int8, "token", 128, None, dict(queries_as_n=True, values_as_stored=True, block_kv=256, num_stages=2)),
    (jnp.int8, "token", 64, 2, dict(queries_as_n=True, values_as_stored=True, block_kv=256, num_stages=2,
                                    persistent=True)),   # the ring streams on across work items
    (jnp.float8_e4m3fn, "token", None, 2, dict(queries_as_n=True, values_as_stored=True, paired_terms=True)),
    (jnp.int8, "token", 64, None, dict(queries_as_n=True, values_as_stored=True, paired_terms=True, block_kv=256,
                                       num_stages=2)),
    # the one-byte default's tiles walked by stream-K (the tuner's one-byte plans)
    (jnp.int8, "token", None, None, dict(queries_as_n=True, values_as_stored=True, paired_terms=True, block_kv=256,
                                         num_stages=2, split_plan="stream_k", persistent=True, num_splits=2)),
    pytest.param(jnp.int8, "token", 128, None, dict(pipeline_qk=True, num_splits=1), marks=pytest.mark.slow),
    pytest.param(jnp.float16, None, 64, None, dict(pipeline_qk=True), marks=pytest.mark.slow),
    pytest.param(jnp.float8_e5m2, "token", None, 3, dict(persistent=True), marks=pytest.mark.slow),
    pytest.param(jnp.int8, "token", 64, None, dict(tile_consumers=2, num_stages=4, pipeline_qk=True, persistent=True),
                 marks=pytest.mark.slow),
], ids=["bf16-dense-s2", "bf16-page64-s2-queries-as-n-pqk", "int8-token-dense", "e4m3-head-page64-groups2",
        "e4m3-token-dense-groups3",
        "e4m3-token-dense-groups2-pqk", "e4m3-token-dense-s2-queries-as-n", "e5m2-head-page64-queries-as-n",
        "e4m3-token-dense-queries-as-n-pqk", "e4m3-token-dense-queries-as-n-stream-k",
        "int8-token-dense-s2-queries-as-n", "int8-head-page64-queries-as-n-pqk",
        "e4m3-token-dense-s2-queries-as-n-values-as-stored", "e5m2-head-page64-queries-as-n-pqk-values-as-stored",
        "e4m3-token-dense-queries-as-n-bkv256-values-as-stored", "e4m3-token-page16-s2-queries-as-n-bkv128",
        "int8-token-dense-s2-queries-as-n-values-as-stored", "int8-head-page64-queries-as-n-pqk-values-as-stored",
        "int8-head-page32-queries-as-n-pqk", "e4m3-token-page64-s2-bkv256-values-as-stored",
        "int8-token-page128-bkv256-values-as-stored", "int8-token-page64-s2-bkv256-values-as-stored-persistent",
        "e4m3-token-dense-s2-paired-terms", "int8-token-page64-bkv256-paired-terms",
        "int8-token-dense-bkv256-paired-terms-stream-k",
        "int8-token-page128-pqk",
        "fp16-page64-pqk", "e5m2-token-dense-s3-persistent", "int8-token-page64-tile-consumers2"])
def test_mosaic_gpu_matches_v_like_k_interpret(kv_dtype, scale_kind, page_size, num_queries, fields):
  case = make_case(8, batch=3, seq_len=256, num_heads=8, num_kv_heads=4, head_dim=64, num_queries=num_queries,
                   dtype=jnp.bfloat16 if kv_dtype == jnp.bfloat16 else jnp.float16, kv_dtype=kv_dtype,
                   page_size=page_size)
  case = poison_unread_slots(case, dense=page_size is None)
  rng = np.random.default_rng(9)
  paged = page_size is not None
  token_shape = case.k_pages.shape[:3] if paged else case.k.shape[:3]
  scales = dict(k_scale=_scales(rng, scale_kind, token_shape), v_scale=_scales(rng, scale_kind, token_shape))
  if scale_kind == "token" and not paged:   # NaN scales past the lengths must not reach an output
    past = np.arange(case.k.shape[1])[None, :] >= np.asarray(case.lengths)[:, None]
    scales["v_scale"] = jnp.where(past[..., None], jnp.nan, scales["v_scale"])
  ref, ref_lse = _run(case, paged=paged, v_tokens_last=False, impl="xla", **scales)
  config = _mosaic(**fields)
  with pkv.interpret():
    out, lse = _run(case, paged=paged, v_tokens_last=True, impl="mosaic_gpu", config=config, **scales)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


@pytest.mark.parametrize("kv_dtype, fields", [(jnp.int8, {}), (jnp.float8_e4m3fn, {}),
                                              (jnp.float8_e4m3fn, dict(pipeline_qk=True)),
                                              (jnp.float8_e4m3fn, dict(queries_as_n=True)),
                                              (jnp.float8_e4m3fn, dict(queries_as_n=True, pipeline_qk=True)),
                                              (jnp.int8, dict(queries_as_n=True)),
                                              (jnp.float8_e4m3fn, dict(queries_as_n=True, values_as_stored=True)),
                                              (jnp.int8, dict(queries_as_n=True, values_as_stored=True)),
                                              (jnp.float8_e4m3fn, dict(queries_as_n=True, values_as_stored=True,
                                                                       paired_terms=True))],
                         ids=["int8-widened", "e4m3-fp8-operands", "e4m3-fp8-operands-pqk", "e4m3-queries-as-n",
                              "e4m3-queries-as-n-pqk", "int8-queries-as-n", "e4m3-queries-as-n-values-as-stored",
                              "int8-queries-as-n-values-as-stored", "e4m3-paired-terms"])
def test_mosaic_gpu_tokens_last_race_detection_finds_none(kv_dtype, fields):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  # 5 tiles through a 2-slot ring: V and its scale slots refilled after register reads, the widened V tile (int8)
  # or P's fp8 terms and the zeroed V columns (e4m3; queries as N: P^T and the V slot widened) rewritten after
  # wgmma read them.
  case = make_case(10, batch=1, seq_len=320, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.float16,
                   kv_dtype=kv_dtype, lengths=[300])
  from pallas_kv.config import AttentionOptions
  from pallas_kv.kernels import frame
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  scales = _scales(np.random.default_rng(1), "token", case.k.shape[:3])
  config = _mosaic(**{"num_splits": 1, **fields})   # pqk: a K slot held a tile longer
  out, _ = mgpu_decode.decode_partials(
      frame.pack_queries(case.q[:, None], 1), case.k, tokens_last(case.v), case.lengths, num_queries=1,
      options=AttentionOptions(scale=0.1), config=config, plan=pkv.SplitPlan(kind="per_sequence", num_splits=1,
                                                                            block_kv=64),
      k_scale=scales, v_scale=scales, v_tokens_last=True, interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found


def test_mosaic_gpu_small_value_pages_widen_with_the_dense_kernels_barriers(monkeypatch):
  # Pages of 16: a V tile is 8 page runs; they are widened, joined in registers and stored 64 rows at a time, so the
  # tile loops hold as many warpgroup barriers as the dense kernel's (a store a run put two around each: 4x more).
  from harness import mosaic_text_for_cuda, tile_loop_counts
  B, T, P = 2, 1024, 128
  q = jax.ShapeDtypeStruct((B, 32, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
  dense = (jax.ShapeDtypeStruct((B, T, 8, 128), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((B, 8, 128, T),
           jnp.float8_e4m3fn), jax.ShapeDtypeStruct((B, T, 8), jnp.float32))
  paged = (jax.ShapeDtypeStruct((P, 16, 8, 128), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((P, 8, 128, 16),
           jnp.float8_e4m3fn), jax.ShapeDtypeStruct((P, 16, 8), jnp.float32))
  tables = jax.ShapeDtypeStruct((B, T // 16), jnp.int32)
  widened = pkv.MosaicGPUConfig(block_kv=128, values_as_stored=False)   # the dense kernel that widens V as pages do
  on_dense = lambda q, k, v, n, s: pkv.decode_attention(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True,
                                                        impl="mosaic_gpu", config=widened)
  on_pages = lambda q, k, v, t, n, s: pkv.paged_decode_attention(q, k, v, t, n, k_scale=s, v_scale=s,
                                                                 v_tokens_last=True, impl="mosaic_gpu")
  counts = {name: tile_loop_counts(mosaic_text_for_cuda(monkeypatch, fn, *args), ("bar.sync",))
            for name, fn, args in (("dense", on_dense, (q, dense[0], dense[1], lengths, dense[2])),
                                   ("pages", on_pages, (q, paged[0], paged[1], tables, lengths, paged[2])))}
  assert counts["pages"]["bar.sync"] == counts["dense"]["bar.sync"] > 0, counts


@pytest.mark.parametrize("kv_dtype, page_size, fields", [
    (jnp.float8_e4m3fn, 16, {}), (jnp.int8, 16, {}),
    (jnp.float8_e4m3fn, 64, dict(block_kv=256, values_as_stored=True))],
    ids=["e4m3-page16-widened", "int8-page16-widened", "e4m3-page64-bkv256-as-stored"])
def test_mosaic_gpu_value_pages_race_detection_finds_none(kv_dtype, page_size, fields):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  # V tokens last in pages smaller than a tile, a tile four page copies: 5 tiles through a 2-slot ring. Pages of 16:
  # each page's run widened into v_wide after its copy landed and refilled after the widening read it; pages of 64:
  # each run read as stored by wgmma (its columns past the length zeroed first), with P's terms a run each.
  block_kv = fields.get("block_kv", 64)
  case = make_case(12, batch=1, seq_len=5 * block_kv, num_heads=4, num_kv_heads=4, head_dim=64, dtype=jnp.float16,
                   kv_dtype=kv_dtype, lengths=[5 * block_kv - 20], page_size=page_size)
  from pallas_kv.config import AttentionOptions
  from pallas_kv.kernels import frame
  from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
  scales = _scales(np.random.default_rng(2), "token", case.k_pages.shape[:3])
  config = _mosaic(num_splits=1, queries_as_n=True, **{"block_kv": block_kv, **fields})
  out, _ = mgpu_decode.decode_partials(
      frame.pack_queries(case.q[:, None], 4), case.k_pages, tokens_last(case.v_pages), case.lengths,
      case.block_tables, num_queries=1, options=AttentionOptions(scale=0.1), config=config,
      plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=block_kv), k_scale=scales, v_scale=scales,
      v_tokens_last=True, interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found


# B=32 T=4096 heads 32/8 D=128 unless noted: the heuristic's configs (one-byte: two KV groups, 8 stages) and the
# options that change the V tiles' readers, lowered for CUDA (layout inference included) with the SMEM the fit
# counts checked against what Mosaic GPU lays out.
MOSAIC_LOWERINGS = [
    ("bfloat16", None, None, {}, 128), ("int8", "token", None, {}, 128), ("float8_e4m3fn", "token", 64, {}, 128),
    ("int8", "head", 128, dict(pipeline_qk=True, persistent=True), 128), ("float8_e4m3fn", "token", None,
                                                                           dict(kv_groups=3), 128),
    ("float8_e4m3fn", "token", None, dict(pipeline_qk=True), 128),
    ("float8_e4m3fn", "token", None, dict(queries_as_n=True), 128),
    ("float8_e4m3fn", "token", None, dict(queries_as_n=True, block_kv=128, pipeline_qk=True), 128),
    ("int8", "token", None, dict(queries_as_n=True, block_kv=128), 128),
    ("float8_e4m3fn", "token", 16, {}, 128), ("int8", "token", 32, {}, 128),   # V widened a page at a time
    ("float8_e4m3fn", "token", 64, dict(queries_as_n=True, values_as_stored=True, block_kv=256), 128),   # as stored
    ("int8", "token", 64, dict(queries_as_n=True, values_as_stored=True, block_kv=256), 128),   # a page at a time
    ("int8", "token", None, dict(queries_as_n=True, values_as_stored=True, block_kv=256, split_plan="stream_k",
                                 persistent=True), 128),   # the default's tiles walked by stream-K
    slow("float8_e4m3fn", "head", 128, dict(queries_as_n=True, block_kv=128), 128),
    slow("float8_e4m3fn", "token", None, dict(queries_as_n=True, split_plan="stream_k"), 128),
    slow("bfloat16", None, None, dict(block_kv=128), 128),
    slow("int8", "token", None, dict(kv_groups=1), 256), slow("float16", None, 64, dict(pipeline_qk=True), 64),
    slow("float8_e5m2", "head", 128, dict(block_kv=128, persistent=True), 128),
]


@pytest.mark.parametrize("kv_dtype, scale_kind, page_size, fields, head_dim", MOSAIC_LOWERINGS,
                         ids=["bf16", "int8-token", "e4m3-token-page64", "int8-head-page128-pqk-persistent",
                              "e4m3-token-groups3", "e4m3-token-pqk", "e4m3-token-queries-as-n",
                              "e4m3-token-bkv128-pqk-queries-as-n", "int8-token-bkv128-queries-as-n",
                              "e4m3-token-page16", "int8-token-page32", "e4m3-token-page64-bkv256-as-stored",
                              "int8-token-page64-bkv256-as-stored", "int8-token-bkv256-as-stored-stream-k",
                              "e4m3-head-page128-bkv128-queries-as-n", "e4m3-token-stream-k-queries-as-n",
                              "bf16-bkv128", "int8-token-d256-one-group", "fp16-page64-pqk-d64",
                              "e5m2-head-page128-bkv128-persistent"])
def test_mosaic_gpu_tokens_last_lowers_for_cuda(monkeypatch, kv_dtype, scale_kind, page_size, fields, head_dim):
  import sweeps
  from test_mosaic_gpu_quantized import lower, lowering_args
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args((32, 8), (32, 4096), page_size)
  problem = dataclasses.replace(problem, head_dim=head_dim, v_tokens_last=True)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(**fields), dtype=kv_dtype, num_sms=132)
  args = lowering_args(kv_dtype, scale_kind, scale_kind, page_size, head_dim=head_dim, v_tokens_last=True)
  if kv_dtype in ("bfloat16", "float16"):
    args = (jax.ShapeDtypeStruct(args[0].shape, kv_dtype), *args[1:])
  module = lower(monkeypatch, config, args)
  assert "_vlast" in module


def _b32_kernel_text(monkeypatch, kv_dtype, scale_shape, **options) -> str:
  """The shipped Mosaic GPU kernel at B32 T4096 heads 32/8 D128, V tokens last, lowered for CUDA, as text."""
  from harness import mosaic_text_for_cuda
  q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((32, 4096, 8, 128), kv_dtype)
  v = jax.ShapeDtypeStruct((32, 8, 128, 4096), kv_dtype)
  lengths = jax.ShapeDtypeStruct((32,), jnp.int32)
  scales = jax.ShapeDtypeStruct(scale_shape, jnp.float32)
  fn = lambda q, k, v, n, ks, vs: pkv.decode_attention(q, k, v, n, k_scale=ks, v_scale=vs, v_tokens_last=True,
                                                       impl="mosaic_gpu", **options)
  return mosaic_text_for_cuda(monkeypatch, fn, q, k, v, lengths, scales, scales)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_mosaic_gpu_masks_a_range_s_first_tiles_only_under_a_window(monkeypatch, kv_dtype):
  # A loop for the tiles before the unmasked ones is code a call without a window (or window start) never runs:
  # none is emitted. Two tile loops (unmasked, then the masked last tiles), three under a window.
  from harness import tile_loops
  plain = tile_loops(_b32_kernel_text(monkeypatch, kv_dtype, (32, 4096, 8)))
  windowed = tile_loops(_b32_kernel_text(monkeypatch, kv_dtype, (32, 4096, 8), window=1000))
  assert (len(plain), len(windowed)) == (2, 3)


def test_mosaic_gpu_lowered_tile_loops_hold_no_extra_syncs_or_divides(monkeypatch):
  # fp8: per-token scales cost the tile loops no warpgroup barrier or proxy fence beyond a head scale's (their slots
  # are freed after P's commit), and each item's output is normalised by one divide a row, not one an element.
  from harness import tile_loop_counts
  counts = {}
  for kind, shape in (("token", (32, 4096, 8)), ("head", (8,))):
    text = _b32_kernel_text(monkeypatch, jnp.float8_e4m3fn, shape)
    counts[kind] = tile_loop_counts(text, ("bar.sync", "fence.proxy")) | {"divf": text.count("arith.divf")}
  assert counts["token"]["bar.sync"] == counts["head"]["bar.sync"] > 0, counts
  assert counts["token"]["fence.proxy"] == counts["head"]["fence.proxy"] > 0, counts
  assert counts["head"]["divf"] <= 4, counts   # two consumers' two rows: 1 / l and the V scales' c


def test_mosaic_gpu_int8_probability_terms_are_transposed_once(monkeypatch):
  # V as stored: P's two int8 terms are split after one f16 transpose, as fp8's are, so int8's tile loops hold no
  # more shuffles than fp8's (each term transposed on its own held 1.6x fp8's).
  from harness import tile_loop_counts
  shuffles = {jnp.dtype(dtype).name: tile_loop_counts(_b32_kernel_text(monkeypatch, dtype, (32, 4096, 8)),
                                                      ("shfl",))["shfl"]
              for dtype in (jnp.int8, jnp.float8_e4m3fn)}
  assert 0 < shuffles["int8"] <= shuffles["float8_e4m3fn"], shuffles


def test_xla_gives_the_same_values_and_gradients():
  case = make_case(5, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.float32)
  f = lambda v, last: pkv.decode_attention(case.q, case.k, v, case.lengths, impl="xla", v_tokens_last=last).sum()
  out, grad = jax.value_and_grad(f)(case.v, False)
  out_t, grad_t = jax.value_and_grad(f)(tokens_last(case.v), True)
  np.testing.assert_allclose(out_t, out, rtol=1e-6)
  np.testing.assert_allclose(grad_t, tokens_last(grad), rtol=1e-6, atol=1e-7)
  paged = make_case(5, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.float32, page_size=8)
  out = _run(paged, paged=True, v_tokens_last=False, impl="xla")
  out_t = _run(paged, paged=True, v_tokens_last=True, impl="xla")
  np.testing.assert_allclose(out_t[0], out[0], rtol=1e-6)


def test_vmap_folds_tokens_last_values_interpret():
  rng = np.random.default_rng(6)
  n, b, t, hkv, d = 2, 2, 64, 2, 64
  q = jnp.asarray(rng.standard_normal((n, b, 4, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, b, t, hkv, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((n, b, t, hkv, d)), jnp.bfloat16)
  lengths = jnp.stack([random_lengths(rng, b, t) for _ in range(n)])
  config = pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=1)
  with pkv.interpret():
    out = jax.vmap(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="triton", config=config,
                                                           v_tokens_last=True))(q, k, jax.vmap(tokens_last)(v), lengths)
  ref = jax.vmap(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="xla"))(q, k, v, lengths)
  assert_matches_reference(out, ref, jnp.bfloat16)


def test_shapes_and_backends_are_checked():
  case = make_case(7, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=16)
  with pytest.raises(ValueError, match=r"v_tokens_last=True, v must have shape \[2, 2, 64, 32\]"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, v_tokens_last=True)
  with pytest.raises(ValueError, match="v_pages must have shape"):
    pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                               v_tokens_last=True)
  with pytest.raises(ValueError, match="v_tokens_last must be a bool"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, v_tokens_last="yes")
  # Mosaic GPU's V tiles [D, bkv]: D in 64-row blocks, one page's copy a tile; from pages of 16 or 32 a page at a
  # time, one-byte caches with <= 16 packed rows only (the queries-as-N consumer).
  with pytest.raises(NotImplementedError, match="v_tokens_last needs pages of a multiple of 64 tokens.*got pages of "
                                                "16 tokens, a 16-bit cache"):
    pkv.paged_decode_attention(case.q, case.k_pages, tokens_last(case.v_pages), case.block_tables, case.lengths,
                               v_tokens_last=True, impl="mosaic_gpu")
  wide = make_case(7, batch=2, seq_len=32, num_heads=34, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   kv_dtype=jnp.int8, page_size=16)
  with pytest.raises(NotImplementedError, match="one-byte cache with <= 16 packed rows.*and 17 packed rows"):
    pkv.paged_decode_attention(wide.q, wide.k_pages, tokens_last(wide.v_pages), wide.block_tables, wide.lengths,
                               v_tokens_last=True, impl="mosaic_gpu")
  small = make_case(7, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                    kv_dtype=jnp.float8_e4m3fn, page_size=16)
  with pytest.raises(ValueError, match=r"pages of 16 tokens is widened a page at a time.*'queries_as_n': False"):
    pkv.paged_decode_attention(small.q, small.k_pages, tokens_last(small.v_pages), small.block_tables, small.lengths,
                               v_tokens_last=True, impl="mosaic_gpu", config=pkv.MosaicGPUConfig(queries_as_n=False))
  narrow = make_case(7, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=96, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="v_tokens_last needs head_dim a multiple of 64.*got 96"):
    pkv.decode_attention(narrow.q, narrow.k, tokens_last(narrow.v), narrow.lengths, v_tokens_last=True,
                         impl="mosaic_gpu")
  pages64 = make_case(7, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                      page_size=64)
  with pytest.raises(ValueError, match="block_kv=128 must divide page_size 64"):
    pkv.paged_decode_attention(pages64.q, pages64.k_pages, tokens_last(pages64.v_pages), pages64.block_tables,
                               pages64.lengths, v_tokens_last=True, impl="mosaic_gpu",
                               config=pkv.MosaicGPUConfig(block_kv=128))
  from pallas_kv import experimental
  int8 = make_case(7, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   kv_dtype=jnp.int8)
  with pytest.raises(ValueError, match="v_tokens_last has no converter"):
    pkv.decode_attention(int8.q, int8.k, tokens_last(int8.v), int8.lengths, v_tokens_last=True, impl="mosaic_gpu",
                         config=experimental.MosaicGPUVariantConfig(convert_warpgroup=True))


# ---------------------------------------------------------------- caches and the layer

def _cache_pair(paged: bool, dtype, scales):
  """The same empty cache twice: v like k, and v stored tokens last (pages reserved if paged)."""
  if not paged:
    return [pkv.KVCache.create(2, 16, 2, 8, dtype, scales, scales, v_tokens_last=t) for t in (False, True)]
  caches = [pkv.PagedKVCache.create(2, 10, 4, 4, 2, 8, dtype, scales, scales, v_tokens_last=t) for t in (False, True)]
  _, tables, ok = pkv.reserve_pages(pkv.PagePool.create(10), caches[0].block_tables, caches[0].lengths, 13, 4)
  assert bool(ok)
  # A short table for sequence 1 (its 4th page unassigned): tokens past it are dropped alike.
  tables = tables.at[1, 3].set(-1)
  return [dataclasses.replace(c, block_tables=tables) for c in caches]


def test_queries_as_n_keeps_keys_of_zero_value_scale_interpret():
  # A key whose V scale is 0 (an all-zero V row) adds 0 to the output but its weight to the row sum: the queries-as-N
  # consumer shifts its logits by log2 of the V scales, floored, so that such a key is neither dropped nor NaN.
  case = make_case(11, batch=2, seq_len=192, num_heads=16, num_kv_heads=4, head_dim=64, dtype=jnp.float16,
                   kv_dtype=jnp.float8_e4m3fn)
  rng = np.random.default_rng(3)
  scales = _scales(rng, "token", case.k.shape[:3])
  v_scale = jnp.where(jnp.asarray(rng.random(scales.shape) < 0.3), 0.0, scales)
  ref, ref_lse = _run(case, paged=False, v_tokens_last=False, impl="xla", k_scale=scales, v_scale=v_scale)
  config = dataclasses.replace(MOSAIC, queries_as_n=True, num_splits=1)
  with pkv.interpret():
    out, lse = _run(case, paged=False, v_tokens_last=True, impl="mosaic_gpu", config=config, k_scale=scales,
                    v_scale=v_scale)
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


@pytest.mark.parametrize("kv_dtype, page_size", [(jnp.float8_e4m3fn, None), (jnp.int8, 16)])
def test_queries_as_n_widens_every_row_block_of_a_value_tile_interpret(kv_dtype, page_size):
  # head_dim 128: a V tile is two 64-row blocks, widened apart and joined into one store (from pages of 16, each
  # block joined from eight page runs first). The heuristic's config.
  case = make_case(14, batch=2, seq_len=256, num_heads=16, num_kv_heads=4, head_dim=128, dtype=jnp.float16,
                   kv_dtype=kv_dtype, page_size=page_size)
  case = poison_unread_slots(case, dense=page_size is None)
  paged = page_size is not None
  scales = _scales(np.random.default_rng(5), "token", (case.k_pages if paged else case.k).shape[:3])
  ref, ref_lse = _run(case, paged=paged, v_tokens_last=False, impl="xla", k_scale=scales, v_scale=scales)
  with pkv.interpret():
    out, lse = _run(case, paged=paged, v_tokens_last=True, impl="mosaic_gpu", k_scale=scales, v_scale=scales)
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


def test_queries_as_n_is_checked():
  # The queries as wgmma N: a 16-bit cache, or an fp8 or int8 one with V tokens last; <= 16 packed rows, one consumer a
  # program.
  from pallas_kv import experimental
  fp8 = make_case(7, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                  kv_dtype=jnp.float8_e4m3fn)
  wide = make_case(7, batch=2, seq_len=64, num_heads=34, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   kv_dtype=jnp.float8_e4m3fn)
  bf16 = make_case(7, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   kv_dtype=jnp.bfloat16)
  int8 = make_case(7, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float16,
                   kv_dtype=jnp.int8)
  as_n = pkv.MosaicGPUConfig(queries_as_n=True)
  checks = [(fp8, True, dataclasses.replace(as_n, kv_groups=2),
             r"queries_as_n=True needs .* <= 16 packed rows.*rows=2 config.kv_groups=2"),
            (fp8, False, as_n, r"v_tokens_last=False"),
            (wide, True, dataclasses.replace(as_n, kv_groups=1), r"rows=17"),
            (bf16, True, dataclasses.replace(as_n, tile_consumers=2, num_stages=4), r"config.tile_consumers=2"),
            (fp8, True, experimental.MosaicGPUVariantConfig(values_in_registers=True, queries_as_n=False),
             "needs queries_as_n=True"),
            (bf16, True, experimental.MosaicGPUVariantConfig(values_as_stored=True, queries_as_n=True),
             "values_as_stored=True .* an fp8 or int8 cache.*bfloat16"),
            (int8, True, experimental.MosaicGPUVariantConfig(values_as_stored=True, queries_as_n=False),
             "values_as_stored=True .*needs queries_as_n=True")]
  for case, last, config, message in checks:
    with pytest.raises(ValueError, match=message), pkv.interpret():
      pkv.decode_attention(case.q, case.k, tokens_last(case.v) if last else case.v, case.lengths, v_tokens_last=last,
                           impl="mosaic_gpu", config=config)


@pytest.mark.parametrize("values, kv_dtype", [("values_in_registers", "float8_e4m3fn"),
                                              ("values_as_stored", "float8_e4m3fn"), ("values_as_stored", "int8")])
def test_mosaic_gpu_values_variants_lower_for_cuda(monkeypatch, values, kv_dtype):
  # The register-operand P V of the queries-as-N consumer: interpret mode runs no register wgmma operand, so its
  # lowering (layout inference included) is what the CPU checks; its numerics are a GPU test's. V as stored (P^T as
  # e4m3 or int8 terms stored transposed through f16): lowered here, its numerics in interpret mode above.
  import sweeps
  from test_mosaic_gpu_quantized import lower, lowering_args
  from pallas_kv import experimental
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args((32, 8), (32, 4096), None)
  problem = dataclasses.replace(problem, head_dim=128, v_tokens_last=True)
  given = experimental.MosaicGPUVariantConfig(queries_as_n=True, block_kv=128, **{values: True})
  config = mgpu_config.resolve_config(problem, given, dtype=kv_dtype, num_sms=132)
  args = lowering_args(kv_dtype, "token", "token", None, head_dim=128, v_tokens_last=True)
  assert "_asn" in lower(monkeypatch, config, args)


@pytest.mark.parametrize("config", [pkv.MosaicGPUConfig(queries_as_n=True, block_kv=128),
                                    pkv.MosaicGPUConfig(queries_as_n=False, kv_groups=2)], ids=["queries-as-n", "groups2"])
def test_loads_only_probe_leaves_the_fp8_consumers_no_math(monkeypatch, config):
  # The benchmark probe that times the load path alone (`TileMath.loads_only`): the kernel still waits on every slot,
  # and its consumers issue no wgmma and no exp2; the same kernel without the probe issues both.
  from harness import mosaic_text_for_cuda
  from benchmarks.tools import mosaic_one_byte
  q = jax.ShapeDtypeStruct((2, 32, 128), jnp.float16)
  k = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.float8_e4m3fn)
  v = jax.ShapeDtypeStruct((2, 8, 128, 1024), jnp.float8_e4m3fn)
  lengths, scales = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 1024, 8), jnp.float32)
  texts = {probe: mosaic_text_for_cuda(monkeypatch, mosaic_one_byte.kernel_only(config, probe, ())[0], q, k, v,
                                       lengths, scales, scales) for probe in ("kernel", "loads")}
  assert "probe_loads_only" in texts["loads"] and "probe_loads_only" not in texts["kernel"]
  for op in ("wgmma.mma_async", "ex2.approx"):
    assert op in texts["kernel"] and op not in texts["loads"], op
  assert texts["loads"].count("mbarrier.try_wait") >= 4   # K, V and their scale slots


AS_STORED = (256, True)   # the queries as N on 256-token tiles, V read as stored
WIDENED = (128, False)   # ... on 128-token tiles, V widened


@pytest.mark.parametrize("dtype,tokens_last,page_size,heads,given,as_n", [
    ("float8_e4m3fn", True, None, (32, 8), None, AS_STORED),
    ("float8_e5m2", True, None, (32, 8), pkv.MosaicGPUConfig(pipeline_qk=True), WIDENED),   # two K slots held
    ("float8_e4m3fn", True, None, (64, 4), None, AS_STORED),   # 16 rows: as many columns as wgmma N holds here
    ("float8_e4m3fn", True, None, (68, 4), None, None),   # 17 rows
    ("float8_e4m3fn", False, None, (32, 8), None, None),
    ("int8", True, None, (32, 8), None, AS_STORED),
    ("float8_e4m3fn", True, 64, (32, 8), None, AS_STORED),   # a tile of four page runs
    ("int8", True, 128, (32, 8), None, AS_STORED),
    ("float8_e4m3fn", True, 192, (32, 8), None, None),   # pages that 256-token tiles do not tile
    ("float8_e4m3fn", True, None, (32, 8), pkv.MosaicGPUConfig(queries_as_n=False), None),
    ("float8_e4m3fn", True, None, (32, 8), pkv.MosaicGPUConfig(kv_groups=2), None),
    ("float8_e4m3fn", True, None, (32, 8), pkv.MosaicGPUConfig(block_kv=64), None),
    ("float8_e4m3fn", True, None, (32, 8), pkv.MosaicGPUConfig(block_kv=128), WIDENED),
    ("int8", True, None, (32, 8), pkv.MosaicGPUConfig(values_as_stored=False), WIDENED),
    ("int8", True, None, (32, 8), pkv.MosaicGPUConfig(queries_as_n=True), AS_STORED),   # asked for: its tiles too
    ("float8_e4m3fn", True, 16, (32, 8), None, WIDENED),   # pages smaller than a tile: the one consumer that reads them
    ("int8", True, 32, (32, 8), None, WIDENED),
    ("int8", True, 256, (32, 8), pkv.MosaicGPUConfig(queries_as_n=True), AS_STORED),
    ("int8", True, 64, (32, 8), pkv.MosaicGPUConfig(pipeline_qk=True), None),   # over pages only V as stored leads
], ids=["e4m3", "e5m2-pqk", "rows16", "rows17", "v-like-k", "int8", "page64", "int8-page128", "page192",
        "given-off", "given-groups2",
        "given-bkv64", "given-bkv128", "int8-given-widened", "int8-given-on", "e4m3-page16", "int8-page32",
        "int8-page256", "int8-page64-given-pqk"])
def test_mosaic_gpu_heuristic_runs_one_byte_queries_as_n(dtype, tokens_last, page_size, heads, given, as_n):
  # A one-byte cache with V tokens last and <= 16 packed rows, dense or in pages that 256-token tiles take whole
  # (64, 128, 256...), runs the queries as N with V read as stored on 256-token tiles (dense: measured level to 14%
  # faster than the queries as N on 128-token tiles over fp8, 34-41% faster than the widening kernel over int8, B1 to
  # B128; pages of 64: 15% faster than two consumers over fp8, 23-34% than the widening kernel over int8), unless the
  # given fields rule it out; pages of 16 or 32 tokens (fp8 and int8) always run the queries as N, as no other
  # consumer reads their V. as_n: (block_kv, values_as_stored), None: not as N.
  import sweeps
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args(heads, (32, 4096), page_size)
  problem = dataclasses.replace(problem, head_dim=128, v_tokens_last=tokens_last)
  config = mgpu_config.resolve_config(problem, given, dtype=dtype, num_sms=132, device_kind="cpu")
  assert config.queries_as_n is (as_n is not None)
  if as_n:
    assert (config.block_kv, config.values_as_stored, config.kv_groups) == (*as_n, 1)
    mgpu_config.check_config(config, rows=heads[0] // heads[1], head_dim=128, dtype=dtype, page_size=page_size,
                             num_splits=config.num_splits, k_scale_kind="token", v_scale_kind="token",
                             num_kv_heads=heads[1], v_tokens_last=True)


@pytest.mark.parametrize("dtype,batch,page_size,given,paired,persistent", [
    ("int8", 32, None, None, True, False), ("float8_e4m3fn", 32, None, None, False, False),
    ("float8_e4m3fn", 64, None, None, False, True), ("int8", 128, 64, None, True, True),
    ("int8", 128, None, pkv.MosaicGPUConfig(paired_terms=False, persistent=False), False, False),
    ("float8_e4m3fn", 128, None, pkv.MosaicGPUConfig(split_plan="balanced"), False, False),
    ("float8_e4m3fn", 32, None, pkv.MosaicGPUConfig(paired_terms=True, persistent=True), True, True)],
    ids=["int8-b32", "e4m3-b32", "e4m3-b64", "int8-page64-b128", "int8-given-off", "e4m3-given-balanced",
         "e4m3-given-on"])
def test_mosaic_gpu_heuristic_pairs_int8_terms_and_streams_many_waves(dtype, batch, page_size, given, paired,
                                                                      persistent):
  # V read as stored: Q's and P's terms paired over int8 (measured 5-7% faster; fp8 5% slower), and persistent
  # programs where the items (B x 8 kv heads) make >= 3 waves of 132 SMs (9-10% faster at 4 and 8 waves, level at
  # 2), unless given.
  import sweeps
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args((32, 8), (batch, 4096), page_size)
  problem = dataclasses.replace(problem, head_dim=128, v_tokens_last=True)
  config = mgpu_config.resolve_config(problem, given, dtype=dtype, num_sms=132, device_kind="cpu")
  assert (config.values_as_stored, config.paired_terms, config.persistent) == (True, paired, persistent)
  mgpu_config.check_config(config, rows=4, head_dim=128, dtype=dtype, page_size=page_size,
                           num_splits=config.num_splits, k_scale_kind="token", v_scale_kind="token", num_kv_heads=8,
                           v_tokens_last=True)


@pytest.mark.parametrize("head_dim, batch, stages, q_buffers", [(64, 32, 5, 1), (128, 512, 2, 2)])
def test_mosaic_gpu_query_rows_take_no_smem_of_their_own(head_dim, batch, stages, q_buffers):
  # The queries-as-N consumer makes Q's one-byte terms from q's 16-bit rows, which land in the terms' own bytes (a
  # union): the heuristic's ring keeps its stages at D 64, and persistent programs their two q buffers at B512 (a
  # buffer of the rows' own took one of each).
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  T = 2048
  S = jax.ShapeDtypeStruct
  problem = pkv.validation.validate_dense(S((batch, 32, head_dim), jnp.bfloat16),
                                          S((batch, T, 8, head_dim), jnp.float8_e4m3fn),
                                          S((batch, 8, head_dim, T), jnp.float8_e4m3fn), S((batch,), jnp.int32), True)
  config = mgpu_config.resolve_config(problem, None, dtype=jnp.dtype(jnp.float8_e4m3fn), num_sms=132)
  smem = mgpu_config.DecodeSmem.for_call(config, rows=4, head_dim=head_dim, dtype=jnp.float8_e4m3fn, page_size=None,
                                         q_dtype=jnp.bfloat16, k_scale_kind="token", v_scale_kind="token",
                                         num_kv_heads=8, v_tokens_last=True)
  assert smem.splits_queries and config.block_kv == 256
  assert (config.num_stages, smem.q_buffers) == (stages, q_buffers)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "int8"])
def test_mosaic_gpu_one_byte_head_dim_256_takes_a_consumer_that_fits(kv_dtype):
  # At head_dim 256 no ring of the queries as N fits SMEM (two stages of 128-token tiles and the widened V): the
  # heuristic takes the other consumers (int8 widened, fp8 operands), and the call lowers for CUDA.
  import sweeps
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args((32, 8), (4, 2048), None)
  problem = dataclasses.replace(problem, head_dim=256, v_tokens_last=True)
  assert not mgpu_config.resolve_config(problem, None, dtype=kv_dtype, num_sms=132, device_kind="cpu").queries_as_n
  B, T = 4, 2048
  args = (jax.ShapeDtypeStruct((B, 32, 256), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, 8, 256), kv_dtype),
          jax.ShapeDtypeStruct((B, 8, 256, T), kv_dtype), jax.ShapeDtypeStruct((B,), jnp.int32),
          jax.ShapeDtypeStruct((B, T, 8), jnp.float32))
  lower_for_cuda(lambda q, k, v, n, s: pkv.decode_attention(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True,
                                                            impl="mosaic_gpu"), *args)


@pytest.mark.parametrize("kv_dtype, page_size", [(jnp.float8_e4m3fn, None), (jnp.int8, 64)])
def test_mosaic_gpu_paired_terms_give_the_two_products_sums_interpret(kv_dtype, page_size):
  # Q's and P's two one-byte terms as one wgmma operand of 32 columns (`paired_terms`) sum the same products as two
  # wgmmas of 16: the outputs agree to f32 rounding (leaving out Q's low term moves fp8's by 8e-4, within the
  # tolerance against xla, so this is the test that sees it). Lengths end inside the first and second tile.
  case = make_case(31, batch=2, seq_len=512, num_heads=8, num_kv_heads=4, head_dim=64, num_queries=2,
                   dtype=jnp.float32, kv_dtype=kv_dtype, lengths=[500, 200], page_size=page_size)
  paged = page_size is not None
  scales = _scales(np.random.default_rng(3), "token", (case.k_pages if paged else case.k).shape[:3])
  outs = []
  for paired in (False, True):
    config = pkv.MosaicGPUConfig(queries_as_n=True, values_as_stored=True, block_kv=256, num_stages=2, num_splits=1,
                                 paired_terms=paired)
    with pkv.interpret():
      outs.append(_run(case, paged=paged, v_tokens_last=True, impl="mosaic_gpu", config=config, k_scale=scales,
                       v_scale=scales))
  (out, lse), (out_paired, lse_paired) = outs
  np.testing.assert_allclose(np.asarray(out_paired), np.asarray(out), rtol=0, atol=1e-5 * float(jnp.abs(out).max()))
  np.testing.assert_allclose(np.asarray(lse_paired), np.asarray(lse), rtol=0, atol=1e-5)
  ref, _ = _run(case, paged=paged, v_tokens_last=False, impl="xla", k_scale=scales, v_scale=scales)
  assert_matches_reference(out_paired, ref, jnp.float16)   # a one-byte cache's tolerance (that of 16-bit queries)


@pytest.mark.parametrize("kv_dtype, page_size", [("float8_e4m3fn", None), ("int8", 64)])
def test_mosaic_gpu_paired_terms_lower_for_cuda(kv_dtype, page_size):
  config = pkv.MosaicGPUConfig(queries_as_n=True, values_as_stored=True, paired_terms=kv_dtype != "int8")
  B, T, P = 4, 2048, 4 * 2048 // 64
  q, lengths = jax.ShapeDtypeStruct((B, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((B,), jnp.int32)
  if page_size is None:
    args = (q, jax.ShapeDtypeStruct((B, T, 8, 128), kv_dtype), jax.ShapeDtypeStruct((B, 8, 128, T), kv_dtype),
            lengths, jax.ShapeDtypeStruct((B, T, 8), jnp.float32))
    fn = lambda q, k, v, n, s: pkv.decode_attention(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True,
                                                    impl="mosaic_gpu", config=config)
  else:
    args = (q, jax.ShapeDtypeStruct((P, 64, 8, 128), kv_dtype), jax.ShapeDtypeStruct((P, 8, 128, 64), kv_dtype),
            jax.ShapeDtypeStruct((B, T // 64), jnp.int32), lengths, jax.ShapeDtypeStruct((P, 64, 8), jnp.float32))
    fn = lambda q, k, v, t, n, s: pkv.paged_decode_attention(q, k, v, t, n, k_scale=s, v_scale=s,
                                                             v_tokens_last=True, impl="mosaic_gpu", config=config)
  lower_for_cuda(fn, *args)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_mosaic_gpu_default_reads_one_byte_values_as_stored_interpret(kv_dtype):
  # The default config of a dense one-byte cache with V tokens last: 256-token tiles, V read as stored. Two new
  # tokens, lengths that end inside the first and the third tile, NaN scales past them; against xla.
  case = make_case(21, batch=2, seq_len=768, num_heads=8, num_kv_heads=4, head_dim=64, num_queries=2,
                   dtype=jnp.float16, kv_dtype=kv_dtype, lengths=[700, 100])
  rng = np.random.default_rng(22)
  past = np.arange(case.k.shape[1])[None, :] >= np.asarray(case.lengths)[:, None]
  scales = {name: jnp.where(past[..., None], jnp.nan, _scales(rng, "token", case.k.shape[:3]))
            for name in ("k_scale", "v_scale")}
  plan = pkv.plan_splits(pkv.decode_attention, case.q, case.k, tokens_last(case.v), case.lengths, v_tokens_last=True,
                         impl="mosaic_gpu", **scales)
  assert plan.block_kv == 256
  ref, ref_lse = _run(case, paged=False, v_tokens_last=False, impl="xla", **scales)
  with pkv.interpret():
    out, lse = _run(case, paged=False, v_tokens_last=True, impl="mosaic_gpu", **scales)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_mosaic_gpu_queries_as_n_takes_every_attention_option_interpret(kv_dtype):
  # The queries-as-N consumer (fp8's default, int8's when asked) under a sliding window, a per-sequence window start,
  # a softcap and sinks, two new tokens each, against xla on the same cache; lengths that end inside a tile. Logits
  # of ~1 (K scales x30) and sinks near them: leaving out any one option moves xla's output 12-46% (fp8), past
  # the 1e-2 tolerance.
  case = make_case(12, batch=2, seq_len=256, num_heads=8, num_kv_heads=4, head_dim=64, num_queries=2,
                   dtype=jnp.float16, kv_dtype=kv_dtype, lengths=[200, 77])
  rng = np.random.default_rng(13)
  scales = dict(k_scale=30 * _scales(rng, "token", case.k.shape[:3]), v_scale=_scales(rng, "token", case.k.shape[:3]))
  options = dict(window=48, softcap=1.0, sinks=jnp.asarray(rng.standard_normal(8) + 2.0, jnp.float32),
                 window_start=jnp.asarray([120, 30], jnp.int32), **scales)
  ref, ref_lse = _run(case, paged=False, v_tokens_last=False, impl="xla", **options)
  config = pkv.MosaicGPUConfig(queries_as_n=True, num_stages=2)
  with pkv.interpret():
    out, lse = _run(case, paged=False, v_tokens_last=True, impl="mosaic_gpu", config=config, **options)
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


def test_fp8_probability_terms_keep_eight_bits():
  # P FP8_MAX in f16 as two e4m3 terms (V as stored over fp8): hi + lo within 2^-8 of it (2^-9 absolute below e4m3's
  # normal range); hi alone is e4m3's 4 bits, so the low term carries the rest.
  from pallas_kv.kernels.mosaic_gpu import fp8_operands
  rng = np.random.default_rng(11)
  p = np.concatenate([rng.uniform(0, 1, 4096), 10.0 ** rng.uniform(-8, 0, 4096), [0.0, 1.0]]).astype(np.float32)
  wide = jnp.asarray(p * fp8_operands.FP8_MAX, jnp.float16)
  hi, lo = fp8_operands.split_fp8(wide)
  assert hi.dtype == lo.dtype == jnp.float8_e4m3fn
  wide, hi, lo = (np.asarray(x, np.float64) for x in (wide, hi, lo))
  error = np.abs(hi + lo - wide)
  assert np.all(error <= np.maximum(wide * 2.0 ** -8, 2.0 ** -9)), error.max()
  assert np.abs(hi - wide).max() > 2.0 ** -5 * 448 / 2   # hi alone misses by e4m3's half step at the top


@pytest.mark.parametrize("kv_dtype, page_size", [("float8_e4m3fn", None), ("int8", None), ("int8", 64)])
def test_mosaic_gpu_one_byte_default_is_the_calls_only_launch(kv_dtype, page_size):
  # B32 T4096 heads 32/8 (one split): the queries-as-N consumer makes Q's one-byte terms itself from q's bf16 rows,
  # so the lowered call holds the kernel and no XLA op that computes (an amax, a convert, a barrier) before it.
  B, T = 32, 4096
  q, lengths = jax.ShapeDtypeStruct((B, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((B,), jnp.int32)
  if page_size is None:
    args = (q, jax.ShapeDtypeStruct((B, T, 8, 128), kv_dtype), jax.ShapeDtypeStruct((B, 8, 128, T), kv_dtype),
            lengths, jax.ShapeDtypeStruct((B, T, 8), jnp.float32))
    fn = lambda q, k, v, n, s: pkv.decode_attention(q, k, v, n, k_scale=s, v_scale=s, v_tokens_last=True,
                                                    impl="mosaic_gpu")
  else:
    P = B * T // page_size
    args = (q, jax.ShapeDtypeStruct((P, page_size, 8, 128), kv_dtype),
            jax.ShapeDtypeStruct((P, 8, 128, page_size), kv_dtype),
            jax.ShapeDtypeStruct((B, T // page_size), jnp.int32), lengths,
            jax.ShapeDtypeStruct((P, page_size, 8), jnp.float32))
    fn = lambda q, k, v, t, n, s: pkv.paged_decode_attention(q, k, v, t, n, k_scale=s, v_scale=s,
                                                             v_tokens_last=True, impl="mosaic_gpu")
  module = lower_for_cuda(fn, *args).mlir_module()
  assert "_asn_v8" in module and module.count("stablehlo.custom_call") == 1
  for op in ("stablehlo.reduce", "stablehlo.convert", "stablehlo.optimization_barrier", "stablehlo.multiply"):
    assert op not in module, op


def _split_in_kernel(q, dtype, *, paired: bool, k_head_scale=None):
  """`fp8_operands.split_queries` in a one-warpgroup kernel (GPU interpret mode): q [64, D] 16-bit -> (Q's terms
  [2, 64, D] or paired [1, 64, D] of dtype, the rows' factors [64])."""
  from pallas_kv.kernels.mosaic_gpu import fp8_operands, tiling
  d = q.shape[1]
  terms_shape = (1 if paired else 2, 64, d)

  def body(q_ref, terms_out, factors_out, rows, terms, factors, barrier):
    plgpu.copy_gmem_to_smem(q_ref, rows, barrier)
    plgpu.barrier_wait(barrier)
    fp8_operands.split_queries(rows, terms, factors, paired=paired, k_head_scale=k_head_scale)
    plgpu.copy_smem_to_gmem(terms, terms_out)
    plgpu.copy_smem_to_gmem(factors, factors_out)
    plgpu.wait_smem_to_gmem(0)

  smem = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=tiling.smem_transforms(dt, d))
  kernel = plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct(terms_shape, dtype), jax.ShapeDtypeStruct((64,), jnp.float32)),
      scratch_types=dict(rows=smem((64, d), q.dtype), terms=smem(terms_shape, dtype),
                         factors=plgpu.SMEM((64,), jnp.float32), barrier=plgpu.Barrier()),
      interpret=plgpu.InterpretGPUParams())
  terms, factors = kernel(q)
  return np.asarray(terms, np.float32), np.asarray(factors)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_query_terms_made_in_the_kernel_keep_their_bits(dtype):
  # Q's two one-byte terms, made by the queries-as-N consumer from q's bf16 rows: int8 q = factor (hi + lo / 254)
  # within factor / 508 (~15 bits), each term in int8's range; e4m3 hi + lo within 2^-8 of the row's max (hi alone
  # misses by e4m3's 4 bits). A row of zeros stays zeros (factor finite, not 0 / 0); a head's k_scale scales the
  # factors; paired, rows 16-31 hold their own rows' low terms.
  from pallas_kv.kernels.mosaic_gpu import fp8_operands
  int8 = dtype == jnp.int8
  q = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32) * np.float32(30.0)
  q[5] = 0.0
  q = jnp.asarray(q, jnp.bfloat16)
  (hi, lo), factor = _split_in_kernel(q, dtype, paired=False)
  q = np.asarray(q, np.float32)
  amax = np.abs(q).max(axis=1)
  rebuilt = factor[:, None] * (hi + lo / (fp8_operands.INT8_LOW_SCALE if int8 else 1.0))
  if int8:
    assert np.all(np.abs(rebuilt - q) <= factor[:, None] / (2 * fp8_operands.INT8_LOW_SCALE) * 1.001)
    assert np.abs(hi).max() == 127 and np.abs(lo).max() <= 127 and np.abs(lo).max() > 64
  else:
    assert np.all(np.abs(rebuilt - q) <= amax[:, None] * 2.0 ** -8)
    assert np.abs(factor[:, None] * hi - q).max() > 2.0 ** -6 * amax.max()
  np.testing.assert_allclose(factor[amax > 0], amax[amax > 0] / (127.0 if int8 else fp8_operands.FP8_MAX),
                             rtol=1e-6)
  assert np.all(rebuilt[5] == 0) and np.isfinite(factor).all()
  (paired,), scaled = _split_in_kernel(jnp.asarray(q, jnp.bfloat16), dtype, paired=True, k_head_scale=2.0)
  np.testing.assert_array_equal(paired[:16], hi[:16])
  np.testing.assert_array_equal(paired[16:32], lo[16:32])
  np.testing.assert_allclose(scaled, 2.0 * factor, rtol=1e-6)


def test_mosaic_gpu_queries_as_n_reads_per_token_scales_as_stored(monkeypatch):
  # The queries as N take each key's scale on S^T's rows, as the cache stores them ([B, T, Hkv]): the default fp8
  # config lowers with no transpose before the kernel; keys as S's columns (queries_as_n=False) need both scales
  # tokens last, one transpose each.
  import sweeps
  from test_mosaic_gpu_quantized import lower, lowering_args
  from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
  _, problem = sweeps.problem_args((32, 8), (32, 4096), None)
  problem = dataclasses.replace(problem, head_dim=128, v_tokens_last=True)
  args = lowering_args("float8_e4m3fn", "token", "token", None, head_dim=128, v_tokens_last=True)
  for given, transposes in ((None, 0), (pkv.MosaicGPUConfig(queries_as_n=False), 2)):
    config = mgpu_config.resolve_config(problem, given, dtype="float8_e4m3fn", num_sms=132, device_kind="cpu")
    assert lower(monkeypatch, config, args).count("stablehlo.transpose") == transposes, config


@pytest.mark.parametrize("paged", [False, True])
def test_caches_store_v_tokens_last_on_append(paged):
  like_k, last = _cache_pair(paged, jnp.int8, "token")   # values and per-token scales both written
  rng = np.random.default_rng(5)
  append = jax.jit(lambda c, k, v: c.append(k, v))
  for s in (9, 1, 3):   # 13 tokens: sequence 1's last page is missing when paged
    k, v = (jnp.asarray(rng.standard_normal((2, s, 2, 8)), jnp.float32) for _ in range(2))
    like_k, last = like_k.append(k, v), append(last, k, v)
  assert last.v_tokens_last and not like_k.v_tokens_last
  stored, want = (last.v, like_k.v) if not paged else (last.v_pages, like_k.v_pages)
  np.testing.assert_array_equal(np.asarray(stored, np.float32), np.asarray(tokens_last(want), np.float32))
  np.testing.assert_array_equal(last.v_scale, like_k.v_scale)
  if paged:
    view, want_view = last.dense_view(), like_k.dense_view()
    assert view.v_tokens_last
    np.testing.assert_array_equal(np.asarray(view.v, np.float32), np.asarray(tokens_last(want_view.v), np.float32))
  with pytest.raises(ValueError, match="v_tokens_last must be a bool"):
    pkv.KVCache.create(1, 4, 1, 8, v_tokens_last="yes")


@pytest.mark.parametrize("paged", [False, True])
def test_one_byte_caches_are_created_tokens_last_unless_told(paged):
  def create(dtype, **kw):
    if paged:
      return pkv.PagedKVCache.create(2, 10, 4, 4, 2, 8, dtype, **kw)
    return pkv.KVCache.create(2, 16, 2, 8, dtype, **kw)

  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    cache = create(dtype, k_scales="token", v_scales="token")
    v = cache.v_pages if paged else cache.v
    assert cache.v_tokens_last and pkv.cache.default_v_tokens_last(dtype), dtype
    assert v.shape == ((10, 2, 8, 4) if paged else (2, 2, 8, 16)), v.shape
    assert not create(dtype, v_tokens_last=False).v_tokens_last
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    assert not create(dtype).v_tokens_last and create(dtype, v_tokens_last=True).v_tokens_last


@pytest.mark.parametrize("paged", [False, True])
def test_with_v_tokens_last_converts_a_filled_cache_both_ways(paged):
  like_k, last = _cache_pair(paged, jnp.int8, "token")
  rng = np.random.default_rng(7)
  k, v = (jnp.asarray(rng.standard_normal((2, 11, 2, 8)), jnp.float32) for _ in range(2))
  like_k, last = like_k.append(k, v), last.append(k, v)
  values = lambda c: np.asarray(c.v_pages if paged else c.v, np.float32)
  converted, back = like_k.with_v_tokens_last(True), last.with_v_tokens_last(False)
  assert converted.v_tokens_last and not back.v_tokens_last
  np.testing.assert_array_equal(values(converted), values(last))
  np.testing.assert_array_equal(values(back), values(like_k))
  np.testing.assert_array_equal(values(last.with_v_tokens_last(True)), values(last))   # already so: unchanged
  # Converted, the cache appends on in its new layout as a cache created that way.
  k2, v2 = (jnp.asarray(rng.standard_normal((2, 2, 2, 8)), jnp.float32) for _ in range(2))
  np.testing.assert_array_equal(values(converted.append(k2, v2)), values(last.append(k2, v2)))
  with pytest.raises(ValueError, match="v_tokens_last must be a bool"):
    like_k.with_v_tokens_last(1)


@pytest.mark.parametrize("paged", [False, True])
def test_layer_over_a_tokens_last_cache_gives_the_same_step(paged):
  # The layer hands the cache's layout to the op (which checks v's shape against it); the Triton
  # kernel on this layout is checked against v like k above.
  layer = pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=8, impl="xla")
  params = layer.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (2, 12, 64))
  outs = []
  for cache in _cache_pair(paged, jnp.int8, "token"):
    _, cache = jax.jit(layer.prefill)(params, x[:, :10], cache)   # one compile, not op by op
    y, cache = jax.jit(layer)(params, x[:, 10:], cache)
    outs.append(y)
  np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))


@pytest.mark.parametrize("page_size, expected", [(None, 128), (16, 128), (64, 128), (128, 128)])
def test_heuristic_tiles_one_byte_values_tokens_last_by_cache_lines(page_size, expected):
  # A tokens-last tile reads D rows of block_kv values: one-byte caches take 128-token tiles
  # (a 128-byte row), dense or paged (pages below the tile load page by page); bf16 and values
  # like k keep the default.
  from pallas_kv import validation
  from pallas_kv.kernels.triton import config as triton_config
  b, t, hkv, d = 2, 1024, 2, 128
  q = jnp.zeros((b, 8, d), jnp.bfloat16)
  lengths = jnp.full((b,), t, jnp.int32)

  def block_kv(dtype, tokens_last):
    if page_size is None:
      k = jnp.zeros((b, t, hkv, d), dtype)
      v = jnp.zeros((b, hkv, d, t) if tokens_last else k.shape, dtype)
      problem = validation.validate_dense(q, k, v, lengths, tokens_last)
    else:
      pages = b * t // page_size
      k = jnp.zeros((pages, page_size, hkv, d), dtype)
      v = jnp.zeros((pages, hkv, d, page_size) if tokens_last else k.shape, dtype)
      tables = jnp.arange(pages, dtype=jnp.int32).reshape(b, -1)
      problem = validation.validate_paged(q, k, v, tables, lengths, tokens_last)
    return triton_config.heuristic_config(problem, dtype=dtype).block_kv

  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    assert block_kv(dtype, True) == expected
    assert block_kv(dtype, False) == triton_config.DEFAULT_BLOCK_KV
  assert block_kv(jnp.bfloat16, True) == triton_config.DEFAULT_BLOCK_KV


@pytest.mark.parametrize("page_size", [None, 16])
def test_triton_lowers_for_cuda(page_size):
  b, t, hkv, d = 8, 1024, 8, 128
  q = jax.ShapeDtypeStruct((b, 32, d), jnp.float16)
  scale = jax.ShapeDtypeStruct((b, t, hkv) if page_size is None else (b * t // 16, 16, hkv), jnp.float32)
  if page_size is None:
    k = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.int8)
    v = jax.ShapeDtypeStruct((b, hkv, d, t), jnp.int8)
    fn = lambda q, k, v, n, ks, vs: pkv.decode_attention(q, k, v, n, k_scale=ks, v_scale=vs, impl="triton",
                                                         v_tokens_last=True)
    args = (q, k, v, jax.ShapeDtypeStruct((b,), jnp.int32), scale, scale)
  else:
    pages = b * t // page_size
    k = jax.ShapeDtypeStruct((pages, page_size, hkv, d), jnp.int8)
    v = jax.ShapeDtypeStruct((pages, hkv, d, page_size), jnp.int8)
    tables = jax.ShapeDtypeStruct((b, t // page_size), jnp.int32)
    fn = lambda q, k, v, bt, n, ks, vs: pkv.paged_decode_attention(q, k, v, bt, n, k_scale=ks, v_scale=vs,
                                                                   impl="triton", v_tokens_last=True)
    args = (q, k, v, tables, jax.ShapeDtypeStruct((b,), jnp.int32), scale, scale)
  text = lower_for_cuda(fn, *args).mlir_module()
  assert TRITON_CUSTOM_CALL in text and "_vt" in text


_GPU_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.bfloat16)


def _check_on_gpu(impl: str, kv_dtype, page_size, seed: int, config=None, heads=(32, 8), head_dim=128,
                  num_queries=2):
  """impl reading v tokens last against xla reading it like k, B4 T4096 (by default heads 32/8, D 128, 2 new
  tokens); per-token scales for a one-byte cache; poisoned slots past the lengths. config: a partial config of
  impl, or None."""
  case = make_case(seed, batch=4, seq_len=4096, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                   num_queries=num_queries,
                   dtype=jnp.float16 if jnp.dtype(kv_dtype).itemsize == 1 else jnp.bfloat16, kv_dtype=kv_dtype,
                   page_size=page_size)
  case = poison_unread_slots(case, dense=page_size is None)
  rng = np.random.default_rng(seed + 1)
  kind = "token" if jnp.dtype(kv_dtype).itemsize == 1 else None
  token_shape = (case.k_pages if page_size else case.k).shape[:3]
  scales = dict(k_scale=_scales(rng, kind, token_shape), v_scale=_scales(rng, kind, token_shape))
  paged = page_size is not None
  ref, ref_lse = _run(case, paged=paged, v_tokens_last=False, impl="xla", **scales)
  out, lse = jax.jit(lambda: _run(case, paged=paged, v_tokens_last=True, impl=impl, config=config, **scales))()
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_matches_reference(out, ref, case.q.dtype)
  assert_lse_matches(lse, ref_lse, case.q.dtype)


@pytest.mark.gpu   # Hopper's fp8 wgmma accumulates in fewer bits than f32
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_mosaic_gpu_fp8_values_as_stored_sums_in_f32(page_size):
  # The default reads fp8 V as stored and sums Q's and P's terms and each tile's products in f32. Summed in one wgmma
  # accumulator they measured 2.5e-3 against xla (B32 T4096), 7.4e-4 in f32 (bf16 P's error; f16 P 3.1e-4): the bound
  # lies between them.
  case = make_case(23, batch=8, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.float16,
                   kv_dtype=jnp.float8_e4m3fn, page_size=page_size)
  paged = page_size is not None
  token_shape = (case.k_pages if paged else case.k).shape[:3]
  rng = np.random.default_rng(5)
  scales = dict(k_scale=_scales(rng, "token", token_shape), v_scale=_scales(rng, "token", token_shape))
  ref, _ = _run(case, paged=paged, v_tokens_last=False, impl="xla", **scales)
  out, _ = jax.jit(lambda: _run(case, paged=paged, v_tokens_last=True, impl="mosaic_gpu", **scales))()
  assert relative_error(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < 1.5e-3


@pytest.mark.gpu   # the consumers' variants over fp8 operands: three of them a program; Q K^T pipelined; rows as N
@pytest.mark.parametrize("fields", [dict(kv_groups=3), dict(pipeline_qk=True), dict(queries_as_n=True),
                                    dict(queries_as_n=True, block_kv=128, pipeline_qk=True),
                                    dict(queries_as_n=True, block_kv=128, values_in_registers=True),
                                    dict(queries_as_n=True, block_kv=128, values_as_stored=True),
                                    dict(queries_as_n=True, block_kv=256, values_as_stored=True),
                                    dict(queries_as_n=True, block_kv=256, values_as_stored=True, paired_terms=True)],
                         ids=["groups3", "pqk", "queries-as-n", "queries-as-n-bkv128-pqk", "queries-as-n-vreg",
                              "queries-as-n-values-as-stored", "queries-as-n-bkv256-values-as-stored",
                              "queries-as-n-bkv256-paired-terms"])
def test_gpu_mosaic_gpu_fp8_consumer_variants_match(fields):
  from pallas_kv.experimental import MosaicGPUVariantConfig   # values_in_registers: interpret mode cannot run it
  _check_on_gpu("mosaic_gpu", jnp.float8_e4m3fn, None, seed=17, config=MosaicGPUVariantConfig(**fields))


@pytest.mark.gpu   # int8 read as stored (s8 wgmma), the queries as N, dense and paged; V as stored too (P V on s8)
@pytest.mark.parametrize("page_size, values_as_stored, paired", [(None, False, False), (128, False, False),
                                                                 (None, True, False), (64, True, True)])
def test_gpu_mosaic_gpu_int8_queries_as_n_matches(page_size, values_as_stored, paired):
  from pallas_kv.experimental import MosaicGPUVariantConfig
  config = MosaicGPUVariantConfig(queries_as_n=True, block_kv=256 if paired else 128,
                                  values_as_stored=values_as_stored, paired_terms=paired)
  _check_on_gpu("mosaic_gpu", jnp.int8, page_size, seed=19, config=config)


@pytest.mark.gpu   # V as stored a page at a time: 256-token tiles of four (two) page runs, one wgmma a run
@pytest.mark.parametrize("kv_dtype,page_size", [(jnp.float8_e4m3fn, 64), (jnp.int8, 64), (jnp.float8_e4m3fn, 128)])
def test_gpu_mosaic_gpu_values_as_stored_over_pages_match(kv_dtype, page_size):
  config = pkv.MosaicGPUConfig(queries_as_n=True, block_kv=256, values_as_stored=True)
  _check_on_gpu("mosaic_gpu", kv_dtype, page_size, seed=29, config=config)


@pytest.mark.gpu   # the GPU tier: each dtype once, each page size once
@pytest.mark.parametrize("kv_dtype,page_size", tiered(
    [(d, page) for d in _GPU_DTYPES for page in (None, 16, 64)],
    every_tier=list(zip(_GPU_DTYPES, (None, 16, 64)))))
def test_gpu_triton_matches_v_like_k(kv_dtype, page_size):
  _check_on_gpu("triton", kv_dtype, page_size, seed=11)


@pytest.mark.gpu   # the GPU tier: each dtype once, dense and pages of 64
@pytest.mark.parametrize("kv_dtype,page_size", tiered(
    [(d, page) for d in _GPU_DTYPES for page in (None, 64)],
    every_tier=list(zip(_GPU_DTYPES, (None, 64, None)))))
def test_gpu_mosaic_gpu_matches_v_like_k(kv_dtype, page_size):
  _check_on_gpu("mosaic_gpu", kv_dtype, page_size, seed=13)   # the heuristic's config


@pytest.mark.gpu   # V in pages smaller than a tile, widened a page at a time (the queries as N)
@pytest.mark.parametrize("kv_dtype,page_size", [(jnp.float8_e4m3fn, 16), (jnp.int8, 32)])
def test_gpu_mosaic_gpu_small_value_pages_match(kv_dtype, page_size):
  _check_on_gpu("mosaic_gpu", kv_dtype, page_size, seed=23)   # the heuristic's config


@pytest.mark.gpu   # per-token scales of 3 and 2 kv heads laid out by head (padded to 4 on pages of 16); groups of 3
@pytest.mark.parametrize("kv_dtype,page_size,heads,head_dim", [   # and 7 (Q factors padded)
    (jnp.float8_e4m3fn, None, (9, 3), 64), (jnp.int8, 64, (9, 3), 64), (jnp.int8, 16, (9, 3), 64),
    (jnp.float8_e4m3fn, 32, (14, 2), 128)],
    ids=["e4m3-heads9-3-d64", "int8-page64-heads9-3-d64", "int8-page16-heads9-3-d64", "e4m3-page32-heads14-2"])
def test_gpu_mosaic_gpu_odd_head_counts_match(kv_dtype, page_size, heads, head_dim):
  _check_on_gpu("mosaic_gpu", kv_dtype, page_size, seed=29, heads=heads, head_dim=head_dim, num_queries=1)
