"""Routing of mixture-of-experts models: record a forward's expert choices, replay them, compare.

Routing replay ("R3"): the sampler's per-token expert choices (`record_routing` on the sampled
sequences under the sampler's policy and weights; in exact mode that forward routes as the
decode did) are given to the trainer's forward (`token_logprobs_replayed`), which then sends
every token to those experts while taking the combine weights from its own router's softmax, so
the router keeps its gradient (lowrl/models/moe.py). `routing_flips` measures how often the
trainer's own top-k set differs from the sampler's: the routing mismatch replay removes.

Routing trees: {"layers_i": expert ids [B, T, k] int32} for every MoE layer, unrolled or
scanned (`model_cfg.scan_layers`: the ids enter and leave the layer scans per layer). In the loop
(`rl.routing_replay`) the sampler records its routing into the rollout
(lowrl/sampling/replay.py), `RLBatch.routing` carries it to the update, and the trainer's
logprob function replays it (`make_logprob_fn(..., replay=True)`).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from lowrl.models import blocks, decoder, layout, logprobs, moe, transformer
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy

Routing = Mapping[str, jax.Array]


def _check(model_cfg: ModelConfig) -> None:
  if not model_cfg.is_moe:
    raise ValueError("routing record/replay needs a mixture-of-experts model (n_experts > 0).")


def _apply(params, tokens_BT, model_cfg, policy, mask_BT, quant_key, replay, record,
           act_amax=None, segment_ids_BT=None):
  """(FP32 logits, routing used, routing the router chose) of one forward; both routings None
  unless `record` (the chosen one is the used one without `replay`). `segment_ids_BT`: packed
  rows (`transformer.model_inputs`)."""
  transformer.check_key(policy, quant_key)
  mask_BT, positions_BT = transformer.model_inputs(tokens_BT, mask_BT, None, segment_ids_BT)
  variables = {"params": params}
  if replay is not None:
    missing = [layout.layer_key(i) for i in range(model_cfg.n_layers)
               if layout.layer_key(i) not in replay]
    if missing:
      raise ValueError(f"replay routing lacks layers {missing}; record it with record_routing.")
    variables[moe.REPLAY] = {k: {"mlp": {moe.EXPERT_IDS: v}} for k, v in replay.items()}
  out = decoder.Transformer(model_cfg, policy).apply(
      variables, tokens_BT, positions_BT, mask_BT, quant_key=quant_key, act_amax=act_amax,
      mutable=[moe.ROUTING] if record else False)
  if not record:
    return out[0], None, None
  (logits_BTV, _), state = out
  tree = state[moe.ROUTING]
  used = {k: v["mlp"][moe.EXPERT_IDS][0] for k, v in tree.items()}
  own = used if replay is None else {k: v["mlp"][moe.OWN_IDS][0] for k, v in tree.items()}
  return logits_BTV, used, own


def record_routing(params: Any, tokens_BT: jax.Array, model_cfg: ModelConfig,
                   policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                   quant_key: jax.Array | None = None,
                   replay: Routing | None = None,
                   act_amax: blocks.ActAmax | None = None,
                   segment_ids_BT: jax.Array | None = None
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(FP32 logits [B, T, V], the routing this forward used); with `replay` it uses that one.
  `act_amax`: static activation scales, as in `transformer.forward`; `segment_ids_BT`: packed
  rows, in place of `mask_BT` (`transformer.model_inputs`)."""
  _check(model_cfg)
  logits_BTV, used, _ = _apply(params, tokens_BT, model_cfg, policy, mask_BT, quant_key, replay,
                               True, act_amax, segment_ids_BT)
  return logits_BTV, used


def forward_routed(params: Any, tokens_BT: jax.Array, model_cfg: ModelConfig,
                   policy: PrecisionPolicy, replay: Routing | None, *,
                   mask_BT: jax.Array | None = None, quant_key: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(FP32 logits [B, T, V], the routing the model's own routers chose in this forward).

  With `replay` the tokens go to those experts (combine weights from this forward's softmax),
  and the returned routing is what each layer's router would have picked instead: the
  trainer's side of the flip metric. None: the model's own routing (used = chosen).
  `segment_ids_BT`: packed rows, as in `record_routing`.
  """
  _check(model_cfg)
  logits_BTV, _, own = _apply(params, tokens_BT, model_cfg, policy, mask_BT, quant_key, replay,
                              True, segment_ids_BT=segment_ids_BT)
  return logits_BTV, own


def check_replay(model_cfg: ModelConfig) -> None:
  """Raises ValueError where the trainer's forward cannot replay routing (one line, the fix)."""
  _check(model_cfg)
  if model_cfg.logprob_chunk:
    raise ValueError("routing replay computes the full LM head; set model.logprob_chunk=0 "
                     "(or rl.routing_replay=False).")


def replayed_logits(params: Any, tokens_BT: jax.Array, model_cfg: ModelConfig,
                    policy: PrecisionPolicy, replay: Routing | None, *,
                    mask_BT: jax.Array | None = None,
                    quant_key: jax.Array | None = None,
                    segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """FP32 logits [B, T, V] with the experts of `replay` (None: `transformer.forward`);
  `segment_ids_BT`: packed rows, in place of `mask_BT` (`transformer.model_inputs`)."""
  if replay is None:
    return transformer.forward(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                               quant_key=quant_key, segment_ids_BT=segment_ids_BT)
  check_replay(model_cfg)
  return _apply(params, tokens_BT, model_cfg, policy, mask_BT, quant_key, replay, False,
                segment_ids_BT=segment_ids_BT)[0]


def token_logprobs_replayed(params: Any, tokens_BT: jax.Array, model_cfg: ModelConfig,
                            policy: PrecisionPolicy, replay: Routing | None, *,
                            mask_BT: jax.Array | None = None,
                            quant_key: jax.Array | None = None) -> jax.Array:
  """`logprobs.token_logprobs` with the experts of `replay` (None: the model's own top-k)."""
  _check(model_cfg)
  if model_cfg.logprob_chunk:
    raise ValueError("token_logprobs_replayed computes the full LM head; set "
                     "model.logprob_chunk=0.")
  logits_BTV, _, _ = _apply(params, tokens_BT, model_cfg, policy, mask_BT, quant_key, replay,
                            False)
  return logprobs.logprobs_from_logits(logits_BTV, tokens_BT, mask_BT)[0]


def routing_flips(a: Routing, b: Routing, mask_BT: jax.Array | None = None) -> dict[str, jax.Array]:
  """{"layers_i": fraction of tokens whose expert set differs, ..., "mean": over layers}."""
  out = {k: moe.routing_flip_fraction(a[k], b[k], mask_BT) for k in sorted(a)}
  out["mean"] = jnp.mean(jnp.stack(list(out.values())))
  return out
