r"""Sweep the asynchronous-RL simulator over a grid of knobs (lowrl/asyncrl/sweep.py).

  lowrl-simulate --workdir=/tmp/lowrl_sim                        # configs/simulate.py
  lowrl-simulate --workdir=/tmp/sim_small --config.sim.rl.steps=100 \
      --config.grid.lag="(0, 4)" --config.grid.sampler_recipe="('nvfp4_naive',)"
(`python -m experiments.simulate ...` is the same; --print_config lists every knob.)

Per setting: TensorBoard runs in <workdir>/runs/<setting>/seed_<s>, one line in
<workdir>/results.jsonl; at the end <workdir>/summary.md (table) and summary.png (plots). Progress
lines (with ETA) go to stdout. Re-running with the same --workdir skips finished settings.
A config error is one line on stderr and exit status 2.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from lowrl.asyncrl import simulator, sweep
from lowrl.training import cli, run_config

_DEFAULT_CONFIG = os.path.join(cli.REPO, "configs", "simulate.py")
sys.argv = cli.resolve_config_paths(sys.argv)
try:  # ml_collections loads the config file and checks the overrides right here
  _CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG,
                                            "Path to an ml_collections config file.")
except Exception as e:  # noqa: BLE001 - any failure here is a usage error
  cli.config_error(e, sys.argv, _DEFAULT_CONFIG)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/lowrl_sim", "Sweep directory (runs, results).")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False,
                                  "Print every --config.* knob with its value and exit.")


def _knob_docs() -> dict[str, str]:
  """Meanings of the sweep's knobs: the simulator's schema (sim.*), the sweep file's comments."""
  docs = simulator.SCHEMA.docs("sim.")
  with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                         "simulate.py")) as f:
    docs.update(run_config.comment_docs(f.read()))
  return docs


def main(argv):
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}; flags look like --workdir=DIR.")
  cfg = cli.config_value(_CONFIG, sys.argv, _DEFAULT_CONFIG)
  if _PRINT_CONFIG.value:
    print(run_config.describe(cfg, _knob_docs()))
    return
  sweep.run_sweep(cfg, _WORKDIR.value, log=lambda s: print(s, flush=True))


def run_main():
  """Console entry point (`lowrl-simulate`)."""
  app.run(main, flags_parser=cli.make_flags_parser(_DEFAULT_CONFIG))


if __name__ == "__main__":
  run_main()
