"""Execution knobs of the model at scale: scanned layers, remat, chunked attention, chunked
log-probabilities. Each is checked against the default (unrolled, materialized, full-vocabulary)
path: bit for bit where the same operations run, else within a bound derived below."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import precision
from lowrl.models import layout, transformer
from lowrl.models.config import ModelConfig
from lowrl import sampling
from lowrl.sampling import SamplingConfig

# 8 layers so nvfp4_recipe's BF16 suffix (round(0.15 * 8) = 1 layer) is its own scan group.
DEEP = tiny.DEEP
# The logprob and attention-model tests need no depth.
SHALLOW = dataclasses.replace(DEEP, n_layers=2)
U = 2.0 ** -24  # FP32 unit roundoff


def gamma(n: int) -> float:
  """Higham's gamma_n = n u / (1 - n u): relative error bound of an n-term FP32 sum/dot."""
  return n * U / (1 - n * U)


def _policy(name: str, cfg: ModelConfig = DEEP, **overrides) -> precision.PrecisionPolicy:
  return precision.policy_for(name, layout.matmuls(cfg), **overrides)


@functools.lru_cache(maxsize=None)
def _params(cfg: ModelConfig = DEEP):
  return transformer.init_params(cfg, jax.random.key(0))


def _batch(cfg: ModelConfig = DEEP, shape=(3, 12)):
  tokens = jax.random.randint(jax.random.key(1), shape, 0, cfg.vocab_size)
  mask = jnp.ones(shape, bool).at[0, :4].set(False)  # a left-padded row
  return tokens, mask


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _loss_and_grads(cfg, policy, quant_key=None, act_amax=None):
  tokens, mask = _batch(cfg)

  def loss(p):
    logp, ent = transformer.token_logprobs_and_entropy(p, tokens, cfg, policy, mask_BT=mask,
                                                       quant_key=quant_key, act_amax=act_amax)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent), (logp, ent)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(_params(cfg))


# ----------------------------------------------------------------------------------------------
# Scanned layers.


def test_layer_groups_split_at_the_bf16_suffix():
  policy = _policy("nvfp4_recipe")
  tail = precision.bf16_tail_layers(DEEP.n_layers, 0.15)
  assert tail == (7,)
  assert transformer.layer_groups(DEEP, policy) == ((0, 7), (7, 8))
  assert transformer.layer_groups(DEEP, _policy("fp32")) == ((0, 8),)
  # A BF16 layer in the middle splits the quantized layers into two runs.
  mid = _policy("nvfp4_recipe", bf16_last_fraction=0.0, high_precision_paths=r"layers_3/.*")
  assert transformer.layer_groups(DEEP, mid) == ((0, 3), (3, 4), (4, 8))


@pytest.mark.parametrize("name,overrides", [
    ("nvfp4_recipe", {}),
    # Stochastic rounding everywhere: every layer's quant key must be fold_in(key, layer).
    ("nvfp4_recipe", {"stochastic_rounding": "all", "high_precision_paths": r"layers_3/.*"}),
])
def test_scan_equals_unrolled_forward_and_gradients(name, overrides):
  policy = _policy(name, **overrides)
  key = jax.random.key(7) if policy.needs_key else None
  (loss_a, aux_a), grads_a = _loss_and_grads(DEEP, policy, key)
  (loss_b, aux_b), grads_b = _loss_and_grads(dataclasses.replace(DEEP, scan_layers=True), policy,
                                             key)
  assert np.isfinite(loss_a)
  assert _same((loss_a, aux_a), (loss_b, aux_b))
  assert _same(grads_a, grads_b)
  assert jax.tree.structure(grads_b) == jax.tree.structure(_params())


def test_scan_with_static_act_amax_and_calibration():
  policy = _policy("nvfp4_naive")  # per-tensor activation scales
  paths = policy.act_paths(layout.matmuls(DEEP), "tensor")
  assert paths
  tokens, mask = _batch()
  scanned = dataclasses.replace(DEEP, scan_layers=True)
  calib = jax.jit(transformer.calibrate_act_amax, static_argnames=("model_cfg", "policy", "paths"))
  amax_a = calib(_params(), tokens, model_cfg=DEEP, policy=policy, paths=paths, mask_BT=mask)
  amax_b = calib(_params(), tokens, model_cfg=scanned, policy=policy, paths=paths, mask_BT=mask)
  assert set(amax_a) == set(paths) and _same(amax_a, amax_b)
  fwd = jax.jit(transformer.forward, static_argnames=("model_cfg", "policy"))
  a = fwd(_params(), tokens, model_cfg=DEEP, policy=policy, mask_BT=mask, act_amax=amax_a)
  b = fwd(_params(), tokens, model_cfg=scanned, policy=policy, mask_BT=mask, act_amax=amax_a)
  assert _same(a, b)
  # The static amaxes are used, not the data's: other amaxes give other logits.
  doubled = {p: 2 * v for p, v in amax_a.items()}
  c = fwd(_params(), tokens, model_cfg=scanned, policy=policy, mask_BT=mask, act_amax=doubled)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("extra", [{}, {"attention": "chunked", "attention_chunk": 16}])
def test_scan_kv_cache_decode_equals_unrolled(extra):
  """Greedy decoding through the sampler's while_loop: the stacked cache of the scanned model
  gives the unrolled model's tokens and log-probabilities bit for bit (chunk 16 >= every call's
  T, so the chunked attention runs the same rows in one chunk)."""
  policy = _policy("nvfp4_recipe")
  prompts = jax.random.randint(jax.random.key(3), (3, 6), 0, DEEP.vocab_size)
  pmask = jnp.ones((3, 6), bool).at[1, :2].set(False)
  config = SamplingConfig(max_new_tokens=5, temperature=0.0)
  run = lambda cfg: sampling.generate(_params(), prompts, pmask, jax.random.key(0),  # noqa: E731
                                      model_cfg=cfg, policy=policy, config=config)
  out_a, cache_a = run(DEEP)
  out_b, cache_b = run(dataclasses.replace(DEEP, scan_layers=True, **extra))
  assert _same(out_a.tokens, out_b.tokens)
  assert _same(out_a.logprobs, out_b.logprobs)
  assert isinstance(cache_a["layers"], tuple) and len(cache_a["layers"]) == DEEP.n_layers
  assert cache_b["layers"]["k"].shape == (DEEP.n_layers,) + cache_a["layers"][0]["k"].shape
  for i in range(DEEP.n_layers):
    assert _same(cache_a["layers"][i], {n: cache_b["layers"][n][i] for n in ("k", "v")})


def _count_dots(n_layers: int, scan: bool) -> int:
  cfg = dataclasses.replace(DEEP, n_layers=n_layers, scan_layers=scan)
  tokens, mask = _batch(cfg)
  grad = jax.grad(lambda p: jnp.sum(transformer.token_logprobs(
      p, tokens, cfg, _policy("bf16", cfg), mask_BT=mask)))
  return jax.jit(grad).lower(transformer.init_params(cfg, jax.random.key(0))).as_text().count(
      "dot_general")


def test_scanned_program_does_not_grow_with_depth():
  assert _count_dots(2, True) == _count_dots(6, True)
  assert _count_dots(6, False) > _count_dots(2, False)


# ----------------------------------------------------------------------------------------------
# Rematerialisation.


@pytest.mark.parametrize("remat,scan", [("full", False), ("full", True), ("dots", True)])
def test_remat_gradients_equal_plain(remat, scan):
  """Remat recomputes the same operations on the same inputs: the same bits."""
  policy = _policy("nvfp4_recipe")
  plain = _loss_and_grads(DEEP, policy)
  remat_out = _loss_and_grads(dataclasses.replace(DEEP, remat=remat, scan_layers=scan), policy)
  assert _same(plain, remat_out)


# ----------------------------------------------------------------------------------------------
# Chunked attention.


def _attention_inputs(steps=11, keys=14, offset=3, dtype=jnp.float32):
  b, k, g, hd = 2, 2, 3, 8
  r = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(r[0], (b, steps, k, g, hd), dtype)
  kk = jax.random.normal(r[1], (b, keys, k, hd), dtype) * 2.0
  v = jax.random.normal(r[2], (b, keys, k, hd), dtype)
  q_col = offset + jnp.arange(steps)  # a cache call: queries start at column `offset`
  key_mask = jnp.ones((b, keys), bool).at[0, :2].set(False).at[1, 12:].set(False)
  return q, kk, v, q_col, key_mask


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_chunked_attention_within_reassociation_bound(chunk):
  """Each row's scores, softmax and value sum are the same operations in both paths; only XLA's
  blocking of the two contractions may differ with the chunk's shapes. Bound, per output o =
  sum_s p_s v_s (FP32): a score s = (q . k) / sqrt(hd) reassociated moves by at most
  d = 2 gamma_hd sum|q k| / sqrt(hd) (+ 1 ulp of the scale product); softmax then moves each p by
  at most (e^(2d) - 1) p relatively, plus 4 u p of its own roundings on perturbed inputs; the
  value sum, reassociated, by 2 gamma_S sum p |v|. So |do| <= (e^(2d) - 1 + 4u + 2 gamma_S) max|v|
  with sum p = 1. A chunk covering every row runs the identical program: equal bits."""
  q, k, v, q_col, key_mask = _attention_inputs()
  full = transformer.attend(q, k, v, q_col, key_mask, jnp.float32)
  chunked = jax.jit(transformer.attend_chunked, static_argnums=(5, 6))(
      q, k, v, q_col, key_mask, jnp.float32, chunk)
  assert chunked.shape == full.shape
  hd, keys = q.shape[-1], k.shape[1]
  qk_abs = jnp.einsum("btkgh,bskh->bkgts", jnp.abs(q), jnp.abs(k)) * hd ** -0.5
  d = 2 * gamma(hd) * float(jnp.max(qk_abs)) + 2 * U * float(jnp.max(qk_abs))
  bound = (np.expm1(2 * d) + 4 * U + 2 * gamma(keys)) * float(jnp.max(jnp.abs(v)))
  np.testing.assert_array_less(np.abs(np.asarray(chunked) - np.asarray(full)), bound)
  if chunk >= q.shape[1]:
    assert _same(chunked, full)


def test_chunked_attention_model_one_chunk_is_exact_and_gradients_flow():
  policy = _policy("bf16", SHALLOW)
  tokens, mask = _batch(SHALLOW)
  cfg = dataclasses.replace(SHALLOW, attention="chunked", attention_chunk=tokens.shape[1])
  assert _same(_loss_and_grads(SHALLOW, policy), _loss_and_grads(cfg, policy))
  (loss, _), grads = _loss_and_grads(dataclasses.replace(cfg, attention_chunk=5), policy)
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------------------------
# Chunked log-probabilities.

HEADS = {
    "tied": SHALLOW,
    "untied": dataclasses.replace(SHALLOW, tie_embeddings=False),
}


def _head_policy(kind: str, cfg: ModelConfig):
  if kind == "fp32":
    return _policy("fp32", cfg)
  # NVFP4 head: blocks of 16 along D, one FP32 outer scale over the whole weight (needs the
  # whole weight's amax in every chunk). mxfp8: blocks of 32 along D only.
  return _policy(kind, cfg, quantize_lm_head=True, compute_dtype="float32")


@pytest.mark.parametrize("head,kind,chunks", [("tied", "fp32", (1, 4)),
                                               ("untied", "nvfp4_naive", (1,)),
                                               ("tied", "mxfp8", (1,))])
def test_chunked_logprobs_one_chunk_is_exact(head, kind, chunks):
  cfg = HEADS[head]
  policy = _head_policy(kind, cfg)
  full = _loss_and_grads(cfg, policy)
  for chunk in (c * cfg.vocab_size for c in chunks):
    assert _same(full, _loss_and_grads(dataclasses.replace(cfg, logprob_chunk=chunk), policy))


@pytest.mark.parametrize("head,kind,chunk", [("tied", "fp32", 7), ("untied", "fp32", 16),
                                              ("untied", "nvfp4_naive", 7),
                                              ("tied", "mxfp8", 16)])
def test_chunked_logprobs_within_online_logsumexp_bound(head, kind, chunk):
  """Bound (FP32, u = 2^-24). The chunks quantize the head's operands exactly as the whole head
  does (blocks along D; the per-tensor scale from the whole weight's amax), so a logit l can only
  move by a reassociated D-term dot: dl <= 2 gamma_D D max|h| max|w| (doubled for quantized
  operands, whose magnitude may exceed the original amax by a rounding step).
  (Computed per logit: dl <= 2 gamma_D sum_d |h_d| |w_dv| x 2.)
  logz: the full path sums V positive terms (relative error gamma_V); the chunked one sums each
  chunk (gamma_C) and merges n chunks with logaddexp, each merge adding <= 4u (1 + |logz|); so
  |dlogz| <= dl + 2 gamma_V + 4 n u (1 + |logz|), and logp = l - logz moves by at most
  dlogp <= 2 dl + 2 gamma_V + 4 n u (2 + |logz| + |logp|).
  Entropy H = -sum p log p with |d log p| <= dlogp and dp <= p dlogp: |dH| <= dlogp (1 + R) plus
  each path's own summation error gamma_V R and the merges' 4 n u (1 + H + R), R = max|log p|
  (entropy and chunk entropies are averages of -log p <= R)."""
  cfg = HEADS[head]
  policy = _head_policy(kind, cfg)
  tokens, mask = _batch(cfg)
  logp, ent = jax.jit(transformer.token_logprobs_and_entropy, static_argnums=(2, 3))(
      _params(cfg), tokens, cfg, policy, mask_BT=mask)
  chunked = dataclasses.replace(cfg, logprob_chunk=chunk)
  logp_c, ent_c = jax.jit(transformer.token_logprobs_and_entropy, static_argnums=(2, 3))(
      _params(cfg), tokens, chunked, policy, mask_BT=mask)

  logits = transformer.forward(_params(cfg), tokens, cfg, policy, mask_BT=mask)[:, :-1]
  h = jax.jit(lambda p: transformer.Transformer(cfg, policy).apply(
      {"params": p}, tokens, transformer.positions_from_mask(mask), mask, head=False)[0])(
          _params(cfg))
  head_w = layout.get_param(_params(cfg), layout.matmul(cfg, None, "lm_head").param_keys)
  d, v = cfg.d_model, cfg.vocab_size
  n = -(-v // chunk)
  w_dv = head_w.T if cfg.tie_embeddings else head_w
  dl = 2 * 2 * gamma(d) * float(jnp.max(jnp.abs(h) @ jnp.abs(w_dv)))
  logz = jax.nn.logsumexp(logits, axis=-1)
  big_r = float(jnp.max(jnp.abs(logits - logz[..., None])))
  tol_logp = (2 * dl + 2 * gamma(v)
              + 4 * n * U * (2 + float(jnp.max(jnp.abs(logz))) + float(jnp.max(jnp.abs(logp)))))
  tol_ent = (tol_logp * (1 + big_r) + gamma(v) * big_r
             + 4 * n * U * (1 + float(jnp.max(ent)) + big_r))
  np.testing.assert_array_less(np.abs(np.asarray(logp_c) - np.asarray(logp)), tol_logp)
  np.testing.assert_array_less(np.abs(np.asarray(ent_c) - np.asarray(ent)), tol_ent)
  assert tol_logp < 1e-3 and tol_ent < 1e-2  # tight enough to catch a wrong merge or scale
  # Masking and alignment as the full path: zeros at t = 0 and on padding.
  assert _same(logp_c == 0, logp == 0)


def test_chunked_logprob_gradients_are_finite_and_close():
  """Gradients through the rematerialised chunks and the padded last chunk (64 = 9 x 7 + 1)."""
  policy = _policy("fp32", SHALLOW)
  _, grads = _loss_and_grads(SHALLOW, policy)
  _, grads_c = _loss_and_grads(dataclasses.replace(SHALLOW, logprob_chunk=7), policy)
  for g, g_c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c)):
    assert np.isfinite(g_c).all()
    # A sanity check, not a derived bound: the same function's gradient through another
    # summation order, so agreeing to ~1e-4 of the leaf's scale (a wrong merge is O(1) off).
    np.testing.assert_allclose(g_c, g, rtol=0, atol=1e-4 * (1 + float(np.max(np.abs(g)))))


# ----------------------------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize("kw,match", [
    ({"remat": "some"}, "remat"),
    ({"attention": "flash"}, "attention"),
    ({"attention_chunk": 0}, "attention_chunk"),
    ({"logprob_chunk": -1}, "logprob_chunk"),
    ({"scan_layers": 1}, "scan_layers"),
])
def test_bad_knobs_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(DEEP, **kw)


def test_chunked_logprobs_refuse_a_stochastically_rounded_head():
  cfg = dataclasses.replace(SHALLOW, logprob_chunk=16)
  policy = _policy("nvfp4_recipe", cfg, quantize_lm_head=True, stochastic_rounding="all")
  tokens, mask = _batch(cfg)
  with pytest.raises(ValueError, match="logprob_chunk"):
    transformer.token_logprobs(_params(SHALLOW), tokens, cfg, policy, mask_BT=mask,
                               quant_key=jax.random.key(0))
