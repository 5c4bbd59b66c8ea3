"""BF16 compute, nothing quantized: the usual mixed-precision baseline (the base recipe).

The recipe's values are lowrl/recipes.py `BF16` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:bf16`.
"""
from configs import base


def get_config():
  return base.get_config("bf16")
