"""GPU checks every kernel backend must pass, at realistic sizes (run on a GPU; skipped elsewhere)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import check_against_reference, make_case

KERNEL_IMPLS = ["mosaic_gpu", "triton"]


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
