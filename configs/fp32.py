"""FP32 everywhere: the unquantized reference.

The recipe's values are lowrl/recipes.py `FP32` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:fp32`.
"""
from configs import base


def get_config():
  return base.get_config("fp32")
