"""Reward against drift: the correction capacity of a sweep, judged by paired tests over seeds.

Per setting of a sweep (results rows of lowrl.asyncrl.sweep, with their `per_seed` numbers):

  gain_s      = greedy_end_s(setting) - greedy_end_s(base), paired by seed s, where base is the
                BF16 / BF16, lag 0, uncorrected run of the same context (lr, batch, horizon):
                the trained policy's held-out greedy reward in the trainer's precision;
  retained_s  = 1 + gain_s / G, G = mean_s(greedy_end_s(base) - greedy_start_s(base)), the
                fraction of BF16's RL improvement the setting keeps (1 = all of it, 0 = none);
                undefined (left out of the fits) in a context where G's paired 95% CI over
                seeds reaches 0: there BF16 itself does not resolvably learn;
  drift_s     = the run's mean k1 (and k3) of the total, quantization and staleness parts.

The correction capacity of a correction is the total drift D* at which retained falls to
RETAINED_AT_CAPACITY (half of BF16's gain). What a capacity may be fitted on (`fit_pool`):
  - every correction on the SAME settings: the drifted situations (sampler, lag, sync, context)
    that every correction of the sweep ran, so a ranking is a property of the corrections, not of
    which contexts each happened to be swept in;
  - no zero-drift copies: a corrected run with sampler = trainer at lag 0, sync 1 has drift 0 by
    construction (every weight 1), so it is the base again, not a measurement of the correction;
  - no runs trained in the format (trainer recipe != BF16): what they lose at zero drift is the
    format's cost, not drift's; they are their own rows (`format_rows`).
Two fits of retained against log10 total k1, pooled over seeds, each with the base as the
zero-drift anchor: the segmented (hinge) fit, flat up to a knee c then linear with slope -b,
D* = 10^(c + (a - 1/2)/b); and the decreasing isotonic fit (pool adjacent violators), which
assumes only that more drift does not help, D* where its interpolated curve reaches 1/2. Their
per-setting residuals (mean over seeds, t interval) show whether a fit describes the data, and
leave-one-seed-out prediction error compares them. Intervals: percentile bootstrap over seeds
(whole seeds resampled, every setting of a seed together); `coverage` checks by simulation, at
the sweep's seed count, how often that interval holds a known D* (data drawn from the fitted
curve with each setting's seed spread); a capacity whose interval does not cover is not an
estimand (the report then gives the paired retained-gain table, `retained_table`).
A D* beyond the largest measured drift is reported as censored (> that drift).

Interchangeability: per seed, retained = a - b max(log10 total k1 - c, 0) + gamma share (the
segmented fit with the quantization part's fraction of the total k1 as a covariate); gamma_s = 0
iff quantization and staleness drift cost alike at equal total drift. The claim is judged by
paired_t over seeds, Holm-adjusted with the per-setting claims (lowrl.analysis.stats).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from lowrl.analysis import stats

RETAINED_AT_CAPACITY = 0.5
DRIFT_FLOOR = 1e-5  # k1 below this (BF16 at lag 0: exactly 0) is drawn and fitted at the floor
CONTEXT_KNOBS = ("lr", "num_prompts", "group_size", "horizon", "schedule")
N_BOOT = 2000


def _is_base(r: dict) -> bool:
  return (r.get("sampler_recipe", "bf16") == "bf16" and _trainer(r) == "bf16"
          and r["lag_used"] == 0 and r.get("correction", "none") == "none"
          and r.get("sync_every", 1) == 1)


def _trainer(r: dict) -> str:
  """The row's trainer recipe ("same" resolved to the sampler's)."""
  t = r.get("trainer_recipe", "bf16")
  return r.get("sampler_recipe", "bf16") if t == "same" else t


def is_zero_drift_copy(r: dict) -> bool:
  """A corrected run whose drift is 0 by construction (sampler = trainer, lag 0, sync every
  step): every importance weight is 1, so it is its uncorrected run again."""
  return (r.get("correction", "none") != "none" and _trainer(r) == r.get("sampler_recipe", "bf16")
          and r["lag_used"] == 0 and r.get("sync_every", 1) == 1)


def in_format(r: dict) -> bool:
  """Trained in a format other than BF16 (its zero-drift loss is the format's, not drift's)."""
  return _trainer(r) != "bf16"


def _context(r: dict) -> tuple:
  return tuple(r.get(k) for k in CONTEXT_KNOBS)


@dataclasses.dataclass(frozen=True)
class Paired:
  """One setting against its base, per seed (the base's seed order)."""

  row: dict
  base: dict
  gain: np.ndarray  # [S] greedy end - base greedy end
  retained: np.ndarray  # [S]
  drift: dict[str, np.ndarray]  # "<part>_k1|k3" -> [S]
  test: stats.PairedResult  # paired_t of gain

  @property
  def quant_share(self) -> np.ndarray:
    total = np.maximum(self.drift["quantization_k1"] + self.drift["staleness_k1"], 1e-30)
    return np.clip(self.drift["quantization_k1"] / total, 0.0, 1.0)


def pair_with_base(rows: Sequence[dict]) -> list[Paired]:
  """Every row with per-seed numbers paired by seed with its context's base (rows without a base
  are left out; the base itself is included, gain 0)."""
  bases = {_context(r): r for r in rows if _is_base(r) and "per_seed" in r}
  out = []
  for r in rows:
    base = bases.get(_context(r))
    if base is None or "per_seed" not in r:
      continue
    seeds = [s for s in base["seeds"] if s in r["seeds"]]
    if not seeds:
      continue
    ib = [base["seeds"].index(s) for s in seeds]
    ir = [r["seeds"].index(s) for s in seeds]
    ps, pb = r["per_seed"], base["per_seed"]
    gain = np.array(ps["eval_end"])[ir] - np.array(pb["eval_end"])[ib]
    base_gain = stats.paired_t(np.array(pb["eval_end"]) - np.array(pb["eval_start"]))
    # retained is a ratio to G: where BF16's own gain is not resolved above 0 (its 95% CI
    # reaches 0, e.g. a 4 x 4 batch or an lr that diverges) the ratio is noise over noise, so
    # that context's settings are left out of the capacity fit (their gain is still reported).
    g_base = base_gain.mean
    retained = (1.0 + gain / g_base if base_gain.ci_low > 0
                else np.full(gain.shape, np.nan))
    drift = {k: np.array(v)[ir] for k, v in ps.items() if k.endswith(("_k1", "_k3"))}
    out.append(Paired(r, base, gain, retained, drift, stats.paired_t(gain)))
  return out


# ----------------------------------------------------------------------------------------------
# The segmented fit and the capacity.


def segmented_fit(x: np.ndarray, y: np.ndarray, z: np.ndarray | None = None
                  ) -> tuple[float, ...]:
  """Least squares y = a - b max(x - c, 0) [+ gamma z] (b >= 0): (a, b, c[, gamma]), the knee c
  tried at every distinct x but the largest (the flat part alone, b = 0, c = max x, when no knee
  does better). `z`: a covariate (the quantization share), fitted jointly."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  extra = [] if z is None else [np.asarray(z, float)]

  def solve(h):
    design = np.stack([np.ones_like(x), -h, *extra], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return coef, float(np.sum((y - design @ coef) ** 2))

  flat, best_sse = solve(np.zeros_like(x))
  best = (float(flat[0]), 0.0, float(np.max(x)), *map(float, flat[2:]))
  for c in np.unique(x)[:-1]:
    coef, sse = solve(np.maximum(x - c, 0.0))
    if coef[1] >= 0 and sse < best_sse - 1e-12:
      best, best_sse = (float(coef[0]), float(coef[1]), float(c), *map(float, coef[2:])), sse
  return best


def crossing(fit: tuple[float, ...], level: float) -> float:
  """log10 drift where the fitted curve (z = 0) falls to `level` (inf if it never does)."""
  a, b, c = fit[:3]
  if a <= level:
    return -math.inf
  if b <= 0:
    return math.inf
  return c + (a - level) / b


def isotonic_decreasing(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The least-squares non-increasing fit of y on x (pool adjacent violators; ties in x pooled
  first): (the distinct x ascending, the fitted value at each)."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  xs, inv = np.unique(x, return_inverse=True)
  sums, counts = np.bincount(inv, y), np.bincount(inv).astype(float)
  blocks = []  # [sum, count, number of distinct x]
  for sm, n in zip(sums, counts):
    blocks.append([sm, n, 1])
    while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
      b = blocks.pop()
      blocks[-1] = [blocks[-1][0] + b[0], blocks[-1][1] + b[1], blocks[-1][2] + b[2]]
  fitted = np.concatenate([np.full(k, sm / n) for sm, n, k in blocks])
  return xs, fitted


def isotonic_crossing(xs: np.ndarray, fitted: np.ndarray, level: float) -> float:
  """log10 drift where the isotonic curve, linear between its points, first falls to `level`
  (-inf if it starts at or below it, +inf if it never reaches it)."""
  if fitted[0] <= level:
    return -math.inf
  below = np.flatnonzero(fitted <= level)
  if not below.size:
    return math.inf
  i = int(below[0])
  x0, x1, y0, y1 = xs[i - 1], xs[i], fitted[i - 1], fitted[i]
  return float(x0 + (y0 - level) * (x1 - x0) / (y0 - y1))


def _predict(kind: str, fit, x: np.ndarray) -> np.ndarray:
  if kind == "hinge":
    a, b, c = fit[:3]
    return a - b * np.maximum(x - c, 0.0)
  xs, fitted = fit
  return np.interp(x, xs, fitted)


def _fit(kind: str, x: np.ndarray, y: np.ndarray):
  return segmented_fit(x, y) if kind == "hinge" else isotonic_decreasing(x, y)


def _crossing(kind: str, fit, level: float) -> float:
  return crossing(fit, level) if kind == "hinge" else isotonic_crossing(*fit, level)


FITS = ("hinge", "isotonic")


@dataclasses.dataclass(frozen=True)
class Capacity:
  """The correction capacity of one correction under one fit ("hinge" or "isotonic"): D* (total
  k1) with its bootstrap interval, and how well the fit describes the data."""

  correction: str
  n_settings: int
  fit: Any  # hinge: (a, b, c); isotonic: (distinct x, fitted values)
  log_d: float  # log10 D*; +inf = not reached within the measured drifts
  ci: tuple[float, float]  # log10, percentile bootstrap over seeds
  max_log_drift: float
  min_log_drift: float  # the smallest measured drift above the floor (the base sits at it)
  kind: str = "hinge"
  rss: float = math.nan  # residual sum of squares over the pooled points
  cv_mse: float = math.nan  # leave-one-seed-out mean squared prediction error
  # Per setting ("<sampler> lag <lag>"): the fit's residual, mean over seeds with its t interval.
  residuals: tuple[tuple[str, stats.PairedResult], ...] = ()

  def text(self) -> str:
    """D* [CI] as total k1; censored where the crossing lies outside the measured drifts (below
    the smallest one it is an interpolation from the base's floor, not a measurement)."""
    def d(v):
      if v > self.max_log_drift:
        return f"> {10 ** self.max_log_drift:.2g}"
      if v < self.min_log_drift:
        return f"< {10 ** self.min_log_drift:.2g}"
      return f"{10 ** v:.2g}"
    return f"{d(self.log_d)} [{d(self.ci[0])}, {d(self.ci[1])}]"

  @property
  def misfit(self) -> int:
    """Settings whose mean residual's 95% t interval excludes 0 (the fit misses them)."""
    return sum(1 for _, r in self.residuals if r.ci_low > 0 or r.ci_high < 0)


def _points(paired: Sequence[Paired], seed_idx: Sequence[int]):
  x, y = [], []
  for p in paired:
    for i in seed_idx:
      x.append(math.log10(max(float(p.drift["total_k1"][i]), DRIFT_FLOOR)))
      y.append(float(p.retained[i]))
  return np.array(x), np.array(y)


def _situation(r: dict) -> tuple:
  """What a correction is applied to: the drift source and the context, not the correction."""
  return (r.get("sampler_recipe", "bf16"), _trainer(r), r["lag_used"], r.get("sync_every", 1),
          _context(r))


def fit_pool(paired: Sequence[Paired]) -> tuple[dict[str, list[Paired]], list[Paired]]:
  """({correction: its settings for the capacity fits, the base first}, the base) on the
  situations every correction ran (drifted, BF16 trainer, a resolved retained; the base of the
  main context as the zero-drift anchor). Empty when there is no such base."""
  bases = [p for p in paired if _is_base(p.row) and np.all(np.isfinite(p.retained))]
  if not bases:
    return {}, []
  base = bases[0]
  usable = [p for p in paired if not _is_base(p.row) and not is_zero_drift_copy(p.row)
            and not in_format(p.row) and np.all(np.isfinite(p.retained))
            and _context(p.row) == _context(base.row)]
  by_corr: dict[str, dict[tuple, Paired]] = {}
  for p in usable:
    by_corr.setdefault(p.row.get("correction", "none"), {})[_situation(p.row)] = p
  if not by_corr:
    return {}, [base]
  shared = set.intersection(*(set(v) for v in by_corr.values()))
  order = sorted(shared, key=repr)
  return {c: [base] + [v[k] for k in order] for c, v in by_corr.items()}, [base]


def format_rows(paired: Sequence[Paired]) -> list[Paired]:
  """The runs trained in a format (trainer recipe != BF16), their own rows."""
  return [p for p in paired if in_format(p.row) and not is_zero_drift_copy(p.row)]


def _residuals(kind: str, fit, ps: Sequence[Paired], n_seeds: int):
  out = []
  for p in ps[1:]:  # the base's retained is 1 by definition
    x, y = _points([p], range(n_seeds))
    out.append((_situation_label(p.row), stats.paired_t(y - _predict(kind, fit, x))))
  return tuple(out)


def _cv_mse(kind: str, ps: Sequence[Paired], n_seeds: int) -> float:
  if n_seeds < 2:
    return math.nan
  errs = []
  for i in range(n_seeds):
    fit = _fit(kind, *_points(ps, [j for j in range(n_seeds) if j != i]))
    x, y = _points(ps, [i])
    errs.append(np.mean((y - _predict(kind, fit, x)) ** 2))
  return float(np.mean(errs))


def _boot_interval(kind: str, ps: Sequence[Paired], n_seeds: int, level: float,
                   rng: np.random.Generator, n_boot: int) -> tuple[float, float]:
  boots = []
  for _ in range(n_boot):
    boots.append(_crossing(kind, _fit(kind, *_points(ps, rng.integers(0, n_seeds, n_seeds))),
                           level))
  # Order statistics, not interpolated quantiles: crossings may be +-inf (censored resamples).
  boots = np.sort(np.array(boots))
  return float(boots[int(0.025 * n_boot)]), float(boots[int(math.ceil(0.975 * n_boot)) - 1])


def capacity(paired: Sequence[Paired], correction: str, *, rng_seed: int = 0,
             level: float = RETAINED_AT_CAPACITY, kind: str = "hinge",
             settings: Sequence[Paired] | None = None, n_boot: int = N_BOOT) -> Capacity | None:
  """The capacity of `correction` under fit `kind`, or None with fewer than 3 settings.
  `settings`: the base first, then the correction's settings (`fit_pool`); default: the
  correction's rows with a resolved retained and the base (no shared-settings restriction)."""
  if kind not in FITS:
    raise ValueError(f"capacity: kind={kind!r}, use one of {FITS}")
  if settings is None:
    ps = [p for p in paired if p.row.get("correction", "none") == correction or _is_base(p.row)]
    ps = sorted((p for p in ps if np.all(np.isfinite(p.retained))),
                key=lambda p: not _is_base(p.row))
  else:
    ps = list(settings)
  if len(ps) < 3:
    return None
  n_seeds = len(ps[0].gain)
  x, y = _points(ps, range(n_seeds))
  fit = _fit(kind, x, y)
  rng = np.random.default_rng(rng_seed)
  lo, hi = _boot_interval(kind, ps, n_seeds, level, rng, n_boot)
  above = x[x > math.log10(DRIFT_FLOOR)]
  return Capacity(correction, len(ps), fit, _crossing(kind, fit, level), (lo, hi),
                  float(np.max(x)), float(np.min(above)) if above.size else float(np.max(x)),
                  kind=kind, rss=float(np.sum((y - _predict(kind, fit, x)) ** 2)),
                  cv_mse=_cv_mse(kind, ps, n_seeds),
                  residuals=_residuals(kind, fit, ps, n_seeds))


def coverage(settings: Sequence[Paired], kind: str = "hinge", *, trials: int = 200,
             n_boot: int = 400, rng_seed: int = 0,
             level: float = RETAINED_AT_CAPACITY) -> tuple[float, float, float] | None:
  """How often the percentile-bootstrap interval of D* holds the true D*, by simulation at the
  settings' seed count: each setting at its mean drift, retained = the pooled fit's curve + a
  normal draw with that setting's seed spread (the base stays at 1), refitted and bootstrapped.
  (coverage, its binomial SE, the true log10 D*); None when the fit's D* is censored (no true
  value inside the measured drifts to cover)."""
  ps = list(settings)
  n = len(ps[0].gain)
  x_all, y_all = _points(ps, range(n))
  fit = _fit(kind, x_all, y_all)
  truth = _crossing(kind, fit, level)
  xs = np.array([math.log10(max(float(np.mean(p.drift["total_k1"])), DRIFT_FLOOR)) for p in ps])
  if not (xs[1:].min() <= truth <= xs.max()):
    return None
  mu = _predict(kind, fit, xs)
  mu[0] = 1.0
  sd = np.array([0.0] + [float(np.std(p.retained, ddof=1)) if n > 1 else 0.0 for p in ps[1:]])
  x_pts = np.repeat(xs[:, None], n, 1)

  def draw(rng, shape):
    return mu[None, None, :] + sd[None, None, :] * rng.standard_normal((*shape, len(xs)))

  boot_rng = np.random.default_rng([rng_seed, 1])  # consumed in trial order: deterministic

  def interval(y_seeds):  # [n seeds, settings]
    def crossing_of(idx):
      return _crossing(kind, _fit(kind, x_pts[:, idx].T.ravel(), y_seeds[idx].ravel()), level)
    boots = np.sort([crossing_of(boot_rng.integers(0, n, n)) for _ in range(n_boot)])
    return boots[int(0.025 * n_boot)], boots[int(math.ceil(0.975 * n_boot)) - 1]

  frac, se = stats.interval_coverage(interval, n, trials=trials, rng_seed=rng_seed, draw=draw,
                                     mean=truth)
  return frac, se, truth


def retained_table(pool: dict[str, list[Paired]]) -> list[tuple[str, str, stats.PairedResult,
                                                                stats.PairedResult | None]]:
  """The paired retained-gain table on the shared settings: per (setting situation, correction)
  retained (mean over seeds, t interval) and its paired difference to the uncorrected run of the
  same situation (None for the uncorrected run itself); a last row per correction "mean over the
  shared settings" (per seed the mean over settings, then t over seeds)."""
  out = []
  none = {_situation(p.row): p for p in pool.get("none", [])[1:]}
  for c, ps in pool.items():
    per_seed_mean = np.mean([p.retained for p in ps[1:]], axis=0) if len(ps) > 1 else None
    none_mean = (np.mean([none[_situation(p.row)].retained for p in ps[1:]], axis=0)
                 if c != "none" and len(ps) > 1 else None)
    for p in ps[1:]:
      ref = none.get(_situation(p.row))
      diff = None if c == "none" or ref is None else stats.paired_t(p.retained - ref.retained)
      out.append((_situation_label(p.row), c, stats.paired_t(p.retained), diff))
    if per_seed_mean is not None:
      out.append(("mean over the shared settings", c, stats.paired_t(per_seed_mean),
                  None if none_mean is None else stats.paired_t(per_seed_mean - none_mean)))
  return out


def _situation_label(r: dict) -> str:
  return f"{r.get('sampler_recipe', 'bf16')} lag {r['lag_used']}"


def interchangeability(paired: Sequence[Paired], correction: str = "none"
                       ) -> stats.PairedResult | None:
  """paired_t over seeds of gamma_s, the quant-share coefficient of the per-seed fit retained =
  a - b max(log10 total k1 - c, 0) + gamma share (settings of `correction` trained in BF16
  and the base; the hinge as in `capacity`); None when the design cannot tell the two apart (fewer than 4 settings
  with drift, or quant shares spread less than 0.2)."""
  ps = [p for p in paired if (p.row.get("correction", "none") == correction or _is_base(p.row))
        and np.all(np.isfinite(p.retained)) and not in_format(p.row)]
  drifted = [p for p in ps if np.all(p.drift["total_k1"] > DRIFT_FLOOR)]
  if len(drifted) < 4 or np.ptp([np.mean(p.quant_share) for p in drifted]) < 0.2:
    return None
  gammas = []
  for i in range(len(ps[0].gain)):
    x, y = _points(ps, [i])
    q = np.array([p.quant_share[i] if p.drift["total_k1"][i] > DRIFT_FLOOR else 0.0 for p in ps])
    gammas.append(segmented_fit(x, y, q)[3])
  return stats.paired_t(gammas)


def claims(paired: Sequence[Paired], gamma: stats.PairedResult | None) -> list[stats.Verdict]:
  """The report's two families: per non-base setting "greedy end below the BF16 lag-0 run"
  (paired_t over seeds; Holm over the settings), and the interchangeability claim, the report's
  one primary hypothesis, its own family (its Holm p is its p: pooling it with ~130 descriptive
  per-setting tests would leave no power for the question the sweep is built to answer)."""
  cs = []
  for p in paired:
    if _is_base(p.row):
      continue
    cs.append(stats.Claim(p.row["name"], p.row["name"], "paired by seed vs BF16 lag 0",
                          p.test, direction=-1))
  primary = [] if gamma is None else [
      stats.Claim("interchangeable", "quantization drift costs more than staleness drift at "
                  "equal total drift (gamma < 0)", "per-seed regression, paired_t of gamma",
                  gamma, direction=-1)]
  return stats.judge(cs) + stats.judge(primary)


def bf16_fraction_kept(recipe: Any, n_layers: int) -> float:
  """Fraction of the decoder layers a recipe keeps in BF16 (lowrl.precision.bf16_tail_layers);
  1 for an unquantized recipe."""
  from lowrl import precision  # noqa: PLC0415

  if recipe.format == precision.FORMAT_NONE:
    return 1.0
  return len(precision.bf16_tail_layers(n_layers, recipe.bf16_last_fraction)) / n_layers
