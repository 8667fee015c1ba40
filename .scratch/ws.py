import jax, jax.numpy as jnp, numpy as np, pallas_kv as pkv
from pallas_kv import reference
B,T,Hq,Hkv,D=5,256,8,2,64
k1,k2,k3=jax.random.split(jax.random.key(3),3)
q=jax.random.normal(k1,(B,1,Hq,D),jnp.bfloat16); k=jax.random.normal(k2,(B,T,Hkv,D),jnp.bfloat16); v=jax.random.normal(k3,(B,T,Hkv,D),jnp.bfloat16)
lengths=jnp.array([256,17,130,200,64],jnp.int32); ws=jnp.array([100,0,60,5,10],jnp.int32)
ref=pkv.decode_attention(q,k,v,lengths,window_start=ws,impl="xla")
for cfg in [pkv.MosaicGPUConfig(persistent=True,pipeline_qk=True,num_splits=2,sequence_order="longest_first"),
            pkv.MosaicGPUConfig(persistent=True,num_splits=1)]:
  with pkv.interpret():
    out=pkv.decode_attention(q,k,v,lengths,window_start=ws,impl="mosaic_gpu",config=cfg)
  err=float(jnp.max(jnp.abs(out.astype(jnp.float32)-ref.astype(jnp.float32))))
  print(cfg.sequence_order, err)
