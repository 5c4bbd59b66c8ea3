"""Sampler/trainer mismatch corrections: truncated (TIS), masked (MIS, IcePop) importance sampling
and VCPO's ESS-scaled step.

w_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(logp_trainer - logp_sampler), with logp_trainer the
trainer's recompute of pi_old and logp_sampler what the sampler recorded (docs/reference.md §3).

  tis: weight = min(w, tis_cap)                                    (verl default cap 2)
  mis: weight = w if mis_low <= w <= mis_high else 0                (IcePop, MIS; bounds inclusive)
       or 1 / 0 (pure mask, no reweighting) with mis_reweight=False
  icepop: IcePop (Ring-1T, "Every Step Evolves...", inclusionAI 2025; ringtech.notion.site):
       the token-level two-sided mask M(w) = w if alpha <= w <= beta else 0, alpha = mis_low,
       beta = mis_high (the paper's [0.5, 5]); = mis at token level with reweighting, so it
       takes no other level.
  vcpo: VCPO's step control (arXiv 2602.17616, "Stable Asynchrony"; mit-han-lab/vcpo README): the
       weights are TIS's, and the optimizer step (the learning rate) is scaled by
       sqrt(ESS / N), ESS = (sum w)^2 / sum w^2 over the N entries (tokens or sequences, at
       `level`) of the untruncated weights: Adam's square-root batch-size rule with the effective
       batch ESS. The paper's second part (its closed-form off-policy baseline) is not here.
Sequence level uses w_seq = exp(sum_t masked log w_t) for every token of the sequence.
Everything is computed in log space, so a long sequence's w_seq can't overflow to Inf.
Weights are stop_gradient'ed and zero off the mask; multiply them into the per-token loss.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lowrl.rl.masked import masked_mean

CORRECTION_MODES = ("none", "tis", "mis", "icepop", "vcpo")
CORRECTION_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  """Which correction, at which granularity, with which bounds (hashable: a static jit argument)."""

  mode: str = "none"
  level: str = "token"
  tis_cap: float = 2.0
  mis_low: float = 0.5
  mis_high: float = 5.0
  mis_reweight: bool = True

  def __post_init__(self):
    if self.mode not in CORRECTION_MODES:
      raise ValueError(f"Unknown correction mode {self.mode!r}; use one of {CORRECTION_MODES}.")
    if self.level not in CORRECTION_LEVELS:
      raise ValueError(f"Unknown correction level {self.level!r}; use one of {CORRECTION_LEVELS}.")
    if not self.tis_cap > 0:
      raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}.")
    if not 0 <= self.mis_low < self.mis_high:
      raise ValueError(f"Need 0 <= mis_low < mis_high, got [{self.mis_low}, {self.mis_high}].")
    if self.mode == "icepop" and (self.level != "token" or not self.mis_reweight):
      raise ValueError("IcePop masks tokens and keeps their weight: use rl.correction_level=token "
                       "(or rl.correction=mis for a sequence-level or pure mask).")

  @property
  def scales_step(self) -> bool:
    """Whether the update scales its optimizer step (by `metrics["is_step_scale"]`)."""
    return self.mode == "vcpo"


def _log_weights(logp_trainer_BT, logp_sampler_BT, mask_BT, level):
  """log w per token ([B, T]) and which entries to count for the metrics ([B, T] or [B])."""
  valid_BT = mask_BT != 0
  log_w_BT = jnp.where(valid_BT, logp_trainer_BT - logp_sampler_BT, 0.0)
  if level == "token":
    return log_w_BT, mask_BT
  log_w_B = jnp.sum(log_w_BT, axis=1)
  seq_valid_B = jnp.any(valid_BT, axis=1).astype(jnp.float32)
  return jnp.broadcast_to(log_w_B[:, None], log_w_BT.shape), seq_valid_B


def correction_weights(logp_trainer_BT: jax.Array, logp_sampler_BT: jax.Array, mask_BT: jax.Array,
                       cfg: CorrectionConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Detached per-token correction weights [B, T] and metrics.

  Metrics (float32 scalars; fractions over masked tokens at token level, over non-empty sequences
  at sequence level; 0 for an empty mask):
    is_truncated_frac: entries with w > tis_cap (modes "tis", "vcpo", else 0),
    is_masked_frac: entries with w outside [mis_low, mis_high] (modes "mis", "icepop", else 0),
    is_weight_mean: masked token mean of the returned weights (1 for an empty mask),
  and for mode "vcpo" only (other modes' metrics stay as they were):
    is_ess: ESS / N of the untruncated weights over the counted entries (1 for an empty mask),
    is_step_scale: sqrt(is_ess), the factor the update scales its optimizer step by.
  """
  if logp_trainer_BT.shape != logp_sampler_BT.shape or logp_trainer_BT.shape != mask_BT.shape:
    raise ValueError(f"Shape mismatch: trainer {logp_trainer_BT.shape}, sampler "
                     f"{logp_sampler_BT.shape}, mask {mask_BT.shape}.")
  logp_trainer_BT = jax.lax.stop_gradient(jnp.asarray(logp_trainer_BT, jnp.float32))
  logp_sampler_BT = jax.lax.stop_gradient(jnp.asarray(logp_sampler_BT, jnp.float32))
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  log_w_BT, count_mask = _log_weights(logp_trainer_BT, logp_sampler_BT, mask_BT, cfg.level)
  # Per-level view of log w for the fractions: [B, T] at token level, [B] at sequence level.
  log_w_lvl = log_w_BT if cfg.level == "token" else log_w_BT[:, 0]

  truncated_frac = masked_mean(jnp.zeros_like(log_w_lvl), count_mask)
  masked_frac = truncated_frac
  if cfg.mode == "none":
    weights_BT = jnp.ones_like(log_w_BT)
  elif cfg.mode in ("tis", "vcpo"):
    log_cap = math.log(cfg.tis_cap)
    weights_BT = jnp.exp(jnp.minimum(log_w_BT, log_cap))
    truncated_frac = masked_mean((log_w_lvl > log_cap).astype(jnp.float32), count_mask)
  else:
    log_low = math.log(cfg.mis_low) if cfg.mis_low > 0 else -math.inf
    log_high = math.log(cfg.mis_high)
    keep_BT = (log_w_BT >= log_low) & (log_w_BT <= log_high)
    # Clamp before exp: rejected entries may be huge, and exp(huge) * 0 would be NaN.
    kept_w_BT = jnp.exp(jnp.clip(log_w_BT, log_low, log_high)) if cfg.mis_reweight else 1.0
    weights_BT = jnp.where(keep_BT, kept_w_BT, 0.0)
    keep_lvl = keep_BT if cfg.level == "token" else keep_BT[:, 0]
    masked_frac = masked_mean((~keep_lvl).astype(jnp.float32), count_mask)

  weights_BT = jax.lax.stop_gradient(jnp.where(mask_BT != 0, weights_BT, 0.0))
  metrics = {
      "is_truncated_frac": truncated_frac,
      "is_masked_frac": masked_frac,
      "is_weight_mean": masked_mean(weights_BT, mask_BT, empty=1.0),
  }
  if cfg.scales_step:
    ess = normalized_ess(log_w_lvl, count_mask)
    metrics.update(is_ess=ess, is_step_scale=jnp.sqrt(ess))
  return weights_BT, metrics


def normalized_ess(log_w: jax.Array, count_mask: jax.Array) -> jax.Array:
  """ESS / N = (sum w)^2 / (N sum w^2) over the entries with count_mask != 0, from log w.

  In (0, 1]; 1 iff the counted weights are all equal (on-policy); 1 for no counted entry. Log
  space (logsumexp), so weights far beyond the FP32 range do not overflow.
  """
  valid = count_mask != 0
  n = jnp.sum(valid.astype(jnp.float32))
  lw = jnp.where(valid, jnp.asarray(log_w, jnp.float32), -jnp.inf)
  log_ess = (2.0 * jax.nn.logsumexp(lw) - jax.nn.logsumexp(2.0 * lw)
             - jnp.log(jnp.maximum(n, 1.0)))
  return jnp.where(n > 0, jnp.minimum(jnp.exp(log_ess), 1.0), 1.0)
