r"""Sweep the asynchronous-RL simulator over a grid of knobs (lowrl/asyncrl/sweep.py).

  python -m experiments.simulate --workdir=/tmp/lowrl_sim          # configs/simulate.py
  python -m experiments.simulate --workdir=/tmp/sim_small --config.sim.rl.steps=100 \
      --config.grid.lag="(0, 4)" --config.grid.sampler_recipe="('nvfp4_naive',)"

Per setting: TensorBoard runs in <workdir>/runs/<setting>/seed_<s>, one line in
<workdir>/results.jsonl; at the end <workdir>/summary.md (table) and summary.png (plots). Progress
lines (with ETA) go to stdout. Re-running with the same --workdir skips finished settings.
"""
from absl import app, flags
from ml_collections import config_flags

from lowrl.asyncrl import sweep

_CONFIG = config_flags.DEFINE_config_file("config", "configs/simulate.py",
                                          "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/lowrl_sim", "Sweep directory (runs, results).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  sweep.run_sweep(_CONFIG.value, _WORKDIR.value, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
  app.run(main)
