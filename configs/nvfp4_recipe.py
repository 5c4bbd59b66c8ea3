"""The default pipeline under the `nvfp4_recipe` precision recipe."""
from configs import base


def get_config():
  return base.get_config("nvfp4_recipe")
