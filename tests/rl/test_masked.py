"""Masked reductions vs NumPy, empty masks, and garbage on padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.masked import masked_count, masked_max, masked_mean, masked_sum, safe_divide


@pytest.fixture
def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 7)).astype(np.float32)
  mask = (rng.random((4, 7)) < 0.6).astype(np.float32)
  mask[2] = 0.0  # one empty row
  return x, mask


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_sum_mean_max_match_numpy(data, axis):
  x, mask = data
  np_sum = (x * mask).sum(axis=axis)
  np_cnt = mask.sum(axis=axis)
  with np.errstate(invalid="ignore", divide="ignore"):
    np_mean = np.where(np_cnt > 0, np_sum / np_cnt, -7.0)
  np_max = np.where(np_cnt > 0, np.where(mask > 0, x, -np.inf).max(axis=axis), -3.0)
  np.testing.assert_allclose(masked_sum(x, mask, axis), np_sum, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(masked_count(mask, axis), np_cnt)
  np.testing.assert_allclose(masked_mean(x, mask, axis, empty=-7.0), np_mean, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(masked_max(x, mask, axis, empty=-3.0), np_max, rtol=1e-6)


def test_row_means_give_empty_value_for_empty_row(data):
  x, mask = data
  out = np.asarray(masked_mean(x, mask, axis=1, empty=0.5))
  assert out[2] == 0.5
  assert masked_mean(x, np.zeros_like(mask)) == 0.0
  assert masked_max(x, np.zeros_like(mask), empty=1.25) == 1.25


def test_garbage_on_padding_does_not_leak_into_value_or_grad(data):
  x, mask = data
  x_bad = np.where(mask > 0, x, np.nan).astype(np.float32)
  x_bad[0, 0] = np.inf if mask[0, 0] == 0 else x_bad[0, 0]
  np.testing.assert_allclose(masked_mean(x_bad, mask), masked_mean(x, mask), rtol=1e-6)
  g = jax.grad(lambda v: masked_mean(v, mask))(jnp.asarray(x_bad))
  assert np.all(np.isfinite(g))
  np.testing.assert_allclose(g, mask / mask.sum(), rtol=1e-6)


def test_safe_divide_gradient_finite_at_zero_denominator():
  f = lambda n, d: safe_divide(n, d, empty=2.0)
  assert f(1.0, 0.0) == 2.0
  gn, gd = jax.grad(f, argnums=(0, 1))(1.0, 0.0)
  assert gn == 0.0 and gd == 0.0
  np.testing.assert_allclose(f(3.0, 2.0), 1.5)
