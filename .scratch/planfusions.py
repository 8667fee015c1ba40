import jax, jax.numpy as jnp, re
from pallas_kv.kernels import plan
f = jax.jit(lambda l: plan.stream_k_walk(l, block_kv=64, num_queries=1, window=None, head_blocks=8, num_programs=132, max_pieces=3))
txt = f.lower(jnp.full((32,),4096,jnp.int32)).compile().as_text()
print(len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", txt, re.M)), "fusions")
print("\n".join(l for l in txt.splitlines() if " fusion(" in l and "ROOT" not in l or l.strip().startswith("ROOT"))[:3000])
