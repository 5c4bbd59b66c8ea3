"""Reward against drift (lowrl.asyncrl.capacity, lowrl.asyncrl.report) on hand-built sweep rows:
the paired gain, the segmented fit and its crossing, the interchangeability coefficient, the
phase table's paired-test marks, and the report end to end (no simulation: rows are written by
hand, the clocks come from the cost model)."""
import dataclasses
import math
import os

import numpy as np
import pytest

from lowrl.analysis import stats
from lowrl.asyncrl import capacity as cap
from lowrl.asyncrl import report, simulator, summary

SEEDS = [0, 1, 2]


def _row(name, sampler="bf16", corr="none", lag=0, end=(0.8, 0.8, 0.8), start=(0.6, 0.6, 0.6),
         quant=0.0, stale=0.0, lr=1e-3):
  per_seed = {"eval_start": list(start), "eval_end": list(end), "reward_final": list(end)}
  for part, v in (("quantization", quant), ("staleness", stale), ("total", quant + stale)):
    per_seed[f"{part}_k1"] = [v] * 3
    per_seed[f"{part}_k3"] = [v / 2] * 3
  return {"name": name, "sampler_recipe": sampler, "trainer_recipe": "bf16", "correction": corr,
          "lag_used": lag, "lr": lr, "seeds": SEEDS, "steps": 100, "per_seed": per_seed,
          "eval_end": float(np.mean(end)), "eval_end_std": float(np.std(end)),
          "eval_curve_steps": [0, 50, 100],
          "eval_curve": [[s, (s + e) / 2, e] for s, e in zip(start, end)]}


def test_gain_and_retained_are_paired_by_seed():
  base = _row("base", end=(0.8, 0.9, 0.7), start=(0.6, 0.6, 0.5))  # BF16 gain: mean 0.233...
  other = _row("x", sampler="nvfp4_naive", end=(0.7, 0.85, 0.7), quant=0.1)
  other["seeds"] = [2, 0, 1]  # another seed order: pairing goes by seed, not position
  other["per_seed"]["eval_end"] = [0.7, 0.7, 0.85]
  paired = {p.row["name"]: p for p in cap.pair_with_base([base, other])}
  np.testing.assert_allclose(paired["x"].gain, [0.7 - 0.8, 0.85 - 0.9, 0.7 - 0.7])
  g = (0.2 + 0.3 + 0.2) / 3
  np.testing.assert_allclose(paired["x"].retained, 1 + paired["x"].gain / g)
  np.testing.assert_allclose(paired["base"].gain, 0.0)


def test_a_context_where_bf16_does_not_resolvably_learn_has_no_retained():
  # BF16's own gains 0.1, -0.05, 0.0: mean 0.017, its 95% CI reaches 0, so retained (a ratio
  # to that gain) is undefined there and stays out of the fits; the gain is still paired.
  base = _row("base", end=(0.7, 0.55, 0.6), start=(0.6, 0.6, 0.6))
  other = _row("x", sampler="nvfp4_naive", end=(0.6, 0.5, 0.6), quant=0.1)
  paired = {p.row["name"]: p for p in cap.pair_with_base([base, other])}
  np.testing.assert_allclose(paired["x"].gain, [-0.1, -0.05, 0.0])
  assert np.all(np.isnan(paired["x"].retained)) and np.all(np.isnan(paired["base"].retained))
  assert cap.capacity(list(paired.values()), "none") is None


def test_segmented_fit_recovers_a_hinge_and_its_crossing():
  x = np.linspace(-5, -1, 9)
  y = 1.0 - 0.4 * np.maximum(x - (-3.0), 0)
  a, b, c = cap.segmented_fit(x, y)
  assert (a, b, c) == pytest.approx((1.0, 0.4, -3.0), abs=1e-9)
  # 1 - 0.4 (x + 3) = 0.5 at x = -3 + 0.5 / 0.4 = -1.75.
  assert cap.crossing((a, b, c), 0.5) == pytest.approx(-1.75)
  assert cap.crossing((1.0, 0.0, -1.0), 0.5) == math.inf  # flat: never reaches the level
  assert cap.crossing((0.3, 0.1, -1.0), 0.5) == -math.inf  # below it already


def _capacity_rows():
  """Retained = 1 up to k1 1e-3, then -0.5 per decade: 0.5 at k1 1e-2 (D* = 1e-2)."""
  rows = [_row("base")]
  g = 0.2
  for i, k1 in enumerate([1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]):
    retained = 1 - 0.5 * max(math.log10(k1) + 3, 0)
    end = 0.8 + (retained - 1) * g
    rows.append(_row(f"s{i}", sampler="nvfp4_naive" if i % 2 else "bf16", lag=i, end=(end,) * 3,
                     quant=k1 * (i % 2), stale=k1 * (1 - i % 2)))
  return rows


def test_capacity_locates_the_drift_where_half_the_gain_is_left():
  k = cap.capacity(cap.pair_with_base(_capacity_rows()), "none")
  assert k.log_d == pytest.approx(-2.0, abs=1e-9)
  assert k.ci == pytest.approx((-2.0, -2.0), abs=1e-9)  # identical seeds: no spread
  assert "0.01" in k.text()
  assert cap.capacity(cap.pair_with_base(_capacity_rows()), "tis") is None  # no tis settings


def test_interchangeability_coefficient_is_the_quant_share_effect():
  rows = _capacity_rows()
  paired = cap.pair_with_base(rows)
  alike = cap.interchangeability(paired)
  assert alike.mean == pytest.approx(0.0, abs=1e-9)
  # Quantization-dominated settings lose 0.3 more retained at the same total drift.
  for r in rows[1:]:
    share = r["per_seed"]["quantization_k1"][0] / r["per_seed"]["total_k1"][0]
    r["per_seed"]["eval_end"] = [e - 0.3 * 0.2 * share for e in r["per_seed"]["eval_end"]]
  gamma = cap.interchangeability(cap.pair_with_base(rows))
  assert gamma.mean == pytest.approx(-0.3, abs=1e-9)


def test_phase_table_marks_only_paired_significant_losses():
  base = _row("base", end=(0.80, 0.82, 0.78))
  lost = _row("lost", lag=8, end=(0.60, 0.63, 0.57))  # every seed 0.2 below its base
  noisy = _row("noisy", lag=2, end=(0.70, 0.92, 0.75))  # mixed signs: not significant
  table = summary.phase_table([base, lost, noisy])
  cells = dict(zip(["lag 0", "lag 2", "lag 8"], table.splitlines()[-1].split(" | ")[2:]))
  assert "✗" in cells["lag 8"] and "✗" not in cells["lag 2"] and "✗" not in cells["lag 0"]


def test_report_writes_its_sections_and_figures(tmp_path):
  rows = _capacity_rows()
  cfgs = {}
  for r in rows:
    c = simulator.default_config()
    c.sampler_recipe = r["sampler_recipe"]
    c.rl.steps = r["steps"]
    cfgs[r["name"]] = c
  text = report.capacity_sections(rows, cfgs, str(tmp_path))
  assert "## Reward against drift" in text and "### Correction capacity" in text
  assert "**h200**" in text and "**b200**" in text
  for png in ("reward_vs_drift.png", "pareto.png"):
    assert os.path.getsize(tmp_path / png) > 10_000
  # The recipe column: the simulated model's layers a recipe keeps in BF16 (2 layers here).
  assert "| nvfp4_naive | none | 1 | main | 0.00 |" in text
  hours = report.time_to_target(rows[0], [0.7, 0.6, 0.95], step_s=3600.0)  # 1 h per step
  # Seed 0: the mid-run eval (0.7) is the first at or above 0.7; seed 1: the start; seed 2: never.
  assert hours == [50.0, 0.0, math.inf]


def test_capacity_below_the_smallest_drift_is_censored():
  """Retained is already -1 at the smallest drift measured (0.1): the crossing lies between the
  base's floor and it, an interpolation, reported as '< 0.1'."""
  rows = [_row("base"), _row("a", lag=2, end=(0.4,) * 3, stale=0.1),
          _row("b", lag=6, end=(0.35,) * 3, stale=0.3)]
  k = cap.capacity(cap.pair_with_base(rows), "none")
  assert k.log_d < -1 and k.text().startswith("< 0.1")


def test_interchangeability_is_judged_in_a_family_of_its_own():
  # Ten per-setting claims at p 0.01 are Holm-adjusted together (0.1); the primary hypothesis
  # keeps its own p (0.01) and, with gamma > 0, is contradicted (staleness costs more).
  paired = cap.pair_with_base(_capacity_rows())
  some = [p for p in paired if not cap._is_base(p.row)][:1] * 10
  at = stats.PairedResult(n=3, mean=-0.1, ci_low=-0.15, ci_high=-0.05, p=0.01)
  some = [dataclasses.replace(p, test=at) for p in some]
  gamma = stats.PairedResult(n=3, mean=0.4, ci_low=0.3, ci_high=0.5, p=0.01)
  verdicts = cap.claims(some, gamma)
  assert [v.p_holm for v in verdicts[:-1]] == pytest.approx([0.1] * 10)
  assert verdicts[-1].claim.name == "interchangeable"
  assert verdicts[-1].p_holm == pytest.approx(0.01)
  assert verdicts[-1].verdict == "contradicted"


def test_context_labels_name_the_knobs_where_a_setting_leaves_the_usual_context():
  cfgs = {name: simulator.default_config() for name in ("a", "b", "c", "d")}
  cfgs["c"].async_rl.sync_every = 4
  cfgs["d"].optimizer.lr = 3e-4
  cfgs["d"].rl.num_prompts = 16
  labels = report.context_labels(["a", "b", "c", "d", "not_run"], cfgs)
  assert labels == {"a": "main", "b": "main", "c": "sync=4", "d": "np=16 lr=0.0003",
                    "not_run": "–"}
