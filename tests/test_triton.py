"""What only the Pallas Triton kernel has: its paged tiles (gathers, pages that are not powers of
two), row blocks, empty splits, more shapes lowered for CUDA, the hidden deprecation warning.
The checks every backend passes are in test_kernels.py."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kv as pkv
import sweeps
from harness import TRITON_CUSTOM_CALL, check_against_reference, lower_for_cuda, make_case
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels.triton import config as triton_config
from pallas_kv.kernels.triton import decode as triton_decode

IMPL = "triton"


def _paged(case, **kw):
  return pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                    return_lse=True, impl=IMPL, **kw)


# ---------------------------------------------------------------- interpret mode (CPU)

def test_paged_window_sinks_heuristic_config_interpret(interpret_mode):
  case = make_case(12, batch=2, seq_len=128, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   page_size=16, lengths=[128, 50])
  kw = dict(window=40, sinks=jnp.linspace(0.0, 1.0, 4))
  check_against_reference(case, _paged(case, **kw), **kw)


def test_row_blocks_interpret(interpret_mode):
  # 9 new tokens x 16 q heads = 144 packed rows: two programs of 128 rows per kv head.
  case = make_case(13, batch=1, seq_len=64, num_heads=16, num_kv_heads=1, head_dim=64, num_queries=9,
                   dtype=jnp.bfloat16, lengths=[60])
  assert triton_config.row_blocking(144, 64) == (128, 2)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL,
                             config=pkv.DecodeConfig(block_kv=16, num_stages=2, num_splits=2))
  check_against_reference(case, out)


def test_partials_of_empty_splits_interpret():
  # 40 tokens = 3 tiles of 16 over 4 splits: split 3 is empty, as is every split of length 0.
  case = make_case(14, batch=2, seq_len=64, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[0, 40])
  q = case.q.reshape(2, 1, 4, 64)
  out, lse = triton_decode.decode_partials(q, case.k, case.v, case.lengths, num_queries=1,
                                           options=AttentionOptions(scale=0.125),
                                           config=pkv.DecodeConfig(block_kv=16, num_stages=2, num_splits=4),
                                           interpret=True)
  assert out.shape == (2, 1, 4, 4, 64) and lse.shape == (2, 1, 4, 4)
  lse, out = np.asarray(lse), np.asarray(out)
  assert np.isneginf(lse[0]).all() and np.isneginf(lse[1, :, 3]).all() and np.isfinite(lse[1, :, :3]).all()
  np.testing.assert_array_equal(out[0], 0.0)
  np.testing.assert_array_equal(out[1, :, 3], 0.0)


def test_other_head_dims_and_page_sizes_are_refused_with_reason():
  case = make_case(15, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=96, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="triton.*head_dim 96"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=IMPL)
  case = make_case(16, batch=1, seq_len=72, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=24)
  with pytest.raises(NotImplementedError, match="page_size 24"):
    _paged(case)


def test_bad_explicit_configs_raise_value_error():
  case = make_case(17, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=48)
  with pytest.raises(ValueError, match="block_kv=32 must divide page_size=48"):
    _paged(case, config=pkv.DecodeConfig(block_kv=32))
  with pytest.raises(ValueError, match="kv_groups.*mosaic_gpu"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=IMPL,
                         config=pkv.DecodeConfig(kv_groups=2, num_splits=2))


# ---------------------------------------------------------------- CUDA lowering (CPU)

def _lower_triton(fn, *args):
  exported = lower_for_cuda(fn, *args)
  assert TRITON_CUSTOM_CALL in exported.mlir_module()
  return exported


@pytest.mark.parametrize("num_queries,head_dim,group,page_size", [
    (4, 128, 8, None), (1, 64, 16, 8), (1, 256, 4, 256), (16, 128, 16, 48), (16, 256, 16, None),
])
def test_other_shapes_lower_triton(num_queries, head_dim, group, page_size):
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  kw = dict(impl=IMPL, softcap=30.0, window=1024, sinks=jnp.zeros((2 * group,)))
  if page_size is None:
    kv = jax.ShapeDtypeStruct((2, 4000, 2, head_dim), jnp.float16)   # capacity not a multiple of any tile
    _lower_triton(functools.partial(pkv.decode_attention, **kw), q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((2 * 4800 // page_size + 3, page_size, 2, head_dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((2, 4800 // page_size), jnp.int32)
    _lower_triton(functools.partial(pkv.paged_decode_attention, **kw), q, pages, pages, tables, lengths)


def test_deprecation_warning_is_hidden_for_our_kernels_only():
  args, _ = sweeps.problem_args((32, 8), (8, 8192), None)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _lower_triton(functools.partial(pkv.decode_attention, impl=IMPL), *args)
  assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]

  def users_own_kernel(x):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

  with pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated"):
    _lower_triton(users_own_kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,page_size,block_kv", [(64, 8, 64), (256, 128, 32), (128, 48, 16), (128, 32, 128)])
def test_gpu_head_dims_and_pages(head_dim, page_size, block_kv):
  case = make_case(head_dim + page_size, batch=3, seq_len=1152, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                   dtype=jnp.float16, page_size=page_size, num_queries=3)
  check_against_reference(case, _paged(case, config=pkv.DecodeConfig(block_kv=block_kv, num_stages=3)))


@pytest.mark.gpu
def test_gpu_capacity_not_a_multiple_of_the_tile_and_row_blocks():
  case = make_case(2, batch=3, seq_len=4000, num_heads=64, num_kv_heads=4, head_dim=128, dtype=jnp.bfloat16,
                   num_queries=16, lengths=[4000, 3999, 17])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL)
  check_against_reference(case, out)


@pytest.mark.gpu
def test_gpu_auto_picks_triton_before_hopper():
  from pallas_kv import runtime
  if runtime.is_hopper_or_newer():
    pytest.skip("impl='auto' picks mosaic_gpu on Hopper and newer")
  case = make_case(5, batch=2, seq_len=1024, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
  pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == IMPL
