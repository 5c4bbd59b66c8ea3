"""The config schema (lowrl.training.schema): checks naming the flag, both run kinds; the config
files as data (configs/base.py's values, lowrl/recipes.py's recipes) resolving as on main."""
import importlib
import json

import pytest

import tiny
from configs import base
from lowrl import precision, recipes
from lowrl.asyncrl import simulator
from lowrl.training import run_config, schema
from lowrl.training.setup import build

# The resolved configs (first generated on main before configs became data, to show the move
# changed none; regenerated since for deliberate changes: sft.steps 150 -> 50, eval_every 0 -> 10,
# rl.routing_replay, the simulator's reduced grid, optimizer.compute_cast_rounding, the
# ablation's sr_travel, its 5 seeds / descriptive_seeds, its default groups and
# paired.distance_groups, model.eos_token, the ablation's 10 seeds / lrs
# (2e-4, 5e-6) / groups without sampler_only / after_run, rl.pack_tokens / rl.pack_rows, the main
# job's sampler_decode_min_rows 0), generated with run_config.to_json(configs.<name>.get_config()) (and precision.recipe(name).to_dict(),
# simulator.default_config()). A deliberate change of a value regenerates it the same way.
ON_MAIN = json.loads((tiny.REPO / "tests" / "data" / "configs_on_main.json").read_text())
_set = run_config.set_path


# -- configs and recipes as data -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ON_MAIN["configs"]))
def test_config_file_resolves_as_on_main(name):
  got = run_config.to_json(importlib.import_module(f"configs.{name}").get_config())
  if name == "ablate":
    got.pop("grid")  # added since: the grid as data (tests/experiments/test_ablate_grid.py)
  assert got == ON_MAIN["configs"][name]


def test_recipes_and_simulator_defaults_resolve_as_on_main():
  assert list(precision.RECIPES) == ON_MAIN["recipe_order"]  # names and table order
  for name, want in ON_MAIN["recipes"].items():
    assert precision.recipe(name).to_dict() == want, name
    assert list(recipes.RECIPES[name]) == list(precision.KNOBS), name  # every knob, KNOBS' order
  assert run_config.to_json(simulator.default_config()) == ON_MAIN["simulator_default"]
  assert run_config.fingerprint(base.get_config()) == ON_MAIN["fingerprint_default"]


# -- the training loop's schema ------------------------------------------------------------------


def test_base_config_has_exactly_the_schema_knobs():
  c = base.get_config("bf16")
  assert set(run_config.flatten(c)) == set(schema.TRAIN.docs())
  assert c.rl.clip_eps_high is None
  c.rl.clip_eps_high = 0.3  # a typed placeholder: the command line can set a float
  with pytest.raises(TypeError):
    c.rl.clip_eps_high = "big"
  schema.TRAIN.validate(base.get_config("nvfp4_recipe"))  # the defaults are valid


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.rl.unlock().__delitem__("tis_cap"), "--config.rl.tis_cap is missing from the "
     "config: add it to the config file (the loop's defaults: configs/base.py)."),
    (lambda c: c.unlock().__setitem__("eval_everyy", 3), "--config.eval_everyy is not a knob of "
     "the schema (lowrl.training.schema); drop it, or add its knob(...) line there."),
    (lambda c: c.mesh.unlock().__setitem__("shap", (1,)), "--config.mesh.shap is not a knob"),
])
def test_missing_or_unknown_knob_is_one_line(edit, message):
  c = base.get_config("bf16")
  edit(c)
  with pytest.raises(ValueError) as e:
    schema.TRAIN.validate(c)
  assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_loop_schema_holds_no_values_and_the_tiny_architecture_is_base_s():
  with pytest.raises(ValueError, match="the schema holds no value of rl.steps"):
    schema.TRAIN_RL.defaults()
  model = base.get_config().model
  assert {k: model[k] for k in schema.TINY_ARCHITECTURE} == schema.TINY_ARCHITECTURE
  model.hf_checkpoint = "/some/checkpoint"
  schema.TRAIN.section("model").validate(model)  # the base values read as unchanged


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
    # Range checks of the loss / update types, which name their own fields: under the flag.
    ("rl.clip_eps_low", 1.5, "--config.rl.clip_eps_low must be in [0, 1)"),
    ("rl.tis_cap", -1.0, "--config.rl.tis_cap must be > 0, got -1.0."),
    ("rl.mu", 0, "--config.rl.mu (inner updates per batch) must be >= 1, got 0."),
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
  assert docs["rl.correction"].endswith(": none | tis | mis | icepop | vcpo")
  assert docs["precision.format"] == precision.KNOBS["format"]


# -- the simulator's schema: the same sections and checks ----------------------------------------


def test_simulator_shares_the_loop_sections():
  sim, train = simulator.default_config(), base.get_config("bf16")
  assert {k.name for k in schema.RL.knobs} < set(sim.rl.keys())
  assert set(sim.rl.keys()) == {k.name for k in schema.SIM_RL.knobs} < set(train.rl.keys())
  # The loop's optimizer adds only the static loss scale (the simulator has no FP16 recipe need)
  # and the trainer's stochastic compute cast (lowrl.training.compute_cast: the loop's trainer).
  assert (set(sim.optimizer.keys()) | {"loss_scale", "compute_cast_rounding"}
          == set(train.optimizer.keys()))
  # The loop's model section adds the real-checkpoint knobs to the shared ones.
  assert set(train.model.keys()) - set(sim.model.keys()) == {"hf_checkpoint", "param_dtype",
                                                              "eos_token"}
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


@pytest.mark.parametrize("path, value, message", [
    # lowrl.precision's and ModelConfig's own range checks, reported under the flag.
    ("precision.bf16_last_fraction", 2.0, "--config.precision.bf16_last_fraction=2.0 must be in "
     "[0, 1] (0 disables the high-precision tail)."),
    ("model.n_layers", 0, "--config.model.n_layers must be a positive int, got 0."),
])
def test_build_range_errors_name_the_flag(path, value, message):
  c = base.get_config("bf16")
  _set(c, path, value)
  with pytest.raises(ValueError) as e:
    build(c)
  assert str(e.value) == message


def test_precision_errors_name_every_flag_they_mention():
  c = base.get_config("bf16")
  c.precision.act_per_token = True  # needs a quantized format; bf16 has none
  with pytest.raises(ValueError) as e:
    build(c)
  assert str(e.value) == ("--config.precision.act_per_token=True needs a quantized format; set "
                          "--config.precision.format (e.g. nvfp4) or "
                          "--config.precision.act_per_token=False.")


def test_loop_build_validates_before_building_the_task():
  # A bad knob is reported even when the task would fail too (nothing is built first).
  c = base.get_config("bf16")
  c.task.name = "chess"
  c.rl.loss = "ppo2"
  with pytest.raises(ValueError, match="--config.rl.loss"):
    build(c)
