"""String tasks: a string of symbols in, one fixed rearrangement of it out.

Sorting ("sort:dbca=" -> "abcd") and reversal ("rev:abcde=" -> "edcba") are one task,
`StringTask`, that differs only in the rearrangement and in which strings count as the same
problem (the split key). Symbols are single characters (digits or lowercase letters by default),
so the string needs no separators; repeats are allowed. Reward: exact match after stripping
whitespace; partial_reward: `verifiers.positional_credit`.
"""
from __future__ import annotations

import numpy as np

from lowrl.tasks import verifiers
from lowrl.tasks.base import Example, ProceduralTask, check_range, resolve_alphabet
from lowrl.tasks.tokenizer import CharTokenizer


class StringTask(ProceduralTask):
  """min_len..max_len symbols drawn uniformly (with repeats) from `alphabet`; the answer is
  `answer_of(text)`. Subclasses set `name`, `prefix` and the two static methods."""

  prefix: str
  lengths: tuple[int, int]  # the default (min_len, max_len)
  metadata_key: str  # the drawn string's name in Example.metadata
  sort_alphabet: bool  # draw from the alphabet's symbols in sorted order (what sorting did)

  @staticmethod
  def answer_of(text: str) -> str:
    raise NotImplementedError

  @staticmethod
  def key_of(text: str) -> str:
    """The canonical form of `text`'s problem: strings with one key share a split."""
    raise NotImplementedError

  def __init__(self, min_len: int | None = None, max_len: int | None = None,
               alphabet: str = "letters", eval_fraction: float = 0.1,
               tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      min_len, max_len: string length range (inclusive); None: the task's `lengths`.
      alphabet: "digits", "letters", or an explicit string of at least two distinct symbols.
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    what = type(self).__name__
    min_len = self.lengths[0] if min_len is None else min_len
    max_len = self.lengths[1] if max_len is None else max_len
    check_range(f"{what} length (min_len, max_len)", min_len, max_len, 1)
    symbols = resolve_alphabet(alphabet)
    self.symbols = "".join(sorted(symbols)) if self.sort_alphabet else symbols
    self.min_len, self.max_len = int(min_len), int(max_len)
    self._check_chars(what, self.prefix + "=" + self.symbols)
    self.max_prompt_len = 1 + len(self.prefix) + self.max_len + 1  # bos, prefix, string, '='
    self.max_answer_len = self.max_len + 1  # eos

  def _draw(self, rng: np.random.Generator) -> Example:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    text = "".join(self.symbols[i] for i in rng.integers(0, len(self.symbols), size=n))
    return Example(prompt=f"{self.prefix}{text}=", answer=self.answer_of(text),
                   metadata={self.metadata_key: text})

  def _key(self, example: Example) -> str:
    return self.key_of(example.metadata[self.metadata_key])

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """Fraction of positions holding the right symbol (over the longer of completion and answer)."""
    return verifiers.positional_credit(completion, example.answer)


class SortingTask(StringTask):
  """Sort the symbols into ascending code-point order. The split key is the multiset of symbols,
  so no ordering of an eval list is ever trained on."""

  name = "sorting"
  prefix = "sort:"
  lengths = (3, 6)
  metadata_key = "items"
  sort_alphabet = True

  @staticmethod
  def answer_of(text: str) -> str:
    return "".join(sorted(text))

  key_of = answer_of


class ReversalTask(StringTask):
  """Reverse the string. A string and its reverse share a split key (each is the other's answer),
  so an eval answer is never a training prompt."""

  name = "reversal"
  prefix = "rev:"
  lengths = (3, 8)
  metadata_key = "text"
  sort_alphabet = False

  @staticmethod
  def answer_of(text: str) -> str:
    return text[::-1]

  @staticmethod
  def key_of(text: str) -> str:
    return min(text, text[::-1])

