"""Every shape real models use runs in a kernel: on a GPU, "auto" picks a kernel backend (never xla) for head
dims 32-512, any number of q heads per kv head up to 128, small pages, varlen queries and window starts; a
fallback that remains says why, once."""

import logging

import jax
import jax.numpy as jnp
import pytest

from pallas_kv import api
from pallas_kv import validation

ROWS_SDS = jax.ShapeDtypeStruct


def _dense_problem(*, batch=4, heads=32, kv_heads=8, head_dim=128, capacity=4096, num_queries=1,
                   dtype=jnp.bfloat16):
  q = ROWS_SDS((batch, num_queries, heads, head_dim), jnp.bfloat16)
  k = ROWS_SDS((batch, capacity, kv_heads, head_dim), dtype)
  return validation.validate_dense(q, k, k, ROWS_SDS((batch,), jnp.int32))


def _paged_problem(*, page_size, batch=4, heads=32, kv_heads=8, head_dim=128, num_queries=1):
  q = ROWS_SDS((batch, num_queries, heads, head_dim), jnp.bfloat16)
  pages = ROWS_SDS((batch * 4096 // page_size, page_size, kv_heads, head_dim), jnp.bfloat16)
  tables = ROWS_SDS((batch, 4096 // page_size), jnp.int32)
  return validation.validate_paged(q, pages, pages, tables, ROWS_SDS((batch,), jnp.int32))


def _choice(op, problem, *, window_start=None, dtypes=(jnp.bfloat16, jnp.bfloat16)):
  options = api._options(problem, None, None, None, None, None, None, window_start)
  return api.choose_impl("auto", op, problem, options, dtypes, None)[0]


@pytest.fixture
def on_hopper(monkeypatch):
  monkeypatch.setattr(api, "device_can_run", lambda name: True)


def test_every_head_dim_from_32_to_512_runs_in_a_kernel(on_hopper):
  for head_dim in range(32, 513, 8):
    for op, problem in (("decode", _dense_problem(head_dim=head_dim)),
                        ("paged", _paged_problem(page_size=16, head_dim=head_dim))):
      assert _choice(op, problem) != "xla", f"{op} head_dim {head_dim}"


@pytest.mark.parametrize("heads,kv_heads", [(20, 1), (40, 2), (48, 1), (71, 1), (128, 1), (64, 8)])
@pytest.mark.parametrize("num_queries", [1, 4, 16])
def test_any_q_heads_per_kv_head_up_to_128_runs_in_a_kernel(on_hopper, heads, kv_heads, num_queries):
  problem = _dense_problem(heads=heads, kv_heads=kv_heads, num_queries=num_queries)
  assert _choice("decode", problem) != "xla"


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64, 48])
def test_small_and_odd_pages_run_in_a_kernel(on_hopper, page_size):
  assert _choice("paged", _paged_problem(page_size=page_size)) != "xla"


def test_window_start_runs_in_a_kernel(on_hopper):
  starts = ROWS_SDS((4,), jnp.int32)
  assert _choice("decode", _dense_problem(), window_start=starts) != "xla"
  assert _choice("paged", _paged_problem(page_size=16), window_start=starts) != "xla"


def test_a_remaining_fallback_is_logged_once_with_its_reason(on_hopper, caplog, monkeypatch):
  monkeypatch.setattr(api, "_fallbacks_logged", set())
  problem = _dense_problem(dtype=jnp.float32)   # no kernel reads a float32 cache
  with caplog.at_level(logging.WARNING, logger="pallas_kv"):
    for _ in range(3):
      assert _choice("decode", problem, dtypes=(jnp.bfloat16, jnp.float32)) == "xla"
  messages = [r.getMessage() for r in caplog.records if r.name == "pallas_kv"]
  assert len(messages) == 1, messages
  assert "impl='auto' runs this decode call on xla" in messages[0] and "float32" in messages[0]
  assert "triton:" in messages[0] and "mosaic_gpu:" in messages[0]


def test_no_fallback_is_logged_on_a_cpu(caplog, monkeypatch):
  monkeypatch.setattr(api, "device_can_run", lambda name: False)
  with caplog.at_level(logging.WARNING, logger="pallas_kv"):
    assert _choice("decode", _dense_problem(head_dim=36)) == "xla"
  assert not [r for r in caplog.records if r.name == "pallas_kv"]


# ---------------------------------------------------------------- on the GPU (realistic sizes, the default configs)

import pallas_kv as pkv   # noqa: E402  (the tests above need only api and validation)
from harness import attend, check_against_reference, make_case, poison_unread_slots, tiered   # noqa: E402

# (impl, heads, kv heads, head dim, page size, new tokens)
_GPU_CASES = [
    ("triton", 48, 1, 128, None, 1), ("mosaic_gpu", 71, 1, 128, None, 2), ("mosaic_gpu", 40, 2, 128, 16, 1),
    ("mosaic_gpu", 16, 2, 96, None, 2), ("mosaic_gpu", 16, 2, 80, 16, 1), ("mosaic_gpu", 16, 2, 192, None, 1),
    ("mosaic_gpu", 16, 2, 128, 1, 2), ("mosaic_gpu", 16, 2, 128, 2, 1), ("mosaic_gpu", 16, 2, 64, 4, 3),
    ("triton", 16, 2, 96, 1, 2), ("triton", 128, 1, 64, 16, 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,heads,kv_heads,head_dim,page_size,num_queries", tiered(
    _GPU_CASES, every_tier=[_GPU_CASES[1], _GPU_CASES[3], _GPU_CASES[6]]))
def test_gpu_new_shapes_match_the_reference(impl, heads, kv_heads, head_dim, page_size, num_queries):
  """Wide groups, head dims past 64 / 128 / 256 and small pages on the GPU, garbage in every unread slot;
  a page-1 ring wraps (more tiles per split than stages)."""
  case = make_case(head_dim + heads, batch=3, seq_len=1024, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=head_dim, num_queries=num_queries, dtype=jnp.bfloat16, page_size=page_size,
                   lengths=[1024, 0, 613])
  bad = poison_unread_slots(case, dense=page_size is None)
  check_against_reference(case, attend(bad, return_lse=True, impl=impl))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_gpu_varlen_and_window_start_match_the_reference(impl):
  case = make_case(11, batch=4, seq_len=2048, num_heads=32, num_kv_heads=8, head_dim=128, num_queries=4,
                   dtype=jnp.bfloat16, page_size=16, lengths=[2048, 900, 37, 1500])
  starts = jnp.asarray([1000, 0, 36, 1499], jnp.int32)
  check_against_reference(case, attend(case, window_start=starts, return_lse=True, impl=impl), window_start=starts)
  counts = [4, 1, 2, 3]
  q = jnp.concatenate([case.q[b, 4 - c:] for b, c in enumerate(counts)])
  cu = jnp.asarray([0, 4, 5, 7, 10], jnp.int32)
  varlen = attend(case, q, cu_seqlens_q=cu, max_seqlen_q=4, impl=impl)
  padded = attend(case, impl=impl)
  rows = jnp.concatenate([padded[b, 4 - c:] for b, c in enumerate(counts)])
  assert jnp.array_equal(varlen, rows)   # the same kernel on the same padded rows: the same bits


def test_auto_takes_mosaic_gpu_for_wide_groups_where_it_measured_faster(on_hopper):
  # 71 / 1 and a shared prefix's stacked samples (16 x 4 q heads per kv head), two-byte caches: Mosaic GPU.
  assert _choice("decode", _dense_problem(heads=71, kv_heads=1)) == "mosaic_gpu"
  assert _choice("paged", _paged_problem(page_size=16, heads=512, kv_heads=8)) == "mosaic_gpu"
  # Narrower groups, page 1 (Mosaic GPU's one copy per token) and one-byte caches stay on Triton.
  assert _choice("decode", _dense_problem(heads=48, kv_heads=1)) == "triton"
  assert _choice("decode", _dense_problem(num_queries=16)) == "triton"
  assert _choice("paged", _paged_problem(page_size=1, heads=512, kv_heads=8)) == "triton"
  assert _choice("decode", _dense_problem(heads=71, kv_heads=1, dtype=jnp.int8),
                 dtypes=(jnp.bfloat16, jnp.int8)) == "triton"
