"""Base config of the RL pipeline: mid-train a tiny base on a verifiable task, then GRPO.

Every knob, its default and its meaning is in the training loop's schema
(lowrl.training.schema.TRAIN); the precision section comes from a recipe file
(`configs/<recipe>.py`, which calls `get_config(PRECISION)`). Choose the recipe with the config
file (`--config=configs/bf16.py`, or `--config=configs/base.py:bf16`); override a knob from the
command line: `--config.rl.steps=100 --config.precision.bf16_last_fraction=0`. `--print_config`
lists every knob with its meaning.

The experiment the defaults describe: sorting 3-6 letters (a mid-trained base makes sampling errors
RL can remove, and the problem space is large enough that held-out problems measure skill, not
memory: 2-digit addition's ~12k problems get memorised, and RL then raises train reward but not
held-out pass@1) with a ~0.8M-parameter decoder, 150 SFT steps, then 40 RL steps of 32 prompts x 8
completions at Adam lr 2e-4 (RL moves a mid-trained base: 1e-3 random-walks it away and the reward
falls; 1e-4..4e-4 is stable).
"""
from __future__ import annotations

from typing import Any

import ml_collections

from lowrl import precision
from lowrl.training import schema


def get_config(recipe: str | dict[str, Any] = "nvfp4_recipe") -> ml_collections.ConfigDict:
  """The loop's defaults under `recipe`: a name of lowrl.precision.RECIPES or a PRECISION dict."""
  if isinstance(recipe, str):
    precision_cfg = precision.recipe(recipe)
  else:
    precision_cfg = ml_collections.ConfigDict(dict(recipe))
  return schema.TRAIN.defaults(precision=precision_cfg)
