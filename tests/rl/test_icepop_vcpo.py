"""IcePop and VCPO corrections, against cases computed by hand from their definitions.

IcePop (Ring-1T): M(w) = w if alpha <= w <= beta else 0, per token. VCPO (arXiv 2602.17616): the
step scaled by sqrt(ESS / N), ESS = (sum w)^2 / sum w^2 of the importance weights.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

from lowrl import precision
from lowrl.models import init, layout
from lowrl.rl.corrections import CorrectionConfig, correction_weights, normalized_ess
from lowrl.rl.losses import LossConfig
from lowrl.training import optimizer
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, make_rl_update
from lowrl.training.step import RLBatch

# Token ratios w = pi_trainer / pi_sampler; the last column is padding, row 2 an empty sequence.
W = np.array([[1.0, 3.0, 0.4, 1.5, 9.0],
              [0.8, 1.1, 6.0, 2.5, 9.0],
              [1.0, 1.0, 1.0, 1.0, 9.0]])
MASK = np.array([[1, 1, 1, 1, 0],
                 [1, 1, 1, 0, 0],
                 [0, 0, 0, 0, 0]], np.float32)


def _run(mode, jit=False, **kw):
  logp_sampler = -np.linspace(0.5, 2.5, W.size).reshape(W.shape)
  args = (jnp.asarray(logp_sampler + np.log(W), jnp.float32),
          jnp.asarray(logp_sampler, jnp.float32), jnp.asarray(MASK))
  cfg = CorrectionConfig(mode=mode, **kw)
  fn = jax.jit(correction_weights, static_argnames="cfg") if jit else correction_weights
  return fn(*args, cfg=cfg)


@pytest.mark.parametrize("jit", [False, True])
def test_icepop_keeps_tokens_inside_the_band_with_their_weight(jit):
  w, m = _run("icepop", jit=jit, mis_low=0.5, mis_high=5.0)
  # By hand: 0.4 < 0.5 and 6.0 > 5 are dropped; the others keep w; padding is 0.
  expected = np.array([[1.0, 3.0, 0.0, 1.5, 0.0],
                       [0.8, 1.1, 0.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(w, expected, rtol=1e-5)
  np.testing.assert_allclose(m["is_masked_frac"], 2 / 7, rtol=1e-6)
  assert "is_step_scale" not in m  # the step is not scaled: the loop's metrics stay as they were


def test_icepop_band_edges_are_kept():
  w, _ = _run("icepop", mis_low=0.4, mis_high=6.0)  # the band's ends are W's 0.4 and 6.0
  np.testing.assert_allclose(w, W * MASK, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(level="sequence"), dict(mis_reweight=False)])
def test_icepop_is_token_level_and_reweighted(kw):
  with pytest.raises(ValueError, match="IcePop"):
    CorrectionConfig(mode="icepop", **kw)


@pytest.mark.parametrize("jit", [False, True])
def test_vcpo_token_weights_are_tis_and_step_scale_is_sqrt_ess(jit):
  w, m = _run("vcpo", jit=jit, tis_cap=2.0)
  np.testing.assert_allclose(w, np.minimum(W, 2.0) * MASK, rtol=1e-5)
  # By hand over the 7 counted tokens 1, 3, 0.4, 1.5, 0.8, 1.1, 6: sum 13.8, sum of squares 50.26.
  ess = 13.8 ** 2 / (7 * 50.26)
  np.testing.assert_allclose(m["is_ess"], ess, rtol=1e-5)
  np.testing.assert_allclose(m["is_step_scale"], np.sqrt(ess), rtol=1e-5)
  np.testing.assert_allclose(m["is_truncated_frac"], 2 / 7, rtol=1e-6)


def test_vcpo_sequence_ess_counts_non_empty_sequences():
  _, m = _run("vcpo", level="sequence")
  # w_seq: 1 * 3 * 0.4 * 1.5 = 1.8 and 0.8 * 1.1 * 6 = 5.28; the empty row is not a sample.
  ess = (1.8 + 5.28) ** 2 / (2 * (1.8 ** 2 + 5.28 ** 2))
  np.testing.assert_allclose(m["is_ess"], ess, rtol=1e-5)


def test_normalized_ess_edge_cases():
  ones = jnp.ones((4,))
  assert float(normalized_ess(jnp.zeros(4), ones)) == 1.0  # on-policy: every weight 1
  assert float(normalized_ess(jnp.full((4,), 50.0), ones)) == 1.0  # equal weights, any size
  # Weights e^1000 and 1: far beyond FP32 (log space); one sample carries it all -> ESS 1 of 2.
  np.testing.assert_allclose(normalized_ess(jnp.array([1000.0, 0.0]), jnp.ones(2)), 0.5,
                             rtol=1e-6)
  assert float(normalized_ess(jnp.array([3.0, -2.0]), jnp.zeros(2))) == 1.0  # nothing counted
  # The mask selects: an uncounted huge weight does not count.
  assert float(normalized_ess(jnp.array([0.0, 0.0, 80.0]), jnp.array([1.0, 1.0, 0.0]))) == 1.0


def test_apply_update_step_scale_scales_the_step_not_the_moments():
  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  grads = {"w": jnp.array([0.3, -0.1, 2.0])}
  tx = optax.adam(0.1)
  full, st_full = optimizer.apply_update(tx, params, grads, tx.init(params),
                                         master_rounding="nearest", key=None)
  half, st_half = optimizer.apply_update(tx, params, grads, tx.init(params),
                                         master_rounding="nearest", key=None,
                                         step_scale=jnp.float32(0.5))
  # Each delta carries the FP32 rounding of p + d: half an ulp of |p| <= 2 (1.2e-7) each.
  np.testing.assert_allclose(half["w"] - params["w"], 0.5 * (full["w"] - params["w"]), rtol=1e-6,
                             atol=2.5e-7)
  jax.tree.map(np.testing.assert_array_equal, st_full, st_half)


def test_vcpo_update_is_tis_update_times_the_step_scale():
  """With SGD the update is -lr * grad: VCPO's is TIS's (same weights, same gradient) times
  sqrt(ESS / N) of the batch's weights."""
  model = dataclasses.replace(tiny.LOOP_MODEL, n_layers=1)
  logprob_fn = make_logprob_fn(model, precision.policy_for("fp32", layout.matmuls(model)))
  params = init.init_params(model, jax.random.key(0))
  b, t = 8, 10
  tokens = jax.random.randint(jax.random.key(1), (b, t), 3, model.vocab_size)
  mask = jnp.zeros((b, t)).at[:, 5:].set(1.0)
  batch = RLBatch(tokens_BT=tokens, input_mask_BT=jnp.ones((b, t)), loss_mask_BT=mask,
                  logp_sampler_BT=jnp.zeros((b, t)), adv_B=jnp.linspace(-1, 1, b))
  logp, _ = logprob_fn(params, batch, None)
  shift = 0.5 * jax.random.normal(jax.random.key(3), mask.shape)
  batch = batch._replace(logp_sampler_BT=(logp + shift) * mask)
  tx = optax.sgd(1e-2)
  deltas, metrics = {}, {}
  for mode in ("tis", "vcpo"):
    update = make_rl_update(logprob_fn, tx, UpdateConfig(LossConfig(), CorrectionConfig(mode)))
    new, _, metrics[mode] = jax.jit(update)(params, tx.init(params), None, batch,
                                            jax.random.key(2))
    deltas[mode] = jax.tree.map(lambda a, p: np.asarray(a - p, np.float64), new, params)
  w = np.exp(-np.asarray(shift))[np.asarray(mask) > 0]  # w = pi_trainer / pi_sampler
  scale = np.sqrt(w.sum() ** 2 / (w.size * (w ** 2).sum()))
  assert 0.5 < scale < 0.99  # the fixture's weights are spread: the scale is active
  np.testing.assert_allclose(metrics["vcpo"]["correction/is_step_scale"], scale, rtol=1e-5)
  # Same gradient; each delta carries the FP32 rounding of p + d (half an ulp of |p| <= 2, so
  # 1.2e-7 each), and the step scale its own float32 rounding (rtol).
  for dv, dt in zip(jax.tree.leaves(deltas["vcpo"]), jax.tree.leaves(deltas["tis"])):
    assert np.max(np.abs(dv)) > 1e-6 or np.max(np.abs(dt)) == 0  # the step moved the params
    np.testing.assert_allclose(dv, scale * dt, rtol=1e-5, atol=2.5e-7)


@pytest.mark.parametrize("mode", ["icepop", "vcpo"])
def test_loop_config_selects_the_correction(mode):
  """rl.correction takes both in the loop's schema; IcePop at sequence level is a one-line error naming the fix, before anything compiles."""
  from configs import base
  from lowrl.training import schema
  cfg = base.get_config("bf16")
  cfg.rl.correction = mode
  schema.TRAIN.validate(cfg)
  cfg.rl.correction_level = "sequence"
  if mode == "icepop":
    with pytest.raises(ValueError, match="correction_level=token"):
      schema.TRAIN.validate(cfg)
  else:
    schema.TRAIN.validate(cfg)
