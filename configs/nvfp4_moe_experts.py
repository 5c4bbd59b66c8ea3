"""NVFP4 on the routed experts only, everything else BF16: the MoE ports' 4-bitter scope.

The recipe's values are lowrl/recipes.py `NVFP4_MOE_EXPERTS` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:nvfp4_moe_experts`.
"""
from configs import base


def get_config():
  return base.get_config("nvfp4_moe_experts")
