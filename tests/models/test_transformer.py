"""Decoder: param tree, causality, padding, KV cache, RoPE, logprobs, precision routing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl.models import layout
from lowrl import precision
from lowrl.models import config as model_config
from lowrl.models import blocks, init, logprobs, transformer
from lowrl.models.config import ModelConfig

TINY, FULL = tiny.TINY, tiny.FULL
FP32 = precision.PrecisionPolicy.unquantized(layout.matmuls(TINY))

fwd = jax.jit(transformer.forward, static_argnames=("model_cfg", "policy"))
fwd_cache = jax.jit(transformer.forward_with_cache, static_argnames=("model_cfg", "policy",
                                                                     "last_only"))


@functools.lru_cache(maxsize=None)
def _params(cfg, seed=0):
  return init.init_params(cfg, jax.random.key(seed))


def _tokens(shape, seed=1, vocab=64):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


# ----------------------------------------------------------------------------------------------
# Config and params.


def test_param_tree_matches_architecture():
  cfg = FULL
  params = _params(cfg)
  d, hd, q, kv, f, v = 32, 8, 32, 16, 64, 64
  layer = {"attn_norm": {"scale": (d,)},
           "attn": {"q_proj": {"kernel": (d, q), "bias": (q,)},
                    "k_proj": {"kernel": (d, kv), "bias": (kv,)},
                    "v_proj": {"kernel": (d, kv), "bias": (kv,)},
                    "o_proj": {"kernel": (q, d)},
                    "q_norm": {"scale": (hd,)}, "k_norm": {"scale": (hd,)}},
           "mlp_norm": {"scale": (d,)},
           "mlp": {"gate_proj": {"kernel": (d, f)}, "up_proj": {"kernel": (d, f)},
                   "down_proj": {"kernel": (f, d)}}}
  expected = {"embed": {"embedding": (v, d)}, "layers_0": layer, "layers_1": layer,
              "final_norm": {"scale": (d,)}}  # tied: no lm_head
  shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  assert shapes == expected
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  # Untied, no biases, no qk-norm.
  plain = jax.tree.map(lambda x: tuple(x.shape), _params(TINY))
  assert plain["lm_head"] == {"kernel": (32, 64)}
  assert set(plain["layers_0"]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
  assert set(plain["layers_0"]["attn"]["q_proj"]) == {"kernel"}
  for cfg in (FULL, TINY):
    n = sum(x.size for x in jax.tree.leaves(_params(cfg)))
    assert n == cfg.num_params()


def test_init_is_deterministic_and_respects_param_dtype():
  a = init.init_params(TINY, jax.random.key(7))
  b = init.init_params(TINY, jax.random.key(7))
  c = init.init_params(TINY, jax.random.key(8))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert not np.array_equal(a["embed"]["embedding"], c["embed"]["embedding"])
  bf = jax.eval_shape(lambda: init.init_params(TINY, jax.random.key(7), jnp.bfloat16))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf))
  # Kernels ~ N(0, 1/fan_in), embedding ~ N(0, 1/D), norms 1.
  assert np.std(a["layers_0"]["mlp"]["down_proj"]["kernel"]) == pytest.approx(64 ** -0.5, rel=0.1)
  assert np.std(a["embed"]["embedding"]) == pytest.approx(32 ** -0.5, rel=0.1)
  assert np.all(a["layers_1"]["mlp_norm"]["scale"] == 1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(d_model=0), "d_model"),
    (dict(rope_llama3_scaling=(8.0, 4.0, 1.0, 16)), "rope_llama3_scaling"),
    (dict(rms_eps=0.0), "rms_eps"),
])
def test_model_config_validation(kw, match):
  base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**base, **kw})


def test_presets_param_counts():
  # Public figures: Qwen3-0.6B 0.6B (0.44B without embeddings), Llama-3.2-1B 1.24B.
  assert model_config.preset("qwen3_0_6b").num_params() == pytest.approx(0.596e9, rel=0.01)
  assert model_config.preset("llama3_2_1b").num_params() == pytest.approx(1.236e9, rel=0.01)
  assert model_config.preset("qwen2_5_0_5b").num_params() == pytest.approx(0.494e9, rel=0.01)
  with pytest.raises(ValueError, match="Unknown model preset"):
    model_config.preset("gpt5")


# ----------------------------------------------------------------------------------------------
# RoPE.


def _hf_rope(x_BTNH, positions_BT, inv_freq):
  """Hugging Face `apply_rotary_pos_emb` transcribed to NumPy (float64)."""
  freqs = positions_BT[..., None].astype(np.float64) * inv_freq.astype(np.float64)
  emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  half = x_BTNH.shape[-1] // 2
  rotate_half = np.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
  return x_BTNH * np.cos(emb) + rotate_half * np.sin(emb)


def test_rope_is_hf_rotate_half_and_relative():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 100, size=(2, 5))
  inv = blocks.rope_inv_freq(TINY)
  np.testing.assert_allclose(inv, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8), rtol=1e-6)
  out = np.asarray(blocks.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv))
  np.testing.assert_allclose(out, _hf_rope(x, pos, inv), atol=1e-5)
  # q.k after RoPE depends only on the position difference.
  q, k = x[:1, :1], x[1:, :1]
  dot = lambda i, j: float(np.sum(np.asarray(blocks.apply_rope(  # noqa: E731
      jnp.asarray(q), jnp.full((1, 1), i), inv)) * np.asarray(blocks.apply_rope(
          jnp.asarray(k), jnp.full((1, 1), j), inv))))
  assert dot(10, 3) == pytest.approx(dot(57, 50), abs=1e-4)
  assert dot(10, 3) != pytest.approx(dot(10, 4), abs=1e-3)


def test_llama3_rope_scaling():
  cfg = model_config.preset("llama3_2_1b")
  factor, low, high, orig = cfg.rope_llama3_scaling
  base = 1.0 / cfg.rope_theta ** (np.arange(0, 64, 2) / 64)
  scaled = blocks.rope_inv_freq(cfg)
  wavelen = 2 * np.pi / base
  hi = wavelen < orig / high  # short wavelengths untouched
  lo = wavelen > orig / low  # long wavelengths slowed by `factor`
  mid = ~hi & ~lo
  assert hi.any() and lo.any() and mid.any()
  np.testing.assert_allclose(scaled[hi], base[hi], rtol=1e-6)
  np.testing.assert_allclose(scaled[lo], base[lo] / factor, rtol=1e-6)
  # Medium band: interpolates between the two, monotonically in wavelength.
  assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / factor)
  smooth = (orig / wavelen[mid] - low) / (high - low)
  np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / factor + smooth * base[mid],
                             rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Causality, padding, KV cache.


def test_causality_gradient():
  """d logits[:, :t+1] / d embedding rows of tokens that occur only after t is exactly 0."""
  t = 4
  early = jnp.array([[1, 2, 3, 4, 5]])
  late = jnp.array([[40, 41, 42]])
  tokens = jnp.concatenate([early, late], axis=1)
  params = _params(TINY)

  def early_logits(embedding):
    p = {**params, "embed": {"embedding": embedding}}
    return jnp.sum(transformer.forward(p, tokens, TINY, FP32)[:, :t + 1] ** 2)

  g = jax.jit(jax.grad(early_logits))(params["embed"]["embedding"])
  assert np.all(np.asarray(g[40:43]) == 0.0)
  assert np.all(np.abs(np.asarray(g[1:6])).sum(-1) > 0)  # the early tokens do matter


@pytest.mark.parametrize("name", ["fp32", "nvfp4_recipe"])
def test_causality_perturbation(name):
  """Changing later tokens leaves earlier logits bit-identical (per-token activation scales
  keep NVFP4 quantization causal too)."""
  policy = precision.policy_for(name, layout.matmuls(TINY))
  a = _tokens((2, 8), seed=3)
  b = a.at[:, 6:].set(_tokens((2, 2), seed=4))
  la, lb = fwd(_params(TINY), a, TINY, policy), fwd(_params(TINY), b, TINY, policy)
  np.testing.assert_array_equal(la[:, :6], lb[:, :6])
  assert not np.allclose(la[:, 6:], lb[:, 6:])


def test_padding_does_not_change_real_tokens():
  cfg = FULL
  params = _params(cfg)
  toks = _tokens((1, 6), seed=5)
  ref = fwd(params, toks, cfg, FP32)
  # Left padding (positions from the mask) and right padding both leave the real logits.
  left = jnp.concatenate([jnp.full((1, 3), 7), toks], axis=1)
  left_mask = jnp.array([[0, 0, 0] + [1] * 6])
  right = jnp.concatenate([toks, jnp.full((1, 3), 7)], axis=1)
  right_mask = jnp.array([[1] * 6 + [0, 0, 0]])
  np.testing.assert_allclose(fwd(params, left, cfg, FP32, mask_BT=left_mask)[:, 3:], ref,
                             atol=1e-5)
  np.testing.assert_allclose(fwd(params, right, cfg, FP32, mask_BT=right_mask)[:, :6], ref,
                             atol=1e-5)
  # Changing a padding token changes nothing.
  other = left.at[:, :3].set(11)
  np.testing.assert_array_equal(fwd(params, other, cfg, FP32, mask_BT=left_mask)[:, 3:],
                                fwd(params, left, cfg, FP32, mask_BT=left_mask)[:, 3:])


def test_kv_cache_matches_full_forward_fp32():
  cfg = FULL
  params = _params(cfg)
  batch, length, prefill = 3, 12, 5
  toks = _tokens((batch, length), seed=6)
  mask = jnp.ones((batch, length), bool).at[1, :2].set(False)  # row 1 left-padded
  full = fwd(params, toks, cfg, FP32, mask_BT=mask)
  pos = transformer.positions_from_mask(mask)
  cache = transformer.init_cache(cfg, batch, length, jnp.float32)
  logits, cache = fwd_cache(params, toks[:, :prefill], cache, cfg, FP32,
                            mask_BT=mask[:, :prefill], positions_BT=pos[:, :prefill])
  steps = [logits]
  for t0, t1 in [(5, 7)] + [(t, t + 1) for t in range(7, length)]:  # a 2-token chunk, then 1s
    logits, cache = fwd_cache(params, toks[:, t0:t1], cache, cfg, FP32,
                              mask_BT=mask[:, t0:t1], positions_BT=pos[:, t0:t1])
    steps.append(logits)
  assert int(cache["index"]) == length
  got = jnp.concatenate(steps, axis=1)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(full)[real], atol=2e-5, rtol=1e-5)


def test_cache_longer_than_max_seq_len_is_refused():
  with pytest.raises(ValueError, match="max_seq_len"):
    transformer.init_cache(TINY, 1, TINY.max_seq_len + 1)


# ----------------------------------------------------------------------------------------------
# Logprobs.


def test_token_logprobs_alignment_and_entropy():
  params = _params(TINY)
  toks = _tokens((2, 8), seed=8)
  mask = jnp.ones((2, 8)).at[1, :2].set(0)
  logits = np.asarray(fwd(params, toks, TINY, FP32, mask_BT=mask), np.float64)
  logp, ent = jax.jit(logprobs.token_logprobs_and_entropy, static_argnums=(2, 3))(
      params, toks, TINY, FP32, mask_BT=mask)
  assert logp.dtype == ent.dtype == jnp.float32
  logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  for b in range(2):
    for t in range(8):
      if t == 0 or mask[b, t] == 0 or mask[b, t - 1] == 0:
        assert logp[b, t] == 0 and ent[b, t] == 0
      else:
        assert logp[b, t] == pytest.approx(logsm[b, t - 1, toks[b, t]], abs=1e-5)
        p = np.exp(logsm[b, t - 1])
        assert ent[b, t] == pytest.approx(-(p * logsm[b, t - 1]).sum(), abs=1e-5)
  only_logp = jax.jit(logprobs.token_logprobs, static_argnums=(2, 3))(params, toks, TINY, FP32,
                                                                         mask_BT=mask)
  np.testing.assert_array_equal(only_logp, logp)


def test_jit_and_eager_agree():
  params, toks = _params(TINY), _tokens((2, 8), seed=9)
  eager = transformer.forward(params, toks, TINY, FP32)
  np.testing.assert_allclose(fwd(params, toks, TINY, FP32), eager, atol=1e-5)


# The layout's claims are checked against the tree the Flax module builds, over every optional
# feature: GQA and MHA, tied and untied heads, qkv bias, qk-norm, head_dim != d_model / n_heads.
LAYOUT_CONFIGS = (
    TINY,
    FULL,
    ModelConfig(vocab_size=48, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=24,
                d_ff=40, qkv_bias=True),
    ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=4,
                d_ff=24, qk_norm=True, tie_embeddings=True),
)


def _leaves_by_keys(tree):
  return {tuple(k.key for k in kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("cfg", LAYOUT_CONFIGS, ids=range(len(LAYOUT_CONFIGS)))
def test_layout_agrees_with_the_param_tree(cfg):
  leaves = _leaves_by_keys(init.param_shapes(cfg))
  matmuls = layout.matmuls(cfg)
  assert len(matmuls) == 7 * cfg.n_layers + 1
  assert len({m.full_path for m in matmuls}) == len(matmuls)
  assert len({m.param_keys for m in matmuls}) == len(matmuls)
  for m in matmuls:
    assert m.param_keys in leaves, m.full_path
    assert tuple(leaves[m.param_keys].shape) == m.weight_shape, m.full_path
    # [in, out] kernels contract axis 0; the tied head contracts the embedding's D (axis 1).
    assert m.contract_axis == (0 if m.owns_kernel else 1)
    assert m.weight_shape[m.contract_axis] == m.in_features
    bias = m.param_keys[:-1] + ("bias",)
    assert (bias in leaves) == m.has_bias, m.full_path
    if m.has_bias:
      assert tuple(leaves[bias].shape) == (m.out_features,)
  # Every kernel in the tree is some matmul's own weight; a tied head reads the embedding.
  kernels = {k for k in leaves if k[-1] == "kernel"}
  assert kernels == {m.param_keys for m in matmuls if m.owns_kernel}
  head = matmuls[-1]
  assert head.layer is None and head.owns_kernel == (not cfg.tie_embeddings)
  if cfg.tie_embeddings:
    assert head.param_keys == ("embed", "embedding") and "lm_head" not in {k[0] for k in leaves}
  # Biases sit only next to layout matmuls that declare them.
  assert ({k for k in leaves if k[-1] == "bias"}
          == {m.param_keys[:-1] + ("bias",) for m in matmuls if m.has_bias})


@pytest.mark.parametrize("cfg", LAYOUT_CONFIGS, ids=range(len(LAYOUT_CONFIGS)))
def test_layout_order_is_the_forward_execution_order(cfg, monkeypatch):
  # The spy identifies which weight every quantized_dot_general call reads (the parameter leaf
  # itself, by identity: a copy or another leaf has no index) and along which axis it
  # contracts. Traced abstractly (eval_shape): the same Python forward, nothing compiled.
  matmuls = layout.matmuls(cfg)
  shapes = init.param_shapes(cfg)  # (an init trace: before the spy is in)
  calls = []
  real = blocks.quantized_dot_general
  index: dict[int, int] = {}

  def spy(lhs, rhs, dims, qcfg, **kw):
    calls.append((index.get(id(rhs)), tuple(rhs.shape), dims[0][1]))
    return real(lhs, rhs, dims, qcfg, **kw)

  monkeypatch.setattr(blocks, "quantized_dot_general", spy)
  policy = precision.PrecisionPolicy.unquantized(matmuls)

  def run(params):
    index.update({id(layout.get_param(params, m.param_keys)): i for i, m in enumerate(matmuls)})
    return transformer.forward(params, jnp.zeros((2, 8), jnp.int32), cfg, policy)

  jax.eval_shape(run, shapes)
  assert len(index) == len(matmuls)
  assert calls == [(i, m.weight_shape, (m.contract_axis,)) for i, m in enumerate(matmuls)]


# ----------------------------------------------------------------------------------------------
# Precision routing.


def test_every_linear_layer_goes_through_qdot_with_the_policy_config(monkeypatch):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, tie_embeddings=True)
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  calls = []
  real = blocks.quantized_dot_general

  def spy(lhs, rhs, dims, qcfg, key=None, preferred_element_type=None, lhs_amax=None,
          rhs_amax=None):
    calls.append((qcfg, lhs.dtype, rhs.shape, rhs_amax is not None))
    return real(lhs, rhs, dims, qcfg, key=key, preferred_element_type=preferred_element_type,
                lhs_amax=lhs_amax, rhs_amax=rhs_amax)

  params = jax.eval_shape(lambda: init.init_params(cfg, jax.random.key(0)))
  monkeypatch.setattr(blocks, "quantized_dot_general", spy)
  out = jax.eval_shape(lambda p: transformer.forward(p, jnp.zeros((2, 5), jnp.int32), cfg,
                                                     policy), params)
  assert out.dtype == jnp.float32 and out.shape == (2, 5, 64)
  expected = [policy.qdot_config(m.full_path) for m in layout.matmuls(cfg)]
  assert [c[0] for c in calls] == expected
  # Body activations enter the GEMMs in BF16; the FP32 (tied) head sees FP32 hidden states and
  # the [V, D] embedding.
  assert {c[1] for c in calls[:-1]} == {jnp.dtype(jnp.bfloat16)}
  assert calls[-1][1] == jnp.float32 and calls[-1][2] == (64, 32)
  # q/k/v and gate/up of the NVFP4 layers take their fused group's static weight amax (one
  # per-tensor scale, lowrl.models.fused_scales); o/down, the BF16 tail and the head their own.
  fused = {p for g in layout.FUSED_GROUPS for p in g}
  assert [c[3] for c in calls] == [m.path in fused and policy.qdot_config(m.full_path).rhs
                                   is not None for m in layout.matmuls(cfg)]


@pytest.mark.parametrize("name", ["bf16", "fp16", "mxfp8", "nvfp4_recipe"])
def test_logits_are_fp32_and_close_to_fp32_model(name):
  params, toks = _params(TINY), _tokens((2, 8), seed=10)
  ref = fwd(params, toks, TINY, FP32)
  out = fwd(params, toks, TINY, precision.policy_for(name, layout.matmuls(TINY)))
  assert out.dtype == jnp.float32 and np.all(np.isfinite(out))
  # The policies quantize / round the body, so logits move, but not by much at init.
  err = float(jnp.mean(jnp.abs(out - ref)))
  assert 0 < err < 0.25, err


def test_stochastic_rounding_needs_and_uses_the_quant_key():
  # SR on one matmul only (each SR quantizer adds a PRNG to the compile).
  policy = precision.policy_for("mxfp8", layout.matmuls(TINY), stochastic_rounding="all",
                                high_precision_paths=r"(?!layers_0/attn/q_proj).*")
  assert [r.fmt for r in precision.assignment_table(policy, layout.matmuls(TINY))].count("mxfp8_e4m3") == 1
  params, toks = _params(TINY), _tokens((2, 8), seed=11)
  with pytest.raises(ValueError, match="quant_key"):
    transformer.forward(params, toks, TINY, policy)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  a = fwd(params, toks, TINY, policy, quant_key=k1)
  np.testing.assert_array_equal(a, fwd(params, toks, TINY, policy, quant_key=k1))
  assert not np.array_equal(a, fwd(params, toks, TINY, policy, quant_key=k2))


def test_gradients_flow_under_nvfp4_recipe():
  params, toks = _params(TINY), _tokens((2, 8), seed=12)
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(TINY))

  def loss(p):
    return -jnp.mean(logprobs.token_logprobs(p, toks, TINY, policy))

  grads = jax.jit(jax.grad(loss))(params)  # one program (grad of a jit would compile two)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(g)), path
  # Quantized layer 0 and BF16 layer 1 both train.
  assert float(jnp.abs(grads["layers_0"]["mlp"]["up_proj"]["kernel"]).sum()) > 0
  assert float(jnp.abs(grads["layers_1"]["attn"]["q_proj"]["kernel"]).sum()) > 0
