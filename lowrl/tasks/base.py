"""The task interface: examples, rewards, SFT targets, and split-aware sampling.

A task produces `Example`s (prompt, reference answer, metadata), scores a decoded completion
with a verifier (`reward`: 1.0 verified correct, else 0.0), and names the text a supervised
mid-training stage trains on (`target_text`; batching appends eos). Lengths are in tokens of
the task's tokenizer: `max_prompt_len` counts bos, `max_answer_len` counts eos, so
`encode_prompts(tok, prompts, task.max_prompt_len)` and
`encode_sft(tok, prompts, targets, task.max_prompt_len + task.max_answer_len)` always fit.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from lowrl.tasks import splits
from lowrl.tasks.tokenizer import CharTokenizer, Tokenizer


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem instance.

  Attributes:
    prompt: text the policy is conditioned on.
    answer: the reference answer (one correct completion; verifiers may accept others).
    metadata: task-specific data the verifier needs, plus "key" (the canonical problem key the
      split is computed from) and "split".
  """

  prompt: str
  answer: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class Task(abc.ABC):
  """A verifiable-reward task.

  Attributes (set by subclasses):
    name: registry name.
    tokenizer: the tokenizer prompts and completions are encoded with.
    max_prompt_len: the most tokens an encoded prompt takes, bos included.
    max_answer_len: the most completion tokens the reference needs, eos included (a sensible
      generation budget).
  """

  name: str
  tokenizer: Tokenizer
  max_prompt_len: int
  max_answer_len: int

  @abc.abstractmethod
  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Example]:
    """`n` examples of `split`, drawn using only `rng` (deterministic given its state)."""

  @abc.abstractmethod
  def reward(self, completion: str, example: Example) -> float:
    """1.0 if `completion` (decoded text, eos excluded) is verified correct, else 0.0."""

  def partial_reward(self, completion: str, example: Example) -> float:
    """A reward in [0, 1] with partial credit (subclasses document theirs); default `reward`."""
    return self.reward(completion, example)

  def target_text(self, example: Example) -> str:
    """The completion supervised mid-training trains on (eos is appended by `encode_sft`)."""
    return example.answer

  def rewards(self, completions: Sequence[str], examples: Sequence[Example]) -> np.ndarray:
    """`reward` over a batch, as float32 [B]."""
    if len(completions) != len(examples):
      raise ValueError(f"{len(completions)} completions for {len(examples)} examples; "
                       "pass one per example.")
    return np.asarray([self.reward(c, e) for c, e in zip(completions, examples)], np.float32)


def check_count(n: int) -> None:
  """Raises ValueError unless `n` is a non-negative integer."""
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
    raise ValueError(f"n={n!r}; pass a non-negative integer number of examples.")


def check_rng(rng: np.random.Generator) -> None:
  """Raises ValueError unless `rng` is a numpy Generator (the only randomness tasks use)."""
  if not isinstance(rng, np.random.Generator):
    raise ValueError("rng must be a numpy Generator (np.random.default_rng(seed)), "
                     f"got {type(rng).__name__}.")


def check_range(what: str, lo: int, hi: int, minimum: int) -> None:
  """Raises ValueError unless minimum <= lo <= hi (integers)."""
  if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (lo, hi)):
    raise ValueError(f"{what} bounds must be integers, got ({lo!r}, {hi!r}).")
  if not minimum <= lo <= hi:
    raise ValueError(f"{what} range ({lo}, {hi}) is invalid; need {minimum} <= min <= max.")


ALPHABETS = {"digits": "0123456789", "letters": "abcdefghijklmnopqrstuvwxyz"}


def resolve_alphabet(alphabet: str) -> str:
  """The symbols of a named alphabet ("digits", "letters") or of an explicit string, validated."""
  symbols = ALPHABETS.get(alphabet, alphabet)
  if not isinstance(symbols, str) or len(set(symbols)) < 2 or len(set(symbols)) != len(symbols):
    raise ValueError(f"alphabet={alphabet!r}; use 'digits', 'letters' or a string of at least two "
                     "distinct characters.")
  if any(c.isspace() for c in symbols):
    raise ValueError(f"alphabet={alphabet!r} contains whitespace, which rewards strip; remove it.")
  return symbols


class ProceduralTask(Task):
  """A task whose problems are generated on the fly; the split is decided by each problem's key.

  Subclasses implement `_draw` (one random problem, either split) and `_key` (the canonical key:
  problems that are the same up to a trivial symmetry share a key, so they share a split).
  `sample` rejects draws from the other split, so train and eval are disjoint by construction.
  """

  def __init__(self, *, eval_fraction: float = 0.1, tokenizer: CharTokenizer | None = None):
    splits.check_eval_fraction(eval_fraction)
    self.eval_fraction = float(eval_fraction)
    self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()

  @abc.abstractmethod
  def _draw(self, rng: np.random.Generator) -> Example:
    """One random problem (metadata without "key"/"split"; `sample` adds them)."""

  @abc.abstractmethod
  def _key(self, example: Example) -> str:
    """Canonical problem key, without the task name (`sample` prefixes it)."""

  def split_of(self, example: Example) -> str:
    """The split `example`'s problem belongs to (recomputed from the problem, not trusted metadata)."""
    return splits.split_of(f"{self.name}|{self._key(example)}", self.eval_fraction)

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Example]:
    """`n` problems of `split`, with replacement, deterministic given `rng`."""
    splits.check_split(split)
    check_count(n)
    check_rng(rng)
    p = self.eval_fraction if split == "eval" else 1.0 - self.eval_fraction
    # Far beyond the expected 1/p draws per example: hitting it means the split is (nearly) empty.
    budget = int(1000 + 50 * n / p)
    out: list[Example] = []
    for _ in range(budget):
      if len(out) == n:
        break
      ex = self._draw(rng)
      key = f"{self.name}|{self._key(ex)}"
      if splits.split_of(key, self.eval_fraction) == split:
        out.append(dataclasses.replace(ex, metadata={**ex.metadata, "key": key, "split": split}))
    if len(out) < n:
      raise ValueError(f"Could not draw {n} {split!r} problems for task {self.name!r} in {budget} "
                       "tries: the problem space is too small for this split; widen the task's "
                       "ranges or change eval_fraction.")
    return out

  def _check_chars(self, what: str, text: str) -> None:
    """Raises ValueError if `text` (task vocabulary) is not covered by the tokenizer."""
    missing = sorted({c for c in text if not self.tokenizer.covers(c)})
    if missing:
      raise ValueError(f"{what} uses characters {missing!r} that the tokenizer lacks; pass a tokenizer "
                       "that covers them (e.g. CharTokenizer(), the default).")

