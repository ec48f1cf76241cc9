"""jaxpar/models/hf/tokenizer.py: a checkpoint's ``tokenizer.json`` read from inside its directory, checked against
the model's vocabulary, and refused clearly when malformed or leading out. The tokenizers are trained in the test
on pydoc text (``helpers.pydoc_tokenizer``); ``experiments/finetune.py`` with them is in tests/test_experiments.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import pydoc_tokenizer

from jaxpar.models import hf
from jaxpar.models.hf import tokenizer as hf_tokenizer

pytest.importorskip("tokenizers")


def test_checkpoint_tokenizer_is_read_as_data(tmp_path):
    reference = pydoc_tokenizer(300, chars=20_000)
    text = "Return the value of the named attribute of object; the name must be a string.\n\tx = getattr(o, 'y')"
    want = reference.encode(text, add_special_tokens=False).ids
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    reference.save(str(ckpt / "tokenizer.json"))
    assert hf.tokenizer_file(ckpt) == str(ckpt / "tokenizer.json")
    for source in (ckpt, ckpt / "tokenizer.json"):          # the directory or the file
        got = hf_tokenizer.encode(hf.load_tokenizer(source, vocab_size=300), text)
        assert got.dtype == np.int32 and got.tolist() == want and reference.decode(want) == text
    with pytest.raises(ValueError, match=r"id 299 \(.*\), beyond the model's vocabulary of 299 ids"):
        hf.load_tokenizer(ckpt, vocab_size=299)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert hf.tokenizer_file(empty) is None
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        hf.load_tokenizer(empty)
    with pytest.raises(ValueError, match="does not exist"):
        hf.tokenizer_file(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.mkdir()
    for content in ('{"model": ', '{"version": "1.0", "model": {"type": "NoSuchModel"}}'):
        (bad / "tokenizer.json").write_text(content)
        with pytest.raises(ValueError, match=r"bad/tokenizer.json' is not a tokenizers tokenizer.json"):
            hf.load_tokenizer(bad)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(ckpt / "tokenizer.json", linked / "tokenizer.json")   # a link out of the checkpoint: never read
    with pytest.raises(ValueError, match="leads out of the checkpoint directory"):
        hf.load_tokenizer(linked)
