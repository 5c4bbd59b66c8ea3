"""Every claim of one grid, gathered from each question's module; their roles and families are
the registry's (experiments/report/registry.py)."""
from __future__ import annotations

from typing import Any

from experiments.report import backward, common, components, recipe_vs_bf16, sr_cast
from lowrl.analysis import stats


def grid_claims(results: list[dict[str, Any]], grid: str = "ablate") -> list[stats.Claim]:
  """The seed-paired claims of the grid's results lines (those whose settings ran); `grid` (the
  config's label) picks the registered equivalence margins."""
  c = [recipe_vs_bf16.design_check(results)]
  c += recipe_vs_bf16.outcome_claims(results, grid)
  c.append(backward.probe_claim(results))
  c += sr_cast.sr_cast_claims(results)
  c.append(common.seed_claim(results, "kl_reset_pass_k", "Resetting the KL reference keeps more "
                             "prompts solvable (pass@k at the end, largest k measured)",
                             "kl+reset", "kl", common.pass_k_max("end"), +1,
                             "held-out pass@k at the end"))
  return [x for x in c if x is not None]


def paired_claims(paired: dict[str, Any], grid: str = "ablate") -> list[stats.Claim]:
  """The claims of experiments/paired.py's measurements (prompts / batches / seeds as units)."""
  lines = paired.get("distance", [])
  out = recipe_vs_bf16.distance_claims(lines, grid) + components.trajectory_claims(lines)
  ladder = paired.get("forward_ladder", {})
  out += components.ladder_claims(ladder) + components.outlier_claims(ladder)
  return out + backward.paired_claims(paired)
