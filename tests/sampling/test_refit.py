"""The refit check: a sampler's held weights, scales and static activation scales against a fresh
quantization of the trainer's weights, bit for bit; one corrupted scale is one mismatching tensor
and a warning line; the loop logs the count at each weight sync."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import precision
from lowrl.models import calibration, init, layout
from lowrl.quant.packing import PackedWeight
from lowrl.sampling import refit
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer

TINY = tiny.TINY
NAIVE = precision.policy_for("nvfp4_naive", layout.matmuls(TINY))  # tensor-scaled activations
AMAX_PATHS = NAIVE.act_paths(layout.matmuls(TINY), "tensor")


def _params(seed=0):
  return init.init_params(TINY, jax.random.key(seed))


def _act_amax(params):
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  return calibration.calibrate_act_amax(params, tokens, TINY, NAIVE, AMAX_PATHS)


def _bump_first_scale(packed):
  """The packed tree with the first E4M3 block scale of layer 0's k_proj one code higher."""
  pw = packed["layers_0"]["attn"]["k_proj"]["kernel"]
  bits = jax.lax.bitcast_convert_type(pw.scale, jnp.uint8)
  scale = jax.lax.bitcast_convert_type(bits.at[0, 0].add(1), pw.scale.dtype)
  bad = dataclasses.replace(pw, scale=scale)
  return {**packed, "layers_0": {**packed["layers_0"], "attn": {
      **packed["layers_0"]["attn"], "k_proj": {"kernel": bad}}}}


@pytest.fixture(scope="module")
def refitter():
  return refit.Refitter(TINY, NAIVE, _act_amax, log=lambda _: None)


def test_fresh_weights_pass_and_one_corrupted_scale_is_one_tensor(refitter):
  params = _params()
  held = refitter.quantize(params)
  assert isinstance(held.weights["layers_0"]["attn"]["k_proj"]["kernel"], PackedWeight)
  assert set(held.act_amax) == set(AMAX_PATHS)
  names = refit.tensor_names(held)
  flags = np.asarray(refitter.check(held, params))
  assert flags.shape == (len(names),) and not flags.any()
  bad = np.asarray(refitter.check(held._replace(weights=_bump_first_scale(held.weights)), params))
  assert bad.sum() == 1
  assert names[int(np.argmax(bad))].startswith("weights/layers_0/attn/k_proj/kernel")
  # A stale activation scale, and weights of another version, are caught too.
  stale = dict(held.act_amax, **{AMAX_PATHS[0]: held.act_amax[AMAX_PATHS[0]] * 1.001})
  assert np.asarray(refitter.check(held._replace(act_amax=stale), params)).sum() == 1
  assert np.asarray(refitter.check(held, _params(1))).sum() > 1


def test_mismatches_compare_bits():
  nan, zero = jnp.array([jnp.nan, 0.0]), jnp.array([jnp.nan, -0.0])
  held = refit.RolloutWeights({"w": nan}, kv_scales={"k": jnp.ones(2)})
  assert not np.asarray(refit.mismatches(held, held)).any()  # NaN is its own bits
  assert np.asarray(refit.mismatches(held._replace(weights={"w": zero}), held)).tolist() == [
      True, False]
  # A tensor the fresh side lacks (e.g. KV scales it did not calibrate) counts.
  assert np.asarray(refit.mismatches(held, held._replace(kv_scales=None))).sum() >= 1


def test_refitter_syncs_on_a_new_version_and_checks_every_n():
  logs = []
  r = refit.Refitter(TINY, NAIVE, _act_amax, check_every=2, log=logs.append)
  params = _params()
  held, m = r(params, 0)
  assert m == {"refit/mismatched_tensors": 0.0} and r.syncs == 1
  # Same version: no sync, no check, the latest check's count again.
  assert r(params, 0) == (held, m) and r.syncs == 1
  assert r(params, 1)[1] == m and r.syncs == 2  # second sync: not checked (every 2)
  pack = r._pack
  r._pack = lambda p: _bump_first_scale(pack(p))  # a broken sync
  _, m = r(params, 2)
  assert m == {"refit/mismatched_tensors": 1.0}
  assert len(logs) == 1 and logs[0].startswith("[warn] refit check: 1 sampler tensor(s)")
  assert "layers_0/attn/k_proj" in logs[0]
  off = refit.Refitter(TINY, NAIVE, _act_amax, check_every=0)
  assert off(params, 0)[1] == {}


def test_loop_rollout_logs_the_check_and_samples_the_held_weights():
  c = tiny.loop_config("nvfp4_naive")
  c.mesh.rules = ()
  c.model.n_layers = 1  # (fewer programs to compile; nothing here depends on the depth)
  c.rl.update(dict(num_prompts=2, group_size=4, max_new_tokens=2))
  logs = []
  trainer = Trainer(build(c), log=logs.append)
  params = init.init_params(trainer.setup.model_cfg, jax.random.key(0))
  _, info = trainer.rollout(params, params, 0, jax.random.key(1), stale=False, sampler_version=0)
  assert info["refit"] == {"refit/mismatched_tensors": 0.0} and not logs
  pack = trainer.refit._pack
  trainer.refit._pack = lambda p: _bump_first_scale(pack(p))
  _, info = trainer.rollout(params, params, 1, jax.random.key(1), stale=False, sampler_version=1)
  assert info["refit"] == {"refit/mismatched_tensors": 1.0}
  assert any(line.startswith("[warn] refit check") for line in logs)


def test_kv_cache_calibration_is_checked_with_the_activation_scales():
  """A quantized KV cache's static K/V amaxes travel in the held act_amax (as the loop's
  calibration returns them, lowrl.sampling.act_scales.calibration_paths): a stale one counts."""
  from lowrl.sampling.act_scales import calibration_paths
  policy = dataclasses.replace(NAIVE, kv_cache="fp8_per_tensor")
  paths = calibration_paths(policy, TINY)
  kv = [p for p in paths if p not in AMAX_PATHS]
  assert kv
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  r = refit.Refitter(TINY, policy, lambda p: calibration.calibrate_act_amax(
      p, tokens, TINY, NAIVE, paths), log=lambda _: None)
  params = _params()
  held = r.quantize(params)
  assert not np.asarray(r.check(held, params)).any()
  stale = dict(held.act_amax, **{kv[0]: held.act_amax[kv[0]] * 2.0})
  assert np.asarray(r.check(held._replace(act_amax=stale), params)).sum() == 1


def test_evaluation_samples_on_the_packed_weights_in_one_decode_program():
  """With the sampler's recipe equal to the trainer's, evaluation samples from the packed weights
  the rollout holds (the prequantized policy), and decodes what the master weights decode, bit
  for bit, greedy and sampled. It compiles one decode program of its own for both (greedy is a
  runtime flag): the rollout's program has another shape (one prefill per group of group_size
  rows, compaction buckets), while an evaluation chunk holds eval_samples rows per prompt,
  prefilled row by row in one bucket."""
  from lowrl.sampling import Sampler, weights
  from lowrl.sampling.generate import _decode_program
  c = tiny.loop_config("nvfp4_recipe")
  c.mesh.rules = ()
  c.model.n_layers = 1
  c.precision.bf16_last_fraction = 0  # (else the one layer is the recipe's BF16 tail)
  c.rl.update(dict(num_prompts=2, group_size=4, max_new_tokens=2))
  c.eval_num_prompts, c.eval_samples = 8, 2  # greedy: one chunk of the rollout's 8 rows; sampled: 2
  trainer = Trainer(build(c))
  s = trainer.setup
  params = init.init_params(s.model_cfg, jax.random.key(0))
  assert weights.is_packed(trainer.refit.pack(params))  # NVFP4 kernels: another program
  trainer.rollout(params, params, 0, jax.random.key(1), stale=False, sampler_version=0)
  packed_policy = weights.prequantized_policy(s.sampler_policy, s.model_cfg)
  programs = _decode_program.cache_info().misses
  trainer.evaluate(params, jax.random.key(2))
  assert _decode_program.cache_info().misses == programs + 1  # greedy and sampled chunks
  # The program generate calls for the chunks.
  program = _decode_program(s.model_cfg, packed_policy, s.sampling, s.plan)
  assert program._cache_size() == 1  # every chunk ran on the packed weights' one program
  key, qk = jax.random.key(3), s.trainer_policy.quant_key(jax.random.key(4))
  _, tokens, mask = trainer._eval_prompts()
  examples = list(range(8))
  greedy, _ = trainer._decode_chunks(trainer._eval_weights(params), examples, tokens, mask, key,
                                     quant_key=qk, act_amax=None, greedy=True)[0]
  sampled, _ = trainer._eval_samples(params, key, quant_key=qk, act_amax=None)[1]
  assert program._cache_size() == 1
  rows = np.repeat(tokens, 2, 0)[8:], np.repeat(mask, 2, 0)[8:]
  for out, config, (t, m), k in ((greedy, s.eval_sampling, (tokens, mask), key),
                                 (sampled, s.sampling, rows, jax.random.fold_in(key, 1))):
    ref = Sampler(s.model_cfg, s.trainer_policy, config, plan=s.plan)(
        params, jnp.asarray(t), jnp.asarray(m), k, quant_key=qk)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
