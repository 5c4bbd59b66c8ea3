"""experiments.report's claims on synthetic results lines: paired by seed (and by prompt / batch
for experiments.paired's measurements), Holm over the report, verdicts. No JAX programs."""
import dataclasses

import numpy as np
import pytest

from experiments.report import backward, components, recipe_vs_bf16, sr_cast
from experiments.report import claims as report_claims, registry
from lowrl.analysis import stats

SEEDS = range(5)


def _line(setting, seed, *, twin_end, twin_start=0.1, start=0.3, end=0.4, grad_cos=0.8,
          pass_k=None):
  return {"setting": setting, "group": "recipe", "seed": seed, "wall_s": 1.0,
          "eval_start": {"pass_at_1": start, "greedy": 0.5},
          "eval_end": {"pass_at_1": end, "greedy": 0.45},
          "twin_kl_k3_start": twin_start, "twin_kl_k3_end": twin_end, "grad_cos": grad_cos,
          "pass_at_k_start": {"1": start, "4": start + 0.2},
          "pass_at_k_end": {"1": end, "4": end + 0.2 if pass_k is None else pass_k}}


def _results():
  seed_level = np.array([0.05, -0.04, 0.08, -0.06, 0.0])  # seed spread shared by settings
  out = []
  for s in SEEDS:
    lvl = 0.2 + seed_level[s]
    out += [_line("bf16", s, twin_end=0.0, twin_start=0.0, start=0.30, end=0.35 + 0.001 * s),
            _line("nvfp4_naive", s, twin_end=lvl, end=0.40 + seed_level[s]),
            # 0.02 below naive on every seed (+ tiny noise): far inside the seed spread
            _line("nvfp4_recipe", s, twin_end=lvl - 0.02 + 1e-4 * s, end=0.36 + seed_level[s]),
            _line("nvfp4_recipe_qbwd", s, twin_end=lvl, grad_cos=0.8 + 0.01 * (s % 2))]
  return out


def _by_name(verdicts):
  return {v.claim.name: v for v in verdicts}


def test_seed_paired_claims_resolve_what_the_seed_spread_hides():
  results = _results()
  v = _by_name(stats.judge(report_claims.grid_claims(results)))
  # RL gain at BF16: end - start of the same runs, 0.05 + 0.001 s: held.
  assert v["rl_gain"].verdict == "held" and v["rl_gain"].claim.result.n == 5
  assert v["rl_gain"].claim.result.mean == pytest.approx(0.052)
  # The recipe's gain is closer to BF16's than naive's on every seed: |0.06| vs |0.10| + noise
  assert v["recipe_vs_naive_outcome"].claim.result.mean < 0
  # Dequantized vs quantized backward: 0.8 vs 0.8 / 0.81 alternating: not resolved at n = 5.
  assert v["backward_probe"].verdict == "not resolved"
  # The twin KL (k3) is in no claim (invalid for naive NVFP4's mismatched scales).
  assert not any("twin" in c.design and "k3" in c.design for c in (x.claim for x in v.values()))
  # Settings that did not run give no claim (the build-up's middle rungs, SR, KL reset).
  assert not any(n.startswith(("component_", "cast_", "kl_reset")) for n in v)


def test_recipe_vs_bf16_is_an_equivalence_with_the_registered_margin():
  """End pass@1 and gain: recipe - BF16 per seed. 0.004 +- 0.002 across seeds (inside the toy's
  ±0.024): equivalent; shifted by 0.03 (outside): not shown equivalent. The TOST's numbers are
  stats.tost's on the same differences with the registry's margin."""
  rng = np.random.default_rng(5)
  lvl = rng.normal(0, 0.05, 8)  # seed level shared by the two settings
  d = 0.004 + rng.normal(0, 0.002, 8)

  def lines(shift):
    out = []
    for s in range(8):
      out += [_line("bf16", s, twin_end=0.0, start=0.3, end=0.35 + lvl[s]),
              _line("nvfp4_recipe", s, twin_end=0.1, start=0.3, end=0.35 + lvl[s] + d[s] + shift)]
    return out
  v = _by_name(stats.judge(report_claims.grid_claims(lines(0.0))))
  margin = registry.margin("ablate", "recipe_equiv_end_pass_at_1")
  for name in ("recipe_equiv_end_pass_at_1", "recipe_equiv_gain"):
    c = v[name].claim
    assert c.margin == (-margin.delta, margin.delta) and v[name].verdict == "equivalent"
    want = stats.tost(d, margin.delta)
    assert dataclasses.astuple(c.result) == pytest.approx(dataclasses.astuple(want), rel=1e-9)
  v = _by_name(stats.judge(report_claims.grid_claims(lines(0.03))))
  assert v["recipe_equiv_end_pass_at_1"].verdict == "not shown equivalent"
  # The regime's margin is its own.
  r = _by_name(stats.judge(report_claims.grid_claims(lines(0.0), "ablate_regime")))
  assert r["recipe_equiv_gain"].claim.margin == registry.margin(
      "ablate_regime", "recipe_equiv_gain").bounds


def test_paired_measurement_claims():
  rng = np.random.default_rng(1)
  base = rng.exponential(0.2, size=200)  # per-prompt KL of naive NVFP4
  lad = {"nvfp4_naive": base, "+per_token": base * 0.9 + rng.normal(0, 1e-3, 200),
         "+4/6": base * 0.9 + rng.normal(0, 1e-3, 200),  # no change on average: not resolved
         "+bf16_tail": base * 0.7}
  n = 20
  modes = {m: {"cos_fp32": list(c + rng.normal(0, 1e-3, n)),
               "cos_exact": list(e + rng.normal(0, 1e-3, n)),
               "heldout_delta": list(h + rng.normal(0, 1e-6, n))}
           for m, c, e, h in (("high_precision", 0.82, 0.95, -1e-4),
                              ("dequantized", 0.80, 1.0, -1e-4),
                              ("quantized", 0.79, 0.90, -9e-5))}
  paired = {"forward_ladder": {"kl": {k: list(x) for k, x in lad.items()}},
            "backward": {"modes": modes, "heldout_base": 0.1}}
  v = _by_name(stats.judge(report_claims.paired_claims(paired)))
  assert v["ladder_+per_token"].verdict == "held"
  assert v["ladder_+4/6"].verdict == "not resolved"
  assert v["ladder_+bf16_tail"].verdict == "held"
  assert v["ladder_+per_token"].claim.result.n == 200
  assert v["backward_cos_fp32_dequantized_vs_quantized"].verdict == "held"
  assert v["backward_cos_fp32_dequantized_vs_high_precision"].verdict == "contradicted"
  assert v["backward_cos_exact_quantized_vs_high_precision"].verdict == "contradicted"
  assert v["backward_heldout_delta_dequantized_vs_quantized"].verdict == "held"
  assert v["backward_heldout_delta_dequantized_vs_high_precision"].verdict == "not resolved"
  md = "\n".join(components.ladder_section(paired["forward_ladder"]) + backward.sections(paired))
  assert "| dequantized | 20 |" in md and "| +bf16_tail | 200 |" in md


def test_outlier_claims_pair_the_planted_factor_by_prompt():
  """Hand-computed: per prompt, planted naive KL = unplanted + 0.1 (raise 0.1 exactly); per-token
  + 4/6 remove 0.08 more with the outliers than without on every prompt but for noise."""
  rng = np.random.default_rng(2)
  off_naive = rng.exponential(0.2, size=50)
  off_46 = off_naive * 0.95
  on_naive = off_naive + 0.1
  on_46 = off_46 + 0.1 - 0.08 + rng.normal(0, 1e-3, 50)
  ladder = {"kl": {"nvfp4_naive": list(on_naive), "+4/6": list(on_46)},
            "kl_unplanted": {"nvfp4_naive": list(off_naive), "+4/6": list(off_46)}}
  claims = {c.name: c for c in components.outlier_claims(ladder)}
  raised = claims["outliers_raise_naive_kl"].result
  assert raised.n == 50 and raised.mean == pytest.approx(0.1, abs=1e-12)
  removed = claims["outliers_per_token_46_remove_more"].result
  expected = (on_naive - on_46) - (off_naive - off_46)
  assert removed.mean == pytest.approx(float(np.mean(expected)), rel=1e-12)
  assert removed.mean == pytest.approx(0.08, abs=1e-3)
  v = _by_name(stats.judge(list(claims.values())))
  assert v["outliers_raise_naive_kl"].verdict == "held"
  assert v["outliers_per_token_46_remove_more"].verdict == "held"
  # The other way round (outliers that lower the KL) is contradicted, not "held".
  flipped = {"kl": ladder["kl_unplanted"], "kl_unplanted": ladder["kl"]}
  v = _by_name(stats.judge(components.outlier_claims(flipped)))
  assert v["outliers_raise_naive_kl"].verdict == "contradicted"
  # A ladder without the unplanted arm has no outlier claim.
  assert components.outlier_claims({"kl": ladder["kl"]}) == []


def test_distance_claims_pair_the_trajectory_part_by_seed():
  rng = np.random.default_rng(2)
  lines = []
  for s in SEEDS:
    lvl = 0.1 + 0.05 * (s - 2)  # a seed moves both settings alike
    for name, shift in (("nvfp4_naive", 0.0), ("nvfp4_recipe", -0.01)):
      per_prompt = lvl + shift + rng.normal(0, 1e-4, 16)
      lines.append({"setting": name, "seed": s, "static_start": list(per_prompt * 0 + 0.2),
                    "static_end": list(per_prompt * 0 + 0.2), "trajectory_end": list(per_prompt)})
  v = _by_name(stats.judge(recipe_vs_bf16.distance_claims(lines)))
  assert set(v) == {"recipe_equiv_trajectory", "trajectory_recipe_vs_naive"}
  r = v["trajectory_recipe_vs_naive"]
  assert r.verdict == "held" and r.claim.result.n == 5
  assert r.claim.result.mean == pytest.approx(-0.01, abs=2e-4)
  md = "\n".join(recipe_vs_bf16.distance_table(lines))
  assert "| nvfp4_recipe | 5 | 0.2000 | 0.2000 |" in md


# -- the seed's SR arm: FP32 master + BF16 RTN cast / SR cast, FP16 ----------------------------

LRS = ("2e-4", "2e-5", "2e-6")


def _cast_lines(gains, ref_kls=None, seeds=SEEDS):
  """Results lines of the arm: gains[arm][lr] is a per-seed array (or a number)."""
  out = []
  for arm, by_lr in gains.items():
    for lr, g in by_lr.items():
      for s in seeds:
        gs = float(np.broadcast_to(g, (len(seeds),))[s])
        kl = 0.01 if ref_kls is None else float(np.broadcast_to(ref_kls[arm][lr], (len(seeds),))[s])
        out.append({"setting": f"{arm}@{lr}", "group": "sr", "seed": s, "wall_s": 1.0,
                    "eval_start": {"pass_at_1": 0.3, "greedy": 0.5},
                    "eval_end": {"pass_at_1": 0.3 + gs, "greedy": 0.5}, "ref_kl_k3_end": kl,
                    "overrides": {"optimizer.lr": float(lr)}})
  return out


def test_sr_cast_claims_find_the_lagging_lr_from_data_and_test_the_gap():
  rng = np.random.default_rng(3)
  seed = np.array([0.03, -0.02, 0.01, -0.04, 0.02])  # shared by the arms of a seed
  noise = lambda: rng.normal(0, 1e-3, 5)  # noqa: E731
  # A lag at 2e-5 and 2e-6 (FP16 above RTN); SR at FP16's level: the lowest lagging lr is 2e-6.
  gains = {"fp32_master": {"2e-4": 0.05 + seed + noise(), "2e-5": 0.02 + seed + noise(),
                           "2e-6": 0.00 + seed + noise()},
           "bf16_sr_cast": {"2e-4": 0.05 + seed + noise(), "2e-5": 0.03 + seed + noise(),
                            "2e-6": 0.01 + seed + noise()},
           "fp16": {"2e-4": 0.049 + seed + noise(), "2e-5": 0.03 + seed + noise(),
                    "2e-6": 0.01 + seed + noise()}}
  kls = {a: {lr: (0.02 if a != "fp32_master" and lr == "2e-6" else 0.01) + 1e-4 * noise()
             for lr in LRS} for a in gains}
  results = _cast_lines(gains, kls)
  lr, lags = sr_cast.lag_lr(results)
  assert lr == "2e-6" and list(lags) == list(LRS) and lags["2e-4"] < 0 < lags["2e-5"]
  v = _by_name(stats.judge(report_claims.grid_claims(results)))
  assert {f"cast_lag@{t}" for t in LRS} <= set(v)  # the lag at every lr: none chosen by data
  assert v["cast_lag@2e-6"].verdict == "held" and v["cast_lag@2e-4"].verdict != "held"
  g = v["cast_sr_closes_gap_gain"]
  assert g.verdict == "held" and "lr 2e-6" in g.claim.design
  assert g.claim.result.mean == pytest.approx(0.005, abs=2e-3)  # SR - midpoint(RTN, FP16)
  assert v["cast_sr_closes_gap_ref_kl"].verdict == "held"
  # SR no better than RTN: contradicted (it is below the midpoint on every seed).
  for lr_ in LRS:
    gains["bf16_sr_cast"][lr_] = gains["fp32_master"][lr_] + noise()
  v = _by_name(stats.judge(sr_cast.sr_cast_claims(_cast_lines(gains, kls))))
  assert v["cast_sr_closes_gap_gain"].verdict == "contradicted"
  md = "\n".join(sr_cast.section(_cast_lines(gains, kls)))
  assert "**2e-6**" in md and "| 2e-6 |" in md


def test_sr_cast_claim_without_a_lag_is_not_tested():
  same = {a: {lr: 0.02 + 0.0 * np.arange(5) for lr in LRS}
          for a in ("fp32_master", "bf16_sr_cast", "fp16")}
  same["fp16"] = {lr: 0.01 + 1e-3 * np.arange(5) for lr in LRS}  # FP16 below RTN everywhere
  v = _by_name(stats.judge(sr_cast.sr_cast_claims(_cast_lines(same))))
  assert sr_cast.lag_lr(_cast_lines(same))[0] is None
  assert v["cast_sr_closes_gap_gain"].verdict == "not tested"
  assert v["cast_sr_closes_gap_ref_kl"].verdict == "not tested"


def test_choosing_the_lr_by_the_lag_does_not_make_the_gap_claim_pass():
  """Under the null (the three arms equal in distribution, independent seed noise of equal
  variance) the chosen lr's gap claim holds no more often than the t-test's one-sided level:
  P(held) = 0.025 when the statistic is independent of the choice, which it is here (jointly
  normal and uncorrelated). 200 grids: held ~ Binomial(200, 0.025), mean 5, P(>= 15) < 1e-3."""
  rng = np.random.default_rng(4)
  held = 0
  for _ in range(200):
    gains = {a: {lr: rng.normal(0.02, 0.01, 5) for lr in LRS}
             for a in ("fp32_master", "bf16_sr_cast", "fp16")}
    claims = [c for c in sr_cast.sr_cast_claims(_cast_lines(gains))
              if c.name == "cast_sr_closes_gap_gain"]
    if claims and not np.isnan(claims[0].result.p):
      held += stats.verdict_of(claims[0].result.mean, claims[0].result.p, +1) == "held"
  assert held < 15, held
