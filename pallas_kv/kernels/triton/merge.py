"""The split-K merge as one Pallas Triton launch, where XLA takes several (docs/decisions.md#fused-merge). One
program per (sequence x kv head, row block, column block) loads every split's LSEs and output columns of its
rows (padded to powers of two, masked) and writes the merged rows and, from column block 0, the merged LSE."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.kernels.triton import decode as triton_decode

# Padded float32 partials one program holds: 64 per thread of NUM_WARPS.
MAX_BLOCK_ELEMENTS = 8192
MAX_COLUMNS = 64
NUM_WARPS = 4


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def blocking(num_splits: int, rows: int, dv: int) -> tuple[int, int]:
  """(rows, columns) one program merges: powers of two, columns dividing dv (each split's rows read in runs of
  up to MAX_COLUMNS floats), at most MAX_BLOCK_ELEMENTS padded partials."""
  splits = _next_pow2(num_splits)
  columns = min(dv & -dv, MAX_COLUMNS)
  while columns > 1 and splits * columns > MAX_BLOCK_ELEMENTS:
    columns //= 2
  row_block = min(_next_pow2(rows), max(1, MAX_BLOCK_ELEMENTS // (splits * columns)))
  return row_block, columns


def _kernel(out_ref,
            lse_ref,
            *refs, rows: int, splits: int, row_block: int, columns: int, has_sinks: bool, write_lse: bool):
  refs = list(refs)
  sinks_ref = refs.pop(0) if has_sinks else None
  merged_ref = refs.pop(0)
  merged_lse_ref = refs.pop(0) if write_lse else None
  s_pad = _next_pow2(splits)
  # Indices past the partials are masked, never clamped: a clamped index would repeat a real
  # row, and a masked store to it could land after the real one.
  row = pl.program_id(1) * row_block + jnp.arange(row_block, dtype=jnp.int32)
  row_ok = row < rows
  split = jnp.arange(s_pad, dtype=jnp.int32)[:, None]
  ok = (split < splits) & row_ok[None, :]
  lse = pltr.load(lse_ref.at[split, row[None, :]], mask=ok, other=-jnp.inf)
  shift = jnp.max(lse, axis=0)
  shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
  weights = jnp.exp(lse - shift[None, :])
  norm = jnp.sum(weights, axis=0)

  column = pl.program_id(2) * columns + jnp.arange(columns, dtype=jnp.int32)
  # A split with no key (lse -inf) is never read: its output may be left unwritten (MLA).
  parts = pltr.load(out_ref.at[split[:, :, None], row[None, :, None], column[None, None, :]],
                    mask=jnp.broadcast_to((ok & (lse > -jnp.inf))[:, :, None], (s_pad, row_block, columns)),
                    other=0.0).astype(jnp.float32)
  acc = jnp.sum(parts * weights[:, :, None], axis=0)

  has_keys = norm > 0
  denom = norm
  if sinks_ref is not None:
    denom = denom + jnp.exp(pltr.load(sinks_ref.at[row], mask=row_ok, other=0.0) - shift)
  merged = acc / jnp.where(has_keys, denom, 1.0)[:, None]
  pltr.store(merged_ref.at[row[:, None], column[None, :]], merged.astype(merged_ref.dtype),
             mask=jnp.broadcast_to(row_ok[:, None], (row_block, columns)))
  if merged_lse_ref is not None:
    lse_total = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)

    @pl.when(pl.program_id(2) == 0)
    def _():
      pltr.store(merged_lse_ref.at[row], lse_total, mask=row_ok)


def merge_partials(out, lse, sinks=None, *, out_dtype, return_lse: bool = True, rows: int | None = None,
                   interpret: bool = False):
  """`frame.merge_splits(out, lse, sinks)` up to float32 rounding, cast to out_dtype: out float32 / 16-bit
  [B, Hkv, splits, >= R, Dv], lse [B, Hkv, splits, >= R] float32, rows: R where a kernel padded its partials
  (default: all). Returns (out [B, Hkv, R, Dv] out_dtype, lse [B, Hkv, R] float32 or None)."""
  if out.ndim != 5 or out.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ValueError(f"out must be float32, bfloat16 or float16 [B, Hkv, splits, R, Dv], got {out.shape=} "
                     f"{out.dtype=}")
  B, hkv, splits, stored_rows, dv = out.shape
  rows = stored_rows if rows is None else rows
  if not 1 <= rows <= stored_rows:
    raise ValueError(f"rows={rows} must be in [1, {stored_rows}], the rows of out")
  if lse.shape != out.shape[:4] or lse.dtype != jnp.float32:
    raise ValueError(f"lse must be float32 {out.shape[:4]}, got {lse.shape=} {lse.dtype=}")
  if sinks is not None and sinks.shape != (hkv, rows):
    raise ValueError(f"sinks must be [Hkv, R]=({hkv}, {rows}), got {sinks.shape=}")
  row_block, columns = blocking(splits, rows, dv)
  # Every program gets its (sequence, kv head)'s whole arrays and indexes its block itself.
  grid = (B * hkv, -(-rows // row_block), dv // columns)
  seq = lambda i: i // hkv
  head = lambda i: i % hkv
  in_specs = [pl.BlockSpec((None, None, splits, stored_rows, dv), lambda i, r, c: (seq(i), head(i), 0, 0, 0)),
              pl.BlockSpec((None, None, splits, stored_rows), lambda i, r, c: (seq(i), head(i), 0, 0))]
  args = [out, lse]
  if sinks is not None:
    in_specs.append(pl.BlockSpec((None, rows), lambda i, r, c: (head(i), 0)))
    args.append(sinks.astype(jnp.float32))
  out_shape = [jax.ShapeDtypeStruct((B, hkv, rows, dv), out_dtype)]
  out_specs = [pl.BlockSpec((None, None, rows, dv), lambda i, r, c: (seq(i), head(i), 0, 0))]
  if return_lse:
    out_shape.append(jax.ShapeDtypeStruct((B, hkv, rows), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, rows), lambda i, r, c: (seq(i), head(i), 0)))
  call = pl.pallas_call(
      functools.partial(_kernel, rows=rows, splits=splits, row_block=row_block, columns=columns,
                        has_sinks=sinks is not None, write_lse=return_lse),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_decode.compiler_params(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret, name=f"pallas_kv_triton_merge_sp{splits}_r{rows}_d{dv}")
  results = triton_decode.call_quietly(call, args)
  return results[0], results[1] if return_lse else None
