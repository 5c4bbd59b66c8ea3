"""The main job: the default pipeline under the 4-bitter `nvfp4_recipe`."""
from configs import base


def get_config():
  return base.get_config("nvfp4_recipe")
