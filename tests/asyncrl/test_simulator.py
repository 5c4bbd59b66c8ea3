"""The fast asynchronous-RL simulator (lowrl.asyncrl.simulator) and its sweep (lowrl.asyncrl.sweep).

Every run uses one of two tiny setups (bf16 and an NVFP4 sampler; one compile each): a 1-layer
decoder, 2 prompts x 4 samples, horizon 4. Runs of the bf16 setup share one ring size (SLOTS) and
the seeds, so they share one compiled program; every run uses the same seeds (SEEDS), so all share
one compiled init and eval (their trainers are bf16).
"""
import collections
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lowrl.asyncrl import simulator, sweep, timing
from lowrl.training import optimizer, rl_update
from lowrl.training import step as step_lib
from lowrl.rl.drift import DRIFT_PARTS
from lowrl.sampling import SampleOutput
from lowrl.training.schedule import AsyncSchedule

STEPS = 8
SEEDS = (0, 1)
SLOTS = 4  # >= every schedule's max_versions below: one compiled program for all of them


def tiny_config(sampler_recipe: str = "bf16", trainer_recipe: str = "bf16"):
  c = simulator.default_config()
  c.task.update(kind="sort", num_symbols=5, length=4)
  c.model.update(d_model=16, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=16, d_ff=32)
  c.rl.update(steps=STEPS, num_prompts=2, group_size=4)
  c.optimizer.lr = 3e-2  # large, so that a few steps move the policy measurably
  c.sampler_recipe, c.trainer_recipe = sampler_recipe, trainer_recipe
  c.eval_num_prompts = 8
  # The modelled system (clock only, not the compiled program): its lag ('auto') is 2.
  c.cost.sequences_per_sim_sequence = 32
  return c


@pytest.fixture(scope="module")
def bf16_setup():
  return simulator.build(tiny_config())


# ----------------------------------------------------------------------------------------------
# The task.


def _prompts(task, key, n, split="train"):
  """task.prompts as one program (op by op it compiled a dozen small ones per shape)."""
  return jax.jit(task.prompts, static_argnums=(1, 2))(key, n, split)


def test_task_targets_and_rewards():
  prompt = jnp.array([[5, 3, 0, 4, 0]])  # bos = num_symbols = 5
  completion = jnp.array([[0, 0, 4, 3]])
  for kind, target in (("sort", [0, 0, 3, 4]), ("reverse", [0, 4, 0, 3]),
                       ("copy", [3, 0, 4, 0])):
    task = simulator.SequenceTask(kind=kind, num_symbols=5, length=4)
    np.testing.assert_array_equal(jax.jit(task.targets)(prompt), [target])
  task = simulator.SequenceTask(kind="sort", num_symbols=5, length=4)
  rewards = jax.jit(task.rewards)
  reward, exact = rewards(prompt, completion)
  assert float(reward[0]) == 0.5 and float(exact[0]) == 0.0
  reward, exact = rewards(prompt, jnp.array([[0, 0, 3, 4]]))
  assert float(reward[0]) == 1.0 and float(exact[0]) == 1.0
  exact_task = simulator.SequenceTask(kind="sort", num_symbols=5, length=4, reward="exact")
  assert float(jax.jit(exact_task.rewards)(prompt, completion)[0][0]) == 0.0
  p = np.asarray(_prompts(task, jax.random.key(0), 64))
  assert p.shape == (64, 5) and np.all(p[:, 0] == 5) and int(p[:, 1:].max()) < 5


def _multisets(prompts):
  return {tuple(sorted(row)) for row in np.asarray(prompts)[:, 1:].tolist()}


def test_default_task_eval_split_is_disjoint_from_training():
  # Sorting 6 of 8 symbols: C(8 + 6 - 1, 6) = 1716 problems (multisets), all of which random
  # draws used to reach. Now the held-out ones are never drawn for training (or the warm start).
  task = simulator.SequenceTask(**simulator.default_config().task.to_dict())
  train = np.asarray(_prompts(task, jax.random.key(0), 100_000, "train"))
  held_out = np.asarray(_prompts(task, jax.random.key(1), 20_000, "eval"))
  assert int(train[:, 0].min()) == int(held_out[:, 0].max()) == task.bos_id
  train_sets, eval_sets = _multisets(train), _multisets(held_out)
  assert not train_sets & eval_sets
  # The rule, from the spec: held out iff the symbols sum to 0 mod num_symbols.
  assert all(sum(m) % 8 == 0 for m in eval_sets) and all(sum(m) % 8 for m in train_sets)
  n_eval = sum(1 for m in itertools.combinations_with_replacement(range(8), 6) if sum(m) % 8 == 0)
  # Both sides are covered (a few multisets, e.g. six equal symbols, have probability ~8^-5).
  assert len(eval_sets) > 0.95 * n_eval and len(train_sets) > 0.95 * (1716 - n_eval)
  with pytest.raises(ValueError, match="split"):
    task.prompts(jax.random.key(0), 4, "test")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_split_prompts_are_uniform_over_their_sequences(split):
  # 3 symbols, length 3: 27 sequences, 9 with sum = 0 mod 3. Each split's draws are uniform over
  # its sequences: every count within 6 binomial standard deviations of n / size.
  task = simulator.SequenceTask(num_symbols=3, length=3)
  n = 60_000
  rows = np.asarray(_prompts(task, jax.random.key(7), n, split))[:, 1:]
  seqs = [s for s in itertools.product(range(3), repeat=3) if (sum(s) % 3 == 0) == (split == "eval")]
  counts = collections.Counter(map(tuple, rows.tolist()))
  assert set(counts) == set(seqs)
  p = 1 / len(seqs)
  sigma = np.sqrt(n * p * (1 - p))
  assert all(abs(c - n * p) < 6 * sigma for c in counts.values())


@pytest.mark.parametrize("path, value, match", [
    ("sampler_recipe", "fp8", "--config.sampler_recipe='fp8'"), ("task.kind", "add", "task.kind"),
    ("rl.group_size", 1, "group_size"), ("rl.correction", "is", "--config.rl.correction"),
    ("rl.std_ddof", 2, "rl.std_ddof"),
    ("model.d_ff", 24, "nvfp4 blocks of 16 .* not a multiple of 16"),
])
def test_build_rejects_bad_settings(path, value, match):
  c = tiny_config(sampler_recipe="nvfp4_naive")
  sweep._set(c, path, value)
  with pytest.raises(ValueError, match=match):
    simulator.build(c)


# ----------------------------------------------------------------------------------------------
# Runs.


@pytest.mark.parametrize("schedule", [AsyncSchedule(), AsyncSchedule(lag=2),
                                      AsyncSchedule(lag=3, sync_every=2),
                                      AsyncSchedule(lag=3, lag_distribution="uniform")],
                         ids=["sync", "lag2", "lag3-sync2", "uniform3"])
def test_in_jit_versions_are_the_schedule(bf16_setup, schedule):
  res = simulator.simulate(bf16_setup, schedule, SEEDS, num_slots=SLOTS)
  for i, seed in enumerate(SEEDS):
    seeded = AsyncSchedule(schedule.lag, schedule.sync_every, schedule.lag_distribution, seed)
    expected = [seeded.sampler_version(t) for t in range(STEPS)]
    np.testing.assert_array_equal(res.metrics["sampler_version"][i], expected)
    np.testing.assert_array_equal(res.metrics["sampler_version_lag"][i],
                                  np.arange(STEPS) - np.array(expected))
  stale = res.metrics["drift/staleness/abs_dlogp_max"]
  lagged = res.metrics["sampler_version_lag"] > 0
  assert np.all(stale[~lagged] == 0.0)  # the ring's version t is the trainer's params, bit for bit
  assert np.all(stale[lagged] > 0.0)


def test_same_seed_replays_and_other_seeds_differ(bf16_setup):
  schedule = AsyncSchedule(lag=2)
  a = simulator.simulate(bf16_setup, schedule, SEEDS, num_slots=SLOTS).metrics
  b = simulator.simulate(bf16_setup, schedule, SEEDS, num_slots=SLOTS).metrics
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert not np.array_equal(a["reward/mean"][0], a["reward/mean"][1])


def test_a_seed_is_a_unit_whatever_seeds_run_beside_it():
  """Seed s alone gives bit for bit what it gives among other seeds (and in another position):
  a rerun with more seeds contains the first run. With the seeds vmapped, XLA compiled one
  program per seed count and rounded each differently (seed 0's base and outcome moved with it).
  The NVFP4 sampler: quantization turns any one-ulp difference into another code, so a width-
  dependent rounding anywhere in the run shows."""
  setup = simulator.build(tiny_config(sampler_recipe="nvfp4_naive"))
  schedule = AsyncSchedule(lag=2)
  wide = simulator.simulate(setup, schedule, (2, 0, 1))
  alone = simulator.simulate(setup, schedule, (0,))
  assert wide.metrics.keys() == alone.metrics.keys()
  for k, v in alone.metrics.items():
    np.testing.assert_array_equal(v[0], wide.metrics[k][1], err_msg=k)
  for a, b in zip(jax.tree.leaves(alone.params), jax.tree.leaves(wide.params)):
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[1]))
  assert alone.compile_s == 0.0  # one program whatever the number of seeds: nothing recompiled


def test_lag0_sync1_same_recipe_is_the_synchronous_trainer(bf16_setup):
  """At lag 0 with sync every step the ring hands the rollout the trainer's current weights, bit
  for bit, at every step; the step body is then rollout(params) -> update, the synchronous trainer.

  Compared within the one compiled program (no hand-written copy of the step: two different XLA
  programs round differently from one CPU to another, so only identical programs compare exactly).
  """
  m = simulator.simulate(bf16_setup, AsyncSchedule(), SEEDS, num_slots=SLOTS).metrics
  lagged = simulator.simulate(bf16_setup, AsyncSchedule(lag=2), SEEDS, num_slots=SLOTS).metrics
  assert np.mean(m["grad_norm"] > 0) > 0.5  # the runs move: the comparison is not between no-ops
  np.testing.assert_array_equal(m["sampler_version"], np.broadcast_to(np.arange(STEPS),
                                                                      (len(SEEDS), STEPS)))
  assert np.all(m["drift/staleness/version_distance"] == 0.0)  # bit-identical weights
  for p in DRIFT_PARTS:
    assert np.all(m[f"drift/{p}/mismatch_kl"] == 0.0)
    assert np.all(m[f"drift/{p}/abs_dlogp_max"] == 0.0)
    assert np.all(m[f"drift/{p}/ess"] == 1.0)
  # The metric sees staleness when there is some (first steps: version 0 = the start, no lag yet).
  lag_BT = lagged["sampler_version_lag"]
  assert np.all(lagged["drift/staleness/version_distance"][lag_BT > 0] > 0)
  assert np.all(lagged["drift/staleness/version_distance"][lag_BT == 0] == 0)
  # The loop's run-health metrics (its step's, lowrl.rl.health) come out per step: nothing off in
  # sync, the stale sampler's logprobs seen at the lagged steps.
  assert np.all(m["health/is_chi2"] == 0.0) and np.all(m["health/dlogp_gt_ln2_frac"] == 0.0)
  assert np.any(lagged["health/is_chi2"][lag_BT > 0] != 0.0)
  assert np.all((m["health/zero_spread_group_frac"] >= 0) & (m["health/zero_spread_group_frac"] <= 1))


def test_fourth_drift_score_is_the_samplers_where_its_scales_are_static():
  """The sampler's precision scores like the trainer's only for identical recipes without static
  activation scales: naive NVFP4 on both sides (per-tensor scales, static on the sampler side)
  still differs by its scales, and that difference is quantization drift, not staleness."""
  def same(s, t):
    return simulator.sampler_scores_are_trainers(simulator.build(tiny_config(s, t)))
  assert same("bf16", "bf16") and same("nvfp4_recipe", "nvfp4_recipe")
  assert not same("nvfp4_naive", "nvfp4_naive")
  assert not same("nvfp4_recipe", "bf16") and not same("nvfp4_naive", "bf16")


def test_drift_parts_add_up_with_a_quantized_stale_sampler():
  setup = simulator.build(tiny_config(sampler_recipe="nvfp4_naive"))
  m = simulator.simulate(setup, AsyncSchedule(lag=2), SEEDS).metrics
  q, s, t = (m[f"drift/{p}/mismatch_kl"] for p in DRIFT_PARTS)
  np.testing.assert_allclose(q + s, t, atol=1e-5)
  np.testing.assert_allclose(t, m["mismatch/mismatch_kl"], atol=1e-5)
  assert np.all(m["drift/quantization/abs_dlogp_max"] > 1e-3)
  assert np.all(m["drift/staleness/abs_dlogp_max"][:, 1:] > 0)
  assert np.all(m["drift/staleness/abs_dlogp_max"][:, 0] == 0.0)
  assert np.all(m["drift/total/ess"] < 1.0)
  # The NVFP4 sampler samples with static calibrated scales and records that distribution: the
  # mean weight pi_now / pi_sampler is 1 within 5 standard errors (see test_act_scales.py).
  s = sweep.summarize(m)
  assert 0 < s["total_is_weight_se"] and \
      abs(s["total_is_weight_mean"] - 1) < 5 * s["total_is_weight_se"], s


# ----------------------------------------------------------------------------------------------
# The sweep.


def sweep_config():
  c = ml_collections.ConfigDict()
  c.sim = tiny_config()
  c.sim.eval_every = STEPS // 2  # the trainer policy's eval curve (time to target, pareto.png)
  c.seeds = SEEDS
  c.log_every = 1
  # Lag 3: the ring the sweep sizes for its largest lag is SLOTS, the bf16 runs' program.
  c.grid = ml_collections.ConfigDict({"lag": (0, 3, "auto"), "sync_every": (1,),
                                      "sampler_recipe": ("bf16",), "correction": ("none",)})
  return c


_TIMING = ("compile_s", "run_s", "updates_per_min")


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in _TIMING} for r in rows]


class _Crash(Exception):
  pass


def test_sweep_writes_runs_summary_and_resumes(tmp_path):
  cfg = sweep_config()
  full = sweep.run_sweep(cfg, str(tmp_path / "full"), log=lambda _: None)
  assert [r["lag"] for r in full] == [0, 3, "auto"]
  # 'auto' runs at the cost model's lag of the modelled system; the clock is the model's.
  auto = sweep.expand_grid(cfg)[2].cfg
  assert full[2]["lag_used"] == timing.clock(auto).lag == 2
  assert full[0]["step_s"] == timing.clock(auto).synchronous_step_s  # lag 0: no overlap
  assert full[1]["gpu_hours"] == pytest.approx(
      STEPS * timing.clock(auto).devices * timing.clock(auto).step_s / 3600)
  assert all(r["finite"] for r in full)
  for r in full:  # start, the mid-run eval, the last step's (after the last update)
    assert r["eval_curve_steps"] == [0, STEPS // 2, STEPS]
    assert [c[0] for c in r["eval_curve"]] == r["per_seed"]["eval_start"]
    assert all(0 <= v <= 1 for c in r["eval_curve"] for v in c)
  # Temperature 1: the sampler's recorded logprobs are those it sampled from, so the mean weight
  # pi_now / pi_sampler is 1 up to sampling noise (see test_act_scales.py for the 5-SE argument).
  for r in full:
    assert abs(r["total_is_weight_mean"] - 1) <= 5 * r["total_is_weight_se"], r  # lag 0: w = 1

  def crash_after_first(msg: str) -> None:
    if msg.startswith("[sweep] 1/"):
      raise _Crash

  workdir = str(tmp_path / "resumed")
  with pytest.raises(_Crash):
    sweep.run_sweep(cfg, workdir, log=crash_after_first)
  with open(os.path.join(workdir, "results.jsonl"), "a") as f:
    f.write('{"name": "lag=3_sy')  # a line cut short by the interruption
  logs = []
  resumed = sweep.run_sweep(cfg, workdir, log=logs.append)
  assert "1 already done, 2 to run" in logs[0]
  assert _strip(resumed) == _strip(full)
  with open(os.path.join(workdir, "results.jsonl")) as f:
    assert [json.loads(line)["lag"] for line in f] == [0, 3, "auto"]

  for r in resumed:
    for seed in SEEDS:
      run = os.path.join(workdir, "runs", r["name"], f"seed_{seed}")
      assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))
  with open(os.path.join(workdir, "summary.md")) as f:
    table = f.read()
  # Settings and drift-part tables: header + one row per setting; time to reward: the same.
  first, answer = table.split("## Reward against drift")
  assert first.count("\n| ") == 3 * (1 + 3)
  assert "## Drift parts" in first and "## Time to reward" in first
  assert "### Correction capacity" in answer
  for png in ("summary.png", "wall_clock.png", "reward_vs_drift.png", "pareto.png"):
    assert os.path.getsize(os.path.join(workdir, png)) > 10_000

  # --report_only: the rows of the lines already there, nothing run.
  assert sweep.write_report(cfg, workdir, log=lambda _: None) == resumed

  cfg.sim.optimizer.lr = 1e-2  # another config in the same workdir must not mix in silently
  with pytest.raises(ValueError, match="from another config"):
    sweep.run_sweep(cfg, workdir, log=lambda _: None)
  with pytest.raises(ValueError, match="from another config.*pass the config the sweep ran"):
    sweep.write_report(cfg, workdir, log=lambda _: None)


def test_summary_numbers_come_from_the_metrics():
  steps = 20
  rng = np.random.default_rng(0)
  metrics = {k: rng.random((2, steps)) for k in (
      "reward/mean", "reward/exact", "sampler_version_lag", "correction/is_truncated_frac",
      "skipped_updates", *[f"drift/{p}/{m}" for p in DRIFT_PARTS
                           for m in ("mismatch_kl", "mismatch_kl_k3", "abs_dlogp_max", "ess",
                                     "is_weight_mean", "is_weight_std")])}
  metrics.update({f"eval/{w}/{k}": rng.random(2) for w in ("start", "end")
                  for k in ("reward", "exact")})
  metrics["drift/tokens"] = rng.integers(1, 50, (2, steps)).astype(np.float32)
  s = sweep.summarize(metrics)
  # The mean weight over every token of the run: per-step means weighted by their token counts;
  # its standard error from the per-token variances (sum of n * std^2 over steps).
  n, w, sd = (metrics[k] for k in ("drift/tokens", "drift/total/is_weight_mean",
                                   "drift/total/is_weight_std"))
  assert s["total_is_weight_mean"] == pytest.approx((w * n).sum() / n.sum())
  assert s["total_is_weight_se"] == pytest.approx(np.sqrt((n * sd ** 2).sum()) / n.sum())
  assert s["reward_final"] == pytest.approx(metrics["reward/mean"][:, -2:].mean())
  assert s["reward_final_std"] == pytest.approx(np.std(metrics["reward/mean"][:, -2:].mean(1)))
  assert s["staleness_k1"] == pytest.approx(metrics["drift/staleness/mismatch_kl"].mean())
  assert s["eval_end"] == pytest.approx(metrics["eval/end/reward"].mean())
  assert s["finite"]


def test_default_sweep_configs_hold_the_question_grid():
  from configs import simulate as simulate_config
  for variant, n_settings, n_programs, n_seeds in (("quick", 13, 5, 8), ("full", 42, 15, 10)):
    settings = sweep.expand_grid(simulate_config.get_config(variant))
    assert len(settings) == n_settings and len(settings[0].seeds) == n_seeds
    programs = {tuple((k, str(v)) for k, v in s.knobs.items() if k not in ("lag", "sync_every"))
                for s in settings}
    assert len(programs) == n_programs
    assert len({s.name for s in settings}) == len({s.fingerprint for s in settings}) == n_settings
    # No zero-drift copy: BF16 at lag 0 runs once, uncorrected (the shared anchor).
    assert [s.knobs["correction"] for s in settings
            if s.cfg.sampler_recipe == "bf16" and s.knobs["lag"] == 0] == ["none"]
    # Every correction on the same drifted settings (BF16 trainer).
    drifted = {}
    for s in settings:
      if s.cfg.trainer_recipe == "bf16" and not (s.cfg.sampler_recipe == "bf16"
                                                 and s.knobs["lag"] == 0):
        drifted.setdefault(s.knobs["correction"], set()).add((s.cfg.sampler_recipe,
                                                              s.knobs["lag"]))
    assert len(drifted) == (2 if variant == "quick" else 4)
    assert len({frozenset(v) for v in drifted.values()}) == 1
    # Trained in the format: sampler = trainer, their own grid.
    fmt = [s for s in settings if s.cfg.trainer_recipe != "bf16"]
    assert fmt and all(s.cfg.trainer_recipe == s.cfg.sampler_recipe and s.grids == ("format_grid",)
                       for s in fmt)
    assert all(s.cfg.eval_every > 0 for s in settings)


def test_pipeline_tokens_come_from_their_versions():
  """async_rl.schedule=pipeline: one sequence's tokens are sampled by several versions; with
  identical recipes the sampler's record is the trainer's per-token-version score, so the
  quantization part is 0 up to the rounding of two programs, while staleness is not."""
  c = tiny_config()
  c.async_rl.update(schedule="pipeline", lag=2)
  setup = simulator.build(c)
  schedule = simulator.schedule_of(c)
  m = simulator.simulate(setup, schedule, SEEDS).metrics
  # Scores of one function by two XLA programs (the scan's forward vs the scorer): FP32 sums of a
  # few dozen terms, a few ulps of |logp| < 10 apart.
  assert np.all(np.abs(m["drift/quantization/abs_dlogp_max"]) < 1e-4)
  lagged = np.arange(STEPS) >= 2  # from step 2 the late tokens are newer than the first ones
  assert np.all(m["drift/staleness/abs_dlogp_max"][:, lagged] > 1e-4)
  np.testing.assert_array_equal(m["sampler_version"][0],
                                [schedule.sampler_version(t) for t in range(STEPS)])
  with pytest.raises(ValueError, match="PipelineSchedule"):
    simulator.simulate(setup, AsyncSchedule(lag=2), SEEDS[:1])


# ----------------------------------------------------------------------------------------------
# The loop's RL step, run by the simulator.


def _fixed_rollout(setup, key):
  """A batch of `setup`'s rollout shape (prompts, uniformly random full-length completions) with
  rewards and trainer scores (stale != now; the sampler's record = the trainer's score).

  The step's input need not be sampled: built here, no sampler program is compiled. Each piece
  jitted: run op by op, the scoring forward took several times its compile time."""
  params = jax.jit(functools.partial(simulator.initial_params, setup))(key)
  task, b = setup.task, setup.batch_size
  # 64 prompts, as test_task_targets_and_rewards draws them (one program), of which the first few.
  prompt_PP = np.asarray(_prompts(task, key, 64))[:setup.num_prompts]
  prompt_BP = np.repeat(prompt_PP, setup.group_size, axis=0)  # group-contiguous
  completion_BN = np.random.default_rng(0).integers(0, task.num_symbols, (b, task.length))
  tokens_BT = jnp.asarray(np.concatenate([prompt_BP, completion_BN], axis=1), jnp.int32)
  p_width = prompt_BP.shape[1]
  completion_BT = np.broadcast_to(np.arange(p_width + task.length) >= p_width, tokens_BT.shape)
  reward_B, _ = jax.jit(task.rewards)(prompt_BP, completion_BN)
  _, logprob_fn = simulator.make_rl_step(setup)
  tokens = rl_update.TokenBatch(tokens_BT, jnp.ones(tokens_BT.shape, jnp.float32))
  logp_now_BT = jax.jit(logprob_fn)(params, tokens, None)[0]
  # The sampler's record (0 off the completion) and the stale score, logp_now + 0.01, in numpy
  # (no eager programs).
  record_BT = np.where(completion_BT, np.asarray(logp_now_BT), 0.0).astype(np.float32)
  out = SampleOutput(
      tokens=tokens_BT, prompt_mask=jnp.asarray(~completion_BT, jnp.float32),
      completion_mask=jnp.asarray(completion_BT, jnp.float32), logprobs=jnp.asarray(record_BT),
      model_logprobs=jnp.asarray(record_BT),
      prompt_lengths=jnp.asarray(np.full((b,), p_width, np.int32)),
      completion_lengths=jnp.asarray(np.full((b,), task.length, np.int32)), prompt_width=p_width)
  logp_stale_BT = jnp.asarray(np.asarray(logp_now_BT) + np.float32(0.01))
  return params, step_lib.Rollout(out, reward_B, logp_now_BT, logp_stale_BT)


def test_simulator_runs_the_loops_step():
  """One fixed rollout through the loop's step and the simulator's: one program, so bit-identical
  results.

  The loop's Trainer builds its step from the same config pieces; here both step functions,
  built by each side's own code from one config, lower under the same jit to one program.
  """
  c = tiny_config()
  c.rl.update(steps=2, num_prompts=2, group_size=4)
  setup = simulator.build(c)
  params, rollout = _fixed_rollout(setup, jax.random.key(3))
  sim_step, logprob_fn = simulator.make_rl_step(setup)
  loop_step = step_lib.make_step(
      rl_update.make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling),
      setup.make_optimizer(), setup.update_cfg,
      step_lib.BatchConfig(group_size=4, advantage="grpo", max_new_tokens=setup.task.length))
  opt_state = jax.jit(functools.partial(optimizer.init_opt_state, setup.make_optimizer()))(params)
  args = (params, opt_state, None, rollout, jax.random.key(4))
  lowered = [jax.jit(f).lower(*args) for f in (sim_step, loop_step)]
  # Identical programs (stronger than bit-identical results, which they imply): one StableHLO
  # text, so one of them is compiled and run (the second compile only reloaded the first).
  assert lowered[0].as_text(debug_info=False) == lowered[1].as_text(debug_info=False)
  m = lowered[0].compile()(*args)[2]
  assert float(m["grad_norm"]) > 0  # a real update, not a no-op
  # make_batch's metrics from the rollout, recomputed here from their definitions.
  r = np.asarray(rollout.rewards_B)
  assert float(m["reward/mean"]) == pytest.approx(r.mean(), rel=1e-6)
  assert float(m["reward/pass_rate"]) == np.mean(r >= 1)
  assert float(m["response_length"]) == setup.task.length  # no stop token: every row is full
  assert float(m["groups_kept"]) == 1.0
  # logp_stale = logp_now + 0.01 on every completion token: the staleness k1 part,
  # mean(logp_stale - logp_now), is 0.01 (up to FP32 rounding of the sums).
  assert float(m["drift/staleness/mismatch_kl"]) == pytest.approx(0.01, rel=1e-4)


def test_make_batch_dynamic_sampling_and_overlong_penalty():
  # Two groups of 2: the first has equal rewards (no signal), the second differs.
  cfg = step_lib.BatchConfig(group_size=2, advantage="drgrpo", dynamic_sampling=True,
                             overlong_buffer=2, max_new_tokens=4)
  b, t = 4, 6
  lengths = np.array([4, 1, 3, 2])
  mask = (np.arange(t)[None] >= 2) & (np.arange(t)[None] < 2 + lengths[:, None])
  out = SampleOutput(
      tokens=jnp.zeros((b, t), jnp.int32), prompt_mask=jnp.zeros((b, t)).at[:, :2].set(1),
      completion_mask=jnp.asarray(mask, jnp.float32), logprobs=jnp.zeros((b, t)),
      model_logprobs=jnp.zeros((b, t)), prompt_lengths=jnp.full((b,), 2, jnp.int32),
      completion_lengths=jnp.asarray(lengths, jnp.int32), prompt_width=2)
  rewards = jnp.array([1.0, 1.0, 0.0, 1.0])
  # Jitted (it is jittable, and runs so in the step): op by op it compiled dozens of programs.
  batch, m = jax.jit(functools.partial(step_lib.make_batch, cfg=cfg))(out, rewards)
  # DAPO overlong: 0 up to 4 - 2 = 2 tokens, then (2 - L) / 2: -1 at L = 4, -0.5 at L = 3.
  # Shaped: (0, 1) and (-0.5, 1). Dr.GRPO: reward - group mean; the first group has signal
  # only through the penalty.
  expected_adv = np.array([-0.5, 0.5, -0.75, 0.75])
  np.testing.assert_allclose(np.asarray(batch.adv_B), expected_adv, rtol=0, atol=1e-7)
  # Dynamic sampling decides on the task rewards: group 0 (1, 1) leaves the loss.
  np.testing.assert_array_equal(np.asarray(batch.loss_mask_BT),
                                mask * np.array([0, 0, 1, 1])[:, None])
  assert float(m["groups_kept"]) == 0.5 and float(m["reward/mean"]) == 0.75
  assert float(m["reward/pass_rate"]) == 0.75 and float(m["response_length"]) == 2.5
  with pytest.raises(ValueError, match="rl.overlong_buffer"):
    step_lib.BatchConfig(group_size=2, overlong_buffer=5, max_new_tokens=4)


def test_simulator_supports_kl_dynamic_sampling_and_top_k():
  c = tiny_config()
  c.rl.update(steps=3, kl_coef=0.1)
  c.rl.dynamic_sampling = True
  c.rl.top_k = 3
  setup = simulator.build(c)
  assert setup.sampling.top_k == 3 and setup.batch_cfg.dynamic_sampling
  # At lag 2 a stale sampler draws tokens outside the current trainer's top-3: pi_old = 0 there,
  # so they leave the loss and the drift parts (counted in outside_support_frac), and no metric
  # reads the -1e30 stand-in for log 0.
  m = simulator.simulate(setup, AsyncSchedule(lag=2), SEEDS, num_slots=SLOTS).metrics
  assert np.all(np.isfinite(m["kl_ref"])) and m["kl_ref"][0, 0] == pytest.approx(0.0, abs=1e-6)
  assert m["kl_ref"][0, -1] > 0  # the policy moved away from its start
  assert np.mean(m["drift/outside_support_frac"]) > 0
  np.testing.assert_array_equal(m["drift/outside_support_frac"],
                                m["correction/outside_support_frac"])  # pi_old = the current
  assert np.all(m["skipped_updates"] == 0)
  for k, v in m.items():
    if k.startswith(("drift/", "mismatch/")):
      assert np.all(np.isfinite(v) & (np.abs(v) < 1e6)), k
  assert np.all((m["groups_kept"] >= 0) & (m["groups_kept"] <= 1))
  c.rl.overlong_buffer = c.task.length + 1
  with pytest.raises(ValueError, match="rl.overlong_buffer"):
    simulator.build(c)


def moe_config(sampler_recipe: str, replay: bool = False):
  """tiny_config with a 1-layer MoE MLP (4 experts, top-2): the router's input does not depend on
  any routing, so the trainer's own choice is the same with and without replay."""
  c = tiny_config(sampler_recipe)
  c.model.update(n_experts=4, n_experts_per_tok=2, moe_d_ff=16, norm_topk_prob=True)
  c.routing_replay = replay
  return c


def test_tiny_moe_option_builds():
  """The model section's MoE knobs give the simulator a mixture-of-experts policy; replay needs
  one, and the pipeline schedule records no routing."""
  c = moe_config("nvfp4_moe_experts", replay=True)
  setup = simulator.build(c)
  assert setup.model_cfg.is_moe and setup.model_cfg.n_experts == 4 and setup.routing_replay
  c.async_rl.schedule = "pipeline"
  with pytest.raises(ValueError, match="schedule=pipeline records no MoE routing"):
    simulator.build(c)
  c = tiny_config()
  c.routing_replay = True
  with pytest.raises(ValueError, match="routing_replay.*mixture-of-experts"):
    simulator.build(c)
  c = moe_config("nvfp4_moe_experts")
  c.model.moe_d_ff = 0
  with pytest.raises(ValueError, match="moe_d_ff"):
    simulator.build(c)


def test_moe_routing_flips_with_and_without_replay():
  """NVFP4 sampler (per-token activation scales: naive NVFP4 everywhere, routers included) vs a
  BF16 trainer: routing/flips > 0; at step 0 (same sampler, same trainer, 1 MoE layer) the flips
  are bit-identical with replay on and off, while replay changes pi_old (the trainer's score the
  mismatch metrics compare with the sampler's)."""
  runs = {}
  for replay in (False, True):
    c = moe_config("nvfp4_naive", replay)
    c.recipe.act_per_token = True
    c.rl.steps, c.eval_num_prompts = 1, 2
    runs[replay] = simulator.simulate(simulator.build(c), AsyncSchedule(lag=0), (0,)).metrics
  off, on = runs[False], runs[True]
  assert off["routing/flips"].shape == (1, 1)
  assert 0 < off["routing/flips"][0, 0] <= 1
  np.testing.assert_array_equal(off["routing/flips"], on["routing/flips"])
  np.testing.assert_array_equal(off["reward/mean"], on["reward/mean"])  # the same rollout
  assert off["mismatch/mismatch_kl"][0, 0] != on["mismatch/mismatch_kl"][0, 0]
