"""What every section of the ablation's report shares: per-run values of a results line, the
settings' descriptive statistics over seeds, and the seed-paired claim.

A results line is one (setting, seed) run of experiments/ablate.py; settings of one seed share the
base, prompts, held-out set and sampling keys, so claims pair by seed (lowrl.analysis.stats).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from experiments import paired as paired_exp
from lowrl.analysis import stats
from lowrl.training import run_logs

# The 4-bitter recipe built up one component at a time (configs/ablate.py's recipe group).
BUILD_UP = ("nvfp4_naive", "+per_token", "+4/6", "+bf16_tail", "nvfp4_recipe")
LADDER = paired_exp.LADDER

Value = Callable[[dict[str, Any]], float | None]


def describe(values: list[float | None]) -> tuple[float, float, int] | None:
  """(mean, population std, n) of the non-None values; None when there are none."""
  v = [x for x in values if x is not None]
  return (float(np.mean(v)), float(np.std(v)), len(v)) if v else None


def fmt_described(s: tuple[float, float, int] | None, digits: int = 3) -> str:
  """"mean ± std" of `describe`'s triple (the mean alone for one value, "–" for none)."""
  if s is None:
    return "–"
  m, sd, n = s
  fmt = (lambda x: f"{x:.{digits}f}") if max(abs(m), sd) >= 10**-digits or m == 0 else (
      lambda x: f"{x:.1e}")
  return f"{fmt(m)} ± {fmt(sd)}" if n > 1 else fmt(m)


def mean_ci(r: stats.PairedResult) -> str:
  """"mean [95% CI]" of a paired t result, 4 digits."""
  return f"{stats.fmt_num(r.mean, 4)} [{stats.fmt_num(r.ci_low, 4)}, {stats.fmt_num(r.ci_high, 4)}]"


def get(*path: str) -> Value:
  """A per-run number of a results line by its path (None when absent)."""
  def value(r):
    for p in path:
      if not isinstance(r, dict) or r.get(p) is None:
        return None
      r = r[p]
    return float(r)
  return value


def gain(r: dict[str, Any]) -> float:
  """The run's held-out pass@1 gain: end - start (both in the run's trainer precision)."""
  return r["eval_end"]["pass_at_1"] - r["eval_start"]["pass_at_1"]


def pass_k_max(when: str) -> Value:
  """pass@k at the largest k the line holds."""
  def value(r):
    d = r.get(f"pass_at_k_{when}")
    return float(d[max(d, key=int)]) if d else None
  return value


def per_seed(results, setting: str, value: Value) -> dict[Any, float]:
  """{seed: value} of one setting's lines."""
  return stats.by_unit(results, value).get(setting, {})


def seed_claim(results, name: str, statement: str, treatment: str, baseline: str,
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
        s[f"{k}_{when}"] = describe([r[f"eval_{when}"][k] for r in runs])
    s["gain"] = describe([gain(r) for r in runs])
    for when in ("start", "end"):
      s[f"pass_k_{when}"] = describe([pass_k_max(when)(r) for r in runs])
    ks = [max(r[f"pass_at_k_end"], key=int) for r in runs if r.get("pass_at_k_end")]
    s["k"] = ks[0] if ks else None
    for k in ("final_reward", "mismatch_kl", "mismatch_kl_k3", "ess", "kl_ref", "grad_cos",
              "grad_rel_err", "update_erasure", "twin_kl_start", "twin_kl_end",
              "twin_kl_k3_start", "twin_kl_k3_end"):
      s[k] = describe([r.get(k) for r in runs])
  return out


def twin(agg: dict) -> str | None:
  """The grid's twin setting (experiments.ablate.settings puts it first)."""
  return next(iter(agg), None)


def curves(workdir: str, agg: dict, setting: str, key: str) -> tuple[np.ndarray, np.ndarray,
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
