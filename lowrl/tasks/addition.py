"""Multi-digit addition: "12+345=" -> "357".

Each operand's digit count is drawn uniformly from 1..num_digits, then the operand uniformly among
numbers of that length. Mixing lengths gives a small model easy problems to learn from first,
which keeps pass@k of a briefly mid-trained base clearly above zero (docs/reference.md §6).

`reverse_answer=True` writes the sum least-significant digit first ("12+345=" -> "753"): each
output digit then depends only on digits already seen plus one carry, which small transformers
learn with far fewer examples (Lee et al. 2023, "Teaching Arithmetic to Small Transformers").
The default is the ordinary order at 3 digits, where the mixed lengths supply easy problems;
if a short mid-training run leaves pass@k near zero, switch on `reverse_answer` or lower
`num_digits` rather than starting RL.
"""
from __future__ import annotations

import numpy as np

from lowrl.tasks import verifiers
from lowrl.tasks.base import Example, ProceduralTask, check_range
from lowrl.tasks.tokenizer import CharTokenizer


class AdditionTask(ProceduralTask):
  """a+b= with a, b of 1..num_digits digits; the answer is the canonical decimal sum.

  Reward: 1.0 iff the stripped completion is exactly the (possibly reversed) canonical sum (no
  sign, no leading zeros, no inner spaces). partial_reward: `positional_credit` aligned at the
  least-significant digit.
  """

  name = "addition"

  def __init__(self, num_digits: int = 3, min_digits: int = 1, reverse_answer: bool = False,
               eval_fraction: float = 0.1, tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      num_digits: the most digits an operand has.
      min_digits: the fewest digits an operand has.
      reverse_answer: write the sum least-significant digit first.
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    check_range("AdditionTask digits (min_digits, num_digits)", min_digits, num_digits, 1)
    if num_digits > 18:
      raise ValueError(f"num_digits={num_digits}; use at most 18 (operands are int64).")
    self.num_digits = int(num_digits)
    self.min_digits = int(min_digits)
    self.reverse_answer = bool(reverse_answer)
    self._check_chars("AdditionTask", "0123456789+=")
    self.max_prompt_len = 1 + 2 * self.num_digits + 2  # bos, a, '+', b, '='
    self.max_answer_len = self.num_digits + 1 + 1  # the sum has at most one more digit; eos

  def _operand(self, rng: np.random.Generator) -> int:
    d = int(rng.integers(self.min_digits, self.num_digits + 1))
    lo = 0 if d == 1 else 10**(d - 1)
    return int(rng.integers(lo, 10**d))

  def _draw(self, rng: np.random.Generator) -> Example:
    a, b = self._operand(rng), self._operand(rng)
    answer = str(a + b)
    if self.reverse_answer:
      answer = answer[::-1]
    return Example(prompt=f"{a}+{b}=", answer=answer, metadata={"a": a, "b": b})

  def _key(self, example: Example) -> str:
    # a+b and b+a are one problem: both land in the same split.
    a, b = sorted((example.metadata["a"], example.metadata["b"]))
    return f"{a}+{b}"

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """Fraction of digits right, aligned at the units digit (the end that does not depend on carries)."""
    return verifiers.positional_credit(completion, example.answer, from_right=not self.reverse_answer)
