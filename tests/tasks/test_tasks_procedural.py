"""Addition, sorting, reversal; splits, determinism and the registry (all procedural tasks)."""
import dataclasses
import itertools

import numpy as np
import pytest

from lowrl.tasks import splits
from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.base import Example, Task
from lowrl.tasks.countdown import CountdownTask
from lowrl.tasks.registry import TASKS, make_task, task_names
from lowrl.tasks.strings import ReversalTask, SortingTask

PROCEDURAL = ["addition", "sorting", "reversal", "countdown"]


def _add(a, b, reverse=False):
  s = str(a + b)
  return Example(f"{a}+{b}=", s[::-1] if reverse else s, {"a": a, "b": b})


@pytest.mark.parametrize("completion,expected", [
    ("357", 1.0), (" 357\n", 1.0), ("357 ", 1.0),
    ("3 57", 0.0), ("0357", 0.0), ("+357", 0.0), ("357 is the answer", 0.0), ("357=", 0.0),
    ("358", 0.0), ("753", 0.0), ("", 0.0), ("three hundred", 0.0)])
def test_addition_reward(completion, expected):
  assert AdditionTask().reward(completion, _add(12, 345)) == expected


def test_addition_reversed_answer_and_partial_credit():
  task = AdditionTask(reverse_answer=True)
  ex = _add(12, 345, reverse=True)
  assert ex.answer == "753"
  assert task.reward("753", ex) == 1.0 and task.reward("357", ex) == 0.0
  # Partial credit is aligned at the units digit in both layouts.
  assert task.partial_reward("752", ex) == pytest.approx(2 / 3)
  plain = AdditionTask()
  assert plain.partial_reward("257", _add(12, 345)) == pytest.approx(2 / 3)
  assert plain.partial_reward("57", _add(12, 345)) == pytest.approx(2 / 3)  # dropped leading digit
  assert plain.partial_reward("1357", _add(12, 345)) == pytest.approx(3 / 4)  # extra digit costs
  assert plain.partial_reward("357", _add(12, 345)) == 1.0
  assert plain.partial_reward("abc", _add(12, 345)) == 0.0


def test_addition_sampling_covers_lengths():
  exs = AdditionTask(num_digits=4).sample(np.random.default_rng(0), 400)
  lengths = {len(str(e.metadata["a"])) for e in exs}
  assert lengths == {1, 2, 3, 4}
  for e in exs:
    a, b = e.metadata["a"], e.metadata["b"]
    assert e.prompt == f"{a}+{b}=" and int(e.answer) == a + b


@pytest.mark.parametrize("completion,expected,partial", [
    ("abcd", 1.0, 1.0), ("  abcd\n", 1.0, 1.0), ("abdc", 0.0, 0.5), ("a b c d", 0.0, 1 / 7),
    ("abcdd", 0.0, 0.8), ("abc", 0.0, 0.75), ("dcba", 0.0, 0.0), ("", 0.0, 0.0)])
def test_sorting_reward(completion, expected, partial):
  task = SortingTask()
  ex = Example("sort:dbca=", "abcd", {"items": "dbca"})
  assert task.reward(completion, ex) == expected
  assert task.partial_reward(completion, ex) == pytest.approx(partial)


def test_sorting_samples_are_sorted_with_repeats_allowed():
  exs = SortingTask(alphabet="digits", min_len=5, max_len=5).sample(np.random.default_rng(1), 300)
  for e in exs:
    items = e.metadata["items"]
    assert e.answer == "".join(sorted(items)) and e.prompt == f"sort:{items}="
  assert any(len(set(e.answer)) < 5 for e in exs)


@pytest.mark.parametrize("completion,expected", [
    ("edcba", 1.0), ("edcba\n", 1.0), ("abcde", 0.0), ("edcb", 0.0), ("edcba.", 0.0),
    ("e d c b a", 0.0)])
def test_reversal_reward(completion, expected):
  task = ReversalTask()
  assert task.reward(completion, Example("rev:abcde=", "edcba", {"text": "abcde"})) == expected


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


def test_split_exhaustive_on_a_small_space():
  """1-digit addition has 100 prompts: train and eval partition them; commuted pairs stay together."""
  task = AdditionTask(num_digits=1, eval_fraction=0.3)
  rng = np.random.default_rng(0)
  train = {e.prompt for e in task.sample(rng, 3000, "train")}
  evals = {e.prompt for e in task.sample(rng, 3000, "eval")}
  assert train | evals == {f"{a}+{b}=" for a, b in itertools.product(range(10), repeat=2)}
  assert not train & evals
  assert 10 <= len(evals) <= 60
  for p in evals:
    a, b = p[:-1].split("+")
    assert f"{b}+{a}=" in evals


def test_reversal_string_and_its_reverse_share_a_split():
  task = ReversalTask()
  for e in task.sample(np.random.default_rng(4), 200, "eval"):
    mirrored = Example(f"rev:{e.answer}=", e.metadata["text"], {"text": e.answer})
    assert task.split_of(mirrored) == "eval"


def test_sorting_permutations_share_a_split():
  task = SortingTask()
  rng = np.random.default_rng(5)
  for e in task.sample(rng, 200, "eval"):
    shuffled = "".join(rng.permutation(list(e.metadata["items"])))
    assert task.split_of(Example(f"sort:{shuffled}=", e.answer, {"items": shuffled})) == "eval"


def test_split_ignores_size_knobs_and_nests():
  small, large = AdditionTask(num_digits=2), AdditionTask(num_digits=3, min_digits=2)
  for e in small.sample(np.random.default_rng(0), 300, "eval"):
    if len(str(e.metadata["a"])) == 2 and len(str(e.metadata["b"])) == 2:
      assert large.split_of(e) == "eval"
  keys = [f"k{i}" for i in range(2000)]
  eval_05 = {k for k in keys if splits.split_of(k, 0.05) == "eval"}
  eval_20 = {k for k in keys if splits.split_of(k, 0.2) == "eval"}
  assert eval_05 < eval_20
  assert 0.1 < len(eval_20) / len(keys) < 0.3


def test_empty_split_raises():
  pairs = {tuple(sorted(p)) for p in itertools.product(range(10), repeat=2)}
  smallest = min(splits.hash_unit(f"addition|{a}+{b}") for a, b in pairs)
  task = AdditionTask(num_digits=1, eval_fraction=smallest / 2)  # below every key: eval is empty
  with pytest.raises(ValueError, match="problem space is too small"):
    task.sample(np.random.default_rng(0), 1, "eval")


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


def test_rewards_batch():
  task = ReversalTask()
  exs = task.sample(np.random.default_rng(0), 3)
  r = task.rewards([exs[0].answer, "zz", exs[2].answer], exs)
  assert r.dtype == np.float32 and r.tolist() == [1.0, 0.0, 1.0]
  with pytest.raises(ValueError, match="one per example"):
    task.rewards(["a"], exs)


def test_registry():
  assert task_names() == ["addition", "countdown", "jsonl", "reversal", "sorting"]
  for name in PROCEDURAL:
    task = make_task(name)
    assert isinstance(task, TASKS[name]) and isinstance(task, Task) and task.name == name
  assert make_task("addition", num_digits=5).num_digits == 5
  assert isinstance(make_task("countdown", num_numbers=4), CountdownTask)
  with pytest.raises(ValueError, match=r"Unknown task 'mult'; valid tasks are \['addition', 'count"):
    make_task("mult")
  with pytest.raises(ValueError, match=r"does not take \['digits'\]; it accepts \['num_digits'"):
    make_task("addition", digits=3)


def test_examples_are_immutable():
  (e,) = AdditionTask().sample(np.random.default_rng(0), 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    e.answer = "0"
