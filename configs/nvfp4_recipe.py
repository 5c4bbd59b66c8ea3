"""NVFP4 with the 4-bitter lesson's fixes (docs/reference.md §1): the main job.

The recipe's values are lowrl/recipes.py `NVFP4_RECIPE` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:nvfp4_recipe`.
"""
from configs import base


def get_config():
  return base.get_config("nvfp4_recipe")
