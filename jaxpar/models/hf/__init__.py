"""Hugging Face checkpoints in and out: ``load(dir) -> (model, params)`` and ``save(model, params, dir)``.

* :mod:`jaxpar.models.hf.checkpoint`: load and save, dispatching on the family through its weight adapter.
* :mod:`jaxpar.models.hf.gpt2`, :mod:`jaxpar.models.hf.llama`, :mod:`jaxpar.models.hf.families` (Qwen2, Qwen3,
  Mistral, Gemma 3), :mod:`jaxpar.models.hf.moe` (Mixtral, Qwen3-MoE): one weight adapter per family, built from
  the readers of :mod:`jaxpar.models.hf.weights`.
* :mod:`jaxpar.models.hf.config`: ``config.json`` to a model config and back, refusing fields that change
  the computation.
* :mod:`jaxpar.models.hf.tokenizer`: the checkpoint's ``tokenizer.json`` read as data, checked against the
  model's vocabulary.
* :mod:`jaxpar.models.hf.files`: the checkpoint's files read as data (paths confined, dtypes checked) and
  written whole.
"""

from jaxpar.models.hf.checkpoint import load, save, with_names
from jaxpar.models.hf.tokenizer import load_tokenizer, tokenizer_file

__all__ = ["load", "load_tokenizer", "save", "tokenizer_file", "with_names"]

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
