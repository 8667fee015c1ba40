"""Checks every kernel backend must pass: interpret mode on the CPU, and GPU runs at realistic sizes
(the `gpu` ones, skipped where there is no GPU). Backend-specific tests live in test_<backend>.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import assert_matches_reference, check_against_reference, make_case

KERNEL_IMPLS = ["mosaic_gpu", "triton"]
# A small tile each backend accepts, for interpret-mode cases.
SMALL_TILE = {"mosaic_gpu": 64, "triton": 32}


def _small_config(impl, num_splits):
  return pkv.DecodeConfig(block_kv=SMALL_TILE[impl], num_stages=2, num_splits=num_splits)


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_zero_lengths_interpret(interpret_mode, impl):
  case = make_case(6, batch=2, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[0, 0])
  out, lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl,
                                  config=_small_config(impl, 2))
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_fixed_splits_make_a_sequence_independent_of_its_batch(interpret_mode, impl):
  case = make_case(7, batch=3, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[256, 187, 120])
  f = functools.partial(pkv.decode_attention, impl=impl, config=_small_config(impl, 2))
  whole = f(case.q, case.k, case.v, case.lengths)
  alone = f(case.q[1:2], case.k[1:2], case.v[1:2], case.lengths[1:2])
  np.testing.assert_array_equal(np.asarray(whole[1:2], np.float32), np.asarray(alone, np.float32))


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_grad_uses_reference_backward(interpret_mode, impl):
  case = make_case(8, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  config = _small_config(impl, 1)
  loss = lambda which, q, k: pkv.decode_attention(q, k, case.v, case.lengths, impl=which,
                                                  config=config if which == impl else None).astype(jnp.float32).sum()
  grads = jax.grad(functools.partial(loss, impl), argnums=(0, 1))(case.q, case.k)
  want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1))(case.q, case.k)
  for g, w in zip(grads, want):
    assert_matches_reference(g, w, jnp.bfloat16)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_vmap_and_jit_match_a_loop_interpret(interpret_mode, impl):
  cases = [make_case(30 + i, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
           for i in range(2)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in cases])
  config = _small_config(impl, 2)
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl=impl, config=config)
  batched = jax.jit(jax.vmap(f))(stack("q"), stack("k"), stack("v"), stack("lengths"))
  for i, c in enumerate(cases):
    np.testing.assert_array_equal(np.asarray(batched[i], np.float32),
                                  np.asarray(f(c.q, c.k, c.v, c.lengths), np.float32))


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_quantized_cache_is_refused_with_reason(impl):
  case = make_case(10, batch=1, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=jnp.int8,
                   dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=f"{impl}.*int8"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=0.1, v_scale=0.1, impl=impl)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_mla_is_refused_with_reason(impl):
  case = make_case(11, batch=1, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                   dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="MLA"):
    pkv.mla_decode_attention(case.q, case.k_pages[:, :, 0], case.block_tables, case.lengths, v_head_dim=32,
                             impl=impl)


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("batch,seq_len,group", [(2, 4096, 4), (4, 2048, 8), (1, 8192, 16)])
def test_gpu_matches_reference(impl, batch, seq_len, group, page_size):
  case = make_case(batch * 7 + group, batch=batch, seq_len=seq_len, num_heads=4 * group, num_kv_heads=4,
                   head_dim=128, dtype=jnp.bfloat16, page_size=page_size, num_queries=2)
  if page_size is None:
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=impl)
  else:
    out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                     return_lse=True, impl=impl)
  check_against_reference(case, out)


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
  f = jax.jit(functools.partial(pkv.decode_attention, impl=impl, config=pkv.DecodeConfig(num_splits=4)))
  whole = f(case.q, case.k, case.v, case.lengths)
  alone = f(case.q[5:6], case.k[5:6], case.v[5:6], case.lengths[5:6])
  np.testing.assert_array_equal(np.asarray(whole[5:6], np.float32), np.asarray(alone, np.float32))
