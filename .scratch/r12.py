import jax, jax.numpy as jnp, pallas_kv as pkv
from tests.harness import make_case, check_against_reference
for nq, hq, hkv in [(3, 8, 2), (7, 24, 2)]:
  case = make_case(nq, batch=2, seq_len=128, num_heads=hq, num_kv_heads=hkv, head_dim=64, dtype=jnp.bfloat16,
                   num_queries=nq, lengths=[100, 128])
  with pkv.interpret():
    out = pkv.decode_attention(case.q, case.k, case.v, case.lengths, impl="mosaic_gpu", return_lse=True)
  check_against_reference(case, out); print(nq, hq, hkv, "ok")
