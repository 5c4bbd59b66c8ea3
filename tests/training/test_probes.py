"""The step probes and loss scaling against independent formulas on hand-made trees:
gradient cosine / relative error / norm ratio, update erasure, and the static loss scale (forward
unchanged, gradients that underflow in FP16 without it recovered with it)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from lowrl.training import schema
from lowrl.training.loss_scaling import check_loss_scale, loss_scaled
from lowrl.training.probes import grad_agreement, update_erasure
from lowrl.training.setup import build

# Sums of a handful of small integers and one sqrt/division each in FP32: relative error below
# ~4 ulps of FP32 (2^-23 each).
RTOL = 4 * 2.0**-23


def _ref(g, r):
  """float64 cos, rel_err, norm_ratio of flat vectors g, r."""
  g, r = np.asarray(g, np.float64).ravel(), np.asarray(r, np.float64).ravel()
  ng, nr = np.linalg.norm(g), np.linalg.norm(r)
  return g @ r / (ng * nr), np.linalg.norm(g - r) / nr, ng / nr


def test_grad_agreement_matches_float64_formulas():
  g = {"a": jnp.array([3.0, 4.0]), "layers_0": {"k": jnp.array([[1.0, 0.0]]),
                                                  "s": jnp.array([2.0])}}
  r = {"a": jnp.array([3.0, 4.0]), "layers_0": {"k": jnp.array([[0.0, 1.0]]),
                                                  "s": jnp.array([-1.0])}}
  out = {k: float(v) for k, v in grad_agreement(g, r).items()}
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  for group, (gg, rr) in {"a": (g["a"], r["a"]), "layers_0": (flat(g["layers_0"]),
                                                              flat(r["layers_0"])),
                          "total": (flat(g), flat(r))}.items():
    cos, rel, ratio = _ref(gg, rr)
    np.testing.assert_allclose(out[f"grad_bias/cos/{group}"], cos, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(out[f"grad_bias/rel_err/{group}"], rel, rtol=RTOL)
    np.testing.assert_allclose(out[f"grad_bias/norm_ratio/{group}"], ratio, rtol=RTOL)
  assert out["grad_bias/cos/a"] == 1.0 and out["grad_bias/rel_err/a"] == 0.0
  assert len(out) == 9  # 3 metrics x (a, layers_0, total)


def test_grad_agreement_zero_gradients():
  z = {"a": jnp.zeros(3)}
  out = grad_agreement(z, z)
  assert float(out["grad_bias/cos/total"]) == 1.0  # both zero: they agree
  assert float(out["grad_bias/rel_err/total"]) == 0.0
  out = grad_agreement({"a": jnp.ones(3)}, z)
  assert float(out["grad_bias/cos/total"]) == 0.0  # no reference direction to agree with
  assert not any(math.isnan(float(v)) for v in out.values())


def test_update_erasure_counts_bf16_rounded_away_updates():
  ulp = 2.0**-7  # BF16 spacing in [1, 2)
  old = jnp.ones(5, jnp.bfloat16)
  # moved by a quarter ulp (rounds back: erased), by 2 ulps (kept), not moved, by 0.75 ulp
  # (rounds up to 1 ulp: kept), by -1/8 ulp below 1 where the spacing is ulp/2 (rounds back).
  new32 = jnp.array([1 + ulp / 4, 1 + 2 * ulp, 1.0, 1 + 0.75 * ulp, 1 - ulp / 8], jnp.float32)
  new_master = new32.astype(jnp.bfloat16)
  assert np.asarray(new_master, np.float32).tolist() == [1.0, 1 + 2 * ulp, 1.0, 1 + ulp, 1.0]
  # 4 moved, 2 erased.
  assert float(update_erasure({"w": old}, {"w": new_master}, {"w": new32})) == 0.5
  # FP32 master: the master step is the FP32 step, nothing erased; nothing moved: 0.
  assert float(update_erasure({"w": old}, {"w": new32}, {"w": new32})) == 0.0
  assert float(update_erasure({"w": old}, {"w": old}, {"w": old.astype(jnp.float32)})) == 0.0


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


def test_base_seed_follows_the_run_seed_unless_sft_seed_is_set():
  """sft.seed = -1 means "the run's seed": the base (init and SFT data) is seeded by cfg.seed and
  its fingerprint moves with it; a non-negative sft.seed pins the base across run seeds."""
  def base(run_seed, sft_seed):
    cfg = base_config.get_config("bf16")
    cfg.sft.steps = 0
    cfg.seed, cfg.sft.seed = run_seed, sft_seed
    return build(cfg).base

  follow_3, follow_4 = base(3, -1), base(4, -1)
  assert (follow_3.seed, follow_4.seed) == (3, 4)
  assert follow_3.fingerprint != follow_4.fingerprint
  pinned_3, pinned_4 = base(3, 7), base(4, 7)
  assert pinned_3.seed == pinned_4.seed == 7
  assert pinned_3.fingerprint == pinned_4.fingerprint
