"""Shared prefill: each prompt group prefilled once, its KV cache copied to the group's rows.

What must hold (docs/sampling.md, "Shared prefill"): the same tokens, masks and lengths as the
per-row prefill with the same keys (the sampling noise is drawn per row from the same key, so the
distribution sampled is unchanged); exact mode's records bit for bit (they re-score the same
tokens with the same program); KV-cache logprobs within FP32 reassociation (a U-row prefill is
another XLA program than the B-row one: its GEMMs may block, hence sum, differently).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import precision, sampling, sharding
from lowrl.models import init, layout
from lowrl.sampling import SamplingConfig
from lowrl.sampling.generate import prefill_group

# Only the order of FP32 additions inside dot products differs between a U-row and a B-row
# prefill (the values are row-local); as in tests/test_sharding.py (ATOL), reassociated sums of
# O(100) terms move logits and logprobs by ~1e-6 (observed <= 2.2e-6 here), covered by 2e-5.
ATOL = 2e-5
G = 4
# Three prompts (lengths 5, 2, 6) padded left, right and not at all, each repeated G times.
_U_PROMPTS = np.array([[0, 5, 9, 2, 7, 1], [8, 3, 0, 0, 0, 0], [11, 12, 13, 14, 15, 16]])
_U_MASK = np.array([[0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
PROMPTS, PMASK = (jnp.asarray(np.repeat(a, G, axis=0)) for a in (_U_PROMPTS, _U_MASK))
# T = 1 with a stop token, so rows of a group end at different lengths.
CONFIG = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_tokens=(3, 4, 5, 6))


@functools.lru_cache(maxsize=None)
def _params(cfg):
  return init.init_params(cfg, jax.random.key(0))


def _assert_same_rollout(got, ref, atol=ATOL):
  for k in ("tokens", "prompt_mask", "completion_mask", "prompt_lengths", "completion_lengths"):
    np.testing.assert_array_equal(np.asarray(got[k] if isinstance(got, dict) else getattr(got, k)),
                                  np.asarray(getattr(ref, k) if not isinstance(ref, dict)
                                             else ref[k]), err_msg=k)
  for k in ("logprobs", "model_logprobs"):
    a = np.asarray(getattr(got, k) if not isinstance(got, dict) else got[k])
    b = np.asarray(getattr(ref, k) if not isinstance(ref, dict) else ref[k])
    if atol == 0:
      np.testing.assert_array_equal(a, b, err_msg=k)
    else:
      np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=k)


def _generate(cfg, policy, group_size, plan=None, prompts=PROMPTS, mask=PMASK):
  out, _ = sampling.generate(_params(cfg), prompts, mask, jax.random.key(3), model_cfg=cfg,
                             policy=policy, config=CONFIG, group_size=group_size, plan=plan)
  return out


@pytest.mark.parametrize("recipe", ["fp32", "nvfp4_recipe"])
def test_shared_prefill_samples_what_the_per_row_prefill_samples(recipe):
  cfg = tiny.TINY
  policy = precision.policy_for(recipe, layout.matmuls(cfg))
  ref = _generate(cfg, policy, 1)
  shared = _generate(cfg, policy, G)
  _assert_same_rollout(shared, ref)
  # The rows of a group share a prompt and a cache, not their samples.
  comp = np.asarray(shared.tokens[:, PROMPTS.shape[1]:]).reshape(3, G, -1)
  assert any(len({tuple(r) for r in grp}) > 1 for grp in comp)
  assert 0 < float(shared.completion_mask.sum()) < shared.completion_mask[:, 6:].size


def test_shared_prefill_with_a_stacked_cache():
  cfg = dataclasses.replace(tiny.DEEP, scan_layers=True)  # [L, B, S, K, hd] cache
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  _assert_same_rollout(_generate(cfg, policy, G), _generate(cfg, policy, 1))


def test_exact_mode_records_are_bitwise_and_the_trainers_pi_old():
  cfg = tiny.TINY
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  sampler = sampling.Sampler(cfg, policy, CONFIG, exact=True)
  ref = sampler(_params(cfg), PROMPTS, PMASK, jax.random.key(3))
  shared = sampler(_params(cfg), PROMPTS, PMASK, jax.random.key(3), group_size=G)
  _assert_same_rollout(shared, ref, atol=0)
  # The trainer's pi_old (the same scoring program on the same tokens) is the record itself.
  pi_old = sampling.rescore(shared, _params(cfg), model_cfg=cfg, policy=policy, config=CONFIG,
                            plan=sharding.single_device_plan())
  np.testing.assert_array_equal(np.asarray(pi_old.logprobs), np.asarray(shared.logprobs))


def test_data_parallel_shared_prefill_matches_one_device():
  cfg = tiny.SHARDABLE
  policy = precision.PrecisionPolicy.unquantized(layout.matmuls(cfg))
  plan = sharding.ShardingPlan(sharding.make_mesh((8, 1), ("data", "model")),
                               rules=sharding.DEFAULT_RULES)
  # 4 prompts x 4 rows = 16 rows over 8 shards: each shard holds 2 rows of one group, so pairs
  # of rows share a prefill (prefill_group) and every shard prefills its own prompt.
  prompts = jnp.asarray(np.repeat(np.arange(1, 25).reshape(4, 6) % 60 + 1, G, axis=0))
  mask = jnp.ones_like(prompts)
  assert prefill_group(16, G, plan.batch_shards, policy) == 2
  ref = _generate(cfg, policy, 1, prompts=prompts, mask=mask)
  params = plan.put(_params(cfg), plan.param_shardings(_params(cfg)))
  out, _ = sampling.generate(params, prompts, mask, jax.random.key(3), model_cfg=cfg,
                             policy=policy, config=CONFIG, group_size=G, plan=plan)
  assert out.tokens.sharding.spec == jax.sharding.PartitionSpec("data")
  _assert_same_rollout(out, ref)


def test_moe_routing_records_follow_the_rows():
  cfg = tiny.MOE
  policy = precision.policy_for("nvfp4_moe_experts", layout.matmuls(cfg))
  sampler = sampling.Sampler(cfg, policy, CONFIG, exact=True, record_routing=True)
  ref = sampler(_params(cfg), PROMPTS, PMASK, jax.random.key(3))
  shared = sampler(_params(cfg), PROMPTS, PMASK, jax.random.key(3), group_size=G)
  _assert_same_rollout(shared, ref, atol=0)
  assert set(shared.routing) == set(ref.routing)
  for name, ids in ref.routing.items():  # each row's own tokens' experts, row by row
    np.testing.assert_array_equal(np.asarray(shared.routing[name]), np.asarray(ids), err_msg=name)


def test_prefill_group_choice():
  fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(tiny.TINY))
  assert prefill_group(64, 8, 1, fp32) == 8
  assert prefill_group(16, 8, 8, fp32) == 2  # 2 rows per shard, one group's
  assert prefill_group(24, 8, 8, fp32) == 1  # 3 rows per shard straddle groups
  assert prefill_group(24, 6, 8, fp32) == 3  # 3 rows per shard: halves of groups
  # Stochastic rounding in the forward: rows sharing a prefill would share its rounding noise.
  sr = precision.policy_for("nvfp4_recipe", layout.matmuls(tiny.TINY), stochastic_rounding="all")
  assert prefill_group(64, 8, 1, sr) == 1
  grad_sr = precision.policy_for("nvfp4_recipe", layout.matmuls(tiny.TINY), backward="quantized",
                                 stochastic_rounding="grad")
  assert prefill_group(64, 8, 1, grad_sr) == 8  # the sampler's forward rounds to nearest
  with pytest.raises(ValueError, match="divide the batch"):
    prefill_group(10, 4, 1, fp32)


def test_rows_of_a_group_must_hold_one_prompt():
  policy = precision.PrecisionPolicy.unquantized(layout.matmuls(tiny.TINY))
  bad = PROMPTS.at[1, 3].set(40)
  with pytest.raises(ValueError, match="prompt groups \\[0\\] differ"):
    _generate(tiny.TINY, policy, G, prompts=bad)
  with pytest.raises(ValueError, match="does not divide the batch"):
    _generate(tiny.TINY, policy, 5)
