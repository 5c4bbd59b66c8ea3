"""FP16 compute, nothing quantized.

The recipe's values are lowrl/recipes.py `FP16` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:fp16`.
"""
from configs import base


def get_config():
  return base.get_config("fp16")
