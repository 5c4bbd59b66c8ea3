"""lowrl.analysis.stats against SciPy (ttest_rel, the t distribution, binomtest) and cases worked
by hand from the definitions (Holm, the bootstrap of two or three points, claim verdicts)."""
import functools
import itertools
import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrl.analysis import stats

# SciPy evaluates the t tail with the same incomplete beta function by another algorithm (Boost);
# both are accurate to a few ulps, so 1e-10 relative leaves room and still catches any wrong
# formula (a wrong df or a one-sided p is off by a factor, not 1e-10).
RTOL = 1e-10


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 19, 100, 1000])
@pytest.mark.parametrize("t", [0.0, 0.1, 1.0, 2.5, 8.0, 60.0])
def test_t_two_sided_p_matches_scipy(df, t):
  assert stats.t_two_sided_p(t, df) == pytest.approx(2 * scipy.stats.t.sf(t, df), rel=RTOL,
                                                     abs=1e-300)


@pytest.mark.parametrize("df", [1, 2, 4, 9, 29, 1000])
@pytest.mark.parametrize("alpha", [0.5, 0.05, 0.01, 1e-4])
def test_t_quantile_matches_scipy(df, alpha):
  assert stats.t_quantile_two_sided(alpha, df) == pytest.approx(
      scipy.stats.t.ppf(1 - alpha / 2, df), rel=RTOL)


@pytest.mark.parametrize("a,b,x", [(0.5, 0.5, 0.3), (2.0, 3.0, 0.9), (10.0, 0.5, 0.99),
                                   (0.5, 50.0, 1e-3), (1.0, 1.0, 0.25)])
def test_betainc_matches_scipy(a, b, x):
  import scipy.special
  assert stats.betainc(a, b, x) == pytest.approx(scipy.special.betainc(a, b, x), rel=RTOL)


@pytest.mark.parametrize("n", [2, 3, 5, 12, 60])
def test_paired_t_matches_ttest_rel(n):
  rng = np.random.default_rng(n)
  base = rng.normal(size=n)
  treat = base + rng.normal(0.4, 1.0, size=n)
  r = stats.paired_t(treat - base)
  ref = scipy.stats.ttest_rel(treat, base)
  ci = ref.confidence_interval(0.95)
  assert r.n == n
  assert r.mean == pytest.approx(np.mean(treat - base), rel=1e-12)
  assert r.p == pytest.approx(ref.pvalue, rel=RTOL)
  # The interval's ends are mean -+ q * se: an absolute error of a few ulps of the mean.
  assert r.ci_low == pytest.approx(ci.low, rel=RTOL, abs=1e-12)
  assert r.ci_high == pytest.approx(ci.high, rel=RTOL, abs=1e-12)


def test_paired_t_hand_case():
  # d = (1, 2, 3): mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3) on 2 df. The 2-df t has a closed
  # form cdf, 1/2 + t / (2 sqrt(2 + t^2)), so P(|T| >= t) = 1 - t / sqrt(2 + t^2).
  r = stats.paired_t([1.0, 2.0, 3.0])
  t = 2 * math.sqrt(3)
  assert r.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=RTOL)
  u = 0.95  # P(|T| <= q) = q / sqrt(2 + q^2) = u  =>  q = u sqrt(2 / (1 - u^2))
  q = u * math.sqrt(2 / (1 - u * u))
  assert r.ci_low == pytest.approx(2 - q / math.sqrt(3), rel=RTOL)
  assert r.ci_high == pytest.approx(2 + q / math.sqrt(3), rel=RTOL)


def test_paired_t_edge_cases():
  one = stats.paired_t([0.3])
  assert one.n == 1 and one.mean == 0.3 and math.isnan(one.p) and math.isnan(one.ci_low)
  assert stats.paired_t([0.0, 0.0, 0.0]).p == 1.0
  same = stats.paired_t([0.5, 0.5])
  assert same.p == 0.0 and same.ci_low == same.ci_high == 0.5
  with pytest.raises(ValueError, match="no paired units"):
    stats.paired_t([])
  with pytest.raises(ValueError, match="non-finite"):
    stats.paired_t([1.0, float("nan")])
  with pytest.raises(ValueError, match="1-D"):
    stats.paired_t([[1.0, 2.0]])


@pytest.mark.parametrize("diffs", [[1, 1, 1, 1, 1], [1, -1, 2, 3, 4, 5, -0.5], [-1] * 12 + [1] * 3,
                                   [0.1, 0.2, -0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]])
def test_sign_test_matches_binomtest(diffs):
  k, n = sum(d > 0 for d in diffs), sum(d != 0 for d in diffs)
  assert stats.sign_test(diffs) == pytest.approx(scipy.stats.binomtest(k, n, 0.5).pvalue,
                                                 rel=1e-12)


def test_sign_test_hand_cases():
  assert stats.sign_test([1.0] * 5) == 2 / 32  # both tails of the all-positive outcome
  assert stats.sign_test([1.0, -1.0]) == 1.0
  assert stats.sign_test([0.0, 0.0, 2.0]) == 1.0  # zeros dropped: one positive of one
  assert stats.sign_test([0.0, 0.0]) == 1.0


def _exact_bootstrap_quantile(x, q):
  """The q-quantile (smallest v with P(mean <= v) >= q) of the exact bootstrap distribution of
  the mean: the n^n equally likely resamples, the distribution an infinite n_boot converges to."""
  means = np.sort([np.mean(c) for c in itertools.product(x, repeat=len(x))])
  cdf = np.arange(1, means.size + 1) / means.size
  return means[np.argmax(cdf >= q)]


def test_bootstrap_two_points_hand_case():
  # Resamples of {0, 1}: means 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5%
  # percentiles are 0 and 1 (ties: a 1/4 atom at each end holds both).
  r = stats.bootstrap_mean_ci([0.0, 1.0], rng_seed=0, n_boot=4000)
  assert (r.n, r.mean, r.ci_low, r.ci_high) == (2, 0.5, 0.0, 1.0)
  # p: P(mean <= 0) = 1/4 (the smaller side): 2 x 1/4, up to Monte Carlo error (sd 0.014 at
  # n_boot = 4000; 5 sd).
  assert abs(r.p - 0.5) < 5 * 2 * math.sqrt(0.25 * 0.75 / 4000)


def test_bootstrap_converges_to_exact_distribution():
  # Three units: 27 equally likely resamples. The extreme means 0 and 4 each have probability
  # 1/27 = 0.037, so the exact 2.5% / 97.5% quantiles are 0 and 4, 0.012 inside the atoms' mass:
  # 9 Monte Carlo sd (sqrt(0.037 * 0.963 / 20000) = 0.0013) at n_boot = 20000.
  x = np.array([0.0, 1.0, 4.0])
  assert (_exact_bootstrap_quantile(x, 0.025), _exact_bootstrap_quantile(x, 0.975)) == (0.0, 4.0)
  r = stats.bootstrap_mean_ci(x, rng_seed=3, n_boot=20_000)
  assert (r.ci_low, r.ci_high) == (0.0, 4.0)
  assert r.mean == pytest.approx(5 / 3)


def test_bootstrap_pairs_is_the_bootstrap_of_differences_and_seeded():
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=30), rng.normal(size=30)
  paired = stats.bootstrap_mean_ci(a, pairs=b, rng_seed=7, n_boot=500)
  assert paired == stats.bootstrap_mean_ci(a - b, rng_seed=7, n_boot=500)
  assert paired == stats.bootstrap_mean_ci(a, pairs=b, rng_seed=7, n_boot=500)
  assert paired != stats.bootstrap_mean_ci(a, pairs=b, rng_seed=8, n_boot=500)
  with pytest.raises(ValueError, match="pairs has 29 units"):
    stats.bootstrap_mean_ci(a, pairs=b[:-1], rng_seed=0)


def test_cluster_bootstrap_of_singletons_is_the_unit_bootstrap():
  x = np.random.default_rng(5).exponential(size=40)
  unit = stats.bootstrap_mean_ci(x, rng_seed=11, n_boot=2000)
  clustered = stats.cluster_bootstrap_mean_ci(x, range(40), rng_seed=11, n_boot=2000)
  assert (clustered.n, clustered.mean, clustered.p) == (unit.n, unit.mean, unit.p)
  # Same resamples; the mean as sum / n instead of numpy's mean: equal to rounding.
  assert clustered.ci_low == pytest.approx(unit.ci_low, rel=1e-12)
  assert clustered.ci_high == pytest.approx(unit.ci_high, rel=1e-12)


def test_cluster_bootstrap_converges_to_the_exact_cluster_resampling():
  # Clusters {0, 0}, {3}, {6, 6, 6}: 27 equally likely resamples of 3 clusters, each's mean the
  # ratio of the drawn sums to the drawn sizes. Enumerated here from the definition; the extreme
  # resamples (mean 0 and 6) have mass 1/27 each, more than 2.5%, so the percentile interval is
  # [0, 6] (the same Monte Carlo margin as the unit bootstrap's case above).
  values, labels = [0.0, 0.0, 3.0, 6.0, 6.0, 6.0], ["a", "a", "b", "c", "c", "c"]
  cl = {"a": [0.0, 0.0], "b": [3.0], "c": [6.0, 6.0, 6.0]}
  means = np.sort([sum(sum(cl[k]) for k in d) / sum(len(cl[k]) for k in d)
                   for d in itertools.product(cl, repeat=3)])
  cdf = np.arange(1, 28) / 27
  assert (means[np.argmax(cdf >= 0.025)], means[np.argmax(cdf >= 0.975)]) == (0.0, 6.0)
  r = stats.cluster_bootstrap_mean_ci(values, labels, rng_seed=3, n_boot=20_000)
  assert (r.n, r.ci_low, r.ci_high) == (6, 0.0, 6.0)
  assert r.mean == pytest.approx(21 / 6)
  with pytest.raises(ValueError, match="5 cluster labels for 6 units"):
    stats.cluster_bootstrap_mean_ci(values, labels[:-1], rng_seed=0)


def test_cluster_bootstrap_covers_where_the_unit_bootstrap_does_not():
  """20 clusters of 10 units sharing a cluster effect (sd 1; unit noise sd 0.3): the mean's sd is
  sqrt((1 + 0.09 / 10) / 20) = 0.22, the unit bootstrap's about sqrt(1.09 / 200) = 0.074, so its
  95% interval covers about P(|Z| < 1.96 x 0.33) = 0.48; the cluster bootstrap's about 0.93
  (a percentile interval over 20 units). 300 trials: binomial sd 0.03 at most."""
  labels = np.repeat(np.arange(20), 10)

  def draw(rng, shape):
    trials, n = shape
    return np.repeat(rng.normal(size=(trials, 20)), 10, axis=1) + rng.normal(0, 0.3, (trials, n))

  def clustered(x):
    r = stats.cluster_bootstrap_mean_ci(x, labels, rng_seed=0, n_boot=1000)
    return r.ci_low, r.ci_high

  def unit(x):
    r = stats.bootstrap_mean_ci(x, rng_seed=0, n_boot=1000)
    return r.ci_low, r.ci_high

  c, _ = stats.interval_coverage(clustered, 200, trials=300, rng_seed=4, draw=draw)
  u, _ = stats.interval_coverage(unit, 200, trials=300, rng_seed=4, draw=draw)
  assert 0.85 <= c <= 0.99 and u < 0.65, (c, u)


def test_bootstrap_close_to_scipy_percentile_interval():
  # 200 units: scipy.stats.bootstrap's percentile interval with its own resamples; the two Monte
  # Carlo estimates of a 2.5% quantile of the mean's distribution differ by O(se / sqrt(n_boot))
  # times a density factor; 0.1 se is > 10 of those at n_boot = 20000.
  rng = np.random.default_rng(2)
  x = rng.exponential(size=200)
  se = x.std(ddof=1) / math.sqrt(x.size)
  r = stats.bootstrap_mean_ci(x, rng_seed=0, n_boot=20_000)
  ref = scipy.stats.bootstrap((x,), np.mean, n_resamples=20_000, method="percentile",
                              random_state=np.random.default_rng(5)).confidence_interval
  assert abs(r.ci_low - ref.low) < 0.1 * se
  assert abs(r.ci_high - ref.high) < 0.1 * se
  assert r.p == 1 / 20_000  # every resampled mean of positive values is > 0: the floor


def test_holm_hand_cases():
  # Definition: sorted p_(1..m), adj_(i) = max_{j<=i} min(1, (m-j+1) p_(j)), back in input order.
  np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
  np.testing.assert_allclose(stats.holm([0.2, 0.9]), [0.4, 0.9])
  np.testing.assert_allclose(stats.holm([0.6, 0.7]), [1.0, 1.0])  # capped at 1, monotone
  np.testing.assert_allclose(stats.holm([0.02]), [0.02])  # m = 1: unchanged
  out = stats.holm([0.01, float("nan"), 0.04])
  assert math.isnan(out[1])
  np.testing.assert_allclose(out[[0, 2]], [0.02, 0.04])  # NaN not counted in m
  assert stats.holm([]).shape == (0,)
  with pytest.raises(ValueError, match="outside"):
    stats.holm([1.5])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_properties(p):
  adj = stats.holm(p)
  p = np.asarray(p)
  assert np.all(adj >= p - 1e-15) and np.all(adj <= 1.0)
  assert np.all(adj <= np.minimum(1.0, len(p) * p) + 1e-15)  # never worse than Bonferroni
  order = np.argsort(p, kind="stable")
  assert np.all(np.diff(adj[order]) >= 0)  # monotone in p


def _claim(name, mean, p, direction=-1):
  return stats.Claim(name, f"statement {name}", "paired by seed",
                     stats.PairedResult(5, mean, mean - 1, mean + 1, p), direction=direction)


def test_judge_holm_over_the_report_and_verdicts():
  claims = [_claim("a", -0.2, 0.001), _claim("b", 0.3, 0.01), _claim("c", -0.1, 0.06),
            _claim("d", 0.1, math.nan)]
  out = stats.judge(claims)
  assert [v.verdict for v in out] == ["held", "contradicted", "not resolved", "not tested"]
  assert [v.p_holm for v in out[:3]] == pytest.approx([0.003, 0.02, 0.06])
  row = out[0].row()
  assert (row["design"], row["n"], row["effect"], row["p_holm"], row["verdict"]) == (
      "paired by seed", 5, -0.2, pytest.approx(0.003), "held")
  table = stats.markdown_table(out)
  assert table.count("\n") == 1 + len(claims) and "**contradicted**" in table
  with pytest.raises(ValueError, match="direction"):
    _claim("e", 0.0, 0.5, direction=0)


def test_paired_diffs_and_by_unit():
  rows = [{"setting": "bf16", "seed": 0, "v": 1.0}, {"setting": "bf16", "seed": 1, "v": 2.0},
          {"setting": "nv", "seed": 1, "v": 5.0}, {"setting": "nv", "seed": 0, "v": 1.5},
          {"setting": "nv", "seed": 2, "v": 9.0}, {"setting": "x", "seed": 0, "v": None}]
  table = stats.by_unit(rows, lambda r: r["v"])
  assert table == {"bf16": {0: 1.0, 1: 2.0}, "nv": {0: 1.5, 1: 5.0, 2: 9.0}}
  units, d = stats.paired_diffs(table["nv"], table["bf16"])
  assert units == [0, 1] and d.tolist() == [0.5, 3.0]  # seed 2 has no baseline: unpaired, left out
  with pytest.raises(ValueError, match="no unit measured on both sides"):
    stats.paired_diffs({0: 1.0}, {1: 1.0})
  with pytest.raises(ValueError, match="two results"):
    stats.by_unit(rows + [rows[0]], lambda r: r["v"])


# ----------------------------------------------------------------------------- equivalence (TOST)


@pytest.mark.parametrize("n", [2, 3, 8, 30])
@pytest.mark.parametrize("shift", [0.0, 0.3, -0.45, 1.2])
def test_tost_matches_scipy_one_sided_tests(n, shift):
  rng = np.random.default_rng(100 + n)
  d = rng.normal(shift, 0.5, size=n)
  for margin, (low, high) in ((0.5, (-0.5, 0.5)), ((-0.2, 0.8), (-0.2, 0.8))):
    r = stats.tost(d, margin)
    p_low = scipy.stats.ttest_1samp(d, low, alternative="greater").pvalue
    p_high = scipy.stats.ttest_1samp(d, high, alternative="less").pvalue
    assert r.n == n and r.mean == pytest.approx(np.mean(d), rel=1e-12)
    assert r.p == pytest.approx(max(p_low, p_high), rel=RTOL, abs=1e-300)
    ci = scipy.stats.ttest_1samp(d, 0.0).confidence_interval(0.90)
    assert r.ci_low == pytest.approx(ci.low, rel=RTOL, abs=1e-12)
    assert r.ci_high == pytest.approx(ci.high, rel=RTOL, abs=1e-12)
    # The duality: equivalent at 0.05 iff the 90% interval lies inside the margin.
    assert (r.p < 0.05) == (low < r.ci_low and r.ci_high < high)


def test_tost_hand_cases_and_errors():
  # d = (1, 2, 3), margin 4: t = (2 + 4) / (1/sqrt(3)) and (4 - 2) * sqrt(3) on 2 df; the
  # 2-df cdf is 1/2 + t / (2 sqrt(2 + t^2)), so P(T >= t) = 1/2 - t / (2 sqrt(2 + t^2)).
  r = stats.tost([1.0, 2.0, 3.0], 4.0)
  t = 2 * math.sqrt(3)
  assert r.p == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), rel=1e-12)
  assert stats.tost([0.125, 0.125, 0.125], 0.25).p == 0.0  # no spread, inside (exact binary)
  assert stats.tost([0.375, 0.375], 0.25).p == 1.0  # no spread, outside
  assert math.isnan(stats.tost([0.1], 0.2).p)
  for bad in (0.0, -1.0, (0.3, 0.1), (math.nan, 1.0)):
    with pytest.raises(ValueError, match="margin"):
      stats.tost([1.0, 2.0], bad)


def test_equivalence_claims_are_judged_by_their_own_verdicts():
  eq = stats.Claim("eq", "recipe keeps BF16's end quality", "paired by seed",
                   stats.tost([0.01, -0.02, 0.0, 0.015, -0.005], 0.05), margin=(-0.05, 0.05))
  wide = stats.Claim("wide", "recipe keeps BF16's end quality", "paired by seed",
                     stats.tost([0.1, -0.2, 0.0, 0.15, -0.05], 0.05), margin=(-0.05, 0.05))
  out = stats.judge([eq, wide, _claim("a", -0.2, 0.001)])
  assert [v.verdict for v in out] == ["equivalent", "not shown equivalent", "held"]
  assert out[0].row()["margin"] == [-0.05, 0.05] and out[2].row()["margin"] is None
  assert "90% CI; margin (-0.050, 0.050)" in stats.markdown_table(out)
  with pytest.raises(ValueError, match="margin"):
    stats.Claim("bad", "s", "d", eq.result, margin=(0.1, -0.1))


# ----------------------------------------------------------------------------- coverage


@functools.lru_cache
def _t_factor(n):
  return stats.t_quantile_two_sided(0.05, n - 1)


def _t95(x):
  # paired_t's interval (mean -+ q se, checked against scipy above) with q computed once per n.
  half = _t_factor(x.size) * x.std(ddof=1) / math.sqrt(x.size)
  return x.mean() - half, x.mean() + half


def _boot95(x):
  r = stats.bootstrap_mean_ci(x, rng_seed=0, n_boot=2000)
  return r.ci_low, r.ci_high


def test_percentile_bootstrap_over_three_units_is_their_range():
  # At n = 3 the bootstrap mean takes its smallest value (every draw the minimum) with
  # probability 1/27 = 3.7% > 2.5%, so both percentile ends are the sample's extremes: the
  # "95%" interval is [min, max], which holds a symmetric distribution's mean with probability
  # 1 - 2 (1/2)^3 = 0.75 exactly, whatever its spread.
  rng = np.random.default_rng(3)
  for x in rng.normal(size=(20, 3)):
    assert _boot95(x) == pytest.approx((x.min(), x.max()), rel=1e-14)  # (3x)/3: an ulp
  cover, se = stats.interval_coverage(_boot95, 3, trials=1000, rng_seed=1)
  assert abs(cover - 0.75) < 4 * se
  t_cover, t_se = stats.interval_coverage(_t95, 3, trials=2000, rng_seed=1)
  assert abs(t_cover - 0.95) < 4 * t_se  # Student's interval is exact for normal units


def test_t_interval_covers_95_percent_at_8_units():
  # Exact for normal units (the t pivot); the bound is 4 binomial standard errors of the
  # simulated fraction. Also for a skewed unit distribution (exponential, mean 1) at n = 8 it
  # stays near 95% (a few points below: the t interval is not exact there).
  cover, se = stats.interval_coverage(_t95, 8, trials=4000, rng_seed=2)
  assert abs(cover - 0.95) < 4 * se
  skew, _ = stats.interval_coverage(_t95, 8, trials=4000, rng_seed=3, mean=1.0,
                                    draw=lambda rng, shape: rng.exponential(1.0, shape))
  assert 0.85 < skew < 0.96
  with pytest.raises(ValueError, match="trials"):
    stats.interval_coverage(_t95, 8, trials=0, rng_seed=0)
