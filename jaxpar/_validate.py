"""Argument checks shared across jaxpar's API boundary: one home, so each check and its message exist once.

Every public function validates its arguments before tracing and raises ``ValueError`` / ``TypeError`` whose
message names the value, the constraint and the fix (docs/architecture.md, "Features check themselves"). Checks used by more than one
module live here; a check only one module needs stays beside it.
"""

from __future__ import annotations

import numbers


def positive_int(name: str, value, hint: str = "") -> int:
    """``int(value)`` for a positive integer of any integral type (numpy's too, never a bool).

    Raises:
      ValueError: ``'<name>=<value> must be a positive int'`` followed by ``hint`` (e.g. the fix).
    """
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int{hint}")
    return int(value)


def nonnegative_int(name: str, value, hint: str = "") -> int:
    """``int(value)`` for an integer ``>= 0`` of any integral type (numpy's too, never a bool): a step, a count
    where 0 means "none" or "the default".

    Raises:
      ValueError: ``'<name>=<value> must be an int >= 0'`` followed by ``hint`` (e.g. what 0 means).
    """
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0{hint}")
    return int(value)
