"""The fixed character vocabulary: newline plus printable ASCII 32-126, 96 symbols.

A character-level vocabulary keeps the model small enough to train on a CPU, as in
Karpathy's char-rnn and nanoGPT's shakespeare_char.
"""
import numpy as np

VOCAB = "\n" + "".join(chr(i) for i in range(32, 127))
VOCAB_SIZE = len(VOCAB)  # 96
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> np.ndarray:
    """Text -> token ids (int64). Raises ValueError naming the first character outside the vocabulary."""
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}" +
                        (" (decode bytes to str first)" if isinstance(text, (bytes, bytearray)) else ""))
    try:
        return np.array([_INDEX[ch] for ch in text], dtype=np.int64)
    except KeyError:
        pos = next(i for i, ch in enumerate(text) if ch not in _INDEX)
        raise ValueError(
            f"character {text[pos]!r} (U+{ord(text[pos]):04X}) at position {pos} is not in the "
            f"vocabulary (newline and printable ASCII 32-126)") from None


def decode(tokens) -> str:
    """Token ids -> text. Raises ValueError on an id outside 0..95."""
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"decode takes integer token ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= VOCAB_SIZE)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(f"token id {int(ids[pos])} at position {pos} is outside 0..{VOCAB_SIZE - 1}")
    return "".join(VOCAB[i] for i in ids)
