"""experiments.paired on the tiny model: the forward ladder and the backward modes measured on
identical BF16-sampled batches, written to paired.jsonl, resumed without rework, read by the
report's claims."""
import os

import ml_collections
import numpy as np
import pytest
import tiny

from configs import ablate as ablate_config
from experiments import ablate, paired
from experiments.report import backward, components, recipe_vs_bf16
from experiments.report import claims as report_claims
from lowrl.training import run_logs
from lowrl.analysis import stats


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  work = str(tmp_path_factory.mktemp("paired"))
  cfg = ablate_config.get_config()
  cfg.seeds = (0,)
  # 150 SFT steps: a base that solves some prompts, so advantages and gradients are not all 0.
  cfg.run = tiny.loop_config("bf16", os.path.join(work, "unused"), steps=2, sft_steps=150)
  cfg.run.sft.seed = 0
  cfg.run.diagnostics.every = 0
  # The quantized backward's NVFP4 blocks of 16 run along batch x time, split over the 8 test
  # devices: 16 rows of 5 + 3 tokens give 2 x 8 per shard.
  cfg.run.rl.update(num_prompts=4, max_new_tokens=3)
  # Held-out prompts as many as a rollout's rows: the distance's KL of naive NVFP4 vs BF16 runs
  # on the [16, 5 + 3] shape the ladder's rung compiled.
  cfg.run.eval_num_prompts = 16
  # Two planted outlier channels (8 and 24: one per block of 16): the ladder runs with and without.
  cfg.run.sft.update(outlier_channels=2, outlier_gain=16.0)
  cfg.paired.update(batches=3, grad_batches=2, heldout=1)
  logs = []
  lines = paired.run(cfg, work, log=logs.append)
  return cfg, work, lines, logs


def test_ladder_scores_every_rung_on_the_same_prompts(measured):
  cfg, _, lines, _ = measured
  lad = {r["measurement"]: r for r in lines}["forward_ladder"]["kl"]
  assert list(lad) == list(paired.LADDER)
  n_prompts = 3 * cfg.run.rl.num_prompts  # batches x prompts, group_size completions each
  for name, v in lad.items():
    v = np.asarray(v)
    assert v.shape == (n_prompts,) and np.all(np.isfinite(v)) and np.all(v >= -1e-6), name
  assert np.mean(lad["nvfp4_naive"]) > 0  # NVFP4 moves the distribution off BF16's
  # The same rungs on the base without its planted channels, the same prompts.
  off = {r["measurement"]: r for r in lines}["forward_ladder"]["kl_unplanted"]
  assert list(off) == list(paired.LADDER)
  assert all(np.asarray(v).shape == (n_prompts,) and np.all(np.isfinite(v)) for v in off.values())
  assert off != lad  # the quantized forwards see the outliers


def test_backward_modes_against_fp32_and_the_exact_quantized_gradient(measured):
  _, _, lines, _ = measured
  bwd = {r["measurement"]: r for r in lines}["backward"]
  modes = bwd["modes"]
  assert set(modes) == {*paired.BACKWARD, "fp32"}
  for m in paired.BACKWARD:
    assert len(modes[m]["cos_fp32"]) == 2 and all(-1 <= c <= 1 + 1e-6 for c in modes[m]["cos_fp32"])
    assert all(np.isfinite(modes[m]["heldout_delta"]))
    assert len(modes[m]["code_churn"]) == 2 and all(0 <= c <= 1 for c in modes[m]["code_churn"])
  # The dequantized step's code churn under every quantized forward of the grid.
  by_fwd = bwd["churn_by_forward"]
  assert set(by_fwd) == {*paired.LADDER, "nvfp4_recipe"}
  for f, c in by_fwd.items():
    assert len(c["codes"]) == 2 and all(0 <= x <= 1 for x in c["codes"] + c["scales"]), f
  # Per-token scales are the activations' alone: the weights' codes are naive NVFP4's, bit for bit.
  assert by_fwd["+per_token"] == by_fwd["nvfp4_naive"]
  assert max(by_fwd["nvfp4_naive"]["codes"]) > 0  # one step moves some codes
  # The dequantized backward is the reference of the "exact" comparison: itself, cosine 1.
  np.testing.assert_allclose(modes["dequantized"]["cos_exact"], 1.0, atol=1e-5)
  np.testing.assert_allclose(modes["dequantized"]["rel_err_exact"], 0.0, atol=1e-6)
  # Rewards differ within groups (else every gradient is 0 and nothing here is tested) ...
  assert any(d != 0 for d in modes["fp32"]["heldout_delta"])
  # ... and a different backward gives a different gradient of the same forward (2 layers: the
  # recipe keeps its last one in BF16, the first is NVFP4).
  assert max(modes["quantized"]["rel_err_exact"]) > 0
  claims = report_claims.paired_claims({r["measurement"]: r for r in lines})
  assert {c.name for c in claims} >= {"ladder_+per_token",
                                      "backward_cos_fp32_dequantized_vs_quantized",
                                      "outliers_raise_naive_kl",
                                      "outliers_per_token_46_remove_more"}
  got = {r["measurement"]: r for r in lines}
  md = "\n".join(components.ladder_section(got["forward_ladder"]) + backward.sections(got))
  assert "outliers not planted" in md and "### What one update changes" in md
  assert all(v.verdict in ("held", "contradicted", "not resolved") for v in stats.judge(claims))


def test_rerun_resumes_without_measuring_again(measured):
  cfg, work, lines, _ = measured
  logs = []
  assert paired.run(cfg, work, log=logs.append) == lines
  assert any("already done, 0 to run" in x for x in logs)
  assert not any("[paired] ladder" in x for x in logs)


def test_bad_sizes_are_rejected_before_any_work(tmp_path):
  cfg = ablate_config.get_config()
  cfg.paired.grad_batches = cfg.paired.batches + 1
  with pytest.raises(ValueError, match="grad_batches <= batches"):
    paired.run(cfg, str(tmp_path))


def test_mid_run_point_is_the_first_seeds_recipe_run_at_its_kept_step_nearest_half():
  """Which grid run and step the backward design mid-run measures, among other runs and seeds
  (the `distanced` grid below has one quantized run; this choice is checked here, compile-free)."""
  cfg = ablate_config.get_config()
  cfg.seeds = (3, 0)
  cfg.run.rl.steps = 8
  settings = paired.all_settings(cfg)
  lines = [{"setting": s, "seed": seed, "run": i} for i, (s, seed) in enumerate(
      [("bf16", 3), ("nvfp4_naive", 3), ("nvfp4_recipe", 0), ("nvfp4_recipe_qbwd", 3),
       ("nvfp4_recipe", 3), ("+4/6", 3)])]
  cfg.run.checkpoint_keep_fractions = (0.25, 0.625, 1.0)  # steps 2, 5 and the end
  line, step = paired.mid_run_point(cfg, lines, settings)
  assert line["run"] == 4 and step == 5  # 5 and 2 are 1 and 2 from 4: the nearer
  cfg.run.checkpoint_keep_fractions = (0.375, 0.625)  # steps 3 and 5, as near: the earlier
  assert paired.mid_run_point(cfg, lines, settings)[1] == 3
  cfg.run.checkpoint_keep_fractions = (1.0,)  # only the end: nothing mid-run
  assert paired.mid_run_point(cfg, lines, settings) is None
  cfg.run.checkpoint_keep_fractions = (0.5,)
  assert paired.mid_run_point(cfg, lines[:4], settings) is None  # the first seed's run not done


@pytest.fixture(scope="module")
def distanced(measured):
  """A 2-setting grid (the BF16 twin and the recipe, 1 seed, the fixture's 2 steps, the
  checkpoint at 50% kept, code churn logged: cosmetic knobs, so the twin's fingerprint and the
  paired lines stay) on the measured base, then experiments.paired's distance lines (and its
  backward design mid-run, on the recipe's kept checkpoint). The recipe is the one quantized
  run: another (naive NVFP4 was one) compiles its own sampler, scorer and update, ~a third of
  this set up, for assertions the recipe's run makes as well; which run the mid-run design
  picks among several is the test above."""
  cfg, work, _, _ = measured
  cfg.groups, cfg.only = ("recipe",), ("nvfp4_recipe",)
  cfg.run.checkpoint_every = 2
  cfg.run.checkpoint_keep_fractions = (0.5,)
  cfg.run.diagnostics.code_churn = True
  # No after-run measurements (twin KL, pass@k: tests/experiments/test_ablate.py checks them):
  # nothing here reads them, and their sampling and scoring programs were a third of this set up.
  cfg.after_run = ()
  results = ablate.run_grid(cfg, work, log=lambda _: None)
  lines = paired.run(cfg, work, log=lambda _: None)
  return cfg, work, results, [r for r in lines if r["measurement"] == "distance"]


def test_backward_design_mid_run_on_the_recipes_kept_checkpoint(distanced):
  """The backward modes again on the nvfp4_recipe run's weights at its kept checkpoint nearest
  half the run (step 1 of 2), on batches sampled from those weights: not the base's numbers."""
  _, work, _, _ = distanced
  got = paired.read_results(work)
  mid, at_base = got["backward_mid"], got["backward"]
  assert mid["point"] == "mid: nvfp4_recipe seed 0 step 1" and mid["step"] == 1
  assert set(mid["modes"]) == {*paired.BACKWARD, "fp32"}
  for m in paired.BACKWARD:
    assert len(mid["modes"][m]["cos_fp32"]) == 2 and np.all(np.isfinite(mid["modes"][m]["cos_fp32"]))
  assert mid["modes"]["quantized"]["cos_fp32"] != at_base["modes"]["quantized"]["cos_fp32"]
  names = {c.name for c in report_claims.paired_claims(got)}
  assert {"backward_cos_fp32_dequantized_vs_quantized",
          "backward_cos_fp32_dequantized_vs_quantized_mid"} <= names
  md = "\n".join(backward.sections(got))
  assert "### Backward modes on identical batches, mid-run (nvfp4_recipe seed 0 step 1 of 2)" in md


def test_distance_at_every_kept_checkpoint_paired_with_the_twin_at_the_same_step(distanced):
  _, work, results, lines = distanced
  assert sorted((r["setting"], r["seed"]) for r in lines) == [("bf16", 0), ("nvfp4_recipe", 0)]
  # The loop kept step 1 (50% of 2) beside the end.
  for r in results:
    kept = os.listdir(os.path.join(work, r["run_dir"], "checkpoints"))
    assert {1, 2} <= {int(d) for d in kept if d.isdigit()}
  by = {r["setting"]: r for r in lines}
  for r in lines:
    assert [(q["step"], q["fraction"]) for q in r["points"]] == [(0, 0.0), (1, 0.5), (2, 1.0)]
  # The twin against itself: trajectory 0 at every step; static 0 (BF16 vs BF16).
  for q in by["bf16"]["points"]:
    assert max(q["trajectory"]) == 0.0 and max(q["static"]) == 0.0
  quantized = by["nvfp4_recipe"]["points"]
  # NVFP4's forward differs from BF16's (the recipe's first layer is NVFP4; its last is BF16).
  assert min(np.mean(q["static"]) for q in quantized) > 0
  assert np.mean(quantized[2]["trajectory"]) > 0  # training took the weights apart
  pts = recipe_vs_bf16.distance_points(by["nvfp4_recipe"])
  assert list(pts) == [0.0, 0.5, 1.0] and pts[0.0]["trajectory"] == 0.0
  md = "\n".join(recipe_vs_bf16.distance_table(lines))
  assert "| setting | seeds | static 0% | static 50% | static 100% | trajectory 50% | " \
         "trajectory 100% |" in md


def test_distance_only_for_the_runs_of_distance_groups(distanced):
  """paired.distance_groups chooses whose runs get distance lines: a group that ran nothing adds
  no job, and the groups that ran keep theirs (already done)."""
  cfg, work, _, lines = distanced
  c = ml_collections.ConfigDict(cfg.to_dict())
  c.paired.distance_groups = ("sr",)
  logs = []
  paired.run(c, work, log=logs.append)
  assert any("3 jobs, 3 already done, 0 to run" in x for x in logs), logs  # + backward mid-run
  c.paired.distance_groups = ("recipe",)
  logs = []
  paired.run(c, work, log=logs.append)
  n = 3 + len(lines)
  assert any(f"{n} jobs, {n} already done, 0 to run" in x for x in logs), logs


def test_code_churn_is_logged_by_the_quantized_run_only(distanced):
  _, work, results, _ = distanced
  for r in results:
    rows = run_logs.read_metrics(os.path.join(work, r["run_dir"]))
    churn = [x.get("code_churn/codes") for x in rows]
    if r["setting"] == "bf16":  # no weight quantized: nothing logged
      assert churn == [None] * 2
    else:
      assert all(0 <= c <= 1 for c in churn) and all(0 <= x["code_churn/scales"] <= 1
                                                     for x in rows)
