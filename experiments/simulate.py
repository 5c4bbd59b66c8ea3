r"""Sweep the asynchronous-RL simulator over a grid of knobs (lowrl/asyncrl/sweep.py).

  python -m experiments.simulate --workdir=/tmp/lowrl_sim        # configs/simulate.py
  python -m experiments.simulate --workdir=/tmp/sim_small --config.sim.rl.steps=100 \
      --config.grid.lag="(0, 4)" --config.grid.sampler_recipe="('nvfp4_naive',)"
(from the repository root; --print_config lists every knob.)

Per setting: TensorBoard runs in <workdir>/runs/<setting>/seed_<s>, one line in
<workdir>/results.jsonl; at the end <workdir>/summary.md (table) and summary.png (plots). Progress
lines (with ETA) go to stdout. Re-running with the same --workdir skips finished settings.
`--report_only` writes the summary of the settings already finished (e.g. while the sweep runs).
A config error is one line on stderr and exit status 2.
"""

from absl import app, flags

from lowrl.asyncrl import simulator, sweep
from lowrl.training import cli, exits, run_config

_FLAGS = cli.define_run_flags("simulate.py", "/tmp/lowrl_sim",
                               "Sweep directory (runs, results).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only write the summary of the settings "
                                 "results.jsonl already holds; run nothing.")


def main(argv):
  cfg = _FLAGS.start(argv, simulator.SCHEMA.docs("sim."))
  if cfg is None:
    return
  log = lambda s: print(s, flush=True)  # noqa: E731
  # A bad grid or a results.jsonl of another config is one line (lowrl.training.exits).
  with exits.one_line_exits():
    try:
      sweep.expand_grid(cfg)  # every setting checked, before anything compiles
    except ValueError as e:
      raise run_config.ConfigError(str(e)) from None
    if _REPORT_ONLY.value:
      sweep.write_report(cfg, _FLAGS.workdir.value, log=log)
    else:
      sweep.run_sweep(cfg, _FLAGS.workdir.value, log=log)


def run_main():
  """Runs the binary (`python -m experiments.simulate`)."""
  app.run(main, flags_parser=_FLAGS.parser())


if __name__ == "__main__":
  run_main()
