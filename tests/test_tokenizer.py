import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lib.tokenizer import VOCAB, VOCAB_SIZE, decode, encode


def test_vocabulary_is_newline_plus_printable_ascii():
    assert VOCAB_SIZE == 96 and VOCAB[0] == "\n" and VOCAB[1:] == "".join(map(chr, range(32, 127)))


@given(st.text(alphabet=VOCAB))
def test_round_trip(text):
    assert decode(encode(text)) == text


def test_character_outside_vocabulary_names_character_and_position():
    with pytest.raises(ValueError, match=r"'é' \(U\+00E9\) at position 3"):
        encode("caf\u00e9")
    with pytest.raises(ValueError, match=r"'\\t' .* at position 0"):
        encode("\tx")


def test_decode_rejects_ids_outside_vocabulary():
    with pytest.raises(ValueError, match="token id 96 at position 1"):
        decode(np.array([5, 96]))
