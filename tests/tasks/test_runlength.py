"""Run-length decoding (lowrl.tasks.runlength): rewards, samples against an independent parser,
the composition draw's uniformity, bad arguments."""
import collections
import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrl.tasks import make_task
from lowrl.tasks.base import Example
from lowrl.tasks.runlength import RunLengthTask


def _expand(prompt: str) -> str:
  """The answer a prompt asks for, read from the prompt text alone."""
  body = re.fullmatch(r"rld:((?:[a-z]\d+)+)=", prompt)
  assert body, prompt
  return "".join(s * int(n) for s, n in re.findall(r"([a-z])(\d+)", body.group(1)))


@pytest.mark.parametrize("completion,expected,partial", [
    ("aaabb", 1.0, 1.0), (" aaabb\n", 1.0, 1.0), ("aaabbb", 0.0, 5 / 6), ("aabbb", 0.0, 0.8),
    ("", 0.0, 0.0)])
def test_reward(completion, expected, partial):
  task = RunLengthTask(min_len=5, max_len=5, min_run=2, max_run=3)
  ex = Example("rld:a3b2=", "aaabb", {"runs": [["a", 3], ["b", 2]]})
  assert task.reward(completion, ex) == expected
  assert task.partial_reward(completion, ex) == pytest.approx(partial)


@settings(max_examples=40, deadline=None)
@given(min_len=st.integers(1, 70), extra=st.integers(0, 10), min_run=st.integers(1, 6),
       more=st.integers(0, 12), seed=st.integers(0, 2**31))
def test_samples_decode_to_their_answers(min_len, extra, min_run, more, seed):
  max_run = min_run + more
  try:
    task = RunLengthTask(min_len, min_len + extra, min_run, max_run, alphabet="abc")
  except ValueError as e:  # only lengths that no runs of min_run..max_run add up to
    assert "cannot be cut into runs" in str(e)
    return
  for ex in task.sample(np.random.default_rng(seed), 20, "train"):
    assert ex.answer == _expand(ex.prompt)
    assert min_len <= len(ex.answer) <= min_len + extra
    runs = [(s, len(list(g))) for s, g in itertools.groupby(ex.answer)]
    assert [list(r) for r in runs] == ex.metadata["runs"]  # consecutive runs differ
    assert all(min_run <= n <= max_run for _, n in runs)
    assert len(task.tokenizer.encode(ex.prompt)) + 1 <= task.max_prompt_len  # + bos
    assert len(ex.answer) + 1 <= task.max_answer_len  # + eos


def test_compositions_are_drawn_uniformly():
  """6 symbols in runs of 1..3: 24 compositions (enumerated here independently), each drawn
  ~1/24 of 6,000 times: every count within 5 binomial standard deviations (±78) of 250. (The
  draw itself: `sample` then keeps the problems of one split.)"""
  task = RunLengthTask(6, 6, 1, 3, alphabet="ab")
  every = {c for k in range(2, 7) for c in itertools.product(range(1, 4), repeat=k)
           if sum(c) == 6}
  rng = np.random.default_rng(0)
  counts = collections.Counter(tuple(n for _, n in task._draw(rng).metadata["runs"])  # noqa: SLF001
                               for _ in range(6000))
  assert set(counts) <= every and len(every) == 24
  n, p = 6000, 1 / 24
  sd = np.sqrt(n * p * (1 - p))
  assert all(abs(counts[c] - n * p) < 5 * sd for c in every), counts


def test_train_and_eval_are_disjoint_and_deterministic():
  task = make_task("runlength", min_len=64, max_len=64, min_run=6, max_run=16)
  train = task.sample(np.random.default_rng(3), 200, "train")
  ev = task.sample(np.random.default_rng(3), 50, "eval")
  assert not {e.prompt for e in train} & {e.prompt for e in ev}
  assert [e.prompt for e in task.sample(np.random.default_rng(3), 200, "train")] == \
      [e.prompt for e in train]
  assert all(task.split_of(e) == "eval" for e in ev)


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_len=7, max_len=7, min_run=4, max_run=5), "cannot be cut into runs"),
    (dict(alphabet="a1"), "digits"),
    (dict(min_run=0), "run length"),
    (dict(min_len=9, max_len=8), "answer length")])
def test_bad_arguments_are_one_line_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RunLengthTask(**kwargs)
