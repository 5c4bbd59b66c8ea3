r"""The ablation's report: docs/results.md with PNG plots, from experiments/ablate.py workdirs.

  python -m experiments.report --workdir=/tmp/lowrl_ablate        # writes docs/results.md
  python -m experiments.report --workdir=W --out=/tmp/results.md   # elsewhere
  python -m experiments.report --workdir=W --workdir=W2           # two grids, one report

With several workdirs (configs/ablate.py's grid and configs/ablate_regime.py's), their claims are
named by grid ("[ablate_regime] ...") and judged as one Holm family; each grid's tables follow.

Every claim is tested as a paired comparison (lowrl.analysis.stats): against a named baseline on
the same unit, a seed of the grid (settings of one seed share the base, prompts, held-out set and
sampling keys) or a prompt / batch of experiments/paired.py's forward-only and backward
measurements (identical tokens and weights for every arm). Per claim: the design, n, the mean
paired difference with its 95% confidence interval (paired t), the Holm-adjusted p over all the
claims of the report (one family), and the verdict at 0.05: held, contradicted (significant the
other way) or not resolved. The PNGs are written next to the markdown file (`<stem>_*.png`, a
second grid's `<stem>_<grid>_*.png`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Sequence

import numpy as np

from experiments import ablate, paired as paired_exp, regime
from lowrl import grid as lowrl_grid
from lowrl.analysis import stats
from lowrl.training import exits, run_config, run_logs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_UP = ("nvfp4_naive", "+per_token", "+4/6", "+bf16_tail", "nvfp4_recipe")
LADDER = paired_exp.LADDER


def _stats(values: list[float | None]) -> tuple[float, float, int] | None:
  """(mean, population std, n) of the non-None values; None when there are none."""
  v = [x for x in values if x is not None]
  return (float(np.mean(v)), float(np.std(v)), len(v)) if v else None


def _fmt(s: tuple[float, float, int] | None, digits: int = 3) -> str:
  if s is None:
    return "–"
  m, sd, n = s
  fmt = (lambda x: f"{x:.{digits}f}") if max(abs(m), sd) >= 10**-digits or m == 0 else (
      lambda x: f"{x:.1e}")
  return f"{fmt(m)} ± {fmt(sd)}" if n > 1 else fmt(m)


def aggregate(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """{setting: {group, n, and for every per-run number its (mean, std, n) over seeds}}, in
  results order."""
  out: dict[str, dict[str, Any]] = {}
  for r in results:
    out.setdefault(r["setting"], {"group": r["group"], "runs": []})["runs"].append(r)
  for s in out.values():
    runs = s["runs"]
    s["n"] = len(runs)
    for when in ("start", "end"):
      for k in ("pass_at_1", "greedy"):
        s[f"{k}_{when}"] = _stats([r[f"eval_{when}"][k] for r in runs])
    s["gain"] = _stats([_gain(r) for r in runs])
    for when in ("start", "end"):
      s[f"pass_k_{when}"] = _stats([_pass_k_max(when)(r) for r in runs])
    ks = [max(r[f"pass_at_k_end"], key=int) for r in runs if r.get("pass_at_k_end")]
    s["k"] = ks[0] if ks else None
    for k in ("final_reward", "mismatch_kl", "mismatch_kl_k3", "ess", "kl_ref", "grad_cos",
              "grad_rel_err", "update_erasure", "twin_kl_start", "twin_kl_end",
              "twin_kl_k3_start", "twin_kl_k3_end"):
      s[k] = _stats([r.get(k) for r in runs])
  return out


def _curves(workdir: str, agg: dict, setting: str, key: str) -> tuple[np.ndarray, np.ndarray,
                                                                       np.ndarray] | None:
  """(steps, mean, std) over seeds of metrics.jsonl's `key` for `setting`."""
  series = []
  for r in agg[setting]["runs"]:
    rows = [x for x in run_logs.read_metrics(os.path.join(workdir, r["run_dir"]))
            if x.get(key) is not None]
    series.append({x["step"]: x[key] for x in rows})
  steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
  if not steps:
    return None
  y = np.array([[s[t] for t in steps] for s in series])
  return np.array(steps), y.mean(0), y.std(0)


Value = Callable[[dict[str, Any]], float | None]


def _get(*path: str) -> Value:
  """A per-run number of a results line by its path (None when absent)."""
  def value(r):
    for p in path:
      if not isinstance(r, dict) or r.get(p) is None:
        return None
      r = r[p]
    return float(r)
  return value


def _gain(r: dict[str, Any]) -> float:
  return r["eval_end"]["pass_at_1"] - r["eval_start"]["pass_at_1"]


def _pass_k_max(when: str) -> Value:
  """pass@k at the largest k the line holds."""
  def value(r):
    d = r.get(f"pass_at_k_{when}")
    return float(d[max(d, key=int)]) if d else None
  return value


def _seed_claim(results, name: str, statement: str, treatment: str, baseline: str,
                value: Value, direction: int, what: str,
                baseline_value: Value | None = None) -> stats.Claim | None:
  """A claim on `value` paired by seed: treatment - baseline per seed (baseline_value: the
  baseline's own number, e.g. the start of the same run). None when a side was not run."""
  t = stats.by_unit(results, value)
  b = stats.by_unit(results, baseline_value or value)
  if treatment not in t or baseline not in b:
    return None
  try:
    _, d = stats.paired_diffs(t[treatment], b[baseline])
  except ValueError:
    return None
  vs = "its own start" if baseline_value is not None and treatment == baseline else baseline
  return stats.Claim(name, statement, f"{what}: {treatment} - {vs}, paired by seed",
                     stats.paired_t(d), direction,
                     note=f"sign test p {stats.fmt_p(stats.sign_test(d))}")


def grid_claims(results: list[dict[str, Any]]) -> list[stats.Claim]:
  """The seed-paired claims of the grid's results lines (those whose settings ran)."""
  twin_end, twin_start = _get("twin_kl_k3_end"), _get("twin_kl_k3_start")
  growth = lambda r: (None if r.get("twin_kl_k3_end") is None  # noqa: E731
                      else r["twin_kl_k3_end"] - r["twin_kl_k3_start"])
  gains = stats.by_unit(results, _gain)
  bf16_gain = gains.get("bf16", {})

  def gap_to_bf16(r):  # how far a run's pass@1 gain is from its seed's BF16 twin's
    g = bf16_gain.get(r["seed"])
    return None if g is None else abs(_gain(r) - g)

  c = [
      _seed_claim(results, "rl_gain", "RL at BF16 raises held-out pass@1 over the base", "bf16",
                  "bf16", _get("eval_end", "pass_at_1"), +1, "held-out pass@1 end - start",
                  baseline_value=_get("eval_start", "pass_at_1")),
      _seed_claim(results, "tracks_twin", "The 4-bitter recipe ends closer to its BF16 twin than "
                  "naive NVFP4 does", "nvfp4_recipe", "nvfp4_naive", twin_end, -1,
                  "KL(run ‖ BF16 twin) at the end (k3)"),
      _seed_claim(results, "tracks_twin_growth", "... and the twin KL grows less along the run "
                  "(end - start: the part training adds)", "nvfp4_recipe", "nvfp4_naive", growth,
                  -1, "twin KL end - start"),
      _seed_claim(results, "tracks_outcome", "The recipe's pass@1 gain is closer to the BF16 "
                  "twin's than naive NVFP4's", "nvfp4_recipe", "nvfp4_naive", gap_to_bf16, -1,
                  "|gain - BF16 twin's gain|"),
  ]
  for prev, cur in zip(BUILD_UP, BUILD_UP[1:]):
    c.append(_seed_claim(results, f"component_{cur}", f"{cur} (after {prev}) ends closer to the "
                         "BF16 twin", cur, prev, twin_end, -1, "twin KL at the end (k3)"))
  c.append(_seed_claim(results, "backward_probe", "The dequantized backward's gradient is closer "
                       "to FP32 than the quantized one's (training probes)", "nvfp4_recipe",
                       "nvfp4_recipe_qbwd", _get("grad_cos"), +1,
                       "mean gradient cosine vs FP32 over the probe steps"))
  c += sr_cast_claims(results)
  c.append(_seed_claim(results, "kl_reset_pass_k", "Resetting the KL reference keeps more prompts "
                       "solvable (pass@k at the end, largest k measured)", "kl+reset", "kl",
                       _pass_k_max("end"), +1, "held-out pass@k at the end"))
  return [x for x in c if x is not None]


def _lrs(results: list[dict[str, Any]], *arms: str) -> list[str]:
  """The lr tags ("2e-5") at which every one of `arms` ran ("<arm>@<lr>"), highest lr first."""
  tags = [{r["setting"].split("@")[1] for r in results if r["setting"].startswith(f"{a}@")}
          for a in arms]
  return sorted(set.intersection(*tags), key=lambda t: -float(t)) if tags else []


# The seed's stochastic-rounding arm (configs/ablate.py): FP32 master weights with the BF16
# compute cast rounded to nearest, the same cast rounded stochastically, FP16 compute.
CAST_RTN, CAST_SR, CAST_FP16 = "fp32_master", "bf16_sr_cast", "fp16"
_REF_KL = _get("ref_kl_k3_end")
# The outcomes of the arm: held-out pass@1 gain, KL(final policy || the reference, the base).
CAST_OUTCOMES = (("gain", "held-out pass@1 gain", _gain),
                 ("ref_kl", "KL(final policy ‖ reference) on held-out prompts (k3)", _REF_KL))


def _per_seed(results, setting: str, value: Value) -> dict[Any, float]:
  return stats.by_unit(results, value).get(setting, {})


def lag_lr(results: list[dict[str, Any]]) -> tuple[str | None, dict[str, float]]:
  """The learning rate where the BF16 cast lags FP16, found from the data: the lowest lr of the
  arm's lrs whose paired mean (FP16 - BF16 RTN cast) held-out pass@1 gain is positive (None if
  none is); and that mean at every lr."""
  lags = {}
  for lr in _lrs(results, CAST_RTN, CAST_SR, CAST_FP16):
    try:
      _, d = stats.paired_diffs(_per_seed(results, f"{CAST_FP16}@{lr}", _gain),
                                _per_seed(results, f"{CAST_RTN}@{lr}", _gain))
    except ValueError:
      continue
    lags[lr] = float(np.mean(d))
  lagging = [lr for lr, m in lags.items() if m > 0]
  return (min(lagging, key=float) if lagging else None), lags


def sr_cast_claims(results: list[dict[str, Any]]) -> list[stats.Claim]:
  """The seed's SR claim, paired by seed: "at a learning rate where the BF16 round-to-nearest
  cast lags FP16, the stochastically rounded cast closes the gap".

  1. The lag, tested at every lr of the arm (one claim per lr, all in the report's Holm family,
     none chosen after looking): FP16 - RTN-cast gain > 0.
  2. At the lr `lag_lr` finds (the lowest with a positive mean lag), per outcome X (gain, KL to
     the reference): SR closes at least half the gap, X_SR - (X_RTN + X_FP16) / 2 on the side of
     FP16 (the sign of the mean X_FP16 - X_RTN). This statistic is uncorrelated with the one the
     lr was chosen by (X_FP16 - X_RTN) when the two arms' seed noise has equal variance, so the
     choice does not bias it; the plain SR - RTN shares RTN's noise with the choice and would be
     pushed the claim's way (it is shown as a note). No lr with a lag: the claim is not tested.
  """
  lr_star, lags = lag_lr(results)
  out = []
  for lr in lags:
    c = _seed_claim(results, f"cast_lag@{lr}", f"At lr {lr}, BF16 compute with the "
                    "round-to-nearest weight cast gains less held-out pass@1 than FP16 compute",
                    f"{CAST_FP16}@{lr}", f"{CAST_RTN}@{lr}", _gain, +1, "pass@1 gain")
    if c is not None:
      out.append(c)
  if not lags:
    return out
  for tag, what, value in CAST_OUTCOMES:
    name = f"cast_sr_closes_gap_{tag}"
    statement = ("At the lr where the BF16 RTN cast lags FP16, the stochastically rounded cast "
                 f"closes at least half the gap ({what})")
    if lr_star is None:
      out.append(stats.Claim(name, statement, "no lr of the arm shows a lag (FP16 - RTN-cast "
                             f"gain <= 0 at every lr: {', '.join(lags)})",
                             stats.PairedResult(0, *(4 * [float("nan")])), +1,
                             note="not tested: the grid found no lr where BF16 lags FP16"))
      continue
    arms = {a: _per_seed(results, f"{a}@{lr_star}", value) for a in (CAST_RTN, CAST_SR, CAST_FP16)}
    seeds = sorted(set.intersection(*(set(v) for v in arms.values())))
    if not seeds:
      continue
    x = {a: np.array([v[s] for s in seeds]) for a, v in arms.items()}
    toward = float(np.sign(np.mean(x[CAST_FP16] - x[CAST_RTN])))
    design = (f"lr {lr_star} (the lowest lr with FP16 - RTN-cast gain > 0: "
              + ", ".join(f"{t}: {stats.fmt_num(m, 4)}" for t, m in lags.items())
              + f"); {what}: {CAST_SR} - ({CAST_RTN} + {CAST_FP16}) / 2, paired by seed")
    if toward == 0:
      out.append(stats.Claim(name, statement, design, stats.PairedResult(
          len(seeds), *(4 * [float("nan")])), +1, note="not tested: FP16 and RTN cast equal"))
      continue
    d = x[CAST_SR] - (x[CAST_RTN] + x[CAST_FP16]) / 2
    sr_rtn, fp16_sr = x[CAST_SR] - x[CAST_RTN], x[CAST_FP16] - x[CAST_SR]
    out.append(stats.Claim(
        name, statement + (" (FP16 larger)" if toward > 0 else " (FP16 smaller)"), design,
        stats.paired_t(d), int(toward),
        note=f"SR - RTN {stats.fmt_num(float(np.mean(sr_rtn)), 4)}, FP16 - SR "
             f"{stats.fmt_num(float(np.mean(fp16_sr)), 4)} (means over {len(seeds)} seeds; SR - "
             "RTN is biased by the choice of lr); sign test p "
             f"{stats.fmt_p(stats.sign_test(d))}"))
  return out


def _sr_cast_section(results: list[dict[str, Any]]) -> list[str]:
  """The seed's SR arm per lr: each arm's gain and KL to the reference (mean ± std over seeds)
  and the paired lag, with the lr `lag_lr` found."""
  lr_star, lags = lag_lr(results)
  if not lags:
    return []
  md = ["## Stochastic rounding of the BF16 compute cast (the seed's arm)", "",
        f"FP32 master weights; the BF16 GEMMs' weights cast to nearest ({CAST_RTN}) or "
        f"stochastically, fresh per update ({CAST_SR}: --config.optimizer.compute_cast_rounding="
        f"stochastic), against FP16 compute with a static loss scale ({CAST_FP16}). The sampler, "
        "the held-out evaluation and the reference use the nearest cast. Lag = FP16 - RTN-cast "
        "gain, paired by seed; the lr where BF16 lags is the lowest with a positive mean lag: "
        f"**{lr_star or 'none'}**.", "",
        "| lr | steps | gain RTN cast | gain SR cast | gain FP16 | lag (FP16 - RTN) | "
        "KL to ref RTN | KL to ref SR | KL to ref FP16 |", "|---|---|---|---|---|---|---|---|---|"]
  for lr in lags:
    arms = (CAST_RTN, CAST_SR, CAST_FP16)
    runs = {a: [r for r in results if r["setting"] == f"{a}@{lr}"] for a in arms}
    steps = {r.get("overrides", {}).get("rl.steps", "run") for a in arms for r in runs[a]}
    cell = lambda a, v: _fmt(_stats([v(r) for r in runs[a]]), 4)  # noqa: E731
    md.append(f"| {lr} | {', '.join(map(str, sorted(steps, key=str)))} | "
              + " | ".join(cell(a, _gain) for a in arms)
              + f" | {stats.fmt_num(lags[lr], 4)} | "
              + " | ".join(cell(a, _REF_KL) for a in arms) + " |")
  return md + ["", "steps: rl.steps of the lr's runs ('run' = the grid's run.rl.steps).", ""]


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


def _label(f: float) -> str:
  return f"{100 * f:.3g}%"


def distance_claims(lines: list[dict[str, Any]]) -> list[stats.Claim]:
  """Seed-paired claims on the trajectory part of the distance to BF16 (experiments/paired.py
  `distance`), from its checkpoints: per run, the trajectory part averaged over the checkpoints
  after step 0 (25%, 50%, 100% of the run in configs/ablate.py; the end alone for a run that kept
  none), and its growth (least-squares slope through the origin against the fraction of the
  run, where it is 0 by construction; only with a checkpoint besides the end)."""
  rows = []
  for r in lines:
    t = _trained(distance_points(r))
    f = np.array(list(t))
    slope = float(np.dot(f, list(t.values())) / np.dot(f, f)) if len(t) >= 2 else None
    rows.append({"setting": r["setting"], "seed": r["seed"],
                 "trajectory_mean": float(np.mean(list(t.values()))) if t else None,
                 "trajectory_slope": slope, "at": ", ".join(_label(x) for x in t)})
  at = next((r["at"] for r in rows if r["setting"] == "nvfp4_recipe"), "the end")
  traj = _get("trajectory_mean")
  what = (f"exact KL(run's weights ‖ twin's weights at the same step), both in BF16, mean over "
          f"the checkpoints ({at})")
  c = [_seed_claim(rows, "trajectory_recipe_vs_naive", "The recipe's weights stay closer to its "
                   "BF16 twin's than naive NVFP4's (trajectory part, both in BF16)",
                   "nvfp4_recipe", "nvfp4_naive", traj, -1, what),
       _seed_claim(rows, "trajectory_growth_recipe_vs_naive", "The recipe's trajectory part "
                   "grows more slowly along the run than naive NVFP4's (it tracks BF16 while "
                   "naive drifts)", "nvfp4_recipe", "nvfp4_naive", _get("trajectory_slope"), -1,
                   f"slope of the trajectory part against the fraction of the run ({at})")]
  for prev, cur in zip(BUILD_UP, BUILD_UP[1:]):
    c.append(_seed_claim(rows, f"trajectory_{cur}", f"{cur} (after {prev}) also lowers the "
                         "trajectory part", cur, prev, traj, -1, what))
  return [x for x in c if x is not None]


def _distance_table(lines: list[dict[str, Any]]) -> list[str]:
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
        "| setting | seeds | " + " | ".join(f"{k} {_label(f)}" for k, f in cols) + " |",
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
  pairs = [("nvfp4_recipe", "nvfp4_naive"), *[(c, p) for p, c in zip(BUILD_UP, BUILD_UP[1:])]]
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
      cells.append(_mean_ci(r) if r.n > 1 else stats.fmt_num(r.mean, 4))
    if any(x != "–" for x in cells):
      diff_rows.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
  if diff_rows:
    md += ["Paired by seed, per checkpoint (mean difference [95% CI], paired t; descriptive: the "
           "claims above use the mean over the checkpoints and the slope):", "",
           "| comparison | " + " | ".join(f"{k} {_label(f)}" for k, f in cols) + " |",
           "|---|" + "---|" * len(cols), *diff_rows, ""]
  return md


def _mean_ci(r: stats.PairedResult) -> str:
  """"mean [95% CI]" of a paired t result, 4 digits."""
  return f"{stats.fmt_num(r.mean, 4)} [{stats.fmt_num(r.ci_low, 4)}, {stats.fmt_num(r.ci_high, 4)}]"


def paired_claims(paired: dict[str, Any]) -> list[stats.Claim]:
  """The claims of experiments/paired.py's measurements (prompts / batches / seeds as units)."""
  out = distance_claims(paired.get("distance", []))
  lad = paired.get("forward_ladder", {}).get("kl", {})
  for prev, cur in zip(LADDER, LADDER[1:]):
    if prev in lad and cur in lad:
      d = np.asarray(lad[cur]) - np.asarray(lad[prev])
      boot = stats.bootstrap_mean_ci(d, rng_seed=0, n_boot=10_000)
      out.append(stats.Claim(
          f"ladder_{cur}", f"{cur} lowers the forward's KL to BF16 (after {prev})",
          "forward-only: same BF16-sampled tokens and weights, exact full-vocabulary KL(rung ‖ "
          f"BF16) per prompt; {cur} - {prev}, paired by prompt", stats.paired_t(d), -1,
          note=f"bootstrap 95% CI [{stats.fmt_num(boot.ci_low, 4)}, "
               f"{stats.fmt_num(boot.ci_high, 4)}]"))
  out += outlier_claims(paired.get("forward_ladder", {}))
  out += backward_claims(paired.get("backward", {}), "the base")
  mid = paired.get("backward_mid", {})
  if mid.get("modes"):
    out += backward_claims(mid, f"mid-run: {mid['weights']}", mid_run=True)
  return out


def backward_claims(bwd: dict[str, Any], where: str,
                    mid_run: bool = False) -> list[stats.Claim]:
  """The backward modes' claims on one paired.py backward line (identical batches and weights,
  `where`: the base or a mid-run checkpoint), paired by batch; mid-run ids end in "_mid"."""
  modes = bwd.get("modes", {})
  suffix, tag = ("_mid", " (mid-run)") if mid_run else ("", "")
  design = (f"identical batches and weights ({where}), gradient of the recipe's forward with each "
            "backward; {what}; {a} - {b}, paired by batch")
  out = []
  for key, what, a, b, direction, statement in (
      ("cos_fp32", "cosine to the FP32 gradient", "dequantized", "quantized", +1,
       "The dequantized backward's gradient is closer to FP32 than the quantized one's"),
      ("cos_fp32", "cosine to the FP32 gradient", "dequantized", "high_precision", +1,
       "The dequantized backward's gradient is closer to FP32 than the high-precision one's"),
      ("cos_exact", "cosine to the quantized forward's exact (dequantized) gradient",
       "quantized", "high_precision", +1,
       "The quantized backward approximates the quantized forward's gradient better than the "
       "high-precision one"),
      ("heldout_delta", "held-out surrogate change after one AdamW step", "dequantized",
       "quantized", -1, "One update with the dequantized backward lowers the held-out loss more "
       "than with the quantized one"),
      ("heldout_delta", "held-out surrogate change after one AdamW step", "dequantized",
       "high_precision", -1, "One update with the dequantized backward lowers the held-out loss "
       "more than with the high-precision one")):
    if a in modes and b in modes:
      d = np.asarray(modes[a][key]) - np.asarray(modes[b][key])
      out.append(stats.Claim(f"backward_{key}_{a}_vs_{b}{suffix}", statement + tag,
                             design.format(what=what, a=a, b=b), stats.paired_t(d), direction,
                             note=f"sign test p {stats.fmt_p(stats.sign_test(d))}"))
  return out


def outlier_claims(ladder: dict[str, Any]) -> list[stats.Claim]:
  """The planted outlier channels as a factor of the forward ladder (experiments/paired.py: the
  same tokens scored on the base with and without them), paired by prompt: they raise naive
  NVFP4's KL to BF16, and per-token scales + 4/6 remove more of it with them than without."""
  on, off = ladder.get("kl", {}), ladder.get("kl_unplanted", {})
  first, last = LADDER[0], "+4/6"
  if not (first in on and first in off and last in on and last in off):
    return []
  design = ("forward-only: same BF16-sampled tokens, the base with its planted outlier channels "
            "and without them (the same function in exact arithmetic), exact full-vocabulary "
            "KL(rung ‖ BF16) per prompt; {what}, paired by prompt")
  raise_d = np.asarray(on[first]) - np.asarray(off[first])
  removed_on = np.asarray(on[first]) - np.asarray(on[last])
  removed_off = np.asarray(off[first]) - np.asarray(off[last])
  return [
      stats.Claim("outliers_raise_naive_kl", "Outlier channels raise naive NVFP4's KL to BF16",
                  design.format(what=f"{first}: planted - not planted"), stats.paired_t(raise_d),
                  +1, note=f"sign test p {stats.fmt_p(stats.sign_test(raise_d))}"),
      stats.Claim("outliers_per_token_46_remove_more",
                  "Per-token scales and 4/6 remove more of the KL to BF16 with outlier channels "
                  "than without",
                  design.format(what=f"({first} - {last}) planted - ({first} - {last}) not "
                                     "planted"), stats.paired_t(removed_on - removed_off), +1,
                  note=f"sign test p {stats.fmt_p(stats.sign_test(removed_on - removed_off))}")]


def _plots(workdir: str, agg: dict, stem: str) -> list[str]:
  """The PNGs `<stem>_settings.png` and `<stem>_curves.png`; returns their file names."""
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  names = list(agg)
  files = []

  def save(fig, tag):
    path = f"{stem}_{tag}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    files.append(os.path.basename(path))

  fig, axes = plt.subplots(1, 3, figsize=(18, 5))
  for ax, key, title in zip(axes, ("pass_at_1_end", "twin_kl_k3_end", "grad_cos"),
                            ("held-out pass@1 (end; dashed: base)", "KL to the BF16 twin (end, k3)",
                             "gradient cosine vs FP32")):
    vals = [agg[n][key] for n in names]
    y = [v[0] if v else np.nan for v in vals]
    e = [v[1] if v else 0 for v in vals]
    ax.bar(range(len(names)), y, yerr=e, capsize=3)
    if key == "pass_at_1_end" and agg[names[0]]["pass_at_1_start"]:
      ax.axhline(agg[names[0]]["pass_at_1_start"][0], ls="--", c="k")
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
    ax.set_title(title)
  save(fig, "settings")

  groups = {}
  for n in names:
    groups.setdefault(agg[n]["group"], []).append(n)
  keys = (("reward/mean", "training reward"), ("mismatch/mismatch_kl", "mismatch KL (k1)"),
          ("kl_ref", "KL to the reference"))
  fig, axes = plt.subplots(len(groups), 3, figsize=(18, 4 * len(groups)), squeeze=False)
  for row, (group, members) in enumerate(groups.items()):
    for col, (key, title) in enumerate(keys):
      ax = axes[row, col]
      for n in members + ([ablate_twin(agg)] if group != "recipe" and ablate_twin(agg) else []):
        c = _curves(workdir, agg, n, key)
        if c is not None:
          ax.plot(c[0], c[1], label=n)
          ax.fill_between(c[0], c[1] - c[2], c[1] + c[2], alpha=0.15)
      ax.set_title(f"{group}: {title}")
      ax.set_xlabel("step")
      if col == 0:
        ax.legend(fontsize=7)
  save(fig, "curves")
  return files


def ablate_twin(agg: dict) -> str | None:
  return next(iter(agg), None)  # ablate.settings puts the twin first


def _table(agg: dict) -> str:
  cols = (("n", None), ("greedy start", "greedy_start"), ("greedy end", "greedy_end"),
          ("pass@1 start", "pass_at_1_start"), ("pass@1 end", "pass_at_1_end"), ("gain", "gain"),
          ("pass@k start", "pass_k_start"), ("pass@k end", "pass_k_end"),
          ("final reward", "final_reward"), ("mismatch k1", "mismatch_kl"), ("ESS", "ess"),
          ("grad cos", "grad_cos"), ("grad rel err", "grad_rel_err"),
          ("erasure", "update_erasure"), ("twin KL start", "twin_kl_k3_start"),
          ("twin KL end", "twin_kl_k3_end"), ("KL to ref", "kl_ref"))
  lines = ["| setting | group | " + " | ".join(c for c, _ in cols) + " |",
           "|" + "---|" * (len(cols) + 2)]
  for n, s in agg.items():
    cells = [str(s["n"]) if k is None else _fmt(s[k], 4 if k == "grad_cos" else 3)
             for _, k in cols]
    lines.append(f"| {n} | {s['group']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _paired_section(paired: dict[str, dict[str, Any]]) -> list[str]:
  """The per-arm numbers of experiments/paired.py (mean [95% CI] over its units)."""
  md = []
  lad = paired.get("forward_ladder", {}).get("kl", {})
  off = paired.get("forward_ladder", {}).get("kl_unplanted", {})
  ci = lambda v: _mean_ci(stats.paired_t(v))  # noqa: E731
  if lad:
    md += ["### Forward ladder (KL to BF16 on identical tokens and weights)", "",
           "| rung | prompts | KL(rung ‖ BF16) per token, mean [95% CI] |"
           + (" outliers not planted | planted - not planted |" if off else ""),
           "|---|---|---|" + ("---|---|" if off else "")]
    for name, v in lad.items():
      row = f"| {name} | {len(v)} | {ci(v)} |"
      if name in off:
        row += f" {ci(off[name])} | {ci(np.asarray(v) - np.asarray(off[name]))} |"
      md.append(row)
    md.append("")
  by_fwd = paired.get("backward", {}).get("churn_by_forward", {})
  if by_fwd:
    md += ["### What one update changes in each quantized forward", "",
           "The dequantized backward's one AdamW step from the base on each batch (the backward "
           "design below), seen through each setting's trainer forward: the fraction of its "
           "quantized weights' codes and block scales the step changes (mean [95% CI] over "
           "batches).", "",
           "| forward | batches | codes changed | block scales changed |", "|---|---|---|---|"]
    for name, c in by_fwd.items():
      md.append(f"| {name} | {len(c['codes'])} | {ci(c['codes'])} | {ci(c['scales'])} |")
    md.append("")
  for key, where in (("backward", "the base"), ("backward_mid", "mid-run")):
    bwd = paired.get(key, {})
    if not bwd.get("modes"):
      continue
    at = "" if key == "backward" else f", mid-run ({bwd['weights']} of {bwd['steps']})"
    md += [f"### Backward modes on identical batches{at}", "",
           "| backward | batches | cos vs FP32 | rel err vs FP32 | cos vs exact quantized-forward "
           "gradient | held-out surrogate change after one step | NVFP4 codes the step changes |",
           "|---|---|---|---|---|---|---|"]
    for mode, m in bwd["modes"].items():
      def cell(k, m=m):
        return ci(m[k]) if k in m else "–"
      md.append(f"| {mode} | {len(m['heldout_delta'])} | {cell('cos_fp32')} | "
                f"{cell('rel_err_fp32')} | {cell('cos_exact')} | {cell('heldout_delta')} | "
                f"{cell('code_churn')} |")
    md += ["", f"Held-out surrogate at {where}: {bwd['heldout_base']:.5f} (lower is better; the "
           "fp32 row is the update on the FP32 gradient of the unquantized model).", ""]
  return md


CHURN = (("codes", "codes"), ("values", "dequantized values"), ("scales", "block scales"))


def churn_per_run(workdir: str, run: dict[str, Any]) -> dict[str, float] | None:
  """The mean over a run's logged steps of its code_churn/* metrics (diagnostics.code_churn:
  the fraction of the sampler policy's quantized weight codes, values and block scales an update
  changes); None when the run logged none (a BF16 sampler, or the knob off)."""
  rows = run_logs.read_metrics(os.path.join(workdir, run["run_dir"]))
  out = {}
  for key, _ in CHURN:
    v = [r[f"code_churn/{key}"] for r in rows if r.get(f"code_churn/{key}") is not None]
    if v:
      out[key] = float(np.mean(v))
  return out or None


def _churn_section(workdir: str, agg: dict) -> list[str]:
  """Per setting: the mean per-update fraction of changed codes / values / scales (mean ± std
  over seeds of each run's mean over its steps)."""
  rows = []
  for name, s in agg.items():
    per_run = [c for c in (churn_per_run(workdir, r) for r in s["runs"]) if c]
    if per_run:
      rows.append(f"| {name} | {len(per_run)} | " + " | ".join(
          _fmt(_stats([c.get(k) for c in per_run]), 4) for k, _ in CHURN) + " |")
  if not rows:
    return []
  return ["## Code churn: how much of the quantized policy an update changes", "",
          "Per RL update, the fraction of the sampler's quantized weight elements whose code "
          "(E2M1 for NVFP4) changes, of those whose dequantized value changes (a changed block "
          "scale moves its whole block) and of the block scales that change "
          "(--config.run.diagnostics.code_churn, lowrl/training/code_churn.py); mean over the "
          "run's steps, then mean ± std over seeds. QuRL's observation (arXiv 2602.13953): "
          "updates below half a 4-bit step change no code, so the quantized policy does not see "
          "them.", "",
          "| setting | runs | " + " | ".join(f"changed {w}" for _, w in CHURN) + " |",
          "|---|---|" + "---|" * len(CHURN), *rows, ""]


def regime_section(probe: dict[str, Any] | None) -> list[str]:
  """experiments/regime.py's probe (regime.json): the outlier channels it shows, the timed
  updates and the grid's estimated cost."""
  if not probe:
    return []
  o, e = probe["outliers"], probe["estimate"]
  md = ["## The regime's outlier channels and cost (experiments/regime.py)", "",
        f"Planted channels {o['channels']} at gain {o['gain']:g} (sft.outlier_channels / "
        "outlier_gain); per layer and RMSNorm, on the normed inputs of the matmuls over "
        f"{o['tokens']} held-out tokens (FP32, unquantized): the largest per-channel max "
        "|activation| over the median channel's, and the kurtosis (Gaussian: 3).", "",
        "| norm | max / median, planted | top channel | kurtosis, planted | max / median, "
        "not planted | kurtosis, not planted |", "|---|---|---|---|---|---|"]
  for norm, st in o["planted"]["per_norm"].items():
    un = o["unplanted"]["per_norm"][norm]
    md.append(f"| {norm} | {st['max_over_median']:.1f} | {st['top']} | {st['kurtosis']:.1f} | "
              f"{un['max_over_median']:.1f} | {un['kurtosis']:.1f} |")
  md += ["", "| setting | s per RL update (± std) | timed updates | completion tokens |",
         "|---|---|---|---|"]
  for name, t in probe["timing"].items():
    md.append(f"| {name} | {t['rl_step_s']:.1f} ± {t['rl_step_s_spread']:.1f} | "
              f"{t['timed_steps']} | {t['response_length']:.0f} |")
  lad = probe.get("ladder")
  md += ["", f"Estimated grid ({probe.get('machine', '?')}, load {probe.get('load', 0):.1f}): "
         f"{len(e['settings'])} settings x {e['seeds']} seeds x {e['rl_steps']} updates = "
         f"**{e['hours']:.1f} h** ({e['per_run_hours']:.2f} h per quantized run; evaluations, "
         "the distance and the paired measurements not included)."
         + (f" Forward-only ladder: {lad['sample_batch_s']:.1f} s to sample a batch of "
            f"{lad['rows_per_batch']} completions in BF16, {lad['ladder_batch_s']:.1f} s to "
            "score it by every rung." if lad else ""), ""]
  return md


def where_tested(labels: Sequence[str]) -> list[str]:
  """Where each claim of the experiment is tested, given the grids this report holds."""
  regime = REGIME in labels
  return [
      "## Where each claim is tested", "",
      "- **Forward components** (naive -> + per-token -> + 4/6 -> + BF16 tail): the static ladder, "
      "forward-only and paired by prompt, on each grid's base (the regime's with and without its "
      "outlier channels), and the trajectory part paired by seed in the build-up of "
      "configs/ablate.py's grid (`component_*`, `trajectory_*`).",
      "- **Backward modes**: identical batches and weights, at the base and mid-run (the "
      "first seed's nvfp4_recipe run at its kept checkpoint nearest half the run), paired by "
      "batch (`backward_*`, `backward_*_mid`), and the training probes' gradient cosine paired "
      "by seed (`backward_probe`).",
      "- **Stochastic rounding** (the seed's arm: FP32 master weights, the BF16 compute cast "
      "rounded to nearest or stochastically, FP16): configs/ablate.py's `sr` group at every lr "
      "of `lrs` (`cast_lag@*`, `cast_sr_closes_gap_*`). The master-weight rows (pure BF16 "
      "training) are described only: their erasure rates differ by construction.",
      "- **The recipe tracks BF16, naive NVFP4 does not**: the twin KL, its growth, the outcome "
      "and the trajectory part at the checkpoints, paired by seed (`tracks_*`, "
      "`trajectory_recipe_vs_naive`, `trajectory_growth_recipe_vs_naive`)"
      + (", in both grids; the regime's (d = 256 with outlier channels, 64-token completions, "
         "300 updates) is where dynamic effects can appear." if regime else
         "; at this size the static forward error dominates. The regime where dynamic effects "
         "can appear is configs/ablate_regime.py (`python -m experiments.ablate "
         "--config=configs/ablate_regime.py --workdir=W2`, paired, then this report with "
         "`--workdir` given twice)."),
      "- **KL reference reset** (the odds of optimal answers collapsing under a fixed "
      "reference): 300 updates, 10 seeds, fixed vs reset vs no KL, in the simulator, "
      "[kl_reset.md](kl_reset.md) (its own report and Holm family). The loop's 30-step `kl` rows "
      "(`--config.groups` adds `kl_reset`) could only test a proxy, and the KL to a reference "
      "just reset is 0 by construction.", ""]


REGIME = "ablate_regime"  # the label of configs/ablate_regime.py's grid


def _fewer_seeds(meta: dict[str, Any]) -> str:
  """', but <settings> on seeds [..]' for the grid's settings that run fewer seeds (a row's
  first_seeds: description no claim reads), grouped by their seeds."""
  by: dict[tuple[int, ...], list[str]] = {}
  for name, seeds in meta.get("setting_seeds", {}).items():
    if list(seeds) != list(meta.get("seeds", [])):
      by.setdefault(tuple(seeds), []).append(name)
  return "".join(f"; {', '.join(names)} on seeds {list(seeds)}" for seeds, names in by.items())


def grid_label(meta: dict[str, Any]) -> str:
  """The grid's config module ("ablate", "ablate_regime", ...) from its recorded command."""
  for word in meta.get("command", "").split():
    if word.startswith("--config="):
      return os.path.splitext(os.path.basename(word.split("=", 1)[1].split(":")[0]))[0]
  return "ablate"


def regime_line(workdir: str, agg: dict) -> str:
  """The grid's regime, read from its twin's first run: model, task, completions, updates,
  outlier channels."""
  twin = ablate_twin(agg)
  if twin is None:
    return ""
  run = agg[twin]["runs"][0]
  path = os.path.join(workdir, run["run_dir"], "config.json")
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    c = json.load(f)["config"]  # lowrl.training.run_config's record of the run's config
  m, rl, task, sft = c["model"], c["rl"], c["task"], c["sft"]
  lengths = [r.get("response_length") for r in run_logs.read_metrics(
      os.path.join(workdir, run["run_dir"])) if r.get("response_length") is not None]
  kwargs = ", ".join(f"{k}={v}" for k, v in sorted(task.get("kwargs", {}).items()))
  out = (f"Regime: {m['n_layers']} layers at d = {m['d_model']} (d_ff {m['d_ff']}); task "
         f"{task['name']}({kwargs}); completions of at most {rl['max_new_tokens']} tokens"
         + (f" ({np.mean(lengths):.1f} on average in the twin's first run)" if lengths else "")
         + f"; {rl['steps']} RL updates of {rl['num_prompts']} prompts x {rl['group_size']}; "
         f"a base of {sft['steps']} SFT steps")
  if int(sft.get("outlier_channels", 0)):
    out += (f", {sft['outlier_channels']} outlier channels planted at gain "
            f"{sft['outlier_gain']:g}")
  return out + "."


@dataclasses.dataclass
class Grid:
  """One experiments.ablate workdir's results, as the report reads them."""

  workdir: str
  label: str
  meta: dict[str, Any]
  results: list[dict[str, Any]]
  agg: dict[str, dict[str, Any]]
  paired: dict[str, Any]

  @classmethod
  def load(cls, workdir: str) -> "Grid":
    results = ablate.read_results(workdir)
    if not results:
      raise lowrl_grid.ResultsFileError(f"{workdir}/{ablate.RESULTS} has no results; run "
                                        "experiments.ablate first.")
    meta_path = os.path.join(workdir, ablate.GRID)
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    return cls(workdir, grid_label(meta), meta, results, aggregate(results),
               paired_exp.read_results(workdir))

  def claims(self) -> list[stats.Claim]:
    return grid_claims(self.results) + paired_claims(self.paired)

  def header(self) -> list[str]:
    w, meta, agg = self.workdir, self.meta, self.agg
    wall = sum(r["wall_s"] for r in self.results)
    quick = " --config.quick=True" if meta.get("quick") else ""
    config = "" if self.label == "ablate" else f" --config=configs/{self.label}.py"
    md = [f"Reproduce: `{meta.get('command', 'python -m experiments.ablate --workdir=W')}`, "
          f"`python -m experiments.paired --workdir={w}{config}{quick}` (paired measurements: "
          f"{'present' if os.path.exists(os.path.join(w, paired_exp.RESULTS)) else 'not run'}"
          f"), then `python -m experiments.report --workdir={w}`.", "",
          f"{len(self.results)} runs ({len(agg)} settings x seeds {meta.get('seeds', '?')}"
          f"{_fewer_seeds(meta)}); wall time of the runs {wall / 60:.1f} min in all "
          f"({meta.get('machine', 'this machine')}). " + regime_line(w, agg), ""]
    if meta.get("quick"):
      md += ["**This is the quick grid** (`--config.quick=True`: 8 RL steps of 8 prompts x 4, "
             "16 held-out prompts): it checks that every part of the experiment runs; its "
             "numbers are too small and short to test the claims.", ""]
    missing = [s for s in meta.get("settings", []) if s not in agg]
    if missing:
      md += [f"Not finished (no results yet): {', '.join(missing)}.", ""]
    return md

  def body(self, out_md: str, suffix: str) -> list[str]:
    """The grid's sections after the claims; its PNGs are `<out stem><suffix>_*.png`."""
    stem = os.path.splitext(out_md)[0] + suffix
    md = _sr_cast_section(self.results)
    md += _paired_section(self.paired) + _distance_table(self.paired.get("distance", []))
    md += _churn_section(self.workdir, self.agg)
    md += regime_section(regime.read_results(self.workdir))
    md += ["## All settings", "", _table(self.agg), ""]
    return md + [f"![{p}]({p})" for p in _plots(self.workdir, self.agg, stem)] + [""]


def write_report(workdirs: str | Sequence[str], out_md: str) -> str:
  """Writes `out_md` and its PNGs from the results of one or more grid workdirs (their claims
  judged as one Holm family); returns the markdown."""
  grids = [Grid.load(w) for w in ([workdirs] if isinstance(workdirs, str) else workdirs)]
  labels = [g.label for g in grids]
  if len(set(labels)) != len(labels):
    raise run_config.ConfigError(f"two workdirs of the same grid config ({labels}); give each "
                                 "grid once.")
  os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
  many = len(grids) > 1
  claims = [dataclasses.replace(c, name=f"{g.label}/{c.name}", statement=f"[{g.label}] "
                                f"{c.statement}") if many else c
            for g in grids for c in g.claims()]
  verdicts = stats.judge(claims)
  md = ["# Recipe ablation in the real training loop", ""]
  for g in grids:
    md += ([f"**[{g.label}]** configs/{g.label}.py."] if many else []) + g.header()
  md += ["Numbers in the settings tables are mean ± population std over seeds (description; the "
         "claims are tested paired, below). Twin KL: KL(run || BF16 twin of the same seed) per "
         "completion token on the held-out prompts, k3 estimate on the run's samples (start: the "
         "base under both precisions).", "",
         "## Claims", "",
         "Each claim is a paired difference (treatment - baseline on the same unit) with the sign "
         "the claim states; effect = its mean with the 95% confidence interval of a paired t-test; "
         "Holm p = the t-test's p adjusted over all the claims below (one family"
         + (f", the {len(grids)} grids' together" if many else "") + "); verdict at 0.05: "
         "**held** (significant, the stated sign), **contradicted** (significant, the other "
         "sign), **not resolved** (not significant: the design cannot tell).", "",
         stats.markdown_table(verdicts, digits=4), ""]
  notes = [f"- {v.claim.statement}: {v.claim.note}" for v in verdicts if v.claim.note]
  if notes:
    md += ["Also (not Holm-adjusted):", "", *notes, ""]
  md += where_tested(labels)
  for g in grids:
    if many:
      md += [f"# The {g.label} grid (configs/{g.label}.py)", ""]
    md += g.body(out_md, "" if g.label == "ablate" or not many else f"_{g.label}")
  with open(os.path.splitext(out_md)[0] + "_claims.json", "w") as f:
    json.dump([v.row() for v in verdicts], f, indent=1)
  text = "\n".join(md) + "\n"
  with open(out_md, "w") as f:
    f.write(text)
  return text


def main(argv):
  del argv
  with exits.one_line_exits():  # a missing or damaged results.jsonl: one line
    write_report(_WORKDIR.value, _OUT.value)
  print(f"[report] wrote {_OUT.value}")


if __name__ == "__main__":
  from absl import app, flags

  _WORKDIR = flags.DEFINE_multi_string(
      "workdir", None, "An experiments.ablate workdir; give it again for another grid (e.g. "
      "configs/ablate_regime.py's): one report, one Holm family.", required=True)
  _OUT = flags.DEFINE_string("out", os.path.join(_REPO, "docs", "results.md"),
                             "Markdown file to write (PNGs next to it).")
  app.run(main)
