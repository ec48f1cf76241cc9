"""jaxpar: run pure JAX training functions on a device mesh with every standard parallelism."""

from jaxpar import data, dispatch, gpu, grads, jit, metrics, models, optim, plot, precision, sharding, train
from jaxpar import pipeline, pruning
from jaxpar import checkpoint, loop
from jaxpar import plan
from jaxpar.mesh import AXES, describe, initialize_distributed, make_mesh
from jaxpar.precision import Policy
from jaxpar.train import TrainState

__version__ = "0.1.0"
__all__ = ["AXES", "Policy", "TrainState", "checkpoint", "data", "describe", "gpu", "grads", "initialize_distributed",
           "jit", "loop", "make_mesh", "metrics", "models", "optim", "pipeline", "plan", "plot", "precision", "pruning",
           "sharding", "train"]
