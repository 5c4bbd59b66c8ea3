"""Random Hadamard transform: orthonormality, inverse, cancellation in products, golden values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.quant import inverse_rht, rht
from lowrl.quant.hadamard import DEFAULT_SIGNS, hadamard_matrix, rht_matrix


def test_matrix_is_orthonormal_hadamard():
  h = hadamard_matrix(16)
  assert set(np.unique(h)) == {-1.0, 1.0}
  np.testing.assert_array_equal(h @ h.T, 16 * np.eye(16))
  t = rht_matrix()
  np.testing.assert_allclose(t @ t.T, np.eye(16), atol=1e-6)
  assert set(np.unique(DEFAULT_SIGNS)) == {-1.0, 1.0} and len(set(DEFAULT_SIGNS)) == 2


def test_golden_single_block():
  # Signs all +1: T = H16 / 4. e_0 -> first column of H / 4 = all 1/4; constant 1 -> (4, 0, ..., 0).
  ones = np.ones(16, np.float32)
  e0 = np.eye(16, dtype=np.float32)[0]
  np.testing.assert_array_equal(rht(e0, signs=ones), np.full(16, 0.25, np.float32))
  np.testing.assert_array_equal(rht(ones, signs=ones), 4 * e0)
  # With signs s: T e_0 = s_0 * (first column of H) / 4.
  np.testing.assert_array_equal(rht(e0), np.full(16, 0.25, np.float32) * DEFAULT_SIGNS[0])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_inverse_and_product_cancellation(axis):
  a = jax.random.normal(jax.random.key(0), (32, 48))
  np.testing.assert_allclose(inverse_rht(rht(a, axis), axis), a, atol=1e-5)
  # Blocks are independent and act along `axis` only.
  if axis == 0:
    b = jax.random.normal(jax.random.key(1), (32, 8))
    np.testing.assert_allclose(rht(a, 0).T @ rht(b, 0), a.T @ b, atol=1e-4)
  # Norm preserved (orthonormal).
  np.testing.assert_allclose(jnp.sum(rht(a, axis) ** 2), jnp.sum(a ** 2), rtol=1e-5)


def test_spreads_outliers():
  x = np.zeros((1, 16), np.float32)
  x[0, 3] = 100.0
  y = np.asarray(rht(x))
  np.testing.assert_allclose(np.abs(y), 25.0)  # one spike becomes 16 values of magnitude 100/4


def test_dtype_and_errors():
  assert rht(jnp.ones((16,), jnp.bfloat16)).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="multiple of 16"):
    rht(jnp.ones((4, 24)))
  with pytest.raises(ValueError, match="±1"):
    rht(jnp.ones((16,)), signs=np.arange(16))
