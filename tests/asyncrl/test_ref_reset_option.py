"""The simulator's KL-reference-reset plan and sampled-eval options: the plan's steps and the
one-line errors before any compile (the runs themselves: tests/experiments/test_kl_reset.py)."""
import dataclasses

import numpy as np
import pytest

from lowrl.asyncrl import simulator
from lowrl.training.schedule import AsyncSchedule


def test_reset_plan_resets_after_every_kth_update():
  np.testing.assert_array_equal(simulator.reset_plan(7, 3),
                                [False, False, True, False, False, True, False])
  assert not simulator.reset_plan(5, 0).any()  # 0: a fixed reference
  assert simulator.reset_plan(4, 1).all()
  with pytest.raises(ValueError, match="int >= 0"):
    simulator.reset_plan(4, -1)


def _setup(kl_coef: float):
  c = simulator.default_config()
  c.rl.update(steps=2, num_prompts=2, group_size=4, kl_coef=kl_coef)
  return simulator.build(c)


@pytest.mark.parametrize("kl_coef,resets,pass_eval,match", [
    (0.0, (0, 2), (0, 0), "set rl.kl_coef > 0"),
    (0.1, (2,), (0, 0), "one per seed"),
    (0.1, None, (1, 0), "pass_eval_samples >= 1")])
def test_bad_options_fail_before_compiling(kl_coef, resets, pass_eval, match):
  setup = dataclasses.replace(_setup(kl_coef), pass_eval_every=pass_eval[0],
                              pass_eval_samples=pass_eval[1])
  with pytest.raises(ValueError, match=match):
    simulator.simulate(setup, AsyncSchedule(lag=0), (0, 1), ref_reset_every=resets)
