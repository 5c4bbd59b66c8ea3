"""A Hugging Face tokenizer.json through `lowrl.checkpoints.tokenizer.load_tokenizer`: round trips,
special tokens found by name or given, one-line errors for a missing file or an unknown token."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrl.checkpoints.tokenizer import load_tokenizer
from lowrl.tasks.tokenizer import Tokenizer as TaskTokenizer


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
  """A small byte-level BPE tokenizer.json trained on the spot (no download)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["12+345=357", "what is 2+2? \\boxed{4}", "hello world"] * 10, trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


@given(text=st.text(max_size=40))
def test_hf_round_trip(tokenizer_json, text):
  tok = load_tokenizer(tokenizer_json)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id] + ids) == text


def test_hf_special_tokens(tokenizer_json):
  tok = load_tokenizer(tokenizer_json)  # no config files: the common names <pad>, <s>, </s>
  assert isinstance(tok, TaskTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  from tokenizers import Tokenizer
  assert tok.vocab_size == Tokenizer.from_file(tokenizer_json).get_vocab_size() > 256
  tok2 = load_tokenizer(tokenizer_json, bos_token="</s>", eos_token="<s>", pad_token="</s>")
  assert (tok2.bos_id, tok2.eos_id, tok2.pad_id) == (2, 1, 2)


def test_hf_errors(tokenizer_json, tmp_path):
  with pytest.raises(ValueError, match="eos_token='<nope>' is not in the tokenizer vocabulary"):
    load_tokenizer(tokenizer_json, eos_token="<nope>")
  with pytest.raises(FileNotFoundError, match="missing.json not found"):
    load_tokenizer(str(tmp_path / "missing.json"))
  from tokenizers import Tokenizer, models
  bare = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
  path = tmp_path / "bare.json"
  bare.save(str(path))
  with pytest.raises(ValueError, match="pass eos_token=... explicitly"):
    load_tokenizer(str(path))
  tok = load_tokenizer(str(path), eos_token="b")  # no bos: allowed; pad falls back to eos
  assert tok.bos_id is None and tok.pad_id == tok.eos_id == 1


def test_a_missing_tokenizer_json_names_the_fix_that_applies(tmp_path):
  """No tokenizer at all: copy it from the base model; a slow tokenizer only: convert it."""
  with pytest.raises(FileNotFoundError) as e:
    load_tokenizer(str(tmp_path))
  assert "saved without its tokenizer. Copy tokenizer.json and tokenizer_config.json" in str(e.value)
  assert "convert" not in str(e.value).lower()
  (tmp_path / "tokenizer.model").write_bytes(b"\x00")
  with pytest.raises(FileNotFoundError) as e:
    load_tokenizer(str(tmp_path))
  assert f"{tmp_path} has ['tokenizer.model'], a slow tokenizer" in str(e.value)
  assert (f"AutoTokenizer.from_pretrained('{tmp_path}').save_pretrained('{tmp_path}')"
          in str(e.value))


def test_no_eos_token_lists_the_special_tokens_to_name(tokenizer_json, tmp_path):
  import json
  import shutil

  from lowrl.checkpoints.tokenizer import MissingEosError
  shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
  with pytest.raises(MissingEosError) as e:
    load_tokenizer(str(tmp_path))
  assert e.value.specials == ("<pad>", "<s>", "</s>")
  assert e.value.config_file == str(tmp_path / "tokenizer_config.json")
  assert str(e.value) == (
      f"No eos token in {str(tmp_path)!r}: tokenizer_config.json, generation_config.json and "
      "config.json define none. Name the token that ends a completion: pass eos_token=... "
      "explicitly (its special tokens: ['<pad>', '<s>', '</s>']), or add \"eos_token\" to "
      f"{tmp_path / 'tokenizer_config.json'}.")
  assert load_tokenizer(str(tmp_path), eos_token="</s>").eos_ids == (2,)
