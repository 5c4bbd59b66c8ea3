"""Policy-gradient losses (GRPO / DAPO / GSPO / CISPO) and their aggregation over tokens.

All losses are written per token ([B, T]) and then aggregated (formulas: docs/reference.md §3).
rho_t = exp(logp_t - logp_old_t); advantages are per sequence (adv_B) and detached.

  grpo:  -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)         (PPO clip)
  dapo:  the same with clip-higher (eps_high 0.28) and token_mean aggregation by default
  gspo:  the same clip on the sequence ratio s_i = exp(masked mean_t(logp - logp_old)) with the GSPO
         bounds [1 - 3e-4, 1 + 4e-4]. Implemented in the paper's GSPO-token form: the per-token ratio is
         sg(s_i) * pi_t / sg(pi_t), whose value is s_i and whose gradient is s_i * d logp_t. With the
         default seq_mean_token_mean aggregation the loss *and* gradient equal the sequence-level
         objective mean_i -min(s_i A_i, clip(s_i) A_i) exactly.
  cispo: -sg(min(rho, eps_max)) A logp_t: the clipped IS weight is a detached coefficient, so every
         token keeps a gradient (MiniMax-M1, ScaleRL).

Aggregation (mask_BT weights tokens; sequences with no counted token are left out of sequence means,
so groups dropped by zeroing their mask don't dilute the batch):
  seq_mean_token_mean     mean over sequences of the per-sequence token mean (GRPO)
  token_mean              mean over all counted tokens of the batch (DAPO)
  seq_mean_token_sum_norm per-sequence token sum / max_len, mean over sequences (Dr.GRPO)

`is_weights_BT` (lowrl.rl.corrections) multiplies each token's policy-gradient term, detached. A zero
weight (MIS) removes the token's contribution but not its place in the normalisation: pass
`mask_BT * (is_weights_BT > 0)` as the mask as well to renormalise over kept tokens.
The KL-to-reference penalty is not importance weighted.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowrl.rl.kl import kl_estimate, validate_kl_estimator
from lowrl.rl.masked import masked_count, masked_mean, masked_sum

LOSSES = ("grpo", "dapo", "gspo", "cispo")
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
_DEFAULT_AGGREGATION = {"grpo": "seq_mean_token_mean", "dapo": "token_mean",
                        "gspo": "seq_mean_token_mean", "cispo": "token_mean"}
_DEFAULT_CLIP_EPS_HIGH = {"grpo": 0.2, "dapo": 0.28, "gspo": 0.2, "cispo": 0.2}


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy loss configuration (frozen, hashable: pass it as a static jit argument).

  Attributes:
    loss: "grpo" | "dapo" | "gspo" | "cispo".
    clip_eps_low, clip_eps_high: PPO clip range for grpo/dapo; clip_eps_high None = 0.28 for dapo,
      0.2 otherwise.
    gspo_eps_low, gspo_eps_high: clip range of the GSPO sequence ratio.
    cispo_eps_max: upper truncation of the CISPO IS weight.
    aggregation: one of AGGREGATIONS; None = the loss's paper default (token_mean for dapo and cispo,
      seq_mean_token_mean for grpo and gspo).
    max_len: the Dr.GRPO normaliser of seq_mean_token_sum_norm; None = the T of the batch.
    kl_coef: beta of the KL-to-reference penalty (0 = none; logp_ref_BT is then only logged).
    kl_estimator: "k1" | "k2" | "k3".
  Defaults left as None are resolved in __post_init__, so equal configs compare and hash equal.
  """

  loss: str = "grpo"
  clip_eps_low: float = 0.2
  clip_eps_high: float | None = None
  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4
  cispo_eps_max: float = 4.0
  aggregation: str | None = None
  max_len: int | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"

  def __post_init__(self):
    if self.loss not in LOSSES:
      raise ValueError(f"Unknown loss {self.loss!r}; use one of {LOSSES}.")
    if self.clip_eps_high is None:
      object.__setattr__(self, "clip_eps_high", _DEFAULT_CLIP_EPS_HIGH[self.loss])
    if self.aggregation is None:
      object.__setattr__(self, "aggregation", _DEFAULT_AGGREGATION[self.loss])
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"Unknown aggregation {self.aggregation!r}; use one of {AGGREGATIONS}.")
    for name in ("clip_eps_low", "gspo_eps_low"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"{name} must be in [0, 1) so the lower clip bound stays positive, "
                         f"got {getattr(self, name)}.")
    for name in ("clip_eps_high", "gspo_eps_high"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
    if not self.cispo_eps_max > 0:
      raise ValueError(f"cispo_eps_max must be > 0, got {self.cispo_eps_max}.")
    if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len <= 0):
      raise ValueError(f"max_len must be a positive int or None (= T), got {self.max_len!r}.")
    if not self.kl_coef >= 0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}.")
    validate_kl_estimator(self.kl_estimator)


def _seq_valid(mask_BT: jax.Array) -> jax.Array:
  """[B] float32: 1 for a sequence with at least one counted token."""
  return jnp.any(mask_BT != 0, axis=1).astype(jnp.float32)


def aggregate(x_BT: jax.Array, mask_BT: jax.Array, aggregation: str,
              max_len: int | None = None) -> jax.Array:
  """Reduce a per-token loss [B, T] to a scalar (see the module docstring; 0 for an empty mask)."""
  if aggregation == "token_mean":
    return masked_mean(x_BT, mask_BT)
  seq_valid_B = _seq_valid(mask_BT)
  if aggregation == "seq_mean_token_mean":
    per_seq_B = masked_mean(x_BT, mask_BT, axis=1)
  elif aggregation == "seq_mean_token_sum_norm":
    per_seq_B = masked_sum(x_BT, mask_BT, axis=1) / float(max_len or x_BT.shape[1])
  else:
    raise ValueError(f"Unknown aggregation {aggregation!r}; use one of {AGGREGATIONS}.")
  return masked_mean(per_seq_B, seq_valid_B)


def aggregation_denominator(mask_BT: jax.Array, aggregation: str) -> jax.Array:
  """What `aggregate` divides by: the token count (token_mean) or the number of sequences with a
  counted token (the seq_mean modes). Splitting a batch into parts k, aggregate(whole) =
  sum_k aggregate(part_k) * den_k / den (gradient accumulation over micro-batches)."""
  if aggregation == "token_mean":
    return masked_count(mask_BT)
  return jnp.sum(_seq_valid(mask_BT))


def _ppo_clip(ratio_BT, adv_BT, eps_low, eps_high):
  """Per-token PPO-clip loss and where the clip is active (the token then has zero gradient)."""
  unclipped_BT = ratio_BT * adv_BT
  clipped_BT = jnp.clip(ratio_BT, 1.0 - eps_low, 1.0 + eps_high) * adv_BT
  return -jnp.minimum(unclipped_BT, clipped_BT), clipped_BT < unclipped_BT


def policy_loss(logp_BT: jax.Array, logp_old_BT: jax.Array, adv_B: jax.Array, mask_BT: jax.Array,
                cfg: LossConfig, logp_ref_BT: jax.Array | None = None,
                is_weights_BT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Scalar policy loss (to minimise) and metrics; differentiable in `logp_BT` only.

  Metrics (detached float32 scalars, token means over the mask):
    pg_loss: the aggregated policy-gradient term (the loss without the KL penalty),
    clip_frac: tokens whose clip is active (PPO/GSPO: zero-gradient tokens; CISPO: rho > eps_max),
    ratio_mean: mean of the ratio the loss uses (rho_t; s_i for GSPO),
    kl_ref: mean per-token KL estimate to the reference (only when logp_ref_BT is given).
  """
  shape = logp_BT.shape
  if len(shape) != 2 or logp_old_BT.shape != shape or mask_BT.shape != shape:
    raise ValueError(f"logp_BT, logp_old_BT and mask_BT must share one [B, T] shape; got "
                     f"{logp_BT.shape}, {logp_old_BT.shape}, {mask_BT.shape}.")
  if adv_B.shape != shape[:1]:
    raise ValueError(f"adv_B must have shape {shape[:1]}, got {adv_B.shape}.")
  for name, arr in (("logp_ref_BT", logp_ref_BT), ("is_weights_BT", is_weights_BT)):
    if arr is not None and arr.shape != shape:
      raise ValueError(f"{name} must have shape {shape}, got {arr.shape}.")
  if cfg.kl_coef > 0 and logp_ref_BT is None:
    raise ValueError(f"kl_coef={cfg.kl_coef} needs logp_ref_BT; pass it or set kl_coef=0.")

  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  valid_BT = mask_BT != 0
  # Padding logprobs may be garbage: select them away before exp() so neither value nor grad is NaN.
  logp_BT = jnp.where(valid_BT, jnp.asarray(logp_BT, jnp.float32), 0.0)
  logp_old_BT = jax.lax.stop_gradient(jnp.where(valid_BT, logp_old_BT, 0.0))
  adv_BT = jax.lax.stop_gradient(jnp.asarray(adv_B, jnp.float32))[:, None]
  log_ratio_BT = logp_BT - logp_old_BT

  if cfg.loss in ("grpo", "dapo"):
    ratio_BT = jnp.exp(log_ratio_BT)
    pg_BT, clip_BT = _ppo_clip(ratio_BT, adv_BT, cfg.clip_eps_low, cfg.clip_eps_high)
  elif cfg.loss == "gspo":
    log_s_B = masked_mean(log_ratio_BT, mask_BT, axis=1)
    # GSPO-token: value s_i, gradient s_i * d logp_t.
    log_s_BT = (jax.lax.stop_gradient(log_s_B)[:, None] + log_ratio_BT
                - jax.lax.stop_gradient(log_ratio_BT))
    ratio_BT = jnp.exp(log_s_BT)
    pg_BT, clip_BT = _ppo_clip(ratio_BT, adv_BT, cfg.gspo_eps_low, cfg.gspo_eps_high)
  else:
    ratio_BT = jnp.exp(log_ratio_BT)
    coef_BT = jax.lax.stop_gradient(jnp.minimum(ratio_BT, cfg.cispo_eps_max))
    pg_BT = -coef_BT * adv_BT * logp_BT
    clip_BT = ratio_BT > cfg.cispo_eps_max

  if is_weights_BT is not None:
    pg_BT = pg_BT * jax.lax.stop_gradient(jnp.asarray(is_weights_BT, jnp.float32))
  pg_loss = aggregate(pg_BT, mask_BT, cfg.aggregation, cfg.max_len)
  loss = pg_loss

  metrics = {
      "pg_loss": pg_loss,
      "clip_frac": masked_mean(clip_BT.astype(jnp.float32), mask_BT),
      "ratio_mean": masked_mean(ratio_BT, mask_BT),
  }
  if logp_ref_BT is not None:
    logp_ref_BT = jax.lax.stop_gradient(jnp.where(valid_BT, logp_ref_BT, 0.0))
    kl_BT = kl_estimate(logp_BT, logp_ref_BT, cfg.kl_estimator)
    if cfg.kl_coef > 0:
      loss = loss + cfg.kl_coef * aggregate(kl_BT, mask_BT, cfg.aggregation, cfg.max_len)
    metrics["kl_ref"] = masked_mean(kl_BT, mask_BT)
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
