"""The sweep's answer (summary.md sections and figures): reward against drift with the correction
capacity per correction, the interchangeability test, the settings judged by paired tests + Holm,
the bf16 fraction actually kept, and time to target / the quality-vs-GPU-hours Pareto per
precision x hardware (lowrl.asyncrl.capacity for the statistics, lowrl.asyncrl.timing for the
clocks).

Time to target: the trainer policy's greedy held-out eval along the run (`sim.eval_every`), per
seed the first eval step at or above a target, times the modelled step time of the setting at the
lag it ran, on each modelled chip (HARDWARES; the cost model's measured Hopper rates). Targets are
the base's start + TARGET_FRACTIONS of its RL gain. Mean over the seeds that reach it, bootstrap
95% interval over them, and how many reached.
"""
from __future__ import annotations

import collections
import math
import os
from typing import Sequence

import ml_collections
import numpy as np

from lowrl.analysis import stats
from lowrl.asyncrl import capacity as cap
from lowrl.asyncrl import timing
from lowrl.asyncrl.knobs import GRID_KNOBS, SHORT
from lowrl.training import run_config

HARDWARES = ("h100_sxm", "h200", "b200")
TARGET_FRACTIONS = (0.25, 0.5, 0.75)
PRECISION_COLORS = {"bf16": "tab:blue", "mxfp8": "tab:green", "nvfp4_naive": "tab:red",
                    "nvfp4_recipe": "tab:purple", "fp16": "tab:gray", "nvfp4_w4a16": "tab:orange"}
LAG_STYLES = ("-", "--", ":", "-.", (0, (1, 4)), (0, (5, 1)))
CORRECTION_MARKERS = {"none": "o", "tis": "s", "mis": "P", "icepop": "^", "vcpo": "D"}
# The capacity interval's coverage check (lowrl.asyncrl.capacity.coverage): simulated sweeps,
# bootstrap resamples in each, and the coverage a D* interval needs to be read as an estimand.
COVERAGE_TRIALS, COVERAGE_BOOT, COVERAGE_NEEDED = 200, 400, 0.90


def precision_label(r: dict) -> str:
  """'<sampler>' (trainer BF16) or '<sampler>=trainer'."""
  s, t = r.get("sampler_recipe", "bf16"), r.get("trainer_recipe", "bf16")
  return s if t == "bf16" or s == t == "bf16" else (f"{s}=trainer" if s == t else f"{s}/{t}")


# The knobs that set a setting's context (its own columns hold precision, correction and lag).
_CONTEXT_KNOBS = ("num_prompts", "group_size", "horizon", "sync_every", "lr", "schedule")


def context_labels(names: Sequence[str], cfgs: dict[str, ml_collections.ConfigDict]
                   ) -> dict[str, str]:
  """Per setting name, the knobs where its config leaves the most common value over `names`
  (e.g. 'np=4 g=16', 'sync=2', 'lr=0.003'); 'main' when none: the tables' rows are otherwise
  ambiguous."""
  values = {n: {k: run_config.get_path(cfgs[n], GRID_KNOBS[k]) for k in _CONTEXT_KNOBS}
            for n in names if n in cfgs}
  usual = {k: collections.Counter(v[k] for v in values.values()).most_common(1)[0][0]
           for k in _CONTEXT_KNOBS} if values else {}

  def label(v: dict) -> str:
    return " ".join(f"{SHORT[k]}={v[k]:g}" if isinstance(v[k], float) else f"{SHORT[k]}={v[k]}"
                    for k in _CONTEXT_KNOBS if v[k] != usual[k]) or "main"
  return {n: label(values[n]) if n in values else "–" for n in names}


def clocks(cfg: ml_collections.ConfigDict, lag: int) -> dict[str, tuple[float, float]]:
  """{hardware: (seconds per step, GPU-hours per step)} of a setting at `lag` (the lag it ran)."""
  out = {}
  for hw in HARDWARES:
    c = ml_collections.ConfigDict(cfg.to_dict())
    c.cost.hardware = hw
    clock = timing.clock(c)
    out[hw] = (clock.step_at(lag), clock.gpu_hours_at(lag))
  return out


def time_to_target(r: dict, targets: Sequence[float], step_s: float) -> list[float]:
  """Hours until each seed's eval curve first reaches its target (`targets` in the row's seed
  order; inf: never)."""
  steps = np.array(r["eval_curve_steps"])
  out = []
  for curve, target in zip(r["eval_curve"], targets):
    hit = np.flatnonzero(np.array(curve) >= target)
    out.append(float(steps[hit[0]]) * step_s / 3600 if hit.size else math.inf)
  return out


def _ci_text(values: Sequence[float], rng_seed: int) -> str:
  v = [x for x in values if math.isfinite(x)]
  if not v:
    return f"never (0/{len(values)})"
  if len(v) == 1:
    return f"{v[0]:.2f} (1/{len(values)})"
  b = stats.bootstrap_mean_ci(v, rng_seed=rng_seed, n_boot=2000)
  return f"{b.mean:.2f} [{b.ci_low:.2f}, {b.ci_high:.2f}] ({len(v)}/{len(values)})"


def _table(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
  return "\n".join(out) + "\n"


def capacity_sections(rows: list[dict], cfgs: dict[str, ml_collections.ConfigDict],
                      workdir: str) -> str:
  """The markdown of the answer (and its figures written under workdir)."""
  paired = cap.pair_with_base(rows)
  if not paired:
    return ("\n## Reward against drift\n\nNo BF16 lag-0 uncorrected base run with per-seed "
            "numbers.\n")
  corrections = sorted({p.row.get("correction", "none") for p in paired},
                       key=lambda c: list(CORRECTION_MARKERS).index(c)
                       if c in CORRECTION_MARKERS else 99)
  pool, _ = cap.fit_pool(paired)
  caps = {c: {k: cap.capacity(paired, c, kind=k, settings=pool[c]) for k in cap.FITS}
          for c in corrections if c in pool}
  gamma = cap.interchangeability(paired, "none")
  verdicts = {v.claim.name: v for v in cap.claims(paired, gamma)}
  sim_layers = {name: c.model.n_layers for name, c in cfgs.items()}
  base = paired[0].base
  g_base = float(np.mean(np.array(base["per_seed"]["eval_end"])
                         - np.array(base["per_seed"]["eval_start"])))
  text = ["\n## Reward against drift: the correction capacity (reward_vs_drift.png)\n",
          "" if g_base > 0 else "**The base run did not improve (RL gain <= 0): no retained "
          "fraction, no capacity.**\n",
          f"Quality = held-out greedy reward of the trained policy in the trainer's precision; "
          f"gain = its difference to the BF16 lag-0 uncorrected run of the same seed and context "
          f"(lr, batch, horizon; paired); retained = 1 + gain / G, G = that BF16 run's own RL "
          f"gain, start -> end ({g_base:.3f} in the main context; '–' where G's 95% CI reaches "
          "0). Drift = the run's mean k1 of the total and of its parts (lowrl.rl.drift). "
          "Verdicts: paired t over seeds of the gain, Holm-adjusted over the settings "
          "(lowrl.analysis.stats); "
          "✗ = significantly below BF16 lag 0. BF16 kept = the fraction of the simulated model's "
          "decoder layers a recipe leaves in BF16.\n"]
  lines = []
  context = context_labels([p.row["name"] for p in paired], cfgs)
  for p in paired:
    r = p.row
    recipe = timing.recipe_config(r.get("sampler_recipe", "bf16"), cfgs[r["name"]].recipe) \
        if r["name"] in cfgs else None
    kept = (cap.bf16_fraction_kept(recipe, sim_layers[r["name"]])
            if recipe is not None else float("nan"))
    v = verdicts.get(r["name"])
    mark = " ✗" if v is not None and v.verdict == "held" else ""
    lines.append([precision_label(r), r.get("correction", "none"), r["lag_used"],
                  context[r["name"]], f"{kept:.2f}", f"{np.mean(p.drift['quantization_k1']):.2e}",
                  f"{np.mean(p.drift['staleness_k1']):.2e}", f"{np.mean(p.drift['total_k1']):.2e}",
                  f"{np.mean(p.drift['total_k3']):.2e}",
                  f"{p.test.mean:+.3f} [{p.test.ci_low:+.3f}, {p.test.ci_high:+.3f}]"
                  if p.test.n > 1 else f"{p.test.mean:+.3f}",
                  f"{np.mean(p.retained):.2f}" if np.all(np.isfinite(p.retained)) else "–",
                  "–" if v is None else f"{stats.fmt_p(v.p_holm)}{mark}"])
  text.append(_table(["precision", "correction", "lag", "context", "BF16 kept", "quant k1",
                      "stale k1",
                      "total k1", "total k3", "gain [95% CI]", "retained", "Holm p"], lines))
  text.append("context: the knobs where a setting leaves the main grid's (np = prompts, g = "
              "group size, h = horizon, sync = weight-sync interval, lr); each context has its own "
              "BF16 lag-0 base.\n")
  text.append(_capacity_section(pool, caps))
  text.append(_format_section(cap.format_rows(paired)))
  text.append("\n### Do quantization and staleness drift cost alike at equal total drift?\n")
  if gamma is None:
    text.append("Not testable on this grid: fewer than 4 uncorrected settings with drift, or "
                "their quantization shares do not spread (>= 0.2).\n")
  else:
    v = verdicts["interchangeable"]
    text.append(f"Uncorrected settings, per seed retained = segmented fit in log10(total k1) + "
                f"gamma x quant share: "
                f"gamma (the share's coefficient) = {gamma.mean:+.3f} [{gamma.ci_low:+.3f}, "
                f"{gamma.ci_high:+.3f}] over {gamma.n} seeds, p {stats.fmt_p(gamma.p)} (the "
                "report's primary hypothesis, a family of its own: lowrl.asyncrl.capacity "
                f"`claims`): **{v.verdict}** for the claim that quantization drift costs more "
                "(gamma < 0; gamma > 0: staleness drift costs more at the same total k1, "
                "'contradicted'; 'not resolved' = no difference detectable at this many "
                "seeds). Only settings whose context's BF16 run resolvably learns enter the fit "
                "(retained is a ratio to that gain).\n")
  text.append(_time_sections(rows, cfgs, base, g_base))
  _drift_figure(pool, caps, os.path.join(workdir, "reward_vs_drift.png"))
  _pareto_figure(rows, cfgs, os.path.join(workdir, "pareto.png"))
  return "\n".join(text)


def _ci(r: stats.PairedResult, sign: bool = False) -> str:
  f = "+.3f" if sign else ".3f"
  if r.n < 2:
    return format(r.mean, f)
  return f"{r.mean:{f}} [{r.ci_low:{f}}, {r.ci_high:{f}}]"


def _capacity_section(pool: dict, caps: dict) -> str:
  """The capacity per correction on the shared settings, both fits, their residuals, the
  interval's simulated coverage, and the paired retained-gain table."""
  text = [f"\n### Correction capacity: total k1 where retained falls to "
          f"{cap.RETAINED_AT_CAPACITY}\n"]
  if not pool:
    return text[0] + "\nNo BF16 lag-0 base with a resolved gain: no capacity.\n"
  n_seeds = len(next(iter(pool.values()))[0].gain)
  shared = sorted({cap._situation_label(p.row) for ps in pool.values() for p in ps[1:]})
  text.append(
      f"Every correction on the same {len(shared)} drifted settings ({', '.join(shared)}; "
      "BF16 trainer, main context), with the BF16 lag-0 run as the zero-drift anchor; corrected "
      "runs with zero drift by construction and runs trained in the format are not in the "
      f"fits. {n_seeds} seeds. Two fits of retained against log10 total k1 pooled over seeds: "
      "the hinge (flat, then linear) and the decreasing isotonic fit (assumes only that more "
      "drift does not help). RSS = residual sum of squares; CV = leave-one-seed-out mean "
      "squared prediction error (the fit that predicts a held-out seed better describes the "
      "data); misfit = settings whose mean residual's 95% t interval over seeds excludes 0. "
      "D* interval: 95% percentile bootstrap over seeds; coverage = how often that interval "
      f"holds the true D* when data are drawn from the fit with each setting's seed spread "
      f"({n_seeds} seeds, {COVERAGE_TRIALS} simulated sweeps; ± its SE).\n")
  lines, covered = [], {}
  for c, by_kind in caps.items():
    for kind, k in by_kind.items():
      if k is None:
        lines.append([c, kind, "–", "too few settings", "–", "–", "–", "–", "–"])
        continue
      cov = cap.coverage(pool[c], kind, trials=COVERAGE_TRIALS, n_boot=COVERAGE_BOOT)
      covered[(c, kind)] = cov is not None and cov[0] >= COVERAGE_NEEDED
      if kind == "hinge":
        a, b, knee = k.fit[:3]
        shape = f"plateau {a:.2f}, knee {10 ** knee:.2g}, slope {-b:.2f}/decade"
      else:
        shape = f"{len(set(np.round(k.fit[1], 12)))} levels"
      lines.append([c, kind, k.n_settings - 1, k.text(),
                    "censored: none" if cov is None else f"{cov[0]:.2f} ± {cov[1]:.2f}",
                    f"{k.rss:.3f}", f"{k.cv_mse:.4f}", f"{k.misfit}/{len(k.residuals)}", shape])
  text.append(_table(["correction", "fit", "settings", "D* [95% CI]", "coverage", "RSS", "CV",
                      "misfit", "shape"], lines))
  ok = [c for c in caps if covered.get((c, "hinge")) and covered.get((c, "isotonic"))]
  text.append(
      f"\nA D* is read as an estimand only where both fits' intervals cover at least "
      f"{COVERAGE_NEEDED:.0%} in simulation: {', '.join(ok) if ok else 'none'}. "
      + ("" if len(ok) == len(caps) else
         "Where it does not, the capacity is not reported as a number and the corrections "
         "are compared by the paired retained-gain table below.") + "\n")
  resid = []
  for c, by_kind in caps.items():
    k = by_kind.get("hinge")
    if k is not None:
      resid += [[c, name, _ci(r, sign=True)] for name, r in k.residuals]
  text.append("\n**Hinge residuals per setting** (retained - fit, mean over seeds [95% t "
              "interval]):\n\n" + _table(["correction", "setting", "residual"], resid))
  text.append("\n**Paired retained-gain table** (shared settings; retained mean over seeds "
              "[95% t interval]; difference to the uncorrected run of the same setting, paired "
              "by seed; 'mean over the shared settings' = per seed the mean over the settings, "
              "then t over seeds):\n")
  text.append(_table(["setting", "correction", "retained", "vs none (paired)"],
                     [[s, c, _ci(r), "–" if d is None else _ci(d, sign=True)]
                      for s, c, r, d in cap.retained_table(pool)]))
  return "\n".join(text)


def _format_section(rows) -> str:
  """Runs trained in the format, their own rows: what the format costs apart from drift."""
  if not rows:
    return ""
  lines = [[precision_label(p.row), p.row.get("correction", "none"), p.row["lag_used"],
            f"{np.mean(p.drift['total_k1']):.2e}", _ci(p.test, sign=True),
            _ci(stats.paired_t(p.retained)) if np.all(np.isfinite(p.retained)) else "–"]
           for p in rows]
  return ("\n### Trained in the format (own rows, not in the capacity fits)\n\nSampler = "
          "trainer in the format: at lag 0 the drift is only the sampler's static scales' (0 "
          "for row-scaled recipes), so the gap to BF16 there is the format's own cost.\n\n"
          + _table(["precision", "correction", "lag", "total k1", "gain vs BF16 lag 0 [95% CI]",
                    "retained [95% CI]"], lines))


def _time_sections(rows, cfgs, base, g_base) -> str:
  # Per seed: the base's start on that seed + a fraction of the base's mean RL gain.
  start = dict(zip(base["seeds"], base["per_seed"]["eval_start"]))
  timed = [r for r in rows if "eval_curve" in r and r["name"] in cfgs
           and all(s in start for s in r["seeds"])]
  if not timed:
    return ""
  text = [f"\n## Time to target on the trainer policy's greedy eval (pareto.png)\n",
          "Targets per seed: the base's start on that seed + "
          + ", ".join(f"{f:.0%}" for f in TARGET_FRACTIONS)
          + f" of its mean RL gain ({g_base:.3f}). Hours of the modelled "
          "system (lowrl.asyncrl.timing at the lag the setting ran; measured Hopper matmul "
          "rates, B200 datasheet) until the eval curve first reaches the target: mean over the "
          "seeds that reach it [bootstrap 95%] (seeds reaching). GPU-h: the whole run.\n"]
  context = context_labels([r["name"] for r in timed], cfgs)
  for hw in HARDWARES:
    lines = []
    for i, r in enumerate(timed):
      step_s, gpu_h = clocks(cfgs[r["name"]], r["lag_used"])[hw]
      cells = [precision_label(r), r.get("correction", "none"), r["lag_used"], context[r["name"]],
               f"{step_s:.2f}"]
      cells += [_ci_text(time_to_target(r, [start[s] + f * g_base for s in r["seeds"]],
                                        step_s), rng_seed=i) for f in TARGET_FRACTIONS]
      cells.append(f"{gpu_h * r['steps']:.1f}")
      lines.append(cells)
    text.append(f"\n**{hw}**\n")
    text.append(_table(["precision", "correction", "lag", "context", "step s"]
                       + [f"h to +{f:.0%}" for f in TARGET_FRACTIONS] + ["GPU-h"], lines))
  return "\n".join(text)


def _plt():
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def _lag_style(lag: int, lags: list[int]):
  return LAG_STYLES[lags.index(lag) % len(LAG_STYLES)]


def _drift_figure(pool, caps, path: str) -> None:
  """One panel per correction: retained vs total k1 (log), colour = precision, filled marker =
  the quantization part dominates, hollow = staleness; on the shared settings (`fit_pool`): the
  hinge fit (solid) with D* and its interval, the isotonic fit (dotted)."""
  plt = _plt()
  corrections = list(caps) or ["none"]  # no fit pool: one empty panel that says so
  fig, axes = plt.subplots(1, len(corrections), figsize=(4.2 * len(corrections), 4.2),
                           sharey=True, squeeze=False)
  for ax, c in zip(axes[0], corrections):
    ps = pool.get(c, [])
    if not ps:
      ax.text(0.5, 0.5, "no shared drifted settings\nwith a resolved BF16 gain",
              ha="center", va="center", transform=ax.transAxes)
    for p in ps:
      x = max(float(np.mean(p.drift["total_k1"])), cap.DRIFT_FLOOR)
      y, e = float(np.mean(p.retained)), float(np.std(p.retained))
      color = PRECISION_COLORS.get(p.row.get("sampler_recipe", "bf16"), "k")
      quant = float(np.mean(p.quant_share)) > 0.5
      ax.errorbar([x], [y], yerr=[e], fmt="o", ms=7, color=color,
                  mfc=color if quant else "white", capsize=2)
      ax.annotate(str(p.row["lag_used"]), (x, y), textcoords="offset points", xytext=(5, 4),
                  fontsize=7)
    k = caps.get(c, {}).get("hinge")
    iso = caps.get(c, {}).get("isotonic")
    if iso is not None:
      ax.plot(10 ** iso.fit[0], iso.fit[1], color="k", ls=":", lw=1)
    if k is not None:
      xs = np.linspace(math.log10(cap.DRIFT_FLOOR), k.max_log_drift, 200)
      a, b, knee = k.fit[:3]
      ax.plot(10 ** xs, a - b * np.maximum(xs - knee, 0), color="k", lw=1)
      if k.min_log_drift <= k.log_d <= k.max_log_drift:
        ax.axvline(10 ** k.log_d, color="k", ls="--", lw=1)
        lo, hi = (10 ** min(max(v, xs[0]), k.max_log_drift) for v in k.ci)
        ax.axvspan(lo, hi, color="k", alpha=0.08)
      ax.set_title(f"{c}: capacity {k.text()}", fontsize=9)
    else:
      ax.set_title(c, fontsize=9)
    ax.axhline(cap.RETAINED_AT_CAPACITY, color="gray", ls=":", lw=1)
    ax.axhline(0, color="gray", lw=0.5)
    if ps:
      ax.set_xscale("log")
    ax.set_xlabel("total drift k1 (mean over the run)")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("fraction of BF16's RL gain retained (greedy, paired by seed)")
  handles = [plt.Line2D([], [], marker="o", ls="", color=col, label=name)
             for name, col in PRECISION_COLORS.items()
             if any(p.row.get("sampler_recipe", "bf16") == name
                    for ps in pool.values() for p in ps)]
  handles += [plt.Line2D([], [], marker="o", ls="", color="k", label="quantization part > half"),
              plt.Line2D([], [], marker="o", ls="", color="k", mfc="white",
                         label="staleness part >= half (numbers: lag)")]
  axes[0][-1].legend(handles=handles, fontsize=7, loc="lower left")
  fig.suptitle("Reward against drift: where each correction's capacity ends", fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _pareto_figure(rows, cfgs, path: str) -> None:
  """Per hardware: the trainer policy's eval curve against GPU-hours (colour = precision, line
  style = lag, uncorrected runs), and every setting's final quality with the Pareto front."""
  plt = _plt()
  timed = [r for r in rows if "eval_curve" in r and r["name"] in cfgs]
  if not timed:
    return
  lags = sorted({r["lag_used"] for r in timed})
  fig, axes = plt.subplots(2, len(HARDWARES), figsize=(5 * len(HARDWARES), 8.5), squeeze=False)
  for j, hw in enumerate(HARDWARES):
    pts = []
    for r in timed:
      step_s, gpu_h = clocks(cfgs[r["name"]], r["lag_used"])[hw]
      color = PRECISION_COLORS.get(r.get("sampler_recipe", "bf16"), "k")
      quality = float(np.mean(r["per_seed"]["eval_end"]))
      pts.append((gpu_h * r["steps"], quality))
      if r.get("correction", "none") == "none":
        curve = np.mean(np.array(r["eval_curve"]), axis=0)
        axes[0][j].plot(np.array(r["eval_curve_steps"]) * gpu_h, curve, color=color,
                        ls=_lag_style(r["lag_used"], lags), lw=1.3)
      axes[1][j].scatter([gpu_h * r["steps"]], [quality], color=color,
                         marker=CORRECTION_MARKERS.get(r.get("correction", "none"), "o"), s=30)
    front, best = [], -math.inf
    for x, y in sorted(pts):
      if y > best:
        front.append((x, y))
        best = y
    axes[1][j].step(*zip(*front), where="post", color="k", lw=0.8)
    axes[0][j].set_title(f"{hw}: greedy eval (uncorrected runs)", fontsize=9)
    axes[1][j].set_title(f"{hw}: final quality vs GPU-hours, Pareto front", fontsize=9)
    for ax in axes[:, j]:
      ax.set_xlabel("GPU-hours (modelled system)")
      ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out greedy reward (trainer policy)")
  axes[1][0].set_ylabel("held-out greedy reward at the end")
  precisions = sorted({r.get("sampler_recipe", "bf16") for r in timed})
  handles = [plt.Line2D([], [], color=PRECISION_COLORS.get(p, "k"), label=p) for p in precisions]
  handles += [plt.Line2D([], [], color="k", ls=_lag_style(l, lags), label=f"lag {l}")
              for l in lags]
  axes[0][-1].legend(handles=handles, fontsize=7)
  corr = sorted({r.get("correction", "none") for r in timed})
  axes[1][-1].legend(handles=[plt.Line2D([], [], marker=CORRECTION_MARKERS.get(c, "o"), ls="",
                                         color="k", label=c) for c in corr], fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
