"""One RL step, shared by the host training loop and the in-jit simulator.

A rollout (the sampled sequences, their task rewards and the trainer's scores of them) becomes a
typed batch (`lowrl.training.batch.RLBatch`: DAPO overlong penalty, group-relative advantages,
DAPO dynamic sampling, all in JAX), then the step logs the sampler -> trainer drift and runs the
pure update (`rl_update.make_rl_update`). `make_step` returns that step as one pure function: the
loop jits it with its shardings and donation (rewards come from the host verifier), the fast
simulator calls it inside its `lax.scan` (rewards computed in JAX). Scoring stays outside the
step: the loop's pi_old must come from the sampler's own jitted `rescore` program (bit-identical
to the exact-mode sampler), which a bigger program would round differently.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lowrl.rl.advantages import compute_advantages, group_has_signal, overlong_penalty
from lowrl.rl.drift import drift_metrics
from lowrl.rl.health import health_metrics
from lowrl.sampling import SampleOutput
from lowrl.sharding import ShardingPlan
from lowrl.training.batch import RLBatch
from lowrl.training.rl_update import UpdateConfig, make_rl_update


# `make_batch`'s metrics, in their log order.
BATCH_METRICS = ("reward/mean", "reward/pass_rate", "response_length", "groups_kept")


class Rollout(NamedTuple):
  """What one step consumes: the sampled batch, its task rewards and the trainer's two scores.

  out:           the sampler's output (group-contiguous rows: group_size completions per prompt).
  rewards_B:     float32 task rewards (before any shaping).
  logp_now_BT:   log q of the sampled tokens, trainer's precision, current params: pi_old.
  logp_stale_BT: the same with the sampler's (possibly stale) weights, for the drift
                 decomposition; `logp_now_BT` itself when the sampler used the current weights.
  logp_now_sampler_BT: the current params in the sampler's precision (the fourth score of the
                 order-symmetric drift split, lowrl.rl.drift); None = the ordered split.
  """

  out: SampleOutput
  rewards_B: jax.Array
  logp_now_BT: jax.Array
  logp_stale_BT: jax.Array
  logp_now_sampler_BT: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """Static settings of rollout -> batch (hashable).

  Attributes:
    group_size: completions per prompt (the advantage group).
    advantage: grpo | drgrpo | rloo (`lowrl.rl.advantages`).
    std_ddof: GRPO group std, 0 population | 1 sample.
    dynamic_sampling: DAPO: groups whose rewards are all equal leave the loss (masked, static
      shapes).
    overlong_buffer: DAPO soft overlong penalty ramp length in tokens (0 = off).
    max_new_tokens: the completion budget the overlong penalty ramps up to.
  """

  group_size: int
  advantage: str = "grpo"
  std_ddof: int = 0
  dynamic_sampling: bool = False
  overlong_buffer: int = 0
  max_new_tokens: int = 0

  def __post_init__(self):
    if not 0 <= self.overlong_buffer <= self.max_new_tokens:
      raise ValueError(f"rl.overlong_buffer={self.overlong_buffer} must be in [0, "
                       f"{self.max_new_tokens}] (the completion budget); 0 turns it off.")

  @classmethod
  def from_rl(cls, rl: ml_collections.ConfigDict, max_new_tokens: int) -> "BatchConfig":
    """From a run's validated `rl` section (lowrl.training.schema) and its horizon."""
    return cls(group_size=rl.group_size, advantage=rl.advantage, std_ddof=rl.std_ddof,
               dynamic_sampling=bool(rl.dynamic_sampling),
               overlong_buffer=int(rl.overlong_buffer), max_new_tokens=max_new_tokens)


def make_batch(out: SampleOutput, rewards_B: jax.Array, cfg: BatchConfig,
               logp_trainer_BT: jax.Array | None = None
               ) -> tuple[RLBatch, dict[str, jax.Array]]:
  """(RLBatch, step metrics) of a sampled batch; pure and jittable.

  Advantages come from the rewards plus the overlong penalty; dynamic sampling decides on the
  task rewards alone. Metrics: reward/mean, reward/pass_rate (reward >= 1), response_length
  (mean completion tokens), groups_kept (fraction of sequences left in the loss by dynamic
  sampling; 1 when off).
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  lengths_B = out.completion_lengths
  shaped_B = rewards_B
  if cfg.overlong_buffer > 0:
    shaped_B = rewards_B + overlong_penalty(lengths_B, cfg.max_new_tokens, cfg.overlong_buffer)
  adv_B = compute_advantages(shaped_B, cfg.group_size, cfg.advantage, std_ddof=cfg.std_ddof)
  loss_mask_BT = out.completion_mask
  groups_kept = jnp.ones((), jnp.float32)
  if cfg.dynamic_sampling:
    signal_B = group_has_signal(rewards_B, cfg.group_size)
    groups_kept = jnp.mean(signal_B)
    loss_mask_BT = loss_mask_BT * signal_B[:, None].astype(jnp.float32)
  # log q on both sides: the distribution sampled from (temperature, top-k, top-p), which the
  # update's ratio and correction also use (lowrl.training.rl_update).
  batch = RLBatch(tokens_BT=out.tokens, input_mask_BT=out.attention_mask,
                  loss_mask_BT=loss_mask_BT, logp_sampler_BT=out.logprobs, adv_B=adv_B,
                  logp_trainer_BT=logp_trainer_BT, routing=out.routing)
  metrics = {"reward/mean": jnp.mean(rewards_B),
             "reward/pass_rate": jnp.mean((rewards_B >= 1).astype(jnp.float32)),
             "response_length": jnp.mean(lengths_B.astype(jnp.float32)),
             "groups_kept": groups_kept}
  return batch, metrics


Step = Callable[[Any, Any, Any, Rollout, jax.Array], tuple[Any, Any, dict[str, jax.Array]]]


def make_step(logprob_fn, tx: optax.GradientTransformation, update_cfg: UpdateConfig,
              batch_cfg: BatchConfig, plan: ShardingPlan | None = None) -> Step:
  """`step(params, opt_state, ref_params, rollout, key) -> (params, opt_state, metrics)`.

  `make_batch` + `drift_metrics` + the update; pure and jittable. `logprob_fn` is the trainer's
  (`rl_update.make_logprob_fn`); `ref_params` None = no KL to a reference (kl_coef must be 0).
  Metrics: the update's, `health/<metric>` (`lowrl.rl.health`: sampler vs the trainer's pi_old
  on the loss's tokens, as `mismatch/*`; task rewards' groups), `drift/<part>/<metric>` and
  `make_batch`'s, in that order. `plan`: the
  mesh the step is jitted on (the update keeps rows on their data shards), None when unplaced.
  """
  update = make_rl_update(logprob_fn, tx, update_cfg, plan)

  def step(params, opt_state, ref_params, rollout: Rollout, key: jax.Array):
    out = rollout.out
    batch, batch_metrics = make_batch(out, rollout.rewards_B, batch_cfg, rollout.logp_now_BT)
    drift = drift_metrics(out.logprobs, rollout.logp_stale_BT, rollout.logp_now_BT,
                          out.completion_mask, rollout.logp_now_sampler_BT)
    health = health_metrics(out.logprobs, rollout.logp_now_BT, batch.loss_mask_BT,
                            rollout.rewards_B, batch_cfg.group_size)
    params, opt_state, metrics = update(params, opt_state, ref_params, batch, key)
    return params, opt_state, {**metrics, **{f"health/{k}": v for k, v in health.items()},
                               **drift, **batch_metrics}

  return step
