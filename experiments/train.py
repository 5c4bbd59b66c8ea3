r"""The main job: mid-train a small base, then RL under a precision recipe.

  python -m experiments.train                                   # configs/default.py (nvfp4_recipe)
  python -m experiments.train --config=configs/bf16.py --workdir=/tmp/lowrl_bf16
  python -m experiments.train --config.rl.steps=100 --config.precision.bf16_last_fraction=0

Progress (step, reward, mismatch, ETA) goes to stdout; TensorBoard logs to <workdir>/tb,
per-step metrics to <workdir>/metrics.jsonl, the summary to <workdir>/summary.json. Re-running
with the same --workdir resumes from the newest checkpoint.

Several processes (one per host, or per GPU): run the same command on each, with
  --coordinator_address=HOST0:PORT --num_processes=N --process_id=I   (explicit), or
  --distributed                                                      (auto-detect: TPU pod slice,
                                                                      SLURM, Open MPI, Kubernetes)
and a --workdir every process can reach. The mesh (--config.mesh.shape/axes/rules) spans all
processes' devices; see README "Sharding and multi-host runs".
"""
from absl import app, flags, logging
from ml_collections import config_flags

from lowrl import distributed
from lowrl.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/lowrl_run", "Run directory (checkpoints, logs).")
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
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every save at INFO; progress lines are printed, so keep the log to warnings.
    logging.set_verbosity(logging.WARNING)
  # Before anything touches a device: the mesh in the config spans every process's devices.
  distributed.initialize(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, auto=_DISTRIBUTED.value,
      local_device_ids=None if _LOCAL_DEVICES.value is None else
      [int(i) for i in _LOCAL_DEVICES.value])
  loop.run(_CONFIG.value, _WORKDIR.value, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
  app.run(main)
