"""Routing replay in the loop (MoE models): the sampler's routing record, the trainer's scores.

The sampler records its expert choices into the rollout (`record`: one full forward of the
sampled sequences with the sampler's weights, precision and static scales; the decode's own
routing up to KV-cache rounding, and in exact mode the routing of the forward whose logprobs are
recorded, up to a near-tie that two programs round apart). The trainer then scores the rollout
with `score`: with replay its forward sends every token to the recorded experts, and either way
it returns what its own routers chose, so `flip_metrics` can count the tokens whose top-k set
differs between sampler and trainer with replay on and off (lowrl/models/routing.py).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import blocks, packing, routing
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.sampling.distributions import SamplingConfig
from lowrl.sampling.generate import SampleOutput
from lowrl.sampling.rescore import logq_of_logits
from lowrl.sharding import ShardingPlan

Params = Any


def _rows(plan: ShardingPlan | None):
  return plan.rows() if plan is not None else contextlib.nullcontext()


def _jit(fn, plan: ShardingPlan | None):
  return jax.jit(fn, **({} if plan is None else {"out_shardings": plan.batch}))


def _rows_of(fn, tokens_BL, mask_BL, replay, plan: ShardingPlan | None,
             pack: packing.PackConfig | None):
  """fn(tokens, key mask, expert ids or None) -> per-token outputs ([B, L, ...] trees), on the
  batch's own rows or, with `pack`, on its packed rows (the ids gathered with their tokens, the
  outputs put back in the padded layout; lowrl.models.packing)."""
  with _rows(plan):
    if pack is None:
      return fn(tokens_BL, mask_BL, replay)
    return packing.scores(lambda mb: fn(mb.tokens_BT, mb.segment_ids_BT, mb.routing), pack,
                          tokens_BL, mask_BL, 1 if plan is None else plan.batch_shards, replay)


@functools.lru_cache(maxsize=32)
def _record_program(model_cfg: ModelConfig, policy: PrecisionPolicy, plan: ShardingPlan | None,
                    pack: packing.PackConfig | None = None):
  def fn(params, tokens_BL, mask_BL, quant_key, act_amax):
    def record_rows(tokens, mask, _):
      seg = mask if jnp.issubdtype(mask.dtype, jnp.integer) else None
      return routing.record_routing(params, tokens, model_cfg, policy, mask_BT=mask,
                                    quant_key=quant_key, act_amax=act_amax,
                                    segment_ids_BT=seg)[1]
    return _rows_of(record_rows, tokens_BL, mask_BL, None, plan, pack)
  return _jit(fn, plan)


@functools.lru_cache(maxsize=32)
def _score_program(model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                   plan: ShardingPlan | None, pack: packing.PackConfig | None = None):
  def fn(params, tokens_BL, mask_BL, quant_key, replay):
    def score_rows(tokens, mask, ids):
      seg = mask if jnp.issubdtype(mask.dtype, jnp.integer) else None
      logits_BLV, own = routing.forward_routed(params, tokens, model_cfg, policy, ids,
                                               mask_BT=mask, quant_key=quant_key,
                                               segment_ids_BT=seg)
      return logq_of_logits(logits_BLV, tokens, mask, config), own
    return _rows_of(score_rows, tokens_BL, mask_BL, replay, plan, pack)
  return _jit(fn, plan)


def _placed(plan: ShardingPlan | None, params, *arrays):
  if plan is None:
    return (params, *arrays)
  return plan.put((params, *arrays), (plan.param_shardings(params),)
                  + tuple(plan.batch if a is not None else plan.replicated for a in arrays))


def record(out: SampleOutput, params: Params, *, model_cfg: ModelConfig,
           policy: PrecisionPolicy, quant_key: jax.Array | None = None,
           plan: ShardingPlan | None = None,
           act_amax: blocks.ActAmax | None = None,
           pack: packing.PackConfig | None = None) -> SampleOutput:
  """`out` with `routing` = the sampler's expert choices {"layers_i": int32 [B, L, k]}.

  `params`: the sampler's (unpacked) weights; `policy`, `quant_key`, `act_amax`: the sampler's.
  `pack` (rl.pack_tokens): the forward runs on packed rows, like exact mode's `rescore` (ids 0
  on padding, which no packed forward reads).
  """
  params, tokens, mask = _placed(plan, params, out.tokens, out.attention_mask)
  ids = _record_program(model_cfg, policy, plan, pack)(params, tokens, mask, quant_key, act_amax)
  return out.replace(routing=ids)


def score(out: SampleOutput, params: Params, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
          config: SamplingConfig, replay: bool, quant_key: jax.Array | None = None,
          plan: ShardingPlan | None = None, pack: packing.PackConfig | None = None
          ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(log q of the completion tokens [B, L], 0 elsewhere; the routing the trainer's routers
  chose) of `out` under (params, policy): with `replay` the forward routes as `out.routing`.
  `pack` (rl.pack_tokens): on packed rows, the recorded ids travelling with their tokens."""
  if replay and out.routing is None:
    raise ValueError("routing replay needs the sampler's routing; record it with "
                     "lowrl.sampling.replay.record (Sampler(..., record_routing=True)).")
  ids = out.routing if replay else None
  params, tokens, mask = _placed(plan, params, out.tokens, out.attention_mask)
  if ids is not None and plan is not None:
    ids = plan.put(ids, plan.batch)
  logq_BL, own = _score_program(model_cfg, policy, config, plan, pack)(params, tokens, mask,
                                                                        quant_key, ids)
  return jnp.where(out.completion_mask > 0, logq_BL, 0.0), own


@jax.jit
def _flips(sampler: dict[str, jax.Array], trainer: dict[str, jax.Array],
           mask_BL: jax.Array) -> jax.Array:
  return routing.routing_flips(sampler, trainer, mask_BL)["mean"]


def flip_metrics(out: SampleOutput, trainer_routing: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """{"routing/flips": fraction of (completion token, MoE layer) whose top-k expert set differs
  between the sampler's record and the trainer's own routers}."""
  return {"routing/flips": _flips(out.routing, trainer_routing, out.completion_mask)}
