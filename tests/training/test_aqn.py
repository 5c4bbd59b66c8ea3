"""QeRL's adaptive quantization noise (lowrl/training/aqn.py): the staged schedule, the noise in
the RMSNorm weights only, the config errors, and a LoRA step with it on (sampler and update see
the same noisy norms; the state keeps the clean ones)."""
import jax
import numpy as np
import pytest
import tiny

from configs import base as base_config
from lowrl.models import init, lora
from lowrl.training import aqn
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer


def _qerl_sigma(step, total_steps, sigma_trend):
  """NVlabs/QeRL's `get_sigma_by_step` (its noise scheduler), as its code reads: the run cut into
  len(sigma_trend) + 1 intervals, the first without noise, then sigma_trend[i] per interval."""
  step = min(step, total_steps)
  steps_per_interval = total_steps / (len(sigma_trend) + 1)
  interval = int(step // steps_per_interval)
  if interval == 0:
    return 0.0
  return sigma_trend[min(interval - 1, len(sigma_trend) - 1)]


@pytest.mark.parametrize("total, stages", [(40, 10), (37, 4), (5, 2), (100, 3)])
def test_schedule_is_qerls_with_a_geometric_sigma_list(total, stages):
  cfg = aqn.AqnConfig(sigma_start=1e-2, sigma_end=5e-4, stages=stages)
  trend = np.geomspace(1e-2, 5e-4, stages - 1) if stages > 2 else [1e-2]
  for step in range(total + 2):
    assert aqn.sigma(cfg, step, total) == pytest.approx(_qerl_sigma(step, total, trend),
                                                        rel=1e-12)
  assert aqn.sigma(cfg, 0, total) == 0.0
  assert aqn.sigma(cfg, total, total) == pytest.approx(5e-4 if stages > 2 else 1e-2)


def test_noise_lands_in_the_rmsnorm_weights_only():
  model_cfg = tiny.loop_config("fp32")
  params = init.init_params(build(model_cfg).model_cfg, jax.random.key(0))
  noisy = aqn.perturb(params, 0.1, seed=3, step=7)
  changed = []
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(noisy)):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if np.array_equal(a, b):
      assert not name.endswith(("attn_norm/scale", "mlp_norm/scale", "final_norm/scale"))
    else:
      changed.append(name)
      z = np.asarray(b, np.float64) - np.asarray(a, np.float64)
      assert 0 < np.abs(z).max() < 0.1 * 6  # N(0, 0.1^2): |z| < 6 sigma
  assert "final_norm/scale" in changed and any(n.endswith("attn_norm/scale") for n in changed)
  assert not any("q_norm" in n or "k_norm" in n or n.endswith("kernel") for n in changed)
  # Deterministic in (seed, step); another step draws other noise; restore undoes it.
  again = aqn.perturb(params, 0.1, seed=3, step=7)
  for x, y in zip(jax.tree.leaves(noisy), jax.tree.leaves(again)):
    np.testing.assert_array_equal(x, y)
  other = aqn.perturb(params, 0.1, seed=3, step=8)
  assert not np.array_equal(other["final_norm"]["scale"], noisy["final_norm"]["scale"])
  for x, y in zip(jax.tree.leaves(aqn.restore(noisy, params)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(x, y)
  assert aqn.perturb(params, 0.0, seed=3, step=7) is params


def _config(**aqn_kw):
  c = tiny.loop_config("fp32", steps=4)
  c.lora.update(dict(rank=4, alpha=8.0, aqn_sigma_start=0.05, aqn_sigma_end=0.01,
                     aqn_stages=2, **aqn_kw))
  c.model.update(dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=128))
  c.precision = base_config.precision.recipe("nvfp4_recipe")
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4, steps=4))
  return c


@pytest.mark.parametrize("knob, value, match", [
    ("aqn_sigma_end", 0.1, r"--config\.lora\.aqn_sigma_end=0\.1"),
    ("aqn_sigma_end", 0.0, r"--config\.lora\.aqn_sigma_end=0\.0"),
    ("aqn_stages", 1, r"--config\.lora\.aqn_stages=1"),
    ("aqn_sigma_start", -1.0, r"--config\.lora\.aqn_sigma_start=-1\.0"),
    ("rank", 0, "lora.rank=0 trains them"),
])
def test_build_rejects_bad_aqn_config(knob, value, match):
  c = _config()
  c.lora[knob] = value
  with pytest.raises(ValueError, match=match) as e:
    build(c)
  assert "\n" not in str(e.value)


def test_off_by_default():
  assert build(tiny.loop_config("fp32")).aqn is None
  assert aqn.config_from(base_config.get_config().lora) is None


@pytest.mark.parametrize("packed", [False, True])
def test_lora_step_with_aqn(packed):
  """In a noisy stage the sampler's held norms are the trainer's noisy ones (the refit check
  finds no mismatch, the sync moves them), the update trains the adapters, and the state comes
  back with the clean norms bit for bit."""
  c = _config(packed_base=packed)
  setup = build(c)
  assert setup.aqn == aqn.AqnConfig(0.05, 0.01, 2)
  trainer = Trainer(setup, log=lambda _: None)
  params = trainer.place(trainer.with_adapters(init.init_params(setup.model_cfg,
                                                                jax.random.key(0))))
  clean = jax.tree.map(np.asarray, lora.split(params)[0])
  opt = trainer.init_opt_state(params)
  ref = jax.tree.map(lambda x: x.copy(), params)
  sampler = jax.tree.map(lambda x: x.copy(), params)
  params, opt, m, _ = trainer.rl_step(sampler, params, opt, ref, 1, jax.random.key(1),
                                      stale=False, sampler_version=1)
  assert float(m["aqn/sigma"]) == 0.0  # the first stage: no noise
  sampler = jax.tree.map(lambda x: x.copy(), params)
  params, opt, m, _ = trainer.rl_step(sampler, params, opt, ref, 3, jax.random.key(2),
                                      stale=False, sampler_version=3)
  assert float(m["aqn/sigma"]) == np.float32(0.05)
  assert m.get("refit/mismatched_tensors", 0) == 0
  assert float(m["mismatch/mismatch_kl"]) == 0.0
  held_norm = trainer.refit.held.weights["final_norm"]["scale"]
  want = aqn.perturb(lora.split(params)[0], 0.05, setup.loop.seed, 3)["final_norm"]["scale"]
  np.testing.assert_array_equal(np.asarray(held_norm), np.asarray(want))
  assert not np.array_equal(np.asarray(held_norm), clean["final_norm"]["scale"])
  for x, y in zip(jax.tree.leaves(lora.split(params)[0]), jax.tree.leaves(clean)):
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(y).view(np.uint8))
