"""MXFP8 (arXiv 2506.08027): E4M3 everywhere, block scales rounded up.

The recipe's values are lowrl/recipes.py `MXFP8` (how it differs from its parent recipe); the
rest of the run is configs/base.py. Same as `--config=configs/base.py:mxfp8`.
"""
from configs import base


def get_config():
  return base.get_config("mxfp8")
