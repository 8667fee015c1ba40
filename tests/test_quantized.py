"""int8 / fp8 KV caches: the scale kinds in the reference, the kernels (interpret mode on the CPU,
CUDA lowering, the GPU), quantizing appends, and the layer with a quantized cache."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import (TRITON_CUSTOM_CALL, assert_lse_matches, assert_matches_reference, lower_for_cuda, make_case,
                     relative_error, tiered)
from naive import naive_attention
from pallas_kv import cache as kv_cache

QUANTIZED = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]
SCALE_KINDS = ["none", "head", "token"]
# Kernel backends that serve quantized caches, with a small config each takes in interpret mode.
KERNELS = {"triton": pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2),
           "mosaic_gpu": pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2)}
# On Triton every pair of dtype, scale kind and layout, as a Latin square: the dtype only changes
# how a tile widens, the scale kind and layout how it is addressed, so each scale kind meets each
# layout, and each dtype meets each of both. Mosaic GPU runs a few here through the API
# (tests/test_mosaic_gpu_quantized.py covers its kernel in full).
PAGE_SIZES = (None, 16, 64)
KERNEL_CASES = [("triton", QUANTIZED[(k + p) % 3], kind, page) for k, kind in enumerate(SCALE_KINDS)
                for p, page in enumerate(PAGE_SIZES)]
KERNEL_CASES += [("mosaic_gpu", jnp.int8, "token", None), ("mosaic_gpu", jnp.int8, "token", 16),
                 ("mosaic_gpu", jnp.float8_e4m3fn, "head", 64), ("mosaic_gpu", jnp.float8_e5m2, "none", None)]


def _name(dtype):
  return jnp.dtype(dtype).name


def _scales(rng, kind, token_shape):
  """(k_scale, v_scale) of a kind: None, a number and an [Hkv] array, or per token."""
  if kind == "none":
    return None, None
  if kind == "head":
    return 0.03, jnp.asarray(rng.uniform(0.01, 0.05, token_shape[-1]), jnp.float32)
  return tuple(jnp.asarray(rng.uniform(0.01, 0.05, token_shape), jnp.float32) for _ in range(2))


def _dequantized(x, scale):
  """float32 x * scale, the scale broadcast from its kind (what the cache stands for)."""
  x = np.asarray(jnp.asarray(x, jnp.float32))
  if scale is None:
    return x
  scale = np.asarray(scale, np.float32)
  return x * (scale[..., None] if scale.ndim == 3 else scale.reshape(-1, 1) if scale.ndim == 1 else scale)


def _quantized_case(seed, kv_dtype, *, page_size=None, num_queries=2, lengths=(100, 0, 128), seq_len=128):
  return make_case(seed, batch=len(lengths), seq_len=seq_len, num_heads=8, num_kv_heads=4, head_dim=64,
                   num_queries=num_queries, dtype=jnp.bfloat16, kv_dtype=kv_dtype, page_size=page_size,
                   lengths=list(lengths))


# ---------------------------------------------------------------- the reference and the xla impl

@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=_name)
def test_reference_dequantizes_every_scale_kind(kv_dtype, kind):
  rng = np.random.default_rng(1)
  case = _quantized_case(1, kv_dtype, num_queries=2, lengths=(60, 17), seq_len=64)
  k_scale, v_scale = _scales(rng, kind, case.k.shape[:3])
  out, lse = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale,
                                            return_lse=True)
  want, want_lse = naive_attention(case.q, _dequantized(case.k, k_scale), _dequantized(case.v, v_scale),
                                   case.lengths)
  assert_matches_reference(out, want, jnp.float32)
  assert_lse_matches(lse, want_lse, jnp.float32)


@pytest.mark.parametrize("kind", ["head", "token"])
def test_paged_scales_follow_the_block_table(kind):
  rng = np.random.default_rng(2)
  case = _quantized_case(2, jnp.int8, page_size=16)
  k_scale, v_scale = _scales(rng, kind, case.k.shape[:3])
  want = pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale, impl="xla")
  if kind == "token":   # the same per-token scales, scattered into pages like the cache
    k_scale, _, _ = _paginate_like(case, k_scale)
    v_scale, _, _ = _paginate_like(case, v_scale)
  got = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                   k_scale=k_scale, v_scale=v_scale, impl="xla")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _paginate_like(case, dense_scale):
  """A per-token scale [B, T, Hkv] scattered into the case's page layout [P, page_size, Hkv]."""
  b, t = dense_scale.shape[:2]
  ps = case.page_size
  pages = jnp.ones((case.k_pages.shape[0], ps, dense_scale.shape[2]), jnp.float32)
  pages = pages.at[case.block_tables.reshape(-1)].set(dense_scale.reshape(b * t // ps, ps, -1))
  return pages, None, None


def test_scale_arguments_are_checked():
  case = _quantized_case(3, jnp.int8)
  call = functools.partial(pkv.decode_attention, case.q, case.k, case.v, case.lengths, impl="xla")
  with pytest.raises(ValueError, match=r"k_scale must be .*per token and kv head \[3, 128, 4\]"):
    call(k_scale=jnp.ones((3, 128, 1), jnp.float32))
  with pytest.raises(ValueError, match="v_scale must be floating point"):
    call(v_scale=jnp.ones((4,), jnp.int32))


# ---------------------------------------------------------------- kernels, interpret mode (CPU)

# The default tier: the square's diagonal (each dtype, scale kind and layout once) and two Mosaic GPU cases.
_EVERY_TIER = [KERNEL_CASES[k * len(PAGE_SIZES) + k] for k in range(len(SCALE_KINDS))] + [KERNEL_CASES[-3],
                                                                                          KERNEL_CASES[-2]]


@pytest.mark.parametrize("impl,kv_dtype,kind,page_size", tiered(KERNEL_CASES, every_tier=_EVERY_TIER),
                         ids=[f"{i}-{_name(d)}-{k}-page{p}" for i, d, k, p in KERNEL_CASES])
def test_kernel_matches_reference_on_dequantized_values(interpret_mode, impl, kv_dtype, kind, page_size):
  rng = np.random.default_rng(4)
  case = _quantized_case(4, kv_dtype, page_size=page_size)
  cache_shape = (case.k_pages if page_size else case.k).shape[:3]
  k_scale, v_scale = _scales(rng, kind, cache_shape)
  if page_size:
    out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                     k_scale=k_scale, v_scale=v_scale, return_lse=True, impl=impl,
                                     config=KERNELS[impl])
    ref = pkv.paged_decode_attention_reference(case.q.astype(jnp.float32), case.k_pages, case.v_pages,
                                               case.block_tables, case.lengths, k_scale=k_scale, v_scale=v_scale,
                                               return_lse=True)
  else:
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale,
                               return_lse=True, impl=impl, config=KERNELS[impl])
    ref = pkv.decode_attention_reference(case.q.astype(jnp.float32), case.k, case.v, case.lengths,
                                         k_scale=k_scale, v_scale=v_scale, return_lse=True)
  assert pkv.last_impl() == impl
  assert out[0].dtype == case.q.dtype
  assert_matches_reference(out[0], ref[0], jnp.bfloat16)
  assert_lse_matches(out[1], ref[1], jnp.bfloat16)
  assert np.all(np.asarray(out[0], np.float32)[1] == 0)   # length 0: zeros


@pytest.mark.parametrize("impl", list(KERNELS))
def test_kernel_options_with_a_quantized_cache(interpret_mode, impl):
  rng = np.random.default_rng(5)
  case = _quantized_case(5, jnp.float8_e4m3fn, num_queries=3, lengths=(128, 77))
  k_scale, v_scale = _scales(rng, "token", case.k.shape[:3])
  kw = dict(softcap=2.0, window=50, sinks=jnp.linspace(-1.0, 1.0, 8), k_scale=k_scale, v_scale=v_scale)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=impl, config=KERNELS[impl], **kw)
  ref = pkv.decode_attention_reference(case.q.astype(jnp.float32), case.k, case.v, case.lengths, **kw)
  assert_matches_reference(out, ref, jnp.bfloat16)


@pytest.mark.parametrize("impl,kv_dtype,v_tokens_last,head_scales", [
    ("triton", jnp.int8, False, False), ("triton", jnp.float8_e4m3fn, True, False), ("triton", jnp.int8, True, True),
    ("mosaic_gpu", jnp.int8, True, False), ("mosaic_gpu", jnp.float8_e4m3fn, True, False)],
    ids=["triton-int8", "triton-fp8-vlast", "triton-int8-vlast-head", "mosaic_gpu-int8-vlast", "mosaic_gpu-fp8-vlast"])
def test_small_value_scales_keep_their_precision(interpret_mode, impl, kv_dtype, v_tokens_last, head_scales):
  # V scales ~1e-8 (a cache of values ~1e-6). Before, Triton's error was 0.67-0.84 (P times the scale, its f16
  # operand, fell below f16's normal range) and Mosaic GPU's queries as N 1.0-1.1 (scales floored at 2^-24); P
  # over the running max of the scales met, and a floor of 2^-64, keep ~1.7e-3, as at scales ~0.01.
  rng = np.random.default_rng(12)
  case = _quantized_case(12, kv_dtype, lengths=(100, 37, 128))
  shape = case.k.shape[2:3] if head_scales else case.k.shape[:3]
  k_scale = jnp.asarray(rng.uniform(0.01, 0.05, shape), jnp.float32)
  v_scale = jnp.asarray(rng.uniform(1e-8, 5e-8, shape), jnp.float32)
  v = jnp.moveaxis(case.v, 1, 3) if v_tokens_last else case.v   # [B, Hkv, D, T]
  out = pkv.decode_attention(case.q, case.k, v, case.lengths, k_scale=k_scale, v_scale=v_scale, impl=impl,
                             v_tokens_last=v_tokens_last)
  ref = pkv.decode_attention_reference(case.q.astype(jnp.float32), case.k, case.v, case.lengths, k_scale=k_scale,
                                       v_scale=v_scale)
  assert_matches_reference(out, ref, jnp.bfloat16, tolerance=5e-3)


def test_float32_queries_run_the_kernel_in_bfloat16(interpret_mode):
  case = _quantized_case(6, jnp.int8, num_queries=None, lengths=(90, 128))
  q = case.q.astype(jnp.float32)
  out = pkv.decode_attention(q, case.k, case.v, case.lengths, k_scale=0.02, v_scale=0.02, impl="triton",
                             config=KERNELS["triton"])
  assert out.dtype == jnp.float32
  ref = pkv.decode_attention_reference(q, case.k, case.v, case.lengths, k_scale=0.02, v_scale=0.02)
  assert_matches_reference(out, ref, jnp.bfloat16)


def test_auto_prefers_triton_for_one_byte_caches(monkeypatch):
  # Measured faster on the H200 (api.KERNEL_IMPLS); both serve the call.
  from pallas_kv import api
  monkeypatch.setattr(api, "device_can_run", lambda name: True)   # as on a Hopper GPU
  case = _quantized_case(7, jnp.int8)
  problem = pkv_problem(case)
  options = api.AttentionOptions(scale=0.1, k_scale="token", v_scale="token")
  for backend in api.KERNEL_IMPLS:
    assert api.kernel_backend(backend).unsupported_reason("decode", problem, options, (jnp.bfloat16, jnp.int8)) is None
  assert api.choose_impl("auto", "decode", problem, options, (jnp.bfloat16, jnp.int8), None)[0] == "triton"
  assert api.choose_impl("auto", "decode", problem, api.AttentionOptions(scale=0.1), (jnp.bfloat16, jnp.bfloat16),
                         None)[0] in ("mosaic_gpu", "triton")


def test_mosaic_gpu_serves_per_token_scales_of_two_kv_heads_on_pages_of_16(interpret_mode):
  # Scales of 2 kv heads: a token's 8 bytes are under a TMA row, and a head's run of 16 under TMA's 128-byte SMEM
  # alignment; the call pads them to 4-head rows.
  case = make_case(11, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   kv_dtype=jnp.int8, page_size=16)
  scale = jnp.asarray(np.random.default_rng(3).uniform(0.01, 0.03, case.k_pages.shape[:3]), jnp.float32)
  call = lambda impl: pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables,
                                                 case.lengths, k_scale=scale, v_scale=scale, impl=impl)
  assert_matches_reference(call("mosaic_gpu"), call("xla"), jnp.bfloat16)


def pkv_problem(case):
  from pallas_kv import validation
  return validation.validate_dense(case.q, case.k, case.v, case.lengths)


# ---------------------------------------------------------------- CUDA lowering (CPU)

@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("kind", ["head", "token"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=_name)
def test_triton_quantized_lowers_for_cuda(kv_dtype, kind, page_size):
  b, t, hq, hkv, d = 32, 4096, 32, 8, 128
  q = jax.ShapeDtypeStruct((b, hq, d), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), kv_dtype)
    args, op = (q, kv, kv), pkv.decode_attention
  else:
    kv = jax.ShapeDtypeStruct((b * t // page_size, page_size, hkv, d), kv_dtype)
    tables = jax.ShapeDtypeStruct((b, t // page_size), jnp.int32)
    args, op = (q, kv, kv, tables), pkv.paged_decode_attention
  scale = jax.ShapeDtypeStruct((hkv,) if kind == "head" else kv.shape[:3], jnp.float32)
  f = lambda *a: op(*a[:-3], a[-3], k_scale=a[-2], v_scale=a[-1], impl="triton")
  module = lower_for_cuda(f, *args, lengths, scale, scale).mlir_module()
  assert TRITON_CUSTOM_CALL in module
  # bf16 q meets the one-byte cache's float16 math inside the kernel: casting it first would be a launch.
  assert "stablehlo.convert" not in module


# ---------------------------------------------------------------- quantizing caches

@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=_name)
def test_quantize_round_trip_error_is_within_the_dtype_step(kv_dtype):
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 64)) * 3
  q, scale = kv_cache.quantize(x, kv_dtype)
  assert q.dtype == kv_dtype and scale.shape == (2, 5, 3)
  back = q.astype(jnp.float32) * scale[..., None]
  # int8: half a step of max|x| / 127; fp8: the mantissa's relative step (e4m3 3 bits, e5m2 2 bits).
  bound = {jnp.int8: 0.5 / 127, jnp.float8_e4m3fn: 2 ** -4, jnp.float8_e5m2: 2 ** -3}[kv_dtype]
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  err = jnp.abs(back - x)
  limit = bound * amax if kv_dtype == jnp.int8 else bound * jnp.maximum(jnp.abs(x), amax * 2 ** -6)
  assert bool(jnp.all(err <= limit + 1e-6))


@pytest.mark.parametrize("paged", [False, True])
def test_append_quantizes_and_writes_per_token_scales(paged):
  rng = np.random.default_rng(8)
  k_new = jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.float32)
  v_new = jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.float32)
  if paged:
    cache = pkv.PagedKVCache.create(batch=2, num_pages=6, page_size=4, max_pages_per_seq=3, num_kv_heads=2,
                                    head_dim=16, dtype=jnp.int8, k_scales="token", v_scales="token")
    pool, tables, ok = pkv.reserve_pages(pkv.PagePool.create(6), cache.block_tables, cache.lengths, 3, 4)
    cache = dataclasses.replace(cache, block_tables=tables)
    view = cache.append(k_new, v_new).dense_view()
  else:
    cache = pkv.KVCache.create(2, 8, 2, 16, dtype=jnp.int8, k_scales="token", v_scales="token")
    view = cache.append(k_new, v_new)
  k = view.k.astype(jnp.float32) * view.k_scale[..., None]
  np.testing.assert_allclose(k[:, :3], k_new, atol=float(jnp.max(jnp.abs(k_new))) / 127)
  assert view.k.dtype == jnp.int8 and int(view.lengths[0]) == 3
  np.testing.assert_array_equal(np.asarray(view.k[:, 3:4], np.float32), 0)   # the page's unwritten slot


def test_fixed_scales_and_bad_ones():
  cache = pkv.KVCache.create(1, 4, 2, 8, dtype=jnp.float8_e4m3fn, k_scales=jnp.asarray([0.5, 2.0]), v_scales=0.25)
  new = cache.append(jnp.full((1, 1, 2, 8), 1.0), jnp.full((1, 1, 2, 8), 1.0))
  np.testing.assert_allclose(np.asarray(new.k[0, 0], np.float32), [[2.0] * 8, [0.5] * 8])
  assert new.v_tokens_last   # the one-byte default
  np.testing.assert_allclose(np.asarray(new.with_v_tokens_last(False).v[0, 0], np.float32), 4.0)
  with pytest.raises(ValueError, match="scales must be None"):
    pkv.KVCache.create(1, 4, 2, 8, dtype=jnp.int8, k_scales="per-token")
  with pytest.raises(ValueError, match="floating-point values"):
    pkv.KVCache.create(1, 4, 2, 8, dtype=jnp.int8).append(jnp.ones((1, 1, 2, 8), jnp.int8),
                                                          jnp.ones((1, 1, 2, 8), jnp.int8))


# ---------------------------------------------------------------- accuracy against a bf16 cache

# Relative error of the attention output over a quantized cache (per-token scales) against the
# same values in a bf16 cache, on random data: what README's table reports.
QUANTIZED_ERROR_BOUND = {jnp.int8: 1e-2, jnp.float8_e4m3fn: 5e-2, jnp.float8_e5m2: 1e-1}


@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=_name)
def test_layer_with_a_quantized_cache_stays_close_to_bf16(kv_dtype):
  layer = pkv.DecodeAttention(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=64, impl="xla")
  params = layer.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (2, 40, 128))
  outs = {}
  for dtype in (jnp.bfloat16, kv_dtype):
    scales = "token" if dtype != jnp.bfloat16 else None
    cache = pkv.KVCache.create(2, 64, 2, 64, dtype=dtype, k_scales=scales, v_scales=scales)
    _, cache = jax.jit(layer.prefill)(params, x[:, :39], cache)   # one compile, not op by op
    outs[dtype], _ = jax.jit(layer)(params, x[:, 39:], cache)
  err = relative_error(outs[kv_dtype], outs[jnp.bfloat16])
  assert err < QUANTIZED_ERROR_BOUND[kv_dtype], err


# ---------------------------------------------------------------- on the GPU

_GPU_CASES = [(impl, kv_dtype, page) for impl in KERNELS for kv_dtype in (jnp.int8, jnp.float8_e4m3fn)
              for page in (None, 16, 64)]


@pytest.mark.gpu   # the GPU tier: each dtype once per backend, dense and paged
@pytest.mark.parametrize("impl,kv_dtype,page_size", tiered(
    _GPU_CASES, every_tier=[(impl, jnp.int8, 16) for impl in KERNELS]
    + [(impl, jnp.float8_e4m3fn, None) for impl in KERNELS]), ids=lambda v: _name(v) if isinstance(v, type) else str(v))
def test_gpu_quantized_matches_reference(impl, kv_dtype, page_size):
  rng = np.random.default_rng(9)
  case = make_case(10, batch=4, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_queries=2,
                   dtype=jnp.bfloat16, kv_dtype=kv_dtype, page_size=page_size)
  cache_shape = (case.k_pages if page_size else case.k).shape[:3]
  k_scale, v_scale = _scales(rng, "token", cache_shape)
  if page_size:
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
    op, ref_op = pkv.paged_decode_attention, pkv.paged_decode_attention_reference
  else:
    args = (case.q, case.k, case.v, case.lengths)
    op, ref_op = pkv.decode_attention, pkv.decode_attention_reference
  out = jax.jit(functools.partial(op, impl=impl, return_lse=True))(*args, k_scale=k_scale, v_scale=v_scale)
  ref = ref_op(case.q.astype(jnp.float32), *args[1:], k_scale=k_scale, v_scale=v_scale, return_lse=True)
  assert_matches_reference(out[0], ref[0], jnp.bfloat16)
  assert_lse_matches(out[1], ref[1], jnp.bfloat16)


