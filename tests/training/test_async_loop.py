"""Simulated asynchrony in the real training loop (lowrl.training.loop.run), on a tiny config.

One module-scoped base (a 1-layer model SFT'd to a 10-50% train pass rate, so advantages and
updates are non-zero) is shared by every run. Runs:
  sync   lag 0, sync every step, sampler recipe == trainer recipe (bf16)
  async  lag 2, sampler nvfp4_naive, trainer bf16 (both drift parts non-zero), run twice and
         once interrupted + resumed.
"""
import json
import os

import jax
import numpy as np
import pytest
import tiny

from lowrl.rl.drift import DRIFT_PARTS
from lowrl.training import loop, optimizer
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer
from lowrl.training.checkpointing import Checkpointer, abstract_like

STEPS = 4
LAG = 2


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("base"))


def tiny_config(base_dir: str, *, lag: int = 0, sampler_recipe: str = "", steps: int = STEPS,
                eval_every: int = 0):
  # One layer: nothing here depends on the depth, and the NVFP4 sampler's programs are smaller.
  # A 150-step SFT learns 1-digit addition to a 10-50% train pass rate (rl steps 1-4: 0.125,
  # 0.5, 0.375, 0.375): advantages and updates are non-zero.
  c = tiny.loop_config("bf16", base_dir, steps=steps, num_prompts=4, sft_steps=150,
                       sft_batch_size=64)
  c.model.n_layers = 1
  c.async_rl.lag = lag
  c.sampler_precision.recipe = sampler_recipe
  c.eval_every = eval_every
  return c


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _quiet(_: str) -> None:
  pass


@pytest.fixture(scope="module")
def async_run(base_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("async"))
  loop.run(tiny_config(base_dir, lag=LAG, sampler_recipe="nvfp4_naive", eval_every=2), workdir,
           log=_quiet)
  return workdir


def test_logged_drift_parts_add_up_and_both_are_present(async_run):
  rows = _metrics(async_run)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for i, r in enumerate(rows):
    q, s, t = (r[f"drift/{p}/mismatch_kl"] for p in DRIFT_PARTS)
    assert q + s == pytest.approx(t, abs=3e-6)  # the log rounds each to 1e-6
    # The total is what the trainer's own mismatch metric sees (same params, same tokens).
    assert t == pytest.approx(r["mismatch/mismatch_kl"], abs=2e-6)
    # nvfp4 sampler vs bf16 trainer: a quantization part at every step.
    assert r["drift/quantization/abs_dlogp_max"] > 1e-3
    for p in DRIFT_PARTS:
      assert r[f"drift/{p}/mismatch_kl_k3"] >= 0 and 0 < r[f"drift/{p}/ess"] <= 1
    # Step i samples with version max(i - LAG, 0): stale from the second step on.
    assert r["sampler_version_lag"] == min(i, LAG)
    if i == 0:
      assert r["drift/staleness/abs_dlogp_max"] == 0.0
    else:
      assert r["drift/staleness/abs_dlogp_max"] > 1e-4
    assert r["versions_held"] == min(i + 2, LAG + 1)  # the versions steps > i still need


def test_same_seed_same_metrics(async_run, base_dir, tmp_path):
  loop.run(tiny_config(base_dir, lag=LAG, sampler_recipe="nvfp4_naive", eval_every=2),
           str(tmp_path), log=_quiet)
  with open(os.path.join(async_run, "metrics.jsonl")) as a, \
       open(os.path.join(tmp_path, "metrics.jsonl")) as b:
    assert a.read() == b.read()


class _Crash(Exception):
  pass


def test_interrupted_run_resumes_to_the_uninterrupted_result(async_run, base_dir, tmp_path):
  """Crash right after step 2's metrics (with its held-out evaluation, eval_every=2) are
  written, before its checkpoint; then resume: step 2 and its evaluation are run again."""
  cfg = tiny_config(base_dir, lag=LAG, sampler_recipe="nvfp4_naive", eval_every=2)

  def crash_at_step_2(msg: str) -> None:
    if msg.startswith("[rl] step 2/"):
      raise _Crash

  with pytest.raises(_Crash):
    loop.run(cfg, str(tmp_path), log=crash_at_step_2)
  assert Checkpointer(os.path.join(tmp_path, "checkpoints"), every=1).latest_step() == 1
  logs = []
  loop.run(cfg, str(tmp_path), log=logs.append)
  assert any(m.startswith("[resume] from step 1") for m in logs)
  assert any(m.startswith("[eval] step 2 held-out pass@1") for m in logs)
  rows = _metrics(str(tmp_path))
  assert [r["step"] for r in rows if "eval/pass_at_1" in r] == [2]  # not 4: the final one
  assert rows == _metrics(async_run)


def _synchronous_reference(cfg, steps: int):
  """The synchronous trainer without the schedule: sample with the current params, update.

  Mirrors `loop.run`'s per-step keys, minus VersionBuffer and copies; each step is the loop's
  own (`Trainer.rl_step`: rollout, then the jitted RL step).
  """
  setup = build(cfg)
  base = loop.load_base(cfg, cfg.sft.base_dir, _quiet)
  trainer = Trainer(setup, _quiet)
  params = trainer.place(optimizer.to_master(base, cfg.optimizer.master_dtype))
  opt_state = trainer.init_opt_state(params)
  base_key = jax.random.key(cfg.seed)
  rows = []
  for step in range(steps):
    params, opt_state, m, _ = trainer.rl_step(params, params, opt_state, None, step,
                                              jax.random.fold_in(base_key, step), stale=False)
    rows.append({k: round(float(v), 6) for k, v in m.items()})
  return params, opt_state, rows


def test_lag0_sync1_same_recipe_is_the_synchronous_trainer(base_dir, tmp_path):
  cfg = tiny_config(base_dir, lag=0, sampler_recipe="bf16")
  cfg.async_rl.lag_distribution = "uniform"  # lag 0 under any distribution is lag 0
  loop.run(cfg, str(tmp_path), log=_quiet)
  rows = _metrics(str(tmp_path))
  ref_params, ref_opt_state, ref_rows = _synchronous_reference(tiny_config(base_dir), STEPS)

  assert any(r["grad_norm"] > 0 for r in ref_rows)  # the comparison is not between no-ops
  for r, ref in zip(rows, ref_rows, strict=True):
    assert {k: r[k] for k in ref} == ref
    assert r["sampler_version_lag"] == 0 and r["versions_held"] == 1
    # Same recipe, current weights: the sampler's logprobs are the trainer's, bit for bit.
    for p in DRIFT_PARTS:
      assert r[f"drift/{p}/mismatch_kl"] == 0.0 and r[f"drift/{p}/abs_dlogp_max"] == 0.0
      assert r[f"drift/{p}/ess"] == 1.0

  ref = {"params": ref_params, "opt_state": ref_opt_state,
         "rng": jax.random.key_data(jax.random.key(cfg.seed))}
  saved, _, step = Checkpointer(os.path.join(tmp_path, "checkpoints"), every=1).restore(
      abstract_like(ref))
  assert step == STEPS
  for a, b in zip(jax.tree.leaves(saved["params"]), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
