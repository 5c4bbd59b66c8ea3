"""Policy losses against a plain NumPy version and closed-form gradients, with masks and padding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.kl import kl_estimate
from lowrl.rl.losses import LossConfig, aggregate, policy_loss

B, T = 4, 6


@pytest.fixture
def batch():
  rng = np.random.default_rng(0)
  logp_old = -rng.uniform(0.1, 3.0, size=(B, T)).astype(np.float32)
  # Log-ratios up to +-0.4 so plenty of tokens land outside [0.8, 1.2] (and some outside 1.28).
  logp = (logp_old + rng.uniform(-0.4, 0.4, size=(B, T))).astype(np.float32)
  # rho = 1.25 with A > 0: clipped by GRPO (1.2), not by DAPO's clip-higher (1.28).
  logp[0, 4] = logp_old[0, 4] + np.log(1.25)
  lengths = np.array([6, 3, 1, 4])
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  adv = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
  logp_ref = (logp_old + rng.normal(0, 0.2, size=(B, T))).astype(np.float32)
  return dict(logp=logp, logp_old=logp_old, adv=adv, mask=mask, logp_ref=logp_ref)


# ---------------------------------------------------------------- NumPy reference (float64, loops).

def np_aggregate(x, mask, aggregation, max_len=None):
  if aggregation == "token_mean":
    return (x * mask).sum() / mask.sum()
  rows = []
  for b in range(x.shape[0]):
    n = mask[b].sum()
    if n == 0:
      continue
    s = (x[b] * mask[b]).sum()
    rows.append(s / n if aggregation == "seq_mean_token_mean" else s / (max_len or x.shape[1]))
  return float(np.mean(rows))


def np_per_token(logp, logp_old, adv, mask, loss, lo=0.2, hi=0.2, eps_max=4.0):
  """Per-token loss and clip indicator, float64."""
  logp, logp_old = logp.astype(np.float64), logp_old.astype(np.float64)
  a = adv.astype(np.float64)[:, None] * np.ones_like(logp)
  if loss == "gspo":
    s = np.exp(((logp - logp_old) * mask).sum(1) / np.maximum(mask.sum(1), 1))
    ratio = s[:, None] * np.ones_like(logp)
  else:
    ratio = np.exp(logp - logp_old)
  if loss == "cispo":
    return -np.minimum(ratio, eps_max) * a * logp, ratio > eps_max, ratio
  unclipped, clipped = ratio * a, np.clip(ratio, 1 - lo, 1 + hi) * a
  return -np.minimum(unclipped, clipped), clipped < unclipped, ratio


def _loss(batch, cfg, **kw):
  return policy_loss(jnp.asarray(batch["logp"]), jnp.asarray(batch["logp_old"]),
                     jnp.asarray(batch["adv"]), jnp.asarray(batch["mask"]), cfg, **kw)


def _grad(batch, cfg, **kw):
  def f(lp):
    return policy_loss(lp, jnp.asarray(batch["logp_old"]), jnp.asarray(batch["adv"]),
                       jnp.asarray(batch["mask"]), cfg, **kw)[0]
  return np.asarray(jax.grad(f)(jnp.asarray(batch["logp"])))


def _seq_weights(mask, aggregation, max_len=None):
  """d(aggregate)/d(per-token loss): the weight each token's term gets in the scalar loss."""
  n_seq = (mask.sum(1) > 0).sum()
  if aggregation == "token_mean":
    return mask / mask.sum()
  if aggregation == "seq_mean_token_mean":
    return mask / np.maximum(mask.sum(1, keepdims=True), 1) / n_seq
  return mask / (max_len or mask.shape[1]) / n_seq


# ---------------------------------------------------------------- values.

@pytest.mark.parametrize("loss,lo,hi,agg", [
    ("grpo", 0.2, 0.2, "seq_mean_token_mean"),
    ("dapo", 0.2, 0.28, "token_mean"),
    ("gspo", 3e-4, 4e-4, "seq_mean_token_mean"),
    ("cispo", None, None, "token_mean"),
])
def test_value_and_metrics_match_numpy(batch, loss, lo, hi, agg):
  cfg = LossConfig(loss=loss)  # paper defaults resolved from the loss name
  assert cfg.aggregation == agg
  val, metrics = _loss(batch, cfg)
  per_tok, clip, ratio = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"],
                                      loss, lo, hi)
  expected = np_aggregate(per_tok, batch["mask"], agg)
  np.testing.assert_allclose(val, expected, rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_loss"], expected, rtol=1e-5)
  m = batch["mask"]
  np.testing.assert_allclose(metrics["clip_frac"], (clip * m).sum() / m.sum(), rtol=1e-6)
  np.testing.assert_allclose(metrics["ratio_mean"], (ratio * m).sum() / m.sum(), rtol=1e-5)
  assert "kl_ref" not in metrics


def test_fixture_exercises_clipping(batch):
  # Guards the value tests above: they only mean something if both clip sides are hit.
  _, clip, ratio = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"], "grpo")
  m = batch["mask"] > 0
  assert clip[m].any() and not clip[m].all()
  assert (ratio[m] > 1.2).any() and (ratio[m] < 0.8).any()
  # DAPO's clip-higher is visible: some positive-advantage tokens in (1.2, 1.28].
  _, clip_dapo, _ = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"],
                                 "dapo", 0.2, 0.28)
  assert clip_dapo[m].sum() < clip[m].sum()


def test_grpo_hand_computed():
  # One sequence, two tokens: rho = [1.5, 0.5], A = 1, eps 0.2.
  logp_old = jnp.log(jnp.array([[0.4, 0.4]]))
  logp = jnp.log(jnp.array([[0.6, 0.2]]))
  mask = jnp.ones((1, 2))
  val, m = policy_loss(logp, logp_old, jnp.array([1.0]), mask, LossConfig("grpo"))
  # token 1: min(1.5, 1.2) = 1.2 (clipped); token 2: min(0.5, 0.8) = 0.5 (unclipped).
  np.testing.assert_allclose(val, -(1.2 + 0.5) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac"], 0.5)
  np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-6)
  # Negative advantage flips which side clips: token 2 clipped at 0.8, token 1 unclipped.
  val, m = policy_loss(logp, logp_old, jnp.array([-1.0]), mask, LossConfig("grpo"))
  np.testing.assert_allclose(val, -(-1.5 + -0.8) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac"], 0.5)


@pytest.mark.parametrize("agg,max_len", [("seq_mean_token_mean", None), ("token_mean", None),
                                         ("seq_mean_token_sum_norm", None),
                                         ("seq_mean_token_sum_norm", 10)])
def test_aggregations(batch, agg, max_len):
  cfg = LossConfig(loss="grpo", aggregation=agg, max_len=max_len)
  per_tok, _, _ = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"], "grpo")
  np.testing.assert_allclose(_loss(batch, cfg)[0], np_aggregate(per_tok, batch["mask"], agg, max_len),
                             rtol=1e-5)


def test_empty_sequence_does_not_dilute_sequence_mean(batch):
  mask = batch["mask"].copy()
  mask[1] = 0.0
  cfg = LossConfig("grpo")
  full = _loss(dict(batch, mask=mask), cfg)[0]
  kept = [0, 2, 3]
  sub = {k: v[kept] for k, v in batch.items()}
  sub["mask"] = mask[kept]
  np.testing.assert_allclose(full, _loss(sub, cfg)[0], rtol=1e-6)


def test_aggregate_matches_numpy_on_random_values(batch):
  x = np.random.default_rng(3).normal(size=(B, T)).astype(np.float32)
  for agg in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
    np.testing.assert_allclose(aggregate(jnp.asarray(x), jnp.asarray(batch["mask"]), agg),
                               np_aggregate(x, batch["mask"], agg), rtol=1e-5)


# ---------------------------------------------------------------- gradients.

@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_ppo_clip_gradient_closed_form(batch, loss):
  cfg = LossConfig(loss=loss)
  per_tok, clip, ratio = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"],
                                      loss, cfg.clip_eps_low, cfg.clip_eps_high)
  del per_tok
  # d/dlogp of -rho*A is -rho*A where unclipped; clipped tokens get exactly zero gradient.
  expected = np.where(clip, 0.0, -ratio * batch["adv"][:, None])
  expected *= _seq_weights(batch["mask"], cfg.aggregation)
  g = _grad(batch, cfg)
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
  assert np.all(g[clip & (batch["mask"] > 0)] == 0.0)


def test_on_policy_grpo_gradient_is_vanilla_policy_gradient(batch):
  b = dict(batch, logp=batch["logp_old"])
  g = _grad(b, LossConfig("grpo"))
  expected = -batch["adv"][:, None] * _seq_weights(batch["mask"], "seq_mean_token_mean")
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
  assert _loss(b, LossConfig("grpo"))[1]["clip_frac"] == 0.0


def test_cispo_gradient_is_detached_clipped_weight(batch):
  cfg = LossConfig(loss="cispo", cispo_eps_max=1.1)  # low cap so truncation is active
  _, clip, ratio = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"],
                                "cispo", eps_max=1.1)
  m = batch["mask"] > 0
  assert clip[m].any() and not clip[m].all()
  g = _grad(batch, cfg)
  expected = -np.minimum(ratio, 1.1) * batch["adv"][:, None] * _seq_weights(batch["mask"], "token_mean")
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
  # Every counted token keeps a gradient, truncated or not.
  assert np.all(g[m] != 0.0)


def _gspo_sequence_objective(logp, logp_old, adv, mask, lo=3e-4, hi=4e-4):
  """GSPO written at the sequence level (no token form, no stop-gradients)."""
  s = jnp.exp(jnp.sum((logp - logp_old) * mask, 1) / jnp.sum(mask, 1))
  return -jnp.mean(jnp.minimum(s * adv, jnp.clip(s, 1 - lo, 1 + hi) * adv))


def test_gspo_token_form_equals_sequence_objective(batch):
  # Tiny log-ratios so some sequences sit inside the +-3e-4 band and some outside.
  logp_old = batch["logp_old"]
  delta = np.array([1e-4, -2e-3, 1e-5, 5e-3], np.float32)[:, None] * np.ones((1, T), np.float32)
  delta = delta * np.linspace(0.5, 1.5, T, dtype=np.float32)
  b = dict(batch, logp=(logp_old + delta).astype(np.float32))
  args = [jnp.asarray(b[k]) for k in ("logp_old", "adv", "mask")]
  seq_val, seq_grad = jax.value_and_grad(_gspo_sequence_objective)(jnp.asarray(b["logp"]), *args)
  cfg = LossConfig("gspo")
  np.testing.assert_allclose(_loss(b, cfg)[0], seq_val, rtol=1e-5)
  g = _grad(b, cfg)
  np.testing.assert_allclose(g, seq_grad, rtol=1e-4, atol=1e-8)
  # Closed form: unclipped sequence i gives every token -s_i A_i / (|o_i| n_seq); clipped gives 0.
  _, clip, s = np_per_token(b["logp"], logp_old, b["adv"], b["mask"], "gspo", 3e-4, 4e-4)
  clip_seq = clip[:, 0]
  assert clip_seq.any() and not clip_seq.all()
  expected = np.where(clip, 0.0, -s * b["adv"][:, None]) * _seq_weights(b["mask"], cfg.aggregation)
  np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-8)


# ---------------------------------------------------------------- KL, IS weights, padding.

@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty(batch, kind):
  beta = 0.1
  cfg = LossConfig("grpo", kl_coef=beta, kl_estimator=kind)
  val, metrics = _loss(batch, cfg, logp_ref_BT=jnp.asarray(batch["logp_ref"]))
  per_tok, _, _ = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"], "grpo")
  r = batch["logp_ref"].astype(np.float64) - batch["logp"]
  kl = {"k1": -r, "k2": r**2 / 2, "k3": np.exp(r) - r - 1}[kind]
  m = batch["mask"]
  expected = np_aggregate(per_tok, m, "seq_mean_token_mean") + beta * np_aggregate(kl, m,
                                                                                   "seq_mean_token_mean")
  np.testing.assert_allclose(val, expected, rtol=1e-5)
  np.testing.assert_allclose(metrics["kl_ref"], (kl * m).sum() / m.sum(), rtol=1e-5)
  # The KL adds beta * dk/dlogp (aggregation-weighted) to the policy-gradient gradient.
  dk = {"k1": np.ones_like(r), "k2": -r, "k3": 1 - np.exp(r)}[kind]
  g_pg = _grad(batch, LossConfig("grpo"))
  g = _grad(batch, cfg, logp_ref_BT=jnp.asarray(batch["logp_ref"]))
  np.testing.assert_allclose(g - g_pg, beta * dk * _seq_weights(m, "seq_mean_token_mean"),
                             rtol=1e-4, atol=1e-7)


def test_kl_logged_but_not_added_when_coef_zero(batch):
  ref = jnp.asarray(batch["logp_ref"])
  val, metrics = _loss(batch, LossConfig("grpo"), logp_ref_BT=ref)
  np.testing.assert_allclose(val, _loss(batch, LossConfig("grpo"))[0])
  expected = np.asarray(kl_estimate(batch["logp"], batch["logp_ref"], "k3"))
  m = batch["mask"]
  np.testing.assert_allclose(metrics["kl_ref"], (expected * m).sum() / m.sum(), rtol=1e-5)


@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo"])
def test_is_weights_scale_tokens_and_are_detached(batch, loss):
  rng = np.random.default_rng(5)
  w = rng.uniform(0.0, 2.0, size=(B, T)).astype(np.float32)
  w[0, 1] = 0.0  # an MIS-masked token
  cfg = LossConfig(loss)
  lo, hi = (cfg.gspo_eps_low, cfg.gspo_eps_high) if loss == "gspo" else (cfg.clip_eps_low,
                                                                          cfg.clip_eps_high)
  per_tok, _, _ = np_per_token(batch["logp"], batch["logp_old"], batch["adv"], batch["mask"], loss,
                               lo, hi, cfg.cispo_eps_max)
  val, _ = _loss(batch, cfg, is_weights_BT=jnp.asarray(w))
  np.testing.assert_allclose(val, np_aggregate(per_tok * w, batch["mask"], cfg.aggregation),
                             rtol=1e-5)
  # Token gradients scale by the weight (for GSPO the token form keeps this per token too).
  np.testing.assert_allclose(_grad(batch, cfg, is_weights_BT=jnp.asarray(w)),
                             _grad(batch, cfg) * w, rtol=1e-5, atol=1e-8)
  gw = jax.grad(lambda ww: _loss(batch, cfg, is_weights_BT=ww)[0])(jnp.asarray(w))
  np.testing.assert_array_equal(gw, 0.0)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "cispo"])
def test_garbage_on_padding_is_ignored(batch, loss):
  cfg = LossConfig(loss, kl_coef=0.05)
  pad = batch["mask"] == 0
  dirty = {k: v.copy() for k, v in batch.items()}
  dirty["logp"][pad] = np.nan
  dirty["logp_old"][pad] = -np.inf
  dirty["logp_ref"][pad] = 1e30
  ref_clean, ref_dirty = jnp.asarray(batch["logp_ref"]), jnp.asarray(dirty["logp_ref"])
  val_clean, m_clean = _loss(batch, cfg, logp_ref_BT=ref_clean)
  val_dirty, m_dirty = _loss(dirty, cfg, logp_ref_BT=ref_dirty)
  np.testing.assert_allclose(val_dirty, val_clean, rtol=1e-6)
  for k in m_clean:
    np.testing.assert_allclose(m_dirty[k], m_clean[k], rtol=1e-6)
  g = _grad(dirty, cfg, logp_ref_BT=ref_dirty)
  assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(g[pad], 0.0)
  np.testing.assert_allclose(g, _grad(batch, cfg, logp_ref_BT=ref_clean), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo"])
def test_all_zero_mask_gives_zero_not_nan(batch, loss):
  b = dict(batch, mask=np.zeros((B, T), np.float32))
  val, metrics = _loss(b, LossConfig(loss))
  assert val == 0.0
  assert all(np.isfinite(v) for v in metrics.values())
  assert np.all(_grad(b, LossConfig(loss)) == 0.0)


def test_jit_with_static_config(batch):
  cfg = LossConfig("dapo", kl_coef=0.01, kl_estimator="k2")
  f = jax.jit(policy_loss, static_argnames="cfg")
  args = [jnp.asarray(batch[k]) for k in ("logp", "logp_old", "adv", "mask")]
  jit_val, jit_m = f(*args, cfg=cfg, logp_ref_BT=jnp.asarray(batch["logp_ref"]))
  val, m = policy_loss(*args, cfg, logp_ref_BT=jnp.asarray(batch["logp_ref"]))
  np.testing.assert_allclose(jit_val, val, rtol=1e-6)
  assert set(jit_m) == set(m)


# ---------------------------------------------------------------- config and input validation.

def test_config_defaults_and_hashing():
  dapo = LossConfig("dapo")
  assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
  assert dapo == LossConfig("dapo", clip_eps_high=0.28, aggregation="token_mean")
  assert hash(dapo) == hash(LossConfig("dapo", clip_eps_high=0.28, aggregation="token_mean"))
  assert LossConfig("grpo").clip_eps_high == 0.2
  assert LossConfig("grpo", clip_eps_high=0.3).clip_eps_high == 0.3
  with pytest.raises(dataclasses.FrozenInstanceError):
    dapo.loss = "grpo"


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss="ppo"), "Unknown loss"),
    (dict(aggregation="sum"), "Unknown aggregation"),
    (dict(clip_eps_low=1.0), "clip_eps_low"),
    (dict(clip_eps_high=-0.1), "clip_eps_high"),
    (dict(gspo_eps_low=-1e-4), "gspo_eps_low"),
    (dict(cispo_eps_max=0.0), "cispo_eps_max"),
    (dict(max_len=0), "max_len"),
    (dict(kl_coef=-1.0), "kl_coef"),
    (dict(kl_estimator="k5"), "KL estimator"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kwargs)


def test_bad_inputs(batch):
  with pytest.raises(ValueError, match="logp_ref_BT"):
    _loss(batch, LossConfig("grpo", kl_coef=0.1))
  with pytest.raises(ValueError, match="adv_B"):
    policy_loss(jnp.asarray(batch["logp"]), jnp.asarray(batch["logp_old"]), jnp.zeros(B + 1),
                jnp.asarray(batch["mask"]), LossConfig())
  with pytest.raises(ValueError, match="share one"):
    policy_loss(jnp.asarray(batch["logp"]), jnp.asarray(batch["logp_old"])[:, :-1],
                jnp.asarray(batch["adv"]), jnp.asarray(batch["mask"]), LossConfig())
  with pytest.raises(ValueError, match="is_weights_BT"):
    _loss(batch, LossConfig(), is_weights_BT=jnp.ones((B, T + 1)))
