"""A small random-weight decoder that prefills with XLA attention and decodes with DecodeAttention.

  python -m examples.tiny_decoder [--impl=xla] [--steps=8] [--mla]

Layers are stacked and run with lax.scan; the paged KV cache of every layer shares one block
table, whose pages come from a `PagePool` reserved before each step.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pallas_kv as pkv
from pallas_kv import cache as kv_cache


def rms_norm(x, eps: float = 1e-6):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


@dataclasses.dataclass(frozen=True)
class TinyDecoder:
  attention: pkv.DecodeAttention
  vocab_size: int = 64
  num_layers: int = 2
  mlp_size: int = 256

  @property
  def hidden(self) -> int:
    return self.attention.hidden_size

  def init(self, key) -> dict:
    k_embed, k_layers = jax.random.split(key)
    keys = jax.random.split(k_layers, self.num_layers)
    def layer(key):
      k_attn, k1, k2 = jax.random.split(key, 3)
      return dict(attn=self.attention.init(k_attn),
                  w1=jax.random.normal(k1, (self.hidden, self.mlp_size)) / math.sqrt(self.hidden),
                  w2=jax.random.normal(k2, (self.mlp_size, self.hidden)) / math.sqrt(self.mlp_size))
    return dict(embed=jax.random.normal(k_embed, (self.vocab_size, self.hidden)),
                layers=jax.vmap(layer)(keys))

  def empty_cache(self, batch: int, max_pages_per_seq: int, page_size: int, num_pages: int,
                  dtype=jnp.bfloat16) -> pkv.PagedKVCache | pkv.PagedLatentCache:
    """One paged cache per layer, stacked on a leading layer axis, with no pages assigned (a
    latent cache when the attention is MLA)."""
    a = self.attention
    tables = jnp.broadcast_to(kv_cache.empty_block_tables(batch, max_pages_per_seq),
                              (self.num_layers, batch, max_pages_per_seq))
    lengths = jnp.zeros((self.num_layers, batch), jnp.int32)
    if a.mla is not None:
      latent = a.mla.kv_lora_rank + a.mla.qk_rope_head_dim
      return pkv.PagedLatentCache(jnp.zeros((self.num_layers, num_pages, page_size, latent), dtype), tables,
                                  lengths)
    shape = (self.num_layers, num_pages, page_size, a.num_kv_heads, a.head_dim)
    return pkv.PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), tables, lengths)

  def _block(self, attend, x, layer_params_and_cache):
    params, cache = layer_params_and_cache
    h, cache = attend(params["attn"], rms_norm(x), cache)
    x = x + h
    x = x + jax.nn.gelu(rms_norm(x) @ params["w1"]) @ params["w2"]
    return x, cache

  def _run_layers(self, attend, params, x, caches):
    x, caches = jax.lax.scan(functools.partial(self._block, attend), x, (params["layers"], caches))
    return rms_norm(x) @ params["embed"].T, caches  # tied embeddings

  def prefill(self, params, tokens, caches):
    """tokens [B, L] -> (logits of the last token [B, V], caches)."""
    x = params["embed"][tokens]
    logits, caches = self._run_layers(self.attention.prefill, params, x, caches)
    return logits[:, -1], caches

  def step(self, params, token, caches):
    """token [B] -> (logits [B, V], caches): one decode step through every layer."""
    x = params["embed"][token][:, None]
    logits, caches = self._run_layers(lambda p, x, c: self.attention(p, x, c), params, x, caches)
    return logits[:, 0], caches


# MLA dimensions the Mosaic GPU MLA kernel serves (latent a multiple of 128, latent + rope <= 576).
MLA = pkv.MLAConfig(kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)


def _reserve(caches, pool, num_new: int):
  """Reserves pages for num_new tokens per sequence (shared by all layers)."""
  # The caches are stacked on a leading layer axis: a page is axis 2 of the pages ([L, P, page, ...]).
  page_size = (caches.kv_pages if isinstance(caches, pkv.PagedLatentCache) else caches.k_pages).shape[2]
  pool, tables, ok = kv_cache.reserve_pages(pool, caches.block_tables[0], caches.lengths[0], num_new, page_size)
  tables = jnp.broadcast_to(tables, caches.block_tables.shape)
  return dataclasses.replace(caches, block_tables=tables), pool, ok


@functools.partial(jax.jit, static_argnames=("model", "num_steps"), donate_argnames=("caches",))
def generate(model: TinyDecoder, params, prompt, caches, pool, *, num_steps: int):
  """Greedy decoding: prefill prompt [B, L], then num_steps tokens.

  Returns (tokens [B, num_steps], logits [B, num_steps, V], caches, pool, ok); ok is False if the
  page pool ran out (the cache is then left without the tokens that did not fit).
  """
  caches, pool, ok = _reserve(caches, pool, prompt.shape[1])
  logits, caches = model.prefill(params, prompt, caches)

  def step(carry, _):
    logits, caches, pool, ok = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    caches, pool, reserved = _reserve(caches, pool, 1)
    next_logits, caches = model.step(params, token, caches)
    return (next_logits, caches, pool, ok & reserved), (token, logits)

  (_, caches, pool, ok), (tokens, all_logits) = jax.lax.scan(step, (logits, caches, pool, ok), None,
                                                             length=num_steps)
  return tokens.T, jnp.swapaxes(all_logits, 0, 1), caches, pool, ok


def main():
  from absl import app, flags
  flags.DEFINE_string("impl", "xla", "decode attention backend")
  flags.DEFINE_integer("steps", 8, "tokens to generate")
  flags.DEFINE_bool("mla", False, "multi-head latent attention (latent 128 + rope 64) instead of GQA")

  def run(argv):
    del argv
    impl, steps = flags.FLAGS.impl, flags.FLAGS.steps
    attention = pkv.DecodeAttention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, impl=impl,
                                    mla=MLA if flags.FLAGS.mla else None)
    model = TinyDecoder(attention)
    params = model.init(jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, model.vocab_size)
    caches = model.empty_cache(batch=2, max_pages_per_seq=8, page_size=16, num_pages=16)
    tokens, _, _, _, ok = generate(model, params, prompt, caches, kv_cache.PagePool.create(16), num_steps=steps)
    print("ok:", bool(ok))
    print("tokens:", tokens)

  app.run(run)


if __name__ == "__main__":
  main()
