"""`Sampler`: a rollout worker's generation, with its KV cache kept between calls, packed weights
and exact mode (generate, then `rescore` with the sampler's own policy)."""
from __future__ import annotations

from typing import Any

import jax

from lowrl import sharding
from lowrl.models import blocks, packing
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.sampling import replay, weights
from lowrl.sampling.distributions import SamplingConfig
from lowrl.sampling.generate import SampleOutput, generate
from lowrl.sampling.rescore import rescore
from lowrl.sharding import ShardingPlan

Params = Any


class Sampler:
  """Generation with a reused (donated) KV cache, optionally in exact mode.

  `params` may be a `pack_params` tree (weights held packed between calls; dequantized for the
  duration of the call, with the weight quantizers of the policy skipped). A policy that scales
  activations per tensor needs the static `act_amax` stored with the rollout weights.

  Exact mode re-scores the finished sequences with the sampler's own policy (and static scales)
  in one full forward, the program a trainer in the same precision runs: it then holds the
  distribution sampled from up to KV-cache rounding, and the trainer's pi_old matches it bit
  for bit. It is offered only for row-local policies (`check_row_local`).

  `decode_min_rows` > 0 compacts the decode into halving buckets of live rows (`generate`'s
  `min_rows`; `decode_buckets_per_halving` = k: k buckets per halving).

  `record_routing` (MoE models, routing replay): the output also carries the sampler's expert
  choices per token and layer (`SampleOutput.routing`, lowrl/sampling/replay.py), recorded with
  the weights exact mode re-scores with.

  Example:
    sampler = Sampler(model_cfg, policy, SamplingConfig(max_new_tokens=16), exact=True)
    out = sampler(params, prompts_BP, mask_BP, rng)
  """

  def __init__(self, model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
               *, exact: bool = False, plan: ShardingPlan | None = None,
               record_routing: bool = False, decode_min_rows: int = 0,
               pack: packing.PackConfig | None = None, decode_buckets_per_halving: int = 1):
    config.check(model_cfg)
    self.decode_min_rows = decode_min_rows  # decode compaction's smallest bucket (`generate`)
    self.decode_buckets_per_halving = decode_buckets_per_halving
    self.pack = pack  # exact mode's rescore and the routing record on packed rows
    if record_routing and not model_cfg.is_moe:
      raise ValueError("record_routing needs a mixture-of-experts model (n_experts > 0).")
    self.record_routing = record_routing
    # Exact mode records re-scored logprobs as the sampling distribution, so it re-scores with
    # the sampler's own policy; a trainer in another precision scores with `rescore(...)`.
    self.model_cfg, self.policy, self.config = model_cfg, policy, config
    self.exact = exact
    self.plan = plan or sharding.single_device_plan()  # every call runs on plan.mesh
    self._cache = None

  def __call__(self, params: Params, prompt_tokens_BP: jax.Array, prompt_mask_BP: jax.Array,
               rng: jax.Array, *, quant_key: jax.Array | None = None,
               trainer_params: Params | None = None,
               trainer_quant_key: jax.Array | None = None,
               act_amax: blocks.ActAmax | None = None, group_size: int = 1,
               greedy: bool | None = None) -> SampleOutput:
    """Generates; in exact mode re-scores with (trainer_params or params) in the sampler's
    precision, with the same static `act_amax` (trainer_params: the master weights of packed
    `params`, or the same weights). `group_size`: rows come in contiguous groups of one prompt,
    each prefilled once; `greedy`: temperature 0 (True) or the config's draw (False) in one
    program (`generate`)."""
    if ((self.exact or self.record_routing) and trainer_params is None
        and weights.is_packed(params)):
      raise ValueError("Exact mode and routing records run with the trainer's weights: pass "
                       "trainer_params (the packed sampler weights are not a parameter tree).")
    batch, p = prompt_tokens_BP.shape
    shape = (batch, p + self.config.max_new_tokens)
    cache = self._cache if self._cache is not None and \
        self._cache["mask"].shape == shape else None
    self._cache = None  # donated below
    out, self._cache = generate(params, prompt_tokens_BP, prompt_mask_BP, rng,
                                model_cfg=self.model_cfg, policy=self.policy, config=self.config,
                                quant_key=quant_key, cache=cache, plan=self.plan,
                                act_amax=act_amax, group_size=group_size,
                                min_rows=self.decode_min_rows, greedy=greedy,
                                buckets_per_halving=self.decode_buckets_per_halving)
    if self.exact:
      out = rescore(out, params if trainer_params is None else trainer_params,
                    model_cfg=self.model_cfg, policy=self.policy, config=self.config,
                    quant_key=trainer_quant_key, plan=self.plan, act_amax=act_amax,
                    pack=self.pack)
    if self.record_routing:
      key = quant_key if trainer_quant_key is None else trainer_quant_key
      out = replay.record(out, params if trainer_params is None else trainer_params,
                          model_cfg=self.model_cfg, policy=self.policy, quant_key=key,
                          plan=self.plan, act_amax=act_amax, pack=self.pack)
    return out
