"""The default pipeline under the `fp32` precision recipe."""
from configs import base


def get_config():
  return base.get_config("fp32")
