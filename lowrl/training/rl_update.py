"""The RL update: one pure function of (params, opt_state, ref_params, batch, key).

It recomputes the trainer's logprobs of the sampled tokens (pi_old and the mismatch metrics), builds
the sampler/trainer correction weights, then runs `mu` passes of `num_minibatches` optimizer steps
on the batch against that fixed pi_old. A non-finite loss or gradient skips that optimizer step
(params and optimizer state unchanged) and is counted in the metrics.

Batch layout (all [B, T], aligned so that column t refers to token t, see ARCHITECTURE.md):
  tokens_BT       int32, prompt + completion (+ padding)
  input_mask_BT   bool/float, 1 on real (non-padding) tokens
  loss_mask_BT    float32, 1 on completion tokens that count in the loss
  logp_sampler_BT float32, the logprob the sampler recorded for token t (0 off loss_mask)
  logp_trainer_BT float32, optional: the trainer's recompute of the same logprobs with the params
                  that start this update (pi_old as the trainer sees it); recomputed here if absent
  adv_B           float32 advantages

pi_old is recomputed *outside* this function, by the same jitted scoring program the sampler uses
in exact mode (lowrl.sampling.rescore): two different XLA programs round BF16 activations
differently, and NVFP4 amplifies a one-ulp difference into a different code, so only the
identical program gives bit-identical logprobs (mismatch exactly 0 when sampler = trainer).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lowrl.models import transformer
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.rl.advantages import ADVANTAGE_MODES
from lowrl.rl.corrections import CorrectionConfig, correction_weights
from lowrl.rl.losses import LossConfig, policy_loss
from lowrl.rl.masked import masked_mean
from lowrl.rl.mismatch import mismatch_metrics
from lowrl.training.optimizer import apply_update

Batch = dict[str, jax.Array]
OLD_LOGP_SOURCES = ("trainer", "sampler")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """Static settings of the update (hashable)."""

  loss: LossConfig
  correction: CorrectionConfig
  mu: int = 1
  num_minibatches: int = 1
  old_logp_source: str = "trainer"
  master_rounding: str = "nearest"

  def __post_init__(self):
    if self.mu < 1:
      raise ValueError(f"rl.mu (inner updates per batch) must be >= 1, got {self.mu}.")
    if self.num_minibatches < 1:
      raise ValueError(f"rl.num_minibatches must be >= 1, got {self.num_minibatches}.")
    if self.old_logp_source not in OLD_LOGP_SOURCES:
      raise ValueError(f"rl.old_logp_source={self.old_logp_source!r}; use one of "
                       f"{OLD_LOGP_SOURCES}.")


def default_rl_config() -> ml_collections.ConfigDict:
  """The RL knobs shared by the training loop (configs/base.py) and the fast simulator."""
  c = ml_collections.ConfigDict()
  c.steps = 40
  c.num_prompts = 32
  c.group_size = 8
  c.advantage = "grpo"  # grpo | drgrpo | rloo
  c.loss = "grpo"  # grpo | dapo | gspo | cispo
  # "" = the loss's paper default (token_mean for dapo/cispo, seq_mean_token_mean for grpo/gspo);
  # or seq_mean_token_mean | token_mean | seq_mean_token_sum_norm (Dr.GRPO).
  c.aggregation = ""
  c.clip_eps_low = 0.2
  c.clip_eps_high = ml_collections.config_dict.placeholder(float)  # None = 0.28 dapo, else 0.2
  c.cispo_eps_max = 4.0
  c.mu = 1  # inner updates per batch against pi_old
  c.num_minibatches = 1
  c.old_logp_source = "trainer"  # trainer (recompute) | sampler (recorded)
  c.kl_coef = 0.0
  c.kl_estimator = "k3"
  c.correction = "none"  # none | tis | mis
  c.correction_level = "token"  # token | sequence
  c.tis_cap = 2.0
  c.mis_low = 0.5
  c.mis_high = 5.0
  return c


def update_config_from(rl: ml_collections.ConfigDict, master_rounding: str,
                       max_len: int) -> UpdateConfig:
  """Validates the RL knobs of `default_rl_config` and builds the update's static config.

  Raises ValueError naming the `rl.*` flag to fix. `max_len` is the Dr.GRPO normaliser (the
  horizon).
  """
  for name in ("steps", "num_prompts", "group_size"):
    if rl[name] < 1:
      raise ValueError(f"config.rl.{name} must be >= 1, got {rl[name]}.")
  if rl.group_size < 2:
    raise ValueError(f"config.rl.group_size={rl.group_size}: group-relative advantages need >= 2 "
                     "samples per prompt.")
  if rl.advantage not in ADVANTAGE_MODES:
    raise ValueError(f"config.rl.advantage={rl.advantage!r}; use one of {ADVANTAGE_MODES}.")
  if (rl.num_prompts * rl.group_size) % rl.num_minibatches:
    raise ValueError(f"rl.num_prompts * rl.group_size = {rl.num_prompts * rl.group_size} is not "
                     f"divisible by rl.num_minibatches={rl.num_minibatches}.")
  loss = LossConfig(loss=rl.loss, clip_eps_low=rl.clip_eps_low, clip_eps_high=rl.clip_eps_high,
                    cispo_eps_max=rl.cispo_eps_max, aggregation=rl.aggregation or None,
                    max_len=max_len, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator)
  correction = CorrectionConfig(mode=rl.correction, level=rl.correction_level, tis_cap=rl.tis_cap,
                                mis_low=rl.mis_low, mis_high=rl.mis_high)
  return UpdateConfig(loss=loss, correction=correction, mu=rl.mu,
                      num_minibatches=rl.num_minibatches, old_logp_source=rl.old_logp_source,
                      master_rounding=master_rounding)


def make_logprob_fn(model_cfg: ModelConfig, policy: PrecisionPolicy
                    ) -> Callable[[Any, Batch, jax.Array | None], tuple[jax.Array, jax.Array]]:
  """(params, batch, quant_key) -> (logp_BT, entropy_BT) of the batch's tokens, FP32."""
  def logprob_fn(params, batch, quant_key):
    return transformer.token_logprobs_and_entropy(
        params, batch["tokens_BT"], model_cfg, policy, mask_BT=batch["input_mask_BT"],
        quant_key=quant_key if policy.needs_key else None)
  return logprob_fn


def _tree_all_finite(tree: Any) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves))


def make_rl_update(logprob_fn, tx: optax.GradientTransformation, cfg: UpdateConfig):
  """Builds `update(params, opt_state, ref_params, batch, key) -> (params, opt_state, metrics)`.

  `ref_params` None: no KL to a reference is computed (kl_coef must then be 0); given with
  kl_coef == 0, the KL to it is logged but not penalised.
  """

  def update(params, opt_state, ref_params, batch: Batch, key: jax.Array):
    key_fwd, key_opt = jax.random.split(key)
    mask_BT = batch["loss_mask_BT"].astype(jnp.float32)
    batch_size = mask_BT.shape[0]
    if batch_size % cfg.num_minibatches:
      raise ValueError(f"batch of {batch_size} sequences is not divisible into "
                       f"rl.num_minibatches={cfg.num_minibatches}.")

    if "logp_trainer_BT" in batch:
      logp_trainer_BT = jax.lax.stop_gradient(batch["logp_trainer_BT"])
    else:  # no external scorer (e.g. the fast simulator): recompute inside this program
      logp_trainer_BT = jax.lax.stop_gradient(logprob_fn(params, batch, key_fwd)[0])
    logp_sampler_BT = batch["logp_sampler_BT"]
    logp_old_BT = logp_trainer_BT if cfg.old_logp_source == "trainer" else logp_sampler_BT
    is_w_BT, corr_metrics = correction_weights(logp_trainer_BT, logp_sampler_BT, mask_BT,
                                               cfg.correction)
    use_is = cfg.correction.mode != "none"
    logp_ref_BT = None
    if ref_params is not None:  # penalised if kl_coef > 0, else only logged
      logp_ref_BT = jax.lax.stop_gradient(logprob_fn(ref_params, batch, key_fwd)[0])

    full = dict(batch, logp_old_BT=logp_old_BT, is_w_BT=is_w_BT, loss_mask_BT=mask_BT)
    if logp_ref_BT is not None:
      full["logp_ref_BT"] = logp_ref_BT
    mb = batch_size // cfg.num_minibatches
    minibatches = jax.tree.map(
        lambda x: x.reshape((cfg.num_minibatches, mb) + x.shape[1:]), full)

    def loss_fn(p, b):
      logp_BT, entropy_BT = logprob_fn(p, b, key_fwd)
      loss, m = policy_loss(logp_BT, b["logp_old_BT"], b["adv_B"], b["loss_mask_BT"], cfg.loss,
                            logp_ref_BT=b.get("logp_ref_BT"),
                            is_weights_BT=b["is_w_BT"] if use_is else None)
      m["entropy"] = jax.lax.stop_gradient(masked_mean(entropy_BT, b["loss_mask_BT"]))
      return loss, m

    def step(carry, i):
      p, o = carry
      b = jax.tree.map(lambda x: x[i % cfg.num_minibatches], minibatches)
      (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
      ok = jnp.isfinite(loss) & _tree_all_finite(grads)
      grad_norm = optax.tree.norm(grads)

      def do(args):
        return apply_update(tx, *args, master_rounding=cfg.master_rounding,
                            key=jax.random.fold_in(key_opt, i))

      p, o = jax.lax.cond(ok, do, lambda args: (args[0], args[2]), (p, grads, o))
      m = dict(m, loss=loss, grad_norm=grad_norm, skipped=1.0 - ok.astype(jnp.float32))
      return (p, o), m

    (params, opt_state), step_metrics = jax.lax.scan(
        step, (params, opt_state), jnp.arange(cfg.mu * cfg.num_minibatches))

    metrics = {k: jnp.mean(v) for k, v in step_metrics.items() if k != "skipped"}
    metrics["skipped_updates"] = jnp.sum(step_metrics["skipped"])
    metrics["grad_norm_max"] = jnp.max(step_metrics["grad_norm"])
    metrics["entropy"] = step_metrics["entropy"][0]  # of pi_old, before any inner step
    metrics.update({f"mismatch/{k}": v for k, v in
                    mismatch_metrics(logp_sampler_BT, logp_trainer_BT, mask_BT).items()})
    metrics.update({f"correction/{k}": v for k, v in corr_metrics.items()})
    return params, opt_state, metrics

  return update
