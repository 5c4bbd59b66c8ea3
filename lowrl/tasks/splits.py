"""Train/eval split of problem instances by a fixed hash, so eval problems never reach training.

The split is a pure function of a problem's canonical key: it does not depend on the seed, the
task's size knobs or the order of sampling, so a problem is in the same split in every run.
The eval sets nest: the eval set at fraction f is a subset of the eval set at any f' > f.
"""
from __future__ import annotations

import hashlib

SPLITS = ("train", "eval")
# Changing the salt reshuffles every split; bump the version only on purpose.
_SALT = b"lowrl-split-v1\x00"


def check_split(split: str) -> None:
  """Raises ValueError unless `split` is "train" or "eval"."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; use one of {SPLITS}.")


def check_eval_fraction(eval_fraction: float) -> None:
  """Raises ValueError unless 0 < eval_fraction < 1 (both splits must be able to hold problems)."""
  if not 0.0 < float(eval_fraction) < 1.0:
    raise ValueError(f"eval_fraction={eval_fraction!r}; use a value strictly between 0 and 1, e.g. 0.1.")


def hash_unit(key: str) -> float:
  """A pseudo-uniform number in [0, 1) from `key`; blake2b, so unlike hash() it is the same in
  every process."""
  digest = hashlib.blake2b(_SALT + key.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0**64


def split_of(key: str, eval_fraction: float) -> str:
  """The split ("train" or "eval") the problem with canonical `key` belongs to."""
  check_eval_fraction(eval_fraction)
  return "eval" if hash_unit(key) < eval_fraction else "train"
