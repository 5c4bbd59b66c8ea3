"""TIS / MIS correction weights at token and sequence level, against hand-built ratios."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.corrections import CorrectionConfig, correction_weights

# Token ratios w = pi_trainer / pi_sampler chosen by hand; the last column is padding.
W = np.array([[1.0, 3.0, 0.4, 1.5, 9.0],
              [0.8, 1.1, 6.0, 2.5, 9.0],
              [1.0, 1.0, 1.0, 1.0, 9.0]], np.float64)
MASK = np.array([[1, 1, 1, 1, 0],
                 [1, 1, 1, 0, 0],
                 [0, 0, 0, 0, 0]], np.float32)  # row 2 is an empty sequence


@pytest.fixture
def logps():
  logp_sampler = -np.linspace(0.5, 2.5, W.size).reshape(W.shape)
  logp_trainer = logp_sampler + np.log(W)
  return jnp.asarray(logp_trainer, jnp.float32), jnp.asarray(logp_sampler, jnp.float32)


def _run(logps, **kw):
  return correction_weights(*logps, jnp.asarray(MASK), CorrectionConfig(**kw))


def test_none_gives_mask(logps):
  w, m = _run(logps, mode="none")
  np.testing.assert_array_equal(w, MASK)
  assert (m["is_truncated_frac"], m["is_masked_frac"], m["is_weight_mean"]) == (0.0, 0.0, 1.0)


def test_tis_token(logps):
  w, m = _run(logps, mode="tis", tis_cap=2.0)
  np.testing.assert_allclose(w, np.minimum(W, 2.0) * MASK, rtol=1e-5)
  # Counted tokens: 3.0 and 6.0 exceed the cap (2.5 is padding) -> 2 of 7.
  np.testing.assert_allclose(m["is_truncated_frac"], 2 / 7, rtol=1e-6)
  assert m["is_masked_frac"] == 0.0
  np.testing.assert_allclose(m["is_weight_mean"], (np.minimum(W, 2.0) * MASK).sum() / 7, rtol=1e-5)


@pytest.mark.parametrize("reweight", [True, False])
def test_mis_token(logps, reweight):
  w, m = _run(logps, mode="mis", mis_low=0.5, mis_high=5.0, mis_reweight=reweight)
  keep = (W >= 0.5) & (W <= 5.0)
  expected = np.where(keep, W if reweight else 1.0, 0.0) * MASK
  np.testing.assert_allclose(w, expected, rtol=1e-5)
  # Counted tokens outside [0.5, 5]: 0.4 and 6.0 -> 2 of 7.
  np.testing.assert_allclose(m["is_masked_frac"], 2 / 7, rtol=1e-6)
  assert m["is_truncated_frac"] == 0.0


def test_tis_sequence(logps):
  w, m = _run(logps, mode="tis", level="sequence", tis_cap=2.0)
  w_seq = np.array([np.prod(W[b][MASK[b] > 0]) for b in range(3)])  # [1.8, 5.28, 1 (empty)]
  np.testing.assert_allclose(w, np.minimum(w_seq, 2.0)[:, None] * MASK, rtol=1e-5)
  # Of the two non-empty sequences, one (5.28) is truncated.
  np.testing.assert_allclose(m["is_truncated_frac"], 0.5)


def test_mis_sequence(logps):
  w, m = _run(logps, mode="mis", level="sequence", mis_low=0.5, mis_high=5.0)
  w_seq = np.array([np.prod(W[b][MASK[b] > 0]) for b in range(3)])
  keep = (w_seq >= 0.5) & (w_seq <= 5.0)
  np.testing.assert_allclose(w, np.where(keep, w_seq, 0.0)[:, None] * MASK, rtol=1e-5)
  np.testing.assert_allclose(m["is_masked_frac"], 0.5)


def test_long_sequences_do_not_overflow():
  # Sum of log w = 500 (w_seq = e^500 overflows float32) and -500.
  logp_s = jnp.zeros((2, 100))
  logp_t = jnp.stack([jnp.full(100, 5.0), jnp.full(100, -5.0)])
  mask = jnp.ones((2, 100))
  w, m = correction_weights(logp_t, logp_s, mask, CorrectionConfig("tis", "sequence"))
  np.testing.assert_allclose(w[0], 2.0)
  assert np.all(np.isfinite(w)) and np.all(np.asarray(w[1]) >= 0)
  w, m = correction_weights(logp_t, logp_s, mask, CorrectionConfig("mis", "sequence"))
  np.testing.assert_array_equal(w, 0.0)
  assert m["is_masked_frac"] == 1.0 and all(np.isfinite(v) for v in m.values())


def test_weights_are_detached(logps):
  cfg = CorrectionConfig("tis")
  g_t, g_s = jax.grad(lambda t, s: jnp.sum(correction_weights(t, s, jnp.asarray(MASK), cfg)[0]),
                      argnums=(0, 1))(*logps)
  np.testing.assert_array_equal(g_t, 0.0)
  np.testing.assert_array_equal(g_s, 0.0)


def test_empty_mask_metrics(logps):
  for mode in ("tis", "mis"):
    w, m = correction_weights(*logps, jnp.zeros(W.shape), CorrectionConfig(mode))
    np.testing.assert_array_equal(w, 0.0)
    assert m["is_truncated_frac"] == 0.0 and m["is_masked_frac"] == 0.0
    assert m["is_weight_mean"] == 1.0


def test_jit_with_static_config(logps):
  cfg = CorrectionConfig("mis", "sequence")
  f = jax.jit(correction_weights, static_argnames="cfg")
  np.testing.assert_allclose(f(*logps, jnp.asarray(MASK), cfg=cfg)[0],
                             correction_weights(*logps, jnp.asarray(MASK), cfg)[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="clip"), "correction mode"),
    (dict(level="chunk"), "correction level"),
    (dict(tis_cap=0.0), "tis_cap"),
    (dict(mis_low=5.0, mis_high=0.5), "mis_low < mis_high"),
    (dict(mis_low=-1.0), "mis_low"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    CorrectionConfig(**kwargs)


def test_config_is_hashable_and_frozen():
  cfg = CorrectionConfig("tis")
  assert hash(cfg) == hash(CorrectionConfig("tis"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.mode = "mis"


def test_shape_mismatch(logps):
  with pytest.raises(ValueError, match="Shape mismatch"):
    correction_weights(logps[0], logps[1][:, :-1], jnp.asarray(MASK), CorrectionConfig("tis"))
