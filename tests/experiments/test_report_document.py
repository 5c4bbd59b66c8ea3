"""experiments.report's document on a synthetic grid workdir (no JAX programs): what it says it
does not test (a registered grid not given, registered claims a grid could not compute, settings
whose seeds have not all run), the registered method, the run times and the notes given to it,
and that it writes no row of a grid it was not given."""
import fnmatch
import json
import os

import numpy as np
import pytest

from experiments import ablate, paired as paired_exp
from experiments.report import common, document, grids, registry

SEEDS = (0, 1, 2)
SETTINGS = ("bf16", "nvfp4_naive", "+per_token", "+4/6", "+bf16_tail", "nvfp4_recipe")


def _line(setting, seed, wall_s):
  end = 0.40 if setting == "bf16" else 0.35
  return {"setting": setting, "group": "recipe", "seed": seed, "run_dir": f"runs/{setting}{seed}",
          "wall_s": wall_s, "eval_start": {"pass_at_1": 0.30 + 0.001 * seed, "greedy": 0.5},
          "eval_end": {"pass_at_1": end + 0.002 * seed, "greedy": 0.5}}


def _workdir(path, *, skip=(("nvfp4_naive", 2),), paired=False):
  """A grid of SETTINGS x SEEDS less `skip`; with `paired`, experiments.paired's lines."""
  work = str(path)
  os.makedirs(work, exist_ok=True)
  meta = {"command": f"python -m experiments.ablate --workdir={work}", "seeds": list(SEEDS),
          "settings": list(SETTINGS), "setting_seeds": {s: list(SEEDS) for s in SETTINGS},
          "machine": "2 CPU cores, cpu"}
  with open(os.path.join(work, ablate.GRID), "w") as f:
    json.dump(meta, f)
  with open(os.path.join(work, ablate.RESULTS), "w") as f:
    for i, (name, seed) in enumerate((n, s) for n in SETTINGS for s in SEEDS):
      if (name, seed) not in skip:
        f.write(json.dumps(_line(name, seed, 100.0 + i)) + "\n")
  if paired:
    rng = np.random.default_rng(0)
    lad = {k: list(rng.exponential(0.1, 8)) for k in common.LADDER}
    modes = {m: {k: list(rng.normal(0.8, 0.01, 4)) for k in ("cos_fp32", "cos_exact",
                                                            "heldout_delta")}
             for m in ("high_precision", "dequantized", "quantized")}
    lines = [{"measurement": "forward_ladder", "kl": lad, "prompts_per_batch": 2},
             {"measurement": "backward", "modes": modes, "heldout_base": -0.3}]
    lines += [{"measurement": "distance", "setting": n, "seed": s, "points": [
        {"fraction": f, "static": [0.1, 0.1], "trajectory": [0.01 * f, 0.02 * f]}
        for f in (0.0, 0.5, 1.0)]} for n in SETTINGS for s in SEEDS]
    with open(os.path.join(work, paired_exp.RESULTS), "w") as f:
      f.writelines(json.dumps(x) + "\n" for x in lines)
  return work


def _section(text, head):
  """The lines of markdown section `head` (up to the next heading of any level)."""
  lines = text.splitlines()
  start = lines.index(head) + 1
  end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
  return "\n".join(lines[start:end])


def test_report_says_what_it_does_not_test_and_invents_no_regime_row(tmp_path):
  work = _workdir(tmp_path / "grid")
  out = str(tmp_path / "doc" / "results.md")
  text = document.write_report(work, out, notes=["ran at load 4-9, with pauses"],
                               command="python -m experiments.report --workdir=W")
  assert "Written by `python -m experiments.report --workdir=W`." in text
  assert "- ran at load 4-9, with pauses" in text
  # A setting missing a seed is named with the seeds it has.
  assert "**Not finished**: nvfp4_naive: seeds [0, 1] of [0, 1, 2]." in text
  gaps = _section(text, "## What this report does not test")
  assert "**configs/ablate_regime.py's grid is not in this report**" in gaps
  # Every registered primary claim or design check this grid did not compute is named, and
  # none that it did; without paired.jsonl that is every claim on its measurements.
  computed = {j["claim"] for j in json.load(open(tmp_path / "doc" / "results_claims.json"))}
  for _, role, pattern in registry.registered():
    named = f"`{pattern}` ({role}," in gaps
    assert named == (not any(fnmatch.fnmatchcase(c, pattern) for c in computed)), pattern
  assert "`ladder_+4/6` (primary, forward_components)" in gaps
  assert "experiments.paired has not run on this grid" in gaps
  # No row, margin or section of the grid that was not given.
  assert "ablate_regime |" not in text and "[ablate_regime]" not in text
  assert "# The ablate_regime grid" not in text
  rows = json.load(open(tmp_path / "doc" / "results_claims.json"))
  assert {r["grid"] for r in rows} == {"ablate"}
  # The method: each question's registered primary claims, from the registry.
  method = _section(text, "## Method")
  for q in registry.QUESTIONS:
    assert q.title in method and all(f"`{p}`" in method for p in q.primary)


def test_paired_measurements_fill_the_gaps_and_both_grids_leave_none(tmp_path):
  work = _workdir(tmp_path / "grid", skip=(), paired=True)
  text = document.write_report(work, str(tmp_path / "one.md"))
  gaps = _section(text, "## What this report does not test")
  assert "Not finished" not in text and "experiments.paired has not run" not in gaps
  assert "`ladder_+4/6`" not in gaps and "`recipe_equiv_trajectory`" not in gaps
  # The toy plants no outlier channels: that design check stays untested, and says so.
  assert "`outliers_raise_naive_kl` (design check, forward_components)" in gaps
  # Both registered grids given: none is missing.
  other = _workdir(tmp_path / "regime", skip=(), paired=True)
  meta_path = os.path.join(other, ablate.GRID)
  meta = json.load(open(meta_path))
  meta["command"] += " --config=configs/ablate_regime.py"
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  both = document.write_report([work, other], str(tmp_path / "two.md"))
  assert "grid is not in this report" not in both
  assert "**[ablate_regime]** registered but not computed" in both


def test_run_times_set_each_settings_first_run_apart():
  rows = [{"setting": s, "seed": k, "wall_s": w}
          for s, k, w in (("a", 0, 200.0), ("a", 1, 50.0), ("b", 0, 300.0), ("a", 2, 70.0),
                          ("b", 1, 60.0), ("b", 2, 2000.0))]
  line = grids.run_times(rows)
  # First runs 200, 300: quartiles by linear interpolation (numpy's default) 225 / 250 / 275.
  assert "first run (its programs compile) median 250 s (middle half 225-275 s, n 2)" in line
  # The others 50, 60, 70, 2000: 57.5 / 65 / 552.5 (positions 0.75, 1.5, 2.25), rounded half to
  # even.
  assert "the other runs median 65 s (middle half 58-552 s, n 4)" in line
  assert line.endswith("the longest 2000 s (b seed 2).")


def test_every_grid_with_margins_is_registered():
  assert set(registry.MARGINS) == set(registry.GRIDS)
  assert registry.margin("ablate_regime", "recipe_equiv_gain").delta == pytest.approx(0.010)


def _as_regime(work):
  """Records `work`'s grid as configs/ablate_regime.py's."""
  meta_path = os.path.join(work, ablate.GRID)
  meta = json.load(open(meta_path))
  meta["command"] += " --config=configs/ablate_regime.py"
  with open(meta_path, "w") as f:
    json.dump(meta, f)


def _bf16_loses(work, drop=0.03):
  """Rewrites `work`'s BF16 runs to end below their start (per seed, by `drop` and a little)."""
  path = os.path.join(work, ablate.RESULTS)
  lines = [json.loads(x) for x in open(path)]
  for r in lines:
    if r["setting"] == "bf16":
      r["eval_end"]["pass_at_1"] = r["eval_start"]["pass_at_1"] - drop - 0.004 * r["seed"]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)


def test_a_failed_design_check_leaves_its_questions_claims_unread(tmp_path):
  # A regime grid stopped after BF16's seeds, all of which lose pass@1: its design check is
  # computed from them, and the recipe's claims are listed as not read, with both reasons.
  regime = _workdir(tmp_path / "regime", skip=tuple((n, s) for n in SETTINGS[1:]
                                                    for s in SEEDS))
  _as_regime(regime)
  _bf16_loses(regime)
  text = document.write_report([_workdir(tmp_path / "toy", skip=(), paired=True), regime],
                               str(tmp_path / "doc" / "results.md"))
  rows = {(r["grid"], r["claim"]): r
          for r in json.load(open(tmp_path / "doc" / "results_claims.json"))}
  check = rows[("ablate_regime", "rl_gain")]
  # Gains -0.030, -0.034, -0.038 (end - start per seed): mean -0.034, sd 0.004, t over n 3.
  assert check["n"] == 3 and check["effect"] == pytest.approx(-0.034)
  assert check["verdict"] == "contradicted"
  gaps = _section(text, "## What this report does not test")
  line = next(x for x in gaps.splitlines() if x.startswith("- **[ablate_regime] design check "
                                                          "failed**"))
  assert "`rl_gain` **contradicted**, -0.0340 [" in line and "n 3" in line
  assert registry.QUESTIONS[0].title in line
  assert all(f"`{p}`" in line for p in registry.QUESTIONS[0].primary)
  assert "not computed either" in line
  assert "nvfp4_naive, +per_token, +4/6, +bf16_tail, nvfp4_recipe ran no seed" in line
  assert "experiments.paired has not run on this grid" in line
  # Listed once: the generic line holds only the other questions' claims.
  rest = next(x for x in gaps.splitlines()
              if x.startswith("- **[ablate_regime]** registered but not computed"))
  assert "`recipe_equiv_gain`" not in rest and "`ladder_+4/6`" in rest
  # The toy grid's BF16 learns: its recipe claims are judged as before, none marked not read.
  assert "[ablate] design check failed" not in gaps
  assert rows[("ablate", "recipe_equiv_gain")]["verdict"] != registry.NOT_READ


def test_claims_a_grid_computed_under_a_failed_design_check_are_marked_not_read(tmp_path):
  work = _workdir(tmp_path / "grid", skip=(), paired=True)
  _bf16_loses(work)
  text = document.write_report(work, str(tmp_path / "results.md"))
  rows = {r["claim"]: r for r in json.load(open(tmp_path / "results_claims.json"))}
  for p in registry.QUESTIONS[0].primary:
    assert rows[p]["verdict"] == registry.NOT_READ and np.isnan(rows[p]["p_holm"]), p
  line = next(x for x in _section(text, "## What this report does not test").splitlines()
              if "design check failed" in x)
  assert "not computed either" not in line
  assert all(f"`{p}`" in line for p in registry.QUESTIONS[0].primary)
  assert f"**{registry.NOT_READ}**" in text
