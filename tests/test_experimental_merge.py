"""The Mosaic GPU split merge, an experimental launch overlapped with the kernel before it
(`pallas_kv.experimental.mosaic_merge`; the ops merge with the Triton merge): equal to
`frame.merge_splits` in GPU interpret mode (empty splits whose partials hold NaN, rows with no key
at all, padded rows, one and many column blocks), after the MLA kernel's partials, what it refuses,
how it blocks, and its CUDA lowering at the MLA shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import lower_for_cuda
from pallas_kv.experimental import mosaic_merge as merge
from pallas_kv.kernels import frame
from test_mosaic_gpu_mla import QK, SMALL_QK, SMALL_V, V, _case, _check, _poisoned, config, plan_of

pytestmark = pytest.mark.experimental


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


@pytest.mark.parametrize("batch,heads,splits,rows,stored_rows,dv,dtype,return_lse", [
    (2, 1, 5, 128, 128, 64, jnp.bfloat16, True),     # two row blocks, column blocks of 8 (many programs wanted)
    (2, 1, 5, 128, 128, 64, jnp.bfloat16, False),    # ... without the merged lse
    (2, 2, 3, 64, 128, 64, jnp.float16, True),       # padded rows past R, two kv heads
    (1, 1, 1, 64, 64, 32, jnp.bfloat16, True),       # one split
], ids=["rowblocks2-splits5", "rowblocks2-splits5-no-lse", "padded-rows-hkv2-fp16", "one-split"])
def test_mosaic_merge_equals_merge_splits(interpret_mode, batch, heads, splits, rows, stored_rows, dv, dtype,
                                          return_lse):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  out, lse = _partials(batch + splits, batch=batch, heads=heads, splits=splits, rows=stored_rows, dv=dv,
                       dtype=dtype)
  ref, ref_lse = frame.merge_splits(out[:, :, :, :rows].astype(jnp.float32), lse[:, :, :, :rows])
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


def _overlapped_merge(q, pages, tables, lengths, *, qk_dim, v_dim, config, interpret=False):
  """(out, lse) of the MLA kernel's partials merged by the Mosaic GPU merge (q [B, (S,) Hq, Dqk])."""
  from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
  rows = q.reshape(q.shape[0], -1, qk_dim)
  num_queries = 1 if q.ndim == 3 else q.shape[1]
  out, lse = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=num_queries, v_head_dim=v_dim,
                                   scale=qk_dim ** -0.5, config=config, plan=plan_of(config), interpret=interpret)
  merged, merged_lse = merge.merge_partials(out[:, None], lse[:, None], None, rows=rows.shape[1], out_dtype=q.dtype,
                                            return_lse=True, interpret=interpret)
  return merged[:, 0].reshape(*q.shape[:-1], v_dim), merged_lse[:, 0].reshape(q.shape[:-1])


def test_mla_overlapped_merge_matches_reference():
  """The Mosaic GPU merge after the MLA kernel (interpret mode) at 64 packed rows (64 heads), with
  unwritten partials of empty splits (lengths 0 and 100 of 4 splits over 256) and NaN pages; two
  row blocks: test_mosaic_merge_equals_merge_splits."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  args = _case(3, batch=3, seq_len=256, num_heads=64, num_queries=None, page_size=64, lengths=[256, 0, 100])
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, 64)
  assert merge.unsupported_reason((3, 1, 4, 64, SMALL_V), q.dtype, rows=64, has_sinks=False) is None
  out = _overlapped_merge(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths, qk_dim=SMALL_QK, v_dim=SMALL_V,
                          config=config(4), interpret=plgpu.InterpretGPUParams())
  _check(args, out)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries", [(4, 4096, 128, None), (3, 8192, 64, 2)])
def test_gpu_mla_overlapped_merge_matches_reference(batch, seq_len, num_heads, num_queries):
  """The Mosaic GPU merge launch overlapped with the MLA kernel on the GPU: ragged, zero and short
  lengths leave splits with no key, whose partials are unwritten."""
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  lengths = [seq_len, 0, 100, seq_len // 3][:batch]
  args = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries, page_size=64,
               lengths=lengths, qk_dim=QK)
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, 64)
  out = jax.jit(functools.partial(_overlapped_merge, qk_dim=QK, v_dim=V, config=config(8)))(
      q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
  _check(args, out, v_head_dim=V)
