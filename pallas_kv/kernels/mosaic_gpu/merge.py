"""The split merge as one Mosaic GPU launch: `frame.merge_splits` of the Mosaic GPU kernels' partials [B, Hkv,
splits, R, Dv] (GQA's, MLA's as one kv head) with no Pallas Triton, whose merge launch the ops use where it imports
(without either, XLA merges in several launches: docs/decisions.md#fused-merge).

A program merges one (sequence, kv head)'s block of up to 64 rows and a block of columns: every split's [rows,
columns] box and LSEs (and the head's sinks) land by TMA in SMEM, then the splits are added one after another in the
WGMMA register layout, each weighted by exp(lse - the rows' max). That layout spans 64 rows: a program of R = 4 rows
computes 60 it never stores, where stacking several heads' rows in one tile would take a copy a head and split (a 3-d
box seen as 2-d is a ref reshape, which GPU interpret mode does not take)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv import online_softmax
from pallas_kv.kernels import plan

ROWS = 64                                # the WGMMA register layout's rows: a program's row block
MIN_ROW_BYTES, MAX_ROW_BYTES = 32, 256   # each split's row of a column block, read by TMA
SMEM_BYTES = 160 * 1024                  # every split's box of partials
TARGET_PROGRAMS = 128                    # about one per SM of an H100 / H200
PARTIAL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_F32_PER_TMA_ROW = 4                     # a TMA box's row is a multiple of 16 bytes


def _block_rows(rows: int) -> tuple[int, int]:
  """(partial rows, LSE rows) a program copies: all R (LSEs padded to 16 bytes) within one block, else 64."""
  return (rows, plan.round_up(rows, _F32_PER_TMA_ROW)) if rows <= ROWS else (ROWS, ROWS)


def unsupported_reason(out_shape, lse_shape, partial_dtype, *, rows: int, has_sinks: bool,
                       return_lse: bool = True) -> str | None:
  """Why `merge_partials` cannot merge these partials (the caller then merges otherwise), or None."""
  _, _, splits, stored_rows, dv = out_shape
  if jnp.dtype(partial_dtype) not in PARTIAL_DTYPES:
    return f"partials in {jnp.dtype(partial_dtype)}, not float32 or a 16-bit dtype"
  if len(lse_shape) != 4 or tuple(lse_shape[:3]) != tuple(out_shape[:3]):
    return f"LSEs {tuple(lse_shape)} do not match the partials {tuple(out_shape)}"
  if not 1 <= rows <= stored_rows:
    return f"rows={rows} not in [1, {stored_rows}], the stored rows"
  if rows > ROWS and (rows % ROWS or stored_rows % ROWS or lse_shape[3] % ROWS):
    return f"{rows} rows: past {ROWS}, whole blocks of {ROWS} only"
  if _block_rows(rows)[1] > lse_shape[3]:
    return f"{lse_shape[3]} LSE rows stored: a TMA copy of {rows} takes {_block_rows(rows)[1]}"
  if (return_lse or has_sinks) and rows % _F32_PER_TMA_ROW:
    what = "a merged LSE" if return_lse else "sinks"
    return f"{what} of {rows} rows: not a whole TMA row of {_F32_PER_TMA_ROW}"
  if dv % 8:
    return f"value dim {dv} is not a multiple of 8"
  if splits * ROWS * _min_columns(partial_dtype) * jnp.dtype(partial_dtype).itemsize > SMEM_BYTES:
    return f"{splits} splits do not fit SMEM"
  return None


def _min_columns(dtype) -> int:
  return MIN_ROW_BYTES // jnp.dtype(dtype).itemsize


def column_block(blocks: int, splits: int, dv: int, dtype) -> int:
  """Columns a program merges: the widest power of two dividing dv, of at most 256 bytes a row and fitting SMEM,
  that still gives about TARGET_PROGRAMS programs over `blocks` row blocks (at least 32 bytes a row)."""
  itemsize = jnp.dtype(dtype).itemsize
  columns = MAX_ROW_BYTES // itemsize
  while columns > _min_columns(dtype) and (dv % columns or splits * ROWS * columns * itemsize > SMEM_BYTES
                                           or blocks * (dv // columns) < TARGET_PROGRAMS):
    columns //= 2
  return columns


def merged_rows(lse_of, part_of, *, splits: int, columns: int, sink=None):
  """(merged rows [64, columns] f32, their LSEs [64] over the real keys) of landed splits, in the WGMMA layout:
  lse_of(s) [64] (its rows' vector), part_of(s) [64, columns], sink: None or the rows' sink logits [64], which join
  the denominator. A split with lse -inf weighs 0 and its part (maybe NaN) is not used; a row with no key in any
  split merges to zeros and LSE -inf."""
  vector = plgpu.Layout.WGMMA.reduce(1)
  top = lax.fori_loop(0, splits, lambda s, m: jnp.maximum(m, lse_of(s)),
                      plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), vector))
  shift = jnp.where(top > -jnp.inf, top, 0.0)

  def add_split(s, carry):
    acc, norm = carry
    lse = lse_of(s)
    weight = jnp.exp(lse - shift)                    # 0 for a split with no key
    part = part_of(s).astype(jnp.float32)
    part = jnp.where(online_softmax.per_row(lse, part.shape) > -jnp.inf, part, 0.0)
    return acc + part * online_softmax.per_row(weight, part.shape), norm + weight

  start = (plgpu.layout_cast(jnp.zeros((ROWS, columns), jnp.float32), plgpu.Layout.WGMMA),
           plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), vector))
  acc, norm = lax.fori_loop(0, splits, add_split, start)
  has_keys = norm > 0
  # A sink far above every split's LSE overflows exp to inf: the row's output is then 0, as it nearly is.
  denom = norm if sink is None else norm + jnp.exp(sink - shift)
  merged = acc / online_softmax.per_row(jnp.where(has_keys, denom, 1.0), acc.shape)
  return merged, jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)


def _kernel(*refs, splits: int, rows: int, columns: int, has_sinks: bool, write_lse: bool):
  refs = list(refs)
  out_ref = refs.pop(0)                                  # [B * Hkv, splits, stored rows, Dv] GMEM: the partials
  lse_ref = refs.pop(0)                                  # [B * Hkv, splits, stored LSE rows] f32 GMEM
  sinks_ref = refs.pop(0) if has_sinks else None         # [Hkv, R] f32 GMEM
  merged_ref = refs.pop(0)                               # [B * Hkv, R, Dv] out dtype GMEM
  merged_lse_ref = refs.pop(0) if write_lse else None   # [B * Hkv, R] f32 GMEM
  parts_smem, lse_smem, sinks_smem, out_smem, lse_out_smem, loaded = refs
  pair, row_block, column = lax.axis_index("pairs"), lax.axis_index("rows"), lax.axis_index("columns")
  n_rows, n_lse = _block_rows(rows)
  first = row_block * ROWS
  cols = pl.ds(column * columns, columns)

  def fetch(s, _):   # split s's box of the block: [rows, columns] and its LSEs; rows past them stay unread
    plgpu.copy_gmem_to_smem(out_ref.at[pair, s, pl.ds(first, n_rows), cols], parts_smem.at[s, pl.ds(0, n_rows)],
                            loaded)
    plgpu.copy_gmem_to_smem(lse_ref.at[pair, s, pl.ds(first, n_lse)], lse_smem.at[s, pl.ds(0, n_lse)], loaded)
  lax.fori_loop(0, splits, fetch, None)
  if has_sinks:   # the kv head's sinks of these rows
    plgpu.copy_gmem_to_smem(sinks_ref.at[pair % sinks_ref.shape[0], pl.ds(first, n_lse)],
                            sinks_smem.at[pl.ds(0, n_lse)], loaded)
  plgpu.barrier_wait(loaded)

  vector = plgpu.Layout.WGMMA.reduce(1)
  lse_of = lambda s: plgpu.load(lse_smem.at[s], layout=vector)
  part_of = lambda s: plgpu.load(parts_smem.at[s], layout=plgpu.Layout.WGMMA)
  sink = plgpu.load(sinks_smem, layout=vector) if has_sinks else None
  merged, merged_lse = merged_rows(lse_of, part_of, splits=splits, columns=columns, sink=sink)
  out_smem[...] = merged.astype(out_smem.dtype)
  if write_lse:
    lse_out_smem[...] = merged_lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, n_rows)], merged_ref.at[pair, pl.ds(first, n_rows), cols])
  if write_lse:
    @pl.when(column == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_out_smem.at[pl.ds(0, n_rows)], merged_lse_ref.at[pair, pl.ds(first, n_rows)])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def merge_partials(out, lse, sinks=None, *, out_dtype, return_lse: bool = True, rows: int | None = None,
                   interpret=False):
  """`frame.merge_splits(out, lse)` in one Mosaic GPU launch, cast to out_dtype: the Triton merge's contract
  (`kernels/triton/merge.py`) where `unsupported_reason` accepts the call.

  Args:
    out: [B, Hkv, splits, >= R, Dv] float32 or 16-bit partials (where a split saw no key, any values).
    lse: [B, Hkv, splits, >= R] float32 (-inf where a split saw no key), its rows padded to 4 or as out's.
    sinks: None, or [Hkv, R] float32 sink logits, which join each row's denominator.
    out_dtype: the dtype of the merged output.
    return_lse: also return the merged LSE.
    rows: R, the rows to merge (default: all out's).
    interpret: False, or a plgpu.InterpretGPUParams (GPU interpret mode on the CPU).
  Returns:
    (out [B, Hkv, R, Dv] out_dtype, lse [B, Hkv, R] float32, or None where not return_lse).
  """
  if out.ndim != 5 or lse.ndim != 4 or lse.dtype != jnp.float32:
    raise ValueError(f"out [B, Hkv, splits, R, Dv] and float32 lse [B, Hkv, splits, R] expected, got "
                     f"{out.shape=} {lse.shape=} {lse.dtype=}")
  B, hkv, splits, stored_rows, dv = out.shape
  rows = stored_rows if rows is None else rows
  reason = unsupported_reason(out.shape, lse.shape, out.dtype, rows=rows, has_sinks=sinks is not None,
                              return_lse=return_lse)
  if reason:
    raise NotImplementedError(f"mosaic_gpu merge: {reason}")
  if sinks is not None and sinks.shape != (hkv, rows):
    raise ValueError(f"sinks must be [Hkv, R]=({hkv}, {rows}), got {sinks.shape=}")
  row_blocks = -(-rows // ROWS)
  columns = column_block(B * hkv * row_blocks, splits, dv, out.dtype)
  out_type = [jax.ShapeDtypeStruct((B * hkv, rows, dv), out_dtype)]
  if return_lse:
    out_type.append(jax.ShapeDtypeStruct((B * hkv, rows), jnp.float32))
  call = plgpu.kernel(
      functools.partial(_kernel, splits=splits, rows=rows, columns=columns, has_sinks=sinks is not None,
                        write_lse=return_lse),
      out_type=out_type,
      scratch_types=[plgpu.SMEM((splits, ROWS, columns), out.dtype), plgpu.SMEM((splits, ROWS), jnp.float32),
                     plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS, columns), out_dtype),
                     plgpu.SMEM((ROWS,), jnp.float32), plgpu.Barrier(num_arrivals=2 * splits + (sinks is not None))],
      grid=(B * hkv, row_blocks, dv // columns),
      grid_names=("pairs", "rows", "columns"),
      interpret=interpret or None,
      kernel_name=f"pallas_kv_mosaic_merge_sp{splits}_r{rows}_d{dv}_c{columns}",
  )
  args = [out.reshape(B * hkv, splits, stored_rows, dv), lse.reshape(B * hkv, splits, lse.shape[3])]
  if sinks is not None:
    args.append(sinks.astype(jnp.float32))
  results = call(*args)
  merged = results[0].reshape(B, hkv, rows, dv)
  return merged, results[1].reshape(B, hkv, rows) if return_lse else None
