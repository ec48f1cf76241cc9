"""Imports of optional libraries (run tooling: plots, TensorBoard, progress bars), where they are used.

``import jaxpar`` needs only the core dependencies (jax, flax, optax, orbax-checkpoint, numpy); a feature that
needs more imports it through :func:`require`, which names the extra to install when it is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType


_PIP_NAMES = {"sklearn": "scikit-learn"}   # import name -> the name pip installs it by


def require(module: str, feature: str, extra: str = "experiments") -> ModuleType:
    """Imports ``module`` or raises ImportError naming ``feature`` and the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f"{feature} needs {top}, which is not installed: pip install 'jaxpar[{extra}]' (from a "
                          f"checkout: pip install '.[{extra}]'), or pip install {_PIP_NAMES.get(top, top)}") from e
