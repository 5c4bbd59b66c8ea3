"""Two processes on one machine (jax.distributed, CPU collectives over loopback) run RL steps in
lockstep on one global mesh, with the result of one process on the same 8 devices.

Each process is the real launcher, `python -m experiments.train` with the multi-process flags; this
file doubles as its config file (`get_config`).
"""
import json
import os

import pytest

WORKER_DEVICES = 4  # per process: 2 x 4 = the 8 devices of the single-process reference


def get_config(base_dir: str = ""):
  """The run of both sides (`--config=tests/test_distributed.py:<base_dir>`).

  1-digit addition after a 150-step SFT (most, not all, samples right): some groups of 4 get
  mixed rewards, so advantages, the loss and the gradient are non-zero and the two steps really
  update the weights.
  """
  import ml_collections
  from configs import base  # imported late: the launcher sets up JAX first
  c = base.get_config("bf16")
  c.task.name = "addition"
  c.task.kwargs = ml_collections.ConfigDict({"num_digits": 1})
  # One layer: 150 SFT steps still leave step 1's groups with mixed rewards (reward/mean 0.94).
  c.model.update(dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128))
  c.sft.steps, c.sft.batch_size, c.sft.base_dir = 150, 64, base_dir
  c.rl.steps, c.rl.num_prompts, c.rl.group_size, c.rl.max_new_tokens = 2, 4, 4, 4
  # Two passes: the first pass's PPO ratio is 1 and GRPO's loss -mean(A) is 0 by construction;
  # the second pass moves the ratio, so the logged (mean) loss is non-zero.
  c.rl.mu = 2
  # 16 eval rows, as the rollout's: the temperature-1 eval reuses the rollout's decode program.
  c.eval_num_prompts, c.eval_samples, c.checkpoint_every = 16, 1, 1
  c.mesh.shape = (-1, 2)  # (4, 2): "data" spans both processes, "model" stays within one
  return c


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_initialize_validates_launch_flags():
  from lowrl import distributed
  assert distributed.initialize() is False  # one process: nothing to connect
  with pytest.raises(ValueError, match="--num_processes and --process_id"):
    distributed.initialize("127.0.0.1:1234")
  with pytest.raises(ValueError, match="--coordinator_address"):
    distributed.initialize(num_processes=2, process_id=0)
  with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)


@pytest.mark.slow
def test_two_processes_run_rl_in_lockstep_like_one(tmp_path):
  # Imported here: the launched processes load this file as their config, without tests/ on
  # their path.
  from multiprocess import free_port, run_processes

  from lowrl.training import loop
  base_dir = str(tmp_path / "base")
  coordinator = f"127.0.0.1:{free_port()}"
  outs = run_processes([["-m", "experiments.train",
                         f"--config={os.path.abspath(__file__)}:{base_dir}",
                         f"--workdir={tmp_path / 'multi'}", f"--coordinator_address={coordinator}",
                         "--num_processes=2", f"--process_id={i}"] for i in range(2)],
                       WORKER_DEVICES)
  assert "[rl] step 2/2" in outs[0] and "[rl]" not in outs[1]  # only process 0 logs
  multi = _metrics(str(tmp_path / "multi"))

  # One process driving the same 8 devices (this pytest process), reusing the base the two
  # processes trained and saved.
  single_dir = str(tmp_path / "single")
  summary = loop.run(get_config(base_dir), single_dir, log=lambda _: None)
  single = _metrics(single_dir)
  assert [m["step"] for m in multi] == [m["step"] for m in single] == [1, 2]
  # A real update: step 1's rewards differ within a group, so its loss and gradient are non-zero;
  # step 2's metrics (rollouts, logprobs, entropy) are of the updated weights.
  first = multi[0]
  assert 0 < first["reward/mean"] < 1 and first["loss"] != 0 and first["grad_norm"] > 1e-3, first
  for a, b in zip(multi, single):
    assert a.keys() == b.keys()
    for k in a:
      # The same SPMD program on the same 8 devices; only cross-process sums (gloo) may be
      # ordered differently: FP32 reassociation of sums over <= 8 shards, a few ulps, which
      # Adam's first steps (update ~ lr * sign(g) away from g ~ 0) do not amplify past 1e-5.
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
  with open(tmp_path / "multi" / "summary.json") as f:
    assert json.load(f)["eval_end"] == summary["eval_end"]
  # Both processes saved one sharded checkpoint per step through orbax.
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["1", "2"]

