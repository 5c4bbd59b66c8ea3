r"""The main job: mid-train a small base, then RL under a precision recipe.

  python -m experiments.train --workdir=DIR                 # configs/default.py (nvfp4_recipe)
  python -m experiments.train --config=configs/bf16.py --workdir=/tmp/lowrl_bf16
  python -m experiments.train --config.rl.steps=100 --config.precision.bf16_last_fraction=0
  python -m experiments.train --print_config                # every --config.* knob, then exit
(from the repository root). A relative --config path is looked up in the
working directory, then in the repository.

Progress (step, reward, mismatch, ETA) goes to stdout; TensorBoard logs to <workdir>/tb,
per-step metrics to <workdir>/metrics.jsonl, the summary to <workdir>/summary.json, the resolved
config to <workdir>/config.json. Re-running with the same --workdir resumes from the newest intact
checkpoint (refused if the config changed, unless --allow_config_change); a finished run prints
its summary and exits (--reevaluate evaluates it again). Exit status: 0 done; 2 a config or workdir problem
found before compiling (one line on stderr: a bad flag, a damaged bookkeeping file, another run
holding the workdir, no write access or space); 1 a failure mid-run (a damaged checkpoint, a
full disk, repeated non-finite updates); 75 stopped by SIGTERM/SIGINT after checkpointing (re-run
to resume); 128+N a second signal N (docs/integrity.md).

Several processes (one per host, or per GPU): run the same command on each, with
  --coordinator_address=HOST0:PORT --num_processes=N --process_id=I   (explicit), or
  --distributed                                                      (auto-detect: TPU pod slice,
                                                                      SLURM, Open MPI, Kubernetes)
and a --workdir every process can reach. The mesh (--config.mesh.shape/axes/rules) spans all
processes' devices; see docs/sharding.md.
"""
from absl import app, flags, logging

from lowrl import distributed
from lowrl.training import cli, exits, loop, schema

_FLAGS = cli.define_run_flags("default.py", "/tmp/lowrl_run",
                               "Run directory (checkpoints, logs).")
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume a run in --workdir even though the config differs from "
    "the one it was started with (the changed keys are printed).")
_REEVALUATE = flags.DEFINE_bool("reevaluate", False,
                                "On a finished run: evaluate it again and rewrite summary.json.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Initialize jax.distributed from the cluster environment (Cloud TPU pod "
    "slices, SLURM, Open MPI, Kubernetes); explicit flags below override what it detects.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator (multi-process launch).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")
_LOCAL_DEVICES = flags.DEFINE_list(
    "local_device_ids", None, "Devices this process drives (e.g. one process per GPU: its id); "
    "default all local devices.")


def main(argv):
  cfg = _FLAGS.start(argv, schema.TRAIN.docs())
  if cfg is None:
    return
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every save at INFO; progress lines are printed, so keep the log to warnings.
    logging.set_verbosity(logging.WARNING)
  # Before anything touches a device: the mesh in the config spans every process's devices.
  distributed.initialize(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, auto=_DISTRIBUTED.value,
      local_device_ids=None if _LOCAL_DEVICES.value is None else
      [int(i) for i in _LOCAL_DEVICES.value])
  # Each expected failure is one line and its exit status (lowrl.training.exits); background
  # threads' reports of a full disk are dropped until the process exits.
  with exits.one_line_exits():
    loop.run(cfg, _FLAGS.workdir.value, log=lambda s: print(s, flush=True),
             allow_config_change=_ALLOW_CHANGE.value, reevaluate=_REEVALUATE.value)


def run_main():
  """Runs the binary (`python -m experiments.train`)."""
  app.run(main, flags_parser=_FLAGS.parser())


if __name__ == "__main__":
  run_main()
