"""LoRA runs in the training loop (lowrl/training/lora_update.py): the build's config errors, the
exact-mode rollout and update with adapters, the frozen base."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from configs import base as base_config
from lowrl.models import init, lora
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer


def _config(recipe="fp32", **lora_kw):
  c = tiny.loop_config(recipe)
  c.lora.update(dict(rank=4, alpha=8.0, **lora_kw))
  return c


@pytest.mark.parametrize("path, value, match", [
    ("lora.rank", -1, r"--config\.lora\.rank=-1"),
    ("lora.rank", 64, r"--config\.lora\.rank=64 exceeds"),
    ("lora.targets", r"layers_\d+/attn/q", "matches no matmul"),
    ("lora.targets", "lm_head", "tied to the embedding"),
    ("lora.dtype", "float16", r"--config\.lora\.dtype"),
    ("lora.alpha", -1.0, r"--config\.lora\.alpha"),
    ("diagnostics.every", 2, r"--config\.diagnostics\.every"),
    ("optimizer.compute_cast_rounding", "stochastic", "compute_cast_rounding"),
])
def test_build_rejects_bad_lora_config(path, value, match):
  tiny.assert_build_rejects(_config("bf16"), path, value, match)


def test_build_rejects_weight_gradient_rht_on_a_frozen_base():
  c = _config()
  c.precision = base_config.precision.recipe("nvfp4_recipe")
  c.precision.update(dict(backward="quantized", rht_wgrad=True))
  c.model.update(dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=128))
  with pytest.raises(ValueError, match="rht_wgrad.*frozen LoRA base"):
    build(c)


def test_lora_rank_zero_is_full_fine_tuning():
  setup = build(tiny.loop_config("fp32"))
  assert setup.lora is None and setup.trainer_policy.adapter is None


def test_exact_mode_rollout_and_update_with_adapters_under_nvfp4():
  """Sampler and trainer compute one forward with adapters (mismatch exactly 0); the update
  changes the adapters and leaves every base leaf bit for bit; optimizer state covers only the
  adapters."""
  c = _config()
  c.model.update(dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=128))
  c.precision = base_config.precision.recipe("nvfp4_recipe")
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4))
  c.optimizer.lr = 1e-2
  setup = build(c)
  assert setup.trainer_policy.adapter == setup.sampler_policy.adapter == setup.lora.precision
  trainer = Trainer(setup, log=lambda _: None)
  base = init.init_params(setup.model_cfg, jax.random.key(0))
  params = trainer.with_adapters(base)
  # Live adapters: B drawn too, so the forward's adapter term is not a sum of zeros.
  _, adapters = lora.split(params)
  adapters = jax.tree_util.tree_map_with_path(
      lambda kp, x: 0.05 * jax.random.normal(jax.random.key(len(str(kp))), x.shape)
      if kp[-1].key == lora.B else x, adapters)
  params = trainer.place(lora.merge(base, adapters))
  rollout, _ = trainer.rollout(params, params, 0, jax.random.key(1), stale=False)
  mask = rollout.out.completion_mask
  assert float(mask.sum()) > 0
  np.testing.assert_array_equal(rollout.out.logprobs * mask, rollout.logp_now_BT * mask)

  # Rewards with spread in every group (a random base solves nothing: all-zero advantages).
  rollout = rollout._replace(rewards_B=jnp.tile(jnp.array([0.0, 1.0]), 8))
  opt = trainer.init_opt_state(params)
  n_opt = sum(x.size for x in jax.tree.leaves(opt) if x.ndim)
  n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
  assert n_opt == 2 * n_adapters  # Adam's two moments, of the adapters alone
  before = jax.tree.map(np.asarray, params)
  ref = jax.tree.map(jnp.copy, params)  # the step donates `params`
  new, _, m = trainer.step(params, opt, ref, rollout, jax.random.key(2))
  assert float(m["mismatch/mismatch_kl"]) == 0.0
  assert float(m["kl_ref"]) == pytest.approx(0.0, abs=1e-5)  # the reference's adapters count
  assert float(m["skipped_updates"]) == 0.0 and float(m["grad_norm"]) > 0
  new_base, new_adapters = lora.split(jax.tree.map(np.asarray, new))
  old_base, old_adapters = lora.split(before)
  for x, y in zip(jax.tree.leaves(new_base), jax.tree.leaves(old_base)):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
  moved = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(new_adapters),
                                                    jax.tree.leaves(old_adapters))]
  assert all(moved)


def test_trainer_initial_params_compute_the_base():
  """with_adapters: B = 0, so the trainer's scores of the initial params are the base's."""
  setup = build(_config())
  trainer = Trainer(setup, log=lambda _: None)
  base = init.init_params(setup.model_cfg, jax.random.key(0))
  params = trainer.with_adapters(base)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, setup.model_cfg.vocab_size, (2, 6)))
  from lowrl.models import transformer
  full = build(tiny.loop_config("fp32"))
  want = transformer.forward(base, tokens, full.model_cfg, full.trainer_policy)
  got = transformer.forward(params, tokens, setup.model_cfg, setup.trainer_policy)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def test_memory_estimate_counts_adapters_and_trains_only_them():
  """The per-device estimate of a LoRA run: params = the full run's + the adapters (FP32), the
  gradients and Adam's two FP32 moments of the adapters alone (counted from the adapter tree).
  The tests' 8 fake devices split the base's terms 8 ways: the full run's terms are per device,
  the adapters (replicated) whole."""
  full = build(tiny.loop_config("fp32")).memory
  setup = build(_config())
  n = sum(x.size for x in jax.tree.leaves(lora.adapter_shapes(setup.lora, setup.model_cfg)))
  assert n == lora.num_params(setup.lora, setup.model_cfg) > 0
  est = setup.memory
  assert est.params == full.params + 4 * n
  assert est.grads == 4 * n and est.optimizer == 2 * 4 * n
  assert est.reference == full.reference + 4 * n  # the reference copies the whole tree
