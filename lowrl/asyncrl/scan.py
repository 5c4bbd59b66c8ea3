"""The jitted pieces of one simulated run: rollouts (plain and pipelined), static activation
calibration, the greedy held-out evaluation and the sampled one (per-prompt success counts), the
supervised warm start and the training scan (`make_train`, optionally resetting the KL reference
on a `reset_plan`). Everything here traces inside one program; `simulator` compiles and runs it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrl import precision
from lowrl.asyncrl.setup import SimSetup
from lowrl.models import calibration, init, layout, routing, transformer
from lowrl.rl.drift import version_distance
from lowrl.sampling import SampleOutput, SamplingConfig, generate_in_jit, rescore
from lowrl.sampling.act_scales import used_act_amax
from lowrl.sampling.distributions import sample_token
from lowrl.training import optimizer
from lowrl.training.evaluation import eval_metrics
from lowrl.training.rl_update import TokenBatch, make_logprob_fn
from lowrl.training.sft import make_sft_step
from lowrl.training.step import Rollout, Step, make_step


def _generate(setup: SimSetup, policy: precision.PrecisionPolicy, config: SamplingConfig,
              params, prompt_BP: jax.Array, key: jax.Array, quant_key,
              act_amax=None, group_size: int = 1) -> SampleOutput:
  """The sampler's prefill + decode inside the scan (the host-side checks ran in `build`);
  `group_size`: rows come in contiguous groups of one prompt (one shared prefill each)."""
  return generate_in_jit(params, prompt_BP, jnp.ones(prompt_BP.shape, bool), key,
                         model_cfg=setup.model_cfg, policy=policy, config=config,
                         quant_key=quant_key, act_amax=act_amax, group_size=group_size)


def calib_key(key: jax.Array) -> jax.Array:
  """The key of a run's calibration prompts (fixed for the run)."""
  return jax.random.fold_in(key, 2**31 - 2)  # outside the range of step indices


def calibrate(setup: SimSetup, policy: precision.PrecisionPolicy, params,
              key: jax.Array) -> dict[str, jax.Array] | None:
  """Static activation amaxes for sampling `params` under `policy` (None if it needs none).

  `calibration.calibrate_act_amax` in the trainer's precision over `calib_num_prompts` train
  prompts from `key` with their target completions.
  """
  paths = policy.act_paths(layout.matmuls(setup.model_cfg), "tensor")
  if not paths:
    return None
  prompt_BP = setup.task.prompts(key, setup.calib_num_prompts)
  tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
  return calibration.calibrate_act_amax(
      params, tokens_BT, setup.model_cfg, setup.trainer_policy, paths,
      quant_key=setup.trainer_policy.quant_key(key))


def _rollout_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(prompt, sampling, quantization) keys of a step's rollout."""
  k_prompt, k_sample, k_quant = jax.random.split(key, 3)
  return k_prompt, k_sample, k_quant


def _train_prompts(setup: SimSetup, k_prompt: jax.Array) -> jax.Array:
  prompt_PL = setup.task.prompts(k_prompt, setup.num_prompts)
  return jnp.repeat(prompt_PL, setup.group_size, axis=0)  # group-contiguous


def sampler_score(setup: SimSetup, out: SampleOutput, params, key: jax.Array,
                  act_amax=None) -> SampleOutput:
  """`out` re-scored by `params` in the sampler's precision (exact mode, `rescore`) with the quant
  key of the rollout keyed by `key`: the sampler's record, or the drift's fourth score."""
  policy = setup.sampler_policy
  return rescore(out, params, model_cfg=setup.model_cfg, policy=policy, config=setup.sampling,
                 quant_key=policy.quant_key(_rollout_keys(key)[2]), act_amax=act_amax)


def rollout(setup: SimSetup, sampler_params, key: jax.Array, act_amax=None
            ) -> tuple[SampleOutput, jax.Array, jax.Array]:
  """One step's sequences sampled by `sampler_params` in the sampler's precision, with rewards.

  `act_amax`: the static activation scales stored with `sampler_params` (`calibrate`), for a
  sampler recipe that scales activations per tensor. Returns (output, reward_B, exact_B); rows
  are group-contiguous (group_size completions per prompt).
  """
  k_prompt, k_sample, k_quant = _rollout_keys(key)
  prompt_BL = _train_prompts(setup, k_prompt)
  policy = setup.sampler_policy
  out = _generate(setup, policy, setup.sampling, sampler_params, prompt_BL, k_sample,
                  policy.quant_key(k_quant), act_amax, setup.group_size)
  if setup.sampler_exact:
    out = sampler_score(setup, out, sampler_params, key, act_amax)
  reward_B, exact_B = setup.task.rewards(prompt_BL, out.tokens[:, out.prompt_width:])
  return out, reward_B, exact_B


def pipeline_rollout(setup: SimSetup, ring, token_slot_H: jax.Array, key: jax.Array
                     ) -> tuple[SampleOutput, jax.Array, jax.Array]:
  """`rollout` with in-flight weight updates: completion token j is drawn from the ring's version
  in slot token_slot_H[j] (weights and static scales), in the sampler's precision.

  Each token comes from a full forward of the sequence so far under its version (the sampler
  recomputes the prefix with the new weights rather than keeping the old KV cache), so the recorded
  log q is exactly the distribution the token was drawn from (exact mode by construction).
  """
  k_prompt, k_sample, k_quant = _rollout_keys(key)
  prompt_BP = _train_prompts(setup, k_prompt)
  policy, cfg = setup.sampler_policy, setup.sampling
  b, p = prompt_BP.shape
  h = setup.task.length
  tokens_BT = jnp.concatenate([prompt_BP, jnp.full((b, h), cfg.pad_id, jnp.int32)], axis=1)
  qk = policy.quant_key(k_quant)

  def draw(tokens_BT, j):
    params, act_amax = jax.tree.map(lambda r: r[token_slot_H[j]], ring)
    # Causal: the pad columns after position p + j - 1 do not reach its logits.
    logits_BTV = transformer.forward(params, tokens_BT, setup.model_cfg, policy,
                                     mask_BT=jnp.ones(tokens_BT.shape, jnp.float32),
                                     quant_key=qk,
                                     act_amax=used_act_amax(policy, setup.model_cfg, act_amax))
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, p + j - 1, axis=1, keepdims=False)
    tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(k_sample, j),
                                         logits_BV.astype(jnp.float32), cfg)
    return tokens_BT.at[:, p + j].set(tok_B), (logq_B, logp_B)

  tokens_BT, (logq_HB, logp_HB) = jax.lax.scan(draw, tokens_BT, jnp.arange(h))
  pad = ((0, 0), (p, 0))
  out = SampleOutput(
      tokens=tokens_BT, prompt_mask=jnp.pad(jnp.ones((b, p), jnp.float32), ((0, 0), (0, h))),
      completion_mask=jnp.pad(jnp.ones((b, h), jnp.float32), pad),
      logprobs=jnp.pad(logq_HB.T, pad), model_logprobs=jnp.pad(logp_HB.T, pad),
      prompt_lengths=jnp.full((b,), p, jnp.int32), completion_lengths=jnp.full((b,), h, jnp.int32),
      prompt_width=p)
  reward_B, exact_B = setup.task.rewards(prompt_BP, tokens_BT[:, p:])
  return out, reward_B, exact_B


def _eval_decode(setup: SimSetup, params, prompt_BP: jax.Array, config: SamplingConfig,
                 key: jax.Array, group_size: int = 1) -> tuple[jax.Array, jax.Array]:
  """(reward_B, exact_B) of the trainer's policy (trainer precision) decoding `prompt_BP` under
  `config`, keyed by `key` (sampling, quantization and the calibration prompts)."""
  # A trainer recipe with per-tensor activation scales decodes as deployed: static scales
  # calibrated from the evaluated weights.
  act_amax = calibrate(setup, setup.trainer_policy, params, calib_key(key))
  out = _generate(setup, setup.trainer_policy, config, params, prompt_BP, key,
                  setup.trainer_policy.quant_key(key), act_amax, group_size)
  return setup.task.rewards(prompt_BP, out.tokens[:, out.prompt_width:])


def evaluate(setup: SimSetup, params, key: jax.Array) -> dict[str, jax.Array]:
  """Greedy reward and exact-match rate of the trainer's policy (trainer precision) on held-out
  prompts (the eval split: problems never drawn for training); `evaluation.eval_metrics`."""
  prompt_BP = setup.task.prompts(key, setup.eval_num_prompts, "eval")
  greedy = dataclasses.replace(setup.sampling, temperature=0.0, top_k=0, top_p=1.0)
  reward_B, _ = _eval_decode(setup, params, prompt_BP, greedy, key)
  # Solved = reward 1 = every position right: the exact match under either reward kind.
  m = eval_metrics(reward_B)
  return {"reward": m["greedy_reward"], "exact": m["greedy"]}


def sampled_correct(setup: SimSetup, params, key: jax.Array) -> jax.Array:
  """[eval_num_prompts] int32: of `pass_eval_samples` completions per held-out prompt (the greedy
  eval's prompts for this key), sampled at the rollout temperature from the trainer's policy in
  its precision, how many are the exact answer (reward 1 under either kind). Per-prompt success
  counts for p_hat, the zero-success fraction and pass@k (`lowrl.tasks.success`)."""
  n = setup.pass_eval_samples
  prompt_PL = setup.task.prompts(key, setup.eval_num_prompts, "eval")
  prompt_BL = jnp.repeat(prompt_PL, n, axis=0)  # prompt-contiguous: row p * n + j
  # Its own sampling key (the greedy eval's is `key`); the same at every eval point of a run.
  _, exact_B = _eval_decode(setup, params, prompt_BL, setup.sampling,
                            jax.random.fold_in(key, 1), n)
  return jnp.sum(exact_B.reshape(setup.eval_num_prompts, n), axis=1).astype(jnp.int32)


def warm_start(setup: SimSetup, key: jax.Array):
  """Random init, then `sft.steps` supervised steps on the targets: the loop's SFT step (FP32)
  with this simulator's optimizer (Adam, constant lr, b2 0.99, gradients clipped at norm 1)."""
  params = init.init_params(setup.model_cfg, key)
  sft = dict(setup.sft)
  if not sft["steps"]:
    return params
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sft["lr"], b2=0.99))
  sft_step = make_sft_step(setup.model_cfg, tx)
  length = setup.task.length
  mask_T = jnp.concatenate([jnp.zeros(length + 1), jnp.ones(length)])

  def step(carry, k):
    prompt_BP = setup.task.prompts(k, sft["batch_size"])
    tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
    mask_BT = jnp.broadcast_to(mask_T, tokens_BT.shape)
    p, o, loss = sft_step(*carry, tokens_BT, mask_BT)
    return (p, o), loss

  keys = jax.random.split(jax.random.fold_in(key, 1), sft["steps"])
  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), keys)
  return params


def initial_params(setup: SimSetup, key: jax.Array):
  """The run's starting policy (warm start), in the master-weight dtype."""
  k_init, _ = jax.random.split(key)
  return optimizer.to_master(warm_start(setup, k_init), dict(setup.optimizer)["master_dtype"])


def make_rl_step(setup: SimSetup) -> tuple[Step, Any]:
  """(the loop's RL step `lowrl.training.step.make_step` for this setup, the trainer's
  `logprob_fn` that scores the rollouts)."""
  logprob_fn = make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling,
                               replay=setup.routing_replay)
  return make_step(logprob_fn, setup.make_optimizer(), setup.update_cfg,
                   setup.batch_cfg), logprob_fn


class RoutedTokens(NamedTuple):
  """A `TokenBatch` with the sampler's routing, for a replaying logprob function."""

  tokens_BT: jax.Array
  input_mask_BT: jax.Array
  routing: Any


def record_routing(setup: SimSetup, out: SampleOutput, sampler_params, key: jax.Array,
                   act_amax=None) -> SampleOutput:
  """`out` with the sampler's expert choices (`routing.record_routing`: its weights, precision,
  static scales and the quant key of the rollout keyed by `key`) in `out.routing`."""
  policy, model_cfg = setup.sampler_policy, setup.model_cfg
  ids = routing.record_routing(sampler_params, out.tokens, model_cfg, policy,
                               mask_BT=out.attention_mask,
                               quant_key=policy.quant_key(_rollout_keys(key)[2]),
                               act_amax=used_act_amax(policy, model_cfg, act_amax))[1]
  return out.replace(routing=ids)


def routing_flips(setup: SimSetup, out: SampleOutput, params, quant_key) -> jax.Array:
  """routing/flips: the fraction of (completion token, MoE layer) whose top-k set differs between
  the sampler's record and the trainer's own routers (with replay: what they would have chosen
  inside the replayed forward), as the loop's `lowrl.sampling.replay.flip_metrics`."""
  own = routing.forward_routed(params, out.tokens, setup.model_cfg, setup.trainer_policy,
                               out.routing if setup.routing_replay else None,
                               mask_BT=out.attention_mask, quant_key=quant_key)[1]
  return routing.routing_flips(out.routing, own, out.completion_mask)["mean"]


def sampler_scores_are_trainers(setup: SimSetup) -> bool:
  """Whether the sampler's precision scores any weights exactly as the trainer's does, so the
  drift's fourth score (current weights in the sampler's precision) is the trainer's own.

  Identical recipes, unless the sampler runs on static activation scales (per-tensor recipes,
  as deployed) while the trainer takes each batch's own: then the scale difference is a
  quantization drift, and taking the trainer's score as the fourth would count half of it as
  staleness.
  """
  return (setup.sampler_policy == setup.trainer_policy and not
          setup.sampler_policy.act_paths(layout.matmuls(setup.model_cfg), "tensor"))


def make_train(setup: SimSetup, num_slots: int) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
  """`train(params, key, plan) -> (final params, metrics)`: all the updates of a run, one scan.

  `plan` is `AsyncSchedule.ring_plan(setup.steps, num_slots)` (as arrays; a pipeline setup adds
  `token_read_slot` [steps, horizon] of `PipelineSchedule.token_ring_plan`); `metrics` are
  [steps] arrays of per-step scalars. Pure and jittable. With rl.kl_coef > 0 the KL penalty is
  to the starting params (the loop's reference: its base), unless `plan` holds `ref_reset`
  ([steps] bool, `reset_plan`): then after the update of every step t where it is true the
  reference becomes the current params (the loop's rl.ref_reset_every; a runtime input, so fixed
  and reset runs share one program). With `setup.pass_eval_every` > 0, after every that many
  updates `sampled_correct` of the params (`eval/pass/correct`, [steps, eval_num_prompts], -1 on
  the other steps).
  """
  tx = setup.make_optimizer()
  rl_step, logprob_fn = make_rl_step(setup)
  use_ref = setup.update_cfg.loss.kl_coef > 0
  same_precision = sampler_scores_are_trainers(setup)
  p_width = setup.task.length + 1
  moe = setup.model_cfg.is_moe  # dense programs trace exactly as before

  def train(params, key, plan):
    _, k_steps = jax.random.split(key)
    opt_state = optimizer.init_opt_state(tx, params)
    ref_params = params if use_ref else None
    resets = "ref_reset" in plan  # the reference rides in the carry only then
    if resets and not use_ref:
      raise ValueError("plan['ref_reset'] resets the KL reference; it needs rl.kl_coef > 0.")
    k_calib = calib_key(key)
    base_amax = calibrate(setup, setup.sampler_policy, params, k_calib)

    def rollout_weights(p):
      """What a sync ships to the samplers: the weights and their static activation scales."""
      if setup.act_calibration == "sync":
        return p, calibrate(setup, setup.sampler_policy, p, k_calib)
      return p, base_amax

    ring = jax.tree.map(lambda p: jnp.zeros((num_slots,) + p.shape, p.dtype),
                        rollout_weights(params))
    ring_version = jnp.full((num_slots,), -1, jnp.int32)

    def step(carry, xs):
      if resets:
        params, opt_state, ring, ring_version, ref = carry
      else:
        (params, opt_state, ring, ring_version), ref = carry, ref_params
      t, write, write_slot, read_slot, token_slot_H, *reset = xs
      # Sync: version t (params after t updates) reaches the samplers' slot.
      ring = jax.tree.map(
          lambda r, p: r.at[write_slot].set(jnp.where(write, p, r[write_slot])), ring,
          rollout_weights(params))
      ring_version = ring_version.at[write_slot].set(
          jnp.where(write, t, ring_version[write_slot]))
      sampler_params, sampler_amax = jax.tree.map(lambda r: r[read_slot], ring)
      k_roll, k_score, k_upd = jax.random.split(jax.random.fold_in(k_steps, t), 3)
      # The trainer's scores share one key, so with lag 0 the staleness part is exactly 0.
      qk = setup.trainer_policy.quant_key(k_score)
      if setup.pipeline:
        out, reward_B, exact_B = pipeline_rollout(setup, ring, token_slot_H, k_roll)
        tokens = TokenBatch(out.tokens, out.attention_mask)
        # Stale score per token: the trainer's score under every slot, each token's slot picked.
        logp_SBT = jax.lax.map(lambda slot_params: logprob_fn(slot_params, tokens, qk)[0],
                               ring[0])
        slot_T = jnp.concatenate([jnp.zeros((p_width,), jnp.int32), token_slot_H])
        logp_stale_BT = jnp.take_along_axis(logp_SBT, slot_T[None, None, :], axis=0)[0]
      else:
        out, reward_B, exact_B = rollout(setup, sampler_params, k_roll, sampler_amax)
        tokens = TokenBatch(out.tokens, out.attention_mask)
        if moe:  # the sampler's routing rides with the batch (replayed if routing_replay)
          out = record_routing(setup, out, sampler_params, k_roll, sampler_amax)
          tokens = RoutedTokens(out.tokens, out.attention_mask, out.routing)
        logp_stale_BT = logprob_fn(sampler_params, tokens, qk)[0]
      logp_now_BT = logprob_fn(params, tokens, qk)[0]
      if same_precision:
        logp_now_sampler_BT = logp_now_BT
      else:  # the static scales a sync of the current weights would ship
        logp_now_sampler_BT = sampler_score(setup, out, params, k_roll,
                                            rollout_weights(params)[1]).logprobs
      params_before = params
      params, opt_state, m = rl_step(
          params, opt_state, ref,
          Rollout(out, reward_B, logp_now_BT, logp_stale_BT, logp_now_sampler_BT), k_upd)
      version = ring_version[read_slot]
      if moe:
        m = {**m, "routing/flips": routing_flips(setup, out, params_before, qk)}
      if setup.eval_every:  # every eval_every steps: a real cond (not a select)
        m = {**m, "eval/curve/reward": jax.lax.cond(
            (t + 1) % setup.eval_every == 0,
            lambda p: evaluate(setup, p, eval_key(key))["reward"],
            lambda p: jnp.float32(jnp.nan), params)}
      if setup.pass_eval_every:
        m = {**m, "eval/pass/correct": jax.lax.cond(
            (t + 1) % setup.pass_eval_every == 0,
            lambda p: sampled_correct(setup, p, eval_key(key)),
            lambda p: jnp.full((setup.eval_num_prompts,), -1, jnp.int32), params)}
      m = {**m, "reward/exact": jnp.mean(exact_B), "sampler_version": version,
           "drift/tokens": jnp.sum(out.completion_mask),
           "drift/staleness/version_distance": version_distance(sampler_params, params_before),
           "sampler_version_lag": t - version}
      if resets:  # pi_ref <- the params after this update (where the plan says so)
        ref = jax.tree.map(lambda r, p: jnp.where(reset[0], p, r), ref, params)
        return (params, opt_state, ring, ring_version, ref), m
      return (params, opt_state, ring, ring_version), m

    token_slot = plan.get("token_read_slot",
                          jnp.zeros((setup.steps, setup.task.length), jnp.int32))
    xs = (jnp.arange(setup.steps, dtype=jnp.int32), plan["write"], plan["write_slot"],
          plan["read_slot"], token_slot) + ((plan["ref_reset"],) if resets else ())
    carry = (params, opt_state, ring, ring_version) + ((ref_params,) if resets else ())
    (params, *_), metrics = jax.lax.scan(step, carry, xs)
    return params, metrics

  return train


def reset_plan(steps: int, every: int) -> np.ndarray:
  """[steps] bool: reset the KL reference after the update of step t iff (t + 1) % every == 0,
  as the loop's rl.ref_reset_every (0 = never: a fixed reference)."""
  if not isinstance(every, int) or isinstance(every, bool) or every < 0:
    raise ValueError(f"ref_reset_every={every!r}: use an int >= 0 (0 = a fixed reference).")
  t = np.arange(steps)
  return (t + 1) % every == 0 if every else np.zeros(steps, bool)


def eval_key(key: jax.Array) -> jax.Array:
  """The key of a run's held-out prompts (the same before and after training)."""
  return jax.random.fold_in(key, 2**31 - 1)  # outside the range of step indices
