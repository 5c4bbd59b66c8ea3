"""An RL run whose rollouts all score 0 (so every advantage and the gradient are 0) says so after
zero_reward.STEPS steps, once per streak, with one completion next to its answer."""
import numpy as np
import pytest

import tiny
from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.base import Example
from lowrl.training import loop, zero_reward


def test_the_warning_comes_once_per_streak_of_all_zero_steps():
  w = zero_reward.ZeroRewardWatch(steps=3)
  ex, done = [Example("1+1=", "2")], []
  rewards = [[0, 0], [0, 0], [0, 0], [0, 0], [0, 1], [0, 0], [0.0, 0.0], [0, 0]]
  for step, r in enumerate(rewards, start=1):
    if w.update(step, r, ex, ["3"]):
      done.append(step)
  assert done == [3, 8]  # steps 1-3, then the streak 6-8 after step 5's reward
  line = zero_reward.ZeroRewardWatch(steps=1).update(7, np.zeros(4), ex, ["3"])
  assert line.startswith("[warn] steps 7-7: every rollout scored reward 0")
  assert "One of step 7's: '1+1=' -> '3' (answer '2')." in line
  assert "--config.task.chat_template=True" in line and "--config.rl.max_new_tokens" in line
  assert zero_reward.ZeroRewardWatch(steps=1).update(1, [0.0, np.nan]) is None  # not all zero
  with pytest.raises(ValueError):
    zero_reward.ZeroRewardWatch(steps=0)


def test_a_run_whose_rewards_are_all_zero_warns(tmp_path, monkeypatch):
  monkeypatch.setattr(AdditionTask, "rewards",
                      lambda self, completions, examples: np.zeros(len(completions), np.float32))
  cfg = tiny.loop_config("fp32", str(tmp_path / "bases"), steps=zero_reward.STEPS, sft_steps=0)
  cfg.eval_every = 0
  lines = []
  loop.run(cfg, str(tmp_path / "run"), lines.append)
  warnings = [line for line in lines if "every rollout scored reward 0" in line]
  assert len(warnings) == 1, lines
  assert warnings[0].startswith(f"[warn] steps 1-{zero_reward.STEPS}: ")
  # Printed right after the step that completes the streak, before its progress line.
  i = lines.index(warnings[0])
  assert lines[i + 1].startswith(f"[rl] step {zero_reward.STEPS}/{zero_reward.STEPS} reward 0.000")
