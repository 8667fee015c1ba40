"""shard_map scale-out (`pallas_kv.sharding`): batch and head shards match one device."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kv as pkv
from harness import relative_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHARD_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    import pallas_kv as pkv
    from pallas_kv import sharding
    rng = np.random.default_rng(0)
    nb, nh = 2, 4                      # mesh: 2 batch shards x 4 head shards
    B, S, Hq, Hkv, D, ps, M = 4, 2, 16, 4, 16, 4, 5
    P_local = (B // nb) * M + 2
    q = jnp.asarray(rng.standard_normal((B, S, Hq, D)), jnp.float32)
    pages = lambda: jnp.asarray(rng.standard_normal((nb * P_local, ps, Hkv, D)), jnp.float32)
    k_pages, v_pages = pages(), pages()
    local_tables = np.stack([rng.permutation(P_local)[:M] for _ in range(B)]).astype(np.int32)
    lengths = jnp.asarray(rng.integers(0, M * ps + 1, B), jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(Hq), jnp.float32)
    # One device: the same pools side by side, ids offset by each batch shard's pool.
    offsets = (np.arange(B) // (B // nb) * P_local)[:, None]
    want = pkv.paged_decode_attention(q, k_pages, v_pages, jnp.asarray(local_tables + offsets), lengths,
                                      sinks=sinks, softcap=5.0, impl="xla")
    assert len(jax.devices()) == 8
    for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
      mesh = jax.make_mesh((nb, nh), ("data", "model"), axis_types=(axis_type,) * 2)
      attend = sharding.sharded_paged_decode_attention(mesh, batch_axis="data", head_axis="model",
                                                       impl="xla", softcap=5.0)
      out = jax.jit(attend)(q, k_pages, v_pages, jnp.asarray(local_tables), lengths, sinks)
      expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "model", None))
      assert out.sharding.is_equivalent_to(expected, out.ndim), out.sharding
      np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    print("SHARDED_OK")
""")


def test_shard_map_over_batch_and_heads_matches_one_device():
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, "-c", SHARD_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
  assert "SHARDED_OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("batch_shards,head_shards", [(2, 1), (1, 2)])
def test_shard_map_on_two_gpus_matches_one_gpu(impl, batch_shards, head_shards):
  if jax.device_count() < 2:
    pytest.skip(f"needs 2 GPUs; this machine has {jax.device_count()}")
  from pallas_kv import sharding
  rng = np.random.default_rng(7)
  B, Hq, Hkv, D, ps, M = 8, 32, 8, 128, 64, 24
  P_local = (B // batch_shards) * M + 3
  q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.bfloat16)
  pages = lambda: jnp.asarray(rng.standard_normal((batch_shards * P_local, ps, Hkv, D)), jnp.bfloat16)
  k_pages, v_pages = pages(), pages()
  local_tables = np.stack([rng.permutation(P_local)[:M] for _ in range(B)]).astype(np.int32)
  lengths = jnp.asarray(rng.integers(0, M * ps + 1, B), jnp.int32)
  offsets = (np.arange(B) // (B // batch_shards) * P_local)[:, None]
  want = pkv.paged_decode_attention(q, k_pages, v_pages, jnp.asarray(local_tables + offsets), lengths, impl=impl)
  mesh = jax.make_mesh((batch_shards, head_shards), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:2])
  attend = sharding.sharded_paged_decode_attention(mesh, batch_axis="data", head_axis="model", impl=impl)
  out = jax.jit(attend)(q, k_pages, v_pages, jnp.asarray(local_tables), lengths)
  assert pkv.last_impl() == impl
  assert len(out.sharding.device_set) == 2
  # Head shards see fewer kv heads, so the split heuristic may cut the context differently: bf16 tolerance.
  assert relative_error(out, want) < 1e-2, relative_error(out, want)
