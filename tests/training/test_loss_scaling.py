"""The static loss scale (`lowrl.training.loss_scaling`): the forward unchanged, gradients that
underflow in FP16 without it recovered with it, and a scale that is not a power of two refused
naming the flag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from lowrl.training import schema
from lowrl.training.loss_scaling import check_loss_scale, loss_scaled


def _fp16_logprob_fn(params, batch, key):
  """A stand-in logprob fn that runs its backward in FP16: logp = f32(f16(w) * f16(1e-4))."""
  del batch, key
  logp = (params["w"].astype(jnp.float16) * jnp.float16(1e-4)).astype(jnp.float32)
  return logp, jnp.zeros_like(logp)


def test_loss_scale_recovers_fp16_underflow_and_keeps_forward():
  params = {"w": jnp.ones((4,), jnp.float32)}
  c16 = float(np.float16(1e-4))

  def grad(fn):
    return jax.grad(lambda p: 1e-4 * jnp.sum(fn(p, None, None)[0]))(params)["w"]

  # Unscaled: the cotangent 1e-4 times f16(1e-4) = 1e-8 is below half FP16's smallest subnormal
  # (2^-25 = 3.0e-8): it flushes to 0.
  assert np.all(np.asarray(grad(_fp16_logprob_fn)) == 0)
  scaled = loss_scaled(_fp16_logprob_fn, 2.0**16)
  # The cotangent is 1e-4 * 2^16 = 6.55 in FP16 (one rounding, 2^-11 relative) times c16 (one
  # more), then exact power-of-two unscaling: within 2 * 2^-11 of 1e-4 * c16.
  np.testing.assert_allclose(np.asarray(grad(scaled)), 1e-4 * c16, rtol=2 * 2.0**-11)
  # The forward is untouched, bit for bit.
  assert np.array_equal(scaled(params, None, None)[0], _fp16_logprob_fn(params, None, None)[0])
  assert loss_scaled(_fp16_logprob_fn, 1.0) is _fp16_logprob_fn


@pytest.mark.parametrize("bad", [1000.0, 0.0, -2.0, 3.0])
def test_loss_scale_must_be_a_power_of_two(bad):
  with pytest.raises(ValueError, match="power of two"):
    check_loss_scale(bad)
  cfg = base_config.get_config("fp16")
  cfg.optimizer.loss_scale = bad
  with pytest.raises(ValueError, match="--config.optimizer.loss_scale"):
    schema.TRAIN.validate(cfg)
  check_loss_scale(1024.0)
  check_loss_scale(0.5)
