"""W4A16 (`nvfp4_w4a16`: NVFP4 weights, activations in the compute dtype): the rollout weights
against an independent NVFP4 reference, unquantized activations, gradients through the
dequantized weights (QAT), exact-mode sampler = trainer, packed weights, sampler-only runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tiny
from quant_reference import exact_fake_quant
from lowrl import precision, sampling
from lowrl.models import init, layout, logprobs
from lowrl.quant import QuantConfig, quantized_dot_general
from lowrl.sampling import SamplingConfig
from lowrl.training.setup import build

TINY = tiny.TINY
W4A16 = precision.policy_for("nvfp4_w4a16", layout.matmuls(TINY))
PROMPTS = jnp.array([[5, 9, 2, 7], [0, 8, 3, 6], [0, 0, 11, 12], [0, 0, 0, 21]])
PMASK = (PROMPTS > 0).astype(jnp.int32).at[:, -1].set(1)
RL = SamplingConfig(max_new_tokens=3, temperature=1.0)


def _params():
  return init.init_params(TINY, jax.random.key(1))


def test_rollout_weights_match_an_independent_nvfp4_reference():
  """Every kernel as the sampler holds it = exact NVFP4 (tests/quant_reference.py) of the
  kernel, blocks along `in`; q/k/v and gate/up with their joint amax (one global scale)."""
  params = _params()
  quantized, policy = sampling.weights.quantize_weights(params, TINY, W4A16)
  assert all(policy.qdot_config(m.full_path).rhs is None for m in layout.matmuls(TINY))
  cfg = QuantConfig("nvfp4", axis=0)
  for layer in range(TINY.n_layers):
    ms = {m.path: m for m in layout.matmuls(TINY) if m.layer == layer}
    groups = [*layout.FUSED_GROUPS, ("attn/o_proj",), ("mlp/down_proj",)]
    for group in groups:
      kernels = [np.asarray(layout.get_param(params, ms[p].param_keys)) for p in group]
      joint = max(np.max(np.abs(k)) for k in kernels)
      for p, k in zip(group, kernels):
        want = exact_fake_quant(k, cfg, tensor_amax=joint if len(group) > 1 else None)
        got = np.asarray(layout.get_param(quantized, ms[p].param_keys))
        np.testing.assert_array_equal(got, want)


def _bf16(x):
  return jnp.asarray(x).astype(jnp.bfloat16)


@pytest.mark.parametrize("use_jit", [False, True])
def test_activations_unquantized_and_gradients_through_dequantized_weights(use_jit):
  """The W4A16 matmul: y = bf16(x) . bf16(dq(W)) (activations untouched); backward=dequantized:
  dx = g . dq(W)^T, dW = bf16(x)^T . g (straight through to the master weight). The reference is
  an FP64 product of the same operands: BF16 x BF16 products are exact in FP32, so the FP32 sums
  differ from it by at most K * 2^-24 * sum |a_i b_i| (K terms, each rounding <= 2^-24)."""
  cfg = W4A16.qdot_config("layers_0/mlp/up_proj")
  assert cfg.lhs is None and cfg.rhs == QuantConfig("nvfp4") and cfg.backward == "dequantized"
  kx, kw, kg = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (8, 64), jnp.float32) * 3.0
  w = jax.random.normal(kw, (64, 32), jnp.float32) * 0.2
  g = jax.random.normal(kg, (8, 32), jnp.float32)
  mm = (((1,), (0,)), ((), ()))

  def run(x, w, g):
    y, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, mm, cfg), x, w)
    return (y,) + vjp(g)

  y, dx, dw = (jax.jit(run) if use_jit else run)(x, w, g)
  dq = exact_fake_quant(np.asarray(w), QuantConfig("nvfp4", axis=0))
  xb = np.asarray(_bf16(x), np.float64)
  wb = np.asarray(_bf16(dq), np.float64)
  gb = np.asarray(_bf16(g), np.float64)

  def close(got, a, b):
    want, bound = a @ b, np.abs(a) @ np.abs(b) * a.shape[1] * 2.0 ** -24
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)

  close(y, xb, wb)          # x enters as bf16(x), not NVFP4-quantized
  close(dx, gb, wb.T)       # dgrad through the dequantized weights
  close(dw, xb.T, gb)       # wgrad on the unquantized activations
  assert np.all(np.isfinite(dw)) and np.any(dw != 0)


def test_qat_gradients_flow_to_every_kernel():
  params = _params()
  tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32)[None], (2, 1))

  def loss(p):
    return -jnp.mean(logprobs.token_logprobs(p, tokens, TINY, W4A16))

  grads = jax.jit(jax.grad(loss))(params)
  for m in layout.matmuls(TINY):
    gk = np.asarray(layout.get_param(grads, m.param_keys))
    assert np.all(np.isfinite(gk)) and np.any(gk != 0), m.full_path


def test_exact_mode_sampler_is_the_trainer_bit_for_bit():
  """Sampler = trainer = nvfp4_w4a16: exact mode's logprobs are the trainer's (mismatch KL 0);
  packed rollout weights sample the same tokens as the master weights."""
  params = _params()
  sampler = sampling.Sampler(TINY, W4A16, RL, exact=True)
  out = sampler(params, PROMPTS, PMASK, jax.random.key(4))
  trainer = jax.jit(logprobs.token_logprobs, static_argnames=("model_cfg", "policy"))(
      params, out.tokens, model_cfg=TINY, policy=W4A16, mask_BT=out.attention_mask)
  comp = np.asarray(out.completion_mask) > 0
  assert comp.sum() > 0
  np.testing.assert_array_equal(np.asarray(out.logprobs)[comp], np.asarray(trainer)[comp])
  packed = sampling.pack_params(params, TINY, W4A16)
  assert 0.5625 <= sampling.packed_bytes(packed)["bytes_per_quantized_param"] < 0.6
  kv = sampling.Sampler(TINY, W4A16, RL)
  a = kv(params, PROMPTS, PMASK, jax.random.key(4))
  b = kv(packed, PROMPTS, PMASK, jax.random.key(4))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_w4a16_sampler_alone_with_a_bf16_trainer_builds():
  c = tiny.loop_config("bf16")
  c.sampler_precision.recipe = "nvfp4_w4a16"
  c.mesh.rules = ()  # the tiny widths don't split into NVFP4 blocks over 8 test devices
  setup = build(c)
  assert setup.trainer_policy.qdot_config("layers_0/attn/q_proj").rhs is None
  sampler = setup.sampler_policy.qdot_config("layers_0/attn/q_proj")
  assert sampler.lhs is None and sampler.rhs.fmt == "nvfp4"
  # Row-local (no activation scales at all): no static calibration needed.
  assert not setup.sampler_policy.act_paths(layout.matmuls(setup.model_cfg), "tensor")
