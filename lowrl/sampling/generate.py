"""Generation: one jitted prefill + `lax.while_loop` decode over a donated KV cache.

Layout (the "Sampler contract" in ARCHITECTURE.md): prompts arrive padded either way
([B, P] tokens + mask); inside, each row is left-aligned so its last prompt token sits in
column P - 1, and the completion occupies columns [P, P + N) of every row, N = max_new_tokens.
The trainer re-scores `out.tokens` with `mask_BT=out.attention_mask` and reads the completion
columns; `token_logprobs`' alignment (logp[:, t] scores tokens[:, t]) makes the columns line up.

One program (`_decode`, jitted by `_decode_program`) serves every caller: `generate` places its
inputs on a `ShardingPlan` (one device is the trivial plan) and the program's outputs come out in
the plan's layout; `generate_in_jit` traces the same program inside a caller's jit, unplaced. The
policy's deterministic weight quantizers are applied once, at the top of the program
(`weights.quantize_weights`), not in the prefill and again at every decode step.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lowrl import distributed, sharding
from lowrl.models import blocks, transformer
from lowrl.models.config import ModelConfig
from lowrl.models.row_sharding import constrain_rows, constrain_rows_tree
from lowrl.precision import PrecisionPolicy
from lowrl.sampling import weights
from lowrl.sampling.act_scales import check_row_local, used_act_amax
from lowrl.sampling.distributions import SamplingConfig, sample_token
from lowrl.sharding import ShardingPlan

Params = Any


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
    routing: MoE models recording their routing (lowrl/sampling/replay.py): the sampler's
      expert choices {"layers_i": int32 [B, L, k]}; None otherwise.
  """

  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  logprobs: jax.Array
  model_logprobs: jax.Array
  prompt_lengths: jax.Array
  completion_lengths: jax.Array
  prompt_width: int = struct.field(pytree_node=False, default=0)
  routing: Any = None

  @property
  def attention_mask(self) -> jax.Array:
    """prompt_mask + completion_mask: the mask_BT to re-score `tokens` with."""
    return self.prompt_mask + self.completion_mask


class DecodeState(NamedTuple):
  """The decode loop's carry; the completion arrays are [B, N], column i = completion token i."""

  step: jax.Array  # int32 scalar: the completion column written next
  tokens_BN: jax.Array  # int32, pad_id where not yet written or after the stop token
  logq_BN: jax.Array  # float32 log q(token), 0 off the completion
  logp_BN: jax.Array  # float32 log p(token), 0 off the completion
  live_BN: jax.Array  # bool: the completion mask (up to and including the stop token)
  done_B: jax.Array  # bool: the row has emitted a stop token
  cache: transformer.Cache


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


def _record(state: DecodeState, i, tok_B, logq_B, logp_B, config: SamplingConfig,
            stop: jax.Array) -> DecodeState:
  """Writes completion column i of the rows still live (pad_id and 0 in the others)."""
  live = ~state.done_B
  tok_B = jnp.where(live, tok_B, config.pad_id)
  return state._replace(
      tokens_BN=state.tokens_BN.at[:, i].set(tok_B),
      logq_BN=state.logq_BN.at[:, i].set(jnp.where(live, logq_B, 0.0)),
      logp_BN=state.logp_BN.at[:, i].set(jnp.where(live, logp_B, 0.0)),
      live_BN=state.live_BN.at[:, i].set(live),
      done_B=state.done_B | (live & jnp.isin(tok_B, stop)))


def _constrain_state(state: DecodeState) -> DecodeState:
  """The loop carry's rows pinned to their shards (the cache's index is a scalar, left alone;
  a scanned model's stacked [L, B, ...] cache has its rows second)."""
  cache = state.cache
  layers = cache["layers"]
  if isinstance(layers, dict):  # stacked [L, B, S, K, hd]
    layers = constrain_rows_tree(layers, axis=1)
  else:
    layers = constrain_rows_tree(layers)
  cache = {**cache, "mask": constrain_rows(cache["mask"]), "layers": layers}
  rows = constrain_rows_tree(state._replace(step=None, cache=None))
  return rows._replace(step=state.step, cache=cache)


def _decode(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax, *,
            model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
            plan: ShardingPlan | None = None) -> tuple[SampleOutput, transformer.Cache]:
  """Prefill + decode loop (traceable). With a plan every row's activations, decode state and
  cache stay on its data shard (`plan.rows`: data parallel, no gather of the batch)."""
  with plan.rows() if plan is not None else contextlib.nullcontext():
    return _decode_rows(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax,
                        model_cfg=model_cfg, policy=policy, config=config)


def _decode_rows(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax, *,
                 model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig
                 ) -> tuple[SampleOutput, transformer.Cache]:
  """`_decode` inside its row context."""
  batch, p = prompt_BP.shape
  n = config.max_new_tokens
  prompt_BP, pmask_BP = left_align(prompt_BP, prompt_mask_BP, config.pad_id)
  plen_B = pmask_BP.sum(-1).astype(jnp.int32)
  stop = jnp.asarray(config.stop_tokens or (-1,), jnp.int32)
  # Reuse the donated k/v buffers as they are: a column is written before any query can see it
  # (causal over columns), so stale values get softmax weight exactly 0. Reset index and mask.
  cache = {**cache, "index": jnp.zeros((), jnp.int32), "mask": jnp.zeros_like(cache["mask"])}
  # The one place weights are quantized ahead of time: once per call, not per decode step.
  params, policy = weights.quantize_weights(params, model_cfg, policy)

  # Prefill: the LM head only for column P - 1, where every left-aligned prompt ends.
  logits_B1V, cache = transformer.forward_with_cache(
      params, prompt_BP, cache, model_cfg, policy, mask_BT=pmask_BP,
      positions_BT=transformer.positions_from_mask(pmask_BP), quant_key=quant_key,
      last_only=True, act_amax=act_amax)
  tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(rng, 0), logits_B1V[:, 0], config)
  state = DecodeState(
      step=jnp.int32(1), tokens_BN=jnp.full((batch, n), config.pad_id, jnp.int32),
      logq_BN=jnp.zeros((batch, n), jnp.float32), logp_BN=jnp.zeros((batch, n), jnp.float32),
      live_BN=jnp.zeros((batch, n), bool), done_B=jnp.zeros((batch,), bool), cache=cache)
  state = _record(state, 0, tok_B, logq_B, logp_B, config, stop)
  state = _constrain_state(state)

  def cond(state: DecodeState):
    return (state.step < n) & ~jnp.all(state.done_B)

  def body(state: DecodeState) -> DecodeState:
    i = state.step
    prev_B1 = jax.lax.dynamic_slice_in_dim(state.tokens_BN, i - 1, 1, axis=1)
    prev_live_B1 = jax.lax.dynamic_slice_in_dim(state.live_BN, i - 1, 1, axis=1)
    logits_B1V, cache = transformer.forward_with_cache(
        params, prev_B1, state.cache, model_cfg, policy, mask_BT=prev_live_B1,
        positions_BT=(plen_B + i - 1)[:, None], quant_key=_fold(quant_key, p + i - 1),
        act_amax=act_amax)
    tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(rng, i), logits_B1V[:, 0], config)
    state = state._replace(step=i + 1)
    return _constrain_state(
        _record(state, i, tok_B, logq_B, logp_B, config, stop)._replace(cache=cache))

  state = jax.lax.while_loop(cond, body, state)
  zeros_BP = jnp.zeros((batch, p), jnp.float32)
  out = SampleOutput(
      tokens=jnp.concatenate([prompt_BP, state.tokens_BN], axis=1),
      prompt_mask=jnp.concatenate([pmask_BP.astype(jnp.float32), jnp.zeros((batch, n))], axis=1),
      completion_mask=jnp.concatenate([zeros_BP, state.live_BN.astype(jnp.float32)], axis=1),
      logprobs=jnp.concatenate([zeros_BP, state.logq_BN], axis=1),
      model_logprobs=jnp.concatenate([zeros_BP, state.logp_BN], axis=1),
      prompt_lengths=plen_B,
      completion_lengths=state.live_BN.sum(-1).astype(jnp.int32),
      prompt_width=p)
  return out, state.cache


@functools.lru_cache(maxsize=64)
def _decode_program(model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                    plan: ShardingPlan | None):
  """`_decode` jitted for one static setting, the cache (argument 4) donated. With a plan, the
  outputs come out in its layout (rollouts over the batch axes, the cache as
  `plan.cache_shardings`) and the inputs arrive placed by `generate`; None: placed by the caller
  (`generate_in_jit`, inside the caller's jit)."""
  layout_kw = {} if plan is None else {
      "out_shardings": (plan.batch, plan.cache_shardings(model_cfg))}
  note = None if plan is None else plan.cache_note(model_cfg)
  if note:  # once per program (cached), before it compiles
    warnings.warn(note, stacklevel=3)
  return jax.jit(functools.partial(_decode, model_cfg=model_cfg, policy=policy, config=config,
                                   plan=plan), donate_argnums=(4,), **layout_kw)


@functools.lru_cache(maxsize=64)
def _cache_allocator(model_cfg: ModelConfig, batch: int, length: int, dtype: Any,
                     plan: ShardingPlan):
  """Allocates an empty KV cache directly in `plan`'s layout (never whole on one device)."""
  return jax.jit(lambda: transformer.init_cache(model_cfg, batch, length, dtype),
                 out_shardings=plan.cache_shardings(model_cfg))


def generate_in_jit(params: Params, prompt_BP: jax.Array, prompt_mask_BP: jax.Array,
                    rng: jax.Array, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
                    config: SamplingConfig, quant_key: jax.Array | None = None,
                    act_amax: blocks.ActAmax | None = None) -> SampleOutput:
  """`generate` as a traceable function, for callers already inside a jit (the simulator's scan).

  No host-side checks (run `config.check`, `check_row_local` before tracing) and no placement
  (the caller's jit places); it allocates its own KV cache. The program `generate` runs.
  """
  batch, p = prompt_BP.shape
  params, policy = weights.dequantize_packed(params, model_cfg, policy)
  cache = transformer.init_cache(model_cfg, batch, p + config.max_new_tokens, policy.dtype)
  out, _ = _decode_program(model_cfg, policy, config, None)(
      params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax)
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
             act_amax: blocks.ActAmax | None = None
             ) -> tuple[SampleOutput, transformer.Cache]:
  """Samples N = config.max_new_tokens tokens per prompt with the KV cache (not exact mode).

  Args:
    params, model_cfg, policy: the sampler's model (may differ from the trainer's). params may
      be master weights or a `pack_params` tree (dequantized here; the policy then skips the
      weight quantizers those kernels went through).
    prompt_tokens_BP, prompt_mask_BP: prompts padded on either side; >= 1 real token per row.
    rng: sampling key (step i uses fold_in(rng, i): deterministic given rng).
    quant_key: stochastic-rounding key (the step writing column c uses fold_in(quant_key, c)).
    cache: a cache from an earlier call of the same shapes, or from
      `transformer.init_cache(model_cfg, B, P + N, policy.dtype)`; donated (do not reuse the
      argument). None allocates one.
    plan: run on this mesh: params as `plan.param_shardings`, prompts, outputs and the KV cache
      split over the batch axes (the cache's kv heads as k_proj's columns); inputs placed
      otherwise are moved there first. None: `sharding.single_device_plan()`.
    act_amax: static calibrated amaxes of the activations `policy` scales per tensor (required
      for such a policy; see `check_row_local`), stored with the rollout weights.

  Returns:
    (SampleOutput, the cache's buffers for the next call).
  """
  _check_inputs(prompt_tokens_BP, prompt_mask_BP, model_cfg, config)
  check_row_local(policy, model_cfg, act_amax)
  act_amax = used_act_amax(policy, model_cfg, act_amax)
  plan = plan or sharding.single_device_plan()
  batch, p = prompt_tokens_BP.shape
  plan.check_batch(batch, "the sampler's batch (prompts)")
  params, policy = weights.dequantize_packed(params, model_cfg, policy)
  if cache is None:
    cache = _cache_allocator(model_cfg, batch, p + config.max_new_tokens, policy.dtype, plan)()
  batch_sh, repl = plan.batch, plan.replicated
  args = plan.put(
      (params, jnp.asarray(prompt_tokens_BP, jnp.int32), jnp.asarray(prompt_mask_BP), rng, cache,
       quant_key, act_amax),
      (plan.param_shardings(params), batch_sh, batch_sh, repl, plan.cache_shardings(model_cfg),
       repl, repl))
  return _decode_program(model_cfg, policy, config, plan)(*args)
