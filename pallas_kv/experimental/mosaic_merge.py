"""The split merge as a Mosaic GPU launch that overlaps the kernel before it (programmatic dependent launch):
`frame.merge_splits` for 16-bit MLA partials.

The split-K kernel lets its dependents launch as it starts (`plgpu.griddepcontrol_launch_dependents`); this
launch's programs take SMs as the kernel's leave them and wait (`plgpu.griddepcontrol_wait`) only for its memory.
One program per (sequence x kv head, 64-row block, column block) TMA-copies its block of every split's LSEs and
partials into SMEM, weights each split by exp(lse - max) (a split with no key weighs 0, its possibly unwritten
partial never added), and writes the merged rows and, from the first column block, the merged LSE.

Not the ops' merge: the Triton merge launch is faster (docs/decisions.md#mla-merge-not-overlapped), with many more,
smaller programs than this one, whose programs each add every split one after another. Likely levers: wider rows
with the splits streamed through a ring, or a register layout finer than WGMMA's 64 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kv.kernels.mosaic_gpu import merge as mgpu_merge

ROWS = 64                         # rows per program: the WGMMA register layout's
MIN_COLUMNS, MAX_COLUMNS = 8, 64  # a column block: 16 to 128 bytes of each 16-bit row
PARTS_SMEM_BYTES = 128 * 1024     # the [splits, 64, columns] block of partials
TARGET_PROGRAMS = 128             # about one per SM of an H100 / H200
PARTIAL_DTYPES = (jnp.bfloat16, jnp.float16)


def unsupported_reason(out_shape, out_dtype, *, rows: int, has_sinks: bool) -> str | None:
  """Why `merge_partials` cannot merge these partials (then the caller merges otherwise), or None."""
  _, _, splits, stored_rows, dv = out_shape
  if has_sinks:
    return "sinks join the denominator: not merged here"
  if jnp.dtype(out_dtype) not in PARTIAL_DTYPES:
    return f"partials in {jnp.dtype(out_dtype)}, not a 16-bit dtype"
  if rows % ROWS or stored_rows % ROWS:
    return f"{rows} rows of {stored_rows}: not whole blocks of {ROWS}"
  if dv % MIN_COLUMNS:
    return f"value dim {dv} is not a multiple of {MIN_COLUMNS}"
  if splits * ROWS * MIN_COLUMNS * 2 > PARTS_SMEM_BYTES:
    return f"{splits} splits do not fit SMEM"
  return None


def column_block(batch_heads: int, splits: int, rows: int, dv: int) -> int:
  """Columns per program: the widest power of two dividing dv, at most MAX_COLUMNS and fitting
  SMEM, that still gives about TARGET_PROGRAMS programs (at least MIN_COLUMNS)."""
  columns = MAX_COLUMNS
  while columns > MIN_COLUMNS and (dv % columns or splits * ROWS * columns * 2 > PARTS_SMEM_BYTES
                                   or batch_heads * (rows // ROWS) * (dv // columns) < TARGET_PROGRAMS):
    columns //= 2
  return columns


def _kernel(out_ref,      # [BH * splits, stored_rows, Dv] 16-bit GMEM: the partials
            lse_ref,      # [BH * splits, stored_rows] f32 GMEM
            merged_ref,   # [BH, R, Dv] out dtype GMEM
            *refs, splits: int, columns: int, write_lse: bool, interpret: bool):
  refs = list(refs)
  merged_lse_ref = refs.pop(0) if write_lse else None   # [BH, R] f32 GMEM
  parts_smem, lse_smem, out_smem, lse_out_smem, loaded = refs
  bh, row_block, column = lax.axis_index("bh"), lax.axis_index("rows"), lax.axis_index("columns")
  rows, cols = pl.ds(row_block * ROWS, ROWS), pl.ds(column * columns, columns)
  if not interpret:   # the kernel before this launch has finished and its writes are visible
    plgpu.griddepcontrol_wait()
  # (sequence x kv head, split) flattened: 3-d copies, which TMA takes at any column block
  splits_of_bh = pl.ds(bh * splits, splits)
  plgpu.copy_gmem_to_smem(lse_ref.at[splits_of_bh, rows], lse_smem, loaded)
  plgpu.copy_gmem_to_smem(out_ref.at[splits_of_bh, rows, cols], parts_smem, loaded)
  plgpu.barrier_wait(loaded)

  lse_of = lambda s: plgpu.load(lse_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(1))
  part_of = lambda s: plgpu.load(parts_smem.at[s], layout=plgpu.Layout.WGMMA)
  merged, merged_lse = mgpu_merge.merged_rows(lse_of, part_of, splits=splits, columns=columns)
  out_smem[...] = merged.astype(out_smem.dtype)
  if write_lse:
    lse_out_smem[...] = merged_lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, merged_ref.at[bh, rows, cols])
  if write_lse:
    @pl.when(column == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_out_smem, merged_lse_ref.at[bh, rows])
  plgpu.wait_smem_to_gmem(0)


def merge_partials(out, lse, sinks=None, *, out_dtype, return_lse: bool = True, rows: int | None = None,
                   interpret=False):
  """`frame.merge_splits(out, lse)` in one launch overlapped with the kernel before it, cast to
  out_dtype. The same contract as the Triton merge (`kernels/triton/merge.py`) where
  `unsupported_reason` accepts the call.

  Args:
    out: [B, Hkv, splits, >= R, Dv] 16-bit partials (where a split saw no key, any values).
    lse: [B, Hkv, splits, >= R] float32 (-inf where a split saw no key).
    sinks: must be None.
    out_dtype: the dtype of the merged output.
    return_lse: also return the merged LSE.
    rows: R, the rows to merge (default all).
    interpret: False, or a plgpu.InterpretGPUParams (GPU interpret mode on the CPU).
  Returns:
    (out [B, Hkv, R, Dv] out_dtype, lse [B, Hkv, R] float32 or None when not return_lse).
  """
  if out.ndim != 5 or lse.shape != out.shape[:4] or lse.dtype != jnp.float32:
    raise ValueError(f"out [B, Hkv, splits, R, Dv] and float32 lse [B, Hkv, splits, R] expected, got "
                     f"{out.shape=} {lse.shape=} {lse.dtype=}")
  B, hkv, splits, stored_rows, dv = out.shape
  rows = stored_rows if rows is None else rows
  reason = unsupported_reason(out.shape, out.dtype, rows=rows, has_sinks=sinks is not None)
  if reason:
    raise NotImplementedError(f"mosaic_gpu merge: {reason}")
  columns = column_block(B * hkv, splits, rows, dv)
  out_type = [jax.ShapeDtypeStruct((B * hkv, rows, dv), out_dtype)]
  if return_lse:
    out_type.append(jax.ShapeDtypeStruct((B * hkv, rows), jnp.float32))
  call = plgpu.kernel(
      functools.partial(_kernel, splits=splits, columns=columns, write_lse=return_lse, interpret=bool(interpret)),
      out_type=out_type,
      scratch_types=[plgpu.SMEM((splits, ROWS, columns), out.dtype), plgpu.SMEM((splits, ROWS), jnp.float32),
                     plgpu.SMEM((ROWS, columns), out_dtype), plgpu.SMEM((ROWS,), jnp.float32),
                     plgpu.Barrier(num_arrivals=2)],
      grid=(B * hkv, rows // ROWS, dv // columns),
      grid_names=("bh", "rows", "columns"),
      interpret=interpret or None,
      kernel_name=f"pallas_kv_mgpu_merge_sp{splits}_r{rows}_d{dv}_c{columns}",
  )
  results = call(out.reshape(B * hkv * splits, stored_rows, dv), lse.reshape(B * hkv * splits, stored_rows))
  merged = results[0].reshape(B, hkv, rows, dv)
  return merged, results[1].reshape(B, hkv, rows) if return_lse else None
