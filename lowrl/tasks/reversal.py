"""String reversal: "rev:abcde=" -> "edcba"."""
from __future__ import annotations

import numpy as np

from lowrl.tasks import verifiers
from lowrl.tasks.base import Example, ProceduralTask, check_range, resolve_alphabet
from lowrl.tasks.tokenizer import CharTokenizer

PREFIX = "rev:"


class ReversalTask(ProceduralTask):
  """Reverse a string of min_len..max_len symbols drawn uniformly from `alphabet`.

  A string and its reverse share a split key (each is the other's answer), so an eval answer is
  never a training prompt. Reward: exact match after stripping whitespace. partial_reward:
  `positional_credit`.
  """

  name = "reversal"

  def __init__(self, min_len: int = 3, max_len: int = 8, alphabet: str = "letters",
               eval_fraction: float = 0.1, tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      min_len, max_len: string length range (inclusive).
      alphabet: "digits", "letters", or an explicit string of at least two distinct symbols.
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    check_range("ReversalTask length (min_len, max_len)", min_len, max_len, 1)
    symbols = resolve_alphabet(alphabet)
    self.symbols = symbols
    self.min_len, self.max_len = int(min_len), int(max_len)
    self._check_chars("ReversalTask", PREFIX + "=" + self.symbols)
    self.max_prompt_len = 1 + len(PREFIX) + self.max_len + 1  # bos, prefix, string, '='
    self.max_answer_len = self.max_len + 1  # eos

  def _draw(self, rng: np.random.Generator) -> Example:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    text = "".join(self.symbols[i] for i in rng.integers(0, len(self.symbols), size=n))
    return Example(prompt=f"{PREFIX}{text}=", answer=text[::-1], metadata={"text": text})

  def _key(self, example: Example) -> str:
    text = example.metadata["text"]
    return min(text, text[::-1])

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """Fraction of positions holding the right symbol (over the longer of completion and answer)."""
    return verifiers.positional_credit(completion, example.answer)
