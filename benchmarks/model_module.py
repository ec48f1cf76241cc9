"""Loads another version of ``jaxpar/models/gpt.py`` from a file, to benchmark it beside the current model."""

from __future__ import annotations

import importlib.util
import sys


def load_model_module(path: str):
    """The module in ``path`` (it must define ``GPT`` and ``GPTConfig``), imported as ``gpt_compared``."""
    spec = importlib.util.spec_from_file_location("gpt_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt_compared"] = module      # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    for name in ("GPT", "GPTConfig"):
        if not hasattr(module, name):
            raise ValueError(f"{path} defines no {name}; pass a copy of jaxpar/models/gpt.py")
    return module
