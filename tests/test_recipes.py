"""The named precision recipes (`lowrl.recipes`): each config file loads its recipe, each recipe
differs from bf16 only where the papers' recipe says, a recipe is a fresh copy, unknown names and
knobs are refused."""
import os

import ml_collections
import pytest

import tiny
from configs import base
from lowrl import precision, recipes
from lowrl.training import cli


@pytest.mark.parametrize("name", precision.RECIPES)
def test_recipe_file_is_the_named_recipe(name):
  # What `--config=configs/<name>.py` loads (the file, as absl loads it) is the base config under
  # the named recipe.
  cfg = cli._load_config_file(os.path.join(tiny.REPO, "configs", f"{name}.py"))
  assert cfg.precision.to_dict() == precision.recipe(name).to_dict()
  assert cfg.precision.name == name
  assert base.get_config(name).to_dict() == cfg.to_dict()


def test_recipes_differ_from_bf16_only_where_they_say():
  # Values from docs/reference.md / the papers' recipes, written here independently.
  expected = {
      "fp32": {"compute_dtype": "float32"},
      "bf16": {},
      "fp16": {"compute_dtype": "float16"},
      "mxfp8": {"format": "mxfp8_e4m3"},
      "nvfp4_naive": {"format": "nvfp4"},
      "nvfp4_recipe": {"format": "nvfp4", "backward": "dequantized", "act_per_token": True,
                       "four_over_six": True, "bf16_last_fraction": 0.15},
      "nvfp4_moe_experts": {"format": "nvfp4", "backward": "dequantized", "act_per_token": True,
                            "four_over_six": True,
                            "high_precision_paths": r"(?!layers_\d+/mlp/experts/|lm_head$).*"},
      "nvfp4_w4a16": {"format": "nvfp4", "act_format": "none", "backward": "dequantized"},
  }
  bf16 = precision.recipe("bf16").to_dict()
  for name, diff in expected.items():
    got = precision.recipe(name).to_dict()
    assert {k: v for k, v in got.items() if k != "name" and bf16[k] != v} == diff, name


def test_recipe_is_a_fresh_copy_and_unknown_names_are_refused():
  a = precision.recipe("bf16")
  a.format = "nvfp4"
  assert precision.recipe("bf16").format == "none" and recipes.BF16["format"] == "none"
  with pytest.raises(ValueError, match="Unknown precision recipe 'nvfp5'"):
    precision.recipe("nvfp5")
  with pytest.raises(ValueError, match=r"recipe 'x': unknown precision knobs \['fromat'\]"):
    recipes.derive(recipes.BF16, "x", fromat="nvfp4")


def test_copied_recipe_with_a_missing_or_extra_knob_names_it():
  from lowrl.models import layout
  from lowrl.models.config import ModelConfig
  matmuls = layout.matmuls(ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2,
                                       n_kv_heads=1, head_dim=16, d_ff=32))
  c = precision.recipe("bf16").to_dict()
  c["fromat"] = "nvfp4"
  with pytest.raises(ValueError, match=r"unknown knobs \['fromat'\]"):
    precision.make_policy(ml_collections.ConfigDict(c), matmuls)
