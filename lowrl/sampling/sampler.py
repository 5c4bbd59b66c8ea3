"""Batched sampling: one jitted prefill + `lax.while_loop` decode over a donated KV cache.

Layout (the "Sampler contract" in ARCHITECTURE.md): prompts arrive padded either way
([B, P] tokens + mask); inside, each row is left-aligned so its last prompt token sits in
column P - 1, and the completion occupies columns [P, P + N) of every row, N = max_new_tokens.
The trainer re-scores `out.tokens` with `mask_BT=out.attention_mask` and reads the completion
columns; `token_logprobs`' alignment (logp[:, t] scores tokens[:, t]) makes the columns line up.

Two logprobs are recorded per generated token, both FP32:
  `logprobs`: log q(y_t), q the distribution actually sampled from (logits / temperature,
    restricted to top-k / top-p and renormalised). What importance corrections divide by.
    Temperature 0 (greedy) is a point mass: 0.
  `model_logprobs`: log p(y_t) under the raw model (temperature 1, no filtering).
With temperature 1 and no filtering they are the same.

Exact mode (`rescore`): both are recomputed from the *trainer's* full-sequence forward
(`token_logprobs` on the finished sequences, same shapes as the trainer's call), so a trainer
that scores the same sequences with the same params, policy and quant key gets bit-identical
values: the only remaining sampler/trainer difference is staleness.

What a sampler records must be the distribution it sampled from, so its activation scales must be
row-local (`precision.activation_scaling`): per-token / MX scales are; a per-tensor activation
scale is only with a static calibrated amax (`act_amax`, `transformer.calibrate_act_amax`), as
inference engines do it. `generate` refuses a policy that scales activations per tensor without
one: computed from the data, the scale of a decode step spans the other rows, and a full-sequence
rescore spans the later tokens too, so neither is a distribution of one row's prefix.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lowrl import distributed
from lowrl.models import transformer
from lowrl.models.config import ModelConfig
from lowrl.models import layout
from lowrl.precision import PrecisionPolicy
from lowrl.quant.packing import pack_e2m1, unpack_e2m1
from lowrl.quant.quantize import QTensor, dequantize, fake_quant, quantize
from lowrl.sharding import ShardingPlan

Params = Any


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


@struct.dataclass
class SampleOutput:
  """Finished rollouts. L = P + N; every array is [B, L] unless noted.

  Attributes:
    tokens: int32. Columns [0, P): the prompt, left-padded with pad_id. Columns [P, L): the
      completion, pad_id after the stop token (or after N tokens).
    prompt_mask: float32 1 on prompt tokens.
    completion_mask: float32 1 on generated tokens up to and including the stop token.
    logprobs: float32 log q(token) of the sampling distribution on completion tokens, else 0.
    model_logprobs: float32 log p(token) of the raw model on completion tokens, else 0.
    prompt_lengths: [B] int32.
    completion_lengths: [B] int32, = completion_mask.sum(-1).
    prompt_width: P (static), the first completion column.
  """

  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  logprobs: jax.Array
  model_logprobs: jax.Array
  prompt_lengths: jax.Array
  completion_lengths: jax.Array
  prompt_width: int = struct.field(pytree_node=False, default=0)

  @property
  def attention_mask(self) -> jax.Array:
    """prompt_mask + completion_mask: the mask_BT to re-score `tokens` with."""
    return self.prompt_mask + self.completion_mask


# ----------------------------------------------------------------------------------------------
# Distributions.


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


def sample_token(key: jax.Array, logits_NV: jax.Array, config: SamplingConfig
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(token_N, log q(token)_N, log p(token)_N) for one step; logits FP32 [..., V]."""
  if config.greedy:
    token = jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)
    logq = jnp.zeros(token.shape, jnp.float32)
  else:
    x = sampling_logits(logits_NV, config)
    token = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
    logq = _logp_at(x, token)
  return token, logq, _logp_at(logits_NV, token)


# ----------------------------------------------------------------------------------------------
# Generation.


def left_align(tokens_BP: jax.Array, mask_BP: jax.Array, pad_id: int
               ) -> tuple[jax.Array, jax.Array]:
  """Moves each row's real tokens (order kept) to the right end; padding (pad_id) to the left."""
  mask = mask_BP.astype(bool)
  order = jnp.argsort(mask.astype(jnp.int32), axis=-1, stable=True)
  mask = jnp.take_along_axis(mask, order, axis=-1)
  tokens = jnp.where(mask, jnp.take_along_axis(tokens_BP, order, axis=-1), pad_id)
  return tokens.astype(jnp.int32), mask


def _fold(key, i):
  return None if key is None else jax.random.fold_in(key, i)


def check_row_local(policy: PrecisionPolicy, model_cfg: ModelConfig,
                    act_amax: transformer.ActAmax | None) -> None:
  """Raises ValueError unless `policy` with `act_amax` computes every activation scale within one
  token's row (what a decoder sees token by token), naming the fix."""
  tiles = policy.act_paths(layout.matmuls(model_cfg), "tile")
  if tiles:
    raise ValueError(f"Precision policy {policy.name!r} quantizes the activations of {tiles[:2]}"
                     f"{'...' if len(tiles) > 2 else ''} in 2-D blocks spanning several tokens, "
                     "which no sampler can reproduce token by token; use 1-D activation blocks "
                     "(block_2d on weights only).")
  tensor = policy.act_paths(layout.matmuls(model_cfg), "tensor")
  if tensor and act_amax is None:
    raise ValueError(
        f"Precision policy {policy.name!r} scales the activations of {len(tensor)} matmuls "
        f"({tensor[0]}, ...) per tensor: computed from the batch, that scale depends on the other "
        "rows (and, re-scored, on later tokens), so the logprobs would not be those of the "
        "distribution sampled from. Pass static calibrated scales, act_amax="
        "transformer.calibrate_act_amax(params, tokens, model_cfg, trainer_policy, "
        "policy.act_paths(layout.matmuls(model_cfg), 'tensor')) (as inference engines do), or use row-local "
        "scaling (--config.precision.act_per_token=True, or an MX format).")
  transformer.check_act_amax(policy, model_cfg, act_amax)


def _generate_impl(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax, *,
                   model_cfg, policy, config):
  batch, p = prompt_BP.shape
  n = config.max_new_tokens
  prompt_BP, pmask_BP = left_align(prompt_BP, prompt_mask_BP, config.pad_id)
  plen_B = pmask_BP.sum(-1).astype(jnp.int32)
  stop = jnp.asarray(config.stop_tokens or (-1,), jnp.int32)
  # Reuse the donated k/v buffers as they are: a column is written before any query can see it
  # (causal over columns), so stale values get softmax weight exactly 0. Reset index and mask.
  cache = {**cache, "index": jnp.zeros((), jnp.int32), "mask": jnp.zeros_like(cache["mask"])}
  # Weights are quantized once per call, not in the prefill and again at every decode step.
  params, policy = quantize_weights(params, model_cfg, policy)

  # Prefill: the LM head only for column P - 1, where every left-aligned prompt ends.
  logits_B1V, cache = transformer.forward_with_cache(
      params, prompt_BP, cache, model_cfg, policy, mask_BT=pmask_BP,
      positions_BT=transformer.positions_from_mask(pmask_BP), quant_key=quant_key,
      last_only=True, act_amax=act_amax)
  tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(rng, 0), logits_B1V[:, 0], config)

  def record(state, i, tok_B, logq_B, logp_B):
    tokens, logq, logp, cmask, done = state
    live = ~done
    tok_B = jnp.where(live, tok_B, config.pad_id)
    tokens = tokens.at[:, i].set(tok_B)
    logq = logq.at[:, i].set(jnp.where(live, logq_B, 0.0))
    logp = logp.at[:, i].set(jnp.where(live, logp_B, 0.0))
    cmask = cmask.at[:, i].set(live)
    done = done | (live & jnp.isin(tok_B, stop))
    return tokens, logq, logp, cmask, done

  state = (jnp.full((batch, n), config.pad_id, jnp.int32), jnp.zeros((batch, n), jnp.float32),
           jnp.zeros((batch, n), jnp.float32), jnp.zeros((batch, n), bool),
           jnp.zeros((batch,), bool))
  state = record(state, 0, tok_B, logq_B, logp_B)

  def cond(carry):
    i, state, _ = carry
    return (i < n) & ~jnp.all(state[-1])

  def body(carry):
    i, state, cache = carry
    tokens, _, _, cmask, _ = state
    prev_B1 = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
    prev_live_B1 = jax.lax.dynamic_slice_in_dim(cmask, i - 1, 1, axis=1)
    logits_B1V, cache = transformer.forward_with_cache(
        params, prev_B1, cache, model_cfg, policy, mask_BT=prev_live_B1,
        positions_BT=(plen_B + i - 1)[:, None], quant_key=_fold(quant_key, p + i - 1),
        act_amax=act_amax)
    tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(rng, i), logits_B1V[:, 0], config)
    return i + 1, record(state, i, tok_B, logq_B, logp_B), cache

  _, state, cache = jax.lax.while_loop(cond, body, (jnp.int32(1), state, cache))
  tokens_BN, logq_BN, logp_BN, cmask_BN, _ = state
  zeros_BP = jnp.zeros((batch, p), jnp.float32)
  out = SampleOutput(
      tokens=jnp.concatenate([prompt_BP, tokens_BN], axis=1),
      prompt_mask=jnp.concatenate([pmask_BP.astype(jnp.float32), jnp.zeros((batch, n))], axis=1),
      completion_mask=jnp.concatenate([zeros_BP, cmask_BN.astype(jnp.float32)], axis=1),
      logprobs=jnp.concatenate([zeros_BP, logq_BN], axis=1),
      model_logprobs=jnp.concatenate([zeros_BP, logp_BN], axis=1),
      prompt_lengths=plen_B,
      completion_lengths=cmask_BN.sum(-1).astype(jnp.int32),
      prompt_width=p)
  return out, cache


_generate = jax.jit(_generate_impl, static_argnames=("model_cfg", "policy", "config"),
                    donate_argnames=("cache",))


def generate_in_jit(params: Params, prompt_BP: jax.Array, prompt_mask_BP: jax.Array,
                    rng: jax.Array, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
                    config: SamplingConfig, quant_key: jax.Array | None = None,
                    act_amax: transformer.ActAmax | None = None) -> SampleOutput:
  """`generate` as a traceable function, for callers already inside a jit (the simulator's scan).

  No host-side checks (run `config.check`, `check_row_local` before tracing) and no mesh; it
  allocates its own KV cache. Same program as `generate` on one device.
  """
  batch, p = prompt_BP.shape
  cache = transformer.init_cache(model_cfg, batch, p + config.max_new_tokens, policy.dtype)
  out, _ = _generate(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax,
                     model_cfg=model_cfg, policy=policy, config=config)
  return out


def _check_inputs(prompt_BP, prompt_mask_BP, model_cfg, config):
  if prompt_BP.ndim != 2 or prompt_BP.shape != prompt_mask_BP.shape:
    raise ValueError(f"prompt tokens {prompt_BP.shape} and prompt mask {prompt_mask_BP.shape} "
                     "must both be [B, P].")
  config.check(model_cfg)
  length = prompt_BP.shape[1] + config.max_new_tokens
  if length > model_cfg.max_seq_len:
    raise ValueError(f"P + max_new_tokens = {length} exceeds model_cfg.max_seq_len="
                     f"{model_cfg.max_seq_len}; shorten the prompts or max_new_tokens.")
  lengths = distributed.to_host(prompt_mask_BP).astype(bool).sum(-1)
  if lengths.min() < 1:
    raise ValueError(f"rows {np.flatnonzero(lengths < 1).tolist()} have empty prompts; every row "
                     "needs at least one prompt token (e.g. a BOS id).")


def generate(params: Params, prompt_tokens_BP: jax.Array, prompt_mask_BP: jax.Array,
             rng: jax.Array, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
             config: SamplingConfig, quant_key: jax.Array | None = None,
             cache: transformer.Cache | None = None, plan: ShardingPlan | None = None,
             act_amax: transformer.ActAmax | None = None
             ) -> tuple[SampleOutput, transformer.Cache]:
  """Samples N = config.max_new_tokens tokens per prompt with the KV cache (not exact mode).

  Args:
    params, model_cfg, policy: the sampler's model (may differ from the trainer's).
    prompt_tokens_BP, prompt_mask_BP: prompts padded on either side; >= 1 real token per row.
    rng: sampling key (step i uses fold_in(rng, i): deterministic given rng).
    quant_key: stochastic-rounding key (the step writing column c uses fold_in(quant_key, c)).
    cache: a cache from `transformer.init_cache(model_cfg, B, P + N, policy.dtype)` or from an
      earlier call of the same shapes; donated (do not reuse the argument). None allocates one.
    plan: run on this mesh: params as `plan.param_shardings`, prompts, outputs and the KV cache
      split over the batch axes (the cache's kv heads as k_proj's columns); inputs placed
      otherwise are moved there first. None: one device, as jit places it.
    act_amax: static calibrated amaxes of the activations `policy` scales per tensor (required
      for such a policy; see `check_row_local`), stored with the rollout weights.

  Returns:
    (SampleOutput, the cache's buffers for the next call).
  """
  _check_inputs(prompt_tokens_BP, prompt_mask_BP, model_cfg, config)
  check_row_local(policy, model_cfg, act_amax)
  act_amax = _only_tensor_scaled(policy, model_cfg, act_amax)
  batch, p = prompt_tokens_BP.shape
  if plan is not None:
    plan.check_batch(batch, "the sampler's batch (prompts)")
    fns = _sharded_fns(model_cfg, policy, config, plan, _params_key(params))
    if cache is None:
      cache = fns.init_cache(batch, p + config.max_new_tokens)
    args = (params, jnp.asarray(prompt_tokens_BP, jnp.int32), jnp.asarray(prompt_mask_BP), rng,
            cache, quant_key, act_amax)
    return fns.generate(*plan.put(args, fns.generate_in))
  if cache is None:
    cache = transformer.init_cache(model_cfg, batch, p + config.max_new_tokens, policy.dtype)
  # Quantize the weights in their own call: master and packed weights then share one compiled
  # generate program (the policy it sees no longer quantizes weights).
  if _has_weight_quantizers(policy, model_cfg):
    params = _quantize_weights(params, model_cfg=model_cfg, policy=policy)
    policy = prequantized_policy(policy, model_cfg)
  return _generate(params, jnp.asarray(prompt_tokens_BP, jnp.int32), jnp.asarray(prompt_mask_BP),
                   rng, cache, quant_key, act_amax, model_cfg=model_cfg, policy=policy,
                   config=config)


def _only_tensor_scaled(policy: PrecisionPolicy, model_cfg: ModelConfig,
                        act_amax: transformer.ActAmax | None) -> dict[str, jax.Array] | None:
  """The entries the policy reads (a plain dict: one pytree structure per policy, one compile)."""
  if act_amax is None:
    return None
  paths = policy.act_paths(layout.matmuls(model_cfg), "tensor")
  return {p: jnp.asarray(act_amax[p], jnp.float32) for p in paths} if paths else None


# Module-level jits: a trainer's `jax.jit(transformer.token_logprobs, ...)` traces the same
# program for the same shapes, which is what makes exact mode bit-identical.
_token_logprobs = jax.jit(transformer.token_logprobs, static_argnames=("model_cfg", "policy"))


def _sampling_logprobs_impl(params, tokens_BL, mask_BL, quant_key, act_amax=None, *, model_cfg,
                            policy, config):
  logits_BLV = transformer.forward(params, tokens_BL, model_cfg, policy, mask_BT=mask_BL,
                                   quant_key=quant_key, act_amax=act_amax)
  logq = sampling_logprobs(logits_BLV[:, :-1], tokens_BL[:, 1:], config)
  return jnp.pad(logq, ((0, 0), (1, 0)))


_sampling_logprobs = jax.jit(_sampling_logprobs_impl,
                             static_argnames=("model_cfg", "policy", "config"))


def _token_logprobs_impl(params, tokens_BL, mask_BL, quant_key, act_amax=None, *, model_cfg,
                         policy):
  return transformer.token_logprobs(params, tokens_BL, model_cfg, policy, mask_BT=mask_BL,
                                    quant_key=quant_key, act_amax=act_amax)


def _params_key(params: Params) -> tuple[Any, tuple[tuple[int, ...], ...]]:
  """Hashable structure + shapes of a parameter tree (what its shardings depend on)."""
  leaves, treedef = jax.tree.flatten(params)
  return treedef, tuple(tuple(np.shape(x)) for x in leaves)


@functools.lru_cache(maxsize=32)
def _sharded_fns(model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                 plan: ShardingPlan, params_key) -> Any:
  """The sampler's jits on `plan`'s mesh, with explicit in/out shardings (one set per model)."""
  treedef, shapes = params_key
  params_sh = plan.param_shardings(
      jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]))
  cache_sh = plan.cache_shardings(model_cfg)
  batch, repl = plan.batch, plan.replicated
  static = dict(model_cfg=model_cfg, policy=policy)
  fns = types.SimpleNamespace(params=params_sh)
  fns.generate_in = (params_sh, batch, batch, repl, cache_sh, repl, repl)
  # The cache (argument 4) is donated: its buffers come back as the next call's cache.
  fns.generate = jax.jit(functools.partial(_generate_impl, **static, config=config),
                         in_shardings=fns.generate_in, out_shardings=(batch, cache_sh),
                         donate_argnums=(4,))
  fns.init_cache = jax.jit(
      lambda b, length: transformer.init_cache(model_cfg, b, length, policy.dtype),
      static_argnums=(0, 1), out_shardings=cache_sh)
  fns.rescore_in = (params_sh, batch, batch, repl, repl)
  fns.logprobs = jax.jit(functools.partial(_token_logprobs_impl, **static),
                         in_shardings=fns.rescore_in, out_shardings=batch)
  fns.sampling_logprobs = jax.jit(functools.partial(_sampling_logprobs_impl, **static,
                                                    config=config),
                                  in_shardings=fns.rescore_in, out_shardings=batch)
  return fns


def rescore(out: SampleOutput, params: Params, *, model_cfg: ModelConfig,
            policy: PrecisionPolicy, config: SamplingConfig,
            quant_key: jax.Array | None = None, plan: ShardingPlan | None = None,
            act_amax: transformer.ActAmax | None = None) -> SampleOutput:
  """Replaces both logprobs with the given model's full forward (exact mode; the trainer's score).

  `model_logprobs` = `transformer.token_logprobs(params, out.tokens, model_cfg, policy,
  mask_BT=out.attention_mask, quant_key=quant_key, act_amax=act_amax)` on completion tokens.
  `logprobs` applies the sampling transform (temperature, top-k, top-p) to the same forward's
  logits; when the transform is the identity it is `model_logprobs` itself. Under top-k/top-p a
  token the trainer's logits rank outside the support gets -inf. `plan`: as in `generate`.
  `act_amax` None: tensor-scaled activations take the amax of the whole batch, as a trainer does
  (not row-local: such scores are the trainer's, never a sampler's record; see `Sampler`).
  """
  comp = out.completion_mask > 0
  mask_BL = out.attention_mask
  act_amax = _only_tensor_scaled(policy, model_cfg, act_amax)
  if plan is not None:
    fns = _sharded_fns(model_cfg, policy, config, plan, _params_key(params))
    args = plan.put((params, out.tokens, mask_BL, quant_key, act_amax), fns.rescore_in)
    logp = jnp.where(comp, fns.logprobs(*args), 0.0)
    logq = jnp.where(comp, fns.sampling_logprobs(*args), 0.0) if config.modifies_distribution \
        else logp
    return out.replace(logprobs=logq, model_logprobs=logp)
  logp = _token_logprobs(params, out.tokens, model_cfg=model_cfg, policy=policy, mask_BT=mask_BL,
                         quant_key=quant_key, act_amax=act_amax)
  logp = jnp.where(comp, logp, 0.0)
  if config.modifies_distribution:
    logq = _sampling_logprobs(params, out.tokens, mask_BL, quant_key, act_amax,
                              model_cfg=model_cfg, policy=policy, config=config)
    logq = jnp.where(comp, logq, 0.0)
  else:
    logq = logp
  return out.replace(logprobs=logq, model_logprobs=logp)


class Sampler:
  """Generation with a reused (donated) KV cache, optionally in exact mode.

  `params` may be a `pack_params` tree (weights held packed between calls; dequantized for the
  duration of the call, with the weight quantizers of the policy skipped). A policy that scales
  activations per tensor needs the static `act_amax` stored with the rollout weights.

  Exact mode re-scores the finished sequences with the sampler's own policy (and static scales)
  in one full forward, the program a trainer in the same precision runs: it then holds the
  distribution sampled from up to KV-cache rounding, and the trainer's pi_old matches it bit
  for bit. It is offered only for row-local policies (`check_row_local`).

  Example:
    sampler = Sampler(model_cfg, policy, SamplingConfig(max_new_tokens=16), exact=True)
    out = sampler(params, prompts_BP, mask_BP, rng)
  """

  def __init__(self, model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
               *, exact: bool = False, plan: ShardingPlan | None = None):
    config.check(model_cfg)
    # Exact mode records re-scored logprobs as the sampling distribution, so it re-scores with
    # the sampler's own policy; a trainer in another precision scores with `rescore(...)`.
    self.model_cfg, self.policy, self.config = model_cfg, policy, config
    self.exact = exact
    self.plan = plan  # None: one device; else every call runs sharded on plan.mesh
    self._cache = None

  def __call__(self, params: Params, prompt_tokens_BP: jax.Array, prompt_mask_BP: jax.Array,
               rng: jax.Array, *, quant_key: jax.Array | None = None,
               trainer_params: Params | None = None,
               trainer_quant_key: jax.Array | None = None,
               act_amax: transformer.ActAmax | None = None) -> SampleOutput:
    """Generates; in exact mode re-scores with (trainer_params or params) in the sampler's
    precision, with the same static `act_amax` (trainer_params: the master weights of packed
    `params`, or the same weights)."""
    batch, p = prompt_tokens_BP.shape
    shape = (batch, p + self.config.max_new_tokens)
    cache = self._cache if self._cache is not None and \
        self._cache["mask"].shape == shape else None
    self._cache = None  # donated below
    policy = self.policy
    if any(_is_packed(x) for x in jax.tree.leaves(params, is_leaf=_is_packed)):
      if self.exact and trainer_params is None:
        raise ValueError("Exact mode re-scores with the trainer's weights: pass trainer_params "
                         "(the packed sampler weights are not a trainer parameter tree).")
      policy = prequantized_policy(policy, self.model_cfg)
      params = unpack_params(params)
    out, self._cache = generate(params, prompt_tokens_BP, prompt_mask_BP, rng,
                                model_cfg=self.model_cfg, policy=policy, config=self.config,
                                quant_key=quant_key, cache=cache, plan=self.plan,
                                act_amax=act_amax)
    if self.exact:
      out = rescore(out, params if trainer_params is None else trainer_params,
                    model_cfg=self.model_cfg, policy=self.policy, config=self.config,
                    quant_key=trainer_quant_key, plan=self.plan, act_amax=act_amax)
    return out


# ----------------------------------------------------------------------------------------------
# Packed rollout weights.


@struct.dataclass
class PackedWeight:
  """A kernel held quantized: codes (E2M1 two per byte as uint8, or FP8), block and outer scales.

  `dequantize()` gives exactly `fake_quant(kernel)` as the trainer's forward computes it.
  """

  codes: jax.Array
  scale: jax.Array
  outer: jax.Array | None
  cfg: Any = struct.field(pytree_node=False)  # QuantConfig, axis resolved
  nibbles: bool = struct.field(pytree_node=False, default=False)  # codes packed two per byte

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in (self.codes, self.scale, self.outer) if a is not None)

  def dequantize(self) -> jax.Array:
    codes = unpack_e2m1(self.codes, axis=self.cfg.axis) if self.nibbles else self.codes
    q = QTensor(codes=codes, scale=self.scale, outer=self.outer, cfg=self.cfg)
    return dequantize(q, jnp.float32)


def _weight_quantizer(policy: PrecisionPolicy, m: layout.Matmul):
  """The deterministic rhs QuantConfig the forward applies to matmul `m`'s weight, or None.

  Stochastically rounded weight quantizers draw a new key per forward and cannot be applied
  ahead of time: None for those too.
  """
  q = policy.qdot_config(m.full_path).rhs
  if q is None or q.stochastic_rounding:
    return None
  # As quantized_dot_general does: 1-D blocks run along the contracting axis.
  return q if q.kind == "tensor" or q.block_2d else dataclasses.replace(q, axis=m.contract_axis)


def _kernels(model_cfg: ModelConfig) -> list[layout.Matmul]:
  """The matmuls with an [in, out] kernel of their own (a tied head reads the embedding)."""
  return [m for m in layout.matmuls(model_cfg) if m.owns_kernel]


def _set(tree, keys, value):
  if len(keys) == 1:
    return {**tree, keys[0]: value}
  return {**tree, keys[0]: _set(tree[keys[0]], keys[1:], value)}


def pack_params(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy,
                other_dtype=None) -> Params:
  """Replaces every kernel the policy quantizes by a PackedWeight (E2M1 two codes per byte).

  Kernels the policy keeps unquantized, norms, biases and the embedding stay as they are, or are
  cast to `other_dtype` (e.g. bfloat16: exact for the embedding and unquantized kernels, which the
  forward casts to the compute dtype anyway, but it rounds norm scales and biases). With
  other_dtype None, `unpack_params` + `prequantized_policy` compute exactly what the master
  weights do (fake_quant(W) == dequantize(quantize(W)) bit for bit).
  """
  return _pack(params, model_cfg=model_cfg, policy=policy,
               other_dtype=None if other_dtype is None else jnp.dtype(other_dtype))


@functools.partial(jax.jit, static_argnames=("model_cfg", "policy", "other_dtype"))
def _pack(params, *, model_cfg, policy, other_dtype):
  # One program for all kernels (eager quantize calls would compile once per kernel shape).
  out = params if other_dtype is None else jax.tree.map(lambda x: x.astype(other_dtype), params)
  for m in _kernels(model_cfg):
    keys = m.param_keys
    rhs = policy.qdot_config(m.full_path).rhs
    if rhs is not None and rhs.stochastic_rounding:
      raise ValueError(f"{m.full_path}: stochastically rounded weights are re-drawn every "
                       "forward and cannot be packed; use precision.stochastic_rounding=grad or "
                       "none for a packed sampler.")
    q = _weight_quantizer(policy, m)
    if q is None:
      continue
    qt = quantize(layout.get_param(params, keys), q)
    nibbles = qt.codes.dtype == jnp.float4_e2m1fn
    codes = pack_e2m1(qt.codes, axis=q.axis) if nibbles else qt.codes
    out = _set(out, keys, PackedWeight(codes, qt.scale, qt.outer, qt.cfg, nibbles))
  return out


def _is_packed(x) -> bool:
  return isinstance(x, PackedWeight)


@jax.jit
def unpack_params(packed: Params) -> Params:
  """PackedWeight leaves -> FP32 dequantized kernels (inside the sampler call, the emulation)."""
  return jax.tree.map(lambda x: x.dequantize() if _is_packed(x) else x, packed,
                      is_leaf=_is_packed)


def _droppable(c) -> bool:
  return c.rhs is not None and not c.rhs.stochastic_rounding


def _has_weight_quantizers(policy: PrecisionPolicy, model_cfg: ModelConfig) -> bool:
  return any(_weight_quantizer(policy, m) is not None for m in _kernels(model_cfg))


def prequantized_policy(policy: PrecisionPolicy, model_cfg: ModelConfig) -> PrecisionPolicy:
  """`policy` without the weight quantizers that `quantize_weights` / `pack_params` apply ahead
  of time (deterministic ones on [in, out] kernels; a tied head quantizes the embedding itself).
  Idempotent: a policy with nothing to drop comes back unchanged."""
  if not _has_weight_quantizers(policy, model_cfg):
    return policy
  def drop(c):
    return dataclasses.replace(c, rhs=None) if _droppable(c) else c
  rules = [(p, drop(c)) for p, c in policy.rules]
  if model_cfg.tie_embeddings:  # the head quantizes the embedding table itself: keep its rule
    head = layout.matmul(model_cfg, None, layout.LM_HEAD).full_path
    rules.insert(0, (re.escape(head), policy.qdot_config(head)))
  return dataclasses.replace(policy, rules=tuple(rules), name=policy.name + "+prequantized")


def quantize_weights(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy
                     ) -> tuple[Params, PrecisionPolicy]:
  """(params with kernels fake-quantized once, the policy that then skips weight quantizers).

  Exact: the pair computes bit for bit what (params, policy) computes, since the forward's own
  weight quantization is the same `fake_quant` call; the sampler uses it so that the decode loop
  does not re-quantize every weight at every step.
  """
  out = params
  for m in _kernels(model_cfg):
    keys = m.param_keys
    q = _weight_quantizer(policy, m)
    if q is not None:
      out = _set(out, keys, fake_quant(layout.get_param(params, keys), q))
  return out, prequantized_policy(policy, model_cfg)


@functools.partial(jax.jit, static_argnames=("model_cfg", "policy"))
def _quantize_weights(params, *, model_cfg, policy):
  return quantize_weights(params, model_cfg, policy)[0]


def packed_bytes(packed: Params) -> dict[str, float]:
  """Storage of a packed tree: quantized kernels (codes + scales) vs everything else."""
  leaves = jax.tree.leaves(packed, is_leaf=_is_packed)
  q = [x for x in leaves if _is_packed(x)]
  rest = [x for x in leaves if not _is_packed(x)]
  q_params = sum(_num_elements(x) for x in q)
  q_bytes = sum(x.nbytes for x in q)
  rest_params = sum(int(x.size) for x in rest)
  rest_bytes = sum(int(x.nbytes) for x in rest)
  total = q_params + rest_params
  return {"quantized_params": q_params, "quantized_bytes": q_bytes,
          "bytes_per_quantized_param": q_bytes / max(q_params, 1),
          "other_params": rest_params, "other_bytes": rest_bytes,
          "bytes_per_param": (q_bytes + rest_bytes) / max(total, 1)}


def _num_elements(w: PackedWeight) -> int:
  return int(w.codes.size) * (2 if w.nibbles else 1)
