"""Rollout generation (see ARCHITECTURE.md, "Sampler contract")."""
from lowrl.sampling.sampler import (SampleOutput, Sampler, SamplingConfig, generate,
                                    generate_in_jit, rescore, sample_token, sampling_logits,
                                    sampling_logprobs)

__all__ = ["SampleOutput", "Sampler", "SamplingConfig", "generate", "generate_in_jit", "rescore",
           "sample_token", "sampling_logits", "sampling_logprobs"]
