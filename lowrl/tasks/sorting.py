"""Sorting a short list of symbols: "sort:dbca=" -> "abcd".

Symbols are single characters (digits or lowercase letters by default), so the list needs no
separators; repeats are allowed. The answer is the characters in ascending code-point order.
"""
from __future__ import annotations

import numpy as np

from lowrl.tasks import verifiers
from lowrl.tasks.base import Example, ProceduralTask, check_range, resolve_alphabet
from lowrl.tasks.tokenizer import CharTokenizer

PREFIX = "sort:"


class SortingTask(ProceduralTask):
  """Sort min_len..max_len symbols drawn uniformly (with repeats) from `alphabet`.

  The split key is the multiset of symbols, so no ordering of an eval list is ever trained on.
  Reward: exact match after stripping whitespace. partial_reward: `positional_credit`.
  """

  name = "sorting"

  def __init__(self, min_len: int = 3, max_len: int = 6, alphabet: str = "letters",
               eval_fraction: float = 0.1, tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      min_len, max_len: list length range (inclusive).
      alphabet: "digits", "letters", or an explicit string of at least two distinct symbols.
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    check_range("SortingTask length (min_len, max_len)", min_len, max_len, 1)
    symbols = resolve_alphabet(alphabet)
    self.symbols = "".join(sorted(symbols))
    self.min_len, self.max_len = int(min_len), int(max_len)
    self._check_chars("SortingTask", PREFIX + "=" + self.symbols)
    self.max_prompt_len = 1 + len(PREFIX) + self.max_len + 1  # bos, prefix, list, '='
    self.max_answer_len = self.max_len + 1  # eos

  def _draw(self, rng: np.random.Generator) -> Example:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    items = "".join(self.symbols[i] for i in rng.integers(0, len(self.symbols), size=n))
    return Example(prompt=f"{PREFIX}{items}=", answer="".join(sorted(items)), metadata={"items": items})

  def _key(self, example: Example) -> str:
    return "".join(sorted(example.metadata["items"]))

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """Fraction of positions holding the right symbol (over the longer of completion and answer)."""
    return verifiers.positional_credit(completion, example.answer)
