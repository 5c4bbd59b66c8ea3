"""W4A16: NVFP4 weights, activations in the compute dtype (weight-only quantization).

The recipe's values are lowrl/recipes.py `NVFP4_W4A16` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:nvfp4_w4a16`.
"""
from configs import base


def get_config():
  return base.get_config("nvfp4_w4a16")
