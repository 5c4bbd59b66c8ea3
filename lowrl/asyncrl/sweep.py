"""A resumable grid sweep of the asynchronous-RL simulator (the engine of experiments/simulate.py).

Config (configs/simulate.py): `sim` is one simulator setting (simulator.default_config()), `seeds`
the seeds every setting runs (vmapped), `grid` one tuple of values per knob in GRID_KNOBS.

Outputs under the workdir:
  runs/<setting>/seed_<s>/   TensorBoard: every per-step metric of that run, eval at the ends
  results.jsonl              one line per finished setting (knobs, fingerprint, summary numbers)
  summary.md, summary.png    the table and plots of final reward and mean drift parts per setting
A sweep that is interrupted and started again skips the settings results.jsonl already holds; a
setting whose config changed since (another fingerprint) is an error, not a silent mix.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from lowrl.asyncrl import simulator
from lowrl.rl.drift import DRIFT_PARTS
from lowrl.metrics.writer import MetricWriter

Log = Callable[[str], None]

# Grid knob -> the simulator config field it sets. Settings iterate with the first knobs
# outermost: lag and sync interval last, since they only change the (runtime) ring plan and so
# share one compiled program.
GRID_KNOBS = {
    "sampler_recipe": "sampler_recipe",
    "trainer_recipe": "trainer_recipe",  # "same" = the sampler's recipe
    "correction": "rl.correction",
    "num_prompts": "rl.num_prompts",
    "group_size": "rl.group_size",
    "horizon": "task.length",
    "lag_distribution": "async_rl.lag_distribution",
    "sync_every": "async_rl.sync_every",
    "lag": "async_rl.lag",
}
_SHORT = {"sampler_recipe": "s", "trainer_recipe": "t", "correction": "corr", "num_prompts": "np",
          "group_size": "g", "horizon": "h", "lag_distribution": "dist", "sync_every": "sync",
          "lag": "lag"}
SUMMARY_TAIL = 0.1  # "final" = the mean over the last 10% of steps


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of the grid: knob values and the full simulator config they give."""

  knobs: dict[str, Any]
  cfg: ml_collections.ConfigDict
  seeds: tuple[int, ...]

  @property
  def name(self) -> str:
    return "_".join(f"{_SHORT[k]}={v}" for k, v in self.knobs.items()) or "base"

  @property
  def fingerprint(self) -> str:
    blob = json.dumps({"cfg": self.cfg.to_dict(), "seeds": self.seeds}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _set(cfg: ml_collections.ConfigDict, path: str, value: Any) -> None:
  *parents, leaf = path.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  node[leaf] = value


def expand_grid(cfg: ml_collections.ConfigDict) -> list[Setting]:
  """Every setting of the grid, validated (each is `simulator.build`-checked before any run)."""
  unknown = sorted(set(cfg.grid.keys()) - set(GRID_KNOBS))
  if unknown:
    raise ValueError(f"config.grid has unknown knobs {unknown}; knobs are {list(GRID_KNOBS)}.")
  values = {}
  for knob in GRID_KNOBS:
    v = cfg.grid.get(knob)
    values[knob] = tuple(v) if isinstance(v, (tuple, list)) and v else None
    if knob in cfg.grid and values[knob] is None:
      raise ValueError(f"config.grid.{knob} must be a non-empty tuple, got {v!r}.")
  knobs = [k for k in GRID_KNOBS if values[k] is not None]
  seeds = tuple(int(s) for s in cfg.seeds)
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"config.seeds={cfg.seeds!r} must be distinct ints, at least one.")
  settings = []
  for combo in itertools.product(*(values[k] for k in knobs)):
    point = dict(zip(knobs, combo))
    sim = ml_collections.ConfigDict(cfg.sim.to_dict())
    for k, v in point.items():
      if k == "trainer_recipe" and v == "same":
        v = point.get("sampler_recipe", sim.sampler_recipe)
      _set(sim, GRID_KNOBS[k], v)
    simulator.build(sim)  # config errors surface before the first run
    simulator.schedule_of(sim)
    settings.append(Setting(point, sim, seeds))
  names = [s.name for s in settings]
  if len(set(names)) != len(names):
    raise ValueError("config.grid has repeated values; every setting must be distinct.")
  return settings


def summarize(metrics: dict[str, np.ndarray], tail_frac: float = SUMMARY_TAIL) -> dict[str, float]:
  """Final reward (mean of the last `tail_frac` of steps), greedy eval, mean drift parts.

  Every number is the mean over seeds; `*_std` the std over seeds of the per-seed value.
  """
  reward = metrics["reward/mean"]  # [S, steps]
  tail = max(1, int(round(reward.shape[1] * tail_frac)))
  out = {}

  def put(name, per_seed):
    out[name] = float(np.mean(per_seed))
    out[name + "_std"] = float(np.std(per_seed))

  put("reward_final", reward[:, -tail:].mean(1))
  out["reward_mean"] = float(reward.mean())
  out["exact_final"] = float(metrics["reward/exact"][:, -tail:].mean())
  for when in ("start", "end"):
    put(f"eval_{when}", metrics[f"eval/{when}/reward"])
    out[f"eval_{when}_exact"] = float(metrics[f"eval/{when}/exact"].mean())
  for part in DRIFT_PARTS:
    out[f"{part}_k1"] = float(metrics[f"drift/{part}/mismatch_kl"].mean())
    out[f"{part}_k3"] = float(metrics[f"drift/{part}/mismatch_kl_k3"].mean())
    out[f"{part}_max"] = float(metrics[f"drift/{part}/abs_dlogp_max"].mean())
    out[f"{part}_ess"] = float(metrics[f"drift/{part}/ess"].mean())
  # Mean importance weight pi_now / pi_sampler over every sampled token of the run (1 in
  # expectation at temperature 1, see lowrl.rl.drift) and its standard error: the weights
  # minus 1 are martingale differences (mean 0 given everything sampled before), hence
  # uncorrelated, so the variance of their sum is the sum of the per-step variances std^2 * n.
  w_mean, w_std = metrics["drift/total/is_weight_mean"], metrics["drift/total/is_weight_std"]
  n = metrics["drift/tokens"]
  out["total_is_weight_mean"] = float(np.sum(w_mean * n) / np.sum(n))
  out["total_is_weight_se"] = float(np.sqrt(np.sum(np.square(w_std) * n)) / np.sum(n))
  out["lag_mean"] = float(metrics["sampler_version_lag"].mean())
  out["truncated_frac"] = float(metrics["correction/is_truncated_frac"].mean())
  out["skipped_updates"] = float(metrics["skipped_updates"].sum())
  out["finite"] = bool(all(np.isfinite(v).all() for v in metrics.values()))
  return out


def write_tensorboard(run_dir: str, metrics: dict[str, np.ndarray], seeds: tuple[int, ...],
                      log_every: int = 1) -> None:
  """runs/<setting>/seed_<s>: per-step scalars at steps 1..N (step t = after t updates)."""
  per_step = {k: v for k, v in metrics.items() if v.ndim == 2}
  steps = next(iter(per_step.values())).shape[1]
  for i, seed in enumerate(seeds):
    with MetricWriter(os.path.join(run_dir, f"seed_{seed}")) as w:
      w.scalars(0, {f"eval/{k}": metrics[f"eval/start/{k}"][i] for k in ("reward", "exact")})
      for t in range(steps):
        if (t + 1) % log_every == 0 or t + 1 == steps:
          w.scalars(t + 1, {k: v[i, t] for k, v in per_step.items()})
      w.scalars(steps, {f"eval/{k}": metrics[f"eval/end/{k}"][i] for k in ("reward", "exact")})


def _read_results(path: str) -> dict[str, dict]:
  if not os.path.exists(path):
    return {}
  done = {}
  with open(path) as f:
    for line in f:
      if line.endswith("\n"):  # a line cut short by an interruption is not a finished setting
        row = json.loads(line)
        done[row["name"]] = row
  return done


def run_sweep(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> list[dict]:
  """Runs every unfinished setting, then writes the summary; returns the rows of all settings."""
  settings = expand_grid(cfg)
  os.makedirs(workdir, exist_ok=True)
  results_path = os.path.join(workdir, "results.jsonl")
  done = _read_results(results_path)
  # Rewrite the file from its complete lines, so an interrupted write leaves no partial line.
  with open(results_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in done.values())
  for s in settings:
    if s.name in done and done[s.name]["fingerprint"] != s.fingerprint:
      raise ValueError(f"{results_path} holds setting {s.name} from another config (fingerprint "
                       f"{done[s.name]['fingerprint']} != {s.fingerprint}); use a new --workdir "
                       "or delete that file to start the sweep afresh.")
  todo = [s for s in settings if s.name not in done]
  log(f"[sweep] {len(settings)} settings x {len(settings[0].seeds)} seeds, "
      f"{len(settings) - len(todo)} already done, {len(todo)} to run -> {workdir}")
  # One ring size for the whole grid: settings differing in lag / sync share a compiled program.
  num_slots = max(simulator.schedule_of(s.cfg).max_versions for s in settings)
  t_start = time.time()
  for i, s in enumerate(todo):
    result = simulator.simulate(simulator.build(s.cfg), simulator.schedule_of(s.cfg), s.seeds,
                                num_slots=num_slots)
    run_dir = os.path.join(workdir, "runs", s.name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-written one from an interrupted sweep
    write_tensorboard(run_dir, result.metrics, s.seeds, cfg.get("log_every", 1))
    row = {"name": s.name, "fingerprint": s.fingerprint, **s.knobs, "seeds": list(s.seeds),
           "steps": s.cfg.rl.steps, "compile_s": round(result.compile_s, 2),
           "run_s": round(result.run_s, 2),
           "updates_per_min": round(result.updates_per_minute, 1),
           **summarize(result.metrics)}
    with open(results_path, "a") as f:
      f.write(json.dumps(row) + "\n")
    done[s.name] = row
    elapsed = time.time() - t_start
    eta = elapsed / (i + 1) * (len(todo) - i - 1)
    log(f"[sweep] {i + 1}/{len(todo)} {s.name}: reward {row['reward_final']:.3f} "
        f"eval {row['eval_start']:.3f}->{row['eval_end']:.3f} "
        f"drift k1 q={row['quantization_k1']:.2e} s={row['staleness_k1']:.2e} "
        f"total={row['total_k1']:.2e} ess {row['total_ess']:.3f} "
        f"E[w] {row['total_is_weight_mean']:.3f}±{row['total_is_weight_se']:.3f} | "
        f"compile {result.compile_s:.0f}s run {result.run_s:.0f}s "
        f"({result.updates_per_minute:,.0f} updates/min) elapsed {elapsed:.0f}s eta {eta:.0f}s")
  rows = [done[s.name] for s in settings]
  write_summary(rows, list(GRID_KNOBS), workdir)
  log(f"[sweep] summary -> {os.path.join(workdir, 'summary.md')}, "
      f"{os.path.join(workdir, 'summary.png')}")
  return rows


# ----------------------------------------------------------------------------------------------
# Summary table and plot.

_COLUMNS = (("reward_final", "final reward"), ("eval_end", "greedy eval (end)"),
            ("quantization_k1", "quant k1"), ("staleness_k1", "stale k1"),
            ("total_k1", "total k1"), ("total_k3", "total k3"), ("total_max", "total max|Δ|"),
            ("total_ess", "ESS"), ("total_is_weight_mean", "E[w]"),
            ("truncated_frac", "TIS trunc."))


def _fmt(x: float) -> str:
  return f"{x:.3f}" if abs(x) >= 1e-2 or x == 0 else f"{x:.1e}"


def summary_table(rows: list[dict], knobs: list[str]) -> str:
  """Markdown: one row per setting, a column per varying knob, then the summary numbers."""
  varying = [k for k in knobs if len({r.get(k) for r in rows}) > 1]
  fixed = {k: rows[0][k] for k in knobs if rows and k in rows[0] and k not in varying}
  lines = []
  if rows:
    lines.append(f"{len(rows[0]['seeds'])} seeds x {rows[0]['steps']} updates per setting; "
                 "mean over seeds (± std over seeds); drift columns are means over all steps. "
                 + (f"Fixed: {', '.join(f'{k}={v}' for k, v in fixed.items())}." if fixed else ""))
    lines.append("")
  head = varying + [title for _, title in _COLUMNS]
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "---|" * len(head))
  for r in rows:
    cells = [str(r[k]) for k in varying]
    for key, _ in _COLUMNS:
      cell = _fmt(r[key])
      if key + "_std" in r:
        cell += f" ± {r[key + '_std']:.3f}"
      cells.append(cell)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def write_summary(rows: list[dict], knobs: list[str], workdir: str) -> None:
  """summary.md (the table) and summary.png (reward and drift parts against the lag)."""
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write("# Asynchronous-RL simulator sweep\n\n" + summary_table(rows, knobs))
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  others = [k for k in knobs if k != "lag" and len({r.get(k) for r in rows}) > 1]
  series: dict[str, list[dict]] = {}
  for r in rows:
    label = ", ".join(f"{r[k]}" for k in others) or "all"
    series.setdefault(label, []).append(r)
  panels = (("reward_final", "final sampled reward"), ("eval_end", "greedy eval reward (end)"),
            ("quantization_k1", "quantization drift k1"), ("staleness_k1", "staleness drift k1"),
            ("total_k1", "total drift k1"), ("total_ess", "total ESS"))
  fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
  for ax, (key, title) in zip(axes.flat, panels):
    for label, rs in series.items():
      rs = sorted(rs, key=lambda r: r["lag"])
      x = [r["lag"] for r in rs]
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
