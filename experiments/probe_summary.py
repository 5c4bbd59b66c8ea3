"""pass@1 of a task probe's sampled rewards over keys, prompts and samples (experiments/probe_task.py;
a module without flags, so tests import it beside other binaries)."""
from __future__ import annotations

from typing import Any

import numpy as np

from lowrl.analysis import stats


def summary(rewards_KPN: np.ndarray) -> dict[str, Any]:
  """pass@1 of rewards [keys, prompts, samples] (1 = solved): the mean; its t interval over the
  prompts (each prompt's solved fraction over all keys' samples is one unit, as the trainer's
  `solved_ci`); each key's pass@1; and their sd over keys (NaN for one key)."""
  r = np.asarray(rewards_KPN, np.float64) >= 1.0
  if r.ndim != 3 or 0 in r.shape:
    raise ValueError(f"rewards must be [keys, prompts, samples] with none empty, got {r.shape}.")
  per_key = r.mean(axis=(1, 2))
  t = stats.paired_t(r.mean(axis=(0, 2)))
  return {"pass_at_1": float(r.mean()), "ci_low": t.ci_low, "ci_high": t.ci_high,
          "per_key": per_key.tolist(),
          "key_sd": float(per_key.std(ddof=1)) if per_key.size > 1 else float("nan")}
