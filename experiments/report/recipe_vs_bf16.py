"""The seed's first question: does the 4-bitter recipe keep BF16's training dynamics?

Measured two ways, both paired by seed against the BF16 twin (same base, prompts and keys):
the end of the run (held-out pass@1 in the run's own, deployment, precision) and the exact
distance to BF16 in two parts (experiments/paired.py `distance`: the static part, the run's
weights under its recipe vs the same weights in BF16; the trajectory part, the run's weights vs
its twin's at the same step, both in BF16). Naive NVFP4 is the secondary comparison.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from experiments.report import common, registry
from lowrl.analysis import stats


RECIPE, NAIVE, TWIN = "nvfp4_recipe", "nvfp4_naive", "bf16"


def design_check(results: list[dict[str, Any]]) -> stats.Claim | None:
  """BF16's RL raises held-out pass@1 over the base: the dynamics the recipe must keep exist."""
  return common.seed_claim(results, "rl_gain", "RL at BF16 raises held-out pass@1 over the base",
                           TWIN, TWIN, common.get("eval_end", "pass_at_1"), +1,
                           "held-out pass@1 end - start",
                           baseline_value=common.get("eval_start", "pass_at_1"))


def equivalence_claim(name: str, statement: str, design: str, diffs: np.ndarray,
                      margin: registry.Margin) -> stats.Claim:
  """A TOST claim on per-seed differences with its registered margin (result: the TOST's p and
  its 90% interval)."""
  return stats.Claim(name, statement, design, stats.tost(diffs, margin.delta), +1,
                     note=f"paired t p {stats.fmt_p(stats.paired_t(diffs).p)} (difference from 0)",
                     margin=margin.bounds)


def _seed_diffs(results, value: common.Value, a: str, b: str) -> np.ndarray | None:
  t, u = common.per_seed(results, a, value), common.per_seed(results, b, value)
  try:
    return stats.paired_diffs(t, u)[1]
  except ValueError:
    return None


def outcome_claims(results: list[dict[str, Any]], grid: str) -> list[stats.Claim]:
  """The recipe's outcome is equivalent to its BF16 twin's (TOST, paired by seed): the end
  held-out pass@1 in deployment precision (the run's own: sampler = trainer = the recipe) and the
  pass@1 gain (end - start: the dynamics, without the static error the base starts with). And
  the secondary: the recipe's gain is closer to the twin's than naive NVFP4's."""
  out = []
  for name, value, what in (
      ("recipe_equiv_end_pass_at_1", common.get("eval_end", "pass_at_1"),
       "held-out pass@1 at the end, each run in its own (deployment) precision"),
      ("recipe_equiv_gain", common.gain, "held-out pass@1 gain (end - start), each run in its "
       "own precision")):
    d = _seed_diffs(results, value, RECIPE, TWIN)
    if d is None:
      continue
    out.append(equivalence_claim(
        name, f"The recipe's {what.split(',')[0]} is equivalent to its BF16 twin's",
        f"{what}: {RECIPE} - {TWIN}, paired by seed; TOST", d, registry.margin(grid, name)))
  c = common.seed_claim(results, "recipe_vs_naive_outcome", "The recipe's pass@1 gain is closer "
                        "to the BF16 twin's than naive NVFP4's", RECIPE, NAIVE,
                        gap_to_twin(results), -1, "|gain - BF16 twin's gain|")
  return out + ([c] if c is not None else [])


def gap_to_twin(results: list[dict[str, Any]], twin: str = "bf16") -> common.Value:
  """How far a run's pass@1 gain is from its seed's BF16 twin's (None without the twin)."""
  twin_gain = stats.by_unit(results, common.gain).get(twin, {})

  def value(r):
    g = twin_gain.get(r["seed"])
    return None if g is None else abs(common.gain(r) - g)
  return value


# ----------------------------------------------------------------------------- distance


def distance_points(line: dict[str, Any]) -> dict[float, dict[str, float | None]]:
  """{fraction of the run: {"static", "trajectory"}} of a distance line (experiments/paired.py
  `distance`), each the mean over its prompts (None where not measured). Lines written before
  the checkpoints were kept (static_start / static_end / trajectory_end) give 0 and 1."""
  mean = lambda v: None if v is None else float(np.mean(v))  # noqa: E731
  if "points" in line:
    return {round(float(q["fraction"]), 6): {"static": mean(q["static"]),
                                             "trajectory": mean(q["trajectory"])}
            for q in line["points"]}
  return {0.0: {"static": mean(line["static_start"]), "trajectory": 0.0},
          1.0: {"static": mean(line["static_end"]), "trajectory": mean(line["trajectory_end"])}}


def _trained(points: dict[float, dict[str, float | None]]) -> dict[float, float]:
  """The trajectory part at the points after step 0 where it was measured."""
  return {f: q["trajectory"] for f, q in points.items() if f > 0 and q["trajectory"] is not None}


def fraction_label(f: float) -> str:
  return f"{100 * f:.3g}%"


def distance_rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per distance line (a run): its trajectory part averaged over the checkpoints after step 0
  (`trajectory_mean`), its growth (`trajectory_slope`: least-squares slope through the origin
  against the fraction of the run, where it is 0 by construction; only with a checkpoint besides
  the end) and the checkpoints' labels (`at`), as results-like rows for `stats.by_unit`."""
  rows = []
  for r in lines:
    t = _trained(distance_points(r))
    f = np.array(list(t))
    slope = float(np.dot(f, list(t.values())) / np.dot(f, f)) if len(t) >= 2 else None
    rows.append({"setting": r["setting"], "seed": r["seed"],
                 "trajectory_mean": float(np.mean(list(t.values()))) if t else None,
                 "trajectory_slope": slope, "at": ", ".join(fraction_label(x) for x in t)})
  return rows


def trajectory_what(rows: list[dict[str, Any]]) -> tuple[str, str]:
  """(the checkpoints the recipe's runs kept, the trajectory-mean design text)."""
  at = next((r["at"] for r in rows if r["setting"] == "nvfp4_recipe"), "the end")
  return at, (f"exact KL(run's weights ‖ twin's weights at the same step), both in BF16, mean "
              f"over the checkpoints ({at})")


def distance_claims(lines: list[dict[str, Any]], grid: str = "ablate") -> list[stats.Claim]:
  """Seed-paired claims on the trajectory part of the distance to BF16 (its mean over the
  checkpoints after step 0: 25%, 50%, 100% of the run in configs/ablate.py; the end alone for a
  run that kept none): the recipe's is inside the registered margin (TOST; the twin's own is 0 by
  construction, so the recipe's value is the paired difference); and, secondary, recipe vs naive
  NVFP4 on it and on its growth (the slope; only with a checkpoint besides the end)."""
  rows = distance_rows(lines)
  at, what = trajectory_what(rows)
  traj = common.per_seed(rows, RECIPE, common.get("trajectory_mean"))
  c = []
  if traj:
    name = "recipe_equiv_trajectory"
    c.append(equivalence_claim(
        name, "The recipe's weights stay within the margin of its BF16 twin's (trajectory part, "
        "both in BF16)", f"{what}: {RECIPE} (its twin: 0 by construction), paired by seed; TOST",
        np.array([traj[k] for k in sorted(traj)]), registry.margin(grid, name)))
  c += [common.seed_claim(rows, "trajectory_recipe_vs_naive", "The recipe's weights stay closer "
                         "to its BF16 twin's than naive NVFP4's (trajectory part, both in BF16)",
                         "nvfp4_recipe", "nvfp4_naive", common.get("trajectory_mean"), -1, what),
       common.seed_claim(rows, "trajectory_growth_recipe_vs_naive", "The recipe's trajectory "
                         "part grows more slowly along the run than naive NVFP4's (it tracks "
                         "BF16 while naive drifts)", "nvfp4_recipe", "nvfp4_naive",
                         common.get("trajectory_slope"), -1,
                         f"slope of the trajectory part against the fraction of the run ({at})")]
  return [x for x in c if x is not None]


def distance_table(lines: list[dict[str, Any]]) -> list[str]:
  """Per setting, the two parts at every checkpoint (mean over seeds of the per-prompt means);
  then per comparison of the claims, the paired difference at every checkpoint."""
  if not lines:
    return []
  by: dict[str, list[dict]] = {}
  for r in lines:
    by.setdefault(r["setting"], []).append(r)
  pts = {r["setting"]: distance_points(r) for r in lines}
  fracs = sorted({f for p in pts.values() for f in p})
  cols = [("static", f) for f in fracs] + [("trajectory", f) for f in fracs if f > 0]
  md = ["### Distance to BF16 in two parts at the checkpoints (exact KL per token on identical "
        "held-out tokens)", "",
        "| setting | seeds | " + " | ".join(f"{k} {fraction_label(f)}" for k, f in cols) + " |",
        "|---|---|" + "---|" * len(cols)]
  for name, rs in by.items():
    cells = []
    for k, f in cols:
      v = [distance_points(r).get(f, {}).get(k) for r in rs]
      v = [x for x in v if x is not None]
      cells.append(stats.fmt_num(float(np.mean(v)), 4) if v else "–")
    md.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
  md += ["", "Static: the run's weights under its recipe vs the same weights in BF16. "
         "Trajectory: the run's weights vs its BF16 twin's at the same step, both in BF16 (0 at "
         "step 0 by construction). Columns: the fraction of the run (step / rl.steps). Mean over "
         "seeds of the per-prompt means.", ""]
  build = common.BUILD_UP
  pairs = [("nvfp4_recipe", "nvfp4_naive"), *[(c, p) for p, c in zip(build, build[1:])]]
  diff_rows = []
  for a, b in pairs:
    cells = []
    for k, f in cols:
      value = lambda r, k=k, f=f: distance_points(r).get(f, {}).get(k)  # noqa: E731
      try:
        _, d = stats.paired_diffs(stats.by_unit(lines, value).get(a, {}),
                                  stats.by_unit(lines, value).get(b, {}))
      except ValueError:
        cells.append("–")
        continue
      r = stats.paired_t(d)
      cells.append(common.mean_ci(r) if r.n > 1 else stats.fmt_num(r.mean, 4))
    if any(x != "–" for x in cells):
      diff_rows.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
  if diff_rows:
    md += ["Paired by seed, per checkpoint (mean difference [95% CI], paired t; descriptive: the "
           "claims above use the mean over the checkpoints and the slope):", "",
           "| comparison | " + " | ".join(f"{k} {fraction_label(f)}" for k, f in cols) + " |",
           "|---|" + "---|" * len(cols), *diff_rows, ""]
  return md
