"""Carried state: what the train step carries that the optimizer does not update, applied by its declaration.

A feature that keeps such state (fp8's scales and amax histories, batch statistics, a token counter, an EMA of
the weights) declares its collection once (:func:`jaxpar.protocol.declare_carried`: a key, how new values
combine, how they reach the step). Accumulation (:mod:`jaxpar.train.grads`), the pipeline interpreter, the
step and checkpoints apply these declarations through this module and never name a feature.

A ``"gradient"`` collection (fp8's ``_overwrite_with_gradient``, a user's counter) sits in the params tree under
its key at any depth. ``init_state`` takes it out into ``TrainState.carried`` (the same nesting, replicated on
every device, checkpointed with the state; :func:`split`); the step puts it back (:func:`merge`) and
differentiates the loss with respect to it; its cotangent is its new value (:func:`overwrite` makes one), which
never reaches the optimizer. Each microbatch starts from the same old value; their new values combine by the
declared rule (:data:`jaxpar.protocol.COMBINES`) over accumulation microbatches (:func:`start`, :func:`add`,
:func:`finish`), over pipeline microbatches (:func:`reduce_microbatches`) and over the batch shards of a manual
region (:func:`reduce_shards`); under GSPMD a reduction over the batch is already global. ``"sum"``'s value is an
increment: the step adds it to the old value (:func:`apply`); a collection declared with ``update`` gets
``update(old, combined)`` instead (the MoE router's bias step).

A ``"loss"`` collection (a Linen collection beside ``params``, NNX variables that are not ``nnx.Param``) is the
state's ``model_state``: the loss takes and returns it, and microbatches read it in order (``"last"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar import protocol
from jaxpar._tree import key_path
from jaxpar.protocol import COMBINES, Carried, declare_carried, overwrite

BATCH_STATS = declare_carried("batch_stats", "last", what="batch statistics (Linen BatchNorm's running mean and "
                              "variance)", through="loss")
"""Linen's ``nn.BatchNorm`` collection (NNX's ``BatchStat`` variables travel the same way, in ``model_state``)."""


def split(params: Any) -> tuple[Any, Any]:
    """``(params without carried state, the carried state)`` (:func:`jaxpar.protocol.split_carried`)."""
    return protocol.split_carried(params)


def merge(params: Any, held: Any) -> Any:
    """The carried state put back into the params (:func:`jaxpar.protocol.merge_carried`)."""
    return protocol.merge_carried(params, held)


def _rule(path: tuple) -> str:
    return protocol.carried_of(path).combine


def is_carried(path: tuple) -> bool:
    """Whether a key path leads into a declared ``"gradient"`` collection."""
    return protocol.carried_of(path) is not None


# ------------------------------------------------------------------------------- combining new values

def start(held: Any) -> Any:
    """The accumulator of a carried tree before any microbatch: the neutral value of each leaf's rule (0; the
    maximum's: ``-inf``)."""
    def neutral(path, x):
        fill = -jnp.inf if _rule(path) == "max" else 0
        return jnp.full(x.shape, fill, x.dtype)
    return jax.tree_util.tree_map_with_path(neutral, held)


def add(acc: Any, value: Any) -> Any:
    """The accumulator after one more microbatch's new values ``value`` (a tree of ``acc``'s structure)."""
    def one(path, a, v):
        how = _rule(path)
        return v if how == "last" else jnp.maximum(a, v) if how == "max" else a + v
    return jax.tree_util.tree_map_with_path(one, acc, value)


def finish(acc: Any, count: int) -> Any:
    """The combined new values of ``count`` microbatches from their accumulator (``"mean"`` divides)."""
    return jax.tree_util.tree_map_with_path(lambda p, a: a / count if _rule(p) == "mean" else a, acc)


def reduce_microbatches(path: tuple, values: jax.Array, axis: int) -> jax.Array:
    """A carried leaf's new values of every microbatch (``values``, microbatches along ``axis`` in order)
    combined by its rule: the pipeline, which holds them per microbatch."""
    how = _rule(path)
    if how == "last":
        return jnp.take(values, values.shape[axis] - 1, axis=axis)
    return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[how](values, axis=axis)


def reduce_shards(path: tuple, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """A carried leaf's new value combined over the batch shards ``axes`` of a manual region (each shard computed
    it from its rows): the maximum, the sum of the increments, else the mean."""
    if not axes:
        return x
    how = _rule(path)
    return jax.lax.pmax(x, axes) if how == "max" else jax.lax.psum(x, axes) if how == "sum" else jax.lax.pmean(x, axes)


def apply(old: Any, new: Any) -> Any:
    """The state's carried tree after a step: ``new`` (the combined new values), the old value plus the
    increment for ``"sum"`` collections, and ``update(old, new)`` on the subtree of a collection declared with
    an ``update``."""
    if old is None:
        return new
    out = jax.tree_util.tree_map_with_path(lambda p, o, n: o + n if _rule(p) == "sum" else n, old, new)
    return _updated(old, new, out)


def _updated(old: Any, new: Any, out: Any) -> Any:
    """``out`` with the subtree under each key whose declaration has an ``update`` replaced by its result."""
    if not isinstance(out, Mapping):
        return out
    result = dict(out)
    for k in out:
        d = protocol.carried_of((jax.tree_util.DictKey(k),))
        if d is not None and d.update is not None:
            result[k] = d.update(old[k], new[k])
        elif d is None:
            result[k] = _updated(old[k], new[k], out[k])
    return type(out)(result) if not isinstance(out, dict) else result


# --------------------------------------------------------------------------------- the state, checkpoints

def by_attribute(name: str) -> Carried | None:
    """The ``"gradient"`` collection a ``TrainState`` attribute (``Carried.attribute``, e.g. ``fp8``) reads."""
    return next((d for d in protocol.carried_declarations() if d.attribute == name), None)


def read_attribute(held: Any, name: str, owner: str) -> Any:
    """``owner.<name>``: the part of the carried tree ``held`` of the collection declaring that attribute.

    Raises:
      AttributeError: no collection declares ``name``.
    """
    declaration = by_attribute(name)
    if declaration is None:
        raise AttributeError(f"{owner} has no attribute {name!r}")
    return part(held, declaration)


def attribute_updates(held: Any, updates: dict) -> dict:
    """``replace(**updates)``'s fields, a collection's attribute (``fp8=``) turned into the new ``carried``."""
    updates = dict(updates)
    for name in [n for n in updates if by_attribute(n) is not None]:
        updates["carried"] = with_part(updates.get("carried", held), by_attribute(name), updates.pop(name))
    return updates


def declarations_in(held: Any) -> tuple[Carried, ...]:
    """The ``"gradient"`` collections a carried tree holds."""
    return tuple(d for d in protocol.carried_declarations() if part(held, d) is not None)


def part(held: Any, declaration: Carried) -> Any:
    """One collection's part of a carried tree (None when it holds none)."""
    return protocol.split_carried(held, (declaration.key,))[1]


def with_part(held: Any, declaration: Carried, value: Any) -> Any:
    """``held`` with one collection's part replaced by ``value`` (None: removed)."""
    rest = protocol.split_carried(held, (declaration.key,))[0] if held is not None else None
    rest = merge(rest or {}, value) if value is not None else rest
    return rest or None


def check_checkpoint(saved: set[str], target: set[str], what: str) -> None:
    """Raises ValueError when a checkpoint's leaf paths (``saved``) and its target's hold different carried
    collections, naming what is missing and how to build the right target (the collection's ``fix``)."""
    for d in protocol.carried_declarations():
        has = lambda paths: any(f"[{d.key!r}]" in p for p in paths)
        fix = d.fix or (f"build the target (jp.train.abstract_state) from an init function whose params "
                        f"{'hold' if has(saved) else 'lack'} the carried key {d.key!r}, as the saved state's did")
        if has(target) and not has(saved):
            raise ValueError(f"{what} holds no {d.what} but the target has: {fix}")
        if has(saved) and not has(target):
            raise ValueError(f"{what} holds {d.what} that the target lacks: {fix}")


def check_state(held: Any, fields: frozenset[str]) -> None:
    """Raises, before anything is traced, for carried state a step cannot carry: a declared attribute that is
    one of the state's ``fields`` (it would shadow it), or a leaf that is not a float array (its new value
    arrives as a cotangent).

    Raises:
      ValueError: an attribute that is a field. TypeError: a non-float leaf, named by its path.
    """
    for d in protocol.carried_declarations():
        if d.attribute in fields:
            raise ValueError(f"the carried collection {d.key!r} declares attribute={d.attribute!r}, a TrainState "
                             f"field it would shadow; declare another attribute (or None)")
    for path, x in jax.tree_util.tree_leaves_with_path(held):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"carried state {key_path(path, indexing=True)} is {x.dtype}: a carried leaf's new value "
                            "arrives as its cotangent, so it is a float array (e.g. a count as float32)")


def check_values(held: Any) -> None:
    """Runs each declared ``check`` (:class:`jaxpar.protocol.Carried`) on the host values of every subtree of
    ``held`` (a concrete carried tree) under its key, before anything is traced.

    Raises:
      ValueError: what a declaration's ``check`` raises.
    """
    def visit(tree: Any) -> None:
        if not isinstance(tree, Mapping):
            return
        for k, v in tree.items():
            d = protocol.carried_of((jax.tree_util.DictKey(k),))
            if d is not None and d.check is not None:
                d.check(jax.device_get(v))
            else:
                visit(v)
    visit(held)


__all__ = ["BATCH_STATS", "COMBINES", "Carried", "add", "apply", "attribute_updates", "by_attribute", "check_checkpoint",
           "check_state", "check_values", "declarations_in", "declare_carried", "finish", "is_carried", "merge",
           "overwrite", "part", "read_attribute", "reduce_microbatches", "reduce_shards", "split", "start", "with_part"]
