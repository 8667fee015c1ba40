"""The Mosaic GPU split merge (`kernels/mosaic_gpu/merge.py`), the ops' merge where Pallas Triton is gone: equal to
`frame.merge_splits` in GPU interpret mode (splits with no key whose partials hold NaN, a row with no key in any
split, LSEs padded past R, two row blocks, 16-bit partials, sinks), what it refuses and how the ops then merge,
how it blocks columns, its CUDA lowering, and on a GPU after the kernel's own partials."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import lower_for_cuda
from pallas_kv.kernels import frame
from pallas_kv.kernels.mosaic_gpu import backend
from pallas_kv.kernels.mosaic_gpu import merge


def _partials(seed, *, batch, heads, splits, rows, dv, lse_rows=None, dtype=jnp.float32):
  """Random partials and LSEs (LSE rows padded with NaN to lse_rows); split 1 of sequence 0 saw no key (NaN
  partials, lse -inf), and row 1 of the last sequence saw none in any split."""
  rng = np.random.default_rng(seed)
  out = rng.standard_normal((batch, heads, splits, rows, dv)).astype(np.float32)
  lse = (3 * rng.standard_normal((batch, heads, splits, lse_rows or rows))).astype(np.float32)
  lse[..., rows:] = np.nan
  if splits > 1:
    lse[0, :, 1], out[0, :, 1] = -np.inf, np.nan
  lse[-1, :, :, 1], out[-1, :, :, 1] = -np.inf, np.nan
  return jnp.asarray(out, dtype), jnp.asarray(lse)


def _check(got, got_lse, out, lse, rows, *, atol, sinks=None):
  want, want_lse = frame.merge_splits(out.astype(jnp.float32), lse[..., :rows], sinks)
  no_keys = np.isneginf(np.asarray(want_lse))
  want = np.where(no_keys[..., None], 0.0, np.asarray(want))   # merge_splits passes a lone split through as is
  got = np.asarray(got, np.float32)
  assert no_keys.any() and (got[no_keys] == 0).all() and not np.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=atol, rtol=atol)
  if got_lse is not None:
    np.testing.assert_array_equal(np.isneginf(got_lse), no_keys)
    np.testing.assert_allclose(np.asarray(got_lse)[~no_keys], np.asarray(want_lse)[~no_keys], rtol=1e-5, atol=1e-5)


def _sinks(seed, heads, rows):
  return jnp.asarray(2 * np.random.default_rng(seed).standard_normal((heads, rows)), jnp.float32)


@pytest.mark.parametrize("batch,heads,splits,rows,lse_rows,dv,dtype,return_lse,sinks", [
    (1, 2, 16, 4, 4, 128, jnp.float32, True, False),      # B1: 16 splits of 4 rows (a Llama head group)
    (3, 2, 5, 7, 8, 64, jnp.float32, False, False),       # group 7: LSEs padded to 8 (no merged LSE of 7 rows)
    (2, 1, 3, 128, 128, 32, jnp.bfloat16, True, False),   # two row blocks of 64, 16-bit partials
    (3, 2, 4, 8, 8, 64, jnp.float32, True, True),         # sinks per kv head and row
], ids=["b1-splits16", "rows7-lse8", "rowblocks2-bf16", "sinks"])
def test_mosaic_merge_equals_merge_splits(mosaic_interpret, batch, heads, splits, rows, lse_rows, dv, dtype,
                                          return_lse, sinks):
  out, lse = _partials(batch + splits, batch=batch, heads=heads, splits=splits, rows=rows, dv=dv,
                       lse_rows=lse_rows, dtype=dtype)
  sinks = _sinks(rows, heads, rows) if sinks else None
  got, got_lse = merge.merge_partials(out, lse, sinks, out_dtype=jnp.bfloat16, return_lse=return_lse,
                                      interpret=mosaic_interpret)
  assert got.shape == (batch, heads, rows, dv) and got.dtype == jnp.bfloat16
  assert (got_lse is not None) == return_lse
  _check(got, got_lse, out, lse, rows, atol=2e-2, sinks=sinks)


def test_mosaic_merge_refuses_what_it_cannot_merge():
  reason = lambda shape, lse_rows, dtype=jnp.float32, **kw: merge.unsupported_reason(
      shape, (*shape[:3], lse_rows), dtype, **{"rows": shape[3], "has_sinks": False, **kw})
  assert reason((1, 8, 16, 4, 128), 4) is None
  assert reason((1, 8, 16, 7, 128), 8, return_lse=False) is None
  assert reason((1, 8, 16, 4, 128), 4, has_sinks=True) is None
  assert "sinks of 7 rows: not a whole TMA row" in reason((1, 8, 16, 7, 128), 8, has_sinks=True, return_lse=False)
  assert "LSE of 7 rows: not a whole TMA row" in reason((1, 8, 16, 7, 128), 8)
  assert "takes 8" in reason((1, 8, 16, 7, 128), 7, return_lse=False)
  assert "whole blocks of 64" in reason((1, 1, 2, 96, 128), 96)
  assert "not float32 or a 16-bit" in reason((1, 8, 16, 4, 128), 4, jnp.int8)
  assert "do not fit SMEM" in reason((1, 8, 1024, 4, 128), 4)
  out, lse = _partials(0, batch=1, heads=1, splits=2, rows=7, lse_rows=8, dv=64)
  with pytest.raises(NotImplementedError, match="mosaic_gpu merge: a merged LSE of 7 rows"):
    merge.merge_partials(out, lse, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"sinks must be \[Hkv, R\]=\(1, 4\)"):
    merge.merge_partials(out[:, :, :, :4], lse[..., :4], jnp.zeros((2, 4)), out_dtype=jnp.bfloat16)


def test_the_ops_merge_in_xla_what_the_mosaic_merge_refuses():
  # Sinks of 7 rows (no whole TMA row): not the Mosaic GPU merge's; the ops' merge without Pallas Triton hands them
  # to XLA.
  out, lse = _partials(1, batch=2, heads=2, splits=3, rows=7, dv=64)
  sinks = _sinks(2, 2, 7)
  got, got_lse = backend.mosaic_merge(out, lse, sinks, rows=7, out_dtype=jnp.float32, return_lse=True)
  want, want_lse = frame.merge_splits(out, lse, sinks)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


def test_the_ops_merge_takes_sinks_to_the_mosaic_merge(interpret_mode):
  out, lse = _partials(4, batch=2, heads=2, splits=3, rows=4, dv=64)
  sinks = _sinks(4, 2, 4)
  got, got_lse = backend.mosaic_merge(out, lse, sinks, rows=4, out_dtype=jnp.float32, return_lse=True)
  _check(got, got_lse, out, lse, 4, atol=1e-5, sinks=sinks)
  unsunk, _ = backend.mosaic_merge(out, lse, None, rows=4, out_dtype=jnp.float32, return_lse=True)
  assert np.abs(np.asarray(unsunk) - np.asarray(got)).max() > 1e-3   # the sinks moved the output


def test_mosaic_merge_blocks_columns_to_fill_the_gpu():
  # B1 (8 pairs of 4 rows): 32-byte rows for 128 programs; B16 wide rows; many splits narrow ones to fit SMEM.
  assert merge.column_block(8, 16, 128, jnp.float32) == 8
  assert merge.column_block(128, 4, 128, jnp.float32) == 64
  assert merge.column_block(128, 64, 128, jnp.float32) == 8   # 64 splits x 64 rows x 64 f32 would be 1 MiB


@pytest.mark.parametrize("batch,splits,rows,lse_rows,sinks", [(1, 16, 4, 4, False), (8, 4, 7, 8, False),
                                                              (1, 64, 128, 128, False), (2, 4, 8, 8, True)])
def test_mosaic_merge_lowers_for_cuda(batch, splits, rows, lse_rows, sinks):
  SDS = jax.ShapeDtypeStruct
  args = [SDS((batch, 8, splits, rows, 128), jnp.float32), SDS((batch, 8, splits, lse_rows), jnp.float32)]
  args += [SDS((8, rows), jnp.float32)] if sinks else []
  exported = lower_for_cuda(lambda o, l, *s: merge.merge_partials(o, l, *s, out_dtype=jnp.bfloat16, return_lse=False),
                            *args)
  assert "pallas_kv_mosaic_merge_sp" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,splits,rows,lse_rows,sinks", [(1, 16, 4, 4, False), (8, 5, 7, 8, False),
                                                              (2, 3, 128, 128, False), (3, 6, 8, 8, True)])
def test_gpu_mosaic_merge_equals_merge_splits(batch, splits, rows, lse_rows, sinks):
  out, lse = _partials(splits, batch=batch, heads=8, splits=splits, rows=rows, dv=128, lse_rows=lse_rows)
  sinks = _sinks(rows, 8, rows) if sinks else None
  got, got_lse = jax.jit(lambda o, l, s: merge.merge_partials(o, l, s, out_dtype=jnp.float32, rows=rows,
                                                              return_lse=rows % 4 == 0))(out, lse, sinks)
  _check(got, got_lse, out, lse, rows, atol=1e-5, sinks=sinks)


def _op_merged_by_mosaic(monkeypatch, seed, *, with_sinks=False, **shape):
  """The Mosaic GPU op over a random case, its splits merged as without Pallas Triton, against the reference."""
  import pallas_kv as pkv
  from harness import check_against_reference, make_case
  monkeypatch.setattr(backend, "fused_merge", lambda: backend.mosaic_merge)
  case = make_case(seed, dtype=jnp.bfloat16, **shape)
  options = dict(sinks=_sinks(seed, 1, shape["num_heads"])[0]) if with_sinks else {}
  config = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=4)
  out_lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl="mosaic_gpu", config=config,
                                 return_lse=True, **options)
  check_against_reference(case, out_lse, **options)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_op_merged_by_mosaic_gpu_matches_the_reference(monkeypatch, interpret_mode, with_sinks):
  _op_merged_by_mosaic(monkeypatch, 3, batch=3, seq_len=512, num_heads=8, num_kv_heads=2, head_dim=64,
                       with_sinks=with_sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len", [(1, 32768), (6, 4096)])
def test_gpu_op_merged_by_mosaic_gpu_matches_the_reference(monkeypatch, batch, seq_len):
  _op_merged_by_mosaic(monkeypatch, batch, batch=batch, seq_len=seq_len, num_heads=32, num_kv_heads=8, head_dim=128)
