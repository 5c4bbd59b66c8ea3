"""The sampler with a quantized KV cache: exact mode holds when both sides quantize K/V alike, the
KV-cache decode samples that distribution, the trainer (unquantized K/V) sees the KV part of the
mismatch, and the loop logs that part (`kv/*`) and validates the knob."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import precision, sampling
from lowrl.models import calibration, init, layout, logprobs
from lowrl.models.config import ModelConfig
from lowrl.rl.mismatch import mismatch_metrics
from lowrl.sampling import SamplingConfig
from lowrl.sampling.act_scales import calibration_paths
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer

KV16 = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=64, max_seq_len=32)
BF16 = precision.policy_for("bf16", layout.matmuls(KV16))
RL = SamplingConfig(max_new_tokens=6, temperature=1.0)
PROMPTS = jax.random.randint(jax.random.key(1), (16, 4), 0, 64)
MASK = jnp.ones(PROMPTS.shape, bool)
logprobs_jit = jax.jit(logprobs.token_logprobs, static_argnames=("model_cfg", "policy"))


@functools.lru_cache(maxsize=None)
def _params():
  p = init.init_params(KV16, jax.random.key(0))
  # A sharper head (logits x4) so that KV quantization moves the logprobs measurably.
  return {**p, "lm_head": {"kernel": p["lm_head"]["kernel"] * 4.0}}


def _amax(policy):
  tokens = jax.random.randint(jax.random.key(2), (8, 10), 0, 64)
  return calibration.calibrate_act_amax(_params(), tokens, KV16, BF16,
                                        calibration_paths(policy, KV16))


@pytest.mark.parametrize("mode", ["fp8_per_tensor", "nvfp4"])
def test_exact_mode_with_a_quantized_kv_cache_is_the_trainers_program(mode):
  policy = dataclasses.replace(BF16, kv_cache=mode)
  amax = _amax(policy)
  out = sampling.Sampler(KV16, policy, RL, exact=True)(_params(), PROMPTS, MASK,
                                                        jax.random.key(3), act_amax=amax)
  decoded, _ = sampling.generate(_params(), PROMPTS, MASK, jax.random.key(3), model_cfg=KV16,
                                 policy=policy, config=RL, act_amax=amax)
  comp = np.asarray(out.completion_mask) > 0
  np.testing.assert_array_equal(out.tokens, decoded.tokens)
  # Bit-identical to a trainer scoring with the same quantized KV (same program, same inputs).
  same = logprobs_jit(_params(), out.tokens, KV16, policy, mask_BT=out.attention_mask,
                      act_amax=amax)
  np.testing.assert_array_equal(np.asarray(out.logprobs)[comp], np.asarray(same)[comp])
  # The decode samples that distribution up to KV-cache rounding: the [B, 1] decode and [B, L]
  # forward round K/V in BF16 alike up to reassociation, which now and then moves a value across an
  # FP8/FP4 rounding boundary (measured: 1 token of 96 off by 7e-3, the rest within 5e-7). That is
  # far below the KV quantization's own effect, which a trainer with unquantized K/V sees (0.03
  # nats mean for fp8 here): the decode records the quantized-KV distribution, not the BF16 one.
  nokv = np.asarray(logprobs_jit(_params(), out.tokens, KV16, BF16, mask_BT=out.attention_mask))
  cache_err = np.abs(np.asarray(decoded.logprobs - out.logprobs))[comp]
  kv_part = np.abs(np.asarray(out.logprobs) - nokv)[comp]
  assert np.median(cache_err) < 1e-5 and cache_err.mean() < kv_part.mean() / 10


def test_a_quantized_kv_cache_needs_static_scales():
  policy = dataclasses.replace(BF16, kv_cache="fp8_per_head")
  with pytest.raises(ValueError, match="quantizes the KV cache .*calibration_paths"):
    sampling.generate(_params(), PROMPTS, MASK, jax.random.key(0), model_cfg=KV16,
                      policy=policy, config=RL)
  with pytest.raises(ValueError, match=r"act_amax lacks .*layers_0/attn/k_cache"):
    sampling.generate(_params(), PROMPTS, MASK, jax.random.key(0), model_cfg=KV16,
                      policy=policy, config=RL, act_amax={"lm_head": jnp.float32(1.0)})


def test_loop_validates_the_knob_in_one_line():
  c = tiny.loop_config("bf16")
  c.sampler_precision.kv_cache = "fp9"
  with pytest.raises(ValueError, match=r"^--config.sampler_precision.kv_cache='fp9': use one of"):
    build(c)
  c = tiny.loop_config("bf16")
  c.model.head_dim = 8
  c.sampler_precision.kv_cache = "nvfp4"
  with pytest.raises(ValueError, match="head_dim % 16 == 0"):
    build(c)


@pytest.mark.parametrize("packed", [False, True])
def test_loop_logs_the_kv_share_which_is_the_whole_mismatch_when_only_kv_differs(packed):
  """Also with rl.pack_tokens: the KV share re-scores on the packed rows exact mode records on,
  so the equality stays exact."""
  c = tiny.loop_config("bf16")
  c.sampler_precision.kv_cache = "fp8_per_tensor"
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4))
  if packed:
    c.rl.pack_tokens = 2 * (build(c).task.max_prompt_len + 4)
  setup = build(c)
  assert setup.sampler_policy.kv_cache == "fp8_per_tensor"
  assert setup.trainer_policy.kv_cache == "none"
  trainer = Trainer(setup, log=lambda _: None)
  params = init.init_params(setup.model_cfg, jax.random.key(0))
  amax = trainer.act_amax(params, setup.sampler_policy)  # recalibrated from the synced weights
  assert set(amax) == {f"layers_{i}/attn/{t}_cache" for i in range(2) for t in "kv"}
  rollout, info = trainer.rollout(params, params, 0, jax.random.key(1), stale=False)
  kv = info["kv"]
  # Same weights and recipe on both sides: the sampler/trainer mismatch is the KV cache's alone.
  whole = mismatch_metrics(rollout.out.logprobs, rollout.logp_now_BT,
                           rollout.out.completion_mask)
  assert {f"kv/{k}" for k in whole} == set(kv)
  for k, v in whole.items():
    assert float(kv[f"kv/{k}"]) == float(v), k
  assert float(kv["kv/abs_dlogp_mean"]) > 1e-4
  # An unquantized cache logs no kv/* part.
  c.sampler_precision.kv_cache = "none"
  plain = Trainer(build(c), log=lambda _: None)
  assert plain.rollout(params, params, 0, jax.random.key(1), stale=False)[1]["kv"] == {}
