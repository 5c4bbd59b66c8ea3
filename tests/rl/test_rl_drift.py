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
  sampler, stale, now, mask = _logps(0)
  m = drift_metrics(sampler, stale, now, mask)
  pairs = {"quantization": (sampler, stale), "staleness": (stale, now), "total": (sampler, now)}
  for part, (a, b) in pairs.items():
    ref = mismatch_metrics(a, b, mask)
    for k in ("mismatch_kl", "mismatch_kl_k3", "abs_dlogp_max", "ess"):
      assert float(m[f"drift/{part}/{k}"]) == float(ref[k])


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
