"""Choosing the next token: greedy, or temperature + top-p (nucleus) sampling, per sequence.

Every argument is an array with one entry per sequence, so a batch can mix greedy and sampled
requests without recompiling. A sequence's random key comes from its own seed and position, so
its samples do not depend on which other requests share the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_token(logits, token_id: int | None, banned):
  """logits [B, V] with token_id set to -inf where banned [B] (e.g. EOS before a request may end)."""
  if token_id is None:
    return logits
  column = jnp.arange(logits.shape[-1]) == token_id
  return jnp.where(banned[:, None] & column[None, :], -jnp.inf, logits)


def top_p_sample(logits, keys, temperature, top_p):
  """Samples from softmax(logits / temperature) restricted to the smallest set of most likely
  tokens whose probability reaches top_p (the token that crosses top_p is kept)."""
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  order = jnp.argsort(-scaled, axis=-1)
  ranked = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(ranked, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
  ranked = jnp.where(before < top_p[:, None], ranked, -jnp.inf)
  choice = jax.vmap(jax.random.categorical)(keys, ranked)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample(logits, seeds, positions, temperature, top_p):
  """Next tokens [B] int32 from logits [B, V] float32.

  seeds, positions [B] int32: the key of sequence b is fold_in(key(seeds[b]), positions[b]).
  temperature [B]: 0 means greedy (argmax). top_p [B] in (0, 1].
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled():
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    return jnp.where(temperature > 0, top_p_sample(logits, keys, temperature, top_p), greedy).astype(jnp.int32)

  return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
