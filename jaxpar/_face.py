"""Package faces that stand where a module stood: patching a name through the face reaches the running code.

``jaxpar.sharding``, ``jaxpar.precision``, ``jaxpar.train``, ``jaxpar.data`` and ``jaxpar.models.hf`` were modules
holding their functions; they are now packages whose ``__init__`` re-exports them from the modules that hold the
code. ``monkeypatch.setattr(jp.sharding, "process_batch_rows", f)`` on a plain package would only rebind the face's
name, while the code keeps calling the holder's. A :class:`Face` also sets (and deletes) the name in the module
that defines the object it replaces, so a patch, and its undo, reach every caller that looks the name up there.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class Face(types.ModuleType):
    """A package module whose attribute assignments also reach the module holding the replaced object."""

    def __setattr__(self, name: str, value: Any) -> None:
        home = _home(self, name, value)
        super().__setattr__(name, value)
        if home is not None:
            setattr(home, name, value)

    def __delattr__(self, name: str) -> None:
        home = _home(self, name, None)
        super().__delattr__(name)
        if home is not None:
            delattr(home, name)


def _home(face: types.ModuleType, name: str, value: Any) -> types.ModuleType | None:
    """The module holding the face's current ``name`` under that name: the module that defines it, or (undoing a
    patch) the one that defines ``value``. None when neither holds it (a name of the face's own)."""
    current = face.__dict__.get(name)
    for obj in (current, value):
        home = sys.modules.get(getattr(obj, "__module__", None) or "")
        if home is not None and home is not face and name in vars(home) and vars(home)[name] is current:
            return home
    return None


def stands_for_module(module_name: str) -> None:
    """Makes the imported package ``module_name`` a :class:`Face` (called at the end of its ``__init__``)."""
    sys.modules[module_name].__class__ = Face
