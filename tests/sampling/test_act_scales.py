"""Per-tensor activation scales: static calibrated amaxes make a sampler row-local and causal, so
the logprobs it records are those of the distribution it sampled from (docs/reference.md §2).

Tiny model (the "tiny" preset, V=64, d=32, 2 layers), random init; nvfp4_naive scales every
activation per tensor. Token 63's embedding is made one-hot so that its normalised activation
(sqrt(32) ~ 5.7) is the largest any token can have: where it appears, a batch amax changes.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl.models import layout
from lowrl import precision
from lowrl.models import calibration, init, logprobs, transformer
from lowrl.quant.config import QDotConfig, QuantConfig
from lowrl import sampling
from lowrl.sampling import SamplingConfig

TINY = tiny.TINY
SPIKE = 63  # the token with the one-hot embedding
NAIVE = precision.policy_for("nvfp4_naive", layout.matmuls(TINY))
NAIVE_FP32 = precision.policy_for("nvfp4_naive", layout.matmuls(TINY), compute_dtype="float32")
BF16 = precision.policy_for("bf16", layout.matmuls(TINY))
FP32 = precision.PrecisionPolicy.unquantized(layout.matmuls(TINY))
N = 6
RL = SamplingConfig(max_new_tokens=N, temperature=1.0)
PATHS = NAIVE.act_paths(layout.matmuls(TINY), "tensor")

forward_jit = jax.jit(transformer.forward, static_argnames=("model_cfg", "policy"))
logprobs_jit = jax.jit(logprobs.token_logprobs, static_argnames=("model_cfg", "policy"))
calibrate_jit = jax.jit(calibration.calibrate_act_amax,
                        static_argnames=("model_cfg", "policy", "paths"))


@functools.lru_cache(maxsize=None)
def _params():
  p = init.init_params(TINY, jax.random.key(0))
  emb = p["embed"]["embedding"].at[SPIKE].set(jax.nn.one_hot(0, TINY.d_model) * 3.0)
  # A sharper head (logits x4) so that sampler and trainer distributions differ measurably.
  return {**p, "embed": {"embedding": emb},
          "lm_head": {"kernel": p["lm_head"]["kernel"] * 4.0}}


# One batch shape for the sampled and scored batches below ([128, 4] prompts + N = 6 tokens), so
# the tests that score or sample the same way share one compiled program.
PROMPT_SHAPE = (128, 4)
SHAPE = (PROMPT_SHAPE[0], PROMPT_SHAPE[1] + N)


def _tokens(seed, shape=SHAPE):
  # Ordinary tokens only (the spike is placed by the tests that need it).
  return jax.random.randint(jax.random.key(seed), shape, 0, SPIKE, jnp.int32)


@functools.lru_cache(maxsize=None)
def _amax():
  return calibrate_jit(_params(), _tokens(100, (16, 12)), model_cfg=TINY, policy=BF16,
                       paths=PATHS)


# ----------------------------------------------------------------------------------------------
# Classification and calibration.


def test_activation_scaling_of_each_recipe():
  def kinds(name, **kw):
    policy = precision.policy_for(name, layout.matmuls(TINY), **kw)
    return {precision.activation_scaling(policy.qdot_config(m.full_path))
            for m in layout.matmuls(TINY) if m.layer is not None}
  assert kinds("bf16") == {"none"}
  assert kinds("nvfp4_naive") == {"tensor"}
  assert kinds("mxfp8") == {"row"}  # MX blocks along the contracting axis
  assert kinds("nvfp4_recipe") == {"row", "none"}  # per-token outer scale; BF16 tail layer
  assert kinds("nvfp4_naive", act_per_token=True) == {"row"}
  assert PATHS == tuple(f"layers_{i}/{p}" for i in range(2) for p in layout.BLOCK_MATMULS)
  assert precision.policy_for("nvfp4_recipe", layout.matmuls(TINY)).act_paths(layout.matmuls(TINY), "tensor") == ()
  # Per-tensor FP8 activations; 2-D (16-token) activation tiles; the LM head when quantized.
  assert precision.activation_scaling(QDotConfig(QuantConfig("fp8_e4m3"), None)) == "tensor"
  assert precision.activation_scaling(
      QDotConfig(QuantConfig("nvfp4", block_2d=True), None)) == "tile"
  head = precision.policy_for("nvfp4_naive", layout.matmuls(TINY), quantize_lm_head=True)
  assert head.act_paths(layout.matmuls(TINY), "tensor")[-1] == "lm_head"


def test_calibration_is_the_masked_max_of_each_matmul_input():
  # Layer 0's q/k/v input is RMSNorm(embedding) (norm scale 1 at init): reference in float64.
  params = _params()
  tokens = np.array(_tokens(1, (4, 9)))
  mask = np.ones(tokens.shape, bool)
  mask[1, :3] = False  # left padding
  mask[2, 7:] = False  # right padding
  tokens[1, 1] = SPIKE  # under padding: must not count
  tokens[3, 4] = SPIKE  # real: must count
  emb = np.asarray(params["embed"]["embedding"], np.float64)[tokens]
  normed = emb / np.sqrt(np.mean(emb ** 2, -1, keepdims=True) + TINY.rms_eps)
  want = np.abs(normed).max(-1)[mask].max()
  paths = ("layers_0/attn/q_proj", "layers_0/attn/v_proj", "layers_1/mlp/down_proj")
  got = calibrate_jit(params, jnp.asarray(tokens), model_cfg=TINY, policy=FP32, paths=paths,
                      mask_BT=jnp.asarray(mask))
  assert set(got) == set(paths)
  # FP32 RMSNorm against float64: a few ulps.
  np.testing.assert_allclose(got["layers_0/attn/q_proj"], want, rtol=1e-6)
  # The spike counted once: sqrt(D), up to rms_eps (relative eps * D / 9 / 2 ~ 2e-6).
  np.testing.assert_allclose(want, np.sqrt(TINY.d_model), rtol=1e-5)
  assert float(got["layers_0/attn/v_proj"]) == float(got["layers_0/attn/q_proj"])
  # Without the real spike the max is an ordinary token's, not the padded spike's.
  mask[3, 4] = False
  got = calibrate_jit(params, jnp.asarray(tokens), model_cfg=TINY, policy=FP32, paths=paths,
                      mask_BT=jnp.asarray(mask))
  want = np.abs(normed).max(-1)[mask].max()
  assert want < 4.0
  np.testing.assert_allclose(got["layers_0/attn/q_proj"], want, rtol=1e-6)
  with pytest.raises(ValueError, match="no matmul"):
    calibration.calibrate_act_amax(params, jnp.asarray(tokens), TINY, FP32, ("layers_9/mlp/x",))


# ----------------------------------------------------------------------------------------------
# Row-locality and causality (identical programs on identical rows: bit for bit).


def _logp(tokens, act_amax, policy=NAIVE, mask=None):
  """The trainer's scores (an all-ones mask when none is given: the mask a finished rollout of
  full prompts without stop tokens has, so scoring programs are shared). Tokens and mask go in
  uncommitted, made-up ones as sampled ones (which the sampler leaves placed on its one-device
  mesh): a placed input would make another program of the same computation."""
  mask = jnp.ones(tokens.shape, jnp.float32) if mask is None else mask
  tokens, mask = (jnp.asarray(np.asarray(x)) for x in (tokens, mask))
  return np.asarray(logprobs_jit(_params(), tokens, model_cfg=TINY, policy=policy, mask_BT=mask,
                                 act_amax=act_amax))


def test_static_scales_are_row_local_and_causal_dynamic_ones_are_not():
  tokens = _tokens(2)  # [128, 10]
  others = tokens.at[1:].set(_tokens(3)[1:]).at[1:, 5].set(SPIKE)  # other rows changed
  later = tokens.at[0, 8:].set(SPIKE)  # row 0's later tokens changed
  for act_amax in (_amax(), None):
    base = _logp(tokens, act_amax)
    row_local = np.array_equal(_logp(others, act_amax)[0], base[0])
    causal = np.array_equal(_logp(later, act_amax)[0, :8], base[0, :8])  # scores tokens < 8
    if act_amax is None:  # the batch amax: another row's spike changes row 0, as do later tokens
      assert not row_local and not causal
    else:
      assert row_local and causal


def test_static_scale_sampler_records_the_distribution_it_sampled_from():
  prompts = _tokens(4, (8, 5))
  mask = jnp.ones(prompts.shape, bool)
  out, _ = sampling.generate(_params(), prompts, mask, jax.random.key(5), model_cfg=TINY,
                             policy=NAIVE_FP32, config=RL, act_amax=_amax())
  comp = np.asarray(out.completion_mask) > 0
  assert comp.sum() == 8 * N
  # Reference: each row alone, one full forward with the same static scales, log-softmax in
  # float64. Both sides quantize with the same scales; the [1, L] forward and the [B, 1] decode
  # steps differ only by FP32 reassociation (~1e-6 in the logits; no NVFP4 code sits that close
  # to a rounding boundary here), far below the 1e-4 allowed and the ~0.1 nats a batch-amax
  # rescore is off by (checked below).
  ref = np.zeros(out.tokens.shape)
  for b in range(8):
    logits = np.asarray(forward_jit(_params(), out.tokens[b:b + 1], model_cfg=TINY,
                                    policy=NAIVE_FP32, act_amax=_amax()), np.float64)[0]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ref[b, 1:] = logits[np.arange(logits.shape[0] - 1), np.asarray(out.tokens[b, 1:])] - logz[:-1]
  np.testing.assert_allclose(np.asarray(out.logprobs)[comp], ref[comp], atol=1e-4)
  # The batch-amax rescore of the same sequences is not what was sampled from.
  dynamic = _logp(out.tokens, None, NAIVE_FP32)
  assert np.mean(np.abs(dynamic[comp] - ref[comp])) > 1e-2


def test_exact_mode_with_static_scales_is_the_trainers_program():
  prompts = _tokens(6, PROMPT_SHAPE)
  mask = jnp.ones(prompts.shape, bool)
  s = sampling.Sampler(TINY, NAIVE, RL, exact=True)
  out = s(_params(), prompts, mask, jax.random.key(7), act_amax=_amax())
  kv, _ = sampling.generate(_params(), prompts, mask, jax.random.key(7), model_cfg=TINY,
                            policy=NAIVE, config=RL, act_amax=_amax())
  comp = np.asarray(out.completion_mask) > 0
  np.testing.assert_array_equal(out.tokens, kv.tokens)
  # Bit-identical to a trainer in the sampler's precision scoring with the same static scales.
  np.testing.assert_array_equal(out.logprobs[comp],
                                _logp(out.tokens, _amax(), mask=out.attention_mask)[comp])
  # And the distribution sampled from up to KV-cache rounding (BF16 activations and cache).
  assert np.max(np.abs(np.asarray(out.logprobs - kv.logprobs))[comp]) < 1e-2


# ----------------------------------------------------------------------------------------------
# Importance weights: E_q[pi_trainer / pi_sampler] = 1.


@pytest.mark.parametrize("sampler_name, trainer_name", [
    ("nvfp4_naive", "bf16"), ("nvfp4_naive", "nvfp4_naive"), ("nvfp4_recipe", "bf16"),
    ("bf16", "nvfp4_naive")])
def test_mean_importance_weight_is_one(sampler_name, trainer_name):
  sampler_policy = precision.policy_for(sampler_name, layout.matmuls(TINY))
  trainer_policy = precision.policy_for(trainer_name, layout.matmuls(TINY))
  prompts = _tokens(8, PROMPT_SHAPE)
  act_amax = _amax() if sampler_policy.act_paths(layout.matmuls(TINY), "tensor") else None
  out, _ = sampling.generate(_params(), prompts, jnp.ones(prompts.shape, bool), jax.random.key(9),
                             model_cfg=TINY, policy=sampler_policy, config=RL, act_amax=act_amax)
  comp = np.asarray(out.completion_mask) > 0
  # The trainer's own scaling (dynamic per tensor for nvfp4_naive), as the loop scores pi_old.
  trainer = _logp(out.tokens, None, trainer_policy, mask=out.attention_mask)
  w = np.exp(trainer[comp] - np.asarray(out.logprobs)[comp])
  # Given everything sampled before it, a token's weight has mean exactly 1 (q is the distribution
  # sampled from), so the weights minus 1 are martingale differences: uncorrelated, and the
  # standard error of their mean is std / sqrt(n). 5 standard errors: a false alarm ~6e-7.
  se = w.std() / np.sqrt(w.size)
  assert 0 < se and abs(w.mean() - 1.0) < 5 * se, (w.mean(), se)
  assert abs(np.mean(np.log(w))) > 1e-3  # the pair does differ (else the test says nothing)


# ----------------------------------------------------------------------------------------------
# Refusals (before any compile).


def test_samplers_refuse_scales_that_are_not_row_local():
  prompts = _tokens(10, (2, 3))
  mask = jnp.ones(prompts.shape, bool)
  gen = functools.partial(sampling.generate, _params(), prompts, mask, jax.random.key(0),
                          model_cfg=TINY, config=RL)
  with pytest.raises(ValueError, match=r"per tensor.*act_amax=.*act_per_token"):
    gen(policy=NAIVE)
  with pytest.raises(ValueError, match=r"per tensor.*act_per_token"):
    sampling.Sampler(TINY, NAIVE, RL, exact=True)(_params(), prompts, mask, jax.random.key(0))
  partial = {k: v for k, v in _amax().items() if k != "layers_1/mlp/down_proj"}
  with pytest.raises(ValueError, match=r"lacks.*layers_1/mlp/down_proj"):
    gen(policy=NAIVE, act_amax=partial)
  tiles = precision.PrecisionPolicy(
      rules=((".*", QDotConfig(QuantConfig("nvfp4", block_2d=True), None)),), name="tiles")
  with pytest.raises(ValueError, match="2-D blocks"):
    gen(policy=tiles)
