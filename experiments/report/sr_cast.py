"""The seed's stochastic-rounding question (configs/ablate.py's `sr` group): at a learning rate
where BF16 compute with the round-to-nearest weight cast lags FP16, does rounding that cast
stochastically close the gap?"""
from __future__ import annotations

from typing import Any

import numpy as np

from experiments.report import common
from lowrl.analysis import stats


def lrs(results: list[dict[str, Any]], *arms: str) -> list[str]:
  """The lr tags ("2e-5") at which every one of `arms` ran ("<arm>@<lr>"), highest lr first."""
  tags = [{r["setting"].split("@")[1] for r in results if r["setting"].startswith(f"{a}@")}
          for a in arms]
  return sorted(set.intersection(*tags), key=lambda t: -float(t)) if tags else []


# The seed's stochastic-rounding arm (configs/ablate.py): FP32 master weights with the BF16
# compute cast rounded to nearest, the same cast rounded stochastically, FP16 compute.
CAST_RTN, CAST_SR, CAST_FP16 = "fp32_master", "bf16_sr_cast", "fp16"
REF_KL = common.get("ref_kl_k3_end")
# The outcomes of the arm: held-out pass@1 gain, KL(final policy || the reference, the base).
CAST_OUTCOMES = (("gain", "held-out pass@1 gain", common.gain),
                 ("ref_kl", "KL(final policy ‖ reference) on held-out prompts (k3)", REF_KL))


def lag_lr(results: list[dict[str, Any]]) -> tuple[str | None, dict[str, float]]:
  """The learning rate where the BF16 cast lags FP16, found from the data: the lowest lr of the
  arm's lrs whose paired mean (FP16 - BF16 RTN cast) held-out pass@1 gain is positive (None if
  none is); and that mean at every lr."""
  lags = {}
  for lr in lrs(results, CAST_RTN, CAST_SR, CAST_FP16):
    try:
      _, d = stats.paired_diffs(common.per_seed(results, f"{CAST_FP16}@{lr}", common.gain),
                                common.per_seed(results, f"{CAST_RTN}@{lr}", common.gain))
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
    c = common.seed_claim(results, f"cast_lag@{lr}", f"At lr {lr}, BF16 compute with the "
                          "round-to-nearest weight cast gains less held-out pass@1 than FP16 "
                          "compute", f"{CAST_FP16}@{lr}", f"{CAST_RTN}@{lr}", common.gain, +1,
                          "pass@1 gain")
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
    arms = {a: common.per_seed(results, f"{a}@{lr_star}", value)
            for a in (CAST_RTN, CAST_SR, CAST_FP16)}
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


def section(results: list[dict[str, Any]]) -> list[str]:
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
    cell = lambda a, v: common.fmt_described(  # noqa: E731
        common.describe([v(r) for r in runs[a]]), 4)
    md.append(f"| {lr} | {', '.join(map(str, sorted(steps, key=str)))} | "
              + " | ".join(cell(a, common.gain) for a in arms)
              + f" | {stats.fmt_num(lags[lr], 4)} | "
              + " | ".join(cell(a, REF_KL) for a in arms) + " |")
  return md + ["", "steps: rl.steps of the lr's runs ('run' = the grid's run.rl.steps).", ""]
