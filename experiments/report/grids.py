"""One grid of the report: an experiments.ablate workdir's results, paired measurements and
meta, with its header and its sections; and where each claim of the experiment is tested."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from experiments import ablate, paired as paired_exp, regime
from experiments.report import (backward, claims, common, components, descriptive,
                                recipe_vs_bf16, sr_cast)
from lowrl import grid as lowrl_grid
from lowrl.analysis import stats
from lowrl.training import run_logs

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
  twin = common.twin(agg)
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


def run_times(results: list[dict[str, Any]]) -> str:
  """The runs' wall times (results' wall_s): median and middle half, each setting's first run
  (which compiles its programs) apart, and the longest. Wall time of this process only: the
  machine's load while it ran is not recorded here."""
  first, rest, seen = [], [], set()
  for r in results:
    (rest if r["setting"] in seen else first).append(r["wall_s"])
    seen.add(r["setting"])
  def quartiles(v):
    q = np.percentile(v, [25, 50, 75])
    return f"median {q[1]:.0f} s (middle half {q[0]:.0f}-{q[2]:.0f} s, n {len(v)})"
  out = f"Per run (wall s): each setting's first run (its programs compile) {quartiles(first)}"
  if rest:
    out += f"; the other runs {quartiles(rest)}"
  longest = max(results, key=lambda r: r["wall_s"])
  return out + (f"; the longest {longest['wall_s']:.0f} s ({longest['setting']} seed "
                f"{longest['seed']}).")


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
    return cls(workdir, grid_label(meta), meta, results, common.aggregate(results),
               paired_exp.read_results(workdir))

  def has_paired(self) -> bool:
    """Whether experiments.paired has written its results here."""
    return os.path.exists(os.path.join(self.workdir, paired_exp.RESULTS))

  def claims(self) -> list[stats.Claim]:
    return (claims.grid_claims(self.results, self.label)
            + claims.paired_claims(self.paired, self.label))

  def header(self) -> list[str]:
    w, meta, agg = self.workdir, self.meta, self.agg
    wall = sum(r["wall_s"] for r in self.results)
    quick = " --config.quick=True" if meta.get("quick") else ""
    config = "" if self.label == "ablate" else f" --config=configs/{self.label}.py"
    md = [f"Reproduce: `{meta.get('command', 'python -m experiments.ablate --workdir=W')}`, "
          f"`python -m experiments.paired --workdir={w}{config}{quick}` (paired measurements: "
          f"{'present' if self.has_paired() else 'not run'}"
          f"), then `python -m experiments.report --workdir={w}`.", "",
          f"{len(self.results)} runs ({len(agg)} settings x seeds {meta.get('seeds', '?')}"
          f"{_fewer_seeds(meta)}); wall time of the runs {wall / 60:.1f} min in all "
          f"({meta.get('machine', 'this machine')}). " + regime_line(w, agg), ""]
    if meta.get("quick"):
      md += ["**This is the quick grid** (`--config.quick=True`: 8 RL steps of 8 prompts x 4, "
             "16 held-out prompts): it checks that every part of the experiment runs; its "
             "numbers are too small and short to test the claims.", ""]
    md += [run_times(self.results), ""]
    missing = self.unfinished()
    if missing:
      md += ["**Not finished**: " + "; ".join(missing) + ". Claims on these settings use the "
             "seeds that ran.", ""]
    return md

  def unfinished(self) -> list[str]:
    """The grid's settings (grid.json) whose results lack some of their seeds: "<setting>: no
    results yet" or "<setting>: seeds [..] of [..]"."""
    seeds = self.meta.get("setting_seeds", {})
    out = []
    for name in self.meta.get("settings", []):
      want = list(seeds.get(name, self.meta.get("seeds", [])))
      have = sorted(r["seed"] for r in self.agg.get(name, {}).get("runs", []))
      if not have:
        out.append(f"{name}: no results yet")
      elif set(want) - set(have):
        out.append(f"{name}: seeds {have} of {want}")
    return out

  def not_run(self) -> list[str]:
    """The grid's settings (grid.json) with no results at all."""
    return [n for n in self.meta.get("settings", []) if not self.agg.get(n, {}).get("runs")]

  def body(self, out_md: str, suffix: str) -> list[str]:
    """The grid's sections after the claims; its PNGs are `<out stem><suffix>_*.png`."""
    stem = os.path.splitext(out_md)[0] + suffix
    md = sr_cast.section(self.results)
    md += components.ladder_section(self.paired.get("forward_ladder", {}))
    md += backward.sections(self.paired)
    md += recipe_vs_bf16.distance_table(self.paired.get("distance", []))
    md += descriptive.churn_section(self.workdir, self.agg)
    md += descriptive.regime_probe_section(regime.read_results(self.workdir))
    md += ["## All settings", "", descriptive.settings_table(self.agg), ""]
    return md + [f"![{p}]({p})" for p in descriptive.plots(self.workdir, self.agg, stem)] + [""]


def where_tested(labels: Sequence[str]) -> list[str]:
  """Where each claim of the experiment is tested, given the grids this report holds."""
  regime = REGIME in labels
  return [
      "## Where each claim is tested", "",
      "- **Forward components** (naive -> + per-token -> + 4/6 -> + BF16 tail): the static ladder, "
      "forward-only and paired by prompt (batch-clustered bootstrap), on each grid's base (the "
      "regime's with and without its outlier channels; `ladder_*`, primary), and the trajectory "
      "part paired by seed in the build-up of configs/ablate.py's grid (`trajectory_*`, "
      "exploratory).",
      "- **Backward modes**: identical batches and weights, at the base and mid-run (the "
      "first seed's nvfp4_recipe run at its kept checkpoint nearest half the run), paired by "
      "batch (`backward_*`, `backward_*_mid`), and the training probes' gradient cosine paired "
      "by seed (`backward_probe`).",
      "- **Stochastic rounding** (the seed's arm: FP32 master weights, the BF16 compute cast "
      "rounded to nearest or stochastically, FP16): configs/ablate.py's `sr` group at every lr "
      "of `lrs` (`cast_lag@*`, `cast_sr_closes_gap_*`). The master-weight rows (pure BF16 "
      "training) are described only: their erasure rates differ by construction.",
      "- **The recipe keeps BF16's dynamics** (primary, an equivalence: TOST with the margins "
      "registered in experiments/report/registry.py): the end held-out pass@1 in deployment "
      "precision, the pass@1 gain and the exact trajectory part of the distance to the BF16 twin, "
      "paired by seed (`recipe_equiv_*`); recipe vs naive NVFP4 is secondary (`recipe_vs_naive_"
      "outcome`, `trajectory_recipe_vs_naive`, `trajectory_growth_recipe_vs_naive`). The twin KL "
      "(k3) is described in the settings table only"
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
