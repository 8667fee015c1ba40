"""A Llama decoder in JAX whose attention is `pallas_kv.DecodeAttention` over a paged KV cache.

Layers are stacked on a leading axis and run with `lax.scan`. Every layer's pages live in one
buffer of `num_layers * num_pages` pages: layer l uses pages [l * P, (l + 1) * P), so one block
table per sequence (page ids in [0, P), from a `pallas_kv.PagePool`) serves every layer, offset
by l * P. The scan carries that whole buffer, each layer appends in place and its attention reads
the buffer directly (no per-layer slice is copied).

Numerics: the residual stream, norms, softmax and logits in float32; matmuls take their inputs in
`compute_dtype` (float32: the bfloat16 weights widened once by `prepare`, the exact comparison
with a float32 reference; bfloat16: the usual fast inference) and accumulate in float32; the KV
cache in bfloat16 (what the attention kernels read; queries are rounded to it too) or, on the
xla impl, float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kv as pkv
from examples.smollm2.gguf_loader import LlamaConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
  """The paged KV cache of every layer: k, v [num_layers * P, page_size, Hkv, D] (v [num_layers * P, Hkv, D,
  page_size] for a one-byte cache: `PagedKVCache.create`'s default layout); for an int8 /
  fp8 cache, k_scale, v_scale [num_layers * P, page_size, Hkv]: one scale per token and kv head,
  addressed like the pages (None for a 16- or 32-bit cache)."""
  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.k.shape[1]


def default_compute_dtype() -> str:
  """float32 on the CPU (no fast bfloat16 matmul there), bfloat16 on accelerators."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def rms_norm(x, weight, eps: float):
  """Llama's RMSNorm, in float32."""
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * weight.astype(jnp.float32)


def layer_tables(block_tables, layer, num_pages: int):
  """Block tables of one layer: page ids offset by layer * num_pages; unassigned (-1) stay -1."""
  return jnp.where(block_tables >= 0, block_tables + layer * num_pages, pkv.UNALLOCATED)


def copy_pages(pages: KVPages, copy_src, copy_dst, num_layers: int) -> KVPages:
  """pages with pool page copy_dst[k] set to pool page copy_src[k] (int [K], -1: no copy) in every
  layer, per-token scales with their pages: the partly filled pages `pallas_kv.fork_sequences` asks for."""
  num_pages = pages.k.shape[0] // num_layers
  layers = jnp.arange(num_layers, dtype=jnp.int32)[:, None]
  src, dst = (layer_tables(jnp.asarray(ids, jnp.int32)[None], layers, num_pages).reshape(-1)
              for ids in (copy_src, copy_dst))
  copy = lambda array: None if array is None else pkv.cache.copy_pages(array, src, dst)
  return KVPages(copy(pages.k), copy(pages.v), copy(pages.k_scale), copy(pages.v_scale))


@dataclasses.dataclass(frozen=True)
class Llama:
  """A Llama decoder. `impl` picks the decode attention backend ("auto", "mosaic_gpu", "triton", "xla").

  compute_dtype: the matmuls' input dtype (float32 or bfloat16; accumulation is float32).
  cache_dtype: of the KV cache; bfloat16 (what the kernels read), float32 (xla impl only: the
  exact comparison with a float32 reference), or int8 / float8_e4m3fn / float8_e5m2 (quantized
  on append with one scale per token and kv head, `pallas_kv.cache.quantize`).
  unroll_decode: a decode step's layers unrolled (the fast step on a GPU); False rolls them, which
  compiles several times faster (the CPU tests).
  prefix_groups: (max groups, max members) of sequences whose block tables start with the same pages
  (forked samples of one prompt), whose shared pages each layer's attention then reads once per
  group (`pallas_kv.PagedKVCache`'s field); None: every sequence reads its own pages.
  """
  config: LlamaConfig
  impl: str = "auto"
  compute_dtype: str = "float32"
  cache_dtype: str = "bfloat16"
  unroll_decode: bool = True
  prefix_groups: tuple[int, int] | None = None

  @property
  def attention(self) -> pkv.DecodeAttention:
    c = self.config
    return pkv.DecodeAttention(hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, rope_theta=c.rope_theta, param_dtype="bfloat16", impl=self.impl)

  def prepare(self, params):
    """The loaded params with every weight matrix in compute_dtype (once, not at every step)."""
    dtype = jnp.dtype(self.compute_dtype)
    return jax.tree.map(lambda w: jnp.asarray(w, dtype) if jnp.ndim(w) >= 2 else jnp.asarray(w), params)

  def _matmul(self, x, w):
    dtype = jnp.dtype(self.compute_dtype)
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)

  def empty_pages(self, num_pages: int, page_size: int) -> KVPages:
    """A zeroed cache of num_pages pages per layer."""
    c = self.config
    shape = (c.num_layers * num_pages, page_size, c.num_kv_heads, c.head_dim)
    scales = (None, None)
    if pkv.cache.is_quantized(self.cache_dtype):   # per token: written by each append
      scales = (jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32))
    v_shape = (shape[0], *shape[2:], page_size) if self._v_tokens_last else shape
    return KVPages(jnp.zeros(shape, self.cache_dtype), jnp.zeros(v_shape, self.cache_dtype), *scales)

  @property
  def _v_tokens_last(self) -> bool:
    return pkv.cache.default_v_tokens_last(self.cache_dtype)

  # ------------------------------------------------------------------------ layers

  def _attend(self, params, x, cache, *, prefill: bool, num_new=None, plan=None, sharing=None):
    if prefill:
      return self.attention.prefill(params, x, cache, num_new)
    return self.attention(params, x, cache, plan=plan, shared_prefix=sharing)

  def _layer_cache(self, pages: KVPages, tables, lengths, layer, num_pages: int) -> pkv.PagedKVCache:
    return pkv.PagedKVCache(pages.k, pages.v, layer_tables(tables, layer, num_pages), lengths, pages.k_scale,
                            pages.v_scale, v_tokens_last=self._v_tokens_last, prefix_groups=self.prefix_groups)

  def _block(self, tables, lengths, num_pages, prefill, num_new, plan, sharing, carry, layer):
    x, pages = carry
    params, index = layer
    c = self.config
    cache = self._layer_cache(pages, tables, lengths, index, num_pages)
    normed = rms_norm(x, params["attn_norm"], c.rms_norm_eps).astype(self.compute_dtype)
    h, cache = self._attend(params["attn"], normed, cache, prefill=prefill, num_new=num_new, plan=plan,
                            sharing=sharing)
    x = x + h.astype(jnp.float32)
    y = rms_norm(x, params["mlp_norm"], c.rms_norm_eps)
    y = jax.nn.silu(self._matmul(y, params["w_gate"])) * self._matmul(y, params["w_up"])
    x = x + self._matmul(y, params["w_down"])
    return (x, KVPages(cache.k_pages, cache.v_pages, cache.k_scale, cache.v_scale)), None

  def _forward(self, params, x, pages: KVPages, tables, lengths, *, prefill: bool, num_new=None):
    """x [B, S, H] float32 through every layer -> (final hidden states [B, S, H], pages); a
    prefill appends num_new [B] of its S tokens (all by default)."""
    num_pages = pages.k.shape[0] // self.config.num_layers
    # Every layer's cache has the same shapes and lengths: a decode step plans its splits once.
    plan = None if prefill else self.attention.plan_step(self._layer_cache(pages, tables, lengths, 0, num_pages))
    # The same for the groups of forked sequences: every layer's tables are the pool's ids, offset alike.
    sharing = None
    if not prefill and self.prefix_groups is not None:
      sharing = pkv.shared_prefix.from_tables(tables, lengths, page_size=pages.k.shape[1],
                                              max_groups=self.prefix_groups[0], max_members=self.prefix_groups[1])
    block = functools.partial(self._block, tables, lengths, num_pages, prefill, num_new, plan, sharing)
    layers = (params["layers"], jnp.arange(self.config.num_layers, dtype=jnp.int32))
    # A decode step's layers unrolled: their small kernels then go out in one stream, and the
    # call returns before the device is done (a rolled loop of 30 layers measured 7% slower per
    # step on the H200 and kept the host waiting). A prefill's long body stays rolled (compile time).
    (x, pages), _ = jax.lax.scan(block, (x, pages), layers, unroll=self.unroll_decode and not prefill)
    return rms_norm(x, params["final_norm"], self.config.rms_norm_eps), pages

  def logits(self, params, hidden):
    """hidden [..., H] -> logits [..., V] float32 (tied embeddings unless the file has an lm_head)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return self._matmul(hidden, head)

  def embed(self, params, tokens):
    return params["embed"][tokens].astype(jnp.float32)

  # ------------------------------------------------------------------------ prefill and decode

  def prefill(self, params, tokens, pages: KVPages, tables, last, start=None):
    """Runs prompts tokens [B, L] (pages for them reserved in tables [B, M]).

    last [B]: index in tokens of each prompt's last real token (prompts are right-padded; the
    padding is not appended). start int32 [B]: tokens each sequence already caches before `tokens`
    (a reused prefix, in its table's first pages; default 0): the new ones take positions from
    there and attend to the cached ones. Returns (logits at `last` [B, V], pages).
    """
    lengths = jnp.zeros((tokens.shape[0],), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    hidden, pages = self._forward(params, self.embed(params, tokens), pages, tables, lengths, prefill=True,
                                  num_new=last + 1)
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return self.logits(params, hidden), pages

  def decode(self, params, tokens, pages: KVPages, tables, lengths):
    """One step: tokens [B] at positions lengths [B] (their pages reserved) -> (logits [B, V], pages)."""
    hidden, pages = self._forward(params, self.embed(params, tokens)[:, None], pages, tables, lengths, prefill=False)
    return self.logits(params, hidden[:, 0]), pages


def generate_greedy(model: Llama, params, prompts, num_new: int, *, page_size: int = 16, logit_steps: int = 0,
                    ignore_eos: bool = False, forced=None):
  """Greedy continuations of a static batch of prompts (lists of ids; the simplest use of the model).

  Prompts are right-padded to a multiple of 64 tokens (few shapes, few compiles). ignore_eos: never
  choose EOS (as transformers' min_new_tokens). forced: tokens [B, num_new] fed back in place of
  the model's own choices (teacher forcing, to compare every step with another run's). Returns
  numpy (the model's choices [B, num_new], the raw logits of the first logit_steps steps
  [B, logit_steps, V]).
  """
  import numpy as np
  b, longest = len(prompts), max(len(p) for p in prompts)
  padded = -(-longest // 64) * 64
  pages_per_seq = -(-(padded + num_new) // page_size)
  pages = model.empty_pages(b * pages_per_seq, page_size)
  tables = jnp.arange(b * pages_per_seq, dtype=jnp.int32).reshape(b, pages_per_seq)
  tokens = np.zeros((b, padded), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits, pages = _jit_prefill(model, params, tokens, pages, tables, lengths - 1)
  out, saved = [], []
  for step in range(num_new):
    if step < logit_steps:
      saved.append(np.asarray(logits))
    if ignore_eos and model.config.eos_token_id is not None:
      logits = logits.at[:, model.config.eos_token_id].set(-jnp.inf)
    out.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    if step + 1 < num_new:
      fed = out[-1] if forced is None else jnp.asarray(forced[:, step], jnp.int32)
      logits, pages = _jit_decode(model, params, fed, pages, tables, lengths + step)
  saved = np.stack(saved, axis=1) if saved else np.zeros((b, 0, model.config.vocab_size), np.float32)
  return np.stack([np.asarray(t) for t in out], axis=1), saved


@functools.partial(jax.jit, static_argnames=("model",))
def _jit_prefill(model, params, tokens, pages, tables, last):
  return model.prefill(params, tokens, pages, tables, last)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("pages",))
def _jit_decode(model, params, tokens, pages, tables, lengths):
  return model.decode(params, tokens, pages, tables, lengths)
