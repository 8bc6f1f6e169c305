"""Sampling from a language model given as one module `tokens (1, t) -> logits (1, t, vocab)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def generate(network, params, prompt, num_tokens: int, *, window: int, key,
             temperature: float = 0.8) -> list[int]:
    """Continue the token list `prompt` by `num_tokens` sampled tokens.

    Args:
      network: a linen module `tokens (1, t) -> logits (1, t, vocab)` (e.g.
        `gpt.network(config)`).
      params: its parameters (sharded or not: it runs under jit on them).
      prompt: the token ids to continue (only its last `window` are read).
      num_tokens: how many tokens to sample.
      window: the sliding window of tokens the network sees.
      key: a JAX random key.
      temperature: the logits are divided by it before sampling.

    Returns:
      The prompt's tokens (its last `window`) followed by the `num_tokens` sampled ones.
    """
    tokens = jnp.zeros((1, window), jnp.int32)
    prompt = list(prompt)[-window:]
    tokens = tokens.at[0, :len(prompt)].set(jnp.asarray(prompt, jnp.int32))

    @jax.jit
    def next_token(params, tokens, pos, key):
        logits = jax.lax.dynamic_index_in_dim(network.apply({"params": params}, tokens), pos - 1,
                                              axis=1, keepdims=False)
        return jax.random.categorical(key, logits / temperature, axis=-1)[0]

    out, pos = list(prompt), len(prompt)
    for _ in range(num_tokens):
        key, sub = jax.random.split(key)
        if pos == window:  # slide the window
            tokens, pos = jnp.roll(tokens, -1, axis=1), pos - 1
        nxt = next_token(params, tokens, pos, sub)
        tokens = tokens.at[0, pos].set(nxt)
        out.append(int(nxt))
        pos += 1
    return out
