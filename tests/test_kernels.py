"""Checks every kernel backend must pass, parameterized by backend: interpret mode on the CPU, and
GPU runs at realistic sizes (the `gpu` ones, skipped where there is no GPU). What only one backend
has (its variants, its page-size rules, its CUDA lowering) lives in test_<backend>.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
import sweeps
from harness import TRITON_CUSTOM_CALL, assert_lse_matches, assert_matches_reference, check_against_reference
from harness import attend, lower_for_cuda, make_case
from harness import poison_unread_slots, tiered
from pallas_kv.kernels.mosaic_gpu import config as mosaic_gpu_config
from pallas_kv.kernels.triton import config as triton_config

KERNEL_IMPLS = ["mosaic_gpu", "triton"]
# A small tile each backend accepts, for interpret-mode cases.
SMALL_TILE = {"mosaic_gpu": 64, "triton": 32}
# A context of 5 small tiles that each backend takes: Triton's is not a multiple of its tile (the
# last tile runs past the cache); Mosaic GPU's TMA boxes stay inside it.
SMALL_CONTEXT = {"mosaic_gpu": 320, "triton": 200}


# How each backend fills in a config (explicit > tuned > heuristic), and what marks its kernel in
# a module lowered for CUDA (not a fallback to XLA).
RESOLVE_CONFIG = {"mosaic_gpu": mosaic_gpu_config.resolve_config, "triton": triton_config.resolve_config}
CONFIG_TYPE = {"mosaic_gpu": pkv.MosaicGPUConfig, "triton": pkv.TritonConfig}
KERNEL_IN_MODULE = {"mosaic_gpu": "custom_call @mosaic_gpu", "triton": TRITON_CUSTOM_CALL}


def _small_config(impl, num_splits, num_stages=2):
  return CONFIG_TYPE[impl](block_kv=SMALL_TILE[impl], num_stages=num_stages, num_splits=num_splits)


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("group,num_queries,num_splits,dtype", [
    (1, None, 1, jnp.bfloat16), (4, None, 3, jnp.bfloat16), (8, 2, 2, jnp.bfloat16), (4, 3, 1, jnp.float16),
], ids=["mha", "gqa4-splits3", "gqa8-s2-splits2", "gqa4-s3-fp16"])
def test_dense_interpret(interpret_mode, impl, group, num_queries, num_splits, dtype):
  t = SMALL_CONTEXT[impl]
  case = make_case(group * 10 + num_splits, batch=3, seq_len=t, num_heads=2 * group, num_kv_heads=2,
                   head_dim=64, num_queries=num_queries, dtype=dtype, lengths=[t, t // 2 - 13, 0])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl,
                             config=_small_config(impl, num_splits))
  check_against_reference(case, out)


# Mosaic GPU: 8 and 16 fill one 64-token tile with several TMA copies, 64 is one copy.
# Triton (tile 32): 8 and 16 are gathered token by token, a page of 64 holds two tiles.
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_paged_interpret_shuffled(interpret_mode, impl, page_size):
  case = make_case(page_size, batch=2, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=[201, 256])
  out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                   return_lse=True, impl=impl, config=_small_config(impl, 2, num_stages=3))
  check_against_reference(case, out)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_options_interpret(interpret_mode, impl):
  t = SMALL_CONTEXT[impl]
  case = make_case(5, batch=2, seq_len=t, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, lengths=[t, 95])
  kw = dict(softcap=1.5, window=70, sinks=jnp.linspace(-1.0, 2.0, 8), scale=0.2)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl,
                             config=_small_config(impl, 3), **kw)
  check_against_reference(case, out, **kw)


_GARBAGE_CASES = [(None, None, None), (None, 3, 50), (16, 2, None), (64, None, None)]


@pytest.mark.parametrize("impl,page_size,num_queries,window", tiered(   # each case on one backend, alternating
    [(i, *case) for case in _GARBAGE_CASES for i in KERNEL_IMPLS],
    every_tier=[(KERNEL_IMPLS[n % 2], *case) for n, case in enumerate(_GARBAGE_CASES)]))
def test_garbage_in_unread_slots_never_reaches_an_output(interpret_mode, impl, page_size, num_queries, window):
  # NaN / inf past each length, in pages no live entry names, behind -1 table entries (page size
  # below, at and above the tile), against the reference on the clean values.
  t = SMALL_CONTEXT[impl] if page_size is None else 256
  case = make_case(7, batch=3, seq_len=t, num_heads=4, num_kv_heads=2, head_dim=64, num_queries=num_queries,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=[t - 37, 70, 0])
  bad = poison_unread_slots(case)
  config = _small_config(impl, 2)
  if page_size is None:
    out = pkv.decode_attention(bad.q, bad.k, bad.v, bad.lengths, window=window, return_lse=True, impl=impl,
                               config=config)
  else:
    out = pkv.paged_decode_attention(bad.q, bad.k_pages, bad.v_pages, bad.block_tables, bad.lengths,
                                     return_lse=True, impl=impl, config=config)
  check_against_reference(case, out, window=window)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_zero_lengths_interpret(interpret_mode, impl):
  case = make_case(6, batch=2, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[0, 0])
  out, lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl,
                                  config=_small_config(impl, 2))
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("impl", tiered([(i,) for i in KERNEL_IMPLS], every_tier=[("mosaic_gpu",)]))
def test_fixed_splits_make_a_sequence_independent_of_its_batch(interpret_mode, impl):
  case = make_case(7, batch=3, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[256, 187, 120])
  f = functools.partial(pkv.decode_attention, impl=impl, config=_small_config(impl, 2))
  whole = f(case.q, case.k, case.v, case.lengths)
  alone = f(case.q[1:2], case.k[1:2], case.v[1:2], case.lengths[1:2])
  np.testing.assert_array_equal(np.asarray(whole[1:2], np.float32), np.asarray(alone, np.float32))


@pytest.mark.parametrize("impl", tiered([(i,) for i in KERNEL_IMPLS], every_tier=[("triton",)]))
def test_grad_uses_xla_backward(interpret_mode, impl):
  case = make_case(8, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  config = _small_config(impl, 1)
  loss = lambda which, q, k: pkv.decode_attention(q, k, case.v, case.lengths, impl=which,
                                                  config=config if which == impl else None).astype(jnp.float32).sum()
  grads = jax.grad(functools.partial(loss, impl), argnums=(0, 1))(case.q, case.k)
  want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1))(case.q, case.k)
  for g, w in zip(grads, want):
    assert_matches_reference(g, w, jnp.bfloat16)


@pytest.mark.parametrize("impl", tiered([(i,) for i in KERNEL_IMPLS], every_tier=[("triton",)]))
def test_vmap_and_jit_match_a_loop_interpret(interpret_mode, impl):
  cases = [make_case(30 + i, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
           for i in range(2)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in cases])
  config = _small_config(impl, 2)
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl=impl, config=config)
  batched = jax.jit(jax.vmap(f))(stack("q"), stack("k"), stack("v"), stack("lengths"))
  one_call = jax.jit(f)   # one compile for both elements
  for i, c in enumerate(cases):
    np.testing.assert_array_equal(np.asarray(batched[i], np.float32),
                                  np.asarray(one_call(c.q, c.k, c.v, c.lengths), np.float32))


def _launches(impl, f, *args):
  """(decode kernel launches, whether one sits in a loop) of f(*args) lowered for CUDA; the
  Triton split merge's own launch is not counted."""
  with pkv.interpret(False):
    module = lower_for_cuda(f, *args).mlir_module()
  calls = [line for line in module.splitlines() if KERNEL_IN_MODULE[impl] in line]
  return sum("pallas_kv_triton_merge" not in line for line in calls), "stablehlo.while" in module


@pytest.mark.parametrize("impl,pool", tiered([(i, pool) for i in KERNEL_IMPLS for pool in ("shared", "per_element")],
                                             every_tier=[("triton", "shared"), ("mosaic_gpu", "per_element")]))
def test_paged_vmap_folds_into_one_launch(interpret_mode, impl, pool):
  cases = [make_case(50 + i, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                     page_size=16, num_queries=2) for i in range(2)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in cases])
  config = _small_config(impl, 2)
  f = lambda q, kp, vp, t, n: pkv.paged_decode_attention(q, kp, vp, t, n, impl=impl, config=config, return_lse=True)
  if pool == "shared":   # one pool; every element's tables point into it (the first case's)
    axes, args = (0, None, None, 0, 0), (stack("q"), cases[0].k_pages, cases[0].v_pages,
                                         jnp.stack([cases[0].block_tables] * 2), stack("lengths"))
  else:
    axes, args = (0, 0, 0, 0, 0), tuple(stack(n) for n in ("q", "k_pages", "v_pages", "block_tables", "lengths"))
  vf = jax.jit(jax.vmap(f, in_axes=axes))
  assert _launches(impl, vf, *args) == (1, False)
  out, lse = vf(*args)
  one_call = jax.jit(f)   # one compile for both elements
  for i in range(2):
    one = [a if ax is None else a[i] for a, ax in zip(args, axes)]
    want_out, want_lse = one_call(*one)
    np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))


@pytest.mark.parametrize("impl", tiered([(i,) for i in KERNEL_IMPLS], every_tier=[("mosaic_gpu",)]))
def test_vmap_of_a_shared_contiguous_cache_loops(interpret_mode, impl):
  # Folding would copy the shared cache once per element: it stays a loop of launches.
  case = make_case(53, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  qs = jnp.stack([case.q, case.q * 2])
  f = lambda q: pkv.decode_attention(q, case.k, case.v, case.lengths, impl=impl, config=_small_config(impl, 1))
  assert _launches(impl, jax.vmap(f), qs) == (1, True)
  out = jax.vmap(f)(qs)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(f(qs[1]), np.float32))


@pytest.mark.parametrize("impl", tiered([(i,) for i in KERNEL_IMPLS], every_tier=[("triton",)]))
def test_nested_vmap_and_grad_of_vmap_fold(interpret_mode, impl):
  cases = [[make_case(60 + 2 * i + j, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64,
                      dtype=jnp.bfloat16) for j in range(2)] for i in range(2)]
  stack = lambda name: jnp.stack([jnp.stack([getattr(c, name) for c in row]) for row in cases])
  config = _small_config(impl, 1)
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl=impl, config=config)
  args = tuple(stack(n) for n in ("q", "k", "v", "lengths"))
  vv = jax.jit(jax.vmap(jax.vmap(f)))
  assert _launches(impl, vv, *args) == (1, False)
  out = vv(*args)
  np.testing.assert_array_equal(np.asarray(out[1, 0], np.float32),
                                np.asarray(f(*(a[1, 0] for a in args)), np.float32))
  loss = lambda q, k, v, n: f(q, k, v, n).astype(jnp.float32).sum()
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(*(a[0] for a in args))
  want = jax.grad(loss, argnums=(0, 1))(*(a[0, 1] for a in args))   # the second element's
  for g, w in zip(grads, want):
    assert_matches_reference(g[1], w, jnp.bfloat16)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_scales_on_a_16_bit_cache_are_refused_with_reason(impl):
  case = make_case(10, batch=1, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  # Refused for every impl, before a backend is chosen: scales only mean something on one-byte caches.
  with pytest.raises(ValueError, match="k_scale=0.1 must be None for a bfloat16 cache"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=0.1, v_scale=0.1, impl=impl)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_mla_is_refused_with_reason(impl):
  case = make_case(11, batch=1, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                   dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="MLA"):
    pkv.mla_decode_attention(case.q, case.k_pages[:, :, 0], case.block_tables, case.lengths, v_head_dim=32,
                             impl=impl)


# ---------------------------------------------------------------- CUDA lowering (CPU)

def _lower(impl, op, config, args):
  exported = lower_for_cuda(functools.partial(op, impl=impl, config=config), *args)
  module = exported.mlir_module()
  assert KERNEL_IN_MODULE[impl] in module and "pallas_kv" in module  # our kernel, not a fallback


@pytest.mark.parametrize("impl,heads,case,page_size", [   # every distinct heuristic kernel of the sweep
    pytest.param(impl, *shape, id=f"{sweeps.shape_id(*shape)}-{impl}") for impl in KERNEL_IMPLS
    for shape in sweeps.distinct_kernel_shapes(impl, RESOLVE_CONFIG[impl])])
def test_heuristic_configs_lower_for_cuda(impl, heads, case, page_size):
  args, problem = sweeps.problem_args(heads, case, page_size)
  config = RESOLVE_CONFIG[impl](problem, None, num_sms=132)
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  _lower(impl, op, config, args)


@pytest.mark.parametrize("impl,case,config", [
    pytest.param(impl, case, config, id=f"{impl}-b{case[0]}-t{case[1]}")
    for impl in KERNEL_IMPLS for case, config in sweeps.shipped_tuned_configs(impl)])
def test_shipped_tuned_configs_lower_for_cuda(impl, case, config):
  # impl="auto" runs these on the GPUs the package ships tuned files for (pallas_kv/tuned/*.json).
  assert config is not None, f"a tuned file of the package has no {impl} entry for a shape it was tuned on"
  args, problem = sweeps.problem_args(sweeps.sweep_heads()[0], case, None)
  _lower(impl, pkv.decode_attention, RESOLVE_CONFIG[impl](problem, config, num_sms=132), args)



@pytest.mark.parametrize("impl,case,config", [
    pytest.param(impl, case, config, id=f"{impl}-b{case[0]}-t{case[1]}")
    for impl in KERNEL_IMPLS for case, config in sweeps.shipped_tuned_configs(impl, sweeps.HELDOUT_SWEEP)])
def test_tuned_configs_at_shapes_between_the_tuned_ones_lower_for_cuda(impl, case, config):
  # At a shape it was not tuned on, auto takes the nearest tuned entry (or the heuristic's, None).
  args, problem = sweeps.problem_args(sweeps.sweep_heads()[0], case, None)
  _lower(impl, pkv.decode_attention, RESOLVE_CONFIG[impl](problem, config, num_sms=132), args)

def _check_hostile_lengths_and_page_ids(impl, *, seq_len, num_heads, num_kv_heads, head_dim, configs):
  """Lengths below 0 and past the capacity, and table entries out of the pool inside a sequence's
  range: the kernels clamp them (no launch before the kernel does), so every config gives the
  reference's result on the clamped values, dense and paged."""
  case = make_case(77, batch=3, seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, dtype=jnp.bfloat16, page_size=16, lengths=[seq_len, seq_len, seq_len])
  lengths = jnp.asarray([-7, 10**6, 37], jnp.int32)
  clamped = jnp.clip(lengths, 0, seq_len)
  num_pages = case.k_pages.shape[0]
  tables = case.block_tables.at[2, 1].set(10**6).at[2, 2].set(-1)
  f32 = lambda x: x.astype(jnp.float32)
  for config in configs:
    dense = pkv.decode_attention(case.q, case.k, case.v, lengths, return_lse=True, impl=impl, config=config)
    want = pkv.decode_attention_reference(f32(case.q), f32(case.k), f32(case.v), clamped, return_lse=True)
    assert_matches_reference(dense[0], want[0], jnp.bfloat16)
    assert_lse_matches(dense[1], want[1], jnp.bfloat16)
    paged = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, tables, lengths, return_lse=True,
                                       impl=impl, config=config)
    want = pkv.paged_decode_attention_reference(f32(case.q), f32(case.k_pages), f32(case.v_pages),
                                                jnp.clip(tables, 0, num_pages - 1), clamped, return_lse=True)
    assert_matches_reference(paged[0], want[0], jnp.bfloat16)
    assert_lse_matches(paged[1], want[1], jnp.bfloat16)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_hostile_lengths_and_page_ids_are_clamped_interpret(interpret_mode, impl):
  _check_hostile_lengths_and_page_ids(impl, seq_len=SMALL_CONTEXT[impl] // 32 * 32, num_heads=4, num_kv_heads=2,
                                      head_dim=64, configs=[_small_config(impl, 2)])


# ---------------------------------------------------------------- on the GPU

# The GPU tier runs each page size and each shape once per backend; the whole product is slow.
_GPU_SHAPES = [(2, 4096, 4), (4, 2048, 8), (1, 8192, 16)]
_GPU_CASES = [(impl, *shape, page) for impl in KERNEL_IMPLS for shape in _GPU_SHAPES for page in (None, 16, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,batch,seq_len,group,page_size", tiered(
    _GPU_CASES, every_tier=[(impl, *shape, page) for impl in KERNEL_IMPLS
                            for shape, page in zip(_GPU_SHAPES, (None, 16, 64))]))
def test_gpu_matches_reference(impl, batch, seq_len, group, page_size):
  case = make_case(batch * 7 + group, batch=batch, seq_len=seq_len, num_heads=4 * group, num_kv_heads=4,
                   head_dim=128, dtype=jnp.bfloat16, page_size=page_size, num_queries=2)
  check_against_reference(case, attend(case, return_lse=True, impl=impl))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_gpu_hostile_lengths_and_page_ids_are_clamped(impl):
  # One split (the kernel writes the output) and four (the merge kernel), at a realistic size.
  _check_hostile_lengths_and_page_ids(impl, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                                      configs=[CONFIG_TYPE[impl](num_splits=1), CONFIG_TYPE[impl](num_splits=4)])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_gpu_options_and_bit_identical_reruns(impl):
  case = make_case(3, batch=4, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                   num_queries=3)
  kw = dict(softcap=20.0, window=1000, sinks=jnp.linspace(-1.0, 1.0, 32))
  f = jax.jit(functools.partial(pkv.decode_attention, impl=impl, return_lse=True, **kw))
  first = f(case.q, case.k, case.v, case.lengths)
  check_against_reference(case, first, **kw)
  again = f(case.q, case.k, case.v, case.lengths)
  np.testing.assert_array_equal(np.asarray(first[0], np.float32), np.asarray(again[0], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_gpu_fixed_splits_batch_1_equals_batch_64(impl):
  case = make_case(4, batch=64, seq_len=2048, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
  f = jax.jit(functools.partial(pkv.decode_attention, impl=impl, config=CONFIG_TYPE[impl](num_splits=4)))
  whole = f(case.q, case.k, case.v, case.lengths)
  alone = f(case.q[5:6], case.k[5:6], case.v[5:6], case.lengths[5:6])
  np.testing.assert_array_equal(np.asarray(whole[5:6], np.float32), np.asarray(alone, np.float32))
