"""Execution knobs of the model at scale: scanned layers, remat, chunked attention, chunked
log-probabilities. Each is checked against the default (unrolled, materialized, full-vocabulary)
path: bit for bit where the same operations run, else within a bound derived below."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl import precision
from lowrl.models import blocks, decoder, layout, logprobs, transformer
from lowrl.models.config import ModelConfig

from model_scale_helpers import (DEEP, SHALLOW, U, _batch, _loss_and_grads, _params, _policy,
                                 _same, gamma)


# One layer: remat recomputes each layer's own operations (a second layer would only repeat
# them); the chunked attention-model and log-probability tests split the attention or the head (a
# deeper body would only make other hidden states).
ONE = dataclasses.replace(SHALLOW, n_layers=1)


# ----------------------------------------------------------------------------------------------
# Rematerialisation.


@pytest.mark.parametrize("remat,scan", [("full", False), ("full", True), ("dots", True)])
def test_remat_gradients_equal_plain(remat, scan):
  """Remat recomputes the same operations on the same inputs: the same bits."""
  # One quantized layer (no BF16 tail: its BF16 matmuls are the layer's other five; a tail layer
  # would add ~20% CPU time to these four programs). Two of its seven matmuls are NVFP4 (the
  # recipe's per-token activation scales, 4/6 blocks, dequantized backward), one in attention and
  # one in the MLP, both fed by activations that remat recomputes; the other five would only
  # repeat the same quantizers (all seven: ~35% more CPU time for these four programs).
  policy = _policy("nvfp4_recipe", ONE, bf16_last_fraction=0.0,
                   high_precision_paths=r"layers_0/(attn/(q|k|v)_proj|mlp/(gate|up)_proj)")
  assert [r.fmt for r in precision.assignment_table(policy, layout.matmuls(ONE))] == [
      "bfloat16"] * 3 + ["nvfp4"] + ["bfloat16"] * 2 + ["nvfp4", "float32"]
  plain = _loss_and_grads(ONE, policy)
  remat_out = _loss_and_grads(dataclasses.replace(ONE, remat=remat, scan_layers=scan), policy)
  assert _same(plain, remat_out)


# ----------------------------------------------------------------------------------------------
# Chunked attention.


def _attention_inputs(steps=11, keys=14, offset=3, dtype=jnp.float32):
  # NumPy's generator: jax.random.normal compiles a program of its own (~5 s of CPU here).
  b, k, g, hd = 2, 2, 3, 8
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((b, steps, k, g, hd)), dtype)
  kk = jnp.asarray(rng.standard_normal((b, keys, k, hd)) * 2.0, dtype)
  v = jnp.asarray(rng.standard_normal((b, keys, k, hd)), dtype)
  q_col = jnp.asarray(offset + np.arange(steps))  # a cache call: queries start at column `offset`
  key_mask = np.ones((b, keys), bool)
  key_mask[0, :2] = key_mask[1, 12:] = False
  return q, kk, v, q_col, jnp.asarray(key_mask)


@functools.lru_cache(maxsize=None)
def _attention_reference():
  """The inputs, the materialized attention and the bound's max |q . k| / sqrt(hd) and max |v|,
  in one program (computed once, not op by op in every parametrization)."""

  def run(q, k, v, q_col, key_mask):
    full = blocks.attend(q, k, v, q_col, key_mask, jnp.float32)
    qk_abs = jnp.einsum("btkgh,bskh->bkgts", jnp.abs(q), jnp.abs(k)) * q.shape[-1] ** -0.5
    return full, jnp.max(qk_abs), jnp.max(jnp.abs(v))

  inputs = _attention_inputs()
  return (inputs, *jax.jit(run)(*inputs))


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_chunked_attention_within_reassociation_bound(chunk):
  """Each row's scores, softmax and value sum are the same operations in both paths; only XLA's
  blocking of the two contractions may differ with the chunk's shapes. Bound, per output o =
  sum_s p_s v_s (FP32): a score s = (q . k) / sqrt(hd) reassociated moves by at most
  d = 2 gamma_hd sum|q k| / sqrt(hd) (+ 1 ulp of the scale product); softmax then moves each p by
  at most (e^(2d) - 1) p relatively, plus 4 u p of its own roundings on perturbed inputs; the
  value sum, reassociated, by 2 gamma_S sum p |v|. So |do| <= (e^(2d) - 1 + 4u + 2 gamma_S) max|v|
  with sum p = 1. A chunk covering every row runs the identical program: equal bits."""
  (q, k, v, q_col, key_mask), full, qk_abs_max, v_abs_max = _attention_reference()
  chunked = jax.jit(blocks.attend_chunked, static_argnums=(5, 6))(
      q, k, v, q_col, key_mask, jnp.float32, chunk)
  assert chunked.shape == full.shape
  hd, keys = q.shape[-1], k.shape[1]
  d = 2 * gamma(hd) * float(qk_abs_max) + 2 * U * float(qk_abs_max)
  bound = (np.expm1(2 * d) + 4 * U + 2 * gamma(keys)) * float(v_abs_max)
  np.testing.assert_array_less(np.abs(np.asarray(chunked) - np.asarray(full)), bound)
  if chunk >= q.shape[1]:
    assert _same(chunked, full)


def test_chunked_attention_model_one_chunk_is_exact_and_gradients_flow():
  # FP32: the plain program is the FP32 head tests' (computed once; BF16 programs also compile
  # slower on the CPU). Chunked attention in BF16 compute (one chunk, over the stacked KV cache)
  # is the bf16 case of test_decoder.py::test_scan_kv_cache_decode_equals_unrolled.
  policy = _policy("fp32", ONE)
  tokens, mask = _batch(ONE)
  cfg = dataclasses.replace(ONE, attention="chunked", attention_chunk=tokens.shape[1])
  assert _same(_loss_and_grads(ONE, policy), _loss_and_grads(cfg, policy))
  (loss, _), grads = _loss_and_grads(dataclasses.replace(cfg, attention_chunk=5), policy)
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------------------------
# Chunked log-probabilities.

HEADS = {
    "tied": ONE,
    "untied": dataclasses.replace(ONE, tie_embeddings=False),
}


def _head_policy(kind: str, cfg: ModelConfig):
  if kind == "fp32":
    return _policy("fp32", cfg)
  # NVFP4 head: blocks of 16 along D, one FP32 outer scale over the whole weight (needs the
  # whole weight's amax in every chunk). mxfp8: blocks of 32 along D only. Only the head is
  # quantized: the chunks split the head alone, and a quantized body (the same hidden states in
  # both paths) would only add compile time.
  return _policy(kind, cfg, quantize_lm_head=True, compute_dtype="float32",
                 high_precision_paths=r"layers_\d+/.*")


@pytest.mark.parametrize("head,kind,chunks", [("tied", "fp32", (1, 4)),
                                               ("untied", "nvfp4_naive", (1,)),
                                               ("tied", "mxfp8", (1,))])
def test_chunked_logprobs_one_chunk_is_exact(head, kind, chunks):
  cfg = HEADS[head]
  policy = _head_policy(kind, cfg)
  full = _loss_and_grads(cfg, policy)
  for chunk in (c * cfg.vocab_size for c in chunks):
    assert _same(full, _loss_and_grads(dataclasses.replace(cfg, logprob_chunk=chunk), policy))


@functools.lru_cache(maxsize=None)
def _full_path(cfg, policy):
  """The full-vocabulary (logp, entropy), the logits and the final hidden states h of
  `_batch(cfg)`, in one program (computed once per head and policy)."""
  tokens, mask = _batch(cfg)

  def run(p):
    logits = transformer.forward(p, tokens, cfg, policy, mask_BT=mask)[:, :-1]
    h = decoder.Transformer(cfg, policy).apply(
        {"params": p}, tokens, transformer.positions_from_mask(mask), mask, head=False)[0]
    return logprobs.token_logprobs_and_entropy(p, tokens, cfg, policy, mask_BT=mask), logits, h

  return jax.jit(run)(_params(cfg))


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
  (logp, ent), logits, h = _full_path(cfg, policy)
  tokens, mask = _batch(cfg)
  chunked = dataclasses.replace(cfg, logprob_chunk=chunk)
  logp_c, ent_c = jax.jit(logprobs.token_logprobs_and_entropy, static_argnums=(2, 3))(
      _params(cfg), tokens, chunked, policy, mask_BT=mask)

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
  policy = _policy("fp32", ONE)
  _, grads = _loss_and_grads(ONE, policy)
  _, grads_c = _loss_and_grads(dataclasses.replace(ONE, logprob_chunk=7), policy)
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
  cfg = dataclasses.replace(ONE, logprob_chunk=16)
  policy = _policy("nvfp4_recipe", cfg, quantize_lm_head=True, stochastic_rounding="all")
  tokens, mask = _batch(cfg)
  with pytest.raises(ValueError, match="logprob_chunk"):
    logprobs.token_logprobs(_params(cfg), tokens, cfg, policy, mask_BT=mask,
                               quant_key=jax.random.key(0))
