"""The default pipeline under the `bf16` precision recipe."""
from configs import base


def get_config():
  return base.get_config("bf16")
