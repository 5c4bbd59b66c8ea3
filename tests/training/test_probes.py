"""The step probes against independent formulas on hand-made trees: gradient cosine / relative
error / norm ratio and update erasure."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrl.training.probes import grad_agreement, update_erasure

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
