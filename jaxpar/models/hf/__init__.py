"""Hugging Face checkpoints in and out: ``load(dir) -> (model, params)`` and ``save(dir, model, params)``.

* :mod:`jaxpar.models.hf.checkpoint`: load and save, dispatching on the family through its weight adapter.
* :mod:`jaxpar.models.hf.gpt2`, :mod:`jaxpar.models.hf.llama`: one weight adapter per family, built from the
  readers of :mod:`jaxpar.models.hf.weights`.
* :mod:`jaxpar.models.hf.config`: ``config.json`` to a model config and back, refusing fields that change
  the computation.
* :mod:`jaxpar.models.hf.files`: the checkpoint's files read as data (paths confined, dtypes checked) and
  written whole.
"""

from jaxpar.models.hf.checkpoint import load, save, with_names

__all__ = ["load", "save", "with_names"]

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
