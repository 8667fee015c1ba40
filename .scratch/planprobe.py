import jax, jax.numpy as jnp
from benchmarks.tools import kernel_variants as kv
from pallas_kv import validation
B,T=32,4096
q=jnp.ones((B,32,128),jnp.bfloat16); k=jnp.ones((B,T,8,128),jnp.bfloat16); lengths=jnp.full((B,),T,jnp.int32)
args=(q,k,k,lengths)
cfg=kv._config({"split_plan":"stream_k","pipeline_qk":True}, args, False)
print(cfg)
problem=kv._problem(args, False)
out=kv.kernel_fn(cfg, problem, False, "plan")(*args)
print([o.shape for o in out])
