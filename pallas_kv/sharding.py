"""Scale-out with shard_map: batch on one mesh axis, KV heads on another (tensor parallel).

Recipe:
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  attend = pallas_kv.sharding.sharded_paged_decode_attention(mesh, batch_axis="data", head_axis="model")
  out = attend(q, k_pages, v_pages, block_tables, lengths)

Layouts (global shapes; each device runs the ordinary op on its shard):
  q [B, (S,) Hq, D]              batch over batch_axis, q heads over head_axis
  k_pages, v_pages [P, ps, Hkv, D]   pages over batch_axis (each batch shard owns a pool of
                                 P / n_batch pages), kv heads over head_axis
  block_tables [B, max_pages]    batch over batch_axis; ids are LOCAL to the shard's pool
  lengths [B]                    batch over batch_axis
q heads are split in contiguous chunks, so a shard's q heads are exactly those of its kv heads
(Hkv must be divisible by the head axis size). No communication is needed: outputs come back
sharded like q.
"""

from __future__ import annotations


import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kv import api


def paged_specs(rank4_query: bool, batch_axis, head_axis):
  """(in_specs, out_spec) of the paged op's arrays (q, k_pages, v_pages, block_tables, lengths)."""
  q = P(batch_axis, None, head_axis, None) if rank4_query else P(batch_axis, head_axis, None)
  pages = P(batch_axis, None, head_axis, None)
  return (q, pages, pages, P(batch_axis, None), P(batch_axis)), q


def _place(x, mesh, spec):
  """Lays x out as spec on mesh: reshard on Explicit axes, a sharding constraint on Auto axes."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  used = [axis for axis in spec if axis is not None]
  if used and all(types[axis] == AxisType.Explicit for axis in used):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def sharded_paged_decode_attention(mesh, *, batch_axis: str | None = "data", head_axis: str | None = "model",
                                   **op_kwargs):
  """A function (q, k_pages, v_pages, block_tables, lengths, sinks=None) running
  `pallas_kv.paged_decode_attention(**op_kwargs)` per shard under shard_map (see the module doc)."""
  for name, axis in (("batch_axis", batch_axis), ("head_axis", head_axis)):
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")
  if op_kwargs.get("return_lse"):
    raise NotImplementedError("return_lse is not supported by the sharded op yet")

  def attend(q, k_pages, v_pages, block_tables, lengths, sinks=None):
    head_size = 1 if head_axis is None else mesh.shape[head_axis]
    if k_pages.shape[2] % head_size:
      raise ValueError(f"k_pages has {k_pages.shape[2]} kv heads, not divisible by the {head_size} shards of "
                       f"mesh axis {head_axis!r}")
    in_specs, out_spec = paged_specs(q.ndim == 4, batch_axis, head_axis)
    args = (q, k_pages, v_pages, block_tables, lengths)
    if sinks is not None:
      in_specs += (P(head_axis),)
      args += (sinks,)

    def local(q, k_pages, v_pages, block_tables, lengths, sinks=None):
      return api.paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, sinks=sinks, **op_kwargs)

    args = [_place(a, mesh, spec) for a, spec in zip(args, in_specs)]
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)

  return attend
