"""The varlen query form (q [total, Hq, D] with cu_seqlens_q) and the per-sequence window start, on every
impl and through DecodeAttention, against per-sequence calls of the reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_kv as pkv
from harness import TRITON_CUSTOM_CALL, assert_lse_matches, assert_matches_reference, check_against_reference
from harness import attend, lower_for_cuda, make_case, tiered

KERNEL_CONFIGS = {"triton": pkv.TritonConfig(block_kv=32, num_stages=2, num_splits=2),
                  "mosaic_gpu": pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2)}


def _varlen_case(seed, counts, *, capacity=128, page_size=None, dtype=jnp.bfloat16, lengths=None):
  """A case whose sequence b brings counts[b] new tokens: (case, q [total, Hq, D], cu_seqlens [B + 1])."""
  batch, most = len(counts), max(counts)
  rng = np.random.default_rng(seed)
  if lengths is None:
    lengths = [int(rng.integers(c, capacity + 1)) for c in counts]
  case = make_case(seed, batch=batch, seq_len=capacity, num_heads=8, num_kv_heads=2, head_dim=64,
                   num_queries=most, dtype=dtype, page_size=page_size, lengths=lengths)
  q = jnp.concatenate([case.q[b, most - c:] for b, c in enumerate(counts)])
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
  return case, q, cu


def _check_per_sequence(case, counts, cu, out, lse, **options):
  """Each sequence's rows of (out, lse) against the reference of that sequence alone, in the padded form."""
  most = max(counts)
  f32 = lambda x: x.astype(jnp.float32)
  for b, c in enumerate(counts):
    ref, ref_lse = pkv.decode_attention_reference(
        f32(case.q[b:b + 1, most - c:]), f32(case.k[b:b + 1]), f32(case.v[b:b + 1]), case.lengths[b:b + 1],
        return_lse=True, **{k: v[b:b + 1] if k == "window_start" else v for k, v in options.items()})
    rows = slice(int(cu[b]), int(cu[b + 1]))
    assert_matches_reference(out[rows], ref[0], case.dtype)
    assert_lse_matches(lse[rows], ref_lse[0], case.dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_xla_matches_each_sequence_alone(paged):
  counts = [3, 1, 5, 2]
  case, q, cu = _varlen_case(1, counts, page_size=16 if paged else None, dtype=jnp.float32)
  if paged:
    call = lambda q, **kw: pkv.paged_decode_attention(q, case.k_pages, case.v_pages, case.block_tables,
                                                      case.lengths, **kw)
  else:
    call = lambda q, **kw: pkv.decode_attention(q, case.k, case.v, case.lengths, **kw)
  out, lse = call(q, cu_seqlens_q=cu, max_seqlen_q=5, return_lse=True, impl="xla")
  assert out.shape == q.shape and lse.shape == q.shape[:2]
  _check_per_sequence(case, counts, cu, out, lse)
  # The default bound (min(16, total)) gives the same rows; under jit too.
  wide = jax.jit(lambda q, cu: call(q, cu_seqlens_q=cu, impl="xla"))(q, cu)
  np.testing.assert_allclose(np.asarray(wide), np.asarray(out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,paged", tiered(
    [("triton", False), ("triton", True), ("mosaic_gpu", False), ("mosaic_gpu", True)],
    every_tier=[("triton", True), ("mosaic_gpu", False)]))
def test_varlen_kernels_match_each_sequence_alone(interpret_mode, impl, paged):
  counts = [2, 1, 4]
  case, q, cu = _varlen_case(2, counts, capacity=256, page_size=64 if paged else None, lengths=[256, 77, 130])
  out, lse = attend(case, q, cu_seqlens_q=cu, max_seqlen_q=4, return_lse=True, impl=impl,
                    config=KERNEL_CONFIGS[impl])
  _check_per_sequence(case, counts, cu, out, lse)


def test_varlen_mla_matches_the_padded_form():
  rng = np.random.default_rng(3)
  counts, most, page = [2, 3], 3, 16
  kv = jnp.asarray(rng.standard_normal((9, page, 96)), jnp.float32)
  tables = jnp.asarray([[0, 3, 5, 7], [1, 2, 4, 6]], jnp.int32)
  lengths = jnp.asarray([40, 61], jnp.int32)
  q_padded = jnp.asarray(rng.standard_normal((2, most, 4, 96)), jnp.float32)
  q = jnp.concatenate([q_padded[b, most - c:] for b, c in enumerate(counts)])
  cu = jnp.asarray([0, 2, 5], jnp.int32)
  out = pkv.mla_decode_attention(q, kv, tables, lengths, v_head_dim=64, cu_seqlens_q=cu, max_seqlen_q=most,
                                 impl="xla")
  ref = pkv.mla_decode_attention_reference(q_padded, kv, tables, lengths, v_head_dim=64)
  np.testing.assert_allclose(out[:2], ref[0, 1:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[2:], ref[1], rtol=1e-5, atol=1e-5)


def test_varlen_grad_and_vmap():
  counts = [2, 3]
  case, q, cu = _varlen_case(4, counts, capacity=32, dtype=jnp.float32, lengths=[20, 32])
  f = lambda q: pkv.decode_attention(q, case.k, case.v, case.lengths, cu_seqlens_q=cu, max_seqlen_q=3, impl="xla")
  grad = jax.grad(lambda q: jnp.sum(f(q) ** 2))(q)
  eps, direction = 1e-3, jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)
  numeric = (jnp.sum(f(q + eps * direction) ** 2) - jnp.sum(f(q - eps * direction) ** 2)) / (2 * eps)
  np.testing.assert_allclose(float(jnp.sum(grad * direction)), float(numeric), rtol=2e-2)
  stacked = jax.vmap(f)(jnp.stack([q, 2 * q]))
  np.testing.assert_allclose(np.asarray(stacked[1]), np.asarray(f(2 * q)), rtol=1e-5, atol=1e-6)


def test_varlen_errors_and_checked_mode():
  case, q, cu = _varlen_case(6, [2, 2], capacity=32, dtype=jnp.float32, lengths=[10, 20])
  call = lambda q, cu, **kw: pkv.decode_attention(q, case.k, case.v, case.lengths, cu_seqlens_q=cu, impl="xla",
                                                  **kw)
  with pytest.raises(ValueError, match="q must be \\[total_tokens, Hq, D\\]"):
    call(q[None], cu)
  with pytest.raises(ValueError, match="cu_seqlens_q must be an int32 array"):
    call(q, cu[None])
  with pytest.raises(ValueError, match="max_seqlen_q must be a Python int in \\[1, 16\\]"):
    call(q, cu, max_seqlen_q=17)
  with pytest.raises(ValueError, match="lengths must have shape \\[B\\]=\\(3,\\)"):
    call(q, jnp.asarray([0, 1, 2, 4], jnp.int32))
  f = jax.jit(lambda cu: call(q, cu, max_seqlen_q=2))
  too_many = jnp.asarray([0, 3, 4], jnp.int32)
  with pkv.checked():
    err, _ = checkify.checkify(f)(cu)
    assert err.get() is None
    err, _ = checkify.checkify(f)(too_many)
    assert "at most max_seqlen_q=2 tokens a sequence" in err.get()
  # Unchecked, a token no slot holds comes back as zeros, never another sequence's rows.
  out = f(too_many)
  np.testing.assert_array_equal(np.asarray(out[0]), 0)


@pytest.mark.parametrize("paged", [False, True])
def test_window_start_hides_keys_before_it(paged):
  """window_start[b] equals attending over the cache with its first window_start[b] tokens cut off."""
  case = make_case(7, batch=3, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=32, num_queries=2,
                   dtype=jnp.float32, page_size=16 if paged else None, lengths=[64, 40, 30])
  starts = jnp.asarray([17, 0, 29], jnp.int32)
  if paged:
    out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                     window_start=starts, impl="xla")
  else:
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, window_start=starts, impl="xla")
  for b in range(3):
    s, length = int(starts[b]), int(case.lengths[b])
    cut = pkv.decode_attention_reference(case.q[b:b + 1], case.k[b:b + 1, s:], case.v[b:b + 1, s:],
                                         jnp.asarray([length - s], jnp.int32))
    # The first new token of the last sequence sits before its start: it sees no key.
    np.testing.assert_allclose(np.asarray(out[b]), np.asarray(cut[0]), rtol=1e-5, atol=1e-5)
  ref = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, window_start=starts)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="window_start has shape \\(2,\\); expected \\(3,\\)"):
    pkv.decode_attention(case.q, case.k, case.v, case.lengths, window_start=starts[:2], impl="xla")


def test_window_start_with_window_vmap_and_grad():
  case = make_case(8, batch=2, seq_len=48, num_heads=4, num_kv_heads=2, head_dim=32, dtype=jnp.float32,
                   lengths=[48, 33])
  starts = jnp.asarray([5, 20], jnp.int32)
  f = lambda q, starts: pkv.decode_attention(q, case.k, case.v, case.lengths, window=20, window_start=starts,
                                             impl="xla")
  ref = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths, window=20, window_start=starts)
  np.testing.assert_allclose(np.asarray(f(case.q, starts)), np.asarray(ref), rtol=1e-5, atol=1e-5)
  mapped = jax.vmap(f)(jnp.stack([case.q, case.q]), jnp.stack([starts, starts + 10]))
  np.testing.assert_allclose(np.asarray(mapped[1]), np.asarray(f(case.q, starts + 10)), rtol=1e-5, atol=1e-6)
  assert jnp.all(jnp.isfinite(jax.grad(lambda q: jnp.sum(f(q, starts)))(case.q)))


def _layer(impl="xla", **kw):
  return pkv.DecodeAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, impl=impl, **kw)


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_decode_attention_varlen_step_matches_steps_per_sequence(kind):
  """One varlen step (2, 1 and 3 new tokens) equals each sequence stepping alone with its own S."""
  layer = _layer()
  params = layer.init(jax.random.key(0))
  counts = [2, 1, 3]
  prompt = jax.random.normal(jax.random.key(1), (3, 5, 64))
  x = jax.random.normal(jax.random.key(2), (sum(counts), 64))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)

  def empty(batch):
    if kind == "dense":
      return pkv.KVCache.create(batch, 16, 2, 32, jnp.float32)
    pages = jnp.zeros((4 * batch, 4, 2, 32), jnp.float32)
    tables = jnp.arange(4 * batch, dtype=jnp.int32).reshape(batch, 4)
    return pkv.PagedKVCache(pages, pages, tables, jnp.zeros((batch,), jnp.int32))

  prefill, step = jax.jit(layer.prefill), jax.jit(layer.__call__)   # a compile per shape, not one per op
  _, cache = prefill(params, prompt, empty(3), num_new=jnp.asarray([5, 3, 4], jnp.int32))
  y, after = jax.jit(lambda x, cache: layer(params, x, cache, cu_seqlens=cu, max_seqlen=3))(x, cache)
  assert y.shape == x.shape
  np.testing.assert_array_equal(np.asarray(after.lengths), [7, 4, 7])
  for b, c in enumerate(counts):
    _, alone = prefill(params, prompt[b:b + 1], empty(1), num_new=jnp.asarray([[5, 3, 4][b]], jnp.int32))
    y_alone, _ = step(params, x[None, int(cu[b]):int(cu[b + 1])], alone)
    np.testing.assert_allclose(np.asarray(y[int(cu[b]):int(cu[b + 1])]), np.asarray(y_alone[0]), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("impl,paged,plan", tiered(
    [("triton", False, "per_sequence"), ("triton", True, "balanced"), ("triton", False, "stream_k"),
     ("mosaic_gpu", False, "per_sequence"), ("mosaic_gpu", True, "balanced")],
    every_tier=[("triton", True, "balanced"), ("triton", False, "stream_k"), ("mosaic_gpu", False, "per_sequence")]))
def test_window_start_kernels_match_the_reference(interpret_mode, impl, paged, plan):
  """Starts before, inside and past a tile edge, and past the first new token: splits skip the tiles before."""
  case = make_case(9, batch=3, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=64, num_queries=2,
                   dtype=jnp.bfloat16, page_size=64 if paged else None, lengths=[256, 150, 40])
  starts = jnp.asarray([100, 0, 39], jnp.int32)
  fields = dict(num_splits=3 if plan == "stream_k" else 2, split_plan=plan)
  config = dataclasses.replace(KERNEL_CONFIGS[impl], **fields)
  k, v, k_pages, v_pages = _nan_before(case, starts)
  hidden = dataclasses.replace(case, k=k, v=v, k_pages=k_pages, v_pages=v_pages)
  out = attend(hidden, window_start=starts, return_lse=True, impl=impl, config=config)
  check_against_reference(case, out, window_start=starts)


def _nan_before(case, starts):
  """(k, v, k_pages, v_pages) with NaN in every token before each sequence's window start: never read."""
  before = np.arange(case.k.shape[1])[None, :] < np.asarray(starts)[:, None]   # [B, T]
  nan = lambda x, mask: jnp.where(jnp.asarray(mask)[..., None, None], jnp.nan, x)
  k, v = nan(case.k, before), nan(case.v, before)
  if case.k_pages is None:
    return k, v, None, None
  hidden = np.zeros(case.k_pages.shape[:2], bool)
  tables = np.asarray(case.block_tables)
  for b, t in zip(*np.nonzero(before)):
    hidden[tables[b, t // case.page_size], t % case.page_size] = True
  return k, v, nan(case.k_pages, hidden), nan(case.v_pages, hidden)


@pytest.mark.parametrize("impl,marker", [("triton", TRITON_CUSTOM_CALL), ("mosaic_gpu", "custom_call @mosaic_gpu")])
def test_window_start_and_varlen_lower_for_cuda(impl, marker):
  q = jax.ShapeDtypeStruct((10, 32, 128), jnp.bfloat16)   # 10 tokens over 4 sequences
  pages = jax.ShapeDtypeStruct((512, 16, 8, 128), jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((4, 64), jnp.int32)
  vector = jax.ShapeDtypeStruct((4,), jnp.int32)
  cu = jax.ShapeDtypeStruct((5,), jnp.int32)
  call = lambda q, k, v, t, lengths, starts, cu: pkv.paged_decode_attention(
      q, k, v, t, lengths, window_start=starts, cu_seqlens_q=cu, max_seqlen_q=4, impl=impl)
  text = lower_for_cuda(call, q, pages, pages, tables, vector, vector, cu).mlir_module()
  assert marker in text and "_wstart" in text
  # No while loop around the kernel: on a GPU each of its steps waits on the host (the varlen gather
  # once doubled a user's per-call time with one).
  assert "stablehlo.while" not in text
