"""A Hugging Face checkpoint's tokenizer: its ``tokenizer.json`` (the ``tokenizers`` library's format, which
transformers' fast tokenizers save) read as data and checked against the model's vocabulary.

The file is found inside the checkpoint directory only (:func:`jaxpar.models.hf.files.inside`: a link leading
out of it is refused), parsed by ``tokenizers`` (a malformed file is a ``ValueError`` naming it), and every id
it can produce must be an id of the model's embedding. Text is encoded without special tokens (no BOS/EOS
added): a fine-tuning stream is the text's own tokens, as byte-level training streams its bytes.
"""

from __future__ import annotations

import os

import numpy as np

from jaxpar.data.prepare import read_tokenizer
from jaxpar.models.hf.files import inside

TOKENIZER = "tokenizer.json"


def tokenizer_file(path: str | os.PathLike) -> str | None:
    """The ``tokenizer.json`` that ``path`` names: ``path`` itself when it is a file, else the one inside the
    directory ``path`` (None when the directory has none).

    Raises:
      ValueError: ``path`` does not exist, or its ``tokenizer.json`` (or a link on the way) leads out of it.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer {path!r} does not exist; pass a checkpoint directory holding tokenizer.json, "
                         "or a tokenizer.json file")
    if not os.path.lexists(os.path.join(path, TOKENIZER)):
        return None
    return inside(path, TOKENIZER, f"the checkpoint directory {path!r}")


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """The ``tokenizers.Tokenizer`` of ``path``: a checkpoint directory (its ``tokenizer.json``) or the file.

    Args:
      path: a Hugging Face checkpoint directory or a ``tokenizer.json`` file.
      vocab_size: the model's vocabulary (``model.cfg.vocab_size``); every id of the tokenizer, added tokens
        included, must lie in ``[0, vocab_size)``. None: not checked.

    Raises:
      ValueError: no tokenizer.json (:func:`tokenizer_file`), one that is not a ``tokenizers`` file, or ids
        beyond ``vocab_size`` (naming the largest id and its token).
      ImportError: ``tokenizers`` is not installed (``pip install 'jaxpar[hf]'``).
    """
    file = tokenizer_file(path)
    if file is None:
        raise ValueError(f"{os.fspath(path)!r} holds no {TOKENIZER}; pass a directory holding one (transformers' "
                         "tokenizer.save_pretrained writes it) or the file")
    tokenizer = read_tokenizer(file, "jaxpar.models.hf.load_tokenizer", "hf")
    if vocab_size is not None:
        token, largest = max(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1],
                             default=(None, -1))
        if largest >= vocab_size:
            raise ValueError(f"the tokenizer {file!r} has id {largest} ({token!r}), beyond the model's vocabulary of "
                             f"{vocab_size} ids: it belongs to another model; pass the checkpoint's own tokenizer")
    return tokenizer


def encode(tokenizer, text: str) -> np.ndarray:
    """``text``'s token ids (int32 ``[N]``) by ``tokenizer``, without special tokens."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


__all__ = ["TOKENIZER", "encode", "load_tokenizer", "tokenizer_file"]
