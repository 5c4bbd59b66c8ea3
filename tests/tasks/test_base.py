"""What every procedural task promises (lowrl.tasks.base.ProceduralTask): reference targets
verify, determinism given a seed, disjoint splits by problem key, input validation."""
import dataclasses

import numpy as np
import pytest

from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.registry import make_task
from lowrl.tasks.strings import ReversalTask, SortingTask

PROCEDURAL = ["addition", "sorting", "reversal", "countdown"]


@pytest.mark.parametrize("name", PROCEDURAL)
def test_reference_targets_verify(name):
  task = make_task(name)
  for split in ("train", "eval"):
    for e in task.sample(np.random.default_rng(2), 150, split):
      assert task.reward(task.target_text(e), e) == 1.0
      assert task.partial_reward(task.target_text(e), e) == 1.0
      assert len(task.tokenizer.encode(e.prompt)) + 1 <= task.max_prompt_len
      assert len(task.tokenizer.encode(task.target_text(e))) + 1 <= task.max_answer_len


@pytest.mark.parametrize("name", PROCEDURAL)
def test_determinism_given_seed(name):
  task = make_task(name)
  a = task.sample(np.random.default_rng(7), 50, "eval")
  b = task.sample(np.random.default_rng(7), 50, "eval")
  c = task.sample(np.random.default_rng(8), 50, "eval")
  assert a == b
  assert [e.prompt for e in a] != [e.prompt for e in c]


@pytest.mark.parametrize("name", PROCEDURAL)
def test_splits_are_disjoint(name):
  task = make_task(name)
  rng = np.random.default_rng(3)
  train, evals = task.sample(rng, 2000, "train"), task.sample(rng, 300, "eval")
  assert all(e.metadata["split"] == "train" == task.split_of(e) for e in train)
  assert all(e.metadata["split"] == "eval" == task.split_of(e) for e in evals)
  assert not {e.metadata["key"] for e in train} & {e.metadata["key"] for e in evals}
  assert not {e.prompt for e in train} & {e.prompt for e in evals}


def test_sample_metadata_and_validation():
  task = SortingTask()
  (e,) = task.sample(np.random.default_rng(0), 1)
  assert e.metadata["key"].startswith("sorting|") and e.metadata["split"] == "train"
  assert task.sample(np.random.default_rng(0), 0) == []
  with pytest.raises(ValueError, match="split='test'"):
    task.sample(np.random.default_rng(0), 1, "test")
  with pytest.raises(ValueError, match="non-negative integer"):
    task.sample(np.random.default_rng(0), -1)
  with pytest.raises(ValueError, match="numpy Generator"):
    task.sample(np.random.RandomState(0), 1)
  with pytest.raises(ValueError, match="eval_fraction"):
    SortingTask(eval_fraction=0.0)
  with pytest.raises(ValueError, match="min <= max"):
    SortingTask(min_len=5, max_len=3)
  with pytest.raises(ValueError, match="alphabet"):
    ReversalTask(alphabet="a")
  with pytest.raises(ValueError, match="whitespace"):
    ReversalTask(alphabet="a b")
  with pytest.raises(ValueError, match="min <= max"):
    AdditionTask(num_digits=0)
  with pytest.raises(ValueError, match="tokenizer lacks"):
    SortingTask(alphabet="\u00e9\u00e8")


def test_examples_are_immutable():
  (e,) = AdditionTask().sample(np.random.default_rng(0), 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    e.answer = "0"
