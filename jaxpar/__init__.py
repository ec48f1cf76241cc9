"""jaxpar: run pure JAX training functions on a device mesh with every standard parallelism.

The package is a set of rooms, each a namespace with a thin face (its ``__init__`` and ``__all__``), in this
order (a room imports only rooms before it; ``tests/test_package.py`` enforces it; docs/architecture.md):
``protocol``, ``sharding``, ``precision``, ``layers``, ``data``, ``train``, ``pipeline``, ``pruning``, ``models``,
``tools``, ``plan``, and ``cli`` (the experiment tooling, never imported here).
"""

import importlib as _importlib
import sys as _sys

from jaxpar import data, layers, models, pipeline, plan, precision, pruning, sharding, tools, train
from jaxpar.precision.policy import Policy   # jp.Policy.from_string("mixed_bf16"): the policy is a top-level name
from jaxpar.sharding.mesh import AXES, describe, initialize_distributed, make_mesh

__version__ = "0.1.0"
__all__ = ["AXES", "Policy", "data", "describe", "initialize_distributed", "layers", "make_mesh", "models",
           "pipeline", "plan", "precision", "pruning", "sharding", "tools", "train"]

# Module paths from before the rooms, kept as the same module objects (not copies), so that code patching a
# function through an old path reaches the running code. ``jp.attention``, ``jp.fp8``, ``jp.grads``, ... are
# these modules too.
MOVED_MODULES = {
    "jaxpar.attention": "jaxpar.layers.attention",
    "jaxpar.batches": "jaxpar.sharding.batches",
    "jaxpar.checkpoint": "jaxpar.train.checkpoint",
    "jaxpar.checks": "jaxpar._validate",
    "jaxpar.dispatch": "jaxpar.train._dispatch",
    "jaxpar.fp8": "jaxpar.precision.fp8",
    "jaxpar.gpu": "jaxpar.tools.gpu",
    "jaxpar.grads": "jaxpar.train.grads",
    "jaxpar.grain_data": "jaxpar.data.grain_pipeline",
    "jaxpar.jit": "jaxpar.train._jit",
    "jaxpar.loop": "jaxpar.train.loop",
    "jaxpar.mesh": "jaxpar.sharding.mesh",
    "jaxpar.metrics": "jaxpar.tools.metrics",
    "jaxpar.model_init": "jaxpar.train.model_init",
    "jaxpar.models.hf_config": "jaxpar.models.hf.config",
    "jaxpar.models.hf_files": "jaxpar.models.hf.files",
    "jaxpar.models.nnx_bridge": "jaxpar.train.nnx_bridge",
    "jaxpar.models.protocol": "jaxpar.protocol",
    "jaxpar.optim": "jaxpar.train.optim",
    "jaxpar.origins": "jaxpar.sharding.opt_state",
    "jaxpar.pipeline.core": "jaxpar.pipeline.shard_map",
    "jaxpar.pipeline.custom": "jaxpar.pipeline.actions",
    "jaxpar.pipeline.layout": "jaxpar.pipeline.stage_layout",
    "jaxpar.pipeline.model": "jaxpar.pipeline.staged_model",
    "jaxpar.pipeline.runtime": "jaxpar.pipeline.functional",
    "jaxpar.placement": "jaxpar.sharding.params",
    "jaxpar.plan.hlo": "jaxpar._hlo",
    "jaxpar.plan.layout": "jaxpar.plan.mesh_sizes",
    "jaxpar.plot": "jaxpar.tools.plot",
    "jaxpar.pruning.structure": "jaxpar.pruning.paths",
    "jaxpar.reports": "jaxpar.sharding.report",
    "jaxpar.token_file": "jaxpar.data.token_file",
    "jaxpar.tokens": "jaxpar.data.prepare",
}
for _old, _new in MOVED_MODULES.items():
    _module = _importlib.import_module(_new)
    _sys.modules[_old] = _module
    _parent, _, _leaf = _old.rpartition(".")
    setattr(_sys.modules[_parent], _leaf, _module)
