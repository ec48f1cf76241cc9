"""Flax NNX models in a ``TrainState``: split once into a graph definition and pure pytrees, merged per step.

An NNX model is an object holding its variables. jaxpar keeps the pure-function form (Flax's own
``nnx.split`` / ``nnx.merge``, the functional API of the NNX guide):

* ``TrainState.graphdef``: the model's ``nnx.GraphDef`` (static: structure, not arrays);
* ``TrainState.params``: its ``nnx.Param`` variables as a pure dict (``nnx.to_pure_dict``: nested dicts of
  arrays, key paths such as ``blocks/0/attn/query/kernel``), which optax, checkpoints, precision policies and
  pruning see as any params (the fp8 meta state of ``jp.fp8.NnxDotGeneral`` layers, ``nnx.Param`` variables
  under the key ``_overwrite_with_gradient``, is kept apart in ``TrainState.fp8`` and merged back by the step
  before ``nnx.merge``, so the model reads it and its VJP gives the new values);
* ``TrainState.model_state``: every other variable (``nnx.BatchStat`` running statistics, ``nnx.RngState``
  streams of ``nnx.Dropout``, caches) as a pure dict, never touched by the optimizer, updated by the step.

Each step rebuilds the model with ``nnx.merge(graphdef, params, model_state)`` inside the traced function,
calls the user's ``loss_fn(model, batch, rng)`` and reads the variables the call changed back with
``nnx.state(model, nnx.Not(nnx.Param))``. Shardings come from the variables' ``out_sharding`` metadata
(``nnx.with_partitioning(init, names)``, as ``nnx.get_partition_spec`` reads it) through the logical rules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


def module_fn(fn: Any) -> Callable[[jax.Array], nnx.Module] | None:
    """``key -> nnx.Module`` for an NNX model function, else None (a Linen ``init_fn(rng) -> params``).

    NNX forms: an ``nnx.Module`` subclass (called as ``cls(rngs=nnx.Rngs(key))``; give other arguments with
    ``functools.partial(cls, ...)``), or ``model_fn(rngs) -> nnx.Module`` (its first parameter named ``rngs``).
    A function of a key that returns an ``nnx.Module`` is recognised by :func:`abstract`.
    """
    if isinstance(fn, nnx.Module):
        raise TypeError(f"init_state got an nnx.Module instance ({type(fn).__name__}); pass its class (or "
                        f"functools.partial(cls, ...)) or a model_fn(rngs) -> nnx.Module, so the model is built "
                        f"sharded from the start, e.g. jp.train.init_state({type(fn).__name__}, tx, 0, mesh=mesh)")
    target = getattr(fn, "func", fn)            # functools.partial
    if inspect.isclass(target) and issubclass(target, nnx.Module):
        return lambda key: fn(rngs=nnx.Rngs(key))
    try:
        first = next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return None
    return (lambda key: fn(nnx.Rngs(key))) if first == "rngs" else None


def build(make: Callable[[jax.Array], nnx.Module], key: jax.Array) -> tuple[Any, Any, Any]:
    """``(graphdef, params, model_state)`` of ``make(key)``: pure dicts (traceable; eager sharding off, so
    ``out_sharding`` names need no mesh: ``jit``'s ``out_shardings`` place the variables)."""
    with nnx.use_eager_sharding(False):
        model = make(key)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"the NNX model function returned {type(model).__name__}, not an nnx.Module")
    graphdef, params, rest = nnx.split(model, nnx.Param, STATE, ...)[:3]
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def abstract(make: Callable[[jax.Array], nnx.Module], key: jax.Array) -> tuple[Any, Any, Any, Any, Any]:
    """``(graphdef, params shapes, params names, model-state shapes, model-state names)`` of ``make(key)``,
    computing nothing (``nnx.eval_shape``). Names: per leaf a tuple of the variable's ``out_sharding`` names,
    None where it has none."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: make(key))
    graphdef, params, rest = nnx.split(model, nnx.Param, STATE, ...)[:3]
    names = lambda state: jax.tree.map(lambda s: tuple(s) or None, nnx.to_pure_dict(nnx.get_partition_spec(state)),
                                       is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    shapes = lambda state: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    return graphdef, shapes(params), names(params), shapes(rest), names(rest)


def module_class(graphdef: Any) -> type | None:
    """The class of the model ``graphdef`` describes (its root node's type: where a model declares protocol
    attributes such as ``shards_activations``), or None (no graph definition)."""
    nodes = getattr(graphdef, "nodes", None)
    return getattr(nodes[0], "type", None) if nodes else None


def merge(graphdef: Any, params: Any, model_state: Any) -> nnx.Module:
    """The model of ``graphdef`` with these params and model state (pure dicts); traceable."""
    return nnx.merge(graphdef, params, model_state if model_state is not None else {})


STATE = nnx.Not(nnx.Any(nnx.Param, nnx.Intermediate))
"""The variables a ``TrainState.model_state`` holds: neither params nor ``sow``'s per-call intermediates."""


def model_state(model: nnx.Module) -> Any:
    """The model-state variables of ``model`` (:data:`STATE`) as a pure dict (what a step writes back)."""
    return nnx.to_pure_dict(nnx.state(model, STATE))


def is_module(x: Any) -> bool:
    return isinstance(x, nnx.Module)


__all__ = ["STATE", "abstract", "build", "is_module", "merge", "model_state", "module_fn"]
