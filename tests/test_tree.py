"""jaxpar/_tree.py: the one key-path formatter, on a pytree written here (dict keys, attributes, indices)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpar._tree import key_names, key_path


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    left: np.ndarray
    right: np.ndarray


def test_key_paths_by_name_and_by_indexing():
    tree = {"blocks": [Pair(np.zeros(1), np.ones(1))], "embed": {"table": np.zeros(2)}}
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [key_names(p) for p in paths] == [("blocks", "0", "left"), ("blocks", "0", "right"), ("embed", "table")]
    assert [key_path(p) for p in paths] == ["blocks/0/left", "blocks/0/right", "embed/table"]
    assert [key_path(p, indexing=True) for p in paths] == ["['blocks'][0].left", "['blocks'][0].right",
                                                           "['embed']['table']"]
    assert key_path(("mlp", "up")) == "mlp/up" and key_path(()) == ""
