"""Paired statistics for experiment reports, pure NumPy (no SciPy at run time).

A claim of a report is a paired comparison: per unit (a seed of a grid, a prompt of a forward-only
measurement) the difference between a setting and a named baseline measured on the same unit. The
tests here answer whether the mean difference is nonzero:

  paired_t(diffs)           Student's paired t-test: two-sided p, confidence interval of the mean;
  sign_test(diffs)          exact two-sided sign test (zeros dropped), for few units / heavy tails;
  bootstrap_mean_ci(...)    seeded percentile bootstrap of the mean (difference) over units;
  cluster_bootstrap_mean_ci(...)  the same, resampling whole clusters of units (prompts of one
                            batch), for per-prompt numbers that are heavy-tailed and correlated;
  tost(diffs, margin)       two one-sided paired t-tests: is the mean difference inside a margin
                            stated before the run (an equivalence claim, not a difference claim);
  holm(pvalues)             Holm's step-down adjustment over one report's claims;
  judge(claims)             per claim (design, n, effect, CI, Holm p, verdict);
  interval_coverage(...)    how often an interval method covers the true mean, by simulation at
                            the n a report uses (the percentile bootstrap over 3 units is the
                            range [min, max]: 75%, not 95%).

The t distribution's tail is the regularized incomplete beta function, evaluated by its continued
fraction (DLMF 8.17.22, with the symmetry 8.17.4), so the p-values agree with scipy.stats to near
machine precision without importing it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class PairedResult:
  """A test of the mean of paired differences: n units, their mean, a confidence interval of the
  mean and a two-sided p-value (NaN where n is too small for the test)."""

  n: int
  mean: float
  ci_low: float
  ci_high: float
  p: float


# ----------------------------------------------------------------------------- distributions


def _betainc_cf(a: float, b: float, x: float) -> float:
  """The continued fraction of I_x(a, b) (DLMF 8.17.22), modified Lentz evaluation."""
  tiny, eps = 1e-300, 1e-16
  f, c, d = 1.0, 1.0, 0.0
  for i in range(0, 10_000):
    m = i // 2
    if i == 0:
      num = 1.0
    elif i % 2 == 0:  # d_{2m}
      num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
    else:  # d_{2m+1}
      num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
    d = 1.0 + num * d
    d = tiny if abs(d) < tiny else d
    c = 1.0 + num / c
    c = tiny if abs(c) < tiny else c
    d = 1.0 / d
    f *= c * d
    if abs(1.0 - c * d) < eps:
      break
  return f - 1.0  # the fraction started from 1 + d_0/(1 + ...); DLMF's is 1/(1 + d_1/(...))


def betainc(a: float, b: float, x: float) -> float:
  """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
  if not (a > 0 and b > 0):
    raise ValueError(f"betainc: a={a}, b={b} must be > 0")
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"betainc: x={x} must be in [0, 1]")
  if x == 0.0 or x == 1.0:
    return x
  if x > (a + 1) / (a + b + 2):  # the fraction converges fast below this point (DLMF 8.17.4)
    return 1.0 - betainc(b, a, 1.0 - x)
  log_front = (a * math.log(x) + b * math.log1p(-x)
               - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)) - math.log(a))
  return math.exp(log_front) * _betainc_cf(a, b, x)


def t_two_sided_p(t: float, df: float) -> float:
  """P(|T| >= |t|) for Student's t with `df` degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
  if math.isnan(t):
    return math.nan
  if math.isinf(t):
    return 0.0
  return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile_two_sided(alpha: float, df: float) -> float:
  """The t > 0 with P(|T| >= t) = alpha (the half-width factor of a 1 - alpha interval)."""
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha} must be in (0, 1)")
  lo, hi = 0.0, 1.0
  while t_two_sided_p(hi, df) > alpha:
    lo, hi = hi, 2 * hi
  for _ in range(200):  # bisection to the last bit: p is monotone in t
    mid = 0.5 * (lo + hi)
    if mid in (lo, hi):
      break
    if t_two_sided_p(mid, df) > alpha:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- tests


def _as_1d(values: Any, what: str) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64)
  if x.ndim != 1:
    raise ValueError(f"{what}: expected a 1-D sequence of per-unit values, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{what}: non-finite values {x[~np.isfinite(x)][:4].tolist()}; drop or "
                     "repair those units first")
  return x


def paired_t(diffs: Sequence[float], *, confidence: float = 0.95) -> PairedResult:
  """Paired t-test of per-unit differences (scipy.stats.ttest_rel on the two sides, two-sided).

  n = 1 gives a NaN interval and p. Zero spread: the interval is the mean itself and p is 1 when
  the mean is 0, else 0 (every unit moved by the same nonzero amount).
  """
  d = _as_1d(diffs, "paired_t")
  n = d.size
  if n == 0:
    raise ValueError("paired_t: no paired units")
  mean = float(d.mean())
  if n == 1:
    return PairedResult(1, mean, math.nan, math.nan, math.nan)
  sd = float(d.std(ddof=1))
  if sd == 0.0:
    return PairedResult(n, mean, mean, mean, 1.0 if mean == 0.0 else 0.0)
  se = sd / math.sqrt(n)
  half = t_quantile_two_sided(1.0 - confidence, n - 1) * se
  return PairedResult(n, mean, mean - half, mean + half, t_two_sided_p(mean / se, n - 1))


def t_one_sided_p_greater(t: float, df: float) -> float:
  """P(T >= t) for Student's t with `df` degrees of freedom."""
  if math.isnan(t):
    return math.nan
  half = 0.5 * t_two_sided_p(t, df)
  return half if t >= 0 else 1.0 - half


def tost(diffs: Sequence[float], margin: float | tuple[float, float], *,
         alpha: float = ALPHA) -> PairedResult:
  """Two one-sided paired t-tests (Schuirmann's TOST) of equivalence of per-unit differences.

  `margin`: delta > 0 for the region (-delta, delta), or (low, high) with low < high; it must be
  stated before the data are seen (the claim is "the mean difference lies inside it"). The null
  is mean <= low or mean >= high; p = max(P(T >= (mean - low) / se), P(T <= (mean - high) / se))
  on n - 1 df (scipy.stats.ttest_1samp(d, low, alternative="greater") and (d, high, "less")).
  The interval is the 1 - 2 alpha t interval of the mean: equivalence at alpha iff it lies inside
  the margin, the same decision as p < alpha. n = 1: NaN. Zero spread: p is 0 when the mean is
  strictly inside the margin, else 1.
  """
  low, high = (-margin, margin) if np.isscalar(margin) else tuple(margin)
  if not (math.isfinite(low) and math.isfinite(high) and low < high):
    raise ValueError(f"tost: margin {margin!r} must be delta > 0 or (low, high) with low < high")
  if not 0.0 < alpha < 0.5:
    raise ValueError(f"tost: alpha={alpha} must be in (0, 0.5)")
  d = _as_1d(diffs, "tost")
  ci = paired_t(d, confidence=1.0 - 2.0 * alpha)
  n, mean = ci.n, ci.mean
  if n == 1:
    return ci
  sd = float(d.std(ddof=1))
  if sd == 0.0:
    return PairedResult(n, mean, mean, mean, 0.0 if low < mean < high else 1.0)
  se = sd / math.sqrt(n)
  p_low = t_one_sided_p_greater((mean - low) / se, n - 1)
  p_high = t_one_sided_p_greater((high - mean) / se, n - 1)  # P(T <= t) = P(T >= -t)
  return PairedResult(n, mean, ci.ci_low, ci.ci_high, max(p_low, p_high))


def sign_test(diffs: Sequence[float]) -> float:
  """Exact two-sided sign test of median 0 (scipy.stats.binomtest(k, n, 0.5) on the nonzero
  differences, k of them positive); 1.0 when every difference is 0."""
  d = _as_1d(diffs, "sign_test")
  pos, neg = int(np.sum(d > 0)), int(np.sum(d < 0))
  n, k = pos + neg, min(pos, neg)
  if n == 0:
    return 1.0
  # Binomial(n, 1/2) is symmetric: the two-sided p doubles the smaller tail (exact integers).
  tail = sum(math.comb(n, i) for i in range(k + 1))
  return min(1.0, 2 * tail / 2**n)


def bootstrap_mean_ci(values: Sequence[float], *, rng_seed: int, n_boot: int = 10_000,
                      pairs: Sequence[float] | None = None,
                      confidence: float = 0.95) -> PairedResult:
  """Percentile bootstrap of the mean over units, resampling units with replacement.

  `pairs` (same length as `values`): the baseline's value on the same unit; then the statistic is
  the mean of values - pairs, each resample drawing whole pairs. p is the two-sided bootstrap
  p-value of mean 0: twice the smaller fraction of resampled means on either side of 0 (at least
  1 / n_boot), the percentile interval's duality with the test.
  """
  x = _as_1d(values, "bootstrap_mean_ci")
  if pairs is not None:
    y = _as_1d(pairs, "bootstrap_mean_ci pairs")
    if y.shape != x.shape:
      raise ValueError(f"bootstrap_mean_ci: pairs has {y.size} units, values {x.size}")
    x = x - y
  if x.size == 0:
    raise ValueError("bootstrap_mean_ci: no units")
  if n_boot < 1:
    raise ValueError(f"bootstrap_mean_ci: n_boot={n_boot} must be >= 1")
  rng = np.random.default_rng(rng_seed)
  idx = rng.integers(0, x.size, size=(n_boot, x.size))
  return _percentile_result(x, x[idx].mean(axis=1), confidence)


def _percentile_result(x: np.ndarray, means: np.ndarray, confidence: float) -> PairedResult:
  """The percentile interval of the resampled `means` and the bootstrap p of mean 0: twice the
  smaller fraction of them on either side of 0, at least 1 / their number."""
  a = (1.0 - confidence) / 2
  lo, hi = np.quantile(means, [a, 1.0 - a])
  below, above = np.mean(means <= 0.0), np.mean(means >= 0.0)
  p = min(1.0, max(2 * min(below, above), 1.0 / means.size))
  return PairedResult(int(x.size), float(x.mean()), float(lo), float(hi), float(p))


def cluster_bootstrap_mean_ci(values: Sequence[float], clusters: Sequence[Hashable], *,
                               rng_seed: int, n_boot: int = 10_000,
                               confidence: float = 0.95) -> PairedResult:
  """Percentile bootstrap of the mean over units that come in clusters, resampling whole
  clusters with replacement (units of one cluster share what made them: e.g. prompts of one
  rollout batch share its sampling key and its per-batch activation scales, so they are not
  independent). A resample's statistic is the mean over the units of its clusters (sum of the
  drawn clusters' sums over the sum of their sizes). p: twice the smaller fraction of resampled
  means on either side of 0 (at least 1 / n_boot), as in `bootstrap_mean_ci`, which this equals
  when every unit is its own cluster. Needs enough clusters for the percentile interval to cover
  (check with `interval_coverage` at the report's cluster count)."""
  x = _as_1d(values, "cluster_bootstrap_mean_ci")
  labels = list(clusters)
  if len(labels) != x.size:
    raise ValueError(f"cluster_bootstrap_mean_ci: {len(labels)} cluster labels for {x.size} units")
  if x.size == 0:
    raise ValueError("cluster_bootstrap_mean_ci: no units")
  if n_boot < 1:
    raise ValueError(f"cluster_bootstrap_mean_ci: n_boot={n_boot} must be >= 1")
  order = {c: i for i, c in enumerate(dict.fromkeys(labels))}  # first-seen order: deterministic
  idx = np.array([order[c] for c in labels])
  sums = np.bincount(idx, weights=x, minlength=len(order))
  sizes = np.bincount(idx, minlength=len(order)).astype(np.float64)
  rng = np.random.default_rng(rng_seed)
  draw = rng.integers(0, len(order), size=(n_boot, len(order)))
  return _percentile_result(x, sums[draw].sum(axis=1) / sizes[draw].sum(axis=1), confidence)


def interval_coverage(interval: Callable[[np.ndarray], tuple[float, float]], n: int, *,
                      trials: int, rng_seed: int,
                      draw: Callable[[np.random.Generator, tuple[int, int]], np.ndarray] | None = None,
                      mean: float = 0.0) -> tuple[float, float]:
  """(fraction of `trials` samples of n units whose `interval(x) -> (low, high)` holds `mean`,
  its binomial standard error). `draw(rng, (trials, n))` gives the samples, standard normal by
  default (then mean 0); a report checks the interval it uses at the n it has."""
  if n < 1 or trials < 1:
    raise ValueError(f"interval_coverage: n={n}, trials={trials} must be >= 1")
  rng = np.random.default_rng(rng_seed)
  xs = rng.standard_normal((trials, n)) if draw is None else np.asarray(draw(rng, (trials, n)))
  hits = 0
  for x in xs:
    lo, hi = interval(x)
    hits += bool(lo <= mean <= hi)
  frac = hits / trials
  return frac, math.sqrt(frac * (1.0 - frac) / trials)


def holm(pvalues: Sequence[float]) -> np.ndarray:
  """Holm's step-down adjusted p-values, in the input order: with p sorted ascending over the m
  non-NaN values, adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). NaN stays NaN (an untested
  claim counts in no family)."""
  p = np.asarray(pvalues, dtype=np.float64)
  if p.ndim != 1:
    raise ValueError(f"holm: expected a 1-D sequence of p-values, got shape {p.shape}")
  ok = ~np.isnan(p)
  if np.any((p[ok] < 0) | (p[ok] > 1)):
    raise ValueError(f"holm: p-values outside [0, 1]: {p[ok][(p[ok] < 0) | (p[ok] > 1)].tolist()}")
  out = np.full(p.shape, np.nan)
  idx = np.flatnonzero(ok)
  order = idx[np.argsort(p[idx], kind="stable")]
  m = order.size
  running = 0.0
  for j, i in enumerate(order):
    running = max(running, min(1.0, (m - j) * p[i]))
    out[i] = running
  return out


# ----------------------------------------------------------------------------- pairing


def paired_diffs(treatment: Mapping[Hashable, float], baseline: Mapping[Hashable, float]
                 ) -> tuple[list[Hashable], np.ndarray]:
  """(units, treatment - baseline) over the units both sides measured, in sorted unit order.
  Raises when they share none."""
  units = sorted(set(treatment) & set(baseline), key=repr)
  if not units:
    raise ValueError(f"no unit measured on both sides (treatment {sorted(treatment, key=repr)}, "
                     f"baseline {sorted(baseline, key=repr)})")
  return units, np.array([float(treatment[u]) - float(baseline[u]) for u in units])


def by_unit(rows: Iterable[Mapping[str, Any]], value: Callable[[Mapping[str, Any]], float | None],
            *, group: str = "setting", unit: str = "seed") -> dict[Hashable, dict[Hashable, float]]:
  """{row[group]: {row[unit]: value(row)}} of results lines (rows whose value is None skipped);
  a (group, unit) twice is an error (a grid holds each once)."""
  out: dict[Hashable, dict[Hashable, float]] = {}
  for r in rows:
    v = value(r)
    if v is None:
      continue
    g = out.setdefault(r[group], {})
    if r[unit] in g:
      raise ValueError(f"two results for {group}={r[group]!r} {unit}={r[unit]!r}")
    g[r[unit]] = float(v)
  return out


# ----------------------------------------------------------------------------- claims


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim of a report: `statement` says the effect (treatment - baseline on `metric`, paired
  by unit) has the sign of `direction` (+1: larger, -1: smaller); `design` says how it was
  measured; `result` is its test (paired_t or bootstrap_mean_ci)."""

  name: str
  statement: str
  design: str
  result: PairedResult
  direction: int = -1
  note: str = ""
  # An equivalence claim: the effect lies inside (low, high), stated before the run; `result` is
  # then `tost`'s (p of the TOST, the 1 - 2 alpha interval) and `direction` is not read.
  margin: tuple[float, float] | None = None

  def __post_init__(self):
    if self.direction not in (-1, 1):
      raise ValueError(f"Claim {self.name}: direction={self.direction} must be +1 or -1")
    if self.margin is not None and not (len(self.margin) == 2
                                        and self.margin[0] < self.margin[1]):
      raise ValueError(f"Claim {self.name}: margin={self.margin!r} must be (low, high), low < high")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A claim with its Holm-adjusted p over the report's claims and the verdict at `alpha`:
  'held' (adjusted p < alpha, effect in the stated direction), 'contradicted' (adjusted p < alpha,
  opposite direction), 'not resolved' (adjusted p >= alpha) or 'not tested' (no p). An
  equivalence claim is 'equivalent' (adjusted TOST p < alpha) or 'not shown equivalent'."""

  claim: Claim
  p_holm: float
  verdict: str

  def row(self) -> dict[str, Any]:
    """(design, n, effect, CI, Holm p, verdict) as a dict, for tables and JSON."""
    r = self.claim.result
    return {"claim": self.claim.name, "statement": self.claim.statement,
            "design": self.claim.design, "n": r.n, "effect": r.mean, "ci_low": r.ci_low,
            "ci_high": r.ci_high, "p": r.p, "p_holm": self.p_holm, "verdict": self.verdict,
            "note": self.claim.note,
            "margin": None if self.claim.margin is None else list(self.claim.margin)}


def verdict_of(effect: float, p_holm: float, direction: int, alpha: float = ALPHA, *,
               equivalence: bool = False) -> str:
  """The verdict of one claim from its effect and adjusted p (see Verdict)."""
  if math.isnan(p_holm):
    return "not tested"
  if equivalence:
    return "equivalent" if p_holm < alpha else "not shown equivalent"
  if p_holm >= alpha:
    return "not resolved"
  return "held" if effect * direction > 0 else "contradicted"


def judge(claims: Sequence[Claim], *, alpha: float = ALPHA) -> list[Verdict]:
  """The verdicts of one report's claims, Holm-adjusted together (one family)."""
  adj = holm([c.result.p for c in claims])
  return [Verdict(c, float(a), verdict_of(c.result.mean, float(a), c.direction, alpha,
                                          equivalence=c.margin is not None))
          for c, a in zip(claims, adj)]


def fmt_num(x: float, digits: int = 3) -> str:
  """A number for a report table: fixed point, or 2 significant digits in e-notation when small."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if x == 0 or abs(x) >= 10**-digits:
    return f"{x:.{digits}f}"
  return f"{x:.1e}"


def fmt_p(p: float) -> str:
  """A p-value for a report table."""
  if p is None or math.isnan(p):
    return "–"
  return f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def markdown_table(verdicts: Sequence[Verdict], digits: int = 3) -> str:
  """The claims table of a report: claim, design, n, effect [95% CI], p, Holm p, verdict (an
  equivalence claim's effect cell: its 90% CI and the margin it must lie in)."""
  lines = ["| claim | design | n | effect [95% CI] | p | Holm p | verdict |",
           "|---|---|---|---|---|---|---|"]
  cell = lambda text: text.replace("|", "\\|")  # noqa: E731 (a | would end the cell)
  for v in verdicts:
    r = v.claim.result
    ci = f" [{fmt_num(r.ci_low, digits)}, {fmt_num(r.ci_high, digits)}]"
    if v.claim.margin is not None:
      lo, hi = v.claim.margin
      ci += (f" ({100 * (1 - 2 * ALPHA):.0f}% CI; margin ({fmt_num(lo, digits)}, "
             f"{fmt_num(hi, digits)}))")
    lines.append(f"| {cell(v.claim.statement)} | {cell(v.claim.design)} | {r.n} | "
                 f"{fmt_num(r.mean, digits)}{ci} | {fmt_p(r.p)} | {fmt_p(v.p_holm)} | "
                 f"**{v.verdict}** |")
  return "\n".join(lines)
