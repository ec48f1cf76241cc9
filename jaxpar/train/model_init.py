"""What a model's init gives a ``TrainState``: params, model state, their names, and an NNX graph definition.

``jp.train.init_state(init_fn, ...)`` accepts what researchers bring:

* ``init_fn(rng) -> params``: a Linen ``model.init`` (with ``nn.with_logical_partitioning`` names, mesh-axis
  names from ``nn.with_partitioning``, or none), or any function returning a pytree of arrays (a dict MLP);
* a Linen variables dict with collections beside ``params`` (``{"params": ..., "batch_stats": ...}``, what
  ``model.init`` returns for a model with ``nn.BatchNorm``): ``{"params": ...}`` become the state's params and
  the other collections its ``model_state`` (Flax's ImageNet example keeps ``batch_stats`` beside the params
  the same way);
* a Flax NNX model function (:func:`jaxpar.train.nnx_bridge.module_fn`): ``Param`` variables become params,
  every other variable the model state, and the graph definition the state's static ``graphdef``.

In every form, the entries under a declared carried key (:mod:`jaxpar.train.carried`: a Linen collection of that
name, or the key at any depth of the params) go to the state's ``carried``.

Init is traced without the logical rules in context (:func:`jaxpar.sharding.use_for_init`) and NNX's eager
sharding off, so any init plain Flax runs runs here; ``jit``'s ``out_shardings`` then place the leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh

from jaxpar import protocol
from jaxpar.sharding import rules as shd
from jaxpar.train import carried, nnx_bridge
from jaxpar.sharding.params import boxed_names


@dataclasses.dataclass(frozen=True)
class ModelInit:
    """An init function, described abstractly.

    Attributes:
      init: ``init(key) -> (params, model_state, carried)``, traceable (unboxed arrays; ``model_state`` None when
        the model has none; ``carried`` the carried state taken out of the params, :func:`jaxpar.train.carried.split`,
        or None).
      param_shapes, param_names: ``jax.ShapeDtypeStruct`` and dimension names (tuple or None) per param leaf.
      state_shapes, state_names: the same for the model state (None when it has none).
      graphdef: the NNX graph definition, or None for a Linen / plain model.
    """
    init: Callable[[jax.Array], tuple[Any, Any]]
    param_shapes: Any
    param_names: Any
    state_shapes: Any = None
    state_names: Any = None
    graphdef: Any = None
    carried_shapes: Any = None   # ``jax.ShapeDtypeStruct`` per carried leaf (None without carried state)

    def __getattr__(self, name: str) -> Any:
        """``<attribute>_shapes``: the part of :attr:`carried_shapes` of the collection declaring that
        ``TrainState`` attribute (as ``TrainState.<attribute>`` reads the state's)."""
        if not name.endswith("_shapes"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return carried.read_attribute(self.carried_shapes, name.removesuffix("_shapes"), type(self).__name__)


def _collections(variables: Any) -> bool:
    """Whether an init output is a Linen variables dict with collections beside ``params``."""
    return (isinstance(variables, Mapping) and "params" in variables and len(variables) > 1
            and all(isinstance(v, Mapping) for v in variables.values()))


def _split(variables: Any) -> tuple[Any, Any]:
    """``(params, model state)``; carried collections that come back through the gradient stay with the params."""
    if not _collections(variables):
        return variables, None
    keep = ("params", *(d.key for d in protocol.carried_declarations("gradient")))
    state = {k: v for k, v in variables.items() if k not in keep}
    return {k: v for k, v in variables.items() if k in keep}, state or None


def describe(init_fn: Any, rng: jax.Array, mesh: Mesh) -> ModelInit:
    """The :class:`ModelInit` of ``init_fn`` (see the module docstring), from abstract evaluation only.

    Raises:
      TypeError: ``init_fn`` is not callable.
    """
    if not callable(init_fn):
        raise TypeError(f"init_fn must be a function init_fn(rng) -> params, or a Flax NNX model function "
                        f"model_fn(rngs) -> nnx.Module (or an nnx.Module class); got {init_fn!r}")
    make = nnx_bridge.module_fn(init_fn)
    if make is None:
        with shd.use_for_init(mesh), nnx.use_eager_sharding(False):
            # a new function each time: jax caches eval_shape's trace by function, and what init_fn builds
            # depends on the policy in context (e.g. fp8 meta state under dot=fp8 only)
            boxed = jax.eval_shape(lambda r: init_fn(r), rng)
        if nnx_bridge.is_module(boxed):        # a function of a key that builds an NNX model
            make = init_fn
    if make is not None:
        graphdef, pshapes, pnames, sshapes, snames = nnx_bridge.abstract(make, rng)
        (pshapes, held), pnames = carried.split(pshapes), carried.split(pnames)[0]

        def init_nnx(key):
            _, params, state = nnx_bridge.build(make, key)
            params, params_held = carried.split(params)
            return params, state, params_held
        return ModelInit(init_nnx, pshapes, pnames, sshapes, snames, graphdef,
                         carried_shapes=held)
    params, state = _split(boxed)
    params, held = carried.split(params)

    def init(key):
        with nnx.use_eager_sharding(False):
            p, s = _split(nn.meta.unbox(init_fn(key)))
        p, h = carried.split(p)
        return p, s, h
    return ModelInit(init, nn.meta.unbox(params), boxed_names(params),
                     None if state is None else nn.meta.unbox(state), None if state is None else boxed_names(state),
                     carried_shapes=None if held is None else nn.meta.unbox(held))


__all__ = ["ModelInit", "describe"]
