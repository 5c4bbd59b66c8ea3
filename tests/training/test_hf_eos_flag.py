"""A Hugging Face checkpoint whose files name no eos token: the error names
--config.model.eos_token and the tokenizer's special tokens, and the flag makes the run stop
completions at that token (checked by build, before any compile)."""
import json
import os

import ml_collections
import pytest

from configs import base as base_config
from hf_builders import write_checkpoint, write_tokenizer
from lowrl.training.setup import build


@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
  """A tiny Qwen3 checkpoint with a tokenizer.json but no eos token in any file, and a JSONL."""
  root = tmp_path_factory.mktemp("noeos")
  path, _ = write_checkpoint(root, "qwen3")
  write_tokenizer(path, "qwen")
  os.remove(os.path.join(path, "generation_config.json"))
  for name, drop in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
    file = os.path.join(path, name)
    with open(file) as fh:
      c = json.load(fh)
    del c[drop]
    with open(file, "w") as fh:
      json.dump(c, fh)
  jsonl = root / "sums.jsonl"
  jsonl.write_text("".join(json.dumps({"prompt": f"what is {a} + {b} =", "answer": a + b}) + "\n"
                           for a in (1, 2, 3, 4) for b in (1, 2, 3, 4, 7, 12)))
  return path, str(jsonl)


def _config(files, **model):
  path, jsonl = files
  c = base_config.get_config("fp32")
  c.model.hf_checkpoint = path
  c.model.update(model)
  c.task.name, c.task.path = "jsonl", jsonl
  c.task.kwargs = ml_collections.ConfigDict({"eval_fraction": 0.25})
  c.sft.steps = 0
  c.rl.update(num_prompts=2, group_size=4, max_new_tokens=4)
  c.eval_num_prompts = 8
  return c


def test_no_eos_token_names_the_flag(no_eos):
  with pytest.raises(ValueError) as e:
    build(_config(no_eos))
  path = no_eos[0]
  assert str(e.value) == (
      f"--config.model.hf_checkpoint={path}: no eos token in {path!r}: tokenizer_config.json, "
      "generation_config.json and config.json define none. Set --config.model.eos_token=TOKEN, "
      "the token the model ends a completion with (the tokenizer's special tokens: ['<unk>', "
      "'<|endoftext|>', '<|im_start|>', '<|im_end|>']), or add \"eos_token\": TOKEN to "
      f"{os.path.join(path, 'tokenizer_config.json')}.")


def test_the_eos_flag_sets_the_stop_token(no_eos):
  setup = build(_config(no_eos, eos_token="<|im_end|>"))
  assert setup.task.tokenizer.eos_ids == (3,)
  assert setup.sampling.stop_tokens == (3,)
  with pytest.raises(ValueError, match=r"--config.model.eos_token='<nope>' is not in the "
                                       "tokenizer vocabulary"):
    build(_config(no_eos, eos_token="<nope>"))


def test_the_eos_flag_needs_a_checkpoint():
  c = base_config.get_config("fp32")
  c.model.eos_token = "</s>"
  with pytest.raises(ValueError, match=r"^--config.model.eos_token='</s>' applies to "
                                       "--config.model.hf_checkpoint only"):
    build(c)
