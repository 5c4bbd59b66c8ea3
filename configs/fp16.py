"""The default pipeline under the `fp16` precision recipe."""
from configs import base


def get_config():
  return base.get_config("fp16")
