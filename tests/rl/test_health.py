"""Run-health metrics (lowrl.rl.health) against hand-computed values and a NumPy reference."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.health import health_metrics

# Row 0: d = logp_s - logp_t = 0.1, -0.8, 0.7 on the mask, then 2.0 off it. Row 1: a token the
# sampler gives probability 0 (-inf, top-k), d = 0.5, garbage (NaN) on padding, d = 0.
LN2 = math.log(2.0)
LOGP_S = np.array([[-1.0, -2.0, -0.5, -0.1], [-np.inf, -1.0, np.nan, -3.0]], np.float32)
LOGP_T = np.array([[-1.1, -1.2, -1.2, -2.1], [-0.5, -1.5, 0.0, -3.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 1]], np.float32)
REWARDS = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0], np.float32)  # 3 groups of 4


@pytest.mark.parametrize("jit", [False, True])
def test_hand_computed_case(jit):
  fn = lambda *a: health_metrics(*a, group_size=4)  # noqa: E731
  m = (jax.jit(fn) if jit else fn)(LOGP_S, LOGP_T, MASK, REWARDS)
  # Counted tokens: row 0 columns 0-2, row 1 columns 1 and 3 (column 0 is outside the support).
  # d = 0.1, -0.8, 0.7, 0.5, 0: two of five beyond ln 2 = 0.693.
  assert float(m["dlogp_gt_ln2_frac"]) == pytest.approx(2 / 5)
  # chi^2 = mean(w^2) - 1, w = exp(-d): (e^-0.2 + e^1.6 + e^-1.4 + e^-1 + 1) / 5 - 1
  # = (0.818731 + 4.953032 + 0.246597 + 0.367879 + 1) / 5 - 1 = 0.477248.
  assert float(m["is_chi2"]) == pytest.approx(0.477248, abs=2e-6)
  # Groups [1,1,1,1] and [0,0,0,0] have zero spread, [0,1,0,0] does not.
  assert float(m["zero_spread_group_frac"]) == pytest.approx(2 / 3)
  assert all(np.isfinite(float(v)) for v in m.values())


def test_against_numpy_on_random_tokens():
  rng = np.random.default_rng(0)
  s = rng.normal(-2, 1, (6, 20)).astype(np.float32)
  t = (s + rng.normal(0, 0.6, s.shape)).astype(np.float32)
  mask = (rng.random(s.shape) < 0.7).astype(np.float32)
  rewards = rng.integers(0, 2, 6).astype(np.float32)
  m = health_metrics(s, t, mask, rewards, group_size=3)
  on = mask > 0
  d = (s.astype(np.float64) - t)[on]
  assert float(m["dlogp_gt_ln2_frac"]) == pytest.approx(np.mean(np.abs(d) > LN2))
  assert float(m["is_chi2"]) == pytest.approx(np.mean(np.exp(-2 * d)) - 1, rel=1e-5)
  groups = rewards.reshape(2, 3)
  assert float(m["zero_spread_group_frac"]) == np.mean(groups.max(1) == groups.min(1))


def test_empty_mask_and_identical_policies():
  zeros = jnp.zeros((2, 3))
  m = health_metrics(zeros, zeros, zeros, jnp.arange(4.0), group_size=2)
  assert {k: float(v) for k, v in m.items()} == {
      "dlogp_gt_ln2_frac": 0.0, "is_chi2": 0.0, "zero_spread_group_frac": 0.0}
  logp = jnp.log(jnp.full((2, 3), 0.3))
  m = health_metrics(logp, logp, jnp.ones((2, 3)), jnp.ones(4), group_size=2)
  assert float(m["is_chi2"]) == 0.0 and float(m["dlogp_gt_ln2_frac"]) == 0.0
  assert float(m["zero_spread_group_frac"]) == 1.0
  with pytest.raises(ValueError, match="Shape mismatch"):
    health_metrics(zeros, zeros[:, :2], zeros, jnp.ones(4), group_size=2)
