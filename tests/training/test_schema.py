"""The config schema (lowrl.training.schema): defaults, checks naming the flag, both run kinds,
and the recipe files as the one source of the precision recipes."""
import importlib

import ml_collections
import pytest

from configs import base
from lowrl import precision
from lowrl.asyncrl import simulator
from lowrl.training import cli, loop, run_config, schema

RECIPE_FILES = {name: f"configs/{name}.py" for name in precision.RECIPES}


def _set(cfg, path, value):
  *parents, leaf = path.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  node[leaf] = value


# -- recipes as data -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", precision.RECIPES)
def test_recipe_file_is_the_named_recipe(name):
  # What `--config=configs/<name>.py` loads (the file, as absl loads it) has the precision section
  # of precision.recipe(name): every knob of KNOBS, the name, nothing else.
  cfg = cli._load_config_file(f"{cli.REPO}/{RECIPE_FILES[name]}")
  assert cfg.precision.to_dict() == precision.recipe(name).to_dict()
  # Every knob spelled out, in KNOBS' order (a file to read and copy).
  assert list(importlib.import_module(f"configs.{name}").PRECISION) == list(precision.KNOBS)
  assert cfg.precision.name == name
  assert base.get_config(name).to_dict() == cfg.to_dict()


def test_recipes_differ_from_bf16_only_where_their_file_says():
  # Spot values from docs/reference.md / the recipe definitions, written here independently.
  expected = {
      "fp32": {"compute_dtype": "float32"},
      "bf16": {},
      "fp16": {"compute_dtype": "float16"},
      "mxfp8": {"format": "mxfp8_e4m3"},
      "nvfp4_naive": {"format": "nvfp4"},
      "nvfp4_recipe": {"format": "nvfp4", "backward": "dequantized", "act_per_token": True,
                       "four_over_six": True, "bf16_last_fraction": 0.15},
  }
  bf16 = precision.recipe("bf16").to_dict()
  for name, diff in expected.items():
    got = precision.recipe(name).to_dict()
    assert {k: v for k, v in got.items() if k != "name" and bf16[k] != v} == diff, name


def test_recipe_is_a_fresh_copy_and_unknown_names_are_refused():
  a = precision.recipe("bf16")
  a.format = "nvfp4"
  assert precision.recipe("bf16").format == "none"
  assert importlib.import_module("configs.bf16").PRECISION["format"] == "none"
  with pytest.raises(ValueError, match="Unknown precision recipe 'nvfp5'"):
    precision.recipe("nvfp5")


def test_copied_recipe_with_a_missing_or_extra_knob_names_it():
  from lowrl.models import layout
  from lowrl.models.config import ModelConfig
  matmuls = layout.matmuls(ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2,
                                       n_kv_heads=1, head_dim=16, d_ff=32))
  c = precision.recipe("bf16").to_dict()
  c["fromat"] = "nvfp4"
  with pytest.raises(ValueError, match=r"unknown knobs \['fromat'\]"):
    precision.make_policy(ml_collections.ConfigDict(c), matmuls)


# -- the training loop's schema ------------------------------------------------------------------


def test_train_defaults_are_the_loop_defaults():
  c = base.get_config("bf16")
  assert set(run_config.flatten(c)) == set(schema.TRAIN.docs())
  # A few values the README and the experiments rely on.
  assert (c.rl.steps, c.rl.num_prompts, c.rl.group_size, c.optimizer.lr) == (40, 32, 8, 2e-4)
  assert (c.task.name, c.sft.steps, c.model.d_model, c.mesh.shape) == ("sorting", 50, 128,
                                                                        (-1, 1))
  assert c.rl.clip_eps_high is None
  c.rl.clip_eps_high = 0.3  # a typed placeholder: the command line can set a float
  with pytest.raises(TypeError):
    c.rl.clip_eps_high = "big"
  schema.TRAIN.validate(base.get_config("nvfp4_recipe"))  # the defaults are valid


def test_defaults_are_fresh_per_config():
  a, b = base.get_config("bf16"), base.get_config("bf16")
  a.task.kwargs.num_digits = 1
  a.rl.clip_eps_high = 0.3
  assert "num_digits" not in b.task.kwargs and b.rl.clip_eps_high is None


@pytest.mark.parametrize("path, value, message", [
    ("rl.loss", "ppo2", "--config.rl.loss='ppo2': use one of 'grpo', 'dapo', 'gspo', 'cispo'."),
    ("rl.steps", 0, "--config.rl.steps=0: must be >= 1."),
    ("rl.group_size", 1, "--config.rl.group_size=1: must be >= 2 (group-relative advantages "
     "need >= 2 samples per prompt)."),
    ("rl.temperature", 0.0, "--config.rl.temperature=0.0: must be > 0"),
    ("rl.top_p", 0.0, "--config.rl.top_p=0.0 must be in (0, 1]"),
    ("rl.num_minibatches", 3, "--config.rl.num_minibatches=3: rl.num_prompts * rl.group_size = "
     "256 is not divisible by it."),
    ("rl.mis_low", 6.0, "--config.rl: Need 0 <= mis_low < mis_high"),
    ("rl.overlong_buffer", 9, "--config.rl.overlong_buffer=9: must be in [0, rl.max_new_tokens=8]"),
    ("rl.std_ddof", 2, "--config.rl.std_ddof=2: use one of 0, 1."),
    ("optimizer.grad_clip", 0.0, "--config.optimizer.grad_clip=0.0: must be > 0 or None."),
    ("optimizer.b2", 1.0, "--config.optimizer.b2=1.0: must be in [0, 1)."),
    ("optimizer.master_rounding", "stochastic", "--config.optimizer.master_rounding=stochastic "
     "rounds BF16 master weights; set --config.optimizer.master_dtype=bfloat16 too."),
    ("async_rl.sync_every", 0, "--config.async_rl.sync_every=0: must be >= 1"),
    ("sft.steps", -1, "--config.sft.steps=-1: must be >= 0."),
    ("eval_every", -1, "--config.eval_every=-1: must be >= 0."),
    ("sampler_precision.recipe", "nvfp5", "--config.sampler_precision.recipe='nvfp5': use one of "
     "'', 'fp32'"),
    ("task.verifier", "numeric", "--config.task.verifier only applies to --config.task.name=jsonl"),
    ("rl.kl_coef", float("nan"), "--config.rl.kl_coef=nan: must be a finite number."),
])
def test_train_checks_name_the_flag(path, value, message):
  c = base.get_config("bf16")
  _set(c, path, value)
  with pytest.raises(ValueError) as e:
    schema.TRAIN.validate(c)
  assert str(e.value).startswith(message), str(e.value)
  assert "\n" not in str(e.value)


def test_every_knob_has_a_meaning_and_choices_are_listed():
  for schema_, prefix in ((schema.TRAIN, ""), (simulator.SCHEMA, "sim.")):
    docs = schema_.docs(prefix)
    assert all(docs.values()), [k for k, v in docs.items() if not v]
  docs = schema.TRAIN.docs()
  assert docs["rl.correction"].endswith(": none | tis | mis")
  assert docs["precision.format"] == precision.KNOBS["format"]


# -- the simulator's schema: the same sections and checks ----------------------------------------


def test_simulator_shares_the_loop_sections():
  sim, train = simulator.default_config(), base.get_config("bf16")
  assert set(schema.RL.defaults().keys()) < set(sim.rl.keys())
  assert set(sim.rl.keys()) == set(schema.SIM_RL.defaults().keys()) < set(train.rl.keys())
  # The loop's optimizer adds only the static loss scale (the simulator has no FP16 recipe need).
  assert set(sim.optimizer.keys()) | {"loss_scale"} == set(train.optimizer.keys())
  # The loop's model section adds the real-checkpoint knobs to the shared ones.
  assert set(train.model.keys()) - set(sim.model.keys()) == {"hf_checkpoint", "param_dtype"}
  assert set(sim.model.keys()) < set(train.model.keys())
  assert set(sim.sft.keys()) == {"steps", "lr", "batch_size"}
  assert (sim.rl.steps, sim.rl.num_prompts, sim.optimizer.lr, sim.sft.steps) == (400, 8, 3e-3, 0)
  assert (sim.model.d_model, sim.model.d_ff) == (32, 64)
  simulator.SCHEMA.validate(sim)


@pytest.mark.parametrize("path, value, message", [
    # The loop's master-weight and rl checks, which the simulator's build used to skip.
    ("optimizer.master_rounding", "stochastic", "--config.optimizer.master_rounding=stochastic"),
    ("rl.steps", 0, "--config.rl.steps=0: must be >= 1."),
    ("rl.loss", "ppo2", "--config.rl.loss='ppo2'"),
    ("optimizer.lr", float("inf"), "--config.optimizer.lr=inf: must be a finite number."),
    ("trainer_recipe", "int4", "--config.trainer_recipe='int4': use one of"),
    ("act_calibration", "never", "--config.act_calibration='never'"),
    ("calib_num_prompts", 0, "--config.calib_num_prompts=0: must be >= 1."),
])
def test_simulator_build_runs_the_same_checks(path, value, message):
  c = simulator.default_config()
  _set(c, path, value)
  with pytest.raises(ValueError) as e:
    simulator.build(c)
  assert str(e.value).startswith(message), str(e.value)


def test_loop_build_validates_before_building_the_task():
  # A bad knob is reported even when the task would fail too (nothing is built first).
  c = base.get_config("bf16")
  c.task.name = "chess"
  c.rl.loss = "ppo2"
  with pytest.raises(ValueError, match="--config.rl.loss"):
    loop.build(c)
