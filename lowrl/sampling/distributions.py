"""The sampled distribution q: temperature, top-k, top-p (and greedy), its logprobs and draws.

Two logprobs are recorded per generated token, both FP32:
  `logprobs`: log q(y_t), q the distribution actually sampled from (logits / temperature,
    restricted to top-k / top-p and renormalised). What importance corrections divide by.
    Temperature 0 (greedy) is a point mass: 0.
  `model_logprobs`: log p(y_t) under the raw model (temperature 1, no filtering).
With temperature 1 and no filtering they are the same.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowrl.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampling settings (hashable: a jit static argument).

  Attributes:
    max_new_tokens: N, completion columns per row.
    temperature: > 0 scales logits; 0 is greedy (argmax).
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest most-likely set with mass >= top_p (1.0 = off).
    stop_tokens: ids that end a completion (the stop token is kept, masked 1).
    pad_id: written to padding columns of `tokens`.
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off).")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def modifies_distribution(self) -> bool:
    """Whether q (sampled from) differs from the raw model distribution p."""
    return self.greedy or self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0

  def check(self, model_cfg: ModelConfig) -> None:
    """Raises ValueError for ids outside the vocabulary."""
    v = model_cfg.vocab_size
    bad = [t for t in self.stop_tokens + (self.pad_id,) if not 0 <= t < v]
    if bad:
      raise ValueError(f"stop_tokens/pad_id {bad} are outside the vocabulary [0, {v}).")
    if self.top_k > v:
      raise ValueError(f"top_k={self.top_k} exceeds vocab_size={v}; use top_k <= {v} or 0.")


def sampling_logits(logits_NV: jax.Array, config: SamplingConfig) -> jax.Array:
  """FP32 logits of q: logits / temperature, -inf outside the top-k / top-p support.

  top-k keeps exactly k tokens (ties broken by `lax.top_k`'s order); top-p is applied after
  top-k and always keeps the most likely token. Not for temperature 0.
  """
  x = logits_NV.astype(jnp.float32) / config.temperature
  if config.top_k:
    _, idx_Nk = jax.lax.top_k(x, config.top_k)
    keep = jnp.put_along_axis(jnp.zeros(x.shape, bool), idx_Nk, True, axis=-1, inplace=False)
    x = jnp.where(keep, x, -jnp.inf)
  if config.top_p < 1.0:
    order_NV = jnp.argsort(-x, axis=-1, stable=True)
    sorted_x = jnp.take_along_axis(x, order_NV, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < config.top_p
    keep = jnp.put_along_axis(jnp.zeros(x.shape, bool), order_NV, keep_sorted, axis=-1,
                              inplace=False)
    x = jnp.where(keep, x, -jnp.inf)
  return x


def _logp_at(logits_NV: jax.Array, tokens_N: jax.Array) -> jax.Array:
  logits = logits_NV.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, tokens_N[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def sampling_logprobs(logits_NV: jax.Array, tokens_N: jax.Array,
                      config: SamplingConfig) -> jax.Array:
  """log q(tokens) under the sampling distribution (greedy: 0 at the argmax, -inf elsewhere)."""
  if config.greedy:
    is_max = tokens_N == jnp.argmax(logits_NV, axis=-1)
    return jnp.where(is_max, 0.0, -jnp.inf).astype(jnp.float32)
  return _logp_at(sampling_logits(logits_NV, config), tokens_N)


def sample_token(key: jax.Array, logits_NV: jax.Array, config: SamplingConfig,
                 rows_N: jax.Array | None = None, batch: int | None = None,
                 greedy: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(token_N, log q(token)_N, log p(token)_N) for one step; logits FP32 [N, V].

  `rows_N` (with `batch`): logits_NV are rows `rows_N` of a [batch, V] step (a compacted decode
  bucket); each row then draws the Gumbel noise `jax.random.categorical(key, ·)` gives that row
  of the whole batch, so it samples the token the uncompacted step samples from the same logits.
  `greedy`: a runtime bool scalar choosing, for a sampling `config`, between its draw (False)
  and temperature 0 (True), each bit for bit what the static config gives: one program serves
  both (evaluation's greedy and sampled decodes). None: as `config` says.
  """
  if config.greedy:
    return _greedy_token(logits_NV)
  x = sampling_logits(logits_NV, config)
  if rows_N is None:
    token = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
  else:  # categorical's own draw (argmax of logits + Gumbel noise), noise of rows_N
    noise_NV = jax.random.gumbel(key, (batch, x.shape[-1]), x.dtype)[rows_N]
    token = jnp.argmax(noise_NV + x, axis=-1).astype(jnp.int32)
  if greedy is None:
    return token, _logp_at(x, token), _logp_at(logits_NV, token)
  # A select of either result, not argmax(x + where(greedy, 0, noise)): the temperature and
  # top-k / top-p of x could round or drop ties that the raw logits' argmax keeps.
  g_token, g_logq, _ = _greedy_token(logits_NV)
  token = jnp.where(greedy, g_token, token)
  logq = jnp.where(greedy, g_logq, _logp_at(x, token))
  return token, logq, _logp_at(logits_NV, token)


def _greedy_token(logits_NV: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """sample_token at temperature 0: the argmax, log q = 0 (a point mass), log p."""
  token = jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)
  return token, jnp.zeros(token.shape, jnp.float32), _logp_at(logits_NV, token)
