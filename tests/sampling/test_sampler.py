"""Sampler: greedy = argmax, top-k / top-p support, statistics, stop tokens, padding, exact mode."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl.models import layout
from lowrl import precision
from lowrl.models import init, logprobs, transformer
from lowrl.quant.packing import bytes_per_param
from lowrl import sampling
from lowrl.sampling import SamplingConfig

TINY = tiny.TINY  # V=64
FP32 = precision.PrecisionPolicy.unquantized(layout.matmuls(TINY))
N = 6
# Four prompts of lengths 6, 3, 4, 1 in a [4, 6] batch, padded on the right, left, or not at all.
PROMPTS = jnp.array([[5, 9, 2, 7, 1, 4], [8, 3, 6, 0, 0, 0], [0, 0, 11, 12, 13, 14],
                     [21, 0, 0, 0, 0, 0]])
PMASK = jnp.array([[1] * 6, [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
LENGTHS = [6, 3, 4, 1]

fwd = jax.jit(transformer.forward, static_argnames=("model_cfg", "policy"))
trainer_logprobs = jax.jit(logprobs.token_logprobs, static_argnames=("model_cfg", "policy"))


@functools.lru_cache(maxsize=None)
def _params():
  return init.init_params(TINY, jax.random.key(0))


def _generate(config, prompts=PROMPTS, mask=PMASK, policy=FP32, seed=0, params=None):
  out, _ = sampling.generate(_params() if params is None else params, prompts, mask,
                             jax.random.key(seed), model_cfg=TINY, policy=policy, config=config)
  return out


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - \
      x.max(-1, keepdims=True)


def _rescored_logits(out, policy=FP32):
  """Full-forward logits of the finished sequences; column c - 1 predicts token c."""
  return np.asarray(fwd(_params(), out.tokens, TINY, policy, mask_BT=out.attention_mask))


def _completion_cells(out):
  return [(b, c) for b, c in zip(*np.nonzero(np.asarray(out.completion_mask)))]


GREEDY = SamplingConfig(max_new_tokens=N, temperature=0.0)


@pytest.fixture(scope="module")
def greedy_out():
  return _generate(GREEDY)


# ----------------------------------------------------------------------------------------------
# Layout and greedy decoding.


def test_output_layout(greedy_out):
  out = greedy_out
  p = PROMPTS.shape[1]
  assert out.prompt_width == p and out.tokens.shape == (4, p + N)
  for arr in (out.prompt_mask, out.completion_mask, out.logprobs, out.model_logprobs):
    assert arr.shape == (4, p + N) and arr.dtype == jnp.float32
  assert out.tokens.dtype == jnp.int32
  np.testing.assert_array_equal(out.prompt_lengths, LENGTHS)
  for b, n in enumerate(LENGTHS):
    # Prompt left-aligned to end at column P - 1, left-padded with pad_id.
    real = np.asarray(PROMPTS[b])[np.asarray(PMASK[b]) > 0]
    np.testing.assert_array_equal(out.tokens[b, p - n:p], real)
    np.testing.assert_array_equal(out.tokens[b, :p - n], 0)
    np.testing.assert_array_equal(out.prompt_mask[b], [0] * (p - n) + [1] * n + [0] * N)
  # No stop tokens: every row generates N tokens.
  np.testing.assert_array_equal(out.completion_mask[:, p:], 1)
  np.testing.assert_array_equal(out.completion_mask[:, :p], 0)
  np.testing.assert_array_equal(out.completion_lengths, N)
  np.testing.assert_array_equal(out.attention_mask, out.prompt_mask + out.completion_mask)


def test_greedy_is_argmax_of_full_forward(greedy_out):
  out = greedy_out
  logits = _rescored_logits(out)
  logsm = _log_softmax(logits)
  for b, c in _completion_cells(out):
    assert out.tokens[b, c] == np.argmax(logits[b, c - 1])
    # Greedy samples from a point mass (log q = 0); the model's logprob is recorded too.
    assert out.logprobs[b, c] == 0.0
    assert out.model_logprobs[b, c] == pytest.approx(logsm[b, c - 1, out.tokens[b, c]], abs=1e-5)


def test_rows_do_not_depend_on_padding_side_or_batch(greedy_out):
  # The same prompts all right-padded, in reversed row order: same completions.
  p = PROMPTS.shape[1]
  right = np.zeros((4, p), np.int32)
  right_mask = np.zeros((4, p), np.int32)
  for b, n in enumerate(LENGTHS):
    right[3 - b, :n] = np.asarray(PROMPTS[b])[np.asarray(PMASK[b]) > 0]
    right_mask[3 - b, :n] = 1
  other = _generate(GREEDY, jnp.asarray(right), jnp.asarray(right_mask))
  np.testing.assert_array_equal(other.tokens[::-1], greedy_out.tokens)
  np.testing.assert_allclose(other.model_logprobs[::-1], greedy_out.model_logprobs, atol=1e-5)
  # Row 2 alone, unpadded, batch 1.
  alone = _generate(GREEDY, PROMPTS[2:3, 2:], PMASK[2:3, 2:])
  np.testing.assert_array_equal(alone.tokens[0, 4:], greedy_out.tokens[2, p:])
  np.testing.assert_allclose(alone.model_logprobs[0, 4:], greedy_out.model_logprobs[2, p:],
                             atol=1e-5)


def test_stop_tokens_end_completions(greedy_out):
  p = PROMPTS.shape[1]
  free = np.asarray(greedy_out.tokens[:, p:])
  stop = int(free[0, 2])  # row 0 stops at its third token (or earlier if it repeats)
  out = _generate(SamplingConfig(max_new_tokens=N, temperature=0.0, stop_tokens=(stop,),
                                 pad_id=63))
  for b in range(4):
    hits = np.flatnonzero(free[b] == stop)
    n = hits[0] + 1 if hits.size else N
    assert out.completion_lengths[b] == n
    np.testing.assert_array_equal(out.completion_mask[b, p:], [1] * n + [0] * (N - n))
    np.testing.assert_array_equal(out.tokens[b, p:p + n], free[b, :n])  # same greedy prefix
    np.testing.assert_array_equal(out.tokens[b, p + n:], 63)  # pad_id after the stop token
    np.testing.assert_array_equal(out.model_logprobs[b, p + n:], 0.0)
  assert out.completion_lengths[0] <= 3


# ----------------------------------------------------------------------------------------------
# Stochastic sampling.


TOPK_TOPP = SamplingConfig(max_new_tokens=N, temperature=0.7, top_k=4, top_p=0.6)
PROMPTS16, PMASK16 = jnp.tile(PROMPTS, (4, 1)), jnp.tile(PMASK, (4, 1))


def test_top_k_and_top_p_support_and_logprobs():
  out = _generate(TOPK_TOPP, PROMPTS16, PMASK16, seed=1)
  logits = _rescored_logits(out)
  cells = _completion_cells(out)
  assert len(cells) == 16 * N
  for b, c in cells:
    row = logits[b, c - 1]
    tok = int(out.tokens[b, c])
    top = np.argsort(-row)[:4]
    assert tok in top  # top-k: never outside the 4 largest logits
    # top-p on the temperature-scaled top-4 distribution: the mass strictly before the token
    # is below top_p.
    q_top = np.exp(_log_softmax(row[top] / 0.7))
    rank = list(top).index(tok)
    assert q_top[:rank].sum() < 0.6 + 1e-5
    nucleus = int(np.sum(np.cumsum(q_top) - q_top < 0.6))
    assert out.logprobs[b, c] == pytest.approx(np.log(q_top[rank] / q_top[:nucleus].sum()),
                                               abs=1e-4)
    assert out.model_logprobs[b, c] == pytest.approx(_log_softmax(row)[tok], abs=1e-4)
  # It samples: copies of the same prompt (rows b, b+4, b+8, b+12) get different completions.
  copies = np.asarray(out.tokens).reshape(4, 4, -1)
  assert any(len({tuple(copies[k, b]) for k in range(4)}) > 1 for b in range(4))


@pytest.mark.parametrize("config", [
    SamplingConfig(1, temperature=1.0), SamplingConfig(1, temperature=2.0, top_k=3),
    SamplingConfig(1, temperature=0.5, top_p=0.6),
    SamplingConfig(1, temperature=0.8, top_k=5, top_p=0.7)], ids=str)
def test_sample_token_frequencies_match_the_distribution(config):
  logits = jnp.array([2.0, 1.5, 1.0, 0.7, 0.0, -0.5, -1.0, -3.0])
  draws = 40000
  tok, logq, logp = jax.jit(sampling.sample_token, static_argnums=2)(
      jax.random.key(0), jnp.broadcast_to(logits, (draws, 8)), config)
  # Expected q: temperature, then top-k, then top-p, renormalised.
  x = np.asarray(logits, np.float64) / config.temperature
  order = np.argsort(-x)
  keep = np.zeros(8, bool)
  keep[order[:config.top_k or 8]] = True
  q = np.where(keep, np.exp(x - x.max()), 0.0)
  q /= q.sum()
  before = np.cumsum(q[order]) - q[order]
  keep[order[before >= config.top_p]] = False
  q = np.where(keep, q, 0.0)
  q /= q.sum()
  freq = np.bincount(np.asarray(tok), minlength=8) / draws
  assert np.all(freq[~keep] == 0)
  assert 0.5 * np.abs(freq - q).sum() < 0.015  # TV; ~0.004 expected at 40k draws
  np.testing.assert_allclose(logq, np.log(q[np.asarray(tok)]), atol=1e-5)
  np.testing.assert_allclose(logp, _log_softmax(logits)[np.asarray(tok)], atol=1e-5)


def test_sampler_is_deterministic_and_reuses_its_donated_cache():
  s = sampling.Sampler(TINY, FP32, TOPK_TOPP)
  a = s(_params(), PROMPTS16, PMASK16, jax.random.key(5))
  first_cache = s._cache["layers"][0]["k"]
  b = s(_params(), PROMPTS16, PMASK16, jax.random.key(5))
  assert first_cache.is_deleted()  # donated into the second call
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  c = s(_params(), PROMPTS16, PMASK16, jax.random.key(6))
  assert not np.array_equal(a.tokens, c.tokens)


def test_one_decode_program_per_setting_however_its_defaults_are_spelled():
  """`generate` passes every argument of `_decode_program`, tests and benchmarks often fewer: one
  setting must reach one jitted program (one compile, one entry in the cache's statistics), and
  another setting another."""
  from lowrl.sampling.generate import _decode_program
  plan = sampling.Sampler(TINY, FP32, TOPK_TOPP).plan
  program = _decode_program(TINY, FP32, TOPK_TOPP, plan, 1, 0, 1)  # as generate passes them
  misses = _decode_program.cache_info().misses
  for same in (_decode_program(TINY, FP32, TOPK_TOPP, plan),
               _decode_program(TINY, FP32, TOPK_TOPP, plan, 1, 0),
               _decode_program(TINY, FP32, TOPK_TOPP, plan, per_halving=1, group=1)):
    assert same is program
  assert _decode_program.cache_info().misses == misses
  assert _decode_program(TINY, FP32, TOPK_TOPP, plan, 1, 0, 2) is not program
  assert _decode_program.cache_info().misses == misses + 1


def test_runtime_greedy_flag_decodes_what_the_static_configs_decode_in_one_program():
  """`greedy=True` on a temperature / top-k / top-p config decodes what temperature 0 decodes
  (the raw logits' argmax, log q = 0), `greedy=False` what the config alone samples: every
  output leaf bit for bit, both calls on one compiled program."""
  from lowrl.sampling.generate import _decode_program
  s = sampling.Sampler(TINY, FP32, TOPK_TOPP)
  program = _decode_program(TINY, FP32, TOPK_TOPP, s.plan)
  compiled = program._cache_size()
  out = {g: s(_params(), PROMPTS16, PMASK16, jax.random.key(7), greedy=g) for g in (True, False)}
  assert program._cache_size() == compiled + 1
  static_greedy = SamplingConfig(max_new_tokens=N, temperature=0.0)
  for flag, config in ((True, static_greedy), (False, TOPK_TOPP)):
    ref = _generate(config, PROMPTS16, PMASK16, seed=7)
    for a, b in zip(jax.tree.leaves(out[flag]), jax.tree.leaves(ref), strict=True):
      np.testing.assert_array_equal(a, b)
  assert not np.array_equal(out[True].tokens, out[False].tokens)


# ----------------------------------------------------------------------------------------------
# Sampler / trainer mismatch under nvfp4_recipe.

RECIPE = precision.policy_for("nvfp4_recipe", layout.matmuls(TINY))
RL = SamplingConfig(max_new_tokens=N, temperature=1.0)


@pytest.fixture(scope="module")
def recipe_outs():
  prompts, mask = jnp.tile(PROMPTS, (2, 1)), jnp.tile(PMASK, (2, 1))
  kv = _generate(RL, prompts, mask, policy=RECIPE, seed=3)
  exact = sampling.rescore(kv, _params(), model_cfg=TINY, policy=RECIPE, config=RL)
  trainer = trainer_logprobs(_params(), kv.tokens, model_cfg=TINY, policy=RECIPE,
                             mask_BT=kv.attention_mask)
  return kv, exact, trainer


def test_exact_mode_is_bit_identical_to_the_trainer(recipe_outs):
  _, exact, trainer = recipe_outs
  comp = np.asarray(exact.completion_mask) > 0
  assert comp.sum() == 8 * N
  np.testing.assert_array_equal(np.asarray(exact.model_logprobs)[comp], np.asarray(trainer)[comp])
  # temperature 1, no filtering: q = p.
  np.testing.assert_array_equal(exact.logprobs, exact.model_logprobs)
  mismatch_kl = float(np.mean(np.asarray(exact.logprobs)[comp] - np.asarray(trainer)[comp]))
  assert mismatch_kl == 0.0


def test_kv_cache_mode_mismatch_is_small_and_measured(recipe_outs):
  kv, _, trainer = recipe_outs
  comp = np.asarray(kv.completion_mask) > 0
  delta = np.asarray(kv.logprobs)[comp] - np.asarray(trainer)[comp]
  mismatch_kl = float(np.mean(delta))
  max_abs = float(np.max(np.abs(delta)))
  print(f"\nnvfp4_recipe KV-cache sampler vs trainer: mismatch KL {mismatch_kl:.2e}, "
        f"max |dlogp| {max_abs:.2e}, mean |dlogp| {np.mean(np.abs(delta)):.2e}")
  # BF16 activations + NVFP4 codes that can flip when the KV-cache path rounds differently.
  assert np.all(np.isfinite(delta))
  assert max_abs < 0.1 and abs(mismatch_kl) < 0.01


def test_exact_sampler_with_a_bf16_trainer(recipe_outs):
  """NVFP4 sampler, BF16 trainer: exact mode records the trainer's logprobs."""
  kv, _, _ = recipe_outs
  bf16 = precision.policy_for("bf16", layout.matmuls(TINY))
  out = sampling.rescore(kv, _params(), model_cfg=TINY, policy=bf16, config=RL)
  trainer = trainer_logprobs(_params(), kv.tokens, model_cfg=TINY, policy=bf16,
                             mask_BT=kv.attention_mask, quant_key=None)
  comp = np.asarray(kv.completion_mask) > 0
  np.testing.assert_array_equal(np.asarray(out.model_logprobs)[comp], np.asarray(trainer)[comp])
  np.testing.assert_array_equal(out.tokens, kv.tokens)


def test_in_jit_generate_and_rescore_are_the_host_programs(recipe_outs):
  """The simulator's path (generate_in_jit + rescore inside its own jit) computes what the host
  path does, bit for bit: one decode program and one scoring program serve both."""
  kv, exact, _ = recipe_outs

  @jax.jit
  def run(params, prompts, mask, key):
    out = sampling.generate_in_jit(params, prompts, mask, key, model_cfg=TINY, policy=RECIPE,
                                   config=RL)
    return out, sampling.rescore(out, params, model_cfg=TINY, policy=RECIPE, config=RL)

  out, rescored = run(_params(), jnp.tile(PROMPTS, (2, 1)), jnp.tile(PMASK, (2, 1)),
                      jax.random.key(3))
  for got, want in ((out, kv), (rescored, exact)):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(x, y)


def test_packed_rollout_weights(recipe_outs):
  params = _params()
  packed = sampling.pack_params(params, TINY, RECIPE)
  stats = sampling.packed_bytes(packed)
  # Layer 0's seven kernels are NVFP4 (layer 1 is the BF16 tail); the head is unquantized.
  kernels = [params["layers_0"][m][p]["kernel"] for m, p in
             (path.split("/") for path in layout.BLOCK_MATMULS)]
  cfg = RECIPE.qdot_config("layers_0/mlp/up_proj").rhs
  expected = sum(bytes_per_param(cfg, k.shape) * k.size for k in kernels)
  assert stats["quantized_params"] == sum(k.size for k in kernels)
  assert stats["quantized_bytes"] == pytest.approx(expected)
  assert 0.5625 < stats["bytes_per_quantized_param"] < 0.57  # 4.5 bits + FP32 outer scales
  # Same rollouts from the packed weights as from the master weights, bit for bit.
  kv, _, _ = recipe_outs
  prompts, mask = jnp.tile(PROMPTS, (2, 1)), jnp.tile(PMASK, (2, 1))
  out = sampling.Sampler(TINY, RECIPE, RL)(packed, prompts, mask, jax.random.key(3))
  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(kv)):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="trainer_params"):
    sampling.Sampler(TINY, RECIPE, RL, exact=True)(packed, prompts, mask, jax.random.key(3))


def test_kernel_casts_ahead_of_the_decode_loop_change_no_bit(recipe_outs, monkeypatch):
  """The decode program casts the kernels the forward only casts once, before its loop
  (`weights.cast_kernels`), and decodes what it decodes casting them at every step, bit for bit.
  Only kernels without a weight quantizer are cast: under the recipe itself layer 0's NVFP4
  kernels stay FP32; once quantize_weights applied their quantizers, every kernel is cast."""
  import importlib
  from lowrl.sampling import weights
  gen = importlib.import_module("lowrl.sampling.generate")
  compute = {m.full_path: jnp.dtype(RECIPE.qdot_config(m.full_path).compute_dtype)
             for m in weights._kernels(TINY)}
  assert jnp.dtype(jnp.bfloat16) in set(compute.values())  # (the head computes in FP32)
  q_params, q_policy = weights.quantize_weights(_params(), TINY, RECIPE)
  for params, policy in ((_params(), RECIPE), (q_params, q_policy)):
    cast = weights.cast_kernels(params, TINY, policy)
    for m in weights._kernels(TINY):
      quantized = policy.qdot_config(m.full_path).rhs is not None
      assert layout.get_param(cast, m.param_keys).dtype == (
          jnp.float32 if quantized else compute[m.full_path]), m.full_path
      assert quantized == (policy is RECIPE and m.full_path.startswith("layers_0/"))
  kv, _, _ = recipe_outs  # generate: the casts before the loop
  monkeypatch.setattr(weights, "cast_kernels", lambda params, *_: params)
  prompts, mask = jnp.tile(PROMPTS, (2, 1)), jnp.tile(PMASK, (2, 1))
  cache = transformer.init_cache(TINY, 8, prompts.shape[1] + N, RECIPE.dtype)
  per_step, _ = jax.jit(functools.partial(gen._decode, model_cfg=TINY, policy=RECIPE, config=RL))(
      _params(), prompts, mask, jax.random.key(3), cache, None, None)
  for x, y in zip(jax.tree.leaves(per_step), jax.tree.leaves(kv), strict=True):
    np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_sampling_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**{"max_new_tokens": 4, **kw})


def test_bad_inputs_fail_before_compiling():
  with pytest.raises(ValueError, match="empty prompts"):
    _generate(GREEDY, PROMPTS, PMASK.at[1].set(0))
  with pytest.raises(ValueError, match="max_seq_len"):
    _generate(SamplingConfig(max_new_tokens=TINY.max_seq_len), PROMPTS, PMASK)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    _generate(SamplingConfig(max_new_tokens=2, stop_tokens=(64,)))
  with pytest.raises(ValueError, match="top_k"):
    _generate(SamplingConfig(max_new_tokens=2, top_k=65))
  with pytest.raises(ValueError, match=r"\[B, P\]"):
    _generate(GREEDY, PROMPTS, PMASK[:, :3])
