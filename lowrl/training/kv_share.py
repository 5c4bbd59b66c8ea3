"""The quantized KV cache's part of the sampler/trainer mismatch (`kv/*`, docs/sampling.md).

The trainer scores with unquantized K/V (as a real engine's trainer does), so a sampler with a
quantized KV cache (`PrecisionPolicy.kv_cache`) adds a mismatch of its own. Its share: the sampled
tokens scored twice with the sampler's weights and precision, quantized KV vs unquantized KV (two
full-sequence forwards through the exact-mode scoring program, no decoding), compared with
`mismatch_metrics`. k1 is additive: mismatch/mismatch_kl = kv/mismatch_kl + the rest (recipe,
staleness) on the same tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from lowrl.models import blocks, kv_cache, packing
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.rl.mismatch import mismatch_metrics
from lowrl.sampling import SampleOutput, SamplingConfig, rescore
from lowrl.sharding import ShardingPlan


def kv_share_metrics(out: SampleOutput, sampler_params: Any, *, model_cfg: ModelConfig,
                     policy: PrecisionPolicy, config: SamplingConfig,
                     quant_key: jax.Array | None, plan: ShardingPlan | None,
                     act_amax: blocks.ActAmax | None,
                     pack: packing.PackConfig | None = None) -> dict[str, jax.Array]:
  """`kv/<mismatch metric>` of log q with the quantized KV cache of `policy` vs the same policy
  with an unquantized cache, over the completion tokens; {} when `policy`'s cache is unquantized.
  `quant_key`, `plan`, `act_amax`, `pack`: the sampler's (as its exact-mode rescore gets them;
  static K/V scales are row-local, so packed rows quantize K and V as padded ones do)."""
  if not kv_cache.quantized(policy.kv_cache):
    return {}
  scores = [rescore(out, sampler_params, model_cfg=model_cfg, policy=p, config=config,
                    quant_key=quant_key, plan=plan, act_amax=act_amax, pack=pack).logprobs
            for p in (policy, dataclasses.replace(policy, kv_cache="none"))]
  return {f"kv/{k}": v for k, v in mismatch_metrics(*scores, out.completion_mask).items()}
