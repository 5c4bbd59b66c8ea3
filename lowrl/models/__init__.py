"""Llama/Qwen-family decoder: ModelConfig and pure functions over a params pytree."""
from lowrl.models.calibration import calibrate_act_amax
from lowrl.models.config import ModelConfig, preset
from lowrl.models.init import init_params, param_shapes
from lowrl.models.logprobs import logprobs_from_logits, token_logprobs, token_logprobs_and_entropy
from lowrl.models.transformer import forward, forward_with_cache, init_cache, positions_from_mask

__all__ = ["ModelConfig", "preset", "calibrate_act_amax", "forward", "forward_with_cache",
           "init_cache", "init_params", "logprobs_from_logits", "param_shapes",
           "positions_from_mask", "token_logprobs", "token_logprobs_and_entropy"]
