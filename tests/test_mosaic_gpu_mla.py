"""The Mosaic GPU MLA kernel (kernels/mosaic_gpu/mla.py), its shipped schedule (one scorer and a P V
partner, P from registers on the GPU; GPU interpret mode runs P through SMEM instead, so CUDA
lowering is the CPU's check of that path): numerics in GPU interpret mode on small latent dims
(Dqk 192 / Dv 128 keep the CPU simulation quick; the kernel is the same code at 576 / 512), the
balanced and per-sequence plans, sequence orders, garbage past lengths and in unnamed pages, race
detection, what it refuses, its configs, CUDA lowering of the shipped configs at the benchmark
shapes, and real shapes on a GPU. The experimental schedules (`pallas_kv.experimental.MLAVariantConfig`)
are tested in test_experimental_mla.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kv as pkv
from harness import assert_lse_matches, assert_matches_reference, lower_for_cuda, paginate
from pallas_kv import validation
from pallas_kv.kernels import frame
from pallas_kv.kernels import plan as split_plan
from pallas_kv.kernels.mosaic_gpu import mla as mgpu_mla
from pallas_kv.kernels.mosaic_gpu import mla_config

IMPL = "mosaic_gpu"
SMALL_QK, SMALL_V = 192, 128      # 128 latent + 64 rope
QK, V = 576, 512                  # DeepSeek-V3
# A complete config (what mla_partials takes): 64-token tiles through a 2-slot ring, per-sequence
# splits in batch order.
BASE = pkv.MosaicMLAConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence", sequence_order="given")


def config(num_splits=1, config_type=pkv.MosaicMLAConfig, **fields):
  """BASE with num_splits and `fields`, as a config_type (an experimental variant config adds its own)."""
  return config_type(**(BASE.given() | dict(num_splits=num_splits) | fields))


def plan_of(config, **fields):
  """The plan of a complete config for a kernel-level call: per sequence, or given `fields`."""
  return pkv.SplitPlan(**(dict(kind="per_sequence", num_splits=config.num_splits, block_kv=config.block_kv) | fields))


def _case(seed, *, batch, seq_len, num_heads, num_queries, page_size, lengths, qk_dim=SMALL_QK,
          dtype=jnp.bfloat16):
  """(q [B, (S,) Hq, Dqk], kv_pages [P, page_size, Dqk] shuffled, block_tables, lengths)."""
  rng = np.random.default_rng(seed)
  shape = (batch, num_heads, qk_dim) if num_queries is None else (batch, num_queries, num_heads, qk_dim)
  q = jnp.asarray(rng.standard_normal(shape), dtype)
  kv = jnp.asarray(rng.standard_normal((batch, seq_len, qk_dim)), dtype)
  pages, tables, _ = paginate(kv, page_size, rng)
  return q, pages, tables, jnp.asarray(lengths, jnp.int32)


def _poisoned(pages, tables, lengths, page_size):
  """NaN in every slot past each length (own pages), in every page no used entry names, and -1
  in table entries past each sequence's last page."""
  pages, tables = np.asarray(pages, np.float32).copy(), np.asarray(tables).copy()
  live = set()
  for b, length in enumerate(np.asarray(lengths)):
    used = -(-int(length) // page_size)
    live.update(tables[b, :used].tolist())
    for j in range(used):
      pages[tables[b, j], np.arange(j * page_size, (j + 1) * page_size) >= length] = np.nan
    tables[b, used:] = -1
  for page in set(range(pages.shape[0])) - live:
    pages[page] = np.nan
  return pages, jnp.asarray(tables, jnp.int32)


def _check(args, out_lse, *, v_head_dim=SMALL_V, scale=None, clean_pages=None, clean_tables=None):
  q, pages, tables, lengths = args
  pages = pages if clean_pages is None else clean_pages
  tables = tables if clean_tables is None else clean_tables
  out, lse = out_lse
  ref, ref_lse = pkv.mla_decode_attention_reference(q.astype(jnp.float32), pages.astype(jnp.float32), tables,
                                                    lengths, v_head_dim=v_head_dim, scale=scale, return_lse=True)
  assert out.dtype == q.dtype
  assert_matches_reference(out, ref, q.dtype)
  assert_lse_matches(lse, ref_lse, q.dtype)


# ---------------------------------------------------------------- interpret mode (CPU)

@pytest.mark.parametrize("page_size,num_queries,num_heads,num_splits,dtype,fields", [
    (16, 2, 4, 2, jnp.bfloat16, {}),
    (64, None, 8, 1, jnp.bfloat16, {}),
    (32, 4, 4, 3, jnp.bfloat16, dict(block_kv=32, num_stages=4)),
    (128, 3, 24, 2, jnp.float16, {}),
], ids=["page16-s2-splits2", "page64-s1-splits1", "page32-s4-bkv32-splits3", "page128-s3-rowblocks2-splits2-fp16"])
def test_mla_interpret(interpret_mode, page_size, num_queries, num_heads, num_splits, dtype, fields):
  # A ragged length (not a multiple of a tile) and one of zero (zeros and no keys, every split
  # empty), shuffled pages; 3 x 24 heads = 72 rows take two row blocks; 32-token tiles through four
  # stages.
  args = _case(page_size + num_heads, batch=2, seq_len=256, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=[219, 0], dtype=dtype)
  out, lse = pkv.mla_decode_attention(*args, v_head_dim=SMALL_V, scale=0.11, return_lse=True, impl=IMPL,
                                      config=config(num_splits, **fields))
  _check(args, (out, lse), scale=0.11)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
  assert np.isneginf(np.asarray(lse[1])).all()


def test_mla_garbage_past_lengths_and_in_unnamed_pages_never_reaches_an_output(interpret_mode):
  page_size = 32
  q, pages, tables, lengths = _case(3, batch=3, seq_len=256, num_heads=4, num_queries=2, page_size=page_size,
                                    lengths=[200, 37, 0])
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, page_size)
  out = pkv.mla_decode_attention(q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths, v_head_dim=SMALL_V,
                                 return_lse=True, impl=IMPL, config=config(2))
  _check((q, pages, tables, lengths), out)


def test_mla_balanced_plan_gives_a_long_sequence_more_splits_and_matches_reference(interpret_mode):
  # The balanced plan (split_plan="balanced"): one tile count per split from the lengths, so at
  # one tile per split the 256-token sequence takes 4 splits and the 130-token one 3 (its last
  # split empty, lse -inf); a zero length takes none. Unbalanced, every sequence would be cut in
  # num_splits equal shares. The merged partials are the reference's; the op runs the balanced
  # plan in test_mla_sequence_order_gives_the_bits_of_batch_order.
  args = _case(8, batch=3, seq_len=256, num_heads=4, num_queries=2, page_size=16, lengths=[256, 0, 130])
  balanced = config(4, split_plan="balanced")
  q, pages, tables, lengths = args
  rows = q.reshape(3, 2 * 4, SMALL_QK)
  out, lse = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=2, v_head_dim=SMALL_V, scale=0.1,
                                   config=balanced, plan=plan_of(balanced, kind="balanced",
                                                                 tiles_per_split=jnp.asarray([1], jnp.int32)),
                                   interpret=plgpu.InterpretGPUParams())
  assert np.isfinite(np.asarray(lse)).any(axis=2).sum(axis=1).tolist() == [4, 0, 3]   # splits with keys
  merged, merged_lse = frame.merge_splits(out[:, None], lse[:, None])
  _check(args, (merged[:, 0].reshape(3, 2, 4, SMALL_V).astype(q.dtype), merged_lse[:, 0].reshape(3, 2, 4)),
         scale=0.1)
  with pytest.raises(ValueError, match="tiles_per_split is given exactly for the balanced plan"):
    pkv.SplitPlan(kind="balanced", num_splits=4, block_kv=64)
  # Through the op the plan comes from the lengths (plan.make_plan), as pkv.plan_splits gives it:
  # splits of at least MIN_TILES_PER_SPLIT tiles.
  plan = pkv.plan_splits(pkv.mla_decode_attention, *args, v_head_dim=SMALL_V, impl=IMPL, config=balanced)
  assert (plan.kind, plan.num_splits, plan.block_kv, plan.order) == ("balanced", 4, 64, None)
  assert plan.tiles_per_split.shape == (1,) and int(plan.tiles_per_split[0]) >= split_plan.MIN_TILES_PER_SPLIT


def test_mla_sequence_order_gives_the_bits_of_batch_order(interpret_mode):
  # Programs take the sequences longest first (or long, short, ...): zero, tile-crossing and
  # page-crossing lengths, 2 splits, and the balanced plan; only the schedule changes, so every
  # output and lse is the bits of batch order. The plan carries the order exactly when the config
  # asks for one.
  args = _case(9, batch=3, seq_len=192, num_heads=4, num_queries=None, page_size=32, lengths=[130, 0, 192])
  kwargs = dict(v_head_dim=SMALL_V, return_lse=True, impl=IMPL)
  op = functools.partial(pkv.mla_decode_attention, *args, **kwargs)
  plan_of_call = functools.partial(pkv.plan_splits, pkv.mla_decode_attention, *args, **kwargs)
  for fields, order in ((dict(num_splits=2), "longest_first"),
                        (dict(num_splits=2, split_plan="balanced"), "long_short")):
    assert plan_of_call(config=config(**fields)).order is None
    given = op(config=config(**fields))
    _check(args, given)
    ordered_config = config(**fields, sequence_order=order)
    plan = plan_of_call(config=ordered_config)
    np.testing.assert_array_equal(np.asarray(plan.order), np.asarray(split_plan.ORDER_FUNCTIONS[order](args[3])))
    assert np.asarray(plan.order).tolist() != [0, 1, 2]
    ordered = op(config=ordered_config)
    for a, b in zip(given, ordered):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  q, pages, tables, lengths = args
  with pytest.raises(ValueError, match=r"SplitPlan.order must be int32 \[3\]"):
    mgpu_mla.mla_partials(q, pages, lengths, tables, num_queries=1, v_head_dim=SMALL_V, scale=0.1, config=BASE,
                          plan=plan_of(BASE, order=jnp.arange(2, dtype=jnp.int32)),
                          interpret=plgpu.InterpretGPUParams())
  with pytest.raises(ValueError, match="stream-K"):
    mgpu_mla.mla_partials(q, pages, lengths, tables, num_queries=1, v_head_dim=SMALL_V, scale=0.1, config=BASE,
                          plan=plan_of(BASE, kind="stream_k"), interpret=plgpu.InterpretGPUParams())


def race_check(args, config, codegen=mla_config.Codegen()):
  """mla_partials under race detection on a 1-sequence case: no race, and the reference's results."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public accessor in jax 0.11
  q, pages, tables, lengths = args
  rows = q.reshape(1, 4, SMALL_QK)
  out, lse = mgpu_mla.mla_partials(rows, pages, lengths, tables, num_queries=1, v_head_dim=SMALL_V, scale=0.1,
                                   config=config, plan=plan_of(config), codegen=codegen,
                                   interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_callbacks.get_races().races_found
  ref = pkv.mla_decode_attention_reference(q.astype(jnp.float32), pages.astype(jnp.float32), tables, lengths,
                                           v_head_dim=SMALL_V, scale=0.1)
  assert_matches_reference(out[:, 0].reshape(ref.shape), ref, q.dtype)


def race_case():
  # 5 tiles through a 2-slot ring, pages of 16 (4 copies per tile), a masked last tile (an odd
  # count: the alternate scorers' last tile has no partner, after two pairs).
  return _case(5, batch=1, seq_len=384, num_heads=4, num_queries=1, page_size=16, lengths=[300])


def test_mla_race_detection_finds_none():
  race_check(race_case(), config())


def test_mla_split_partials_are_stored_in_the_cache_dtype():
  # Split partials in bf16 halve what the splits write and the merge reads; the merged output
  # still matches the reference (test_mla_interpret).
  q, pages, tables, lengths = _case(6, batch=1, seq_len=256, num_heads=4, num_queries=1, page_size=64,
                                    lengths=[200])
  two = config(2)
  out, lse = mgpu_mla.mla_partials(q.reshape(1, 4, SMALL_QK), pages, lengths, tables, num_queries=1,
                                   v_head_dim=SMALL_V, scale=0.1, config=two, plan=plan_of(two),
                                   interpret=plgpu.InterpretGPUParams())
  assert out.dtype == jnp.bfloat16 and out.shape == (1, 2, 4, SMALL_V) and lse.dtype == jnp.float32
  assert np.isfinite(np.asarray(lse)).all()


# ---------------------------------------------------------------- what it serves, configs

def _problem(*, num_heads=128, num_queries=1, qk_dim=QK, v_dim=V, page_size=64, batch=4, seq_len=4096,
             dtype=jnp.bfloat16):
  q = jax.ShapeDtypeStruct((batch, num_queries, num_heads, qk_dim), dtype)
  pages = jax.ShapeDtypeStruct((batch * seq_len // page_size, page_size, qk_dim), dtype)
  tables = jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return (q, pages, tables, lengths), validation.validate_mla(q, pages, tables, lengths, v_dim)


@pytest.mark.parametrize("fields,match", [
    (dict(qk_dim=64, v_dim=32), "MLA needs v_head_dim a multiple of 128"),
    (dict(qk_dim=640, v_dim=512), "Dqk <= 576"),
    (dict(page_size=4), "page_size 4 is not supported"),
    (dict(dtype=jnp.float32), "MLA needs a bfloat16, float16 or fp8 .* cache"),
])
def test_mla_calls_it_cannot_serve_are_refused_with_reason(fields, match):
  args, _ = _problem(seq_len=256, **fields)
  args = [jnp.zeros(a.shape, a.dtype) for a in args]
  with pytest.raises(NotImplementedError, match=f"mosaic_gpu.*{match}"):
    pkv.mla_decode_attention(*args, v_head_dim=fields.get("v_dim", V), impl=IMPL)


def test_mla_on_triton_names_what_is_missing_and_auto_on_cpu_runs_xla():
  args, _ = _problem(num_heads=4, batch=1, seq_len=128)
  args = [jnp.zeros(a.shape, a.dtype) for a in args]
  with pytest.raises(NotImplementedError, match="(?i)MLA is not implemented on the triton backend"):
    pkv.mla_decode_attention(*args, impl="triton")
  pkv.mla_decode_attention(*args)
  assert pkv.last_impl() == "xla"


def test_mla_register_splits_are_checked():
  assert mla_config.RegisterSplit().name == "" and mla_config.RegisterSplit(40, 232).name == "_r40_232"
  assert mla_config.Codegen().name == "" and mla_config.Codegen(q_per_tile=False).name == "_heldq"
  assert mla_config.Codegen(mla_config.RegisterSplit(40, 232), q_per_tile=False).name == "_r40_232_heldq"
  assert mla_config.Codegen(slots_per_tile=True).name == "_spt"
  for producer, consumer, match in ((40, 236, "multiple of 8"), (16, 240, r"\[24, 256\]"),
                                    (32, 240, "three warpgroups launch with 504")):   # 512 > 504
    with pytest.raises(ValueError, match=match):
      mla_config.RegisterSplit(producer, consumer)


def test_mla_configs_are_checked():
  check = functools.partial(mla_config.check_config, qk_dim=QK, v_dim=V, dtype=jnp.bfloat16, page_size=64)
  check(config())
  with pytest.raises(ValueError, match="block_kv=128 must be one of"):
    pkv.MosaicMLAConfig(block_kv=128)
  check(config(block_kv=32, num_stages=4))   # 32-token tiles: four stages fit where 64-token ones take two
  with pytest.raises(ValueError, match="SMEM"):
    check(config(block_kv=32, num_stages=5))
  with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
    pkv.MosaicMLAConfig(num_stages=1)
  with pytest.raises(ValueError, match="SMEM"):
    check(config(num_stages=3))
  with pytest.raises(ValueError, match=r"split_plan='stream_k' must be one of \('per_sequence', 'balanced'\)"):
    pkv.MosaicMLAConfig(split_plan="stream_k")
  with pytest.raises(ValueError, match="sequence_order='backwards' must be one of"):
    pkv.MosaicMLAConfig(sequence_order="backwards")
  # GQA's fields and the experimental schedules' are not fields of the shipped config.
  for foreign in (dict(kv_groups=2), dict(pipeline_qk=True), dict(split_scores=True), dict(p_in_registers=False)):
    with pytest.raises(TypeError):
      pkv.MosaicMLAConfig(**foreign)
  with pytest.raises(ValueError, match="complete MosaicMLAConfig"):
    check(pkv.MosaicMLAConfig(num_stages=2))
  with pytest.raises(ValueError, match="complete MosaicMLAConfig"):
    check(pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=1, split_plan="per_sequence", kv_groups=1,
                              pipeline_qk=False, persistent=False))
  # The shipped config runs the shipped schedule: P V from registers, the scorer and its partner.
  assert mla_config.variant_schedule(config()) is None
  # Through the op: a config of the other kernel, or a kernel-level plan of another call.
  args, _ = _problem(num_heads=4, batch=1, seq_len=128)
  args = [jnp.zeros(a.shape, a.dtype) for a in args]
  with pytest.raises(TypeError, match="takes a MosaicMLAConfig"):
    pkv.mla_decode_attention(*args, v_head_dim=V, impl=IMPL, config=pkv.MosaicGPUConfig(block_kv=64))
  with pytest.raises(ValueError, match="was made for another call"):
    pkv.mla_decode_attention(*args, v_head_dim=V, impl=IMPL, config=config(),
                             plan=plan_of(config(), num_splits=2))
  # Two 64 x 576 stages beside Q fill SMEM (as FlashMLA's); small latent dims get a deeper ring.
  _, problem = _problem()
  heuristic = mla_config.heuristic_config(problem)
  assert heuristic.num_stages == 2 and type(heuristic) is pkv.MosaicMLAConfig   # the shipped schedule
  _, small = _problem(qk_dim=SMALL_QK, v_dim=SMALL_V)
  assert mla_config.heuristic_config(small).num_stages > 2


# (B, T, heads, splits, order): past one wave of programs (batch x row blocks x splits > 132 SMs)
# the heuristic takes the sequences longest first.
@pytest.mark.parametrize("batch,seq_len,num_heads,want_splits,want_order", [
    (1, 32768, 128, 64, "given"), (16, 4096, 128, 4, "given"), (64, 4096, 128, 1, "given"),
    (128, 8192, 128, 1, "longest_first"), (64, 8192, 16, 2, "given"), (67, 4096, 128, 1, "longest_first")])
def test_mla_split_count_fills_one_wave(batch, seq_len, num_heads, want_splits, want_order):
  _, problem = _problem(batch=batch, seq_len=seq_len, num_heads=num_heads)
  resolved = mla_config.resolve_config(problem, None, num_sms=132)
  assert resolved.complete and (resolved.num_splits, resolved.sequence_order) == (want_splits, want_order)
  # A config that leaves the order None takes the heuristic's; one that says "given" keeps it.
  partial = pkv.MosaicMLAConfig(block_kv=64, num_stages=2)
  assert mla_config.resolve_config(problem, partial, num_sms=132).sequence_order == want_order
  explicit = pkv.MosaicMLAConfig(block_kv=64, num_stages=2, sequence_order="given")
  assert mla_config.resolve_config(problem, explicit, num_sms=132).sequence_order == "given"


def test_mla_balanced_plan_bounds_the_splits_by_the_batch():
  # The balanced plan sizes the grid for a batch at least half full: at B128 (two row blocks of
  # 128 heads) up to 5 splits where the per-sequence plan takes 1; at B1, the most splits.
  _, ragged = _problem(batch=128, seq_len=8192)
  balanced = pkv.MosaicMLAConfig(block_kv=64, num_stages=2, split_plan="balanced")
  assert mla_config.resolve_config(ragged, None, num_sms=132).num_splits == 1
  assert mla_config.resolve_config(ragged, balanced, num_sms=132).num_splits == 5
  _, one = _problem(batch=1, seq_len=32768)
  assert mla_config.resolve_config(one, balanced, num_sms=132).num_splits == split_plan.MAX_SPLITS


# ---------------------------------------------------------------- CUDA lowering (CPU)

# The benchmark rows (benchmarks/mla.py), then page sizes, new tokens and fp16.
LOWERING_SHAPES = [
    dict(batch=1, seq_len=32768), dict(batch=16, seq_len=4096), dict(batch=64, seq_len=4096),
    dict(batch=128, seq_len=8192), dict(batch=64, seq_len=8192, num_heads=16),
    dict(batch=64, seq_len=4096, num_queries=2),
    dict(batch=8, seq_len=4096, page_size=16, num_queries=4), dict(batch=8, seq_len=4096, page_size=32, num_queries=3),
    dict(batch=8, seq_len=4096, page_size=128, num_heads=32), dict(batch=8, seq_len=4096, num_heads=64, dtype=jnp.float16),
    dict(batch=2, seq_len=1024, qk_dim=SMALL_QK, v_dim=SMALL_V, num_heads=4),
]


def _shape_id(shape):
  return "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in shape.items())


# Every row but B16 T4096 (the code of B1 T32768, four splits in place of 64) and pages of 32 (the
# code of pages of 16, two copies a tile in place of four): one split and many, one row block to
# four, longest first (B128 T8192), pages of 16 and 128, fp16, small latent dims.
@pytest.mark.parametrize("shape", [s for i, s in enumerate(LOWERING_SHAPES) if i not in (1, 7)], ids=_shape_id)
def test_mla_shipped_configs_lower_for_cuda(shape):
  module, resolved = lower_mla(shape, None)
  assert ("_ordered" in module) == (resolved.sequence_order != "given")   # B128 T8192: longest first
  assert "_regp" in module   # the scorer's P V from registers


# 32-token tiles (the tiles' 64-byte rows set every operand's swizzle), in fp16.
def test_mla_32_token_tiles_lower_for_cuda():
  lower_mla(LOWERING_SHAPES[9], pkv.MosaicMLAConfig(block_kv=32, num_stages=4))


# The balanced plan at B128 (two row blocks, 5 splits); longest first with it at B16 (4 splits):
# the shipped configs above lower longest first alone at B128 T8192, where the heuristic takes it.
def test_mla_balanced_plan_lowers_for_cuda():
  module, _ = lower_mla(LOWERING_SHAPES[3], pkv.MosaicMLAConfig(split_plan="balanced"))
  assert "_balanced" in module


def test_mla_longest_first_with_the_balanced_plan_lowers_for_cuda():
  module, _ = lower_mla(LOWERING_SHAPES[1], pkv.MosaicMLAConfig(sequence_order="longest_first",
                                                                split_plan="balanced"))
  assert "_balanced" in module and "_ordered" in module


def lower_mla(shape, given):
  """The op lowered for CUDA at `shape` (`_problem`'s fields) with the config resolved from `given`:
  (module, the resolved config)."""
  args, problem = _problem(**shape)
  resolved = mla_config.resolve_config(problem, given, num_sms=132)
  exported = lower_for_cuda(functools.partial(pkv.mla_decode_attention, v_head_dim=problem.v_head_dim,
                                              return_lse=True, impl=IMPL, config=resolved), *args)
  module = exported.mlir_module()
  assert "custom_call @mosaic_gpu" in module and "pallas_kv_mla" in module
  return module, resolved


# ---------------------------------------------------------------- on the GPU

def gpu_case(batch, seq_len, num_heads, num_queries, page_size):
  """(args, poisoned pages, poisoned tables) of a GPU case at Dqk 576: ragged, one full, one empty."""
  rng = np.random.default_rng(batch + num_heads)
  lengths = rng.integers(1, seq_len + 1, size=batch)
  lengths[0] = seq_len
  if batch > 2:
    lengths[1] = 0
  args = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries,
               page_size=page_size, lengths=lengths, qk_dim=QK)
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, page_size)
  return args, jnp.asarray(bad_pages, q.dtype), bad_tables


GPU_SHAPES = [(1, 32768, 128, None, 64), (16, 4096, 128, 2, 64), (64, 4096, 128, None, 16), (8, 8192, 16, 4, 128),
              (4, 4096, 64, 3, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries,page_size", GPU_SHAPES)
def test_gpu_mla_matches_reference(batch, seq_len, num_heads, num_queries, page_size):
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  args, bad_pages, bad_tables = gpu_case(batch, seq_len, num_heads, num_queries, page_size)
  q, _, _, lengths = args
  out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True))(
      q, bad_pages, bad_tables, lengths)
  assert pkv.last_impl() == IMPL
  _check(args, out, v_head_dim=V)
  for fields in (dict(), dict(block_kv=32, num_stages=4), dict(split_plan="balanced"),
                 dict(sequence_order="longest_first"), dict(split_plan="balanced", sequence_order="long_short")):
    given = pkv.MosaicMLAConfig(**fields)
    out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True, impl=IMPL,
                                    config=given))(q, bad_pages, bad_tables, lengths)
    _check(args, out, v_head_dim=V)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len,num_heads,num_queries", [(4, 4096, 128, None), (3, 8192, 64, 2)])
def test_gpu_mla_split_merge_matches_reference(batch, seq_len, num_heads, num_queries):
  """The op's split merge on the GPU: ragged, zero and short lengths leave splits with no key,
  whose partials are unwritten."""
  from pallas_kv import runtime
  if not runtime.is_hopper_or_newer():
    pytest.skip("needs a Hopper GPU (compute capability 9.0+)")
  lengths = [seq_len, 0, 100, seq_len // 3][:batch]
  args = _case(batch, batch=batch, seq_len=seq_len, num_heads=num_heads, num_queries=num_queries, page_size=64,
               lengths=lengths, qk_dim=QK)
  q, pages, tables, lengths = args
  bad_pages, bad_tables = _poisoned(pages, tables, lengths, 64)
  for given in (None, pkv.MosaicMLAConfig(num_splits=8)):
    out = jax.jit(functools.partial(pkv.mla_decode_attention, v_head_dim=V, return_lse=True, config=given))(
        q, jnp.asarray(bad_pages, q.dtype), bad_tables, lengths)
    assert pkv.last_impl() == IMPL
    _check(args, out, v_head_dim=V)


# ---------------------------------------------------------------- the benchmark program

@pytest.mark.slow   # a whole-program smoke run; make test-slow
def test_mla_benchmark_runs_a_tiny_case_on_cpu():
  import io
  from benchmarks import mla as mla_bench
  out = io.StringIO()
  rows = mla_bench.run(mla_bench.cpu_rows(), iters=2, repeats=1, out=out)
  assert rows and all(r["status"] == "ok" for r in rows), rows
  assert all(r["rel_err"] < 1e-2 for r in rows if r["impl"] != "bf16_einsum")
  assert "bf16_einsum" in out.getvalue() and "roofline" in out.getvalue()


def test_mla_benchmark_names_its_kernel_variants():
  from benchmarks import mla as mla_bench
  from pallas_kv.experimental import MLAVariantConfig
  assert mla_bench.variant_fields("mosaic_gpu_sp33") == dict(num_splits=33)
  assert mla_bench.variant_fields("mosaic_gpu_halves") == dict(split_scores=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_balanced") == dict(split_plan="balanced")
  assert mla_bench.variant_fields("mosaic_gpu_rows_as_n") == dict(rows_as_n=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_pqk") == dict(pipeline_qk=True, block_kv=32, num_stages=4,
                                                            p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_bkv32") == dict(block_kv=32, num_stages=4, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_alt") == dict(alternate_scores=True, p_in_registers=False)
  assert mla_bench.variant_fields("mosaic_gpu_rh") == dict(ring_halves=True)
  assert mla_bench.variant_fields("mosaic_gpu_smemp") == dict(p_in_registers=False)
  # Variants change the heuristic's config: the benchmark's base is what the heuristic gives, a
  # shipped config; the fields of another schedule make an experimental variant config.
  _, problem = _problem()
  assert pkv.MosaicMLAConfig(**(mla_bench.DEFAULT_FIELDS | mla_bench.PLAN_FIELDS)) == mla_config.heuristic_config(problem)
  assert type(mla_bench.config_of(mla_bench.VARIANTS["mosaic_gpu_lf"])) is pkv.MosaicMLAConfig
  assert isinstance(mla_bench.config_of(mla_bench.VARIANTS["mosaic_gpu_halves"]), MLAVariantConfig)
  config, plan = mla_bench.kernel_config({}, 3)
  assert config.complete and (plan.kind, plan.num_splits, plan.block_kv) == ("per_sequence", 3, 64)
  assert mla_bench.variant_fields("mosaic_gpu") is None and mla_bench.is_ours("mosaic_gpu_sp4")
  # The kernel's launch alone under each schedule, with or without a probe's stages left out.
  assert mla_bench.KERNEL_IMPLS["kernel_alt_no_loads"] == (dict(alternate_scores=True, p_in_registers=False),
                                                           frozenset({"loads"}), {})
  assert mla_bench.KERNEL_IMPLS["kernel_rh"] == (dict(ring_halves=True), frozenset(), {})
  assert mla_bench.KERNEL_IMPLS["kernel_alt_r232_no_qk"] == (dict(alternate_scores=True, p_in_registers=False),
                                                             frozenset({"qk"}), dict(registers=(40, 232)))
  assert mla_bench.KERNEL_IMPLS["kernel_r232_heldq"][2] == dict(registers=(40, 232), q_per_tile=False)
  assert mla_bench.KERNEL_IMPLS["kernel_alt_spt"][2] == dict(slots_per_tile=True)
  assert mla_bench.is_ours("kernel_alt") and not mla_bench.is_probe("kernel_alt")
  assert mla_bench.is_probe("kernel_rh_no_pv") and not mla_bench.is_ours("kernel_rh_no_pv")
  row = mla_bench.cpu_rows()[0]
  for bad in ("mosaic_gpu_sp0", "mosaic_gpu_sp", "flashmla"):
    with pytest.raises(ValueError, match="unknown impl"):
      mla_bench.build_fn(bad, row)


def benchmark_launches(impls):
  """(baseline, {impl: output}) of benchmarks.mla's impls on its tiny CPU row (kernels in interpret mode)."""
  from benchmarks import cases as bench_cases
  from benchmarks import mla as mla_bench
  row = mla_bench.cpu_rows()[0]
  case = row.case()
  lengths = bench_cases.make_lengths(case, jax.random.key(1))
  args = bench_cases.make_input_sets(case, jax.random.key(2), lengths, 1)[0]
  baseline = np.asarray(mla_bench.build_fn(mla_bench.BASELINE, row)(*args), np.float32)
  with pkv.interpret():
    return baseline, {impl: np.asarray(mla_bench.build_fn(impl, row)(*args), np.float32) for impl in impls}


def test_mla_kernel_launch_matches_the_baseline_and_its_probes_run_in_interpret_mode():
  """benchmarks.mla's `kernel` impl (the launch alone, TileMath as the kernel uses it, the shipped
  schedule) matches the bf16 baseline; its probes, which leave stages of the tile's math out, run
  and change the output (a probe that left nothing out would measure nothing). The other
  schedules' launches: test_experimental_mla.py."""
  from benchmarks import cases as bench_cases
  from benchmarks import mla as mla_bench
  probes = ("kernel_no_softmax", "kernel_loads_only")
  baseline, outs = benchmark_launches((mla_bench.KERNEL,) + probes)
  assert bench_cases.relative_error(outs[mla_bench.KERNEL], baseline) < 1e-2
  for impl in probes:
    assert outs[impl].shape == baseline.shape and mla_bench.is_probe(impl) and not mla_bench.is_ours(impl)
    assert not np.allclose(outs[impl], outs[mla_bench.KERNEL], atol=1e-2, equal_nan=True), impl


def lower_benchmark_launch(impl):
  """benchmarks.mla's impl lowered for CUDA at its h128_b64_t4096 row; its module, checked for names."""
  from benchmarks import mla as mla_bench
  row = mla_bench.ALL_ROWS["h128_b64_t4096"]
  args, _ = _problem(batch=row.batch, seq_len=row.seq_len, num_heads=row.num_heads)
  module = lower_for_cuda(mla_bench.build_fn(impl, row), *args).mlir_module()
  assert "custom_call @mosaic_gpu" in module and "pallas_kv_mla" in module
  if mla_bench.is_probe(impl):
    assert f"_{impl}" in module   # a probe's kernel says so in its name
  if "_r232" in impl:   # and so does a register split other than the default
    assert "_r40_232" in module
  for option in ("_heldq", "_spt"):   # and Q's descriptors held, the ring's slots opaque
    assert (option in impl) == (option in module), option
  return module


# The shipped schedule's probes of the loads' waits and of one row block's loads (each lowering
# takes 5-9 s on 2 cores); the other schedules', the other stages' and Codegen's: test_experimental_mla.py.
@pytest.mark.parametrize("impl", ["kernel_late_waits", "kernel_one_loader"])
def test_mla_kernel_launch_probes_lower_for_cuda(impl):
  assert "_regp" in lower_benchmark_launch(impl)
