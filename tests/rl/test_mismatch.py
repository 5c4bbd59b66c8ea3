"""Sampler/trainer mismatch metrics against NumPy, plus the identical-policy and empty-mask cases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.mismatch import mismatch_metrics

KEYS = {"mismatch_kl", "mismatch_kl_k3", "abs_dlogp_mean", "abs_dlogp_max", "is_weight_mean",
        "is_weight_std", "ess", "outside_support_frac"}


def _np_metrics(logp_s, logp_t, mask):
  # A probability-0 token (top-k / top-p: -inf, or the trainer's -1e30 clamp) is counted apart.
  outside = (logp_s < -1e29) | (logp_t < -1e29)
  m = (mask > 0) & ~outside
  d = (logp_s - logp_t).astype(np.float64)[m]
  w = np.exp(-d)
  return {
      "outside_support_frac": (outside & (mask > 0)).sum() / (mask > 0).sum(),
      "mismatch_kl": d.mean(),
      "mismatch_kl_k3": (w - np.log(w) - 1).mean(),
      "abs_dlogp_mean": np.abs(d).mean(),
      "abs_dlogp_max": np.abs(d).max(),
      "is_weight_mean": w.mean(),
      "is_weight_std": w.std(),
      "ess": w.sum() ** 2 / (len(w) * (w**2).sum()),
  }


@pytest.fixture
def data():
  rng = np.random.default_rng(0)
  logp_t = -rng.uniform(0.1, 4.0, size=(5, 8)).astype(np.float32)
  logp_s = (logp_t + rng.normal(0, 0.3, size=(5, 8))).astype(np.float32)
  mask = (rng.random((5, 8)) < 0.7).astype(np.float32)
  logp_s[mask == 0] = 50.0  # garbage on padding must not matter
  return logp_s, logp_t, mask


def test_matches_numpy(data):
  out = mismatch_metrics(*map(jnp.asarray, data))
  assert set(out) == KEYS
  ref = _np_metrics(*data)
  for k in KEYS:
    assert out[k].dtype == jnp.float32 and out[k].shape == ()
    np.testing.assert_allclose(out[k], ref[k], rtol=1e-5, err_msg=k)
  assert 0.0 < float(out["ess"]) < 1.0


def test_identical_policies(data):
  logp_s, _, mask = data
  out = mismatch_metrics(jnp.asarray(logp_s), jnp.asarray(logp_s), jnp.asarray(mask))
  expected = dict(mismatch_kl=0.0, mismatch_kl_k3=0.0, abs_dlogp_mean=0.0, abs_dlogp_max=0.0,
                  is_weight_mean=1.0, is_weight_std=0.0, ess=1.0)
  for k, v in expected.items():
    np.testing.assert_allclose(out[k], v, atol=1e-7, err_msg=k)


def test_all_zero_mask(data):
  logp_s, logp_t, _ = data
  out = mismatch_metrics(jnp.asarray(logp_s), jnp.asarray(logp_t), jnp.zeros(logp_s.shape))
  expected = dict(mismatch_kl=0.0, mismatch_kl_k3=0.0, abs_dlogp_mean=0.0, abs_dlogp_max=0.0,
                  is_weight_mean=1.0, is_weight_std=0.0, ess=1.0, outside_support_frac=0.0)
  assert {k: float(v) for k, v in out.items()} == expected


def test_tokens_outside_either_support_are_counted_apart(data):
  # Top-k sampling: the trainer can rank a sampled token outside its top-k (-inf from the
  # sampler's scoring, -1e30 from the trainer's clamp). Its KL is infinite; the metrics are over
  # the other tokens and the share left out is reported.
  logp_s, logp_t, mask = (x.copy() for x in data)
  logp_t[0, :3] = -np.inf
  logp_t[1, 2:4] = -1e30
  logp_s[2, 5] = -np.inf
  outside = np.zeros(mask.shape, bool)
  outside[0, :3] = outside[1, 2:4] = outside[2, 5] = True
  assert (outside & (mask > 0)).sum() >= 3
  out = mismatch_metrics(*map(jnp.asarray, (logp_s, logp_t, mask)))
  ref = _np_metrics(logp_s, logp_t, mask)
  assert 0 < ref["outside_support_frac"] < 1
  for k in KEYS:
    np.testing.assert_allclose(out[k], ref[k], rtol=1e-5, err_msg=k)
  # The same numbers as the mask without those tokens.
  kept = mismatch_metrics(*map(jnp.asarray, (data[0], data[1], np.where(outside, 0.0, mask))))
  for k in KEYS - {"outside_support_frac"}:
    assert float(out[k]) == float(kept[k]), k


def test_ess_stable_for_extreme_weights():
  # Log-weights of 100 and 0: w^2 overflows float32, but ESS is scale-invariant.
  logp_t = jnp.array([[100.0, 0.0, 0.0, 0.0]])
  out = mismatch_metrics(jnp.zeros((1, 4)), logp_t, jnp.ones((1, 4)))
  np.testing.assert_allclose(out["ess"], 0.25, rtol=1e-6)


def test_k3_mismatch_is_nonnegative_and_k1_estimates_kl():
  # Exact expectation over a small vocabulary: tokens weighted by the sampler's probability.
  rng = np.random.default_rng(2)
  a, b = rng.normal(size=(2, 16))
  logp_s = a - np.log(np.exp(a).sum())
  logp_t = b - np.log(np.exp(b).sum())
  p_s = np.exp(logp_s)
  out = mismatch_metrics(jnp.asarray(logp_s[None], jnp.float32), jnp.asarray(logp_t[None], jnp.float32),
                         jnp.asarray(p_s[None], jnp.float32))  # mask = sampling probability weights
  kl = (p_s * (logp_s - logp_t)).sum()
  np.testing.assert_allclose(out["mismatch_kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(out["mismatch_kl_k3"], kl, rtol=1e-5)  # k3 is unbiased too


def test_jit_and_no_gradient(data):
  args = tuple(map(jnp.asarray, data))
  out = jax.jit(mismatch_metrics)(*args)
  np.testing.assert_allclose(out["ess"], mismatch_metrics(*args)["ess"], rtol=1e-6)
  g = jax.grad(lambda t: mismatch_metrics(args[0], t, args[2])["mismatch_kl"])(args[1])
  np.testing.assert_array_equal(g, 0.0)


def test_shape_mismatch(data):
  logp_s, logp_t, mask = data
  with pytest.raises(ValueError, match="Shape mismatch"):
    mismatch_metrics(jnp.asarray(logp_s), jnp.asarray(logp_t[:, :-1]), jnp.asarray(mask))
