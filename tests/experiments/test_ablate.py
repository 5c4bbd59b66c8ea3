"""experiments.ablate + experiments.report: a 2-setting, 2-seed, 2-step grid of the real loop
runs, records the probes and the twin KL, resumes without rerunning finished runs, and the
report writes its markdown and PNGs."""
import json
import os
import shutil

import ml_collections
import pytest
import tiny

from configs import ablate as ablate_config
from experiments import ablate
from experiments.report import document as report
from lowrl.training import run_config, run_logs


def _grid_cfg(base_dir: str) -> ml_collections.ConfigDict:
  c = ablate_config.get_config()
  c.seeds = (0, 1)
  c.groups = ("sr",)
  c.lrs = (1e-3,)
  c.only = ("bf16_rtn@1e-3",)  # + the twin, bf16: 2 settings
  # bf16_rtn runs the first seed only (a row's first_seeds): 3 runs, and the report says so.
  c.grid = tuple({**r, "first_seeds": 1} if r["name"] == "bf16_rtn" else r for r in c.grid)
  run = tiny.loop_config("bf16", base_dir, steps=2)
  run.model.n_layers = 1  # nothing here depends on the depth: the smaller programs
  run.sft.seed = 0
  run.diagnostics.every = 1
  run.checkpoint_every = 2
  c.run = run
  return c


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
  work = str(tmp_path_factory.mktemp("ablate"))
  cfg = _grid_cfg(os.path.join(work, "unused_base"))
  logs = []
  results = ablate.run_grid(cfg, work, log=logs.append)
  return cfg, work, results, logs


def test_grid_runs_every_setting_and_seed(grid):
  _, work, results, _ = grid
  assert [(r["setting"], r["seed"]) for r in results] == [
      ("bf16", 0), ("bf16", 1), ("bf16_rtn@1e-3", 0)]
  # One base for every run and seed (run.sft.seed), in <workdir>/base.
  assert len(os.listdir(os.path.join(work, "base"))) == 1
  for r in results:
    lines = run_logs.read_metrics(os.path.join(work, r["run_dir"]))
    assert len(lines) == 2 and all("grad_bias/cos/total" in x and "update_erasure" in x
                                   for x in lines)
    if r["setting"] == "bf16":
      # The twin against itself; FP32 master weights erase nothing by definition.
      assert r["twin_kl_end"] == 0.0 and r["update_erasure"] == 0.0
    for k in ("twin_kl_start", "twin_kl_end", "grad_cos", "final_reward"):
      assert r[k] is not None
    # The sr group's outcome KL(final policy || base) on held-out prompts (k3 >= 0 per token).
    assert ("ref_kl_k3_end" in r) == (r["group"] == "sr")
    if r["group"] == "sr":
      assert r["ref_kl_k3_end"] >= 0 and r["ref_kl_end"] is not None
    # eval_samples = 1: pass@1 only, from the same kind of samples as eval's pass_at_1.
    assert set(r["pass_at_k_end"]) == {"1"} and 0 <= r["pass_at_k_end"]["1"] <= 1


def test_grid_resumes_skipping_finished_runs(grid):
  cfg, work, results, _ = grid
  logs = []
  again = ablate.run_grid(cfg, work, log=logs.append)
  assert again == results
  assert not [x for x in logs if " -> " in x and "runs" in x]
  assert any("3 jobs, 3 already done, 0 to run" in x for x in logs)
  # A finished line whose config changed since is an error, not a silent mix.
  changed = ml_collections.ConfigDict(cfg.to_dict())
  changed.run.optimizer.lr = 1e-4
  with pytest.raises(run_config.ConfigError, match="another config"):
    ablate.run_grid(changed, work, log=lambda _: None)


def test_report_writes_markdown_and_pngs(grid, tmp_path):
  _, work, _, _ = grid
  out = str(tmp_path / "results.md")
  text = report.write_report(work, out)
  assert "bf16_rtn@1e-3" in text and "RL at BF16 raises held-out pass@1" in text
  assert "3 runs (2 settings x seeds [0, 1]; bf16_rtn@1e-3 on seeds [0])" in text
  assert "| claim | design | n | effect [95% CI] | p | Holm p | verdict |" in text
  pngs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
  assert pngs == ["results_curves.png", "results_settings.png"]
  for p in pngs:
    with open(tmp_path / p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"]({p})" in text


def test_report_of_two_grids_judges_each_grid_in_its_own_families(grid, tmp_path):
  """Two workdirs (here the fixture's grid, and a copy recorded as configs/ablate_regime.py's):
  every claim once per grid, named by grid; each grid is its own study (its families are its
  own, so a claim's adjusted p is the one-grid report's); each grid's tables and PNGs."""
  _, work, _, _ = grid
  other = str(tmp_path / "regime")
  shutil.copytree(work, other)
  meta_path = os.path.join(other, ablate.GRID)
  with open(meta_path) as f:
    meta = json.load(f)
  meta["command"] += " --config=configs/ablate_regime.py"
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  out = str(tmp_path / "results.md")
  one = report.write_report(work, str(tmp_path / "one.md"))
  text = report.write_report([work, other], out)
  assert "# The ablate_regime grid (configs/ablate_regime.py)" in text
  claims = json.load(open(tmp_path / "results_claims.json"))
  single = json.load(open(tmp_path / "one_claims.json"))
  assert len(claims) == 2 * len(single) > 0
  assert {(c["grid"], c["claim"]) for c in claims} == {(g, c["claim"]) for c in single
                                                       for g in ("ablate", "ablate_regime")}
  p_one = {c["claim"]: c["p_holm"] for c in single}
  for c in claims:
    assert c["p_holm"] == pytest.approx(p_one[c["claim"]], nan_ok=True)
    assert c["family"] in (None, f"{c['grid']}/{c['question']}", f"{c['grid']}/design check")
  assert "Regime: " in one and " RL updates of " in one
  pngs = sorted(p for p in os.listdir(tmp_path) if p.startswith("results") and p.endswith(".png"))
  assert pngs == ["results_ablate_regime_curves.png", "results_ablate_regime_settings.png",
                  "results_curves.png", "results_settings.png"]
  with pytest.raises(ValueError, match="same grid config"):
    report.write_report([work, work], out)


def test_bad_grid_is_rejected_before_any_run(tmp_path):
  cfg = _grid_cfg(str(tmp_path / "b"))
  cfg.groups = ("nope",)
  with pytest.raises(ValueError, match="unknown groups"):
    ablate.run_grid(cfg, str(tmp_path / "w"))
  cfg = _grid_cfg(str(tmp_path / "b"))
  cfg.run.rl.num_minibatches = 3
  with pytest.raises(run_config.ConfigError, match="--config.run.rl.num_minibatches"):
    ablate.run_grid(cfg, str(tmp_path / "w"))
  cfg = _grid_cfg(str(tmp_path / "b"))
  cfg.after_run = ("twin_kl", "nope")
  with pytest.raises(run_config.ConfigError, match=r"--config.after_run=.*unknown \['nope'\]"):
    ablate.run_grid(cfg, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / ablate.RESULTS)


def test_quick_grid_runs_every_group_and_evaluates_in_rollout_sized_rows():
  """`--config.quick=True` keeps a setting of every group (the twin first), every name of it is a
  setting of the full grid, and its held-out rows are a rollout's (the programs are shared)."""
  full = ablate_config.get_config()
  quick = ablate.quick(full)
  chosen = ablate.settings(quick)
  assert chosen[0].name == full.twin
  assert {s.group for s in chosen} == {s.group for s in ablate.settings(full)}
  assert set(quick.only) <= {s.name for s in chosen}
  r = quick.run
  assert r.eval_num_prompts * r.eval_samples == r.rl.num_prompts * r.rl.group_size


def test_descriptive_rows_run_the_first_seeds_only():
  """configs/ablate.py: the rows no claim reads run the first `descriptive_seeds` of `seeds`,
  the others (the twin always) every seed, at least 8; a bad first_seeds is a one-line error."""
  cfg = ablate_config.get_config()
  cfg.groups = ("recipe", "sampler_only", "sr")
  by = {s.name: s.seeds(tuple(cfg.seeds)) for s in ablate.settings(cfg)}
  assert len(cfg.seeds) >= 8 and by[cfg.twin] == tuple(cfg.seeds)
  few = {n for n, s in by.items() if s == tuple(cfg.seeds)[:cfg.descriptive_seeds]}
  assert few == {"fp32", "mxfp8", "s=mxfp8/t=bf16", "s=nvfp4_naive/t=bf16",
                 "s=nvfp4_recipe/t=bf16",
                 *(f"{arm}@{ablate._lr_tag(lr)}" for arm in ("bf16_rtn", "bf16_sr")  # noqa: SLF001
                   for lr in cfg.lrs)}
  assert set(by) - few == {n for n, s in by.items() if s == tuple(cfg.seeds)}
  # The quick grid's 2 seeds: first_seeds 3 keeps both.
  q = ablate.quick(cfg)
  assert all(s.seeds(tuple(q.seeds)) == tuple(q.seeds) for s in ablate.settings(q))
  for bad, match in (("$nope", r"\$nope names no knob"), (-1, "first_seeds=-1"),
                     (1.5, "first_seeds=1.5")):
    c = ablate_config.get_config()
    c.grid = tuple({**r, "first_seeds": bad} if r["name"] == "mxfp8" else r for r in c.grid)
    with pytest.raises(run_config.ConfigError, match=match):
      ablate.settings(c)
  c = ablate_config.get_config()
  c.grid = tuple({**r, "first_seeds": 2} if r["name"] == c.twin else r for r in c.grid)
  with pytest.raises(run_config.ConfigError, match="the twin must run every seed"):
    ablate.settings(c)


def test_rows_are_data_knobs_and_lrs_expand():
  """configs/ablate.py's grid rows: "$knob" reads the grid's knob, "each": "lrs" repeats a row per
  learning rate (lr-major within the group), a malformed row is a one-line error."""
  cfg = ablate_config.get_config()
  cfg.kl_coef = 0.125
  cfg.lrs = (1e-3, 1e-5)
  cfg.groups = (*cfg.groups, "kl_reset")  # not run by default (configs/ablate.py says why)
  by_name = {s.name: s for s in ablate.settings(cfg)}
  assert dict(by_name["kl"].overrides) == {"rl.kl_coef": 0.125}
  sr = [s.name for s in ablate.settings(cfg) if s.group == "sr"]
  assert sr == [f"{m}@{lr}" for lr in ("1e-3", "1e-5")
                for m in ("fp32_master", "bf16_sr_cast", "bf16_rtn", "bf16_sr", "fp16")]
  assert dict(by_name["bf16_sr@1e-5"].overrides)["optimizer.lr"] == 1e-5
  assert by_name["bf16_sr@1e-5"].config(cfg.run, 0).optimizer.master_rounding == "stochastic"
  assert (by_name["bf16_sr_cast@1e-5"].config(cfg.run, 0).optimizer.compute_cast_rounding
          == "stochastic")
  # min_travel: rl.steps = max(run.rl.steps, ceil(sr_travel / lr)), so lr x steps reaches it.
  cfg.sr_travel = 1e-3
  by_name = {s.name: s for s in ablate.settings(cfg)}
  assert by_name["fp16@1e-5"].config(cfg.run, 0).rl.steps == 100
  assert "rl.steps" not in dict(by_name["fp16@1e-3"].overrides)  # 1 step < run.rl.steps
  bf16 = {"precision": "bf16"}
  for bad, match in (({"name": "x", "group": "g", "overrides": {**bf16, "rl.kl_coef": "$nope"}},
                      r"\$nope names no knob"),
                     ({"name": "x", "group": "g", "overrides": bf16, "each": "seeds"},
                      "only 'lrs'"),
                     ({"name": "x", "group": "g"}, "needs name, group and overrides"),
                     ({"name": "x", "group": "g", "overrides": {**bf16, "precision.nope": 1}},
                      "unknown precision knobs")):
    cfg.grid = (*ablate_config.GRID, bad)
    with pytest.raises(run_config.ConfigError, match=match):
      ablate.settings(cfg)
