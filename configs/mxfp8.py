"""The default pipeline under the `mxfp8` precision recipe."""
from configs import base


def get_config():
  return base.get_config("mxfp8")
