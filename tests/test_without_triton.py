"""pallas_kv without Pallas Triton (deprecated in jax 0.11, to be removed): in a fresh interpreter where
`jax.experimental.pallas.triton` cannot be imported, the library imports, "auto" never picks Triton, and
every op lowers for CUDA on Mosaic GPU with no Triton call in the module (one-byte caches in their default layout,
v tokens last, too, dense and in pages of 16), its splits merged by the Mosaic GPU merge launch."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    class NoPallasTriton(importlib.abc.MetaPathFinder):
      BLOCKED = ("jax.experimental.pallas.triton", "jax._src.pallas.triton")
      def find_spec(self, name, path=None, target=None):
        if name.startswith(self.BLOCKED):
          raise ImportError(f"{name} is blocked: Pallas Triton is gone")
        return None

    sys.meta_path.insert(0, NoPallasTriton())
    import jax, jax.numpy as jnp
    import pallas_kv as pkv
    from pallas_kv import api
    import harness

    try:
      api.kernel_backend("triton")
      raise AssertionError("the triton backend imported")
    except NotImplementedError as e:
      assert "cannot be imported" in str(e), e
    api.device_can_run = lambda name: True   # as on a Hopper GPU
    SDS = jax.ShapeDtypeStruct
    B, T, P = 4, 2048, 600
    q = SDS((B, 2, 32, 128), jnp.bfloat16)
    k = SDS((B, T, 8, 128), jnp.bfloat16)
    k8 = SDS((B, T, 8, 128), jnp.int8)
    v8, vf8 = SDS((B, 8, 128, T), jnp.int8), SDS((B, 8, 128, T), jnp.float8_e4m3fn)   # one-byte caches' default
    kf8, token = SDS((B, T, 8, 128), jnp.float8_e4m3fn), SDS((B, T, 8), jnp.float32)
    pages = SDS((P, 16, 8, 128), jnp.bfloat16)
    tables, lengths = SDS((B, T // 16), jnp.int32), SDS((B,), jnp.int32)
    pages8, vpages8 = SDS((P, 16, 8, 128), jnp.int8), SDS((P, 8, 128, 16), jnp.int8)   # PagedKVCache's int8 default
    page_token = SDS((P, 16, 8), jnp.float32)
    latent, q_mla = SDS((P, 64, 576), jnp.bfloat16), SDS((B, 1, 128, 576), jnp.bfloat16)
    mla_tables = SDS((B, T // 64), jnp.int32)
    calls = {
        "decode": (lambda q, k, l: pkv.decode_attention(q, k, k, l), (q, k, lengths)),
        "paged": (lambda q, k, t, l: pkv.paged_decode_attention(q, k, k, t, l, window_start=l), (q, pages, tables, lengths)),
        "stream-K": (lambda q, k, l: pkv.decode_attention(q, k, k, l, config=pkv.MosaicGPUConfig(split_plan="stream_k")),
                     (q, k, lengths)),
        "int8": (lambda q, k, l: pkv.decode_attention(q, k, k, l, k_scale=0.5, v_scale=0.5), (q, k8, lengths)),
        "int8 tokens last": (lambda q, k, v, l, s: pkv.decode_attention(q, k, v, l, k_scale=s, v_scale=s,
                                                                       v_tokens_last=True), (q, k8, v8, lengths, token)),
        "fp8 tokens last": (lambda q, k, v, l, s: pkv.decode_attention(q, k, v, l, k_scale=s, v_scale=s,
                                                                      v_tokens_last=True), (q, kf8, vf8, lengths, token)),
        "paged int8 tokens last": (lambda q, k, v, t, l, s: pkv.paged_decode_attention(
            q, k, v, t, l, k_scale=s, v_scale=s, v_tokens_last=True), (q, pages8, vpages8, tables, lengths, page_token)),
        "mla": (lambda q, kv, t, l: pkv.mla_decode_attention(q, kv, t, l), (q_mla, latent, mla_tables, lengths)),
    }
    for name, (fn, args) in calls.items():
      text = harness.lower_for_cuda(fn, *args).mlir_module()
      assert api.last_impl() == "mosaic_gpu", (name, api.last_impl())
      assert "custom_call @mosaic_gpu" in text and harness.TRITON_CUSTOM_CALL not in text, name
      print("lowered", name, "merged by mosaic_gpu" if "pallas_kv_mosaic_merge" in text else "")
    assert not any(m.startswith("jax.experimental.pallas.triton") for m in sys.modules)
""")


def test_without_pallas_triton_every_op_lowers_on_mosaic_gpu():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
  env.pop("PALLAS_KV_INTERPRET", None)
  result = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  # Each call splits its sequences, and the Mosaic GPU merge launch merges them (XLA only where it refuses).
  assert [line for line in result.stdout.splitlines() if line.startswith("lowered")] == [
      f"lowered {name} merged by mosaic_gpu" for name in ("decode", "paged", "stream-K", "int8", "int8 tokens last",
                                                          "fp8 tokens last", "paged int8 tokens last", "mla")]
