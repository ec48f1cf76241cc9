"""jaxpar/run.py, the tooling the experiment entry points share: its config pieces' flag checks, as the scripts'
``Config`` classes raise them. The entry points themselves run end to end in tests/test_experiments.py."""

from __future__ import annotations

import dataclasses

import pytest
from test_experiments import load


def test_digits_rejects_bad_pruning_flags():
    digits = load("digits")
    for bad in (dict(sparsity=1.0), dict(sparsity=0.5, distribution="layer"), dict(n_m=(4, 2)),
                dict(sparsity=0.5, prune_begin=300, prune_end=200), dict(sparsity=0.5, prune_end=10_000)):
        with pytest.raises(ValueError, match="pruning flags"):
            digits.Config(pruning=dataclasses.replace(digits.Config().pruning, **bad))


def test_prune_structure_rejects_bad_flags():
    charlm = load("charlm")
    for bad, match in ((dict(prune_structure="both"), "--sparsity"),
                       (dict(prune_structure="heads", sparsity=0.5, n_m=(2, 4)), "N:M"),
                       (dict(prune_structure="neurons", sparsity=0.5, distribution="erk"), "erk"),
                       (dict(prune_structure="layers", sparsity=0.5), "--prune-structure")):
        with pytest.raises(ValueError, match=match):
            charlm.Config(pruning=dataclasses.replace(charlm.Config().pruning, **bad))
