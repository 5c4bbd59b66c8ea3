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
RETAINED_AT_CAPACITY (half of BF16's gain): a segmented fit of retained against log10 total k1
(flat up to a knee c, then linear with slope -b), pooled over seeds, D* = 10^(c + (a - 1/2)/b);
its 95% interval is the percentile bootstrap over seeds (whole seeds resampled, every setting of
a seed together). A D* beyond the largest measured drift is reported as censored (> that drift).

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
  return (r.get("sampler_recipe", "bf16") == "bf16" and r.get("trainer_recipe", "bf16") == "bf16"
          and r["lag_used"] == 0 and r.get("correction", "none") == "none"
          and r.get("sync_every", 1) == 1)


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


@dataclasses.dataclass(frozen=True)
class Capacity:
  """The correction capacity of one correction: D* (total k1) with its bootstrap interval."""

  correction: str
  n_settings: int
  fit: tuple[float, float, float]
  log_d: float  # log10 D*; +inf = not reached within the measured drifts
  ci: tuple[float, float]  # log10, percentile bootstrap over seeds
  max_log_drift: float
  min_log_drift: float  # the smallest measured drift above the floor (the base sits at it)

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


def _points(paired: Sequence[Paired], seed_idx: Sequence[int]):
  x, y = [], []
  for p in paired:
    for i in seed_idx:
      x.append(math.log10(max(float(p.drift["total_k1"][i]), DRIFT_FLOOR)))
      y.append(float(p.retained[i]))
  return np.array(x), np.array(y)


def capacity(paired: Sequence[Paired], correction: str, *, rng_seed: int = 0,
             level: float = RETAINED_AT_CAPACITY) -> Capacity | None:
  """The capacity of `correction` from its settings (with the base as the zero-drift anchor), or
  None with fewer than 3 settings."""
  ps = [p for p in paired if p.row.get("correction", "none") == correction or _is_base(p.row)]
  ps = [p for p in ps if np.all(np.isfinite(p.retained))]
  if len(ps) < 3:
    return None
  n_seeds = len(ps[0].gain)
  x, y = _points(ps, range(n_seeds))
  fit = segmented_fit(x, y)
  rng = np.random.default_rng(rng_seed)
  boots = []
  for _ in range(N_BOOT):
    bx, by = _points(ps, rng.integers(0, n_seeds, n_seeds))
    boots.append(crossing(segmented_fit(bx, by), level))
  # Order statistics, not interpolated quantiles: crossings may be +-inf (censored resamples).
  boots = np.sort(np.array(boots))
  lo, hi = boots[int(0.025 * N_BOOT)], boots[int(math.ceil(0.975 * N_BOOT)) - 1]
  above = x[x > math.log10(DRIFT_FLOOR)]
  return Capacity(correction, len(ps), fit, crossing(fit, level), (float(lo), float(hi)),
                  float(np.max(x)), float(np.min(above)) if above.size else float(np.max(x)))


def interchangeability(paired: Sequence[Paired], correction: str = "none"
                       ) -> stats.PairedResult | None:
  """paired_t over seeds of gamma_s, the quant-share coefficient of the per-seed fit retained =
  a - b max(log10 total k1 - c, 0) + gamma share (settings of `correction` and the base; the
  hinge as in `capacity`); None when the design cannot tell the two apart (fewer than 4 settings
  with drift, or quant shares spread less than 0.2)."""
  ps = [p for p in paired if (p.row.get("correction", "none") == correction or _is_base(p.row))
        and np.all(np.isfinite(p.retained))]
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
