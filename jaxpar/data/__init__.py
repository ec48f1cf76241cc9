"""Data: text corpora, token files and their preparation, grain pipelines packed into batches.

* :mod:`jaxpar.data.corpora`: ``CharCorpus`` (characters, step-indexed batches), ``Digits`` (scikit-learn's).
* :mod:`jaxpar.data.prepare`: tokenize text into a token directory (a BPE trained or loaded).
* :mod:`jaxpar.data.token_file`: ``TokenFile`` / ``TokenCorpus``: windows of a token directory.
* :mod:`jaxpar.data.grain_pipeline`: ``grain_batches``: a grain dataset of documents packed into rows.
"""

from jaxpar.data import prepare
from jaxpar.data.corpora import CharCorpus, Digits, default_text, load_text
from jaxpar.data.grain_pipeline import GrainBatches, grain_batches
from jaxpar.data.token_file import TokenCorpus, TokenFile
from jaxpar.sharding.batches import process_slice

__all__ = ["CharCorpus", "Digits", "GrainBatches", "TokenCorpus", "TokenFile", "default_text", "grain_batches",
           "load_text", "prepare", "process_slice"]

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
