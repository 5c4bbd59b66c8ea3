"""Countdown-style arithmetic: reach a target with + - * / using each given number at most once.

Prompt "cd:3,7,20>41=", answer e.g. "3*7+20". Generation is constructive: a random subset (at
least two) of the drawn numbers is combined by random operations, keeping every intermediate a
positive integer, and the result becomes the target; that expression is the reference solution,
so every problem is solvable. Targets equal to one of the numbers are redrawn (trivial).

The verifier (`reward`) accepts any expression that the safe parser in `expressions` reads,
whose integer literals form a sub-multiset of the given numbers, and whose exact (rational)
value equals the target. Spaces are allowed; extra text, unary minus, other characters,
division by zero and reused numbers score 0.
"""
from __future__ import annotations

import collections

import numpy as np

from lowrl.tasks import expressions
from lowrl.tasks.base import Example, ProceduralTask, check_range
from lowrl.tasks.tokenizer import CharTokenizer

PREFIX = "cd:"
_TRIES_PER_DRAW = 1000
FORMAT_CREDIT = 0.1  # partial_reward of a well-formed, number-respecting but wrong expression


class CountdownTask(ProceduralTask):
  """num_numbers integers in [min_number, max_number] and a target in [1, max_target]."""

  name = "countdown"

  def __init__(self, num_numbers: int = 3, min_number: int = 1, max_number: int = 20,
               max_target: int = 100, eval_fraction: float = 0.1,
               tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      num_numbers: how many numbers the prompt gives (>= 2).
      min_number, max_number: range of the numbers (inclusive, >= 1).
      max_target: largest target.
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    check_range("CountdownTask num_numbers", num_numbers, num_numbers, 2)
    check_range("CountdownTask numbers (min_number, max_number)", min_number, max_number, 1)
    check_range("CountdownTask max_target", max_target, max_target, 1)
    self.num_numbers = int(num_numbers)
    self.min_number, self.max_number = int(min_number), int(max_number)
    self.max_target = int(max_target)
    self._check_chars("CountdownTask", PREFIX + "0123456789,>=+-*/()")
    n, w = self.num_numbers, len(str(self.max_number))
    # bos, prefix, numbers with commas, '>', target, '='
    self.max_prompt_len = 1 + len(PREFIX) + n * w + (n - 1) + 1 + len(str(self.max_target)) + 1
    # Minimal parentheses: only non-root operations (at most n - 2) are ever wrapped. Plus eos.
    self.max_answer_len = n * w + (n - 1) + 2 * (n - 2) + 1
    # Fail at construction, not mid-training, if the ranges admit (almost) no problems. A private
    # generator keeps the caller's rng untouched.
    self._draw(np.random.default_rng(0))

  def _combine(self, rng: np.random.Generator, numbers: list[int]) -> tuple[int, expressions.Node]:
    """A random expression over a random subset (>= 2) of `numbers`, with positive integer steps."""
    k = int(rng.integers(2, len(numbers) + 1))
    chosen = [numbers[i] for i in rng.permutation(len(numbers))[:k]]
    pool: list[tuple[int, expressions.Node]] = [(v, v) for v in chosen]
    while len(pool) > 1:
      i, j = (int(t) for t in rng.choice(len(pool), size=2, replace=False))
      (va, ea), (vb, eb) = pool[i], pool[j]
      if va < vb:  # larger first, so '-' stays positive and '/' can be exact
        (va, ea), (vb, eb) = (vb, eb), (va, ea)
      ops = ["+", "*"] + (["-"] if va != vb else []) + (["/"] if va % vb == 0 else [])
      op = ops[int(rng.integers(len(ops)))]
      value = {"+": va + vb, "*": va * vb, "-": va - vb, "/": va // vb}[op]  # vb >= 1 always
      pool = [p for t, p in enumerate(pool) if t not in (i, j)] + [(value, (op, ea, eb))]
    return pool[0]

  def _draw(self, rng: np.random.Generator) -> Example:
    for _ in range(_TRIES_PER_DRAW):
      drawn = rng.integers(self.min_number, self.max_number + 1, size=self.num_numbers)
      numbers = [int(v) for v in drawn]
      target, tree = self._combine(rng, numbers)
      if 1 <= target <= self.max_target and target not in numbers:
        prompt = f"{PREFIX}{','.join(map(str, numbers))}>{target}="
        return Example(prompt=prompt, answer=expressions.render(tree),
                       metadata={"numbers": numbers, "target": target})
    raise ValueError(
        f"CountdownTask found no solvable problem with target in [1, {self.max_target}] in "
        f"{_TRIES_PER_DRAW} tries; widen max_target or the number range.")

  def _key(self, example: Example) -> str:
    # The order the numbers are shown in does not change the problem.
    nums = sorted(example.metadata["numbers"])
    return f"{','.join(map(str, nums))}>{example.metadata['target']}"

  def _check(self, completion: str, example: Example) -> tuple[bool, bool]:
    """(well formed and uses only given numbers, also hits the target)."""
    try:
      value, used = expressions.parse_expression(completion.strip())
    except expressions.ExpressionError:
      return False, False
    if collections.Counter(used) - collections.Counter(example.metadata["numbers"]):
      return False, False  # a number not given, or one used more often than given
    return True, value == example.metadata["target"]

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if self._check(completion, example)[1] else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """1.0 correct; FORMAT_CREDIT for a valid expression over the given numbers that misses; else 0."""
    valid, correct = self._check(completion, example)
    return 1.0 if correct else (FORMAT_CREDIT if valid else 0.0)
