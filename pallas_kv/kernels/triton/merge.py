"""The split-K merge as one Pallas Triton launch: `split_k.merge_splits` (its reference), fused.

XLA runs `merge_splits` as three to four kernels (the max over splits, the exponentials, the
weighted sum and divide, the cast to the output dtype); on the H200 they took ~5 µs of a ~46 µs
batch-1 call. Here one program per (sequence, kv head, column block) loads every split's LSE
and its block of output columns at once (splits and rows padded to powers of two, padding
masked), and writes the merged rows in the output dtype and, from the first column block, the
merged LSE.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kv.kernels.triton import decode as triton_decode

# Float32 values one program holds of the partials ([splits, rows, columns] padded to powers of
# two): 64 per thread of 4 warps.
MAX_BLOCK_ELEMENTS = 8192
NUM_WARPS = 4


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def column_block(num_splits: int, rows: int, dv: int) -> int:
  """Output columns one program merges: a power of two dividing dv, at most MAX_BLOCK_ELEMENTS
  values of the padded partials, at least 1."""
  per_column = _next_pow2(num_splits) * _next_pow2(rows)
  block = max(1, MAX_BLOCK_ELEMENTS // per_column)
  block = min(_next_pow2(dv), 1 << (block.bit_length() - 1))
  while dv % block:
    block //= 2
  return block


def _kernel(out_ref,     # [splits, R, Dv] f32, this (sequence, kv head)'s partials
            lse_ref,     # [splits, R] f32
            *refs, rows: int, splits: int, block: int, has_sinks: bool, write_lse: bool):
  refs = list(refs)
  sinks_ref = refs.pop(0) if has_sinks else None   # [R] f32
  merged_ref = refs.pop(0)                         # [R, Dv] output dtype
  merged_lse_ref = refs.pop(0) if write_lse else None   # [R] f32
  s_pad, r_pad = _next_pow2(splits), _next_pow2(rows)
  split = jnp.arange(s_pad, dtype=jnp.int32)[:, None]           # [s_pad, 1]
  row = jnp.arange(r_pad, dtype=jnp.int32)[None, :]             # [1, r_pad]
  ok = (split < splits) & (row < rows)                          # [s_pad, r_pad]
  lse = pltr.load(lse_ref.at[split, row], mask=ok,
                  other=-jnp.inf)
  shift = jnp.max(lse, axis=0)                                  # [r_pad]
  shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
  weights = jnp.exp(lse - shift[None, :])                        # empty splits and padding weigh 0
  norm = jnp.sum(weights, axis=0)

  column0 = pl.program_id(1) * block
  column = column0 + jnp.arange(block, dtype=jnp.int32)[None, None, :]   # [1, 1, block]
  ok3 = jnp.broadcast_to(ok[:, :, None], (s_pad, r_pad, block))
  parts = pltr.load(out_ref.at[split[:, :, None], row[:, :, None],
                               column], mask=ok3, other=0.0)    # [s_pad, r_pad, block]
  acc = jnp.sum(parts * weights[:, :, None], axis=0)             # [r_pad, block]

  has_keys = norm > 0
  denom = norm
  row1 = jnp.arange(r_pad, dtype=jnp.int32)
  if sinks_ref is not None:
    sink = pltr.load(sinks_ref.at[row1], mask=row1 < rows, other=0.0)
    denom = denom + jnp.exp(sink - shift)
  merged = acc / jnp.where(has_keys, denom, 1.0)[:, None]
  row_ok = row1 < rows
  pltr.store(merged_ref.at[row1[:, None], column[0]], merged.astype(merged_ref.dtype),
             mask=jnp.broadcast_to(row_ok[:, None], (r_pad, block)))
  if merged_lse_ref is not None:
    lse_total = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)

    @pl.when(pl.program_id(1) == 0)
    def _():
      pltr.store(merged_lse_ref.at[row1], lse_total, mask=row_ok)


def merge_partials(out, lse, sinks=None, *, out_dtype, return_lse: bool = True, interpret: bool = False):
  """`split_k.merge_splits(out, lse, sinks)` in one launch, cast to out_dtype.

  Args:
    out: [B, Hkv, splits, R, Dv] float32 partials (0 where a split saw no key).
    lse: [B, Hkv, splits, R] float32 (-inf where a split saw no key).
    sinks: optional [Hkv, R] float32 sink logit of each packed row (joins the denominator only).
    out_dtype: the dtype of the merged output.
    return_lse: also return the merged LSE.
  Returns:
    (out [B, Hkv, R, Dv] out_dtype, lse [B, Hkv, R] float32 or None when not return_lse): what
    merge_splits returns, up to float32 rounding (the sums run in another order), then cast.
  """
  if out.ndim != 5 or out.dtype != jnp.float32:
    raise ValueError(f"out must be float32 [B, Hkv, splits, R, Dv], got {out.shape=} {out.dtype=}")
  B, hkv, splits, rows, dv = out.shape
  if lse.shape != out.shape[:4] or lse.dtype != jnp.float32:
    raise ValueError(f"lse must be float32 {out.shape[:4]}, got {lse.shape=} {lse.dtype=}")
  if sinks is not None and sinks.shape != (hkv, rows):
    raise ValueError(f"sinks must be [Hkv, R]=({hkv}, {rows}), got {sinks.shape=}")
  block = column_block(splits, rows, dv)
  grid = (B * hkv, dv // block)
  seq = lambda i, j: i // hkv
  head = lambda i, j: i % hkv
  in_specs = [pl.BlockSpec((None, None, splits, rows, dv), lambda i, j: (seq(i, j), head(i, j), 0, 0, 0)),
              pl.BlockSpec((None, None, splits, rows), lambda i, j: (seq(i, j), head(i, j), 0, 0))]
  args = [out, lse]
  if sinks is not None:
    in_specs.append(pl.BlockSpec((None, rows), lambda i, j: (head(i, j), 0)))
    args.append(sinks.astype(jnp.float32))
  out_shape = [jax.ShapeDtypeStruct((B, hkv, rows, dv), out_dtype)]
  out_specs = [pl.BlockSpec((None, None, rows, dv), lambda i, j: (seq(i, j), head(i, j), 0, 0))]
  if return_lse:
    out_shape.append(jax.ShapeDtypeStruct((B, hkv, rows), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, rows), lambda i, j: (seq(i, j), head(i, j), 0)))
  call = pl.pallas_call(
      functools.partial(_kernel, rows=rows, splits=splits, block=block, has_sinks=sinks is not None,
                        write_lse=return_lse),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_decode.compiler_params(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret, name=f"pallas_kv_triton_merge_sp{splits}_r{rows}_d{dv}")
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=triton_decode.DEPRECATION_MESSAGE, category=DeprecationWarning)
    results = call(*args)
  return results[0], results[1] if return_lse else None
