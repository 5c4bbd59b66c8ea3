"""LoRA adapters (lowrl/models/lora.py): the base at B = 0 bit for bit, the adapter's forward, its
gradients against autodiff of the merged weights, the tree operations and the config errors."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from lowrl import precision
from lowrl.models import init, layout, lora, transformer
from lowrl.models.blocks import QDense, qdot

# Untied head so that `lm_head` can be a target too.
MODEL = dataclasses.replace(tiny.TINY, tie_embeddings=False)
EVERY = lora.ALL_LINEAR + "|lm_head"


def _bits(x):
  return np.asarray(x).view(np.uint32)


def _tokens(model_cfg, shape=(2, 8), seed=2):
  return jax.random.randint(jax.random.key(seed), shape, 0, model_cfg.vocab_size)


def _random_b(adapters, seed=3, scale=0.1):
  """Adapters with B drawn too (B = 0 would hide every adapter bug behind a zero product)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
  out = []
  for i, (kp, x) in enumerate(leaves):
    if kp[-1].key == lora.B:
      x = scale * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), x.shape)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "nvfp4_recipe", "mxfp8"])
@pytest.mark.parametrize("scan", [False, True])
def test_zero_b_gives_the_base_logits_bit_for_bit(recipe, scan):
  mc = dataclasses.replace(MODEL, scan_layers=scan)
  policy = precision.policy_for(recipe, layout.matmuls(mc))
  params = init.init_params(mc, jax.random.key(0))
  cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=EVERY)
  merged = lora.merge(params, lora.init_adapters(cfg, mc, jax.random.key(1)))
  tokens = _tokens(mc)
  base = transformer.forward(params, tokens, mc, policy)
  adapted = transformer.forward(merged, tokens, mc, lora.adapter_policy(policy, cfg))
  np.testing.assert_array_equal(_bits(adapted), _bits(base))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapted_matmul_is_base_plus_scaled_low_rank_product(dtype):
  # One layer's q_proj output: the base's matmul (NVFP4 here) + ((x A) B) alpha / r, the
  # adapter in its own precision. Reference: the same function written out with jnp.
  mc = MODEL
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(mc))
  cfg = lora.LoraConfig(rank=4, alpha=6.0, targets=r"layers_0/attn/q_proj", dtype=dtype)
  params = init.init_params(mc, jax.random.key(0))
  adapters = _random_b(lora.init_adapters(cfg, mc, jax.random.key(1)))
  merged = lora.merge(params, adapters)
  tokens = _tokens(mc)
  full = transformer.forward(merged, tokens, mc, lora.adapter_policy(policy, cfg))
  base = transformer.forward(params, tokens, mc, policy)
  assert not np.array_equal(np.asarray(full), np.asarray(base))  # the adapter is live

  x = jax.random.normal(jax.random.key(4), (2, 8, mc.d_model)).astype(policy.dtype)
  q = params["layers_0"]["attn"]["q_proj"]
  a = adapters["layers_0"]["attn"]["q_proj"][lora.A]
  b = adapters["layers_0"]["attn"]["q_proj"][lora.B]
  dense = QDense(mc.q_dim, "attn/q_proj", 0, lora.adapter_policy(policy, cfg))
  got = dense.apply({"params": {**q, lora.A: a, lora.B: b}}, x, None)
  base_y = QDense(mc.q_dim, "attn/q_proj", 0, policy).apply({"params": q}, x, None)
  # The base's FP32 output (before the cast to the compute dtype) plus the adapter term.
  y32 = dense.apply({"params": q}, x, method=lambda m, x: qdot(
      m, x, q["kernel"], 0, policy, 0, "attn/q_proj", None, None, "amax"))
  dt = jnp.dtype(dtype)
  xa = jnp.dot(x.astype(dt), a.astype(dt), preferred_element_type=jnp.float32)
  want = (y32 + jnp.dot(xa.astype(dt), b.astype(dt), preferred_element_type=jnp.float32)
          * jnp.float32(cfg.scale)).astype(policy.dtype)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(got), np.asarray(base_y))
  assert got.dtype == base_y.dtype


def test_adapter_gradients_match_autodiff_of_the_merged_weights():
  """FP32, unquantized: d loss / d(A, B) through the adapter forward vs autodiff of the merged
  model W' = W + A B alpha / r. Both are FP32 evaluations of the same function of (A, B); they
  differ only in rounding order: the adapter path sums x W and (x A) B separately, the merged one
  rounds W + A B s once. Per dot product of length n <= 64 the relative error is <= n u
  (u = 2^-24, Higham's bound) of the sum of |terms|; through 2 layers, attention and the
  log-softmax this stays below ~1e-4 of the gradient's largest entry, the bound asserted
  (observed ~1e-6)."""
  mc = MODEL
  policy = precision.policy_for("fp32", layout.matmuls(mc))
  cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=EVERY)
  params = init.init_params(mc, jax.random.key(0))
  adapters = _random_b(lora.init_adapters(cfg, mc, jax.random.key(1)))
  tokens = _tokens(mc)
  w_t = jax.random.normal(jax.random.key(7), (2, 8, mc.vocab_size))

  def loss(logits):
    return jnp.sum(jax.nn.log_softmax(logits) * w_t)

  adapted = lambda a: loss(transformer.forward(lora.merge(params, a), tokens, mc,  # noqa: E731
                                               lora.adapter_policy(policy, cfg)))
  merged = lambda a: loss(transformer.forward(  # noqa: E731
      lora.merged_kernels(lora.merge(params, a), cfg.scale), tokens, mc, policy))
  g = jax.grad(adapted)(adapters)
  g_ref = jax.grad(merged)(adapters)
  for (kp, x), y in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_ref)):
    x, y = np.asarray(x), np.asarray(y)
    assert np.abs(y).max() > 0, kp
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * np.abs(y).max(), err_msg=str(kp))


def test_quantized_base_gets_no_gradient_and_adapters_do():
  """Under NVFP4 (the recipe's backward), differentiating the adapters only: the base is a
  constant of the program (no weight-gradient GEMM), and A and B both get gradients (B's
  through x A, A's through B != 0)."""
  mc = MODEL
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(mc))
  cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.ALL_LINEAR)
  params = init.init_params(mc, jax.random.key(0))
  adapters = _random_b(lora.init_adapters(cfg, mc, jax.random.key(1)))
  tokens = _tokens(mc)
  f = lambda a: jnp.mean(transformer.forward(  # noqa: E731
      lora.merge(params, a), tokens, mc, lora.adapter_policy(policy, cfg)) ** 2)
  g = jax.grad(f)(adapters)
  assert jax.tree.structure(g) == jax.tree.structure(adapters)
  assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))


def test_split_merge_round_trip_and_targets():
  mc = MODEL
  params = init.init_params(mc, jax.random.key(0))
  cfg = lora.LoraConfig(rank=2, alpha=2.0, targets=r"layers_1/mlp/(up|down)_proj|lm_head")
  adapters = lora.init_adapters(cfg, mc, jax.random.key(1))
  assert [m.full_path for m in lora.targets(cfg, mc)] == [
      "layers_1/mlp/up_proj", "layers_1/mlp/down_proj", "lm_head"]
  assert adapters["layers_1"]["mlp"]["up_proj"][lora.A].shape == (mc.d_model, 2)
  assert adapters["layers_1"]["mlp"]["down_proj"][lora.B].shape == (2, mc.d_model)
  assert adapters["lm_head"][lora.B].shape == (2, mc.vocab_size)
  np.testing.assert_array_equal(adapters["lm_head"][lora.B], 0)
  bound = 1 / np.sqrt(mc.d_model)
  assert float(jnp.abs(adapters["lm_head"][lora.A]).max()) <= bound
  merged = lora.merge(params, adapters)
  base, back = lora.split(merged)
  assert jax.tree.structure(base) == jax.tree.structure(params)
  assert jax.tree.structure(back) == jax.tree.structure(adapters)
  assert lora.has_adapters(merged) and not lora.has_adapters(params)
  # Deterministic in the key, different across keys.
  again = lora.init_adapters(cfg, mc, jax.random.key(1))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(adapters),
                                                  jax.tree.leaves(again)))


def test_adapters_without_adapter_precision_raise():
  mc = MODEL
  policy = precision.policy_for("fp32", layout.matmuls(mc))
  cfg = lora.LoraConfig(rank=2, alpha=2.0)
  merged = lora.merge(init.init_params(mc, jax.random.key(0)),
                      lora.init_adapters(cfg, mc, jax.random.key(1)))
  with pytest.raises(ValueError, match="adapter_policy"):
    transformer.forward(merged, _tokens(mc), mc, policy)


@pytest.mark.parametrize("kw, match", [
    (dict(rank=0), r"lora\.rank=0: must be >= 1"),
    (dict(rank=-2), r"lora\.rank=-2"),
    (dict(rank=33), r"lora\.rank=33 exceeds"),
    (dict(targets="layers_\\d+/attn/qq_proj"), "matches no matmul"),
    (dict(targets="("), "not a valid regex"),
    (dict(alpha=0.0), r"lora\.alpha"),
    (dict(dtype="float16"), r"lora\.dtype"),
])
def test_config_errors(kw, match):
  cfg = lora.LoraConfig(**{**dict(rank=4, alpha=8.0), **kw})
  with pytest.raises(ValueError, match=match) as e:
    lora.check(cfg, MODEL)
  assert "\n" not in str(e.value)


def test_tied_head_and_routed_experts_are_refused():
  with pytest.raises(ValueError, match="tied to the embedding"):
    lora.check(lora.LoraConfig(rank=2, alpha=2.0, targets="lm_head"), tiny.FULL)
  with pytest.raises(ValueError, match="routed experts"):
    lora.check(lora.LoraConfig(rank=2, alpha=2.0, targets=r".*/experts/.*"), tiny.MOE)
  # The shared expert and the attention of a MoE model are plain QDense layers: allowed.
  hit = lora.check(lora.LoraConfig(rank=2, alpha=2.0, targets=r".*(attn/q_proj|shared_expert/"
                                   r"up_proj)"), tiny.MOE)
  assert all(re.search("q_proj|shared_expert", m.full_path) for m in hit)
