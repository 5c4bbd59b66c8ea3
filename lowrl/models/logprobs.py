"""Per-token log-probabilities and entropies of next-token predictions (FP32), from logits or,
with `model_cfg.logprob_chunk`, straight from the final hidden state V-chunk by V-chunk (no
[B, T, V] FP32 array).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.blocks import NEG_INF, ActAmax, fold
from lowrl.models.config import ModelConfig
from lowrl.models.decoder import Transformer
from lowrl.models.layout import LM_HEAD
from lowrl.models.transformer import Params, check_key, forward, model_inputs
from lowrl.precision import PrecisionPolicy, activation_scaling
from lowrl.quant.config import QDotConfig
from lowrl.quant.qdot import quantized_dot_general

_PATH_IDS = layout.PATH_IDS


def _align(logp_BT: jax.Array, entropy_BT: jax.Array, tokens_BT: jax.Array,
           mask_BT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Predictions made at t - 1 ([B, T - 1]) moved to the predicted token t, 0 where invalid.

  An integer `mask_BT` holds segment ids (packed rows, 0 = padding): a prediction is valid only
  within one segment (the first token of a sequence has no context, as in its own row)."""
  valid = jnp.ones(tokens_BT.shape, bool) if mask_BT is None else mask_BT.astype(bool)
  valid_BT = valid[:, 1:] & valid[:, :-1]
  if mask_BT is not None and jnp.issubdtype(mask_BT.dtype, jnp.integer):
    valid_BT = valid_BT & (mask_BT[:, 1:] == mask_BT[:, :-1])
  pad = lambda x: jnp.pad(jnp.where(valid_BT, x, 0.0), ((0, 0), (1, 0)))  # noqa: E731
  return pad(logp_BT), pad(entropy_BT)


def _logz_and_entropy(logits_BTV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(logsumexp, entropy) over the last axis, FP32."""
  logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  logp_all = logits_BTV - logz_BT[..., None]
  return logz_BT, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def logprobs_from_logits(logits_BTV: jax.Array, tokens_BT: jax.Array,
                         mask_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT) of next-token predictions, aligned with the predicted token.

  logp[:, t] = log p(tokens[:, t] | tokens[:, :t]) from logits[:, t - 1]; entropy[:, t] is the
  entropy of that same distribution. Both are 0 at t = 0 and wherever mask[:, t] or
  mask[:, t - 1] is 0 (no real context to predict from, or not a real token); an integer mask
  holds packed rows' segment ids (`_align`). FP32.
  """
  logits = logits_BTV[:, :-1].astype(jnp.float32)
  logz_BT, entropy_BT = _logz_and_entropy(logits)
  picked_BT = jnp.take_along_axis(logits, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return _align(picked_BT - logz_BT, entropy_BT, tokens_BT, mask_BT)


def _check_chunked_head(model_cfg: ModelConfig, policy: PrecisionPolicy) -> QDotConfig:
  """The LM head's QDotConfig, refused where V-chunks would not quantize like the whole head."""
  qcfg = policy.qdot_config(LM_HEAD)
  fix = "set model.logprob_chunk=0 or keep the LM head unquantized (precision.quantize_lm_head)"
  if any(q is not None and q.stochastic_rounding for q in (qcfg.lhs, qcfg.rhs, qcfg.grad)):
    raise ValueError("logprob_chunk: the LM head rounds stochastically, and a V-chunk draws "
                     f"other random bits than the whole head; {fix}.")
  if qcfg.backward == "quantized":
    raise ValueError("logprob_chunk: the LM head quantizes its gradient along V (the dgrad "
                     f"GEMM's contracting axis), which V-chunks would split; {fix}.")
  if qcfg.rhs is not None and qcfg.rhs.block_2d and model_cfg.logprob_chunk % qcfg.rhs.block:
    raise ValueError(f"logprob_chunk={model_cfg.logprob_chunk} must be a multiple of the LM "
                     f"head's {qcfg.rhs.block}x{qcfg.rhs.block} weight tiles; {fix}.")
  return qcfg


def _chunked_logz_entropy_picked(h_BTD: jax.Array, w: jax.Array, head: layout.Matmul,
                                 qcfg: QDotConfig, head_key: jax.Array | None,
                                 lhs_amax: jax.Array | None, target_BT: jax.Array,
                                 chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logsumexp, entropy, logit of target_BT) of the LM head's logits, V-chunk by V-chunk.

  Each chunk's logits are the head's own quantized dot on a slice of the weight (blocks run along
  D, so a V-slice quantizes as in the whole head; a per-tensor weight scale takes the whole
  weight's amax); chunk 0 starts the running (logz, entropy), and each further chunk c merges in
  with w = exp(logz - logz'): H' = sum_c w_c (H_c - log w_c). One chunk covering V runs exactly
  `_logz_and_entropy`'s operations. Chunks are rematerialised in the backward, so at most one
  FP32 [B, T, chunk] logits array is live.
  """
  vocab = head.out_features
  chunk = min(chunk, vocab)
  n = -(-vocab // chunk)
  pad = n * chunk - vocab
  rhs_amax = None
  if qcfg.rhs is not None and qcfg.rhs.kind != "mx" and not qcfg.rhs.per_token:
    rhs_amax = jax.lax.stop_gradient(jnp.max(jnp.abs(w)).astype(jnp.float32))
  if head.contract_axis == 0:  # [D, V] kernel -> [n, D, chunk]
    w_N = jnp.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], n, chunk).transpose(1, 0, 2)
  else:  # tied [V, D] embedding -> [n, chunk, D]
    w_N = jnp.pad(w, ((0, pad), (0, 0))).reshape(n, chunk, w.shape[1])
  dims = (((h_BTD.ndim - 1,), (head.contract_axis,)), ((), ()))
  key = fold(head_key, _PATH_IDS[LM_HEAD])

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_chunk(w_c, c):
    logits_BTC = quantized_dot_general(h_BTD, w_c, dims, qcfg, key=key,
                                       preferred_element_type=jnp.float32, lhs_amax=lhs_amax,
                                       rhs_amax=rhs_amax)
    logits_BTC = logits_BTC.astype(jnp.float32)
    if pad:  # columns past V: exp(-1e30 - logz) = 0, and no NaN in the entropy's gradient
      logits_BTC = jnp.where(c * chunk + jnp.arange(chunk) < vocab, logits_BTC, NEG_INF)
    logz_BT, entropy_BT = _logz_and_entropy(logits_BTC)
    idx_BT = target_BT - c * chunk
    inside_BT = (idx_BT >= 0) & (idx_BT < chunk)
    picked_BT = jnp.take_along_axis(logits_BTC, jnp.clip(idx_BT, 0, chunk - 1)[..., None],
                                    axis=-1)[..., 0]
    return logz_BT, entropy_BT, jnp.where(inside_BT, picked_BT, 0.0)

  def merge(carry, xs):
    logz, entropy, picked = carry
    logz_c, entropy_c, picked_c = one_chunk(*xs)
    new_logz = jnp.logaddexp(logz, logz_c)
    log_w, log_wc = logz - new_logz, logz_c - new_logz
    entropy = jnp.exp(log_w) * (entropy - log_w) + jnp.exp(log_wc) * (entropy_c - log_wc)
    return (new_logz, entropy, picked + picked_c), None

  carry = one_chunk(w_N[0], 0)
  if n > 1:
    carry, _ = jax.lax.scan(merge, carry, (w_N[1:], jnp.arange(1, n)))
  return carry


def token_logprobs_and_entropy(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                               policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                               positions_BT: jax.Array | None = None,
                               quant_key: jax.Array | None = None,
                               act_amax: ActAmax | None = None,
                               segment_ids_BT: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT): see `logprobs_from_logits` for the alignment.

  `segment_ids_BT`: packed rows (int ids, 0 = padding; `transformer.model_inputs`), in place of
  `mask_BT`: attention and predictions stay within a segment, positions restart per segment.

  With `model_cfg.logprob_chunk` > 0 the LM head and log-softmax run over V in chunks of that
  many columns (`_chunked_logz_entropy_picked`): no [B, T, V] FP32 array; the same numbers up to
  the online logsumexp's reassociation (tests/models/test_logprobs.py states the bound).
  """
  mask_in, positions_in = model_inputs(tokens_BT, mask_BT, positions_BT, segment_ids_BT)
  if segment_ids_BT is not None:
    mask_BT = mask_in  # the segment ids: `_align` keeps predictions within a segment
  if not model_cfg.logprob_chunk:
    logits_BTV = forward(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                         positions_BT=positions_BT, quant_key=quant_key, act_amax=act_amax,
                         segment_ids_BT=segment_ids_BT)
    return logprobs_from_logits(logits_BTV, tokens_BT, mask_BT)
  qcfg = _check_chunked_head(model_cfg, policy)
  check_key(policy, quant_key)
  h_BTD, _ = Transformer(model_cfg, policy).apply(
      {"params": params}, tokens_BT, positions_in, mask_in, quant_key=quant_key,
      act_amax=act_amax, head=False)
  head = layout.matmul(model_cfg, None, LM_HEAD)
  lhs_amax = None
  if act_amax is not None and activation_scaling(qcfg) == "tensor":
    lhs_amax = act_amax[LM_HEAD]
  # The head runs on every position (as `forward`'s does, so a per-tensor activation scale sees
  # the same tensor); the last position predicts nothing and is dropped.
  target_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
  logz_BT, entropy_BT, picked_BT = _chunked_logz_entropy_picked(
      h_BTD, layout.get_param(params, head.param_keys), head, qcfg,
      fold(quant_key, model_cfg.n_layers), lhs_amax, target_BT, model_cfg.logprob_chunk)
  return _align((picked_BT - logz_BT)[:, :-1], entropy_BT[:, :-1], tokens_BT, mask_BT)


def token_logprobs(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                   policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                   positions_BT: jax.Array | None = None,
                   quant_key: jax.Array | None = None,
                   act_amax: ActAmax | None = None,
                   segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """logp_BT[:, t] = log p(tokens[:, t] | tokens[:, :t]) in FP32; 0 at t = 0 and on padding
  (`segment_ids_BT`: packed rows, as in `token_logprobs_and_entropy`)."""
  return token_logprobs_and_entropy(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                                    positions_BT=positions_BT, quant_key=quant_key,
                                    act_amax=act_amax, segment_ids_BT=segment_ids_BT)[0]
