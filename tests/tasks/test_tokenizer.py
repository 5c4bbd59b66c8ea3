"""The character tokenizer (`lowrl.tasks.tokenizer.CharTokenizer`): round trips, special ids, errors."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrl.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer

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
