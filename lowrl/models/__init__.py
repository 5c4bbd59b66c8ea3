"""Llama/Qwen-family decoder: ModelConfig and pure functions over a params pytree."""
from lowrl.models.config import ModelConfig, preset
from lowrl.models.transformer import (forward, forward_with_cache, init_cache, init_params,
                                      logprobs_from_logits, param_shapes, positions_from_mask,
                                      token_logprobs, token_logprobs_and_entropy)

__all__ = ["ModelConfig", "preset", "forward", "forward_with_cache", "init_cache", "init_params",
           "logprobs_from_logits", "param_shapes", "positions_from_mask", "token_logprobs",
           "token_logprobs_and_entropy"]
