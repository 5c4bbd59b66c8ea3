"""The sweep's summary.md tables and plots (lowrl.asyncrl.sweep writes them at the end of a sweep):
the settings and drift-part tables, time to reward on the sampled reward, the phase diagram
(cells judged by paired tests + Holm, lowrl.asyncrl.capacity), and the answer's sections and
figures (lowrl.asyncrl.report).
"""
from __future__ import annotations

import os
from typing import Any

import ml_collections
import numpy as np

from lowrl.asyncrl import capacity as cap
from lowrl.asyncrl import report
from lowrl.rl.drift import DRIFT_PARTS


_COLUMNS = (("reward_final", "final reward"), ("eval_end", "greedy eval (end)"),
            ("quantization_k1", "quant k1"), ("staleness_k1", "stale k1"),
            ("total_k1", "total k1"), ("total_k3", "total k3"), ("total_max", "total max|Δ|"),
            ("total_ess", "ESS"), ("total_is_weight_mean", "E[w]"),
            ("truncated_frac", "TIS trunc."), ("lag_used", "lag run"),
            ("wall_clock_h", "wall clock h"), ("gpu_hours", "GPU-h"))
_DRIFT_COLUMNS = tuple((f"{p}_{m}", f"{p[:5]}. {m}") for p in DRIFT_PARTS
                       for m in ("k1", "k3", "ess")) + (("total_is_weight_mean", "E[w]"),)
# A phase-diagram cell is marked when its held-out greedy reward at the end is below the BF16
# lag-0 uncorrected run of the same lr, paired by seed, at Holm-adjusted p < 0.05 over the table.
DEGRADED = ("greedy eval end below BF16 lag 0 (same lr), paired t over seeds, Holm p < 0.05 over "
            "the table's cells")


def degraded(rows: list[dict]) -> dict[str, tuple[float, bool]]:
  """{setting name: (Holm p, marked)} of the rows that have a base (DEGRADED)."""
  return {v.claim.name: (v.p_holm, v.verdict == "held")
          for v in cap.claims(cap.pair_with_base(rows), None)}


def _fmt(x: Any) -> str:
  if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
    return str(x)
  return f"{x:.3f}" if abs(x) >= 1e-2 or x == 0 else f"{x:.1e}"


def _varying(rows: list[dict], knobs: list[str]) -> list[str]:
  return [k for k in knobs if len({str(r.get(k)) for r in rows}) > 1]


def summary_table(rows: list[dict], knobs: list[str],
                  columns: tuple[tuple[str, str], ...] = _COLUMNS) -> str:
  """Markdown: one row per setting, a column per varying knob, then the summary numbers."""
  varying = _varying(rows, knobs)
  fixed = {k: rows[0][k] for k in knobs if rows and k in rows[0] and k not in varying}
  lines = []
  if rows:
    lines.append(f"{len(rows[0]['seeds'])} seeds x {rows[0]['steps']} updates per setting; "
                 "mean over seeds (± std over seeds); drift columns are means over all steps. "
                 + (f"Fixed: {', '.join(f'{k}={v}' for k, v in fixed.items())}." if fixed else ""))
    lines.append("")
  head = varying + [title for _, title in columns]
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "---|" * len(head))
  for r in rows:
    cells = [str(r.get(k)) for k in varying]
    for key, _ in columns:
      cell = _fmt(r[key])
      if key + "_std" in r:
        cell += f" ± {r[key + '_std']:.3f}"
      cells.append(cell)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _first_reach(r: dict, target: float) -> float | None:
  """Fraction of the run (steps) at which the reward curve first reaches `target`, or None."""
  for reward, step in zip(r["reward_curve"], r["curve_steps"]):
    if reward >= target:
      return step / r["steps"]
  return None


def time_to_reward_table(rows: list[dict], knobs: list[str]) -> str:
  """Markdown: per setting, simulated wall-clock hours and GPU-hours until its reward curve first
  reaches 90% of the best final reward of the sweep, fastest first."""
  target = 0.9 * max(r["reward_final"] for r in rows)
  varying = _varying(rows, knobs)
  timed = []
  for r in rows:
    frac = _first_reach(r, target)
    timed.append((float("inf") if frac is None else frac * r["wall_clock_h"], frac, r))
  lines = [f"Target reward {target:.3f} (90% of the best final reward); modelled system per "
           "setting (lowrl.asyncrl.timing).", "",
           "| " + " | ".join(varying + ["step s", "hours to target", "GPU-h to target"]) + " |",
           "|" + "---|" * (len(varying) + 3)]
  for hours, frac, r in sorted(timed, key=lambda x: x[0]):
    cells = [str(r.get(k)) for k in varying] + [f"{r['step_s']:.2f}"]
    cells += ["never", "never"] if frac is None else [f"{hours:.2f}",
                                                       f"{frac * r['gpu_hours']:.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _phase_panels(rows: list[dict]) -> dict[str, list[dict]]:
  panels: dict[str, list[dict]] = {}
  for r in rows:
    label = (f"sampler {r.get('sampler_recipe', '-')}, trainer {r.get('trainer_recipe', '-')}, "
             f"{r.get('correction', '-')}")
    panels.setdefault(label, []).append(r)
  return panels


def phase_table(rows: list[dict]) -> str:
  """Markdown: held-out greedy reward at the end ± std over seeds per (precision x correction,
  lr) row and lag column, with its Holm p; ✗ marks a significant loss (DEGRADED)."""
  lags = sorted({r["lag_used"] for r in rows})
  marks = degraded(rows)
  lines = [f"Greedy held-out reward of the trained policy at the end (Holm p); ✗ = {DEGRADED}.",
           "",
           "| setting | lr | " + " | ".join(f"lag {l}" for l in lags) + " |",
           "|" + "---|" * (2 + len(lags))]
  for label, rs in _phase_panels(rows).items():
    for lr in sorted({r["lr"] for r in rs}):
      cells = []
      for lag in lags:
        hit = [r for r in rs if r["lr"] == lr and r["lag_used"] == lag]
        if not hit:
          cells.append("")
          continue
        r = hit[0]
        p, marked = marks.get(r["name"], (float("nan"), False))
        p_text = "" if np.isnan(p) else f" (p {p:.2g})"
        cells.append(f"{r['eval_end']:.3f} ± {r['eval_end_std']:.3f}{p_text}"
                     + (" ✗" if marked else ""))
      lines.append(f"| {label} | {lr:g} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def write_summary(rows: list[dict], knobs: list[str], workdir: str,
                  cfgs: dict[str, ml_collections.ConfigDict] | None = None) -> None:
  """summary.md (tables), summary.png (reward and drift parts against the lag), wall_clock.png
  (reward against simulated hours and GPU-hours), phase.png (when a phase grid ran), and the
  answer's sections with reward_vs_drift.png and pareto.png (`cfgs`: setting name -> config)."""
  main = [r for r in rows if r.get("grids", ("grid",)) != ["phase_grid"]]
  phase = [r for r in rows if "phase_grid" in r.get("grids", ())]
  text = ["# Asynchronous-RL simulator sweep\n", summary_table(main, knobs),
          "\n## Drift parts (order-symmetric; lowrl.rl.drift)\n",
          "k1 parts add up to the total; each part's k3 and ESS are under the distribution it "
          "refers to (importance-weighted from the sampler's tokens).\n",
          summary_table(main, knobs, _DRIFT_COLUMNS),
          "\n## Time to reward (reward_vs_wall_clock: wall_clock.png)\n",
          time_to_reward_table(main, knobs)]
  if phase:
    text += ["\n## Phase diagram: LR x lag x precision (phase.png)\n", phase_table(phase)]
  text.append(report.capacity_sections(rows, cfgs or {}, workdir))
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write("\n".join(text))
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  others = [k for k in _varying(main, knobs) if k != "lag"]
  series: dict[str, list[dict]] = {}
  for r in main:
    label = ", ".join(f"{r.get(k)}" for k in others) or "all"
    series.setdefault(label, []).append(r)
  panels = (("reward_final", "final sampled reward"), ("eval_end", "greedy eval reward (end)"),
            ("quantization_k1", "quantization drift k1"), ("staleness_k1", "staleness drift k1"),
            ("total_k1", "total drift k1"), ("total_ess", "total ESS"))
  fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
  for ax, (key, title) in zip(axes.flat, panels):
    for label, rs in series.items():
      rs = sorted(rs, key=lambda r: r["lag_used"])
      x = [r["lag_used"] for r in rs]
      y = np.array([r[key] for r in rs])
      ax.plot(x, y, marker="o", label=label)
      if key + "_std" in rs[0]:
        std = np.array([r[key + "_std"] for r in rs])
        ax.fill_between(x, y - std, y + std, alpha=0.15)
    ax.set_title(title)
    ax.set_xlabel("off-policy lag (trainer steps)")
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=8, title=", ".join(others) or None)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "summary.png"), dpi=110)
  plt.close(fig)

  # Colour = precision, line style = lag, one panel per correction (GPU-hours: pareto.png).
  corrections = sorted({r.get("correction", "none") for r in main})
  lags = sorted({r["lag_used"] for r in main})
  fig, axes = plt.subplots(1, len(corrections), figsize=(5 * len(corrections), 4.5),
                           sharey=True, squeeze=False)
  for ax, corr in zip(axes[0], corrections):
    for r in main:
      if r.get("correction", "none") != corr:
        continue
      frac = np.array(r["curve_steps"]) / r["steps"]
      ax.plot(frac * r["wall_clock_h"], r["reward_curve"], lw=1.2,
              color=report.PRECISION_COLORS.get(r.get("sampler_recipe", "bf16"), "k"),
              ls=report.LAG_STYLES[lags.index(r["lag_used"]) % len(report.LAG_STYLES)],
              label=f"{report.precision_label(r)}, lag {r['lag_used']}")
    ax.set_title(f"correction {corr}", fontsize=9)
    ax.set_xlabel("simulated wall-clock hours (cost.hardware)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel("sampled reward")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "wall_clock.png"), dpi=110)
  plt.close(fig)

  if phase:
    groups = _phase_panels(phase)
    lags = sorted({r["lag_used"] for r in phase})
    lrs = sorted({r["lr"] for r in phase})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (label, rs) in zip(axes[0], groups.items()):
      grid = np.full((len(lrs), len(lags)), np.nan)
      for r in rs:
        grid[lrs.index(r["lr"]), lags.index(r["lag_used"])] = r["eval_end"]
      im = ax.imshow(grid, origin="lower", aspect="auto", vmin=0, vmax=1, cmap="viridis")
      marks = degraded(phase)
      for r in rs:
        if marks.get(r["name"], (0, False))[1]:
          ax.text(lags.index(r["lag_used"]), lrs.index(r["lr"]), "✗", ha="center",
                  va="center", color="red")
      ax.set_xticks(range(len(lags)), [str(l) for l in lags])
      ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
      ax.set_xlabel("lag")
      ax.set_ylabel("lr")
      ax.set_title(label, fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="greedy held-out reward at the end")
    fig.savefig(os.path.join(workdir, "phase.png"), dpi=110)
    plt.close(fig)
