"""experiments.kl_reset end to end on the tiny config: three arms, the sampled held-out eval at
every point, the claims judged and the report written, runs of other seeds pooled; bad knobs fail
before any compile."""
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
  counts = {a: np.array(res["arms"][a]["counts"]) for a in kl_reset.ARMS}
  for c in counts.values():  # [seeds, points, prompts], every count a real eval in [0, n]
    assert c.shape == (len(cfg.seeds), len(res["points"]), cfg.sim.eval_num_prompts)
    assert c.min() >= 0 and c.max() <= cfg.pass_samples
  # Paired: every arm starts from the same base (the same compiled init and evals), evaluated on
  # the same prompts with the same keys.
  for arm in ("no_kl", "reset"):
    np.testing.assert_array_equal(counts[arm][:, 0], counts["fixed"][:, 0])
    np.testing.assert_array_equal(res["arms"][arm]["per_seed"]["greedy_start"],
                                  res["arms"]["fixed"]["per_seed"]["greedy_start"])
  # The reference is the start (fixed) or the params after every K-th update (reset): the KL of
  # update t to it is 0 at t = 0 and, for reset, at every t = K, 2K, ... (mu = 1: the params the
  # loss sees are the reference itself), and > 0 for the fixed reference there.
  kl = {a: np.array(res["arms"][a]["kl_ref"]) for a in kl_reset.ARMS}
  after_reset = np.arange(cfg.ref_reset_every, steps, cfg.ref_reset_every)
  np.testing.assert_allclose(kl["reset"][:, [0, *after_reset]], 0.0, atol=1e-6)
  np.testing.assert_allclose(kl["fixed"][:, 0], 0.0, atol=1e-6)
  assert np.all(kl["fixed"][:, after_reset] > 1e-5)
  np.testing.assert_array_equal(kl["reset"][:, :cfg.ref_reset_every],
                                kl["fixed"][:, :cfg.ref_reset_every])  # same run until a reset
  report = (work / kl_reset.REPORT).read_text()
  assert "| claim |" in report and "pass@k at the end" in report


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
    ("ref_reset_every", 0, "int >= 1")])
def test_bad_knobs_fail_before_compiling(knob, value, match):
  cfg = kl_config.get_config("tiny")
  cfg[knob] = value
  with pytest.raises(ValueError, match=match):
    kl_reset.check(cfg)
