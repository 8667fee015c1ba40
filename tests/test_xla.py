"""The "xla" impl (`pallas_kv.xla`): the float32 oracle's results at the cache's precision, without
ever widening the cache to float32."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import assert_lse_matches, assert_matches_reference, make_case

OPTIONS = {"plain": {}, "softcap-window": dict(softcap=20.0, window=37),
           "sinks": dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.3, 1.0], jnp.float32))}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_queries", [None, 3])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_matches_the_reference(options, num_queries, page_size, dtype):
  case = make_case(11, batch=3, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=num_queries,
                   dtype=dtype, page_size=page_size, lengths=[128, 45, 0])
  opts = OPTIONS[options]
  if page_size is None:
    out, lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl="xla", **opts)
  else:
    out, lse = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                          return_lse=True, impl="xla", **opts)
  f32 = lambda x: x.astype(jnp.float32)
  ref, ref_lse = pkv.decode_attention_reference(f32(case.q), f32(case.k), f32(case.v), case.lengths,
                                                return_lse=True, **opts)
  assert out.dtype == dtype
  assert_matches_reference(out, ref, dtype)
  assert_lse_matches(lse, ref_lse, dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", ["number", "head", "token"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_quantized_caches_match_the_reference(kv_dtype, kind, page_size):
  rng = np.random.default_rng(5)
  case = make_case(12, batch=2, seq_len=64, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, kv_dtype=kv_dtype, lengths=[64, 29])
  if kind == "number":
    k_scale, v_scale = 0.02, 0.03
  elif kind == "head":
    k_scale, v_scale = (jnp.asarray(rng.uniform(0.01, 0.05, 2), jnp.float32) for _ in range(2))
  else:
    k_scale, v_scale = (jnp.asarray(rng.uniform(0.01, 0.05, (2, 64, 2)), jnp.float32) for _ in range(2))
  ref = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale)
  if page_size is None:
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, k_scale=k_scale, v_scale=v_scale, impl="xla")
  else:   # one page per 16 tokens, in order: table row b names pages 4b .. 4b+3
    paged = lambda x: x.reshape(2 * 64 // page_size, page_size, *x.shape[2:])
    tables = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    if kind == "token":
      k_scale, v_scale = paged(k_scale), paged(v_scale)
    out = pkv.paged_decode_attention(case.q, paged(case.k), paged(case.v), tables, case.lengths, k_scale=k_scale,
                                     v_scale=v_scale, impl="xla")
  assert_matches_reference(out, ref, jnp.bfloat16)


def test_mla_matches_the_reference():
  # Three sequences (one empty) on shuffled pages; every latent slot past a length, and the page
  # no table names, holds NaN, which must not reach a valid output.
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((3, 2, 16, 96)), jnp.bfloat16)
  clean = rng.standard_normal((13, 16, 96)).astype(np.float32)
  order = rng.permutation(13)
  tables_np = order[:12].reshape(3, 4)
  lengths = jnp.asarray([61, 5, 0], jnp.int32)
  poisoned = clean.copy()
  poisoned[order[12]] = np.nan
  for b, length in enumerate(np.asarray(lengths)):
    for slot in range(length, 64):
      poisoned[tables_np[b, slot // 16], slot % 16] = np.nan
  tables = jnp.asarray(tables_np, jnp.int32)
  kv_pages = jnp.asarray(clean, jnp.bfloat16)
  out, lse = pkv.mla_decode_attention(q, jnp.asarray(poisoned, jnp.bfloat16), tables, lengths, v_head_dim=64,
                                      return_lse=True, impl="xla")
  ref, ref_lse = pkv.mla_decode_attention_reference(q, kv_pages, tables, lengths, v_head_dim=64, return_lse=True)
  assert_matches_reference(out, ref, jnp.bfloat16)
  assert_lse_matches(lse, ref_lse, jnp.bfloat16)


def _float32_shapes(fn, *args) -> set[tuple[int, ...]]:
  """Shapes of every float32 array in fn's jaxpr, nested jaxprs included."""
  shapes = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        if getattr(var.aval, "dtype", None) == jnp.float32:
          shapes.add(tuple(var.aval.shape))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_the_cache_is_never_widened_to_float32(kv_dtype):
  case = make_case(13, batch=2, seq_len=96, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   kv_dtype=kv_dtype, page_size=16)
  scales = dict(k_scale=jnp.full((2, 96, 2), 0.02), v_scale=jnp.full((2,), 0.03)) if kv_dtype == jnp.int8 else {}
  dense = functools.partial(pkv.decode_attention, impl="xla", **scales)
  shapes = _float32_shapes(dense, case.q, case.k, case.v, case.lengths)
  assert case.k.shape not in shapes
  assert _float32_shapes(functools.partial(pkv.decode_attention_reference, **scales),
                         case.q, case.k, case.v, case.lengths) >= {case.k.shape}   # the oracle does widen
  if kv_dtype == jnp.bfloat16:
    paged = functools.partial(pkv.paged_decode_attention, impl="xla")
    shapes = _float32_shapes(paged, case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
    assert case.k_pages.shape not in shapes and case.k.shape not in shapes
