"""Policy-gradient pieces: advantages, losses, KL estimators, mismatch corrections and metrics."""
from lowrl.rl.advantages import (ADVANTAGE_MODES, compute_advantages, group_has_signal,
                                 overlong_penalty)
from lowrl.rl.corrections import CorrectionConfig, correction_weights
from lowrl.rl.kl import KL_ESTIMATORS, k3_from_log_ratio, kl_estimate
from lowrl.rl.losses import AGGREGATIONS, LOSSES, LossConfig, aggregate, policy_loss
from lowrl.rl.masked import masked_count, masked_max, masked_mean, masked_sum, safe_divide
from lowrl.rl.mismatch import mismatch_metrics

__all__ = [
    "ADVANTAGE_MODES", "AGGREGATIONS", "KL_ESTIMATORS", "LOSSES", "CorrectionConfig", "LossConfig",
    "aggregate", "compute_advantages", "correction_weights", "group_has_signal", "k3_from_log_ratio",
    "kl_estimate", "masked_count", "masked_max", "masked_mean", "masked_sum", "mismatch_metrics",
    "overlong_penalty", "policy_loss", "safe_divide",
]
