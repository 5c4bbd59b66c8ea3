"""The sampler -> trainer drift decomposition (lowrl.rl.drift)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.drift import DRIFT_PARTS, drift_metrics, sampler_trainer_drift
from lowrl.rl.mismatch import mismatch_metrics


def _logps(seed: int, shape=(6, 9)):
  rng = np.random.default_rng(seed)
  now = -rng.gamma(2.0, 0.7, shape)
  stale = now + rng.normal(-0.3, 0.5, shape)
  sampler = stale + rng.normal(0.2, 0.3, shape)
  mask = (rng.random(shape) < 0.7).astype(np.float32)
  mask[0] = 0.0  # an empty row
  # Garbage off the mask must not leak into any part.
  sampler = np.where(mask > 0, sampler, 1e6)
  return [jnp.asarray(x, jnp.float32) for x in (sampler, stale, now, mask)]


@pytest.mark.parametrize("seed", range(5))
def test_k1_parts_add_up_to_the_total(seed):
  sampler, stale, now, mask = _logps(seed)
  m = drift_metrics(sampler, stale, now, mask)
  q, s, t = (float(m[f"drift/{p}/mismatch_kl"]) for p in DRIFT_PARTS)
  assert abs(q) > 1e-3 and abs(s) > 1e-3  # both parts present
  assert q + s == pytest.approx(t, abs=1e-6)
  assert np.isfinite([float(v) for v in m.values()]).all()


def test_parts_are_mismatch_metrics_of_the_right_pairs():
  """Three scores (the ordered split): quantization = (sampler, stale) on the sampler's tokens;
  staleness = (stale, now) under the stale policy, i.e. weighted by pi_stale / pi_sampler."""
  sampler, stale, now, mask = _logps(0)
  m = drift_metrics(sampler, stale, now, mask)
  pairs = {"quantization": (sampler, stale, None), "staleness": (stale, now, stale - sampler),
           "total": (sampler, now, None)}
  for part, (a, b, log_w) in pairs.items():
    ref = mismatch_metrics(a, b, mask, log_w)
    for k in ("mismatch_kl_k3", "abs_dlogp_max", "ess"):
      assert float(m[f"drift/{part}/{k}"]) == float(ref[k])
    assert float(m[f"drift/{part}/mismatch_kl"]) == float(mismatch_metrics(a, b, mask)
                                                          ["mismatch_kl"])


@pytest.mark.parametrize("seed", range(3))
def test_symmetric_parts_add_up_and_do_not_depend_on_the_order(seed):
  sampler, stale, now, mask = _logps(seed)
  now_sampler = now + (sampler - stale) * 0.8 + 0.05  # the current weights in sampler precision
  m = drift_metrics(sampler, stale, now, mask, now_sampler)
  q, s, t = (float(m[f"drift/{p}/mismatch_kl"]) for p in DRIFT_PARTS)
  assert abs(q) > 1e-3 and abs(s) > 1e-3
  assert q + s == pytest.approx(t, abs=1e-6)
  # The Shapley split, from its definition (per token: the average of both orders).
  keep = np.asarray(mask) > 0
  d, c, a, b = (np.asarray(x, np.float64)[keep] for x in (sampler, stale, now, now_sampler))
  assert q == pytest.approx(np.mean(((d - c) + (b - a)) / 2), abs=1e-6)
  assert s == pytest.approx(np.mean(((d - b) + (c - a)) / 2), abs=1e-6)
  # Taking staleness first instead of quantization exchanges the two middle scores: the parts
  # swap, nothing else changes.
  swapped = drift_metrics(sampler, now_sampler, now, mask, stale)
  for k in ("mismatch_kl", "mismatch_kl_k3", "abs_dlogp_max", "ess", "is_weight_mean"):
    assert float(swapped[f"drift/quantization/{k}"]) == pytest.approx(
        float(m[f"drift/staleness/{k}"]), rel=1e-6, abs=1e-7)
  assert np.isfinite([float(v) for v in m.values()]).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_tokens_outside_a_support_leave_every_part(symmetric):
  # Top-k / top-p: a token the sampler drew can be outside another score's support (-inf or the
  # trainer's -1e30 clamp). Every part drops it, so they still add up and stay finite.
  sampler, stale, now, mask = _logps(1)
  now_sampler = now + 0.1 if symmetric else None
  outside = np.zeros(mask.shape, bool)
  outside[1, :2] = outside[3, 4] = outside[4, 7] = True
  row = np.arange(mask.shape[0])[:, None]
  stale_o = jnp.where(outside & (row == 1), -jnp.inf, stale)  # the stale trainer's top-k
  now_o = jnp.where(outside & (row == 3), -1e30, now)  # the current trainer's (clamped)
  sampler_o = jnp.where(outside & (row == 4), -jnp.inf, sampler)
  m = drift_metrics(sampler_o, stale_o, now_o, mask, now_sampler)
  kept = drift_metrics(sampler, stale, now, jnp.where(jnp.asarray(outside), 0.0, mask),
                       now_sampler)
  assert np.isfinite([float(v) for v in m.values()]).all()
  n_out = (outside & (np.asarray(mask) > 0)).sum()
  assert n_out >= 2
  assert float(m["drift/outside_support_frac"]) == pytest.approx(n_out / np.asarray(mask).sum())
  assert float(kept["drift/outside_support_frac"]) == 0.0
  for k in kept:
    if k != "drift/outside_support_frac":
      assert float(m[k]) == float(kept[k]), k
  q, s, t = (float(m[f"drift/{p}/mismatch_kl"]) for p in DRIFT_PARTS)
  assert q + s == pytest.approx(t, abs=1e-6)


def test_part_k3_and_ess_are_under_the_distribution_they_refer_to():
  """Four categorical distributions over 4 tokens; 400k tokens drawn from the sampler d. Each part's
  k3 must estimate the exact KLs of its pairs under their first distribution, ESS the exact
  E_x[w]^2 / E_x[w^2]. Tolerance: 6 standard errors of the self-normalised importance-sampling
  estimate, sqrt(E_d[v^2 (f - mu)^2] / n) with v = p_x / p_d (delta method), summed over the pair
  and halved; the ESS error through its first-order propagation from E_x[w^2]."""
  probs = {"d": [0.4, 0.3, 0.2, 0.1], "c": [0.3, 0.3, 0.25, 0.15], "a": [0.2, 0.25, 0.3, 0.25],
           "b": [0.35, 0.2, 0.25, 0.2]}
  p = {k: np.array(v) for k, v in probs.items()}
  n = 400_000
  tok = np.random.default_rng(0).choice(4, size=n, p=p["d"])
  logp = {k: jnp.asarray(np.log(v)[tok][None], jnp.float32) for k, v in p.items()}
  mask = jnp.ones((1, n), jnp.float32)
  m = drift_metrics(logp["d"], logp["c"], logp["a"], mask, logp["b"])

  def exact(x, y):
    w = p[y] / p[x]
    k3 = np.sum(p[x] * (w - 1 - np.log(w)))
    m2 = np.sum(p[x] * w ** 2)
    v = p[x] / p["d"]
    se_k3 = np.sqrt(np.sum(p["d"] * v ** 2 * (w - 1 - np.log(w) - k3) ** 2) / n)
    se_m2 = np.sqrt(np.sum(p["d"] * v ** 2 * (w ** 2 - m2) ** 2) / n)
    return k3, 1 / m2, se_k3, se_m2 / m2 ** 2

  parts = {"quantization": [("d", "c"), ("b", "a")], "staleness": [("d", "b"), ("c", "a")],
           "total": [("d", "a")]}
  for part, pairs in parts.items():
    vals = [exact(x, y) for x, y in pairs]
    k3, ess = (np.mean([v[i] for v in vals]) for i in (0, 1))
    tol_k3, tol_ess = (6 * np.sum([v[i] for v in vals]) / len(vals) for i in (2, 3))
    assert float(m[f"drift/{part}/mismatch_kl_k3"]) == pytest.approx(k3, abs=tol_k3), part
    assert float(m[f"drift/{part}/ess"]) == pytest.approx(ess, abs=tol_ess), part
    # E_x[p_y / p_x] = 1 for every pair under its own distribution.
    assert float(m[f"drift/{part}/is_weight_mean"]) == pytest.approx(1.0, abs=0.02), part
  # Unweighted, the (c, a) pair would be off: the bias the weights remove is larger than the
  # tolerance here, so the test can fail.
  naive = float(mismatch_metrics(logp["c"], logp["a"], mask)["mismatch_kl_k3"])
  assert abs(naive - exact("c", "a")[0]) > 10 * exact("c", "a")[2]


def test_k3_and_max_are_not_additive_but_bounded():
  """k3 >= 0 per part; max |dlogp| obeys the triangle inequality."""
  for seed in range(5):
    sampler, stale, now, mask = _logps(seed)
    m = drift_metrics(sampler, stale, now, mask)
    assert all(float(m[f"drift/{p}/mismatch_kl_k3"]) >= 0 for p in DRIFT_PARTS)
    assert float(m["drift/total/abs_dlogp_max"]) <= (float(m["drift/quantization/abs_dlogp_max"])
                                                     + float(m["drift/staleness/abs_dlogp_max"])
                                                     + 1e-6)


def test_no_drift_when_sampler_and_trainer_agree():
  _, _, now, mask = _logps(1)
  m = drift_metrics(now, now, now, mask)
  for p in DRIFT_PARTS:
    assert float(m[f"drift/{p}/mismatch_kl"]) == 0.0
    assert float(m[f"drift/{p}/abs_dlogp_max"]) == 0.0
    assert float(m[f"drift/{p}/ess"]) == 1.0


def test_sampler_trainer_drift_scores_stale_and_current_params():
  """A fake trainer whose logprob is params * token: stale vs current params give the parts."""
  tokens = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 10
  mask = jnp.ones((3, 4))
  keys = []

  def logprob_fn(params, batch, key):
    keys.append(key)
    return -params * batch["tokens_BT"], jnp.zeros_like(batch["tokens_BT"])

  logp_sampler = -1.1 * tokens
  m = sampler_trainer_drift(logprob_fn, 1.0, 1.5, {"tokens_BT": tokens}, logp_sampler, mask,
                            jax.random.key(3))
  ref = drift_metrics(logp_sampler, -1.0 * tokens, -1.5 * tokens, mask)
  assert m.keys() == ref.keys()
  for k in m:
    assert float(m[k]) == float(ref[k])
  assert float(m["drift/staleness/mismatch_kl"]) == pytest.approx(0.5 * float(jnp.mean(tokens)))
  assert len(keys) == 2 and keys[0] is keys[1]  # one quantization key for both scores
