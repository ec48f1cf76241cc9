"""Pytree key paths as text: the one formatter of ``jax.tree_util`` key paths for reports, errors and keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def key_names(path: Sequence[Any]) -> tuple[str, ...]:
    """Each entry of a key path as a string: a dict key, an attribute name or a sequence index (strings as they
    are), e.g. ``("blocks", "0", "kernel")``."""
    part = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    return tuple(part(k) for k in path)


def key_path(path: Sequence[Any], indexing: bool = False) -> str:
    """A pytree key path (``jax.tree_util`` key entries, or names) as text.

    Args:
      path: key entries (``DictKey``, ``GetAttrKey``, ``SequenceKey``, ...) or strings.
      indexing: False: the names joined by ``/`` (``blocks/0/kernel``: parameter names in reports, pruning masks
        and sharding tables). True: the Python indexing expression that reaches the leaf (``['blocks'][0]
        ['kernel']``, ``jax.tree_util.keystr``): after a value's name in an error (``params['w'] has shape``),
        and the stable keys of a checkpoint's leaves.
    """
    return jax.tree_util.keystr(tuple(path)) if indexing else "/".join(key_names(path))


__all__ = ["key_names", "key_path"]
