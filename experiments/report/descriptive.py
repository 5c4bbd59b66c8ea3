"""The report's descriptive sections: no claim reads them. The settings table (mean ± std over
seeds), the code churn of each setting's quantized policy, experiments/regime.py's probe of the
regime (outlier channels, cost), and the PNG plots."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from experiments.report import common
from lowrl.training import run_logs


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


def churn_section(workdir: str, agg: dict) -> list[str]:
  """Per setting: the mean per-update fraction of changed codes / values / scales (mean ± std
  over seeds of each run's mean over its steps)."""
  rows = []
  for name, s in agg.items():
    per_run = [c for c in (churn_per_run(workdir, r) for r in s["runs"]) if c]
    if per_run:
      rows.append(f"| {name} | {len(per_run)} | " + " | ".join(
          common.fmt_described(common.describe([c.get(k) for c in per_run]), 4)
          for k, _ in CHURN) + " |")
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


def regime_probe_section(probe: dict[str, Any] | None) -> list[str]:
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


def plots(workdir: str, agg: dict, stem: str) -> list[str]:
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
      for n in members + ([common.twin(agg)] if group != "recipe" and common.twin(agg) else []):
        c = common.curves(workdir, agg, n, key)
        if c is not None:
          ax.plot(c[0], c[1], label=n)
          ax.fill_between(c[0], c[1] - c[2], c[1] + c[2], alpha=0.15)
      ax.set_title(f"{group}: {title}")
      ax.set_xlabel("step")
      if col == 0:
        ax.legend(fontsize=7)
  save(fig, "curves")
  return files


def settings_table(agg: dict) -> str:
  """Every setting's per-run numbers, mean ± population std over seeds."""
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
    cells = [str(s["n"]) if k is None
             else common.fmt_described(s[k], 4 if k == "grad_cos" else 3) for _, k in cols]
    lines.append(f"| {n} | {s['group']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
