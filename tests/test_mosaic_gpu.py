"""What only the Mosaic GPU kernel has: race detection in GPU interpret mode, its shipped pipeline
options (pipeline_qk, persistent, kv_groups=2, tile_consumers=2) and their checks, measurement probes, more shapes
lowered for CUDA, `auto` on Hopper. The checks every backend passes are in test_kernels.py; the
experimental variants' tests are in test_experimental_mosaic_gpu.py."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
import sweeps
from harness import check_against_reference, lower_for_cuda, make_case, poison_unread_slots, tiered
from pallas_kv.config import AttentionOptions
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.mosaic_gpu import config as mgpu_config
from pallas_kv.kernels.mosaic_gpu import decode as mgpu_decode
from pallas_kv.kernels.mosaic_gpu import pipeline
from pallas_kv.kernels.mosaic_gpu import tiling

IMPL = "mosaic_gpu"
# A complete config (what decode_partials takes): 64-token tiles through a 2-slot ring, one split.
BASE = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence", kv_groups=1,
                           pipeline_qk=False, persistent=False, tile_consumers=1, sequence_order="given",
                           queries_as_n=False, values_as_stored=False, paired_terms=False)


def _config(**fields) -> pkv.MosaicGPUConfig:
  return dataclasses.replace(BASE, **fields)


def _plan(config, lengths=None, *, num_kv_heads: int = 1, num_sms: int = 132, ahead: bool = False) -> pkv.SplitPlan:
  """The plan of a complete config (its own split count): per sequence, or a stream-K walk of `lengths` over
  kv heads of one row block each (ahead: its vectors made in XLA; else each program plans its share)."""
  if config.split_plan != "stream_k":
    return pkv.SplitPlan(kind="per_sequence", num_splits=config.num_splits, block_kv=config.block_kv)
  problem = types.SimpleNamespace(batch=lengths.shape[0], num_kv_heads=num_kv_heads, num_queries=1, capacity=1 << 20)
  return split_plan.make_plan(lengths, problem=problem, config=config, window=None, row_blocks=1, num_sms=num_sms,
                              walked=True, ahead=ahead)


# ---------------------------------------------------------------- interpret mode (CPU)

# Two tile consumers: each takes every other ring step, and the second hands its partial to the first at
# the end of each work item (two items per program through the persistent grid: splits of 3 and 2 tiles).
TWO_TILE_CONSUMERS = _config(tile_consumers=2, num_stages=4, pipeline_qk=True, persistent=True, num_splits=2)


# Stream-K over one sequence of 5 tiles: two programs (shares of 3 and 2 tiles), two tile consumers each, and the
# producer filling the third piece slot.
STREAM_K = _config(split_plan="stream_k", persistent=True, num_splits=3, tile_consumers=2, num_stages=4,
                   pipeline_qk=True)


# A persistent program of one consumer over two items: the second item's q rows copied into the second buffer
# while the first streams.
PREFETCHED_Q = _config(persistent=True, pipeline_qk=True, num_splits=2)


@pytest.mark.parametrize("page_size,config,num_programs", [
    (None, BASE, None), (16, BASE, None), pytest.param(2, BASE, None, marks=pytest.mark.slow),
    (None, TWO_TILE_CONSUMERS, 1), (None, STREAM_K, None), (None, PREFETCHED_Q, 1)],
    ids=["dense", "page16", "page2", "two-tile-consumers", "stream-k", "prefetched-q"])
def test_race_detection_finds_none(page_size, config, num_programs):
  # 5 tiles through a 2-slot ring: every slot is refilled (pages of 16: 4 copies a tile; of 2: 32).
  case = make_case(9, batch=1, seq_len=320, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[300], page_size=page_size)
  q = case.q.reshape(1, 1, 4, 64)
  args = (case.k, case.v, case.lengths) if page_size is None else (
      case.k_pages, case.v_pages, case.lengths, case.block_tables)
  out, lse = mgpu_decode.decode_partials(q, *args, num_queries=1, options=AttentionOptions(scale=0.125),
                                         config=config, plan=_plan(config, case.lengths), num_programs=num_programs,
                                         interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  # No public accessor exists for the interpreter's race state in jax 0.11.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found


# ---------------------------------------------------------------- CUDA lowering (CPU)

@pytest.mark.parametrize("num_queries,head_dim,group",
                         [(1, 64, 16), (1, 256, 4), (16, 128, 4), (5, 128, 16), (3, 128, 4), (7, 128, 12)])
def test_other_shapes_lower_for_cuda(num_queries, head_dim, group):
  # The heuristic's config at head dims and row counts the sweeps (test_kernels.py) do not hold,
  # with softcap, window and sinks: D 64, D 256, 64 rows of 16 new tokens, 80 rows (two row
  # warpgroups), 12 and 84 rows (q's TMA box needs its rows below or a multiple of a swizzle tile).
  q = jax.ShapeDtypeStruct((2, num_queries, 2 * group, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  lower_for_cuda(functools.partial(pkv.decode_attention, impl=IMPL, softcap=30.0, window=1024,
                                   sinks=jnp.zeros((2 * group,))), q, kv, kv, lengths)


@pytest.mark.gpu
def test_gpu_auto_runs_mla_here_and_untuned_gqa_on_triton():
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  # A GQA shape the tuned file does not hold (head_dim 64, 2 kv heads): Triton first (api.KERNEL_IMPLS).
  case = make_case(5, batch=2, seq_len=1000, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == "triton"
  q = jnp.ones((1, 16, 576), jnp.bfloat16)
  pages = jnp.ones((4, 64, 576), jnp.bfloat16)
  pkv.mla_decode_attention(q, pages, jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray([200], jnp.int32),
                           v_head_dim=512)
  assert pkv.last_impl() == IMPL


@pytest.mark.gpu
@pytest.mark.parametrize("fields,page_size", [
    (dict(tile_consumers=2, pipeline_qk=True, persistent=True), None),
    (dict(tile_consumers=2), 16),
    (dict(sequence_order="longest_first", pipeline_qk=True, persistent=True), 16),
    (dict(split_plan="stream_k", pipeline_qk=True), None),
    (dict(split_plan="stream_k", tile_consumers=2, pipeline_qk=True), 16),
], ids=["tc2-pqk-persistent", "tc2-page16", "longest-first-persistent-page16", "stream-k-pqk", "stream-k-tc2-page16"])
def test_gpu_tile_consumers_and_sequence_order_on_a_ragged_batch(fields, page_size):
  # Persistent programs over items of every length (one of 8192 tokens, an empty one), or walking equal shares
  # of them (stream-K: the long one cut into pieces); longest first gives the bits of batch order.
  rng = np.random.default_rng(8)
  lengths = rng.integers(1, 4096, size=24)
  lengths[5], lengths[17] = 8192, 0
  case = make_case(61, batch=24, seq_len=8192, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                   lengths=lengths, page_size=page_size)
  config = pkv.MosaicGPUConfig(**fields)
  out = _paged_or_dense(case, config)
  check_against_reference(case, out)
  if "sequence_order" in fields:
    given = _paged_or_dense(case, dataclasses.replace(config, sequence_order="given"))
    for a, b in zip(given, out, strict=True):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ---------------------------------------------------------------- pipeline options (interpret)

def _partials_case(case, config, num_programs=None, ahead=False):
  """decode_partials + the split merge for a [B, Hq, D] case (dense, or paged when case.page_size); ahead: a
  stream-K walk's vectors made in XLA, not planned by the programs."""
  rows = frame.pack_queries(case.q[:, None], case.k.shape[2])
  args = ((rows, case.k_pages, case.v_pages, case.lengths, case.block_tables) if case.page_size
          else (rows, case.k, case.v, case.lengths))
  plan = _plan(config, case.lengths, num_kv_heads=case.k.shape[2], ahead=ahead)
  out, lse = mgpu_decode.decode_partials(*args, num_queries=1, options=AttentionOptions(scale=case.q.shape[-1] ** -0.5),
                                         config=config, plan=plan, num_programs=num_programs,
                                         interpret=plgpu.InterpretGPUParams())
  out, lse = frame.merge_splits(out, lse)
  return frame.unpack_rows(out, 1)[:, 0].astype(case.q.dtype), frame.unpack_rows(lse, 1)[:, 0]


# Few programs and tiles (the CPU simulates each program's warpgroups): a split with no tile, a
# masked last tile, persistent programs fewer than the work items (B x Hkv x splits) so that each
# loops over several, an empty one among them, with an odd ring step count (a 3-tile sequence, or
# its 1-tile split) before the next item.
@pytest.mark.parametrize("lengths,page_size,fields,num_programs", [
    ([201], None, dict(pipeline_qk=True, num_splits=3), None),
    ([150, 201], 16, dict(persistent=True, num_splits=2), 2),
    ([150, 0, 201], 64, dict(pipeline_qk=True, persistent=True, num_splits=1), 1),
    # Two tile consumers: an item of one tile (the second consumer has none), items starting on odd ring
    # steps (so the first consumer's first tile is the item's second), a split with no tile.
    ([201], None, dict(tile_consumers=2, num_stages=4, pipeline_qk=True, num_splits=3), None),
    ([150, 0, 201], 64, dict(tile_consumers=2, num_stages=4, pipeline_qk=True, persistent=True, num_splits=1), 1),
    pytest.param([150, 201], 16, dict(tile_consumers=2, persistent=True, num_splits=2), 2, marks=pytest.mark.slow),
], ids=["pqk-splits3", "persistent2-page16", "pqk-persistent1-page64", "tc2-pqk-splits3",
        "tc2-pqk-persistent1-page64", "tc2-persistent2-page16"])
def test_pipeline_options_interpret(lengths, page_size, fields, num_programs):
  case = make_case(40, batch=len(lengths), seq_len=256, num_heads=4, num_kv_heads=1, head_dim=64,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=lengths)
  check_against_reference(case, _partials_case(case, _config(**fields), num_programs))


# Stream-K: persistent programs walk equal shares (2 tiles) of the batch's tiles laid end to end over sequences
# and both kv heads: sequences cut into two and three pieces, an empty one, a share that crosses into the next kv
# head (13 tiles a head), unused piece slots that the producer fills.
@pytest.mark.parametrize("page_size,fields", tiered(
    [(None, ()), (16, (("pipeline_qk", True),)), (None, (("tile_consumers", 2), ("num_stages", 4))),
     (64, (("tile_consumers", 2), ("num_stages", 4), ("pipeline_qk", True)))],
    every_tier=[(None, ()), (64, (("tile_consumers", 2), ("num_stages", 4), ("pipeline_qk", True)))]))
def test_stream_k_interpret(page_size, fields):
  case = make_case(43, batch=6, seq_len=256, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=page_size, lengths=[250, 30, 0, 256, 5, 130])
  config = _config(split_plan="stream_k", persistent=True, num_splits=3, **dict(fields))
  out, lse = _partials_case(case, config)
  check_against_reference(case, (out, lse))
  # The walk planned by each program visits the tiles in the same segments as the XLA walk: the same bits.
  ahead_out, ahead_lse = _partials_case(case, config, ahead=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ahead_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ahead_lse))


def test_pipeline_options_through_the_api_interpret(interpret_mode):
  # Partial configs: the backend fills the rest (heuristic), the op plans the splits; two or three KV
  # groups stream a split each.
  case = make_case(41, batch=1, seq_len=192, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[150])
  for config in (pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2, pipeline_qk=True, persistent=True),
                 pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2, kv_groups=2),
                 pkv.MosaicGPUConfig(kv_groups=3),   # the heuristic's ring rounded to three groups' slots
                 pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2, split_plan="stream_k")):
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config)
    check_against_reference(case, out)
  # A stream-K plan made once (as `DecodeAttention.plan_step` does) carries its walk into the call.
  config = pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2, split_plan="stream_k")
  made = pkv.plan_splits(pkv.decode_attention, case.q, case.k, case.v, case.lengths, impl=IMPL, config=config)
  assert made.walk is not None and made.walk.num_programs == 1 and len(made.kernel_inputs()) == 4
  planned = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config,
                                 plan=made)
  check_against_reference(case, planned)


@pytest.mark.parametrize("fields", [pytest.param(dict(), marks=pytest.mark.slow),
                                    dict(persistent=True, pipeline_qk=True, tile_consumers=2)],
                         ids=["grid", "persistent-tc2"])
def test_sequence_order_moves_only_the_schedule_interpret(interpret_mode, fields):
  # Longest first: batch slot i takes sequence order[i]; the splits, and so the bits, are those of batch order.
  case = make_case(42, batch=4, seq_len=256, num_heads=4, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[40, 250, 0, 130], page_size=16)
  outs = {}
  for order in ("given", "longest_first"):
    config = pkv.MosaicGPUConfig(block_kv=64, num_stages=4, num_splits=2, sequence_order=order, **fields)
    outs[order] = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                             return_lse=True, impl=IMPL, config=config)
  check_against_reference(case, outs["longest_first"])
  for given, ordered in zip(outs["given"], outs["longest_first"]):
    np.testing.assert_array_equal(np.asarray(given), np.asarray(ordered))


def test_configs_and_plans_are_validated():
  with pytest.raises(ValueError, match="kv_groups"):
    pkv.MosaicGPUConfig(kv_groups=4)
  with pytest.raises(ValueError, match="persistent=True needs kv_groups=1"):
    pkv.MosaicGPUConfig(persistent=True, kv_groups=3)
  with pytest.raises(ValueError, match="persistent"):
    pkv.MosaicGPUConfig(persistent=True, kv_groups=2)
  with pytest.raises(ValueError, match="tile_consumers=2 needs kv_groups=1"):
    pkv.MosaicGPUConfig(tile_consumers=2, kv_groups=2)
  with pytest.raises(ValueError, match="tile_consumers"):
    pkv.MosaicGPUConfig(tile_consumers=3)
  with pytest.raises(ValueError, match="pipeline_qk"):
    pkv.MosaicGPUConfig(pipeline_qk=1)
  with pytest.raises(ValueError, match=r"block_kv=32 must be one of \(64, 128, 256\)"):
    pkv.MosaicGPUConfig(block_kv=32)
  for foreign in (dict(merge_in_kernel=True), dict(num_warps=4), dict(convert_warpgroup=True)):
    with pytest.raises(TypeError):   # another kernel's field, or an experimental variant's
      pkv.MosaicGPUConfig(**foreign)
  check = functools.partial(mgpu_config.check_config, head_dim=64, dtype=jnp.bfloat16, page_size=None)
  with pytest.raises(ValueError, match="complete MosaicGPUConfig"):
    check(pkv.MosaicGPUConfig(block_kv=64, num_stages=2), rows=4, num_splits=1)
  with pytest.raises(ValueError, match="complete MosaicGPUConfig"):
    check(pkv.MosaicMLAConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence",
                              sequence_order="given"), rows=4, num_splits=1)
  with pytest.raises(ValueError, match="num_stages"):
    check(_config(num_stages=1, pipeline_qk=True), rows=4, num_splits=1)
  with pytest.raises(ValueError, match="pipeline_qk=True needs num_stages >= 2 a KV group"):   # K held: deadlock
    check(_config(num_stages=2, num_splits=2, kv_groups=2, pipeline_qk=True), rows=4, num_splits=2)
  with pytest.raises(NotImplementedError, match="kv_groups=2 needs <= 64 packed rows"):
    check(_config(num_splits=2, kv_groups=2), rows=65, num_splits=2)
  with pytest.raises(ValueError, match="num_splits a multiple of 2"):   # the plan's split count is the one checked
    check(_config(num_splits=2, kv_groups=2), rows=4, num_splits=3)
  with pytest.raises(ValueError, match="num_stages a multiple of 2"):
    check(_config(num_stages=3, num_splits=2, kv_groups=2), rows=4, num_splits=2)
  with pytest.raises(ValueError, match="kv_groups=3 needs num_splits a multiple of 3, got 4"):
    check(_config(num_stages=3, num_splits=3, kv_groups=3), rows=4, num_splits=4)
  with pytest.raises(ValueError, match="kv_groups=3 needs num_stages a multiple of 3, got config.num_stages=4"):
    check(_config(num_stages=4, num_splits=3, kv_groups=3), rows=4, num_splits=3)
  with pytest.raises(ValueError, match="SMEM"):
    check(_config(block_kv=256, num_stages=8), rows=128, num_splits=1)
  with pytest.raises(NotImplementedError, match="tile_consumers=2 needs <= 64 packed rows"):
    check(_config(tile_consumers=2), rows=65, num_splits=1)
  with pytest.raises(ValueError, match="tile_consumers=2 needs an even num_stages"):
    check(_config(tile_consumers=2, num_stages=3), rows=4, num_splits=1)
  with pytest.raises(ValueError, match=r"even num_stages \(>= 4 with pipeline_qk\)"):
    check(_config(tile_consumers=2, num_stages=2, pipeline_qk=True), rows=4, num_splits=1)
  with pytest.raises(NotImplementedError, match="tile_consumers=2 has no schedule for fp8 wgmma operands"):
    mgpu_config.check_config(_config(tile_consumers=2), rows=4, head_dim=64, dtype=jnp.float8_e4m3fn, page_size=None,
                             num_splits=1, k_scale_kind="token", v_scale_kind="token", v_tokens_last=True)
  sds = jax.ShapeDtypeStruct
  fp8_call = functools.partial(pkv.decode_attention, impl=IMPL, v_tokens_last=True,
                               config=pkv.MosaicGPUConfig(tile_consumers=2))
  with pytest.raises(NotImplementedError, match="tile_consumers=2 has no schedule for fp8 wgmma operands"):
    jax.eval_shape(fp8_call, sds((2, 4, 64), jnp.bfloat16), sds((2, 256, 1, 64), jnp.float8_e4m3fn),
                   sds((2, 1, 64, 256), jnp.float8_e4m3fn), sds((2,), jnp.int32), k_scale=sds((2, 256, 1), jnp.float32),
                   v_scale=sds((2, 256, 1), jnp.float32))
  # decode_partials runs the same checks on the config it is given, and checks its plan.
  q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  lengths = jnp.array([128], jnp.int32)
  call = functools.partial(mgpu_decode.decode_partials, q, kv, kv, lengths, num_queries=1,
                           options=AttentionOptions(scale=0.1))
  with pytest.raises(ValueError, match="num_stages"):
    call(config=_config(num_stages=1, pipeline_qk=True), plan=_plan(BASE))
  with pytest.raises(ValueError, match="complete MosaicGPUConfig"):
    call(config=pkv.MosaicGPUConfig(block_kv=64), plan=_plan(BASE))
  with pytest.raises(ValueError, match="made for 128-token tiles; the kernel streams 64"):
    call(config=BASE, plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=128))
  with pytest.raises(ValueError, match=r"order must be int32 \[1\]"):
    call(config=BASE, plan=pkv.SplitPlan(kind="per_sequence", num_splits=1, block_kv=64,
                                         order=jnp.zeros((2,), jnp.int32)))
  # A stream-K plan needs its walk and a stream-K config, and the walk sets the program count.
  stream_k = _config(split_plan="stream_k", num_splits=2, persistent=True)
  with pytest.raises(ValueError, match="walks a stream-K plan with persistent programs"):
    call(config=BASE, plan=_plan(stream_k, lengths, num_kv_heads=1))
  with pytest.raises(ValueError, match="plan without a walk"):
    call(config=stream_k, plan=pkv.SplitPlan(kind="stream_k", num_splits=2, block_kv=64))
  with pytest.raises(ValueError, match="differs from the stream-K plan's 1 programs"):
    call(config=stream_k, plan=_plan(stream_k, lengths, num_kv_heads=1), num_programs=3)
  with pytest.raises(NotImplementedError, match="'stream_k' with window_start"):
    mgpu_decode.decode_partials(q, kv, kv, lengths, num_queries=1, window_start=lengths - 5, config=stream_k,
                                options=AttentionOptions(scale=0.1, has_window_start=True),
                                plan=_plan(stream_k, lengths, num_kv_heads=1))
  with pytest.raises(ValueError, match=r"walk.offsets must be int32 \[2\]"):
    walk = _plan(stream_k, lengths, num_kv_heads=1).walk
    call(config=stream_k, plan=pkv.SplitPlan(kind="stream_k", num_splits=2, block_kv=64, walk=dataclasses.replace(
        walk, offsets=jnp.zeros((3,), jnp.int32))))
  with pytest.raises(ValueError, match="a walk is a stream-K plan's"):
    pkv.SplitPlan(kind="per_sequence", num_splits=2, block_kv=64, walk=walk)
  for fields in (dict(persistent=False), dict(kv_groups=2), dict(sequence_order="longest_first"), dict(num_splits=1)):
    with pytest.raises(ValueError, match="split_plan='stream_k' is walked by persistent programs"):
      pkv.MosaicGPUConfig(split_plan="stream_k", **fields)
  with pytest.raises(ValueError, match=r"tiles_per_split must be int32 \[1\]"):
    call(config=BASE, plan=pkv.SplitPlan(kind="balanced", num_splits=1, block_kv=64,
                                         tiles_per_split=jnp.ones((2,), jnp.int32)))
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    pkv.SplitPlan(kind="balanced", num_splits=2, block_kv=64)
  # Through the op: a config of the other kernel, or of another backend.
  with pytest.raises(TypeError, match="takes a MosaicGPUConfig"):
    pkv.decode_attention(q[:, 0, 0:1], kv, kv, lengths, impl=IMPL,
                         config=pkv.MosaicMLAConfig(block_kv=64, num_stages=2))
  with pytest.raises(ValueError, match="impl='mosaic_gpu' runs another"):
    pkv.decode_attention(q[:, 0, 0:1], kv, kv, lengths, impl=IMPL, config=pkv.TritonConfig(block_kv=64))


def _option_lowering_cases():
  # Each option once, dense (B128) or paged (pages of 16, B8: several copies a tile); pipeline_qk
  # with persistent both ways. The batch changes only static sizes of the same code.
  cases = [(dict(pipeline_qk=True, persistent=True), (128, 4096), None),
           (dict(pipeline_qk=True, persistent=True), (8, 8192), 16),
           (dict(pipeline_qk=True), (128, 4096), None),
           (dict(persistent=True), (1, 32768), None),
           (dict(block_kv=128, num_stages=3), (8, 8192), 16),
           (dict(kv_groups=2, num_splits=2), (8, 8192), 16),
           (dict(tile_consumers=2, pipeline_qk=True, persistent=True, sequence_order="longest_first"), (64, 8192),
            None),
           (dict(tile_consumers=2), (8, 8192), 16),
           (dict(split_plan="balanced"), (8, 8192), 16),
           (dict(split_plan="stream_k", tile_consumers=2, pipeline_qk=True), (64, 8192), None),
           (dict(split_plan="stream_k"), (16, 32768), 16)]
  return [pytest.param(f, c, p, id="-".join(f"{k}={v}" for k, v in f.items()) + f"-b{c[0]}-t{c[1]}-page{p}")
          for f, c, p in cases]


@pytest.mark.parametrize("fields,case,page_size", _option_lowering_cases())
def test_pipeline_options_lower_for_cuda(fields, case, page_size):
  args, problem = sweeps.problem_args((32, 8), case, page_size)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(**fields), num_sms=132)
  assert config.complete and all(getattr(config, k) == v for k, v in fields.items())
  op = pkv.decode_attention if page_size is None else pkv.paged_decode_attention
  module = lower_for_cuda(functools.partial(op, impl=IMPL, config=config), *args).mlir_module()
  assert "custom_call @mosaic_gpu" in module
  assert ("_balanced" in module) == (config.split_plan == "balanced")
  assert ("_ordered" in module) == (config.sequence_order != "given")
  assert ("_streamk" in module) == (config.split_plan == "stream_k")
  # q reaches the kernel unpadded (TMA fills the rows past it), and one split is stored as the output (with one
  # tile consumer), so neither a pad nor a cast is an op of its own around the kernel.
  assert "stablehlo.pad" not in module
  if config.num_splits == 1 and config.split_plan != "stream_k" and config.tile_consumers == 1:
    assert not re.search(r"stablehlo\.convert .*-> tensor<[0-9x]*bf16>", module)


def _kernel_variants():
  from benchmarks.tools import kernel_variants
  return kernel_variants


@pytest.mark.parametrize("probe", ["no_qk", "no_softmax", "no_pv"])
def test_probes_lower_for_cuda(probe):
  # Measurement-only kernels (benchmarks/tools/kernel_variants.py: TileMath subclasses that leave a
  # stage out); their results are wrong by design. loads_only: test_load_path_rings_lower_for_cuda.
  q = jax.ShapeDtypeStruct((128, 8, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((128, 4096, 8, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((128,), jnp.int32)
  config = _config(num_stages=4)
  tile_math = _kernel_variants().PROBES[probe]
  exported = lower_for_cuda(functools.partial(
      mgpu_decode.decode_partials, num_queries=1, options=AttentionOptions(scale=0.1), config=config,
      plan=_plan(config), tile_math=tile_math), q, kv, kv, lengths)
  assert tile_math.name in exported.mlir_module()   # the probe's name is in the kernel's


@pytest.mark.parametrize("ring", ["bkv64_st4", "bkv128_st2", "bkv64_st4_persistent", "bkv64_st4_kvg2"])
def test_load_path_rings_lower_for_cuda(ring):
  # benchmarks/tools/kernel_variants.py --load_path times these rings with no math (the loads_only
  # probe) on the H200: the shipped ring, a larger tile, the persistent grid and two KV groups (the
  # others differ in depth alone). The full kernel lowers with each in
  # test_pipeline_options_lower_for_cuda, so that a faster ring can ship.
  kernel_variants = _kernel_variants()
  args, problem = sweeps.problem_args((32, 8), (128, 4096), None)
  config = mgpu_config.resolve_config(problem, pkv.MosaicGPUConfig(**kernel_variants.LOAD_PATH[ring]), num_sms=132)
  module = lower_for_cuda(kernel_variants.kernel_fn(config, problem, paged=False, probe="loads_only"),
                          *args).mlir_module()
  assert kernel_variants.PROBES["loads_only"].name in module


@pytest.mark.parametrize("page_size", [3, 12, 24])
def test_page_sizes_it_cannot_tile_are_refused_so_auto_moves_on(page_size):
  case = make_case(42, batch=1, seq_len=96, num_heads=4, num_kv_heads=2, head_dim=64,
                   dtype=jnp.bfloat16, page_size=page_size)
  with pytest.raises(NotImplementedError, match=f"mosaic_gpu.*page_size {page_size} is not supported"):
    pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths, impl=IMPL)


# ---------------------------------------------------------------- small pages and head dims

def _paged_or_dense(case, config, **kw):
  if case.page_size is None:
    return pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl=IMPL, config=config, **kw)
  return pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                    return_lse=True, impl=IMPL, config=config, **kw)


# Pages below a swizzle tile's 8 rows (a copy per token or pair, one per 64-column tile at D 128) and pages that
# overlap 64-token tiles unevenly (48: runs of 16); shuffled pages, garbage in every unread slot, lengths that end
# mid-tile.
@pytest.mark.parametrize("page_size,num_queries,head_dim", tiered(
    [(1, 2, 64), (1, 1, 128), (2, 2, 128), (4, 1, 64), (2, 1, 96), (4, 2, 80), (48, 1, 64)],
    every_tier=[(1, 2, 64), (4, 2, 80)]))
def test_small_pages_interpret(interpret_mode, page_size, num_queries, head_dim):
  t = 192 if page_size == 48 else 128
  case = make_case(page_size, batch=2, seq_len=t, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                   num_queries=num_queries, dtype=jnp.bfloat16, page_size=page_size, lengths=[t - 27, 70])
  out = _paged_or_dense(poison_unread_slots(case), _config(num_splits=2))
  check_against_reference(case, out)


# Head dims off 64/128/256 (swizzles of 32 and 64 bytes; 80 and 240 leave a 16-column chunk for the zeroing of
# V rows past the length), dense with garbage past each length, or in pages of 16.
@pytest.mark.parametrize("head_dim,page_size", tiered(
    [(32, None), (48, None), (80, None), (96, 16), (112, None), (160, 16), (192, None), (240, None)],
    every_tier=[(80, None)]))
def test_head_dims_interpret(interpret_mode, head_dim, page_size):
  case = make_case(head_dim, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=[75, 128])
  check_against_reference(case, _paged_or_dense(poison_unread_slots(case), _config()))


# The queries as wgmma N over a 16-bit cache (`queries_as_n.py`): garbage past each length (V NaN must not reach P V
# through the zeroed keys), 2 new tokens of 4 heads a kv head (8 packed rows of N's 16), head dims whose slots take
# swizzles of 128 and 64 bytes (P's must match), one split and two, pages of 16 (copies of several pages a tile),
# pipeline_qk, the persistent grid, stream-K, softcap and a window.
@pytest.mark.parametrize("head_dim,page_size,fields,options", [
    (64, None, dict(block_kv=64), {}),
    (128, 16, dict(block_kv=64, num_splits=2, pipeline_qk=True), {}),
    pytest.param(32, None, dict(block_kv=128, num_splits=2), dict(softcap=20.0), marks=pytest.mark.slow),
    pytest.param(64, None, dict(block_kv=64, num_splits=2, persistent=True, pipeline_qk=True), dict(window=70),
                 marks=pytest.mark.slow),
    pytest.param(64, 16, dict(block_kv=64, num_splits=3, split_plan="stream_k", persistent=True, pipeline_qk=True),
                 {}, marks=pytest.mark.slow),
], ids=["d64-dense", "d128-page16-s2-pqk", "d32-bkv128-softcap", "d64-persistent-window", "d64-page16-stream-k"])
def test_queries_as_n_over_a_16bit_cache_interpret(interpret_mode, head_dim, page_size, fields, options):
  case = make_case(head_dim, batch=2, seq_len=320, num_heads=8, num_kv_heads=2, head_dim=head_dim, num_queries=2,
                   dtype=jnp.bfloat16, page_size=page_size, lengths=[300, 75])
  config = _config(queries_as_n=True, num_stages=3, **fields)
  out = _paged_or_dense(poison_unread_slots(case), config, **options)
  assert np.isfinite(np.asarray(out[0], np.float32)).all()
  check_against_reference(case, out, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,fields", [
    (None, dict(block_kv=64)), (None, dict(block_kv=128, pipeline_qk=True)),
    (16, dict(pipeline_qk=True, persistent=True)),
    (None, dict(split_plan="stream_k", persistent=True, pipeline_qk=True))],
    ids=["dense", "bkv128-pqk", "page16-pqk-persistent", "stream-k"])
def test_gpu_queries_as_n_over_a_16bit_cache(page_size, fields):
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  case = make_case(11, batch=4, seq_len=2048, num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                   page_size=page_size, lengths=[2048, 1000, 77, 1])
  out = _paged_or_dense(poison_unread_slots(case), pkv.MosaicGPUConfig(queries_as_n=True, **fields))
  check_against_reference(case, out)


def test_queries_as_n_16bit_needs_few_rows_and_one_consumer():
  problem = dict(rows=16, head_dim=128, dtype=jnp.bfloat16, page_size=None, num_splits=1)
  mgpu_config.check_config(_config(queries_as_n=True), **problem)   # 16 packed rows: N's 16 columns
  with pytest.raises(ValueError, match="queries_as_n=True needs .* <= 16 packed rows"):
    mgpu_config.check_config(_config(queries_as_n=True), **{**problem, "rows": 17})
  with pytest.raises(ValueError, match="one consumer"):
    mgpu_config.check_config(_config(queries_as_n=True, tile_consumers=2, num_stages=4), **problem)


@pytest.mark.slow
def test_one_byte_head_dim_interpret(interpret_mode):
  # int8 rows of 96 bytes (a 32-byte swizzle) widened into bf16 tiles of 96 columns, per-token K scales.
  case = make_case(96, batch=2, seq_len=128, num_heads=4, num_kv_heads=1, head_dim=96, dtype=jnp.bfloat16,
                   kv_dtype=jnp.int8, lengths=[75, 128])
  k_scale = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, case.k.shape[:3]) / 40, jnp.float32)
  v_scale = jnp.full((1,), 1 / 40, jnp.float32)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale,
                             return_lse=True, impl=IMPL, config=_config())
  dequantized = dataclasses.replace(case, k=case.k.astype(jnp.float32) * k_scale[..., None],
                                    v=case.v.astype(jnp.float32) * v_scale[:, None])
  check_against_reference(dequantized, out)


def _lowering_cases():
  cases = [(64, 1, {}), (128, 1, {}), (256, 1, {}), (128, 2, {}), (128, 4, {}), (96, 2, {}), (80, 4, {}),
           (128, 1, dict(pipeline_qk=True)), (128, 2, dict(persistent=True)), (128, 1, dict(kv_groups=2, num_splits=2)),
           (128, 48, {}), (128, 80, dict(block_kv=128, num_stages=2)),
           (32, None, {}), (48, None, {}), (80, None, {}), (96, None, {}), (112, None, {}), (160, 16, {}),
           (192, None, dict(pipeline_qk=True)), (240, None, {})]
  every_tier = [(128, 1, {}), (80, 4, {}), (192, None, dict(pipeline_qk=True))]
  ids = lambda c: f"d{c[0]}-page{c[1]}" + "".join(f"-{k}={v}" for k, v in c[2].items())
  return [pytest.param(*c, id=ids(c), marks=() if c in every_tier else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("head_dim,page_size,fields", _lowering_cases())
def test_small_pages_and_head_dims_lower_for_cuda(head_dim, page_size, fields):
  b, t, hkv = 4, 3840, 8
  q = jax.ShapeDtypeStruct((b, 2, 32, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  config = pkv.MosaicGPUConfig(**fields)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((b, t, hkv, head_dim), jnp.bfloat16)
    fn, args = functools.partial(pkv.decode_attention, impl=IMPL, config=config), (q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((b * t // page_size, page_size, hkv, head_dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((b, t // page_size), jnp.int32)
    fn = functools.partial(pkv.paged_decode_attention, impl=IMPL, config=config)
    args = (q, pages, pages, tables, lengths)
  module = lower_for_cuda(fn, *args).mlir_module()
  assert "custom_call @mosaic_gpu" in module
  assert f"_d{head_dim}_" in module and (page_size is None or f"_ps{page_size}" in module)


def test_small_page_copies_land_one_column_tile_at_a_time():
  # Pages of 1 at D 128: 64 copies of a token a tile, each as two 64-column tiles, all awaited by one barrier.
  smem = mgpu_config.DecodeSmem.for_call(BASE, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=1)
  spec = smem.ring_spec()
  assert (spec.copies_per_slot, spec.rows_per_copy, spec.copies_per_source) == (64, 1, 2)
  assert spec.barrier_types()[0].num_arrivals == 128
  assert smem.tile_aliases and not mgpu_config.DecodeSmem.for_call(
      BASE, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=1, interpret=True).tile_aliases
  assert smem.nbytes == mgpu_config.smem_bytes(BASE, rows=4, head_dim=128, page_size=16)   # aliases are free
  eight = mgpu_config.DecodeSmem.for_call(BASE, rows=4, head_dim=128, dtype=jnp.bfloat16, page_size=8).ring_spec()
  assert not eight.splits_rows and eight.barrier_types()[0].num_arrivals == 8
  # A token of 32 bf16 columns (a 64-byte swizzle) alone would start off TMA's 128-byte SMEM alignment.
  with pytest.raises(ValueError, match="128-byte"):
    pipeline.RingSpec(num_stages=2, block_shape=(64, 32), dtype=jnp.bfloat16, copies_per_slot=64,
                      transforms=tiling.smem_transforms(jnp.bfloat16, 32))


def test_uneven_pages_are_copied_in_runs_that_stay_in_one_page():
  # Pages of 48 tokens and 64-token tiles: runs of 16 tokens, each inside one page; ids clamped into the pool.
  table = jnp.asarray([[3, 7, 1, 0, 12, 99]], jnp.int32)
  kv_tiling = tiling.KVTiling(64, 64, jnp.bfloat16, page_size=48, num_pages=20, max_pages=6)
  assert (kv_tiling.rows_per_copy, kv_tiling.copies_per_tile) == (16, 4)
  for tile in range(6 * 48 // 64):
    for copy, (page, row) in enumerate(kv_tiling.tile_locations(tile, batch=0, block_tables_ref=table)):
      token = tile * 64 + copy * 16
      assert (int(page), int(row)) == (min(int(table[0, token // 48]), 19), token % 48)


@pytest.mark.parametrize("head_dim,page_size,dtype,accepted", [
    (32, None, jnp.bfloat16, True), (80, 16, jnp.bfloat16, True), (240, None, jnp.float16, True),
    (256, 1, jnp.bfloat16, True), (96, 2, jnp.bfloat16, True), (80, 4, jnp.bfloat16, True), (64, 48, jnp.bfloat16, True),
    (96, None, jnp.int8, True), (40, None, jnp.bfloat16, False), (24, None, jnp.bfloat16, False),
    (272, None, jnp.bfloat16, False), (512, 16, jnp.bfloat16, False), (48, None, jnp.int8, False),
    (96, 1, jnp.bfloat16, False), (80, 2, jnp.bfloat16, False), (128, 4, jnp.int8, False), (128, 12, jnp.bfloat16, False),
])
def test_unsupported_reason_names_the_head_dim_or_page_size(head_dim, page_size, dtype, accepted):
  from pallas_kv import validation
  t, hkv = 96, 2
  q = jax.ShapeDtypeStruct((2, 8, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((2, t, hkv, head_dim), dtype)
    problem = validation.validate_dense(q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((2 * t // page_size, page_size, hkv, head_dim), dtype)
    tables = jax.ShapeDtypeStruct((2, t // page_size), jnp.int32)
    problem = validation.validate_paged(q, pages, pages, tables, lengths)
  scales = "head" if jnp.dtype(dtype).itemsize == 1 else None
  options = AttentionOptions(scale=0.1, k_scale=scales, v_scale=scales)
  reason = mgpu_config.unsupported_reason("decode" if page_size is None else "paged", problem, options,
                                          (jnp.bfloat16, dtype))
  if accepted:
    assert reason is None
  else:
    assert reason and (f"head_dim {head_dim}" in reason or f"page_size {page_size}" in reason), reason
