"""The report's claims, gathered from each question's module in the report's order."""
from __future__ import annotations

from typing import Any

from experiments.report import backward, common, components, recipe_vs_bf16, sr_cast
from lowrl.analysis import stats


def grid_claims(results: list[dict[str, Any]]) -> list[stats.Claim]:
  """The seed-paired claims of the grid's results lines (those whose settings ran)."""
  c = [common.seed_claim(results, "rl_gain", "RL at BF16 raises held-out pass@1 over the base",
                         "bf16", "bf16", common.get("eval_end", "pass_at_1"), +1,
                         "held-out pass@1 end - start",
                         baseline_value=common.get("eval_start", "pass_at_1"))]
  c += recipe_vs_bf16.tracking_claims(results)
  c += components.twin_kl_claims(results)
  c.append(backward.probe_claim(results))
  c += sr_cast.sr_cast_claims(results)
  c.append(common.seed_claim(results, "kl_reset_pass_k", "Resetting the KL reference keeps more "
                             "prompts solvable (pass@k at the end, largest k measured)",
                             "kl+reset", "kl", common.pass_k_max("end"), +1,
                             "held-out pass@k at the end"))
  return [x for x in c if x is not None]


def paired_claims(paired: dict[str, Any]) -> list[stats.Claim]:
  """The claims of experiments/paired.py's measurements (prompts / batches / seeds as units)."""
  lines = paired.get("distance", [])
  out = recipe_vs_bf16.distance_claims(lines) + components.trajectory_claims(lines)
  ladder = paired.get("forward_ladder", {})
  out += components.ladder_claims(ladder) + components.outlier_claims(ladder)
  return out + backward.paired_claims(paired)
