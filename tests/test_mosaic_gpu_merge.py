"""The Mosaic GPU split merge (kernels/mosaic_gpu/merge.py): equal to `split_k.merge_splits` in GPU
interpret mode (empty splits whose partials hold NaN, rows with no key at all, padded rows, one and
many column blocks), what it refuses, how it blocks, and its CUDA lowering at the MLA shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import lower_for_cuda
from pallas_kv.kernels import split_k
from pallas_kv.kernels.mosaic_gpu import merge


def _partials(seed, *, batch, heads, splits, rows, dv, dtype=jnp.bfloat16):
  """Random partials and LSEs; split 1 of sequence 0 saw no key (NaN partials, lse -inf), and row 3
  of the last sequence saw none in any split."""
  rng = np.random.default_rng(seed)
  out = rng.standard_normal((batch, heads, splits, rows, dv)).astype(np.float32)
  lse = (3 * rng.standard_normal((batch, heads, splits, rows))).astype(np.float32)
  if splits > 1:
    lse[0, :, 1], out[0, :, 1] = -np.inf, np.nan
  lse[-1, :, :, 3], out[-1, :, :, 3] = -np.inf, np.nan
  return jnp.asarray(out, dtype), jnp.asarray(lse)


@pytest.mark.parametrize("batch,heads,splits,rows,stored_rows,dv,dtype", [
    (2, 1, 5, 128, 128, 64, jnp.bfloat16),     # two row blocks, column blocks of 8 (many programs wanted)
    (3, 2, 3, 64, 128, 128, jnp.float16),      # padded rows past R, two kv heads
    (1, 1, 1, 64, 64, 32, jnp.bfloat16),       # one split
], ids=["rowblocks2-splits5", "padded-rows-hkv2-fp16", "one-split"])
@pytest.mark.parametrize("return_lse", [True, False])
def test_mosaic_merge_equals_merge_splits(interpret_mode, batch, heads, splits, rows, stored_rows, dv, dtype,
                                          return_lse):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  out, lse = _partials(batch + splits, batch=batch, heads=heads, splits=splits, rows=stored_rows, dv=dv,
                       dtype=dtype)
  ref, ref_lse = split_k.merge_splits(out[:, :, :, :rows].astype(jnp.float32), lse[:, :, :, :rows])
  got, got_lse = merge.merge_partials(out, lse, out_dtype=dtype, return_lse=return_lse, rows=rows,
                                      interpret=plgpu.InterpretGPUParams())
  assert got.shape == (batch, heads, rows, dv) and got.dtype == dtype
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  # A row no split saw a key of merges to zeros (merge_splits passes a lone split through as is).
  no_keys = np.isneginf(np.asarray(ref_lse))
  ref = np.where(no_keys[..., None], 0.0, ref)
  assert no_keys.sum() == heads and (got[no_keys] == 0).all()
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
  if return_lse:
    got_lse, ref_lse = np.asarray(got_lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
  else:
    assert got_lse is None


def test_mosaic_merge_refuses_what_it_cannot_merge():
  shape = (1, 1, 4, 128, 512)
  assert merge.unsupported_reason(shape, jnp.bfloat16, rows=128, has_sinks=False) is None
  assert "not whole blocks of 64" in merge.unsupported_reason(shape, jnp.bfloat16, rows=16, has_sinks=False)
  assert "sinks" in merge.unsupported_reason(shape, jnp.bfloat16, rows=128, has_sinks=True)
  assert "not a 16-bit dtype" in merge.unsupported_reason(shape, jnp.float32, rows=128, has_sinks=False)
  out = jnp.zeros((1, 1, 2, 16, 512), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="mosaic_gpu merge: 16 rows of 16"):
    merge.merge_partials(out, jnp.zeros(out.shape[:4], jnp.float32), out_dtype=jnp.bfloat16)


def test_mosaic_merge_blocks_columns_to_fill_the_gpu():
  # B1 MLA at 128 heads (two row blocks): narrow blocks for ~128 programs; B16 wide ones.
  assert merge.column_block(1, 64, 128, 512) == merge.MIN_COLUMNS
  assert merge.column_block(16, 4, 128, 512) == 64
  assert merge.column_block(16, 64, 128, 512) == 16   # 64 splits x 64 rows x 64 columns would be 512 KiB


@pytest.mark.parametrize("batch,splits,rows", [(1, 64, 128), (16, 4, 128), (4, 16, 256)])
def test_mosaic_merge_lowers_for_cuda(batch, splits, rows):
  exported = lower_for_cuda(lambda o, l: merge.merge_partials(o, l, out_dtype=jnp.bfloat16),
                            jax.ShapeDtypeStruct((batch, 1, splits, rows, 512), jnp.bfloat16),
                            jax.ShapeDtypeStruct((batch, 1, splits, rows), jnp.float32))
  assert "pallas_kv_mgpu_merge" in exported.mlir_module()
