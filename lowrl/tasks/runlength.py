"""Run-length decoding: a short prompt in, a long completion out.

Prompt "rld:a12b9c14=" -> answer "aaaaaaaaaaaabbbbbbbbbcccccccccccccc". The answer is `min_len` to
`max_len` symbols cut into runs of `min_run` to `max_run` equal symbols, consecutive runs of
different symbols, so the prompt (about 3 tokens a run) is a fraction of the completion: the task
for long completions at little training cost (the recipe ablation's regime, configs/ablate_regime.py,
where a forward pass over prompt + completion is most of an update). Each symbol of the answer
needs a count kept along the completion, so one wrong token anywhere fails the exact match:
per-token errors compound over the length. Reward: exact match after stripping whitespace;
partial_reward: `verifiers.positional_credit`. The split key is the prompt (each run list is
one problem).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from lowrl.tasks import verifiers
from lowrl.tasks.base import Example, ProceduralTask, check_range, resolve_alphabet
from lowrl.tasks.tokenizer import CharTokenizer

PREFIX = "rld:"


def decode(runs: list[tuple[str, int]]) -> str:
  """The string of `runs` ((symbol, count), ...)."""
  return "".join(s * n for s, n in runs)


def prompt_of(runs: list[tuple[str, int]]) -> str:
  return PREFIX + "".join(f"{s}{n}" for s, n in runs) + "="


class RunLengthTask(ProceduralTask):
  """Decode a run-length encoding of min_len..max_len symbols of `alphabet`."""

  name = "runlength"

  def __init__(self, min_len: int = 16, max_len: int = 24, min_run: int = 2, max_run: int = 9,
               alphabet: str = "abcd", eval_fraction: float = 0.1,
               tokenizer: CharTokenizer | None = None):
    """Configures the task.

    Args:
      min_len, max_len: answer length range in symbols (inclusive).
      min_run, max_run: run length range (inclusive, >= 1); every length in min_len..max_len
        must split into such runs.
      alphabet: "letters" or an explicit string of at least two distinct non-digit symbols
        (the counts are digits).
      eval_fraction: share of problems held out for evaluation.
      tokenizer: defaults to CharTokenizer().
    """
    super().__init__(eval_fraction=eval_fraction, tokenizer=tokenizer)
    check_range("RunLengthTask answer length (min_len, max_len)", min_len, max_len, 1)
    check_range("RunLengthTask run length (min_run, max_run)", min_run, max_run, 1)
    symbols = resolve_alphabet(alphabet)
    if any(c.isdigit() for c in symbols):
      raise ValueError(f"RunLengthTask alphabet={alphabet!r} has digits, which the counts use; "
                       "use letters (e.g. alphabet='abcd').")
    bad = [n for n in range(min_len, max_len + 1) if not _runs_range(n, min_run, max_run)]
    if bad:
      raise ValueError(f"RunLengthTask: answer lengths {bad[:5]} cannot be cut into runs of "
                       f"{min_run}..{max_run}; widen the run range or change the lengths.")
    self.symbols = symbols
    self.min_len, self.max_len = int(min_len), int(max_len)
    self.min_run, self.max_run = int(min_run), int(max_run)
    self._check_chars("RunLengthTask", PREFIX + "=0123456789" + symbols)
    most_runs = max(_runs_range(n, min_run, max_run)[1] for n in range(min_len, max_len + 1))
    # bos, prefix, per run a symbol and its count's digits, '='
    self.max_prompt_len = 1 + len(PREFIX) + most_runs * (1 + len(str(max_run))) + 1
    self.max_answer_len = self.max_len + 1  # eos

  def _draw(self, rng: np.random.Generator) -> Example:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    counts = _composition(rng, n, self.min_run, self.max_run)
    letters = [int(rng.integers(len(self.symbols)))]
    for _ in counts[1:]:  # a symbol other than the previous run's
      step = int(rng.integers(1, len(self.symbols)))
      letters.append((letters[-1] + step) % len(self.symbols))
    runs = [(self.symbols[i], c) for i, c in zip(letters, counts)]
    return Example(prompt=prompt_of(runs), answer=decode(runs),
                   metadata={"runs": [[s, c] for s, c in runs]})

  def _key(self, example: Example) -> str:
    return example.prompt

  def reward(self, completion: str, example: Example) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0

  def partial_reward(self, completion: str, example: Example) -> float:
    """Fraction of positions holding the right symbol (over the longer of completion and answer)."""
    return verifiers.positional_credit(completion, example.answer)


def _runs_range(n: int, min_run: int, max_run: int) -> tuple[int, int] | None:
  """The fewest and most runs of min_run..max_run symbols that add up to n (None: none do)."""
  lo, hi = math.ceil(n / max_run), n // min_run
  return (lo, hi) if lo <= hi else None


def _composition(rng: np.random.Generator, n: int, min_run: int, max_run: int) -> list[int]:
  """Run lengths in [min_run, max_run] adding up to n, uniform over all such compositions (any
  number of runs): each run drawn with weight the number of ways the rest can be completed."""
  @functools.lru_cache(maxsize=None)
  def ways(total: int) -> int:  # compositions of `total` into runs of min_run..max_run
    if total == 0:
      return 1
    return sum(ways(total - c) for c in range(min_run, min(max_run, total) + 1))

  out, rest = [], n
  counts = np.arange(min_run, max_run + 1)
  while rest:
    w = np.array([ways(rest - c) if rest >= c else 0 for c in counts], dtype=float)
    out.append(int(rng.choice(counts, p=w / w.sum())))
    rest -= out[-1]
  return out
