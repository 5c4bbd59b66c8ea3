"""Rollout generation (see ARCHITECTURE.md, "Sampler contract").

distributions.py  SamplingConfig and the sampled distribution q (temperature / top-k / top-p)
act_scales.py     which activation scales a sampler can use (row-local, or static amaxes)
weights.py        rollout weights: weight quantizers applied ahead of time, packed kernels
generate.py       the prefill + while_loop decode program; generate, generate_in_jit
rescore.py        exact-mode scoring (the trainer's score): rescore
rollout.py        Sampler: KV cache kept between calls, packed weights, exact mode
refit.py          RolloutWeights held between weight syncs; the bitwise refit check
"""
from lowrl.sampling.act_scales import check_row_local
from lowrl.sampling.distributions import (SamplingConfig, sample_token, sampling_logits,
                                          sampling_logprobs)
from lowrl.sampling.generate import SampleOutput, generate, generate_in_jit
from lowrl.sampling.rescore import rescore
from lowrl.sampling.rollout import Sampler
from lowrl.sampling.weights import pack_params, packed_bytes

__all__ = ["SampleOutput", "Sampler", "SamplingConfig", "check_row_local", "generate",
           "generate_in_jit", "rescore", "sample_token", "sampling_logits", "sampling_logprobs",
           "pack_params", "packed_bytes"]
