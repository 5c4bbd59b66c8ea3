"""Optimizer / master weights, the pure RL update and config validation of the training loop."""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import multiprocess
import pytest
import tiny

from configs import base as base_config
from lowrl.models import init, layout
from lowrl import precision
from lowrl.models import transformer
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.losses import LossConfig
from lowrl.sampling import SamplingConfig
from lowrl.training import loop, optimizer, run_config, schema
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, make_rl_update
from lowrl.training.batch import RLBatch

# The pure-update tests' model: the loop's test model with one layer (nothing here depends on the
# depth; a smaller program compiles faster).
MODEL = dataclasses.replace(tiny.LOOP_MODEL, n_layers=1)


def _opt_cfg(**kw):
  c = base_config.get_config("fp32").optimizer
  c.update(kw)
  return c


def test_bf16_master_stochastic_rounding_keeps_small_updates():
  # An update of 1e-4 on weights of 1.0 is far below half a BF16 ulp (2^-8 = 0.0039): round to
  # nearest erases it every step; stochastic rounding keeps it in expectation.
  n, steps, lr = 4096, 20, 1e-4
  params = {"w": jnp.ones((n,), jnp.bfloat16)}
  grads = {"w": -jnp.ones((n,), jnp.float32)}  # SGD step of +lr per step
  tx = optax.sgd(lr)
  results = {}
  for rounding in ("nearest", "stochastic"):
    p, o = params, optimizer.init_opt_state(tx, params)
    for i in range(steps):
      p, o = optimizer.apply_update(tx, p, grads, o, master_rounding=rounding,
                                    key=jax.random.key(i))
      assert p["w"].dtype == jnp.bfloat16
    results[rounding] = float(jnp.mean(p["w"].astype(jnp.float32)))
  assert results["nearest"] == 1.0
  # Expected value 1 + steps*lr = 1.002. The SR mean over n weights has std
  # sqrt(steps * p(1-p)) * ulp / n with p = lr/ulp: 5 sigma is ~1.5e-4.
  ulp = 2.0**-7
  p_up = lr / ulp
  sigma = np.sqrt(steps * p_up * (1 - p_up)) * ulp / np.sqrt(n)
  assert abs(results["stochastic"] - (1 + steps * lr)) < 5 * sigma


def test_fp32_master_matches_optax():
  params = {"w": jnp.linspace(-1, 1, 8)}
  grads = {"w": jnp.arange(8.0)}
  tx = optimizer.make_optimizer(_opt_cfg(lr=1e-2), total_steps=10)
  o = optimizer.init_opt_state(tx, params)
  p, _ = optimizer.apply_update(tx, params, grads, o, master_rounding="nearest", key=None)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(p["w"], optax.apply_updates(params, updates)["w"])


@pytest.mark.parametrize("bad, match", [
    ({"lr": 0.0}, "lr"), ({"schedule": "step"}, "schedule"), ({"master_dtype": "fp8"}, "master_dtype"),
    ({"grad_clip": -1.0}, "grad_clip"),
])
def test_optimizer_config_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    schema.TRAIN_OPTIMIZER.validate(_opt_cfg(**bad))


def _batch(key, b=8, t=10):
  tokens = jax.random.randint(key, (b, t), 3, MODEL.vocab_size)
  loss_mask = jnp.zeros((b, t)).at[:, 5:].set(1.0)
  return RLBatch(tokens_BT=tokens, input_mask_BT=jnp.ones((b, t)), loss_mask_BT=loss_mask,
                 logp_sampler_BT=jnp.zeros((b, t)), adv_B=jnp.linspace(-1, 1, b))


def _update(policy_name="fp32", **cfg_kw):
  policy = precision.policy_for(policy_name, layout.matmuls(MODEL))
  logprob_fn = make_logprob_fn(MODEL, policy)
  tx = optax.adam(1e-2)
  cfg = UpdateConfig(loss=LossConfig(), correction=CorrectionConfig(), **cfg_kw)
  return logprob_fn, tx, jax.jit(make_rl_update(logprob_fn, tx, cfg))


def test_update_recomputes_pi_old_and_moves_params():
  logprob_fn, tx, update = _update()
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  logp, _ = jax.jit(logprob_fn)(params, batch, None)
  batch = batch._replace(logp_sampler_BT=logp * batch.loss_mask_BT)
  new, _, m = update(params, tx.init(params), None, batch, jax.random.key(2))
  # pi_old recomputed by the trainer with the same params: ratio 1, nothing clipped, and the
  # sampler's logprobs were the trainer's own, so the mismatch is exactly zero.
  assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
  assert float(m["clip_frac"]) == 0.0
  assert abs(float(m["mismatch/mismatch_kl"])) < 1e-6
  assert float(m["skipped_updates"]) == 0.0
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new)
  assert all(jax.tree.leaves(moved))


def test_update_skips_non_finite_gradient():
  _, tx, update = _update()
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  batch = batch._replace(adv_B=batch.adv_B.at[0].set(jnp.nan))
  opt_state = tx.init(params)
  new, new_opt, m = update(params, opt_state, None, batch, jax.random.key(2))
  assert float(m["skipped_updates"]) == 1.0
  jax.tree.map(np.testing.assert_array_equal, new, params)
  jax.tree.map(np.testing.assert_array_equal, new_opt, opt_state)


def test_update_mu_passes():
  _, tx, update = _update(mu=3, num_minibatches=2)
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  _, opt_state, m = update(params, tx.init(params), None, batch, jax.random.key(2))
  # Adam counts its steps: 3 passes x 2 minibatches.
  assert int(opt_state[0].count) == 6
  # Later passes move away from pi_old, so the ratio is no longer exactly 1 on average.
  assert float(m["ratio_mean"]) != 1.0


def _tiny_config():
  return tiny.loop_config("fp32")


@pytest.mark.parametrize("path, value, match", [
    ("rl.group_size", 1, "group_size"),
    ("rl.temperature", 0.0, "temperature"),
    ("rl.num_minibatches", 3, "num_minibatches"),
    ("rl.advantage", "ppo", "advantage"),
    ("rl.loss", "reinforce", "loss"),
    ("rl.correction", "clip", "correction"),
    ("async_rl.lag", -1, "lag"),
    ("optimizer.master_rounding", "stochastic", "master_dtype"),
    ("precision.format", "int4", "format"),
    ("precision.bf16_last_fraction", 1.5, "bf16_last_fraction"),
    ("task.name", "chess", "chess"),
])
def test_build_rejects_bad_config(path, value, match):
  c = _tiny_config()
  run_config.set_path(c, path, value)
  with pytest.raises(ValueError, match=match):
    build(c)


def test_build_rejects_block_not_dividing_width():
  c = base_config.get_config("nvfp4_naive")
  c.model.update(dict(d_model=40, n_heads=2, n_kv_heads=1, head_dim=20, d_ff=80))
  with pytest.raises(ValueError, match="nvfp4 blocks of 16 .* not a multiple of 16"):
    build(c)


# The suite compiles at LLVM level 0 (tests/multiprocess.py COMPILE_FLAGS). At that level the
# update's loss forward and the scoring forward (two programs) stop agreeing under fused shared
# weight scales (measured: PPO ratio 1.0018, |dlogp| up to 0.13; at XLA's default level 2 they
# agree bit for bit on 1 and 8 devices). So the fused case runs in a process of its own at the
# default level, as the training binaries compile; per-linear scales run here.
_O0 = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")


def test_exact_mode_fused_scales_at_the_default_llvm_level():
  env = dict(os.environ, LOWRL_EXACT_MODE_SCALES="fused", XLA_FLAGS=(
      multiprocess.xla_flags(8).replace("--xla_backend_optimization_level=0",
                                        "--xla_backend_optimization_level=2")))
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
       f"{__file__}::test_exact_mode_rollout_and_update_agree_bitwise_under_nvfp4"],
      env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_exact_mode_rollout_and_update_agree_bitwise_under_nvfp4():
  scales = os.environ.get("LOWRL_EXACT_MODE_SCALES", "per_linear" if _O0 else "fused")
  # The sampler's exact-mode logprobs, the trainer's pi_old and the loss's first forward all see
  # the same numbers: mismatch exactly 0 and the PPO ratio 1 before the first inner step. Without
  # lowrl's xla_allow_excess_precision=false the loss forward (a different XLA program) drifted
  # from pi_old by ~10% on average under NVFP4.
  c = _tiny_config()
  # Wide enough that NVFP4 blocks of 16 tile the contracting axes sharded over 8 fake devices.
  c.model.update(dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=128))
  c.precision = base_config.precision.recipe("nvfp4_recipe")
  c.precision.weight_scales = scales
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4))
  setup = build(c)
  trainer = Trainer(setup, log=lambda _: None)
  params = init.init_params(setup.model_cfg, jax.random.key(0))
  rollout, _ = trainer.rollout(params, params, 0, jax.random.key(1), stale=False)
  mask = rollout.out.completion_mask
  assert float(mask.sum()) > 0
  np.testing.assert_array_equal(rollout.out.logprobs * mask, rollout.logp_now_BT * mask)
  ref = jax.tree.map(jnp.copy, params)  # the step donates `params`
  _, _, m = trainer.step(params, trainer.init_opt_state(params), ref, rollout, jax.random.key(2))
  assert float(m["drift/total/mismatch_kl"]) == 0.0
  assert float(m["mismatch/mismatch_kl"]) == 0.0
  # The run-health metrics of the step (lowrl.rl.health): no token off, chi^2 exactly 0, and the
  # zero-spread share from the rollout's task rewards.
  assert float(m["health/dlogp_gt_ln2_frac"]) == 0.0 and float(m["health/is_chi2"]) == 0.0
  r = np.asarray(rollout.rewards_B).reshape(-1, c.rl.group_size)
  assert float(m["health/zero_spread_group_frac"]) == np.mean(r.max(1) == r.min(1))
  assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
  # rl.log_kl_ref: the KL to the reference is logged (here pi_ref = pi_old, so ~0) but, with
  # kl_coef = 0, not penalised.
  assert float(m["kl_ref"]) == pytest.approx(0.0, abs=1e-5)


# ----------------------------------------------------------------------------------------------
# Decoupled PPO, the sampled distribution, exact statistics.


def test_build_rejects_double_correction_and_bad_ddof():
  c = _tiny_config()
  c.rl.std_ddof = 2
  with pytest.raises(ValueError, match="rl.std_ddof"):
    build(c)
  for correction in ("tis", "mis"):
    c = _tiny_config()
    c.rl.old_logp_source, c.rl.correction = "sampler", correction
    with pytest.raises(ValueError, match="^--config.rl.correction=.* "
                                         "--config.rl.old_logp_source=sampler"):
      build(c)


def _np_decoupled_ppo(logp_new, logp_prox, logp_behav, adv, mask, c_fn, eps=0.2):
  """Decoupled PPO (Hilton et al. 2021), float64: mean_i (1/|o_i|) sum_t of
  -min(r A, clip(r) A) * c(pi_prox / pi_behav), r = pi_theta / pi_prox."""
  logp_new, logp_prox, logp_behav = (np.asarray(x, np.float64) for x in
                                     (logp_new, logp_prox, logp_behav))
  r = np.exp(logp_new - logp_prox)
  a = np.asarray(adv, np.float64)[:, None]
  per_tok = -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
  per_tok = per_tok * c_fn(np.exp(logp_prox - logp_behav))
  m = np.asarray(mask, np.float64)
  return np.mean((per_tok * m).sum(1) / m.sum(1))


@pytest.mark.parametrize("source, correction", [("trainer", "tis"), ("trainer", "none"),
                                                ("sampler", "none")])
def test_update_loss_is_decoupled_ppo(source, correction):
  policy = precision.policy_for("fp32", layout.matmuls(MODEL))
  logprob_fn = make_logprob_fn(MODEL, policy)
  cfg = UpdateConfig(loss=LossConfig(), correction=CorrectionConfig(mode=correction, tis_cap=1.5),
                     old_logp_source=source)
  update = jax.jit(make_rl_update(logprob_fn, optax.sgd(0.0), cfg))
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  logp_new, _ = jax.jit(logprob_fn)(params, batch, None)
  mask = batch.loss_mask_BT
  # pi_prox and pi_behav: the model's logprobs shifted per token, far enough that both the PPO
  # clip and the TIS cap are active on some tokens.
  k1, k2 = jax.random.split(jax.random.key(3))
  logp_prox = (logp_new + 0.3 * jax.random.normal(k1, mask.shape)) * mask
  logp_behav = (logp_new + 0.6 * jax.random.normal(k2, mask.shape)) * mask
  batch = batch._replace(logp_trainer_BT=logp_prox, logp_sampler_BT=logp_behav)
  _, _, m = update(params, optax.sgd(0.0).init(params), None, batch, jax.random.key(2))
  if source == "sampler":  # pi_prox = pi_behav: the correction is 1 by definition
    ref = _np_decoupled_ppo(logp_new, logp_behav, logp_behav, batch.adv_B, mask,
                            lambda w: 1.0)
  else:
    c_fn = (lambda w: np.minimum(w, 1.5)) if correction == "tis" else (lambda w: 1.0)
    ref = _np_decoupled_ppo(logp_new, logp_prox, logp_behav, batch.adv_B, mask, c_fn)
  # float32 terms of size O(1), 40 tokens summed: relative error well below 1e-5.
  assert float(m["loss"]) == pytest.approx(ref, rel=1e-5)
  if correction == "tis":  # the fixture exercises the cap
    w = np.exp(np.asarray(logp_prox - logp_behav))[np.asarray(mask) > 0]
    assert 0 < np.mean(w > 1.5) < 1


def _np_sampling_logq(logits, tokens, temperature, top_k, top_p):
  """log q(token) with q = softmax(logits / T) restricted to top-k then top-p, float64; also the
  distance of the support from a tie: the smallest gap between a kept and a dropped logit, and
  between top_p and a cumulative mass, per position."""
  x = np.asarray(logits, np.float64) / temperature
  out = np.zeros(tokens.shape)
  margin = np.full(tokens.shape, np.inf)
  for idx in np.ndindex(tokens.shape):
    row = x[idx]
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(row.shape, bool)
    keep[order[:top_k or len(row)]] = True
    srt = row[order][keep[order]]
    p = np.exp(srt - srt.max())
    p /= p.sum()
    mass_before = np.cumsum(p) - p
    kept = order[:len(srt)][mass_before < top_p]
    if top_p < 1:
      margin[idx] = min(margin[idx], np.abs(mass_before - top_p).min())
    keep[:] = False
    keep[kept] = True
    if not keep.all():
      margin[idx] = min(margin[idx], row[keep].min() - row[~keep].max())
    z = np.log(np.sum(np.exp(row[keep] - row.max()))) + row.max()
    out[idx] = row[tokens[idx]] - z if keep[tokens[idx]] else -np.inf
  return out, margin


def test_logprob_fn_uses_the_sampled_distribution():
  policy = precision.policy_for("fp32", layout.matmuls(MODEL))
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  logits = np.asarray(jax.jit(transformer.forward, static_argnums=(2, 3))(
      params, batch.tokens_BT, MODEL, policy))
  tokens = np.asarray(batch.tokens_BT)
  for t, k, p in ((0.5, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.6), (0.8, 9, 0.7)):
    sampling = SamplingConfig(max_new_tokens=4, temperature=t, top_k=k, top_p=p)
    logp, ent = jax.jit(make_logprob_fn(MODEL, policy, sampling))(params, batch, None)
    ref, margin = _np_sampling_logq(logits[:, :-1], tokens[:, 1:], t, k, p)
    # Two fp32 programs' logits (O(0.1) at init, sums of 32 terms) agree to ~1e-6, and so do the
    # masses: where the support is at least 1e-4 from a tie it is the same in both, and log q
    # agrees to 1e-4. Positions nearer a tie are left out.
    clear = margin > 1e-4
    assert clear.mean() > 0.8
    got = np.asarray(logp[:, 1:])
    inside = np.isfinite(ref)
    if k or p < 1:
      assert not inside[clear].all()  # some sampled tokens fall outside the support
    np.testing.assert_allclose(got[inside & clear], ref[inside & clear], atol=1e-4)
    np.testing.assert_array_equal(got[~inside & clear] < -1e29, True)  # probability exactly 0
    assert np.all(np.isfinite(np.asarray(ent)))


def test_loop_rollout_scores_the_sampled_distribution():
  # Stale sampler (other params) at temperature 0.5: the batch's logprobs and the TIS weights are
  # those of q = softmax(logits / 0.5), not of the raw model.
  c = _tiny_config()
  c.rl.update(dict(num_prompts=2, group_size=4, max_new_tokens=4, temperature=0.5,
                   correction="tis", tis_cap=1.2))
  # No reference params: the KL-to-reference forward would only enlarge the step's program (the
  # exact-mode test above logs it).
  c.rl.log_kl_ref = False
  setup = build(c)
  trainer = Trainer(setup, log=lambda _: None)
  sampler_params = init.init_params(setup.model_cfg, jax.random.key(0))
  params = init.init_params(setup.model_cfg, jax.random.key(5))
  rollout, _ = trainer.rollout(sampler_params, params, 0, jax.random.key(1), stale=True)
  out = rollout.out
  mask = np.asarray(out.completion_mask) > 0
  tokens = np.asarray(out.tokens)
  fwd = jax.jit(transformer.forward, static_argnums=(2, 3), static_argnames=())
  logq = {}
  for name, p in (("sampler", sampler_params), ("trainer", params)):
    logits = np.asarray(fwd(p, out.tokens, setup.model_cfg, setup.trainer_policy,
                            mask_BT=out.attention_mask))
    ref, _ = _np_sampling_logq(logits[:, :-1], tokens[:, 1:], 0.5, 0, 1.0)
    logq[name] = np.pad(ref, ((0, 0), (1, 0)))
    # fp32 forwards in two programs: logits agree to ~1e-6, log q to 1e-4.
    recorded = out.logprobs if name == "sampler" else rollout.logp_now_BT
    np.testing.assert_allclose(np.asarray(recorded)[mask], logq[name][mask], atol=1e-4)
  _, _, m = trainer.step(params, trainer.init_opt_state(params), None, rollout, jax.random.key(2))
  w = np.exp(logq["trainer"] - logq["sampler"])[mask]
  assert 0 < np.mean(w > 1.2) < 1
  assert float(m["correction/is_weight_mean"]) == pytest.approx(np.mean(np.minimum(w, 1.2)),
                                                                rel=1e-4)


def test_tokens_outside_pi_old_support_leave_the_loss():
  policy = precision.policy_for("fp32", layout.matmuls(MODEL))
  # A distribution test_logprob_fn_uses_the_sampled_distribution scores too (one program).
  sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=6)
  logprob_fn = make_logprob_fn(MODEL, policy, sampling)
  cfg = UpdateConfig(loss=LossConfig(loss="cispo"), correction=CorrectionConfig(mode="tis"))
  update = jax.jit(make_rl_update(logprob_fn, optax.adam(1e-2), cfg))
  params = init.init_params(MODEL, jax.random.key(0))
  batch = _batch(jax.random.key(1))
  logp, _ = jax.jit(logprob_fn)(params, batch, None)
  mask = np.asarray(batch.loss_mask_BT)
  outside = (np.asarray(logp) < -1e29) & (mask > 0)
  assert 0 < outside.sum() < mask.sum()
  # The sampler (other weights) had every token in its support; the trainer's pi_old did not.
  batch = batch._replace(logp_sampler_BT=jnp.where(mask > 0, jnp.where(outside, -1.0, logp), 0.0),
                         logp_trainer_BT=jnp.where(jnp.asarray(outside), -jnp.inf, logp))
  _, _, m = update(params, optax.adam(1e-2).init(params), None, batch, jax.random.key(2))
  assert float(m["skipped_updates"]) == 0.0 and np.isfinite(float(m["loss"]))
  assert float(m["correction/outside_support_frac"]) == pytest.approx(outside.sum() / mask.sum())
