"""Imports of optional libraries (run tooling: plots, TensorBoard, progress bars), where they are used.

``import jaxpar`` needs only the core dependencies (jax, flax, optax, orbax-checkpoint, numpy); a feature that
needs more imports it through :func:`require`, which names the extra to install when it is missing. An entry
point (``experiments/*.py``) needs its whole extra and checks it at start with :func:`require_extra`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


_PIP_NAMES = {"sklearn": "scikit-learn"}   # import name -> the name pip installs it by
# import names of pyproject.toml's [project.optional-dependencies] (tests/test_core_install.py keeps them equal)
EXTRAS = {"experiments": ("tyro", "tqdm", "tensorboardX", "matplotlib", "sklearn"),
          "data": ("tokenizers", "pyarrow", "grain"),
          "gpu": ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")}


def _install(extra: str) -> str:
    return f"pip install 'jaxpar[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


def require(module: str, feature: str, extra: str = "experiments") -> ModuleType:
    """Imports ``module`` or raises ImportError naming ``feature`` and the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f"{feature} needs {top}, which is not installed: {_install(extra)}, or pip install "
                          f"{_PIP_NAMES.get(top, top)}") from e


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None   # None also for sys.modules[module] = None
    except (ImportError, ValueError):
        return False


def require_extra(feature: str, extra: str = "experiments") -> None:
    """Checks, without importing them, that every library of the pip extra ``extra`` is installed.

    For an entry point, before its first optional import: a core-only install (``pip install -e .``) then
    fails at once with the command to run, not with a bare ``ModuleNotFoundError``, nor after training when
    the plots are drawn. Presence is looked up with ``importlib.util.find_spec``.

    Args:
      feature: what needs the extra, e.g. ``"experiments/charlm.py"`` (named in the message).
      extra: a key of :data:`EXTRAS`.

    Raises:
      ImportError: one or more libraries missing; the message names ``feature``, each missing library and
        the pip command for the extra.
      ValueError: an unknown ``extra``.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra={extra!r} is not one of jaxpar's extras {sorted(EXTRAS)}")
    missing = [m for m in EXTRAS[extra] if not _installed(m)]
    if missing:
        names = ", ".join(_PIP_NAMES.get(m, m) for m in missing)
        raise ImportError(f"{feature} needs the {extra!r} extra, and {names} {'is' if len(missing) == 1 else 'are'} "
                          f"not installed: {_install(extra)}")
