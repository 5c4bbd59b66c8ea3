"""configs/ablate.py's `grid` rows ({name, group, overrides}) describe the settings
experiments/ablate.py builds: each row, applied to `run` as its docstring says, gives the same
loop config as the runner's Setting of that name."""
import ml_collections

from configs import ablate as ablate_config
from experiments import ablate
from lowrl import precision
from lowrl.training import run_config


def _apply(run: ml_collections.ConfigDict, overrides: dict, seed: int) -> ml_collections.ConfigDict:
  """A row as the docstring of configs/ablate.py defines it, written from that text."""
  c = ml_collections.ConfigDict(run.to_dict())
  c.seed = seed
  c.sampler_precision.recipe = ""  # the trainer's, unless the row says otherwise
  for path, value in overrides.items():
    if path == "precision":
      c.precision = precision.recipe(value)
    else:
      run_config.set_path(c, path, value)
  return c


def test_grid_rows_are_the_runner_settings():
  cfg = ablate_config.get_config()
  rows = {r["name"]: r for r in cfg.grid}
  assert len(rows) == len(cfg.grid)  # names are unique
  settings = {s.name: s for s in ablate.settings(cfg)}
  assert set(rows) == set(settings)
  for name, s in settings.items():
    assert rows[name]["group"] == s.group, name
    assert (run_config.to_json(_apply(cfg.run, rows[name]["overrides"], 1))
            == run_config.to_json(s.config(cfg.run, 1))), name


def test_grid_follows_its_knobs():
  rows = ablate_config.grid((1e-3,), 512.0, 0.1, 3)
  by_name = {r["name"]: r["overrides"] for r in rows}
  assert by_name["bf16_sr@1e-3"]["optimizer.lr"] == 1e-3 and "bf16_sr@2e-4" not in by_name
  assert by_name["fp16"]["optimizer.loss_scale"] == 512.0
  assert by_name["kl+reset"] == {"precision": "bf16", "rl.kl_coef": 0.1, "rl.ref_reset_every": 3}
