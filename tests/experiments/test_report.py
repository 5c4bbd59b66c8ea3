"""experiments.report's per-checkpoint distance claims, code-churn and regime sections, on
synthetic lines (no JAX programs)."""
import json
import os

import numpy as np
import pytest

from experiments.report import descriptive, recipe_vs_bf16, registry
from lowrl.analysis import stats

SEEDS = range(5)


def _distance_lines(recipe_slope=0.05, naive_slope=0.10):
  """The trajectory part grows linearly along the run (0 at step 0), naive faster than the
  recipe on every seed; a seed level shared by the settings (what pairing removes)."""
  rng = np.random.default_rng(0)
  out = []
  for s in SEEDS:
    lvl = 1 + 0.5 * (s - 2) / 2
    for name, slope in (("nvfp4_naive", naive_slope), ("nvfp4_recipe", recipe_slope)):
      pts = [{"step": st, "fraction": st / 40, "static": list(0.2 + rng.normal(0, 1e-4, 8)),
              "trajectory": list(lvl * slope * st / 40 + rng.normal(0, 1e-5, 8))}
             for st in (0, 10, 20, 40)]
      pts[0]["trajectory"] = [0.0] * 8
      out.append({"setting": name, "seed": s, "steps": 40, "points": pts})
  return out


def test_trajectory_claims_use_every_checkpoint_paired_by_seed():
  v = {x.claim.name: x for x in stats.judge(recipe_vs_bf16.distance_claims(_distance_lines()))}
  assert set(v) == {"recipe_equiv_trajectory", "trajectory_recipe_vs_naive",
                    "trajectory_growth_recipe_vs_naive"}
  # The recipe's own trajectory part (its twin's is 0 by construction), TOST against the toy's
  # registered margin: lvl x 0.05 x 7/12 per seed, 0.029 on average, outside ±0.018.
  equiv = v["recipe_equiv_trajectory"]
  levels = np.array([1 + 0.5 * (s - 2) / 2 for s in SEEDS])
  assert equiv.claim.result.mean == pytest.approx(0.05 * 7 / 12 * levels.mean(), rel=1e-3)
  assert equiv.claim.margin == registry.margin("ablate", "recipe_equiv_trajectory").bounds
  assert equiv.verdict == "not shown equivalent"
  mean = v["trajectory_recipe_vs_naive"]
  assert mean.verdict == "held" and mean.claim.result.n == 5
  # Mean over 25%, 50%, 100% of lvl x slope x f: (0.05 - 0.10) x 7/12 on average over seeds.
  assert mean.claim.result.mean == pytest.approx(-0.05 * 7 / 12, rel=1e-3)
  assert "25%, 50%, 100%" in mean.claim.design
  growth = v["trajectory_growth_recipe_vs_naive"]
  assert growth.verdict == "held" and growth.claim.result.mean == pytest.approx(-0.05, rel=1e-3)
  # The recipe drifting faster instead: contradicted.
  flipped = {x.claim.name: x for x in stats.judge(recipe_vs_bf16.distance_claims(
      _distance_lines(recipe_slope=0.2)))}
  assert flipped["trajectory_growth_recipe_vs_naive"].verdict == "contradicted"


def test_distance_table_per_checkpoint_with_paired_differences():
  md = "\n".join(recipe_vs_bf16.distance_table(_distance_lines()))
  assert ("| setting | seeds | static 0% | static 25% | static 50% | static 100% | "
          "trajectory 25% | trajectory 50% | trajectory 100% |") in md
  row = next(line for line in md.splitlines() if line.startswith("| nvfp4_recipe - nvfp4_naive"))
  # At 100%: -0.05 x the seed level, mean over seeds 1: the CI is about it.
  cells = row.split(" | ")
  assert cells[-1].startswith("-0.0500 [")


def test_code_churn_and_regime_sections(tmp_path):
  work = str(tmp_path)
  runs = []
  for s in SEEDS:
    d = f"runs/r{s}"
    os.makedirs(os.path.join(work, d))
    with open(os.path.join(work, d, "metrics.jsonl"), "w") as f:
      for step in (1, 2):
        f.write(json.dumps({"step": step, "code_churn/codes": 0.01 * step,
                            "code_churn/values": 0.02, "code_churn/scales": 0.0}) + "\n")
    runs.append({"setting": "nvfp4_naive", "group": "recipe", "seed": s, "run_dir": d})
  agg = {"nvfp4_naive": {"group": "recipe", "runs": runs}}
  md = "\n".join(descriptive.churn_section(work, agg))
  assert "| nvfp4_naive | 5 | 0.0150 ± 0.0000 | 0.0200 ± 0.0000 | 0.0000 ± 0.0000 |" in md
  norm = {"max_over_median": 18.0, "kurtosis": 40.0, "top": 32}
  plain = {"max_over_median": 1.5, "kurtosis": 3.0, "top": 7}
  probe = {"outliers": {"channels": [32, 96], "gain": 16.0, "tokens": 100,
                        "planted": {"per_norm": {"layers_0/attn_norm": norm}},
                        "unplanted": {"per_norm": {"layers_0/attn_norm": plain}}},
           "timing": {"bf16": {"rl_step_s": 10.0, "rl_step_s_spread": 1.0, "timed_steps": 3,
                               "response_length": 70.0}},
           "estimate": {"settings": ["bf16", "nvfp4_naive"], "seeds": 5, "rl_steps": 300,
                        "hours": 8.4, "per_run_hours": 0.9}, "machine": "2 CPU cores",
           "load": 4.0}
  md = "\n".join(descriptive.regime_probe_section(probe))
  assert "| layers_0/attn_norm | 18.0 | 32 | 40.0 | 1.5 | 3.0 |" in md and "**8.4 h**" in md
  assert descriptive.regime_probe_section(None) == []
