"""Hugging Face checkpoints: safetensors + config.json <-> (ModelConfig, params), tokenizer.json."""
from lowrl.checkpoints.hf import (check_hf_weights, load_hf_checkpoint, load_hf_params,
                                  save_hf_checkpoint)
from lowrl.checkpoints.hf_config import (hf_config_from_model, infer_model_type,
                                         model_config_from_hf, read_hf_config)
from lowrl.checkpoints.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Tokenizer",
    "check_hf_weights",
    "hf_config_from_model",
    "infer_model_type",
    "load_hf_checkpoint",
    "load_hf_params",
    "load_tokenizer",
    "model_config_from_hf",
    "read_hf_config",
    "save_hf_checkpoint",
]
