"""Exact-mode scoring: both logprobs of finished rollouts from one full-sequence forward.

`rescore` is the trainer's score and the exact-mode sampler's record alike: a trainer that scores
the same sequences with the same params, policy, quant key and static scales runs the identical
jitted program (`logprobs.token_logprobs` on the same shapes), so its values are bit-identical
and the only remaining sampler/trainer difference is staleness.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import blocks, logprobs, packing, transformer
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.sampling.act_scales import used_act_amax
from lowrl.sampling.distributions import SamplingConfig, sampling_logprobs
from lowrl.sampling.generate import SampleOutput
from lowrl.sharding import ShardingPlan

Params = Any


def _score(params, tokens_BL, mask_BL, quant_key, act_amax, *, model_cfg, policy, config,
           plan=None, pack=None, shards=1):
  """log p of every token (config None: `logprobs.token_logprobs` itself, the trainer's
  function) or log q under `config`'s sampling transform of the same forward's logits. With a
  plan, each device scores only its rows (`plan.rows`). `pack` (a `packing.PackConfig`): the
  real tokens packed into rows, scored micro-batch by micro-batch, the scores put back in the
  padded layout (lowrl.models.packing)."""
  if plan is not None:
    with plan.rows():
      return _score(params, tokens_BL, mask_BL, quant_key, act_amax, model_cfg=model_cfg,
                    policy=policy, config=config, pack=pack, shards=plan.batch_shards)
  if pack is not None:
    return packing.scores(
        lambda mb: _score_rows(params, mb.tokens_BT, mb.segment_ids_BT, quant_key, act_amax,
                               model_cfg, policy, config, mb.positions_BT),
        pack, tokens_BL, mask_BL, shards)
  return _score_rows(params, tokens_BL, mask_BL, quant_key, act_amax, model_cfg, policy, config)


def _score_rows(params, tokens_BL, mask_BL, quant_key, act_amax, model_cfg, policy, config,
                positions_BL=None):
  """`_score` of one set of rows: an integer `mask_BL` holds packed rows' segment ids (then
  `positions_BL` their positions)."""
  seg = mask_BL if jnp.issubdtype(mask_BL.dtype, jnp.integer) else None
  kw = dict(quant_key=quant_key, act_amax=act_amax, positions_BT=positions_BL,
            segment_ids_BT=seg)
  if config is None:
    return logprobs.token_logprobs(params, tokens_BL, model_cfg, policy, mask_BT=mask_BL, **kw)
  logits_BLV = transformer.forward(params, tokens_BL, model_cfg, policy, mask_BT=mask_BL, **kw)
  return logq_of_logits(logits_BLV, tokens_BL, mask_BL, config)


def logq_of_logits(logits_BLV: jax.Array, tokens_BL: jax.Array, mask_BL: jax.Array,
                   config: SamplingConfig) -> jax.Array:
  """log q of each token under `config`'s transform of the logits predicting it ([B, L], 0 at
  the first column; an integer `mask_BL` holds packed rows' segment ids: 0 across segments)."""
  if not config.modifies_distribution:
    return logprobs.logprobs_from_logits(logits_BLV, tokens_BL, mask_BL)[0]
  logq_BL = sampling_logprobs(logits_BLV[:, :-1], tokens_BL[:, 1:], config)
  if jnp.issubdtype(mask_BL.dtype, jnp.integer):  # no prediction across segments (`_align`)
    logq_BL = jnp.where((mask_BL[:, 1:] == mask_BL[:, :-1]) & (mask_BL[:, 1:] > 0), logq_BL, 0.0)
  return jnp.pad(logq_BL, ((0, 0), (1, 0)))


# A trainer's `jax.jit(logprobs.token_logprobs, ...)` traces the same computation for the same
# shapes, which is what makes exact mode bit-identical.
@functools.lru_cache(maxsize=64)
def _scoring_program(model_cfg: ModelConfig, policy: PrecisionPolicy,
                     config: SamplingConfig | None, plan: ShardingPlan | None,
                     pack: packing.PackConfig | None = None):
  """`_score` jitted for one static setting; with a plan its output is split over the batch
  axes (inputs arrive placed by `rescore`)."""
  layout_kw = {} if plan is None else {"out_shardings": plan.batch}
  return jax.jit(functools.partial(_score, model_cfg=model_cfg, policy=policy, config=config,
                                   plan=plan, pack=pack), **layout_kw)


def scoring_program(model_cfg: ModelConfig, policy: PrecisionPolicy,
                    config: SamplingConfig | None, *, plan: ShardingPlan | None,
                    pack: packing.PackConfig | None):
  """The jitted program `rescore` runs for `config` (None: log p), called with (params, tokens,
  attention mask, quant key, `used_act_amax`), placed as `rescore` places them (also what
  lowrl.training.precompile compiles ahead: the same cached program)."""
  return _scoring_program(model_cfg, policy, config, plan=plan, pack=pack)


def rescore(out: SampleOutput, params: Params, *, model_cfg: ModelConfig,
            policy: PrecisionPolicy, config: SamplingConfig,
            quant_key: jax.Array | None = None, plan: ShardingPlan | None = None,
            act_amax: blocks.ActAmax | None = None,
            pack: packing.PackConfig | None = None) -> SampleOutput:
  """Replaces both logprobs with the given model's full forward (exact mode; the trainer's score).

  `model_logprobs` = `logprobs.token_logprobs(params, out.tokens, model_cfg, policy,
  mask_BT=out.attention_mask, quant_key=quant_key, act_amax=act_amax)` on completion tokens.
  `logprobs` applies the sampling transform (temperature, top-k, top-p) to the same forward's
  logits; when the transform is the identity it is `model_logprobs` itself. Under top-k/top-p a
  token the trainer's logits rank outside the support gets -inf.

  plan: inputs placed on this mesh as in `generate`, outputs split over its batch axes. None:
  placed as jit places them (one device), which keeps `rescore` traceable inside a caller's jit
  (the simulator's scan). `act_amax` None: tensor-scaled activations take the amax of the whole
  batch, as a trainer does (not row-local: such scores are the trainer's, never a sampler's
  record; see `Sampler`). `pack` (rl.pack_tokens): the forward runs on packed rows (`_score`);
  the exact-mode sampler and the trainer pass the same one, so they still run one program.
  """
  comp = out.completion_mask > 0
  args = (params, out.tokens, out.attention_mask, quant_key,
          used_act_amax(policy, model_cfg, act_amax))
  if plan is not None:
    args = plan.put(args, (plan.param_shardings(params), plan.batch, plan.batch, plan.replicated,
                           plan.replicated))
  program = functools.partial(scoring_program, model_cfg, policy, plan=plan, pack=pack)
  logp = jnp.where(comp, program(None)(*args), 0.0)
  logq = jnp.where(comp, program(config)(*args), 0.0) \
      if config.modifies_distribution else logp
  return out.replace(logprobs=logq, model_logprobs=logp)
