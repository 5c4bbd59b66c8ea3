"""A resumable grid sweep of the asynchronous-RL simulator (the engine of experiments/simulate.py).

Config (configs/simulate.py): `sim` is one simulator setting (simulator.default_config()), `seeds`
the seeds every setting runs (one program per seed), `grid` one tuple of values per knob in GRID_KNOBS, and
optionally `phase_grid`, a second grid (the LR x lag x precision phase diagram) run after it.

Outputs under the workdir:
  runs/<setting>/seed_<s>/   TensorBoard: every per-step metric of that run, eval at the ends
  results.jsonl              one line per finished setting (knobs, fingerprint, summary numbers,
                             the modelled step time, wall clock and GPU-hours, reward curve)
  summary.md                 tables: final reward and drift parts per setting, time to reward,
                             phase diagram
  summary.png                reward and drift parts against the lag
  wall_clock.png             reward against simulated wall-clock hours and against GPU-hours
  phase.png                  final reward over LR x lag, one panel per precision x correction
A sweep that is interrupted and started again skips the settings results.jsonl already holds; a
setting whose config changed since (another fingerprint) is an error, not a silent mix (the
bookkeeping is lowrl.grid's, one job per setting keyed by its name).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from typing import Any, Callable

import ml_collections
import numpy as np

from lowrl import grid as lowrl_grid
from lowrl.asyncrl import simulator, timing
from lowrl.asyncrl.knobs import GRID_KNOBS, SHORT as _SHORT
from lowrl.asyncrl.summary import phase_table, summary_table, write_summary  # noqa: F401
from lowrl.rl.drift import DRIFT_PARTS
from lowrl.metrics.writer import MetricWriter
from lowrl.training import run_config

Log = Callable[[str], None]

# The config's grids: `grid` (the main table), any `<name>_grid` (more knob sweeps, e.g.
# sync_grid: the weight-sync interval), `phase_grid` (the LR x lag diagram).


def grids_of(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The grids a sweep config holds, in run order: `cfg.grids` when given, else `grid`, the
  other `*_grid`s by name, `phase_grid` last."""
  found = [k for k in cfg.keys() if k == "grid" or k.endswith("_grid")]
  if "grids" in cfg:
    if sorted(cfg.grids) != sorted(found):
      raise ValueError(f"config.grids={tuple(cfg.grids)} must list the config's grids "
                       f"{tuple(found)} once each.")
    return tuple(cfg.grids)
  return tuple(sorted(found, key=lambda k: (k != "grid", k == "phase_grid", k)))
CURVE_POINTS = 20  # reward-curve points kept per setting (means over seeds of equal chunks)
SUMMARY_TAIL = 0.1  # "final" = the mean over the last 10% of steps


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of the grid: knob values and the full simulator config they give."""

  knobs: dict[str, Any]
  cfg: ml_collections.ConfigDict
  seeds: tuple[int, ...]
  grids: tuple[str, ...] = ("grid",)  # the config's grids (grids_of) it belongs to
  # Knob values of a later grid that ran the same config under another name (not in `name`).
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    return "_".join(f"{_SHORT[k]}={v}" for k, v in self.knobs.items()) or "base"

  @property
  def fingerprint(self) -> str:
    return run_config.digest({"cfg": self.cfg.to_dict(), "seeds": self.seeds}, 12)


_get = run_config.get_path


def _set(cfg: ml_collections.ConfigDict, path: str, value: Any) -> None:
  run_config.set_path(cfg, path, value, ignore_type=True)  # async_rl.lag: an int or 'auto'


def _grid_settings(cfg: ml_collections.ConfigDict, which: str,
                   seeds: tuple[int, ...]) -> list[Setting]:
  grid = cfg[which]
  unknown = sorted(set(grid.keys()) - set(GRID_KNOBS))
  if unknown:
    raise ValueError(f"config.{which} has unknown knobs {unknown}; knobs are {list(GRID_KNOBS)}.")
  values = {}
  for knob in GRID_KNOBS:
    v = grid.get(knob)
    values[knob] = tuple(v) if isinstance(v, (tuple, list)) and v else None
    if knob in grid and values[knob] is None:
      raise ValueError(f"config.{which}.{knob} must be a non-empty tuple, got {v!r}.")
  knobs = [k for k in GRID_KNOBS if values[k] is not None]
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
    settings.append(Setting(point, sim, seeds, (which,)))
  return settings


def expand_grid(cfg: ml_collections.ConfigDict) -> list[Setting]:
  """Every setting of the config's grids (grids_of), validated (each is
  `simulator.build`-checked before any run). A config that several points (of one grid or two)
  give runs once, under its first name; the later points' knob values are kept as `extra`."""
  seeds = tuple(int(s) for s in cfg.seeds)
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"config.seeds={cfg.seeds!r} must be distinct ints, at least one.")
  settings, by_fingerprint = [], {}
  for which in grids_of(cfg):
    grid_settings = _grid_settings(cfg, which, seeds)
    if len({s.name for s in grid_settings}) != len(grid_settings):
      raise ValueError(f"config.{which} has repeated values; every setting must be distinct.")
    for s in grid_settings:
      first = by_fingerprint.get(s.fingerprint)
      if first is None:
        by_fingerprint[s.fingerprint] = s
        settings.append(s)
        continue
      i = settings.index(first)
      extra = {**first.extra, **{k: v for k, v in s.knobs.items() if k not in first.knobs}}
      grids = first.grids + tuple(g for g in s.grids if g not in first.grids)
      settings[i] = by_fingerprint[s.fingerprint] = dataclasses.replace(
          first, grids=grids, extra=extra)
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
  curve = metrics.get("eval/curve/reward")  # NaN between the eval steps
  out["finite"] = bool(all(np.isfinite(v).all() for k, v in metrics.items()
                           if k != "eval/curve/reward"))
  # Per seed (seed order of the run), for the paired analysis (lowrl.asyncrl.capacity).
  per_seed = {"eval_start": metrics["eval/start/reward"], "eval_end": metrics["eval/end/reward"],
              "reward_final": reward[:, -tail:].mean(1)}
  for part in DRIFT_PARTS:
    per_seed[f"{part}_k1"] = metrics[f"drift/{part}/mismatch_kl"].mean(1)
    per_seed[f"{part}_k3"] = metrics[f"drift/{part}/mismatch_kl_k3"].mean(1)
  out["per_seed"] = {k: [float(x) for x in v] for k, v in per_seed.items()}
  if curve is not None:  # the trainer policy's greedy eval: step 0 (start), eval steps, end
    at = np.flatnonzero(np.isfinite(curve[0]))
    out["eval_curve_steps"] = [0] + [int(t) + 1 for t in at]
    out["eval_curve"] = [[float(metrics["eval/start/reward"][i])]
                         + [float(x) for x in curve[i, at]] for i in range(curve.shape[0])]
    out["finite"] = out["finite"] and bool(np.isfinite(curve[:, at]).all())
  # The reward curve: means over seeds of CURVE_POINTS equal chunks of steps (the last point at
  # the last step), for the reward-against-time plots.
  chunks = np.array_split(np.arange(reward.shape[1]), min(CURVE_POINTS, reward.shape[1]))
  out["reward_curve"] = [float(reward[:, c].mean()) for c in chunks]
  out["curve_steps"] = [int(c[-1]) + 1 for c in chunks]
  return out


def write_tensorboard(run_dir: str, metrics: dict[str, np.ndarray], seeds: tuple[int, ...],
                      log_every: int = 1) -> None:
  """runs/<setting>/seed_<s>: per-step scalars at steps 1..N (step t = after t updates)."""
  per_step = {k: v for k, v in metrics.items() if v.ndim == 2 and k != "eval/curve/reward"}
  curve = metrics.get("eval/curve/reward")
  steps = next(iter(per_step.values())).shape[1]
  for i, seed in enumerate(seeds):
    with MetricWriter(os.path.join(run_dir, f"seed_{seed}")) as w:
      w.scalars(0, {f"eval/{k}": metrics[f"eval/start/{k}"][i] for k in ("reward", "exact")})
      for t in range(steps):
        if (t + 1) % log_every == 0 or t + 1 == steps:
          w.scalars(t + 1, {k: v[i, t] for k, v in per_step.items()})
        if curve is not None and np.isfinite(curve[i, t]):
          w.scalars(t + 1, {"eval/curve/reward": curve[i, t]})
      w.scalars(steps, {f"eval/{k}": metrics[f"eval/end/{k}"][i] for k in ("reward", "exact")})


def _jobs(settings: list[Setting]) -> list[lowrl_grid.Job]:
  # The line's key is the setting's name: {"name", "fingerprint", knobs..., numbers...}.
  return [lowrl_grid.Job.of({"name": s.name}, s.fingerprint, s) for s in settings]


def run_sweep(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> list[dict]:
  """Runs every unfinished setting (lowrl.grid: one results.jsonl line each), then writes the
  summary; returns the rows of all settings."""
  settings = expand_grid(cfg)
  # One ring size for the whole grid: settings differing in lag / sync share a compiled program.
  num_slots = max(simulator.schedule_of(s.cfg).max_versions for s in settings)

  def work(job: lowrl_grid.Job) -> dict[str, Any]:
    s = job.payload
    result = simulator.simulate(simulator.build(s.cfg), simulator.schedule_of(s.cfg), s.seeds,
                                num_slots=num_slots)
    run_dir = os.path.join(workdir, "runs", s.name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-written one from an interrupted sweep
    write_tensorboard(run_dir, result.metrics, s.seeds, cfg.get("log_every", 1))
    row = {**s.knobs, "seeds": list(s.seeds), "steps": s.cfg.rl.steps,
           "compile_s": round(result.compile_s, 2), "run_s": round(result.run_s, 2),
           "updates_per_min": round(result.updates_per_minute, 1),
           **summarize(result.metrics), **clock_row(s.cfg)}
    log(f"[sweep] {s.name}: reward {row['reward_final']:.3f} "
        f"eval {row['eval_start']:.3f}->{row['eval_end']:.3f} "
        f"drift k1 q={row['quantization_k1']:.2e} s={row['staleness_k1']:.2e} "
        f"total={row['total_k1']:.2e} ess {row['total_ess']:.3f} "
        f"E[w] {row['total_is_weight_mean']:.3f}±{row['total_is_weight_se']:.3f} | "
        f"compile {result.compile_s:.0f}s run {result.run_s:.0f}s "
        f"({result.updates_per_minute:,.0f} updates/min)")
    return row

  rows = lowrl_grid.run(_jobs(settings), os.path.join(workdir, "results.jsonl"), work, log=log,
                        tag="sweep")
  return _write_rows(settings, {r["name"]: r for r in rows}, workdir, log)


def _write_rows(settings: list[Setting], done: dict[str, dict], workdir: str, log: Log
                ) -> list[dict]:
  # Grid membership is the config's, not the results file's (a resumed row may predate it); a
  # knob another setting varies is filled in from this setting's config, for the tables.
  settings = [s for s in settings if s.name in done]
  varied = {k for s in settings for k in (*s.knobs, *s.extra)}
  rows = [{**{k: _get(s.cfg, GRID_KNOBS[k]) for k in varied}, **done[s.name], **s.extra,
           "grids": list(s.grids)} for s in settings]
  write_summary(rows, list(GRID_KNOBS), workdir, {s.name: s.cfg for s in settings})
  log(f"[sweep] summary of {len(rows)} settings -> {os.path.join(workdir, 'summary.md')} (+ "
      "summary.png, wall_clock.png, phase.png, reward_vs_drift.png, pareto.png)")
  return rows


def write_report(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> list[dict]:
  """The summary of the settings results.jsonl already holds (a sweep still running, or cut
  short), without running anything; rows from another config are an error as in run_sweep."""
  settings = expand_grid(cfg)
  done = lowrl_grid.finished(_jobs(settings), os.path.join(workdir, "results.jsonl"),
                             fix="pass the config the sweep ran with.")
  if not done:
    raise lowrl_grid.ResultsFileError(f"{workdir}/results.jsonl holds no setting of this config "
                                      "yet; run the sweep first (without --report_only).")
  return _write_rows(settings, {r["name"]: r for r in done.values()}, workdir, log)


def clock_row(cfg: ml_collections.ConfigDict) -> dict[str, float]:
  """The setting's modelled clock (lowrl.asyncrl.timing): the lag it ran at, seconds per step,
  the whole run's wall-clock hours and GPU-hours."""
  clock = timing.clock(cfg)
  lag = simulator.lag_of(cfg)
  steps = cfg.rl.steps
  return {"lag_used": lag, "model_lag": clock.lag, "step_s": clock.step_at(lag),
          "wall_clock_h": steps * clock.step_at(lag) / 3600.0,
          "gpu_hours": steps * clock.gpu_hours_at(lag)}
