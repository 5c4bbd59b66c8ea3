"""The RL update: one pure function of (params, opt_state, ref_params, batch, key).

It recomputes the trainer's logprobs of the sampled tokens (pi_old and the mismatch metrics), builds
the sampler/trainer correction weights, then runs `mu` passes of `num_minibatches` optimizer steps
on the batch against that fixed pi_old. A non-finite loss, gradient or updated state skips that
optimizer step (params and optimizer state unchanged) and is counted in the metrics.

Batch layout (all [B, T], aligned so that column t refers to token t, see ARCHITECTURE.md):
  tokens_BT       int32, prompt + completion (+ padding)
  input_mask_BT   bool/float, 1 on real (non-padding) tokens
  loss_mask_BT    float32, 1 on completion tokens that count in the loss
  logp_sampler_BT float32, log q_sampler(token t), the sampler's recorded `logprobs` (0 off loss_mask)
  logp_trainer_BT float32, optional: the trainer's log q of the same tokens with the params that
                  start this update (pi_old as the trainer sees it); recomputed here if absent
  adv_B           float32 advantages

Every logprob is of the distribution rollouts are sampled from, q = softmax(logits / temperature)
restricted to top-k / top-p (`make_logprob_fn`'s `sampling`): the importance weight of the
correction is q_trainer / q_sampler and the PPO ratio is q_theta / q_old, both on that one
distribution (verl scores logits / temperature the same way).

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL):
behaviour policy pi_behav = the sampler, proximal policy pi_prox = pi_old. Per token the loss is
  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * sg(c),  r = pi_theta / pi_prox,
  c = correction(pi_prox / pi_behav) (rl.correction: 1 for none, truncated for TIS, masked for MIS).
old_logp_source=trainer: pi_prox = the trainer's recompute. old_logp_source=sampler: pi_prox =
pi_behav, so c is 1 by definition: rl.correction must be none (UpdateConfig rejects TIS/MIS, which
would divide by the sampler twice).

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
from lowrl.rl.advantages import ADVANTAGE_MODES, validate_std_ddof
from lowrl.rl.corrections import CorrectionConfig, correction_weights
from lowrl.rl.losses import LossConfig, policy_loss
from lowrl.rl.masked import masked_mean
from lowrl.rl.mismatch import mismatch_metrics
from lowrl import sampling as sampler_lib
from lowrl.sampling import SamplingConfig
from lowrl.training.optimizer import apply_update, tree_all_finite

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
    if self.old_logp_source == "sampler" and self.correction.mode != "none":
      # Decoupled PPO with pi_prox = pi_behav: the PPO ratio is already relative to the sampler,
      # so a TIS/MIS weight pi_trainer/pi_sampler on top would correct twice.
      raise ValueError(f"rl.correction={self.correction.mode!r} with rl.old_logp_source=sampler "
                       "corrects the sampler mismatch twice; set rl.correction=none or "
                       "rl.old_logp_source=trainer.")


def default_rl_config() -> ml_collections.ConfigDict:
  """The RL knobs shared by the training loop (configs/base.py) and the fast simulator."""
  c = ml_collections.ConfigDict()
  c.steps = 40
  c.num_prompts = 32
  c.group_size = 8
  c.advantage = "grpo"  # grpo | drgrpo | rloo
  c.std_ddof = 0  # GRPO group std: 0 population (GRPO paper) | 1 sample (TRL, verl, tunix)
  c.loss = "grpo"  # grpo | dapo | gspo | cispo
  # "" = the loss's paper default (token_mean for dapo/cispo, seq_mean_token_mean for grpo/gspo);
  # or seq_mean_token_mean | token_mean | seq_mean_token_sum_norm (Dr.GRPO).
  c.aggregation = ""
  c.clip_eps_low = 0.2  # PPO clip: ratio >= 1 - clip_eps_low
  c.clip_eps_high = ml_collections.config_dict.placeholder(float)  # None = 0.28 dapo, else 0.2
  c.cispo_eps_max = 4.0  # CISPO: the detached weight is min(ratio, cispo_eps_max)
  c.mu = 1  # inner updates per batch against pi_old
  c.num_minibatches = 1  # PPO minibatches per pass over the batch
  # pi_old of the PPO ratio: trainer (recompute; decoupled PPO, the sampler is corrected for by
  # rl.correction) | sampler (recorded; the ratio is then relative to the sampler and
  # rl.correction must be none).
  c.old_logp_source = "trainer"
  c.kl_coef = 0.0  # beta of the KL-to-reference penalty (0 = no penalty)
  c.kl_estimator = "k3"  # k1 | k2 | k3 (REFERENCE.md section 3)
  c.correction = "none"  # none | tis | mis
  c.correction_level = "token"  # token | sequence
  c.tis_cap = 2.0  # TIS: weight truncated at this cap
  c.mis_low = 0.5  # MIS: tokens/sequences with weight below this are masked
  c.mis_high = 5.0  # MIS: tokens/sequences with weight above this are masked
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
  validate_std_ddof(rl.std_ddof)
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


# Stands in for the -inf of a token outside the top-k / top-p support inside the update: exp()
# of it is exactly 0 like -inf, but products with 0 (entropy, CISPO's coef * logp) stay 0, not NaN.
_OUTSIDE_SUPPORT_LOGIT = -1e30


def make_logprob_fn(model_cfg: ModelConfig, policy: PrecisionPolicy,
                    sampling: SamplingConfig | None = None
                    ) -> Callable[[Any, Batch, jax.Array | None], tuple[jax.Array, jax.Array]]:
  """(params, batch, quant_key) -> (logp_BT, entropy_BT) of the batch's tokens, FP32.

  The distribution is the one rollouts are sampled from: `sampling`'s transform (logits /
  temperature, top-k, top-p; `lowrl.sampling.sampling_logits`) applied to the model's
  logits, the same transform the sampler's `logprobs` and `rescore(...).logprobs` use. None, or
  a config that leaves the distribution unchanged, = the raw model. A token outside the top-k /
  top-p support gets logp ~ -1e30 (probability exactly 0).
  """
  if sampling is not None and sampling.greedy:
    raise ValueError("The trained distribution needs rl.temperature > 0 (greedy has no logprobs).")
  transform = sampling is not None and sampling.modifies_distribution

  def logprob_fn(params, batch, quant_key):
    tokens_BT, mask_BT = batch["tokens_BT"], batch["input_mask_BT"]
    quant_key = quant_key if policy.needs_key else None
    if not transform:
      return transformer.token_logprobs_and_entropy(params, tokens_BT, model_cfg, policy,
                                                    mask_BT=mask_BT, quant_key=quant_key)
    logits_BTV = transformer.forward(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                                     quant_key=quant_key)
    q_logits_BTV = sampler_lib.sampling_logits(logits_BTV, sampling)
    q_logits_BTV = jnp.maximum(q_logits_BTV, _OUTSIDE_SUPPORT_LOGIT)
    return transformer.logprobs_from_logits(q_logits_BTV, tokens_BT, mask_BT)
  return logprob_fn


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
    # A token outside pi_old's top-k / top-p support (possible when the sampler's weights or
    # precision differ) has pi_old = 0: its PPO ratio is undefined and its corrected weight
    # pi_old / pi_sampler is 0, so it leaves the loss.
    in_support_BT = (logp_old_BT > _OUTSIDE_SUPPORT_LOGIT / 2).astype(jnp.float32)
    outside_support_frac = masked_mean(1.0 - in_support_BT, mask_BT)
    loss_mask_BT = mask_BT * in_support_BT
    use_is = cfg.correction.mode != "none"
    logp_ref_BT = None
    if ref_params is not None:  # penalised if kl_coef > 0, else only logged
      logp_ref_BT = jax.lax.stop_gradient(logprob_fn(ref_params, batch, key_fwd)[0])

    full = dict(batch, logp_old_BT=logp_old_BT, is_w_BT=is_w_BT, loss_mask_BT=loss_mask_BT)
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
      grad_norm = optax.tree.norm(grads)
      new_p, new_o = apply_update(tx, p, grads, o, master_rounding=cfg.master_rounding,
                                  key=jax.random.fold_in(key_opt, i))
      # Keep the old state when the loss, the gradient or the update is non-finite (a finite
      # gradient can still give a non-finite update, e.g. with a huge lr).
      ok = jnp.isfinite(loss) & tree_all_finite((grads, new_p, new_o))
      p, o = jax.tree.map(lambda new, old: jnp.where(ok, new, old), (new_p, new_o), (p, o))
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
    metrics["correction/outside_support_frac"] = outside_support_frac
    return params, opt_state, metrics

  return update
