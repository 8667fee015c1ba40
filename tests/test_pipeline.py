"""The Mosaic GPU load pipeline and tiling: the TMA ring's slot and phase bookkeeping (a stream
through a ring in GPU interpret mode), KV tile addressing, and the SMEM sizing the config choice
relies on."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

TILE_ROWS, COLS = 16, 64


def _weighted_stream(x, *, num_stages: int, copies_per_slot: int, detect_races: bool = False,
                     fence: bool = True):
  """Streams x [steps * TILE_ROWS, COLS] through a Ring (a producer warpgroup, one consumer that
  loads each tile into registers) and returns sum_i (i + 1) * tile_i: any tile read from the wrong
  slot or before it landed, or read twice, changes the result."""
  num_steps = x.shape[0] // TILE_ROWS
  spec = pipeline.RingSpec(num_stages=num_stages, block_shape=(TILE_ROWS, COLS), dtype=x.dtype,
                           copies_per_slot=copies_per_slot)
  rows_per_copy = TILE_ROWS // copies_per_slot

  def body(x_ref, out_ref, slots, produced, consumed, out_smem):
    ring = pipeline.Ring(spec, slots, produced, consumed)
    wg = lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
      @pl.loop(0, num_steps)
      def _(step):
        ring.acquire(step)
        first = step * TILE_ROWS
        ring.commit(step, [x_ref.at[pl.ds(first + j * rows_per_copy, rows_per_copy)]
                           for j in range(copies_per_slot)])
      ring.drain(num_steps)

    @pl.when(wg == 0)
    def _consumer():
      def step(i, acc):
        tile = ring.wait(i)[...].astype(jnp.float32)
        ring.release(i, read_by_registers=fence)
        return acc + tile * (i + 1).astype(jnp.float32)

      out_smem[...] = lax.fori_loop(0, num_steps, step, jnp.zeros((TILE_ROWS, COLS), jnp.float32))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_ref)
      plgpu.wait_smem_to_gmem(0)

  produced, consumed = spec.barrier_types()
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((TILE_ROWS, COLS), jnp.float32),
      scratch_types=(spec.buffer_type(), produced, consumed, plgpu.SMEM((TILE_ROWS, COLS), jnp.float32)),
      num_threads=2, thread_name="wg",
      interpret=plgpu.InterpretGPUParams(detect_races=detect_races))(x)


@pytest.mark.parametrize("num_stages,copies_per_slot,num_steps", [
    (1, 1, 3), (2, 1, 7), (3, 2, 8), (4, 4, 5),
], ids=["1stage", "2stages", "3stages-2copies", "4stages-4copies-fewer-steps-than-2-rounds"])
def test_ring_streams_every_tile_once_in_order(num_stages, copies_per_slot, num_steps):
  rng = np.random.default_rng(num_stages * 10 + copies_per_slot)
  x = jnp.asarray(rng.integers(-8, 8, (num_steps * TILE_ROWS, COLS)), jnp.bfloat16)
  got = _weighted_stream(x, num_stages=num_stages, copies_per_slot=copies_per_slot)
  tiles = np.asarray(x, np.float32).reshape(num_steps, TILE_ROWS, COLS)
  want = np.einsum("i,irc->rc", np.arange(1, num_steps + 1, dtype=np.float32), tiles)
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("fence", [True, False])
def test_ring_races_only_without_the_register_read_fence(fence):
  # A slot loaded into registers and refilled by TMA (the async proxy) needs a proxy fence between
  # the two; GPU interpret mode's race detector models that, so it must flag the unfenced ring.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  x = jnp.ones((6 * TILE_ROWS, COLS), jnp.bfloat16)
  jax.block_until_ready(_weighted_stream(x, num_stages=2, copies_per_slot=2, detect_races=True, fence=fence))
  assert gpu_callbacks.get_races().races_found == (not fence)


def _parts_stream(x, *, parts, num_stages: int, copies_per_slot: int):
  """Streams x [steps * TILE_ROWS, COLS] through a Ring of column parts, one consumer warpgroup
  per part loading its part into registers; returns sum_i (i + 1) * tile_i, the parts side by
  side. Each part is released by its own consumer alone, with races detected."""
  num_steps = x.shape[0] // TILE_ROWS
  spec = pipeline.RingSpec(num_stages=num_stages, block_shape=(TILE_ROWS, COLS), dtype=x.dtype,
                           copies_per_slot=copies_per_slot, column_parts=parts)
  rows_per_copy = TILE_ROWS // copies_per_slot
  producer = len(parts)

  def body(x_ref, out_ref, slots, produced, consumed, out_smem):
    ring = pipeline.Ring(spec, slots, produced, consumed)
    wg = lax.axis_index("wg")

    @pl.when(wg == producer)
    def _producer():
      @pl.loop(0, num_steps)
      def _(step):
        first = step * TILE_ROWS
        for part in range(len(parts)):
          ring.acquire(step, part)
          ring.commit(step, [x_ref.at[pl.ds(first + j * rows_per_copy, rows_per_copy)]
                             for j in range(copies_per_slot)], part)
      ring.drain(num_steps)

    for part, width in enumerate(parts):
      @pl.when(wg == part)
      def _consumer():
        def step(i, acc):
          tile = ring.wait(i, part)[...].astype(jnp.float32)
          ring.release(i, part=part, read_by_registers=True)
          return acc + tile * (i + 1).astype(jnp.float32)

        out_smem[part] = lax.fori_loop(0, num_steps, step, jnp.zeros((TILE_ROWS, width), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[part], out_ref.at[part])
        plgpu.wait_smem_to_gmem(0)

  produced, consumed = spec.barrier_types()
  width = parts[0]
  out = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((len(parts), TILE_ROWS, width), jnp.float32),
      scratch_types=(spec.buffer_type(), produced, consumed, plgpu.SMEM((len(parts), TILE_ROWS, width), jnp.float32)),
      num_threads=len(parts) + 1, thread_name="wg",
      interpret=plgpu.InterpretGPUParams(detect_races=True))(x)
  return jnp.concatenate(list(out), axis=1)


@pytest.mark.parametrize("num_stages,copies_per_slot,num_steps", [(2, 1, 7), (3, 2, 5)])
def test_ring_of_column_parts_streams_each_part_to_its_consumer(num_stages, copies_per_slot, num_steps):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  rng = np.random.default_rng(num_stages)
  x = jnp.asarray(rng.integers(-8, 8, (num_steps * TILE_ROWS, COLS)), jnp.bfloat16)
  got = _parts_stream(x, parts=(COLS // 2, COLS // 2), num_stages=num_stages, copies_per_slot=copies_per_slot)
  tiles = np.asarray(x, np.float32).reshape(num_steps, TILE_ROWS, COLS)
  want = np.einsum("i,irc->rc", np.arange(1, num_steps + 1, dtype=np.float32), tiles)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert not gpu_callbacks.get_races().races_found


def test_ring_of_column_parts_checks_its_parts():
  with pytest.raises(ValueError, match="adding up to the slot's 64 columns"):
    pipeline.RingSpec(num_stages=2, block_shape=(TILE_ROWS, COLS), dtype=jnp.bfloat16, column_parts=(32, 16))
  spec = pipeline.RingSpec(num_stages=2, block_shape=(TILE_ROWS, COLS), dtype=jnp.bfloat16, column_parts=(16, 48))
  assert spec.part_columns(1) == (16, 48) and spec.num_parts == 2
  assert spec.buffer_bytes == 2 * TILE_ROWS * COLS * 2 and spec.barrier_bytes == 2 * 2 * 2 * pipeline.BARRIER_BYTES
  assert [t.shape for t in spec.buffer_type()] == [(2, TILE_ROWS, 16), (2, TILE_ROWS, 48)]
  ring = pipeline.Ring(spec, slots=None, produced=None, consumed=None)
  with pytest.raises(ValueError, match="name a part exactly when"):
    ring.release(0)


def test_ring_refuses_a_commit_of_the_wrong_number_of_copies():
  spec = pipeline.RingSpec(num_stages=2, block_shape=(TILE_ROWS, COLS), dtype=jnp.bfloat16, copies_per_slot=2)
  ring = pipeline.Ring(spec, slots=None, produced=None, consumed=None)
  with pytest.raises(ValueError, match="copies"):
    ring.commit(0, ["only one source"])
  with pytest.raises(ValueError, match="num_stages"):
    pipeline.RingSpec(num_stages=0, block_shape=(TILE_ROWS, COLS), dtype=jnp.bfloat16)


def test_ring_sizes():
  spec = pipeline.RingSpec(num_stages=3, block_shape=(64, 128), dtype=jnp.bfloat16)
  assert spec.buffer_bytes == 3 * 64 * 128 * 2
  assert spec.barrier_bytes == 2 * 3 * pipeline.BARRIER_BYTES
  assert pipeline.align_up(1) == pipeline.SMEM_ALIGNMENT and pipeline.align_up(2048) == 2048


# ---------------------------------------------------------------- KV tile addressing

@pytest.mark.parametrize("page_size,block_kv", [(16, 64), (64, 64), (128, 64)])
def test_paged_tile_locations_follow_the_table_and_clamp(page_size, block_kv):
  max_pages, num_pages = 8, 20
  table = jnp.asarray([[3, 7, 1, 0, 12, 5, -4, 99], [2, 2, 2, 2, 2, 2, 2, 2]], jnp.int32)
  kv_tiling = tiling.KVTiling(block_kv, 64, jnp.bfloat16, page_size=page_size, num_pages=num_pages,
                              max_pages=max_pages)
  assert kv_tiling.copies_per_tile == max(1, block_kv // page_size)
  for tile in range(max_pages * page_size // block_kv):
    locations = kv_tiling.tile_locations(tile, batch=0, block_tables_ref=table)
    assert len(locations) == kv_tiling.copies_per_tile
    for copy, (page, row) in enumerate(locations):
      token = tile * block_kv + copy * kv_tiling.rows_per_copy   # first token of this copy
      want_page = min(max(int(table[0, token // page_size]), 0), num_pages - 1)   # ids clamped into the pool
      assert (int(page), int(row)) == (want_page, token % page_size)


def test_dense_tile_location():
  kv_tiling = tiling.KVTiling(64, 128, jnp.bfloat16)
  assert kv_tiling.tile_locations(3, batch=2) == [(2, 192)]
  assert kv_tiling.capacity((4, 1000, 8, 128)) == 1000


# ---------------------------------------------------------------- SMEM sizing

def test_smem_of_the_default_config_counts_every_buffer():
  config = pkv.MosaicGPUConfig(block_kv=64, num_stages=4, num_splits=1, split_plan="per_sequence", kv_groups=1,
                               pipeline_qk=False, persistent=False, tile_consumers=1, sequence_order="given",
                               queries_as_n=False, values_as_stored=False, paired_terms=False)
  smem = mgpu_config.DecodeSmem.for_call(config, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=None)
  align = pipeline.align_up
  rings = 2 * align(4 * 64 * 128 * 2)                              # K and V rings
  staging = align(64 * 128 * 4) + 64 * 4                           # out and lse, aliasing the rings
  q = 64 * 128 * 2
  barriers = 2 * 2 * 4 * pipeline.BARRIER_BYTES + 2 * pipeline.BARRIER_BYTES
  reduction = align(plgpu.CompilerParams().reduction_scratch_bytes)
  assert smem.nbytes == align(q) + align(max(rings, staging)) + reduction + barriers
  assert mgpu_config.smem_bytes(config, rows=4, head_dim=128) == smem.nbytes
  # A persistent program keeps its staging beside the rings.
  persistent = dataclasses.replace(config, persistent=True)
  assert mgpu_config.smem_bytes(persistent, rows=4, head_dim=128) > smem.nbytes


@pytest.mark.parametrize("rows,head_dim", [(4, 128), (128, 128), (16, 256), (4, 64)])
def test_heuristic_config_fits_and_uses_the_deepest_ring_that_does(rows, head_dim):
  problem = _problem(rows, head_dim)
  config = mgpu_config.heuristic_config(problem)
  fits = lambda c: mgpu_config.fits_smem(c, rows=rows, head_dim=head_dim)
  assert fits(config)
  deeper = dataclasses.replace(config, num_stages=config.num_stages + 1)
  assert config.num_stages == mgpu_config.DEFAULT.num_stages or not fits(deeper)


def _problem(rows, head_dim):
  from pallas_kv import validation
  q = jax.ShapeDtypeStruct((1, rows, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 4096, 1, head_dim), jnp.bfloat16)
  return validation.validate_dense(q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32))
