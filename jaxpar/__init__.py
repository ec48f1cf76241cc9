"""jaxpar: run pure JAX training functions on a device mesh with every standard parallelism."""

from jaxpar import attention, data, fp8, gpu, grads, mesh, metrics, models, optim, plot, precision, sharding, train
from jaxpar import pipeline, pruning
from jaxpar import checkpoint, loop
from jaxpar import plan
from jaxpar.mesh import AXES, describe, initialize_distributed, make_mesh
from jaxpar.precision import Policy   # jp.Policy.from_string("mixed_bf16"): the policy is a top-level name

__version__ = "0.1.0"
# The public namespaces: jp and the modules below (jit and dispatch are internal machinery; jaxpar.cli, the
# experiment tooling, is never imported here). Each public name is exported by one of them only.
__all__ = ["AXES", "attention", "checkpoint", "data", "describe", "fp8", "gpu", "grads", "initialize_distributed", "loop", "make_mesh",
           "mesh", "metrics", "models", "optim", "pipeline", "plan", "plot", "Policy", "precision", "pruning",
           "sharding", "train"]
