"""A LoRA run's base held packed in the trainer (--config.lora.packed_base,
lowrl/training/lora_update.pack_base): exact mode bit for bit with adapters on the packed base,
the base's codes and scales never written, the refit check over them, the compiled update program
holding no FP32 copy of the base, and the config errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from configs import base as base_config
from lowrl.models import init, layout, lora
from lowrl.quant.packing import PackedWeight
from lowrl.sampling import weights
from lowrl.training import lora_update
from lowrl.training.batch import RLBatch
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer

_packed = lambda x: isinstance(x, PackedWeight)  # noqa: E731


def _config(d_model=128, d_ff=128, **model):
  c = tiny.loop_config("fp32")
  c.lora.update(dict(rank=4, alpha=8.0, packed_base=True))
  c.model.update(dict(d_model=d_model, n_heads=4, n_kv_heads=2, head_dim=d_model // 4,
                      d_ff=d_ff, **model))
  c.precision = base_config.precision.recipe("nvfp4_recipe")
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4))
  c.optimizer.lr = 1e-2
  return c


def _live_params(trainer, packed=True):
  """Initial params (base packed unless `packed` is False) with B drawn too, so the adapter term
  is not a sum of zeros."""
  base = init.init_params(trainer.setup.model_cfg, jax.random.key(0))
  key = jax.random.key(trainer.setup.loop.seed)
  _, adapters = lora.split(lora.merge(base, lora.init_adapters(trainer.setup.lora,
                                                               trainer.setup.model_cfg, key)))
  adapters = jax.tree_util.tree_map_with_path(
      lambda kp, x: 0.05 * jax.random.normal(jax.random.key(len(str(kp))), x.shape)
      if kp[-1].key == lora.B else x, adapters)
  params = lora.merge(base, adapters)
  return trainer.place(trainer._pack(params) if packed else params)  # noqa: SLF001


def _bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def sampled():
  """`_config()`'s trainer, live params and one rollout of theirs (with its info). The rollout's
  arrays depend on the batch settings alone (not the model's width or depth), so it is also the
  input any `_config(**model)` update program is lowered for: the same program as for its own
  rollout, without compiling that model's sampler and scorer. (The exact-mode test's update
  donates the params; the other tests take the rollout alone.)"""
  trainer = Trainer(build(_config()), log=lambda _: None)
  params = _live_params(trainer)
  rollout, info = trainer.rollout(params, params, 0, jax.random.key(1), stale=False)
  return trainer, params, rollout, info


@pytest.mark.parametrize("path, value, match", [
    ("precision.backward", "high_precision", r"backward='high_precision' needs the original"),
    ("lora.rank", 0, "lora.rank=0 trains every weight"),
])
def test_build_rejects_packed_base_that_cannot_apply(path, value, match):
  tiny.assert_build_rejects(_config(), path, value, match)


def test_packed_base_needs_a_weight_quantizer():
  """A recipe whose policy quantizes no kernel leaves nothing to pack (the build's precision
  checks refuse backward=dequantized without a format first; the check covers policies too)."""
  c = _config()
  bf16 = build(tiny.loop_config("bf16"))
  with pytest.raises(ValueError, match="quantizes no weight") as e:
    lora_update.check_packed_base(c, lora.config_from(c.lora), bf16.model_cfg,
                                  bf16.trainer_policy)
  assert "\n" not in str(e.value)


def test_exact_mode_update_and_refit_on_the_packed_base(sampled):
  """The base is packed once (uint8 codes + FP8 block scales + FP32 outer scales, no master
  kernel) and computes what the master base computes, bit for bit (logprobs, adapter gradients,
  the sampler's exact-mode scores; mismatch exactly 0); the update moves the adapters and leaves
  the base's codes and scales bit for bit; the refit check compares them at every sync."""
  trainer, params, rollout, info = sampled
  setup = trainer.setup
  base, adapters = lora.split(params)
  packed = [x for x in jax.tree.leaves(base, is_leaf=_packed) if _packed(x)]
  n_quantized = len(weights.prequantizable(setup.trainer_policy, setup.model_cfg))
  assert n_quantized > 0 and len(packed) == n_quantized
  assert all(p.nibbles and p.codes.dtype == jnp.uint8 for p in packed)

  assert info["refit"].get("refit/mismatched_tensors", 0) == 0
  out, mask = rollout.out, rollout.out.completion_mask
  assert float(mask.sum()) > 0
  # The update's forward and the adapters' gradient on the packed base (each layer dequantizes
  # its kernels, their quantizer skipped) are those on the master base (the policy's weight
  # quantizer, backward=dequantized), bit for bit, in one program.
  batch = RLBatch(tokens_BT=out.tokens, input_mask_BT=out.attention_mask, loss_mask_BT=None,
                  logp_sampler_BT=None, adv_B=None)

  def loss(a, b):
    logp_BT, _ = trainer.logprob_fn(lora.merge(b, a), batch, None)
    return jnp.sum(jnp.where(mask > 0, logp_BT, 0.0)), logp_BT

  grad_fn = jax.jit(jax.grad(loss, has_aux=True))
  master = lora.split(_live_params(trainer, packed=False))[0]
  (g_packed, lp_packed), (g_master, lp_master) = grad_fn(adapters, base), grad_fn(adapters, master)
  np.testing.assert_array_equal(np.asarray(lp_packed).view(np.uint32),
                                np.asarray(lp_master).view(np.uint32))
  for x, y in zip(_bits(g_packed), _bits(g_master)):
    np.testing.assert_array_equal(x, y)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_packed))
  # The sampler's recorded logprobs (exact mode, on the packed tree) are the master base's too.
  k_quant = jax.random.split(jax.random.key(1))[1]
  on_master = trainer.score(trainer.place(lora.merge(master, adapters)), setup.trainer_policy,
                            out, k_quant)
  np.testing.assert_array_equal(np.asarray(on_master).view(np.uint32),
                                np.asarray(out.logprobs).view(np.uint32))

  rollout = rollout._replace(rewards_B=jnp.tile(jnp.array([0.0, 1.0]), 8))
  opt = trainer.init_opt_state(params)
  assert sum(x.size for x in jax.tree.leaves(opt) if x.ndim) == 2 * sum(
      x.size for x in jax.tree.leaves(adapters))
  before = jax.tree.map(np.asarray, params)
  ref = jax.tree.map(jnp.copy, params)  # the step donates `params`
  new, _, m = trainer.step(params, opt, ref, rollout, jax.random.key(2))
  assert float(m["mismatch/mismatch_kl"]) == 0.0
  assert float(m["skipped_updates"]) == 0.0 and float(m["grad_norm"]) > 0
  new_base, new_adapters = lora.split(new)
  old_base, old_adapters = lora.split(before)
  assert jax.tree.structure(new_base, is_leaf=_packed) == jax.tree.structure(
      old_base, is_leaf=_packed)
  for x, y in zip(_bits(new_base), _bits(old_base)):
    np.testing.assert_array_equal(x, y)
  assert all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(new_adapters),
                                                     jax.tree.leaves(old_adapters)))
  # The next sync moves the new adapters; the check still covers the packed base.
  _, refit_metrics = trainer.refit(new, 1)
  assert refit_metrics.get("refit/mismatched_tensors", 0) == 0
  assert refit_metrics["refit/sync_bytes"] < sum(x.nbytes for x in jax.tree.leaves(new_base))


@pytest.mark.slow
def test_update_program_holds_no_fp32_copy_of_the_base(sampled):
  """Inspect the compiled update program (XLA's memory analysis of its buffers): its arguments
  are the packed base (no FP32 input of any quantized kernel's shape) and its temporaries stay
  below an FP32 copy of the quantized kernels, since each layer dequantizes its own kernels. The
  same program fed a dequantized tree (`weights.unpack_params` of the base before the scan: an
  FP32 copy) exceeds that bound, so the bound sees such a copy. Per-device sizes of the SPMD
  program on the suite's 8 fake devices (the packed kernels are replicated, so whole)."""
  # Eight layers (the recipe quantizes seven): an FP32 copy of the quantized kernels (~27.5 MB)
  # outweighs what one layer at a time needs (its dequantized kernels, ~4 MB) plus the
  # activations; XLA puts the temporaries at ~23 MB here, the dequantized-tree control at >90 MB.
  c = _config(d_model=256, d_ff=1024, n_layers=8, scan_layers=True, remat="full")
  setup = build(c)
  trainer = Trainer(setup, log=lambda _: None)
  params = _live_params(trainer)
  quantized = weights.prequantizable(setup.trainer_policy, setup.model_cfg)
  shapes = init.param_shapes(setup.model_cfg)
  kernels = [layout.get_param(shapes, m.param_keys).shape for m in quantized]
  fp32_base = sum(4 * int(np.prod(s)) for s in kernels)
  rollout = sampled[2]  # (its own rollout would have the same arrays: see `sampled`)
  opt = trainer.init_opt_state(params)

  compiled = trainer.step.lower(params, opt, params, rollout, jax.random.key(2)).compile()
  params_in = compiled.args_info[0][0]  # the program's params argument, as it takes it
  for m in quantized:
    k = layout.get_param(params_in, m.param_keys)
    assert isinstance(k, PackedWeight) and k.codes.dtype == jnp.uint8, m.full_path
  stats = compiled.memory_analysis()
  print("packed-base update program:", stats, "FP32 quantized kernels:", fp32_base)
  assert stats.argument_size_in_bytes < fp32_base
  assert stats.temp_size_in_bytes < fp32_base, (stats.temp_size_in_bytes, fp32_base)

  # Control: the base dequantized as a whole before the forward (an FP32 copy of it).
  step_fn = lora_update.make_lora_step(
      lambda p, b, k: trainer.logprob_fn(weights.unpack_params(p), b, k), trainer.tx,
      setup.update_cfg, setup.batch_cfg, setup.plan)
  copy = jax.jit(step_fn).lower(params, opt, params, rollout, jax.random.key(2)).compile()
  print("dequantized-tree control:", copy.memory_analysis())
  assert copy.memory_analysis().temp_size_in_bytes >= fp32_base


def test_memory_estimate_of_a_packed_base():
  """packed_base_bytes is what the packed tree holds per block-linear parameter (counted here
  from a real packed tree); the estimate's params term replaces the block linears' master bytes
  by those bytes (one device here: the suite's 8 split the master part)."""
  setup = build(_config())
  trainer = Trainer(setup, log=lambda _: None)
  packed = lora.split(_live_params(trainer))[0]
  blocks = [m for m in layout.matmuls(setup.model_cfg) if m.owns_kernel and m.layer is not None]
  held = sum(x.nbytes for m in blocks for x in jax.tree.leaves(layout.get_param(packed,
                                                                               m.param_keys)))
  n = sum(m.in_features * m.out_features for m in blocks)
  b = lora_update.packed_base_bytes(setup.model_cfg, setup.trainer_policy, "float32")
  assert b == held / n and 0.5 < b < 4
  from lowrl import memory
  common = dict(batch=16, micro_batch=4, seq_len=8, max_new_tokens=4, adapter_params=1000)
  plain = memory.estimate(setup.model_cfg, **common)
  est = memory.estimate(setup.model_cfg, **common, packed_base_bytes=b)
  assert est.params == plain.params - 4 * n + int(np.ceil(n * b))
  assert est.grads == plain.grads and est.optimizer == plain.optimizer
  with pytest.raises(ValueError, match="needs adapter_params"):
    memory.estimate(setup.model_cfg, **dict(common, adapter_params=0), packed_base_bytes=b)
