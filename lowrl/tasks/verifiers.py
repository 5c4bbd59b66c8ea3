"""Verifiers: compare a decoded completion with a reference answer, by name.

A verifier is `(completion, answer) -> float` (1.0 correct, 0.0 not). Completions are taken as
the model wrote them; every verifier ignores surrounding whitespace. Registry names:

  "exact"    completion.strip() == answer.strip().
  "numeric"  the whole (stripped) completion is one decimal number within tolerance of the answer
             (math.isclose with rtol/atol); anything else, e.g. "x = 3", scores 0. With
             last=True the last decimal literal anywhere in the completion is compared instead
             ("The answer is 122." -> 122: GSM8K-style extraction for chat models).
  "boxed"    the content of the *last* \\boxed{...} in the completion (nested braces and escaped
             \\{ \\} handled; an unclosed last box scores 0) equals the answer after
             `normalize_answer`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

Verifier = Callable[[str, str], float]

# A plain decimal literal. float() alone would also accept "nan", "inf" and "1_000".
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_RATIO = re.compile(r"[+-]?\d+/\d+")
_FRAC = re.compile(r"(-?)\\frac\{(\d+)\}\{(\d+)\}")
_LATEX_SPACING = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;: ]")


def parse_number(text: str) -> float | None:
  """The float value of `text` if it is (up to surrounding whitespace) one decimal literal, else None."""
  text = text.strip()
  return float(text) if _NUMBER.fullmatch(text) else None


def extract_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} in `text`, or None if there is none or it is not closed."""
  start = text.rfind("\\boxed")
  if start < 0:
    return None
  i = start + len("\\boxed")
  while i < len(text) and text[i] == " ":
    i += 1
  if i >= len(text) or text[i] != "{":
    return None
  depth = 0
  j = i
  while j < len(text):
    c = text[j]
    if c == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
      j += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
    j += 1
  return None


def normalize_answer(text: str) -> str:
  """A canonical form for comparing math answers.

  Strips surrounding whitespace and $...$, LaTeX spacing commands (\\left, \\right, \\!, \\, ...),
  all whitespace and a trailing period; maps \\dfrac/\\tfrac to \\frac and \\frac{a}{b} of
  integers to a/b; numbers and integer ratios become their exact reduced value ("3.0" -> "3",
  "0.50" -> "1/2", "2/4" -> "1/2"), so equal values compare equal.
  """
  s = text.strip()
  while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
    s = s[1:-1].strip()
  s = _LATEX_SPACING.sub("", s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = "".join(s.split()).rstrip(".")
  m = _FRAC.fullmatch(s)
  if m:
    s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
  if _NUMBER.fullmatch(s) or _RATIO.fullmatch(s):
    try:
      s = str(Fraction(s))
    except ZeroDivisionError:
      pass
  return s


def positional_credit(completion: str, reference: str, from_right: bool = False) -> float:
  """Fraction of positions where the stripped completion agrees with `reference`.

  Characters are aligned from the left (or the right with `from_right`, for numbers written
  most-significant first) and the count is divided by the longer length, so extra or missing
  characters cost credit. 1.0 exactly when the two are equal.
  """
  pred = completion.strip()
  if not pred and not reference:
    return 1.0
  if from_right:
    pred, reference = pred[::-1], reference[::-1]
  return sum(a == b for a, b in zip(pred, reference)) / max(len(pred), len(reference))


def exact_verifier() -> Verifier:
  """Completion equals the answer up to surrounding whitespace."""

  def verify(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0

  return verify


def numeric_verifier(rtol: float = 1e-6, atol: float = 1e-9, last: bool = False) -> Verifier:
  """The completion is a single number within `rtol`/`atol` (math.isclose) of the answer; with
  `last`, the last number written anywhere in the completion is."""
  if not (rtol >= 0 and atol >= 0):
    raise ValueError(f"rtol={rtol}, atol={atol}; tolerances must be non-negative.")

  def verify(completion: str, answer: str) -> float:
    ref = parse_number(answer)
    if ref is None:
      raise ValueError(f"Reference answer {answer!r} is not a number; use the 'exact' or 'boxed' "
                       "verifier for non-numeric answers.")
    if last:
      found = _NUMBER.findall(completion)
      pred = float(found[-1]) if found else None
    else:
      pred = parse_number(completion)
    return 1.0 if pred is not None and math.isclose(pred, ref, rel_tol=rtol, abs_tol=atol) else 0.0

  return verify


def boxed_verifier() -> Verifier:
  """The last \\boxed{...} of the completion equals the answer after `normalize_answer`."""

  def verify(completion: str, answer: str) -> float:
    got = extract_boxed(completion)
    return 1.0 if got is not None and normalize_answer(got) == normalize_answer(answer) else 0.0

  return verify


_FACTORIES: dict[str, Callable[..., Verifier]] = {
    "exact": exact_verifier,
    "numeric": numeric_verifier,
    "boxed": boxed_verifier,
}


def verifier_names() -> list[str]:
  """Registered verifier names, sorted."""
  return sorted(_FACTORIES)


def register_verifier(name: str, factory: Callable[..., Verifier], overwrite: bool = False) -> None:
  """Adds a verifier factory (kwargs -> verifier) under `name`."""
  if name in _FACTORIES and not overwrite:
    raise ValueError(f"Verifier {name!r} is already registered; pass overwrite=True to replace it.")
  _FACTORIES[name] = factory


def make_verifier(name: str, **kwargs) -> Verifier:
  """The verifier registered as `name`, configured with `kwargs` (e.g. numeric's rtol/atol)."""
  if name not in _FACTORIES:
    raise ValueError(f"Unknown verifier {name!r}; use one of {verifier_names()} or register_verifier().")
  return _FACTORIES[name](**kwargs)
