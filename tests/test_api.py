"""The public ops on impl="xla": options, jit/vmap/grad, errors, interpret and checked modes."""


import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.test_util import check_grads

import pallas_kv as pkv
from pallas_kv import runtime
import harness
from harness import assert_lse_matches, assert_matches_reference, make_case

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("num_queries", [None, 4])
def test_xla_impl_matches_reference(dtype, num_queries):
  case = make_case(1, batch=3, seq_len=32, num_heads=8, num_kv_heads=2, head_dim=16, num_queries=num_queries,
                   dtype=dtype)
  sinks = jnp.linspace(-1.0, 1.0, 8)
  out, lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, window=9, softcap=5.0, sinks=sinks,
                                  return_lse=True, impl="xla")
  ref, ref_lse = pkv.decode_attention_reference(case.q.astype(jnp.float32), case.k.astype(jnp.float32),
                                                case.v.astype(jnp.float32), case.lengths, window=9, softcap=5.0,
                                                sinks=sinks, return_lse=True)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert out.shape == case.q.shape and lse.shape == case.q.shape[:-1]
  assert_matches_reference(out, ref, dtype)
  assert_lse_matches(lse, ref_lse, dtype)


def test_paged_and_mla_xla_impl():
  case = make_case(2, batch=2, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8,
                   dtype=jnp.bfloat16)
  out = pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                                   impl="xla")
  ref = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths)
  assert_matches_reference(out, ref, jnp.bfloat16)
  kv = case.k_pages[:, :, 0, :]
  out = pkv.mla_decode_attention(case.q, kv, case.block_tables, case.lengths, v_head_dim=8, impl="xla")
  ref = pkv.mla_decode_attention_reference(case.q, kv, case.block_tables, case.lengths, v_head_dim=8)
  assert out.shape == (2, 4, 8)
  assert_matches_reference(out, ref, jnp.bfloat16)


def test_zero_length_gives_zeros_and_no_nan():
  case = make_case(3, batch=2, seq_len=16, lengths=[0, 0], num_queries=2)
  sinks = jnp.ones((4,))
  out, lse = pkv.decode_attention(case.q, case.k, case.v, case.lengths, sinks=sinks, return_lse=True, impl="xla")
  np.testing.assert_array_equal(out, 0.0)
  assert np.isneginf(np.asarray(lse)).all()
  grads = jax.grad(lambda q, k: pkv.decode_attention(q, k, case.v, case.lengths, impl="xla").sum(),
                   argnums=(0, 1))(case.q, case.k)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()


def test_auto_runs_xla_on_cpu():
  if runtime.gpu_device() is not None:
    pytest.skip("this machine has a GPU: impl='auto' picks a kernel there")
  case = make_case(4)
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths)
  assert pkv.last_impl() == "xla"
  assert_matches_reference(out, pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths), jnp.float32)


def test_jit_matches_eager():
  case = make_case(5, num_queries=2, dtype=jnp.bfloat16)
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, window=6, impl="xla")
  np.testing.assert_array_equal(jax.jit(f)(case.q, case.k, case.v, case.lengths),
                                f(case.q, case.k, case.v, case.lengths))


def test_vmap_over_extra_leading_axis_matches_loop():
  cases = [make_case(10 + i, batch=2, seq_len=16) for i in range(3)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in cases])
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, softcap=4.0, impl="xla")
  batched = jax.vmap(f)(stack("q"), stack("k"), stack("v"), stack("lengths"))
  for i, c in enumerate(cases):
    np.testing.assert_allclose(batched[i], f(c.q, c.k, c.v, c.lengths), rtol=1e-6, atol=1e-6)


def test_paged_vmap_matches_loop():
  cases = [make_case(20 + i, batch=2, seq_len=16, page_size=4) for i in range(2)]
  stack = lambda name: jnp.stack([getattr(c, name) for c in cases])
  f = lambda q, kp, vp, bt, n: pkv.paged_decode_attention(q, kp, vp, bt, n, impl="xla")
  batched = jax.vmap(f)(stack("q"), stack("k_pages"), stack("v_pages"), stack("block_tables"), stack("lengths"))
  for i, c in enumerate(cases):
    np.testing.assert_allclose(batched[i], f(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths),
                               rtol=1e-6, atol=1e-6)


def test_grad_matches_finite_differences():
  case = make_case(6, batch=2, seq_len=8, num_heads=4, num_kv_heads=2, head_dim=8, lengths=[5, 8])
  sinks = jnp.asarray([0.1, -0.2, 0.3, 0.0])
  f = lambda q, k, v, s: pkv.decode_attention(q, k, v, case.lengths, softcap=3.0, sinks=s, impl="xla")
  check_grads(f, (case.q, case.k, case.v, sinks), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


# (description, call, exception type, message fragment)
def _bad_inputs():
  c = make_case(7, batch=2, seq_len=16, num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
  q, k, v, n = c.q, c.k, c.v, c.lengths
  d = pkv.decode_attention
  p = lambda **kw: pkv.paged_decode_attention(kw.get("q", q), kw.get("kp", c.k_pages), kw.get("vp", c.v_pages),
                                              kw.get("bt", c.block_tables), kw.get("n", n),
                                              impl=kw.get("impl", "xla"), config=kw.get("config"))
  return [
      ("q rank 2", lambda: d(q[0], k, v, n), ValueError, "q must have rank 3"),
      ("k rank 3", lambda: d(q, k[0], v[0], n), ValueError, "k must have rank 4"),
      ("batch mismatch", lambda: d(q[:1], k, v, n[:1]), ValueError, "batch"),
      ("head_dim mismatch", lambda: d(q[..., :4], k, v, n), ValueError, "head_dim"),
      ("heads not a multiple", lambda: d(jnp.concatenate([q, q[:, :1]], 1), k, v, n), ValueError, "multiple"),
      ("k/v shape", lambda: d(q, k, v[:, :8], n), ValueError, "same shape"),
      ("float lengths", lambda: d(q, k, v, n.astype(jnp.float32)), ValueError, "lengths must be an integer"),
      ("lengths shape", lambda: d(q, k, v, n[:1]), ValueError, "lengths has shape"),
      ("q dtype", lambda: d(q.astype(jnp.int32), k, v, n), ValueError, "q has dtype int32"),
      ("kv dtype", lambda: d(q, k.astype(jnp.int32), v.astype(jnp.int32), n), ValueError, "k has dtype int32"),
      ("negative scale", lambda: d(q, k, v, n, scale=-1.0), ValueError, "scale"),
      ("zero softcap", lambda: d(q, k, v, n, softcap=0.0), ValueError, "softcap"),
      ("window 0", lambda: d(q, k, v, n, window=0), ValueError, "window"),
      ("float window", lambda: d(q, k, v, n, window=2.5), ValueError, "window"),
      ("sinks shape", lambda: d(q, k, v, n, sinks=jnp.ones(3)), ValueError, "sinks"),
      ("k_scale shape", lambda: d(q, k, v, n, k_scale=jnp.ones(5)), ValueError, "k_scale"),
      ("too many tokens", lambda: d(jnp.zeros((2, 17, 4, 8)), k, v, n), NotImplementedError, "at most 16"),
      ("unknown impl", lambda: d(q, k, v, n, impl="cuda"), ValueError, "impl must be one of"),
      ("config on xla", lambda: d(q, k, v, n, impl="xla", config=pkv.TritonConfig()), ValueError,
       "impl='xla' takes no kernel config"),
      ("config not a kernel config", lambda: d(q, k, v, n, config=object()), TypeError,
       "config must be a kernel config"),
      ("config dict", lambda: d(q, k, v, n, impl="triton", config=dict(block_kv=16)), TypeError,
       "config must be a kernel config"),
      ("config of another backend", lambda: d(q, k, v, n, impl="mosaic_gpu", config=pkv.TritonConfig()), ValueError,
       "TritonConfig, a config of the triton backend; impl='mosaic_gpu'"),
      ("MLA config on a GQA op", lambda: d(q, k, v, n, config=pkv.MosaicMLAConfig()), TypeError,
       "decode call on mosaic_gpu takes a MosaicGPUConfig, got MosaicMLAConfig"),
      ("MLA config on a paged op", lambda: p(impl="mosaic_gpu", config=pkv.MosaicMLAConfig(block_kv=32)), TypeError,
       "paged call on mosaic_gpu takes a MosaicGPUConfig"),
      ("GQA config on MLA", lambda: pkv.mla_decode_attention(q, c.k_pages[:, :, 0], c.block_tables, n, v_head_dim=4,
                                                              config=pkv.MosaicGPUConfig()), TypeError,
       "mla call on mosaic_gpu takes a MosaicMLAConfig, got MosaicGPUConfig"),
      ("float block tables", lambda: p(bt=c.block_tables.astype(jnp.float32)), ValueError, "block_tables"),
      ("block tables rank", lambda: p(bt=c.block_tables[0]), ValueError, "block_tables must have rank 2"),
      ("pages rank", lambda: p(kp=c.k_pages[0], vp=c.v_pages[0]), ValueError, "k_pages must have rank 4"),
      ("mla v_head_dim", lambda: pkv.mla_decode_attention(q, c.k_pages[:, :, 0], c.block_tables, n, v_head_dim=9,
                                                           impl="xla"), ValueError, "v_head_dim"),
  ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_raises(index):
  _, call, exc, fragment = _bad_inputs()[index]
  with pytest.raises(exc, match=fragment):
    call()


@pytest.mark.parametrize("impl", ["mosaic_gpu", "triton"])
def test_kernel_backend_that_cannot_serve_raises_with_reason(impl):
  case = make_case(8, page_size=16, head_dim=64, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=f"impl='{impl}' cannot run this mla call: MLA"):
    pkv.mla_decode_attention(case.q, case.k_pages[:, :, 0], case.block_tables, case.lengths, v_head_dim=32,
                             impl=impl)


def test_interpret_switches():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kv.kernels.mosaic_gpu import backend as mosaic_gpu_backend
  with pkv.interpret(False):   # off even where PALLAS_KV_INTERPRET=1 turned it on for the process
    assert runtime.interpret_enabled() is False and mosaic_gpu_backend.interpret_params() is False
    with pkv.interpret():
      assert runtime.interpret_enabled() is True
      assert isinstance(mosaic_gpu_backend.interpret_params(), plgpu.InterpretGPUParams)
    assert runtime.interpret_enabled() is False


# Reports, as JSON, the switches a fresh process sees: at import, then as `steps` (comma-separated)
# say: "start" runs a JAX computation (the CPU client starts), "enter" enters `pkv.interpret()`.
_SWITCHES_PROBE = """
import json, os, sys
import jax, jax.numpy as jnp
import pallas_kv as pkv
from pallas_kv import runtime
async_dispatch = lambda: jax.config.read("jax_cpu_enable_async_dispatch")
facts = {"interpret": runtime.interpret_enabled(), "async": async_dispatch()}
with pkv.interpret(False):
  facts["interpret_off"] = runtime.interpret_enabled()
for step in filter(None, sys.argv[1].split(",")):
  if step == "start":
    jnp.ones(4).block_until_ready()
  elif step == "enter":
    with pkv.interpret():
      facts["entered"] = runtime.interpret_enabled()
    facts["async_after_enter"] = async_dispatch()
    facts["synchronous"] = runtime.synchronous_cpu_dispatch()
facts["cpu_threads"] = os.environ.get("PJRT_NPROC")
print(json.dumps(facts))
"""


def _probe_switches(steps: str, env_value: str | None = None, cpu_threads: str | None = None) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in (runtime.INTERPRET_ENV_VAR, "JAX_CPU_ENABLE_ASYNC_DISPATCH", "PJRT_NPROC")}
  if env_value is not None:
    env[runtime.INTERPRET_ENV_VAR] = env_value
  if cpu_threads is not None:
    env["PJRT_NPROC"] = cpu_threads
  result = subprocess.run([sys.executable, "-c", _SWITCHES_PROBE, steps], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


# Importing pallas_kv before JAX's CPU client starts gives the client a thread for each interpreted warpgroup that
# may wait at a barrier at once (on 2 cores an fp8 MLA kernel hung without); a count the environment sets stays.
_CPU_THREADS = str(max(runtime.INTERPRET_CPU_THREADS, os.cpu_count()))


@pytest.mark.parametrize("value", ["1", "true", "TRUE"])
def test_interpret_env_var_turns_interpret_mode_and_synchronous_dispatch_on(value):
  facts = _probe_switches("", value)
  assert facts == {"interpret": True, "async": False, "interpret_off": False, "cpu_threads": _CPU_THREADS}


def test_interpret_context_turns_synchronous_dispatch_on_while_it_still_can():
  assert _probe_switches("", "0") == {"interpret": False, "async": True, "interpret_off": False,
                                      "cpu_threads": _CPU_THREADS}
  facts = _probe_switches("enter")   # before the CPU client starts: asynchronous dispatch goes off
  assert facts["entered"] is True and facts["async"] is True and facts["async_after_enter"] is False
  assert facts["synchronous"] is True
  # After the CPU client started the flag can no longer take effect: it stays, and says so.
  facts = _probe_switches("start,enter")
  assert facts["entered"] is True and facts["async_after_enter"] is True and facts["synchronous"] is False


def test_importing_pallas_kv_first_sizes_the_cpu_clients_threads_for_interpret_mode():
  assert _probe_switches("")["cpu_threads"] == _CPU_THREADS
  assert _probe_switches("", cpu_threads="3")["cpu_threads"] == "3"


def test_jit_retraces_when_interpret_mode_changes():
  if harness.gpu_available():
    pytest.skip("a GPU is present: the kernel runs there outside interpret mode")
  case = make_case(13, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  ref = pkv.decode_attention_reference(case.q, case.k, case.v, case.lengths)
  args = (case.q, case.k, case.v, case.lengths)
  traced_outside = jax.jit(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="triton"))
  with pkv.interpret(False), pytest.raises(ValueError, match="PALLAS_KV_INTERPRET=1"):
    traced_outside(*args)
  with pkv.interpret():
    assert_matches_reference(traced_outside(*args), ref, jnp.bfloat16)
  traced_inside = jax.jit(lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl="triton") * 2)
  with pkv.interpret():
    assert_matches_reference(traced_inside(*args), 2 * ref, jnp.bfloat16)
  with pkv.interpret(False), pytest.raises(ValueError, match="PALLAS_KV_INTERPRET=1"):
    traced_inside(*args)


def test_checked_mode_reports_bad_lengths_and_pages_under_jit():
  case = make_case(9, batch=2, seq_len=16, page_size=4, lengths=[16, 5])
  f = jax.jit(lambda bt, n: pkv.paged_decode_attention(case.q, case.k_pages, case.v_pages, bt, n, impl="xla"))
  plain = f(case.block_tables, case.lengths)   # traced outside checked(): no checks in it
  err, _ = checkify.checkify(f)(case.block_tables, jnp.asarray([17, 5], jnp.int32))
  assert err.get() is None
  bad_tables = case.block_tables.at[1, 0].set(999)
  with pkv.checked():   # part of jit's cache key: f is traced again, with its checks
    err, _ = checkify.checkify(f)(case.block_tables, case.lengths)
    assert err.get() is None
    err, _ = checkify.checkify(f)(case.block_tables, jnp.asarray([17, 5], jnp.int32))
    assert "lengths must lie in [0, 16]" in err.get()
    err, _ = checkify.checkify(f)(bad_tables, case.lengths)
    assert "block_tables holds page ids outside [0, " in err.get()
    # A bad id in a page past the sequence's length is never read: no error.
    err, _ = checkify.checkify(f)(case.block_tables.at[1, 3].set(999), case.lengths)
    assert err.get() is None
    # Eager calls raise at once.
    with pytest.raises(Exception, match="lengths must lie in"):
      pkv.decode_attention(case.q, case.k, case.v, jnp.asarray([17, 5], jnp.int32), impl="xla")
  # Plain calls after checked ones still run (and trace no check again).
  np.testing.assert_array_equal(np.asarray(f(case.block_tables, case.lengths)), np.asarray(plain))
  f(bad_tables, case.lengths)
  assert not jax.make_jaxpr(f)(bad_tables, case.lengths).effects


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_gpu"])
def test_degenerate_shapes_give_empty_or_zero_results(impl):
  q = jnp.ones((0, 4, 64), jnp.bfloat16)
  kv = jnp.ones((0, 32, 2, 64), jnp.bfloat16)
  out, lse = pkv.decode_attention(q, kv, kv, jnp.zeros((0,), jnp.int32), impl=impl, return_lse=True)
  assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
  q = jnp.ones((2, 4, 64), jnp.bfloat16)
  no_capacity = jnp.ones((2, 0, 2, 64), jnp.bfloat16)
  out = pkv.decode_attention(q, no_capacity, no_capacity, jnp.zeros((2,), jnp.int32), impl=impl)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  no_pages = jnp.ones((0, 16, 2, 64), jnp.bfloat16)
  out = pkv.paged_decode_attention(q, no_pages, no_pages, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32),
                                   impl=impl)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_lengths_that_are_not_arrays_and_huge_windows():
  case = make_case(12, batch=2, seq_len=32)
  with pytest.raises(ValueError, match="lengths must be an int32 array of shape \\(2,\\); got list"):
    pkv.decode_attention(case.q, case.k, case.v, [3, 4], impl="xla")
  wide = pkv.decode_attention(case.q, case.k, case.v, case.lengths, window=2**31, impl="xla")
  plain = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl="xla")
  np.testing.assert_array_equal(np.asarray(wide), np.asarray(plain))


def test_a_kernel_impl_on_a_cpu_without_interpret_mode_names_the_switch():
  if harness.gpu_available():
    pytest.skip("a GPU is present: the kernel runs there")
  case = make_case(3, batch=1, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  for impl in ("triton", "mosaic_gpu"):
    with pkv.interpret(False), pytest.raises(ValueError, match="PALLAS_KV_INTERPRET=1"):
      pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl=impl)


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_a_jitted_kernel_impl_on_a_cpu_names_the_switch_and_still_lowers_for_cuda(impl, monkeypatch):
  if harness.gpu_available():
    pytest.skip("a GPU is present: the kernel runs there")
  case = make_case(3, batch=1, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  f = lambda q, k, v, n: pkv.decode_attention(q, k, v, n, impl=impl)
  with pkv.interpret(False):
    with pytest.raises(ValueError) as raised:
      jax.jit(f)(case.q, case.k, case.v, case.lengths)
    assert str(raised.value) == runtime.cpu_without_interpret_message(impl)
    assert "PALLAS_KV_INTERPRET=1" in str(raised.value) and f"impl='{impl}'" in str(raised.value)
    # The CUDA lowering is the kernel's, exactly as without the CPU refusal.
    module = harness.lower_for_cuda(f, case.q, case.k, case.v, case.lengths).mlir_module()
    assert {"mosaic_gpu": "custom_call @mosaic_gpu", "triton": harness.TRITON_CUSTOM_CALL}[impl] in module
    monkeypatch.setattr(runtime, "gpu_only", lambda x, *, impl: x)
    assert harness.lower_for_cuda(f, case.q, case.k, case.v, case.lengths).mlir_module() == module


@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
def test_lengths_wider_than_int32_clamp_instead_of_wrapping(dtype):
  case = make_case(4, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=32)
  huge = np.array([2**32 + 5 if dtype == np.int64 else 2**31 + 5, 7], dtype)
  out = pkv.decode_attention(case.q, case.k, case.v, huge, impl="xla")
  want = pkv.decode_attention_reference(case.q, case.k, case.v, jnp.asarray([64, 7], jnp.int32))
  assert_matches_reference(out, want, jnp.float32)
  assert_matches_reference(pkv.decode_attention_reference(case.q, case.k, case.v, huge), want, jnp.float32)


# ---------------------------------------------------------------- kernel configs and split plans

@pytest.mark.parametrize("config,impl", [
    (pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=2), "triton"),
    (pkv.MosaicGPUConfig(block_kv=64, num_stages=2, num_splits=2), "mosaic_gpu"),
], ids=["triton", "mosaic_gpu"])
def test_a_kernel_config_narrows_auto_to_its_backend(interpret_mode, config, impl):
  # On this CPU "auto" alone runs xla; a config names the backend that runs.
  case = make_case(30, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[128, 45])
  out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, return_lse=True, impl="auto", config=config)
  assert pkv.last_impl() == impl
  harness.check_against_reference(case, out)


def test_a_partial_config_keeps_its_fields_and_the_backend_fills_the_rest():
  import sweeps
  from pallas_kv.kernels import plan
  from pallas_kv.kernels.mosaic_gpu import config as mosaic_gpu_config
  from pallas_kv.kernels.triton import config as triton_config
  _, problem = sweeps.problem_args((32, 8), (4, 4096), None)
  partial = pkv.TritonConfig(block_kv=32)
  assert partial.given() == {"block_kv": 32} and not partial.complete
  resolved = triton_config.resolve_config(problem, partial, num_sms=132)
  heuristic = triton_config.heuristic_config(problem)
  assert resolved.complete and resolved.block_kv == 32 and heuristic.block_kv != 32
  for name in ("num_stages", "split_plan", "num_warps", "sequence_order", "merge_in_kernel"):
    assert getattr(resolved, name) == getattr(heuristic, name), name
  assert resolved.num_splits == plan.choose_num_splits(batch=4, num_kv_heads=8, row_blocks=1, capacity=4096,
                                                       block_kv=32, num_sms=132,
                                                       programs_per_sm=triton_config.PROGRAMS_PER_SM)
  mosaic = mosaic_gpu_config.resolve_config(problem, pkv.MosaicGPUConfig(num_stages=2, num_splits=3), num_sms=132)
  assert mosaic.complete and (mosaic.num_stages, mosaic.num_splits) == (2, 3)
  assert mosaic.block_kv == mosaic_gpu_config.heuristic_config(problem).block_kv
  with pytest.raises(TypeError, match="takes a TritonConfig"):
    triton_config.resolve_config(problem, pkv.MosaicGPUConfig(), num_sms=132)


def test_plan_splits_gives_the_plan_the_call_runs(interpret_mode, monkeypatch):
  from pallas_kv.kernels.triton import backend
  case = make_case(31, batch=3, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   lengths=[40, 128, 77])
  args = (case.q, case.k, case.v, case.lengths)
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=4, split_plan="balanced",
                            sequence_order="longest_first")
  made = pkv.plan_splits(pkv.decode_attention, *args, impl="triton", config=config)
  assert isinstance(made, pkv.SplitPlan)
  assert (made.kind, made.num_splits, made.block_kv) == ("balanced", 4, 16)
  assert made.order.tolist() == [1, 2, 0] and made.tiles_per_split.shape == (1,)
  auto = pkv.plan_splits(pkv.decode_attention, *args, config=config)   # "auto" narrowed to triton
  assert (auto.kind, auto.num_splits, auto.block_kv) == (made.kind, made.num_splits, made.block_kv)
  assert pkv.plan_splits(pkv.decode_attention, *args, impl="xla") is None

  seen, vectors = [], []   # the plan every kernel call runs (traced), and the values of its vectors
  run = backend.run

  def spy(*a, split_plan, **kw):
    seen.append(split_plan)
    jax.debug.callback(lambda *xs: vectors.append([np.asarray(x) for x in xs]), *split_plan.kernel_inputs())
    return run(*a, split_plan=split_plan, **kw)

  monkeypatch.setattr(backend, "run", spy)
  want = pkv.decode_attention(*args, return_lse=True, impl="triton", config=config)
  (used,), (used_vectors,) = seen, vectors
  assert (used.kind, used.num_splits, used.block_kv) == (made.kind, made.num_splits, made.block_kv)
  for got, expected in zip(used_vectors, made.kernel_inputs(), strict=True):   # the order, the tile count
    np.testing.assert_array_equal(got, expected)
  # The plan goes through jit as an argument (a pytree of its arrays) and gives the same bits.
  with_plan = jax.jit(lambda q, k, v, n, plan: pkv.decode_attention(q, k, v, n, return_lse=True, impl="triton",
                                                                     config=config, plan=plan))
  got = with_plan(*args, made)
  assert seen[-1].num_splits == made.num_splits and len(seen) == 2
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  harness.check_against_reference(case, got)
  # A plan made for another config (split count, tile) is refused, as is something not a plan.
  for other in (dict(num_splits=2), dict(block_kv=32), dict(split_plan="per_sequence")):
    wrong = pkv.plan_splits(pkv.decode_attention, *args, impl="triton",
                            config=pkv.TritonConfig(**{**config.given(), **other}))
    with pytest.raises(ValueError, match="made for another call"):
      pkv.decode_attention(*args, impl="triton", config=config, plan=wrong)
  with pytest.raises(TypeError, match="plan must be a SplitPlan"):
    pkv.decode_attention(*args, impl="triton", config=config, plan=dict(made.__dict__))


def test_plan_splits_of_the_paged_op_matches_its_call(interpret_mode):
  case = make_case(32, batch=2, seq_len=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                   page_size=32, lengths=[128, 33])
  args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths)
  config = pkv.TritonConfig(block_kv=16, num_stages=2, num_splits=2, sequence_order="long_short")
  made = pkv.plan_splits(pkv.paged_decode_attention, *args, impl="triton", config=config)
  assert (made.kind, made.num_splits, made.block_kv, made.tiles_per_split) == ("per_sequence", 2, 16, None)
  want = pkv.paged_decode_attention(*args, return_lse=True, impl="triton", config=config)
  got = pkv.paged_decode_attention(*args, return_lse=True, impl="triton", config=config, plan=made)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with pytest.raises(ValueError, match="op must be one of"):
    pkv.plan_splits(pkv.decode_attention_reference, *args)
