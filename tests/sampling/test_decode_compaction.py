"""Decode compaction: live rows move into halving buckets as rows finish.

Each row draws the Gumbel noise it draws uncompacted (`sample_token`'s rows), and its cache
entries move with it, so the tokens, masks and lengths are the uncompacted decode's, in the
original row order; the logprobs are within FP32 reassociation (a b-row decode step is another
XLA program than the B-row one), and exact mode's records, which re-score the same tokens with the
same program, bit for bit.
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
from lowrl.sampling.generate import bucket_sizes, decode_min_rows

# As tests/sampling/test_shared_prefill.py: reassociated FP32 sums of O(100) terms (~1e-6).
ATOL = 2e-5
B, P = 16, 5
_rng = np.random.default_rng(7)
PROMPTS = jnp.asarray(_rng.integers(1, 64, (B, P)).astype(np.int32))
PMASK = jnp.asarray((np.arange(P)[None, :] >= _rng.integers(0, P - 1, (B, 1))).astype(np.int32))
# Ten stop ids of 64: long-tailed lengths (most rows stop within a few tokens, some run to N).
CONFIG = SamplingConfig(max_new_tokens=20, temperature=1.0, stop_tokens=tuple(range(2, 12)))


@functools.lru_cache(maxsize=None)
def _params(cfg):
  return init.init_params(cfg, jax.random.key(0))


def _assert_same(got, ref, atol=ATOL):
  for k in ("tokens", "prompt_mask", "completion_mask", "prompt_lengths", "completion_lengths"):
    np.testing.assert_array_equal(np.asarray(getattr(got, k)), np.asarray(getattr(ref, k)), k)
  for k in ("logprobs", "model_logprobs"):
    np.testing.assert_allclose(np.asarray(getattr(got, k)), np.asarray(getattr(ref, k)),
                               atol=atol, rtol=0, err_msg=k)


def _generate(cfg, policy, min_rows, group_size=1, plan=None, prompts=PROMPTS, mask=PMASK,
              per_halving=1):
  params = _params(cfg) if plan is None else plan.put(_params(cfg),
                                                       plan.param_shardings(_params(cfg)))
  out, cache = sampling.generate(params, prompts, mask, jax.random.key(5), model_cfg=cfg,
                                 policy=policy, config=CONFIG, min_rows=min_rows,
                                 group_size=group_size, plan=plan,
                                 buckets_per_halving=per_halving)
  return out, cache


@pytest.mark.parametrize("recipe", ["fp32", "nvfp4_recipe"])
def test_compacted_decode_samples_what_the_full_decode_samples(recipe):
  cfg = tiny.TINY
  policy = precision.policy_for(recipe, layout.matmuls(cfg))
  ref, ref_cache = _generate(cfg, policy, 0)
  got, cache = _generate(cfg, policy, 2)  # buckets 16, 8, 4, 2
  lengths = np.asarray(ref.completion_lengths)
  assert lengths.max() > 3 * np.median(lengths)  # a long tail: compaction has work to do
  _assert_same(got, ref)
  # The cache handed back for the next call has the full batch's shape.
  assert jax.tree.map(jnp.shape, cache) == jax.tree.map(jnp.shape, ref_cache)


def test_finer_buckets_sample_what_the_full_decode_samples():
  """Three buckets per halving (16, 13, 10, 8, 6, 5, 4, 3, 2, 1 rows): the same statement."""
  cfg = tiny.TINY
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  ref, _ = _generate(cfg, policy, 0)
  got, _ = _generate(cfg, policy, 1, per_halving=3)
  _assert_same(got, ref)


def test_compaction_with_shared_prefill_and_a_stacked_cache():
  cfg = dataclasses.replace(tiny.DEEP, scan_layers=True)  # [L, B, S, K, hd] cache
  policy = precision.policy_for("bf16", layout.matmuls(cfg))
  prompts, mask = jnp.repeat(PROMPTS[:4], 4, axis=0), jnp.repeat(PMASK[:4], 4, axis=0)
  ref, _ = _generate(cfg, policy, 0, prompts=prompts, mask=mask)
  got, _ = _generate(cfg, policy, 1, group_size=4, prompts=prompts, mask=mask)
  _assert_same(got, ref)


def test_data_parallel_compaction_keeps_rows_on_their_shard():
  cfg = tiny.SHARDABLE
  policy = precision.PrecisionPolicy.unquantized(layout.matmuls(cfg))
  plan = sharding.ShardingPlan(sharding.make_mesh((8, 1), ("data", "model")),
                               rules=sharding.DEFAULT_RULES)
  assert bucket_sizes(B, plan.batch_shards, 1) == (16, 8)  # 2 rows per shard, then 1
  ref, _ = _generate(cfg, policy, 0)
  got, cache = _generate(cfg, policy, 1, plan=plan)
  assert got.tokens.sharding.spec == jax.sharding.PartitionSpec("data")
  assert cache["mask"].sharding.spec == jax.sharding.PartitionSpec("data")
  _assert_same(got, ref)


def test_exact_mode_and_moe_routing_records_are_bitwise():
  cfg = tiny.MOE
  policy = precision.policy_for("nvfp4_moe_experts", layout.matmuls(cfg))
  outs = []
  for min_rows, per_halving in ((0, 1), (2, 1), (1, 2)):
    sampler = sampling.Sampler(cfg, policy, CONFIG, exact=True, record_routing=True,
                               decode_min_rows=min_rows, decode_buckets_per_halving=per_halving)
    outs.append([sampler(_params(cfg), PROMPTS, PMASK, jax.random.key(k)) for k in (5, 6)])
  for compacted in outs[1:]:
    for ref, got in zip(outs[0], compacted):  # the second call reuses the donated cache
      _assert_same(got, ref, atol=0)
      for name, ids in ref.routing.items():
        np.testing.assert_array_equal(np.asarray(got.routing[name]), np.asarray(ids), name)


def test_bucket_sizes_and_when_compaction_is_off():
  assert bucket_sizes(256, 1, 8) == (256, 128, 64, 32, 16, 8)
  assert bucket_sizes(256, 1, 0) == (256,)
  assert bucket_sizes(24, 8, 1) == (24,)  # 3 rows per shard do not halve
  assert bucket_sizes(48, 2, 4) == (48, 24, 12)  # 24, 12, 6 per shard; 3 < 4
  # k buckets per halving: rows per shard round(b 2^(-j / k)), distinct, >= min_rows.
  assert bucket_sizes(64, 1, 4, 2) == (64, 45, 32, 23, 16, 11, 8, 6, 4)
  assert bucket_sizes(64, 8, 1, 2) == (64, 48, 32, 24, 16, 8)  # 8, 6, 4, 3, 2, 1 per shard
  assert bucket_sizes(256, 1, 16, 1) == bucket_sizes(256, 1, 16)
  assert bucket_sizes(64, 1, 0, 3) == (64,)
  with pytest.raises(ValueError, match="per_halving=0"):
    bucket_sizes(64, 1, 4, 0)
  fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(tiny.TINY))
  assert decode_min_rows(4, fp32) == 4
  sr = precision.policy_for("nvfp4_recipe", layout.matmuls(tiny.TINY), stochastic_rounding="all")
  assert decode_min_rows(4, sr) == 0  # SR noise is drawn over the whole step's activation
  with pytest.raises(ValueError, match="decode_min_rows=-1"):
    decode_min_rows(-1, fp32)
