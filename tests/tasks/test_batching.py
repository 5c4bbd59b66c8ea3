"""Prompt / SFT batches: layout, prefix consistency, length bounds, errors."""
import numpy as np
import pytest

from lowrl.tasks import batching
from lowrl.tasks.registry import make_task
from lowrl.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()
A, B, C = TOK.encode("abc")


def test_prompt_layout():
  tokens, lens = batching.encode_prompts(TOK, ["ab", "", "abc"], 5)
  assert tokens.dtype == np.int32 and lens.dtype == np.int32
  np.testing.assert_array_equal(tokens, [[1, A, B, 0, 0], [1, 0, 0, 0, 0], [1, A, B, C, 0]])
  np.testing.assert_array_equal(lens, [3, 1, 4])


def test_sft_layout():
  tokens, mask = batching.encode_sft(TOK, ["ab", "c"], ["c", ""], 6)
  assert tokens.dtype == np.int32 and mask.dtype == np.float32
  np.testing.assert_array_equal(tokens, [[1, A, B, C, 2, 0], [1, C, 2, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0]])


@pytest.mark.parametrize("name,kwargs", [
    ("addition", {"num_digits": 4}), ("addition", {"reverse_answer": True}), ("sorting", {"max_len": 9}),
    ("reversal", {"alphabet": "digits"}), ("countdown", {"num_numbers": 4, "max_number": 100})])
def test_task_batches_fit_and_share_the_prompt_prefix(name, kwargs):
  task = make_task(name, **kwargs)
  examples = task.sample(np.random.default_rng(0), 200)
  prompts = [e.prompt for e in examples]
  targets = [task.target_text(e) for e in examples]
  # The declared maxima fit every example (no error), so fixed-shape batches are safe.
  p_tokens, lens = batching.encode_prompts(task.tokenizer, prompts, task.max_prompt_len)
  s_tokens, mask = batching.encode_sft(task.tokenizer, prompts, targets,
                                       task.max_prompt_len + task.max_answer_len)
  for b, e in enumerate(examples):
    n = lens[b]
    np.testing.assert_array_equal(p_tokens[b, :n], s_tokens[b, :n])
    assert (p_tokens[b, n:] == task.tokenizer.pad_id).all()
    assert not mask[b, :n].any()
    target_ids = s_tokens[b][mask[b] == 1]
    assert target_ids[-1] == task.tokenizer.eos_id
    assert task.tokenizer.decode(target_ids) == targets[b]
    assert task.reward(task.tokenizer.decode(s_tokens[b, n:]), e) == 1.0
  # The prompt bound is tight for some example at these sizes.
  assert lens.max() == task.max_prompt_len or name == "countdown"


def test_decode_batch_from_prompt_lengths():
  prompts, targets = ["ab", "c"], ["ba", "cc"]
  tokens, _ = batching.encode_sft(TOK, prompts, targets, 8)
  _, lens = batching.encode_prompts(TOK, prompts, 8)
  assert batching.decode_batch(TOK, tokens, lens) == targets
  assert batching.decode_batch(TOK, tokens) == ["abba", "ccc"]


class _NoBosTokenizer:
  """Qwen-style: no bos token."""
  vocab_size, pad_id, bos_id, eos_id = TOK.vocab_size, 0, None, 2

  def encode(self, text):
    return TOK.encode(text)

  def decode(self, ids):
    return TOK.decode(ids)


def test_no_bos_tokenizer_prepends_nothing():
  tok = _NoBosTokenizer()
  tokens, lens = batching.encode_prompts(tok, ["ab"], 3)
  np.testing.assert_array_equal(tokens, [[A, B, 0]])
  assert lens.tolist() == [2]
  tokens, mask = batching.encode_sft(tok, ["ab"], ["c"], 4)
  np.testing.assert_array_equal(tokens, [[A, B, C, 2]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1]])


def test_errors():
  with pytest.raises(ValueError, match="needs 4 tokens but max_len=3"):
    batching.encode_prompts(TOK, ["abc"], 3)
  with pytest.raises(ValueError, match="needs 5 tokens"):
    batching.encode_sft(TOK, ["abc"], [""], 4)
  with pytest.raises(ValueError, match="one target per prompt"):
    batching.encode_sft(TOK, ["a", "b"], ["c"], 8)
  with pytest.raises(ValueError, match="positive integer"):
    batching.encode_prompts(TOK, ["a"], 0)
  with pytest.raises(ValueError, match="one start per row"):
    batching.decode_batch(TOK, np.zeros((2, 3), np.int32), np.zeros(3, np.int32))
