r"""The main job: mid-train a small base, then RL under a precision recipe.

  python -m experiments.train                                   # configs/default.py (nvfp4_recipe)
  python -m experiments.train --config=configs/bf16.py --workdir=/tmp/lowrl_bf16
  python -m experiments.train --config.rl.steps=100 --config.precision.bf16_last_fraction=0

Progress (step, reward, mismatch, ETA) goes to stdout; TensorBoard logs to <workdir>/tb,
per-step metrics to <workdir>/metrics.jsonl, the summary to <workdir>/summary.json. Re-running
with the same --workdir resumes from the newest checkpoint.
"""
from absl import app, flags
from ml_collections import config_flags

from lowrl.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/lowrl_run", "Run directory (checkpoints, logs).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  loop.run(_CONFIG.value, _WORKDIR.value, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
  app.run(main)
