"""JSONL task and the named verifiers (exact, numeric, boxed)."""
import json

import numpy as np
import pytest

from lowrl.checkpoints.tokenizer import Tokenizer as CheckpointTokenizer
from lowrl.tasks import verifiers
from lowrl.tasks.batching import encode_sft
from lowrl.tasks.jsonl import JsonlTask
from lowrl.tasks.registry import make_task
from lowrl.tasks.tokenizer import CharTokenizer
from lowrl.tasks.verifiers import extract_boxed, make_verifier, normalize_answer


def _write(path, rows):
  lines = [(r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows]
  path.write_text("".join(lines), encoding="utf-8")
  return path


@pytest.fixture
def arith_file(tmp_path):
  rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in range(12) for b in range(12)]
  return _write(tmp_path / "mul.jsonl", rows)


@pytest.mark.parametrize("text,content", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed {7}", "7"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),     # escaped braces do not close the box
    ("\\boxed{\\{x}", "\\{x"), ("\\boxed{a\\}b}", "a\\}b"),
    ("\\boxed{x^{2}+1} and more text", "x^{2}+1"),
    ("\\boxed{1} \\boxed{2", None),           # the last box is unclosed
    ("\\boxed{", None), ("no box here 42", None), ("\\boxed 5", None), ("", None)])
def test_extract_boxed(text, content):
  assert extract_boxed(text) == content


@pytest.mark.parametrize("raw,norm", [
    ("$3$", "3"), (" 3. ", "3"), ("3.0", "3"), ("0.50", "1/2"), ("2/4", "1/2"), ("\\dfrac{2}{4}", "1/2"),
    ("-\\frac{3}{6}", "-1/2"), ("\\left( 1, 2 \\right)", "(1,2)"), ("x + 1", "x+1"), ("1e3", "1000"),
    ("\\frac{x}{2}", "\\frac{x}{2}"), ("1/0", "1/0")])
def test_normalize_answer(raw, norm):
  assert normalize_answer(raw) == norm


@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{ 3 }", "3", 1.0),
    ("\\boxed{2} no wait \\boxed{3}", "3", 1.0),
    ("\\boxed{2} no wait \\boxed{3}", "2", 0.0),
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{3", "3", 0.0),
    ("3", "3", 0.0),                 # no box at all
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{x^{2}}", "x^2", 0.0)])  # no symbolic algebra: different strings stay different
def test_boxed_verifier(completion, answer, expected):
  assert make_verifier("boxed")(completion, answer) == expected


@pytest.mark.parametrize("completion,expected", [
    ("3", 1.0), (" 3.0\n", 1.0), ("3.0000001", 1.0), ("+3", 1.0), ("3e0", 1.0), ("3.1", 0.0),
    ("x = 3", 0.0), ("3 apples", 0.0), ("nan", 0.0), ("inf", 0.0), ("1_0", 0.0), ("", 0.0)])
def test_numeric_verifier(completion, expected):
  assert make_verifier("numeric")(completion, "3") == expected


def test_numeric_tolerance_and_bad_reference():
  assert make_verifier("numeric", rtol=0.1)("3.2", "3") == 1.0
  assert make_verifier("numeric", rtol=0.0, atol=0.0)("3.0000001", "3") == 0.0
  with pytest.raises(ValueError, match="not a number"):
    make_verifier("numeric")("3", "three")
  with pytest.raises(ValueError, match="non-negative"):
    make_verifier("numeric", rtol=-1.0)


def test_numeric_last_number():
  last = make_verifier("numeric", last=True)
  assert last("The answer is 122.", "122") == 1.0 and last("94 + 28 = 122", "122") == 1.0
  assert last("The answer is 12", "122") == 0.0 and last("no number", "122") == 0.0
  assert make_verifier("numeric")("The answer is 122.", "122") == 0.0


def test_exact_verifier_and_registry():
  exact = make_verifier("exact")
  assert exact(" yes\n", "yes") == 1.0 and exact("Yes", "yes") == 0.0 and exact("yes!", "yes") == 0.0
  with pytest.raises(ValueError, match=r"Unknown verifier 'fuzzy'; use one of \['boxed', 'exact'"):
    make_verifier("fuzzy")
  with pytest.raises(ValueError, match="already registered"):
    verifiers.register_verifier("exact", verifiers.exact_verifier)


def test_jsonl_load_split_and_sample(arith_file):
  task = JsonlTask(arith_file, verifier="numeric", eval_fraction=0.25)
  train, evals = task.examples("train"), task.examples("eval")
  assert len(train) + len(evals) == 144
  assert 0.1 < len(evals) / 144 < 0.4
  assert not {e.prompt for e in train} & {e.prompt for e in evals}
  sampled = task.sample(np.random.default_rng(0), 500, "train")
  assert {e.prompt for e in sampled} <= {e.prompt for e in train}
  again = task.sample(np.random.default_rng(5), 20, "eval")
  assert task.sample(np.random.default_rng(5), 20, "eval") == again
  ex = evals[0]
  assert task.reward(ex.answer, ex) == 1.0 and task.reward(ex.answer + ".5", ex) == 0.0
  assert ex.metadata["split"] == "eval" and ex.metadata["line"] >= 1
  # The char tokenizer is built from the file: exactly its characters.
  assert isinstance(task.tokenizer, CharTokenizer)
  assert set(task.tokenizer.chars) == set("0123456789*=")
  assert task.max_prompt_len == 1 + len("10*11=") and task.max_answer_len == 1 + len("121")


def test_jsonl_split_depends_on_prompt_not_file_order(arith_file, tmp_path):
  lines = arith_file.read_text().splitlines()
  shuffled = [lines[i] for i in np.random.default_rng(0).permutation(len(lines))]
  other = _write(tmp_path / "shuffled.jsonl", shuffled + [lines[0]])  # plus a repeated prompt
  a, b = JsonlTask(arith_file), JsonlTask(other)
  assert {e.prompt for e in a.examples("eval")} == {e.prompt for e in b.examples("eval")}
  first = json.loads(lines[0])["prompt"]
  dup = [e for s in ("train", "eval") for e in b.examples(s) if e.prompt == first]
  assert len(dup) == 2 and dup[0].metadata["split"] == dup[1].metadata["split"]


def test_jsonl_boxed_targets(tmp_path):
  path = _write(tmp_path / "math.jsonl", [
      {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
      {"prompt": "Solve 2x = 6.", "answer": 3, "target": "Divide by 2: x = \\boxed{3}"},
      "",  # blank lines are skipped
      {"prompt": "Pairs?", "answer": "(1,2)"}])
  task = make_task("jsonl", path=str(path), verifier="boxed", eval_fraction=0.5)
  exs = task.examples("train") + task.examples("eval")
  assert len(exs) == 3
  by_prompt = {e.prompt: e for e in exs}
  assert task.target_text(by_prompt["What is 1/2 + 1/4?"]) == "\\boxed{\\frac{3}{4}}"
  assert task.target_text(by_prompt["Solve 2x = 6."]) == "Divide by 2: x = \\boxed{3}"
  assert by_prompt["Solve 2x = 6."].answer == "3"  # numbers become strings
  assert by_prompt["Solve 2x = 6."].metadata["line"] == 2
  for e in exs:
    assert task.reward(task.target_text(e), e) == 1.0
    assert task.reward("\\boxed{0}", e) == 0.0
  tokens, mask = encode_sft(task.tokenizer, [e.prompt for e in exs], [task.target_text(e) for e in exs],
                            task.max_prompt_len + task.max_answer_len)
  assert mask.sum() == sum(len(task.target_text(e)) + 1 for e in exs)


def test_jsonl_with_tokenizer_json_and_callable_verifier(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["hello world"], trainers.BpeTrainer(
      vocab_size=280, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  path = _write(tmp_path / "greet.jsonl", [{"prompt": "Say hi:", "answer": "HELLO"},
                                           {"prompt": "Say bye:", "answer": "bye"}])
  task = JsonlTask(path, verifier=lambda c, a: float(c.strip().lower() == a.lower()),
                   tokenizer=str(tmp_path / "tokenizer.json"), max_answer_len=16)
  assert isinstance(task.tokenizer, CheckpointTokenizer) and task.max_answer_len == 16
  e = (task.examples("train") + task.examples("eval"))[0]
  assert task.reward(" hello", e) == 1.0 and task.reward("hell", e) == 0.0
  assert task.tokenizer.decode(task.tokenizer.encode(e.prompt)) == e.prompt


@pytest.mark.parametrize("rows,match", [
    ([{"prompt": "a", "answer": "b"}, "{not json"], r"bad.jsonl:2: not valid JSON"),
    ([["a", "b"]], "expected a JSON object"),
    ([{"question": "a", "answer": "b"}], r"\"prompt\" must be a string"),
    ([{"prompt": "a", "answer": ["b"]}], r"\"answer\" must be a string or a number"),
    ([{"prompt": "a", "answer": True}], r"\"answer\" must be a string or a number"),
    ([{"prompt": "a", "answer": "b", "target": 3}], r"\"target\" must be a string"),
    ([], "has no examples"),
])
def test_jsonl_bad_files(tmp_path, rows, match):
  with pytest.raises(ValueError, match=match):
    JsonlTask(_write(tmp_path / "bad.jsonl", rows))


def test_jsonl_other_errors(tmp_path):
  path = _write(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "seven"}])
  with pytest.raises(ValueError, match=r"t.jsonl:1: Reference answer 'seven' is not a number"):
    JsonlTask(path, verifier="numeric")
  with pytest.raises(ValueError, match=r"t.jsonl:1: the answer 'seven' does not pass"):
    JsonlTask(path, verifier=lambda c, a: 0.0)
  with pytest.raises(ValueError, match="Unknown verifier"):
    JsonlTask(path, verifier="fuzzy")
  with pytest.raises(ValueError, match="only applies to a named verifier"):
    JsonlTask(path, verifier=lambda c, a: 1.0, verifier_kwargs={"rtol": 1.0})
  with pytest.raises(ValueError, match="longest target needs 6 tokens"):
    JsonlTask(path, max_answer_len=5)
  with pytest.raises(ValueError, match="Cannot read JSONL file"):
    JsonlTask(tmp_path / "missing.jsonl")
  task = JsonlTask(path)  # one example: one split is empty
  empty = "eval" if not task.examples("eval") else "train"
  with pytest.raises(ValueError, match=f"The '{empty}' split .* is empty"):
    task.sample(np.random.default_rng(0), 1, empty)
