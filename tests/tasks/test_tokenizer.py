"""Tokenizers: CharTokenizer and a bare tokenizer.json through load_tokenizer."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrl.checkpoints.tokenizer import load_tokenizer
from lowrl.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer
from lowrl.tasks.tokenizer import Tokenizer as TaskTokenizer

TOK = CharTokenizer()


@given(st.text(alphabet=DEFAULT_CHARS, max_size=60))
def test_char_round_trip(text):
  ids = TOK.encode(text)
  assert len(ids) == len(text)
  assert all(3 <= i < TOK.vocab_size for i in ids)  # text never becomes a special token
  assert TOK.decode(ids) == text


@given(st.text(alphabet=DEFAULT_CHARS, max_size=20), st.lists(st.integers(0, 98), max_size=10))
def test_char_decode_stops_at_eos_and_drops_pad_bos(text, tail):
  ids = [TOK.bos_id] + TOK.encode(text) + [TOK.eos_id] + tail
  assert TOK.decode(ids) == text
  padded = [TOK.pad_id, TOK.bos_id] + [x for i in TOK.encode(text) for x in (i, TOK.pad_id)]
  assert TOK.decode(padded) == text


def test_char_special_ids_and_size():
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert TOK.vocab_size == 3 + len(DEFAULT_CHARS) == 99
  assert TOK.encode("0") == [3]  # ids are fixed: chars[i] -> 3 + i
  # The text of a special token is ordinary characters.
  assert TOK.decode(TOK.encode("<eos>")) == "<eos>" and TOK.eos_id not in TOK.encode("<eos>")


def test_char_decode_accepts_arrays_and_generators():
  ids = TOK.encode("ab") + [TOK.eos_id, 5]
  assert TOK.decode(np.asarray(ids, np.int32)) == "ab"
  assert TOK.decode(i for i in ids) == "ab"
  assert TOK.decode([]) == ""


def test_char_errors():
  with pytest.raises(ValueError, match="'é' at position 2"):
    TOK.encode("ab\u00e9")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    TOK.decode([5, 999])
  with pytest.raises(ValueError, match="1-D"):
    TOK.decode(np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="duplicates"):
    CharTokenizer("abca")
  with pytest.raises(ValueError, match="single characters"):
    CharTokenizer(["ab", "c"])
  with pytest.raises(ValueError, match="at least one"):
    CharTokenizer("")


def test_char_from_texts_is_sorted_and_deterministic():
  tok = CharTokenizer.from_texts(["cab", "b a"])
  assert tok.chars == (" ", "a", "b", "c")
  assert tok.encode("abc ") == [4, 5, 6, 3]
  with pytest.raises(ValueError, match="not in the tokenizer vocabulary"):
    tok.encode("d")


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
