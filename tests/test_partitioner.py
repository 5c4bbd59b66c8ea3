"""The rollout (prefill + decode, exact-mode rescore) and the RL update on (4, 2) and (2, 4) meshes
compile without XLA partitioner "[SPMD] Involuntary full rematerialization" warnings, and the
decode program is data parallel (no collective moves a whole batch).

The partitioner logs from C++ to the process's stderr, and a program found in the persistent
compilation cache is not partitioned again (no warning), so each mesh compiles in a fresh
subprocess without a cache (this file is also the worker: `python tests/test_partitioner.py`).
A control run compiles the update as it was before rows were pinned (no `plan.rows`, PPO
minibatches as contiguous rows, `reshape(n, mb)[i]`): it must log the warning, which shows that
the capture sees it.
"""
import os
import re
import subprocess
import sys

import pytest

import multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARNING = "Involuntary full rematerialization"
BATCH = 24  # rollout rows: a size no model width has, so a collective of [24, ...] is a batch


def _worker(shape: tuple[int, int], contiguous: bool) -> None:
  """Compiles the sampler's programs and the update on `shape`; prints markers to stderr."""
  sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  from lowrl import precision
  from lowrl.models import init, layout, transformer
  from lowrl.sampling import SamplingConfig, rescore
  from lowrl.sampling.generate import _decode_program
  from lowrl.training import optimizer, rl_update
  from lowrl.training.setup import build
  from lowrl.training.trainer import Trainer
  import test_sharding as ts
  import tiny

  if contiguous:  # the update before the fix (contiguous minibatches, rows unpinned): control
    rl_update._strided = lambda tree, parts: jax.tree.map(
        lambda x: x.reshape((parts, x.shape[0] // parts) + x.shape[1:]), tree)
    rl_update._part = lambda tree, j: jax.tree.map(lambda x: x[j], tree)
  mark = lambda s: print(f"@@ {s}", file=sys.stderr, flush=True)  # noqa: E731
  plan = ts._plan(shape)
  model = tiny.SHARDABLE
  policy = precision.PrecisionPolicy.unquantized(layout.matmuls(model))
  if not contiguous:
    params = init.init_params(model, jax.random.key(0))
    params = plan.put(params, plan.param_shardings(params))
    prompts = plan.put(jnp.ones((BATCH, 5), jnp.int32), plan.batch)
    pmask = plan.put(jnp.ones((BATCH, 5), bool), plan.batch)
    config = SamplingConfig(max_new_tokens=4, temperature=1.0)
    cache = plan.put(transformer.init_cache(model, BATCH, 9, policy.dtype),
                     plan.cache_shardings(model))
    mark("decode")
    decode = _decode_program(model, policy, config, plan).lower(
        params, prompts, pmask, jax.random.key(2), cache, None, None).compile()
    ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
    batch_ops = re.findall(rf"= \w+\[{BATCH},[^\n]* (?:{ops})\(", decode.as_text())
    mark(f"batch collectives {len(batch_ops)}")
    mark("rescore")
    # The decode executable compiled above (calling the jitted program would compile it again).
    out, _ = decode(params, prompts, pmask, jax.random.key(2), cache, None, None)
    jax.block_until_ready(rescore(out, params, model_cfg=model, policy=policy, config=config,
                                  plan=plan).logprobs)
  mark("update")
  cfg = ts._update_config("fp32", shape)
  cfg.rl.micro_batches = 1 if contiguous else 2
  setup = dataclasses.replace(build(cfg), plan=plan)
  trainer = Trainer(setup, log=lambda _: None)
  params0 = init.init_params(setup.model_cfg, jax.random.key(0))
  state = trainer.place({"params": params0,
                         "opt_state": optimizer.init_opt_state(trainer.tx, params0)})
  p_sh, o_sh = (trainer.state_shardings(state[k]) for k in ("params", "opt_state"))
  update = jax.jit(rl_update.make_rl_update(trainer.logprob_fn, trainer.tx, setup.update_cfg,
                                            None if contiguous else plan),
                   in_shardings=(p_sh, o_sh, plan.replicated, plan.batch, plan.replicated))
  batch = plan.put(ts._batch(setup, jax.random.key(10)), plan.batch)
  update.lower(state["params"], state["opt_state"], None, batch, jax.random.key(0)).compile()
  mark("done")
  del np


def _run(shape: tuple[int, int], contiguous: bool = False) -> str:
  # No persistent cache: every program is partitioned here.
  env = multiprocess.child_env(8, TF_CPP_MIN_LOG_LEVEL="0", LOWRL_TEST_JAX_CACHE="")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  cmd = [sys.executable, os.path.abspath(__file__), f"{shape[0]},{shape[1]}",
         "contiguous" if contiguous else "strided"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "@@ done" in proc.stderr, proc.stderr[-4000:]
  return proc.stderr


def _warned_sections(log: str) -> list[str]:
  """The marked sections (decode, rescore, update) during which the partitioner warned."""
  out, section = [], None
  for line in log.splitlines():
    if line.startswith("@@ "):
      section = line[3:]
    elif WARNING in line and section not in out:
      out.append(section)
  return out


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_rollout_and_update_compile_without_involuntary_rematerialization(shape):
  log = _run(shape)
  assert _warned_sections(log) == [], [l for l in log.splitlines() if WARNING in l][:3]
  # Data parallel decode: every device works on its own rows, no collective carries the batch.
  assert "@@ batch collectives 0" in log, re.findall(r"@@ batch collectives \d+", log)


@pytest.mark.slow
def test_contiguous_unpinned_minibatches_trigger_the_warning_the_test_looks_for():
  assert _warned_sections(_run((4, 2), contiguous=True)) == ["update"]


if __name__ == "__main__":
  _worker(tuple(int(s) for s in sys.argv[1].split(",")), sys.argv[2] == "contiguous")
