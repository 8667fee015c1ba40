import functools, re, collections, sys
import jax, jax.numpy as jnp
import pallas_kv as pkv
from tests.harness import lower_for_cuda
B, T, dt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
q = jax.ShapeDtypeStruct((B, 1, 32, 128), jnp.bfloat16)
k = jax.ShapeDtypeStruct((B, T, 8, 128), jnp.dtype(dt))
v = jax.ShapeDtypeStruct((B, 8, 128, T), jnp.dtype(dt))
ks = jax.ShapeDtypeStruct((B, T, 8), jnp.float32)
ln = jax.ShapeDtypeStruct((B,), jnp.int32)
f = lambda q, k, v, l, ks, vs: pkv.decode_attention(q, k, v, l, k_scale=ks, v_scale=vs, impl="mosaic_gpu", v_tokens_last=True)
exp = lower_for_cuda(f, q, k, v, ln, ks, ks)
txt = exp.mlir_module()
ops = collections.Counter(re.findall(r"(stablehlo\.[a-z_]+)", txt))
print(ops.most_common())
