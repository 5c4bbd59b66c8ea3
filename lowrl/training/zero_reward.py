"""The warning for an RL run that cannot learn: every rollout scored reward 0.

With every reward of a batch 0, every group's rewards are equal, so the group-relative advantages
(GRPO, Dr.GRPO, RLOO) are all 0 and so is the policy gradient: the steps run, the metrics look
calm, and the policy learns nothing (AdamW's momentum from earlier steps and its weight decay
still move the weights). It happens when the starting policy never produces an answer
the verifier accepts (a checkpoint prompted without its chat template, a completion budget too
short for the answer, the wrong verifier, an eos token that never comes). After `STEPS`
consecutive such steps the run says so once, with one of the step's completions next to its
answer, and goes on (a later reward can still start learning).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Consecutive all-zero-reward steps before the warning.
STEPS = 3


class ZeroRewardWatch:
  """Counts consecutive RL steps whose rollouts all scored 0; `update` returns the warning line
  once per such streak of `steps` steps, else None."""

  def __init__(self, steps: int = STEPS):
    if steps < 1:
      raise ValueError(f"steps must be >= 1, got {steps}.")
    self.steps = steps
    self._streak = 0

  def update(self, done: int, rewards: Sequence[float], examples: Sequence[Any] = (),
             completions: Sequence[str] = ()) -> str | None:
    """Call after step `done` with its task rewards (and, for the example shown, its examples
    and completions)."""
    rewards = np.asarray(rewards)
    self._streak = self._streak + 1 if rewards.size and not np.any(rewards) else 0
    if self._streak != self.steps:
      return None
    sample = ""
    if len(examples) and len(completions):
      e, c = examples[0], completions[0]
      sample = f" One of step {done}'s: {e.prompt[-80:]!r} -> {c[:80]!r} (answer {e.answer!r})."
    return (f"[warn] steps {done - self.steps + 1}-{done}: every rollout scored reward 0, so every "
            "group's advantages and the policy gradient are 0: nothing is learned from them (only "
            "the optimizer's momentum from earlier steps and its weight decay move the weights)."
            f"{sample} Check that the policy can produce an accepted answer: the verifier "
            "(--config.task.verifier), the prompt format (--config.task.chat_template=True for "
            "an instruct checkpoint), the completion budget (--config.rl.max_new_tokens) and the "
            "eos token (--config.model.eos_token); the samples are in TensorBoard's TEXT tab.")
