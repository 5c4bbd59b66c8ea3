"""experiments.kl_reset end to end on the tiny config: the arms (no_kl, fixed, reset and a fixed
reference at another beta), the sampled held-out eval at every point, the claims judged at matched
pass@1 and the report written, runs of other seeds pooled; bad knobs fail before any compile."""
import json
import os

import numpy as np
import pytest

from configs import kl_reset as kl_config
from experiments import kl_reset


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  work = tmp_path_factory.mktemp("kl_reset")
  cfg = kl_config.get_config("tiny")
  logs = []
  verdicts = kl_reset.run(cfg, str(work), log=logs.append)
  return cfg, work, verdicts, logs


def test_runs_end_to_end_and_writes_its_report(tiny_run):
  cfg, work, verdicts, _ = tiny_run
  assert [v.claim.name for v in verdicts] == ["collapse", "pass@k", "kl_bites"]
  assert all(v.verdict in ("held", "contradicted", "not resolved") for v in verdicts)
  for name in (kl_reset.RESULTS, kl_reset.REPORT, kl_reset.FIGURE, kl_reset.ARMS_FILE):
    assert os.path.getsize(work / name) > 0
  res = json.loads((work / kl_reset.RESULTS).read_text())
  steps, every = cfg.sim.rl.steps, cfg.pass_eval_every
  assert res["points"] == list(range(0, steps + 1, every))
  names = kl_reset.arm_names(cfg)
  assert names == ("no_kl", "fixed", "reset", "fixed_b0.3") and set(res["arms"]) == set(names)
  counts = {a: np.array(res["arms"][a]["counts"]) for a in names}
  for c in counts.values():  # [seeds, points, prompts], every count a real eval in [0, n]
    assert c.shape == (len(cfg.seeds), len(res["points"]), cfg.sim.eval_num_prompts)
    assert c.min() >= 0 and c.max() <= cfg.pass_samples
  # Paired: every arm starts from the same base (the same compiled init and evals), evaluated on
  # the same prompts with the same keys.
  for arm in ("no_kl", "reset", "fixed_b0.3"):
    np.testing.assert_array_equal(counts[arm][:, 0], counts["fixed"][:, 0])
    np.testing.assert_array_equal(res["arms"][arm]["per_seed"]["greedy_start"],
                                  res["arms"]["fixed"]["per_seed"]["greedy_start"])
  # The reference is the start (fixed) or the params after every K-th update (reset): the KL of
  # update t to it is 0 at t = 0 and, for reset, at every t = K, 2K, ... (mu = 1: the params the
  # loss sees are the reference itself), and > 0 for the fixed reference there.
  kl = {a: np.array(res["arms"][a]["kl_ref"]) for a in names}
  after_reset = np.arange(cfg.ref_reset_every, steps, cfg.ref_reset_every)
  np.testing.assert_allclose(kl["reset"][:, [0, *after_reset]], 0.0, atol=1e-6)
  np.testing.assert_allclose(kl["fixed"][:, 0], 0.0, atol=1e-6)
  assert np.all(kl["fixed"][:, after_reset] > 1e-5)
  np.testing.assert_array_equal(kl["reset"][:, :cfg.ref_reset_every],
                                kl["fixed"][:, :cfg.ref_reset_every])  # same run until a reset
  report = (work / kl_reset.REPORT).read_text()
  assert "| claim |" in report and "pass@k at the end" in report and "unmatched" in report


def test_matched_interpolates_the_fixed_frontier_at_the_reset_runs_pass_at_1():
  # One seed per case; frontier arms at p_hat 0.3 (no_kl), 0.2 (b), 0.1 (fixed), y = 2 p_hat + 1
  # on the frontier: at reset's p_hat 0.15 the matched y is 1.3 (between b and fixed).
  point = lambda p, y: [{"p_hat": p, "y": y}]  # noqa: E731 (one eval point)
  summ = {"no_kl": [point(0.3, 1.6), point(0.3, 1.6)], "b": [point(0.2, 1.4), point(0.2, 1.4)],
          "fixed": [point(0.1, 1.2), point(0.1, 1.2)], "reset": [point(0.15, 9.0),
                                                                 point(0.35, 9.0)]}
  got = kl_reset.matched(summ, ("no_kl", "b", "fixed"), "y")
  assert got[0] == pytest.approx(1.3) and np.isnan(got[1])  # 0.35: outside, no extrapolation


def test_a_second_run_reuses_the_runs_and_pools_other_seeds(tiny_run, tmp_path):
  cfg, work, _, _ = tiny_run
  logs = []
  kl_reset.run(cfg, str(work), log=logs.append)  # nothing runs again
  assert any("reusing" in line for line in logs) and not any("compile" in line for line in logs)
  other = kl_config.get_config("tiny")
  other.seeds = (2, 3)
  kl_reset.run(other, str(tmp_path / "b"))
  pooled = kl_config.get_config("tiny")
  pooled.pool_workdirs = (str(tmp_path / "b"),)
  kl_reset.run(pooled, str(work))
  res = json.loads((work / kl_reset.RESULTS).read_text())
  b = json.loads((tmp_path / "b" / kl_reset.RESULTS).read_text())
  assert res["seeds"] == [0, 1, 2, 3]
  np.testing.assert_array_equal(np.array(res["arms"]["reset"]["counts"])[2:],
                                b["arms"]["reset"]["counts"])
  assert all(v["n"] == 4 for v in res["claims"])
  again = kl_config.get_config("tiny")
  again.pool_workdirs = (str(work),)  # its own seeds twice
  with pytest.raises(ValueError, match="ran twice"):
    kl_reset.run(again, str(work))
  changed = kl_config.get_config("tiny")
  changed.kl_coef = 2.0
  with pytest.raises(ValueError, match="another config"):
    kl_reset.run(changed, str(work))


@pytest.mark.parametrize("knob,value,match", [
    ("seeds", (0,), "at least 2 distinct"), ("kl_coef", 0.0, "coefficient > 0"),
    ("pass_eval_every", 3, "must divide"), ("large_k", 8, "k <= samples"),
    ("ref_reset_every", 0, "int >= 1"), ("fixed_kl_coefs", (1.0,), "distinct values in"),
    ("fixed_kl_coefs", (0.2, 0.2), "distinct values in")])
def test_bad_knobs_fail_before_compiling(knob, value, match):
  cfg = kl_config.get_config("tiny")
  cfg[knob] = value
  with pytest.raises(ValueError, match=match):
    kl_reset.check(cfg)
