"""k1/k2/k3 KL estimators: hand values, exact expectations and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.kl import kl_estimate


def test_hand_values():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -2.0]])  # r = [-0.5, 0]
  np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), [[0.5, 0.0]], atol=1e-7)
  np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), [[0.125, 0.0]], atol=1e-7)
  np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), [[np.exp(-0.5) + 0.5 - 1.0, 0.0]],
                             rtol=1e-6, atol=1e-8)


def test_k3_accurate_for_tiny_differences():
  # Naive e^r - r - 1 in float32 loses everything at r = 1e-4; the true value is ~r^2/2.
  r = 1e-4
  out = kl_estimate(jnp.array([0.0]), jnp.array([r]), "k3")
  np.testing.assert_allclose(out, [r * r / 2 + r**3 / 6], rtol=1e-5)
  # Both sides of the series/expm1 switch agree with float64.
  for r in (-0.3, -1e-2, -9e-3, 9e-3, 1e-2, 0.3):
    np.testing.assert_allclose(kl_estimate(jnp.array([0.0]), jnp.array([r]), "k3"),
                               [np.expm1(r) - r], rtol=1e-4)


def test_k1_and_k3_expectations_equal_exact_kl():
  rng = np.random.default_rng(1)
  logits_p, logits_q = rng.normal(size=(2, 11))
  logp = logits_p - np.log(np.exp(logits_p).sum())
  logq = logits_q - np.log(np.exp(logits_q).sum())
  p = np.exp(logp)
  kl = float((p * (logp - logq)).sum())
  # Expectation over samples y ~ pi_theta, done exactly by enumerating the vocabulary.
  for kind in ("k1", "k3"):
    est = float((p * np.asarray(kl_estimate(logp, logq, kind))).sum())
    np.testing.assert_allclose(est, kl, rtol=1e-5)
  assert np.all(np.asarray(kl_estimate(logp, logq, "k2")) >= 0)
  assert np.all(np.asarray(kl_estimate(logp, logq, "k3")) >= 0)


def test_gradients_closed_form():
  logp = jnp.array([-0.3, -1.2, -2.0])
  ref = jnp.array([-0.5, -0.7, -2.4])
  r = np.asarray(ref - logp)
  for kind, expected in (("k1", np.ones(3)), ("k2", -r), ("k3", 1.0 - np.exp(r))):
    g = jax.grad(lambda lp: jnp.sum(kl_estimate(lp, ref, kind)))(logp)
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-6)


def test_unknown_kind():
  with pytest.raises(ValueError, match="k1"):
    kl_estimate(jnp.zeros(2), jnp.zeros(2), "k4")


@pytest.mark.parametrize("jit", [False, True])
def test_exact_kl_matches_float64_definition(jit):
  """exact_kl vs sum p (log p - log q) in float64 (scipy.special.rel_entr); FP32 log-softmax of
  O(1) logits over 37 entries is accurate to ~1e-6 absolute per term."""
  from scipy.special import rel_entr
  from lowrl.rl.kl import exact_kl
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(2, 3, 4, 37)) * 2
  p = np.exp(a - np.log(np.exp(a).sum(-1, keepdims=True)))
  q = np.exp(b - np.log(np.exp(b).sum(-1, keepdims=True)))
  fn = jax.jit(exact_kl) if jit else exact_kl
  out = np.asarray(fn(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))
  assert out.shape == (3, 4) and out.dtype == np.float32
  np.testing.assert_allclose(out, rel_entr(p, q).sum(-1), atol=5e-6)
  np.testing.assert_array_equal(fn(jnp.asarray(a), jnp.asarray(a)), np.zeros((3, 4)))
  # p = 0 where q = 0: no NaN; p > 0 where q = 0: inf.
  lp = jnp.array([[[0.0, -jnp.inf]]])
  assert float(exact_kl(lp, lp)[0, 0]) == 0.0
  assert float(exact_kl(jnp.array([[[0.0, 0.0]]]), lp)[0, 0]) == np.inf
