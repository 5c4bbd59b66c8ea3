"""The pace logged to TensorBoard: the learning rate is the optimizer's own schedule at each RL
step's first update; the step time and tokens/s come from the clock."""
import numpy as np
import pytest
import tiny

from lowrl.training import optimizer, pace


def _cfg(**opt):
  c = tiny.loop_config("fp32")
  c.rl.update(steps=10, mu=2, num_minibatches=2, num_prompts=4, group_size=4)
  c.optimizer.update(lr=1e-3, schedule="cosine", warmup_steps=4, final_lr_fraction=0.1, **opt)
  return c


def test_lr_is_the_learning_rate_the_optimizer_applies_at_each_steps_first_update():
  cfg = _cfg()
  p = pace.Pace.from_config(cfg)
  tx = optimizer.make_optimizer(cfg.optimizer, 10 * 2 * 2)  # the Trainer's: steps x mu x batches
  # Adam on a constant gradient from zero params: every bias-corrected step is m/sqrt(v) = 1
  # (times 1 / (1 + eps)), and weight decay of zero params is zero, so |update| = lr of the update.
  params = {"w": np.zeros(1, np.float32)}
  state = tx.init(params)
  applied = []
  for _ in range(40):
    upd, state = tx.update({"w": np.full(1, 0.5, np.float32)}, state, params)
    applied.append(-float(upd["w"][0]))
  for step in range(10):  # RL step `step`'s first update is update 4 * step
    assert p.lr(step) == pytest.approx(applied[4 * step], rel=1e-6, abs=1e-12)
  assert p.lr(0) == 0.0  # warmup from 0
  assert p.lr(1) == pytest.approx(1e-3)  # the peak, after 4 warmup updates
  assert p.lr(9) < p.lr(5) < p.lr(1)


def test_step_time_and_tokens_per_second():
  clock = iter([100.0, 102.5])
  p = pace.Pace.from_config(_cfg(), clock=lambda: next(clock))
  p.start()
  got = p.scalars(3, response_length=5.0)
  assert got["run/step_time_s"] == 2.5
  assert got["run/tokens_per_s"] == 5.0 * 16 / 2.5  # 4 prompts x 4 samples of 5 tokens each
  assert got["run/lr"] == p.lr(3)


def test_scalars_before_start_is_an_error():
  with pytest.raises(RuntimeError, match="start"):
    pace.Pace.from_config(_cfg()).scalars(0, 1.0)
