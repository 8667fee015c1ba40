import functools, re, collections, sys
import jax, jax.numpy as jnp
import pallas_kv as pkv
from tests.harness import lower_for_cuda
B, T = int(sys.argv[1]), int(sys.argv[2])
plan = sys.argv[3]
q = jax.ShapeDtypeStruct((B, 1, 32, 128), jnp.bfloat16)
kv = jax.ShapeDtypeStruct((B, T, 8, 128), jnp.bfloat16)
ln = jax.ShapeDtypeStruct((B,), jnp.int32)
cfg = pkv.MosaicGPUConfig(split_plan=plan, pipeline_qk=True, persistent=True) if plan=="stream_k" else pkv.MosaicGPUConfig(split_plan=plan, pipeline_qk=True, persistent=True, num_splits=2)
exp = lower_for_cuda(functools.partial(pkv.decode_attention, impl="mosaic_gpu", config=cfg), q, kv, kv, ln)
txt = exp.mlir_module()
ops = collections.Counter(re.findall(r"(stablehlo\.[a-z_]+|mosaic_gpu[a-z_.]*|custom_call)", txt))
print(ops.most_common())
open(f".scratch/sk_{plan}.mlir","w").write(txt)
