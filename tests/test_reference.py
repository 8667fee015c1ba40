"""The float32 references against an independent float64 loop implementation."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import assert_lse_matches, make_case, relative_error
from naive import naive_attention

OPTION_SETS = {
    "plain": {},
    "scale": dict(scale=0.3),
    "softcap": dict(softcap=2.0, scale=1.0),
    "window": dict(window=5),
    "sinks": dict(sinks="random"),
    "window+softcap+sinks": dict(window=7, softcap=3.0, sinks="random"),
}

# (num_heads, num_kv_heads): MHA, GQA, MQA.
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}


def _options(name, num_heads, seed):
  opts = dict(OPTION_SETS[name])
  if opts.get("sinks") == "random":
    opts["sinks"] = jnp.asarray(np.random.default_rng(seed).standard_normal(num_heads) + 1.0, jnp.float32)
  return opts


def _rank4(x):
  return x if x.ndim == 4 else x[:, None]


@pytest.mark.parametrize("num_queries", [None, 1, 3])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_dense_reference(options, heads, num_queries):
  hq, hkv = HEADS[heads]
  case = make_case(hash((options, heads, num_queries)) % 2**31, batch=3, seq_len=24, num_heads=hq,
                   num_kv_heads=hkv, head_dim=16, num_queries=num_queries)
  opts = _options(options, hq, 7)
  out, lse = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, return_lse=True, **opts)
  want_out, want_lse = naive_attention(_rank4(case.q), case.k, case.v, case.lengths, **opts)
  if num_queries is None:
    want_out, want_lse = want_out[:, 0], want_lse[:, 0]
  assert out.dtype == jnp.float32
  assert relative_error(out, want_out) < 1e-5
  assert_lse_matches(lse, want_lse, jnp.float32)


@pytest.mark.parametrize("kv_dtype,k_scale,v_scale", [
    (jnp.int8, "per_head", 0.02),
    (jnp.float8_e4m3fn, 0.5, "per_head"),
    (jnp.float8_e5m2, None, None),
])
def test_quantized_reference(kv_dtype, k_scale, v_scale):
  case = make_case(3, batch=2, seq_len=16, num_heads=4, num_kv_heads=2, head_dim=16, kv_dtype=kv_dtype)
  per_head = jnp.asarray([0.01, 0.03], jnp.float32)
  k_scale = per_head if k_scale == "per_head" else k_scale
  v_scale = per_head if v_scale == "per_head" else v_scale
  out = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale)
  want, _ = naive_attention(case.q[:, None], case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale)
  assert relative_error(out, want[:, 0]) < 1e-5


@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("options", ["plain", "window+softcap+sinks"])
def test_paged_reference_equals_dense_view(page_size, options):
  case = make_case(11, batch=3, seq_len=32, num_heads=8, num_kv_heads=2, head_dim=16, num_queries=2,
                   page_size=page_size)
  opts = _options(options, 8, 5)
  paged = pkv.paged_decode_attention_reference(case.q, case.k_pages, case.v_pages, case.block_tables,
                                               case.lengths, return_lse=True, **opts)
  dense = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, return_lse=True, **opts)
  np.testing.assert_allclose(paged[0], dense[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(paged[1], dense[1])
  want, _ = naive_attention(case.q, case.k, case.v, case.lengths, **opts)
  assert relative_error(paged[0], want) < 1e-5


@pytest.mark.parametrize("num_queries", [None, 2])
def test_mla_reference(num_queries):
  rng = np.random.default_rng(2)
  b, hq, dqk, dv, ps, per_seq = 2, 4, 24, 16, 4, 5
  s = 1 if num_queries is None else num_queries
  q = jnp.asarray(rng.standard_normal((b, s, hq, dqk)), jnp.float32)
  q = q[:, 0] if num_queries is None else q
  num_pages = b * per_seq + 2
  kv_pages = jnp.asarray(rng.standard_normal((num_pages, ps, dqk)), jnp.float32)
  tables = jnp.asarray(rng.permutation(num_pages)[: b * per_seq].reshape(b, per_seq), jnp.int32)
  lengths = jnp.asarray([13, 0], jnp.int32)
  out, lse = pkv.mla_decode_attention_reference(q, kv_pages, tables, lengths, v_head_dim=dv, return_lse=True)
  dense = kv_pages[tables].reshape(b, per_seq * ps, 1, dqk)
  want, want_lse = naive_attention(_rank4(q), dense, dense[..., :dv], lengths)
  if num_queries is None:
    want, want_lse = want[:, 0], want_lse[:, 0]
  assert out.shape == want.shape
  assert relative_error(out, want) < 1e-5
  assert_lse_matches(lse, want_lse, jnp.float32)


def test_lengths_past_capacity_are_clamped():
  case = make_case(4, batch=2, seq_len=16, lengths=[16, 16])
  over = pkv.decode_attention_reference(case.q, case.k, case.v, jnp.asarray([40, -3], jnp.int32))
  clamped = pkv.decode_attention_reference(case.q, case.k, case.v, jnp.asarray([16, 0], jnp.int32))
  np.testing.assert_array_equal(over, clamped)


def test_out_of_range_page_ids_are_clamped():
  case = make_case(5, batch=2, seq_len=16, page_size=4)
  bad = case.block_tables.at[0, 1].set(10_000).at[1, 0].set(-5)
  out = pkv.paged_decode_attention_reference(case.q, case.k_pages, case.v_pages, bad, case.lengths)
  assert np.isfinite(np.asarray(out)).all()


def test_garbage_past_lengths_and_in_pages_of_other_sequences_never_reaches_an_output():
  # Sequence 0 owns page 0, whose values hold NaN past its length; sequence 1's unassigned table
  # entries (-1) clamp to page 0. Neither may turn a valid output non-finite.
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 16)), jnp.float32)
  pages = jnp.asarray(rng.standard_normal((4, 16, 2, 16)), jnp.float32)
  v_pages = pages.at[0, 5:].set(jnp.nan)
  tables = jnp.asarray([[0, 1], [2, -1]], jnp.int32)
  lengths = jnp.asarray([5, 10], jnp.int32)
  for op in (pkv.paged_decode_attention_reference,
             functools.partial(pkv.paged_decode_attention, impl="xla")):
    out = op(q, pages, v_pages, tables, lengths)
    assert np.isfinite(np.asarray(out)).all()
  dense_v = jnp.asarray(rng.standard_normal((2, 16, 2, 16)), jnp.float32).at[:, 12:].set(jnp.inf)
  out = pkv.decode_attention(q, dense_v, dense_v.at[:, 12:].set(jnp.nan), jnp.asarray([12, 3], jnp.int32), impl="xla")
  assert np.isfinite(np.asarray(out)).all()
