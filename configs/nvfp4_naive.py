"""The default pipeline under the `nvfp4_naive` precision recipe."""
from configs import base


def get_config():
  return base.get_config("nvfp4_naive")
