"""NVFP4 without the fixes: every linear layer (but the LM head) in NVFP4.

The recipe's values are lowrl/recipes.py `NVFP4_NAIVE` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:nvfp4_naive`.
"""
from configs import base


def get_config():
  return base.get_config("nvfp4_naive")
