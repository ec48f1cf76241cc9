"""What jaxpar needs from a model: the contract every model (ours or a user's) provides, written once.

A model is an object with pure functions over one params pytree. jaxpar's features read only these methods,
never the model's class, so a model defined anywhere (a test file, a research script) gets each feature whose
part it provides, and a clear error naming the part it lacks (:func:`require`).

Core (every training step):
  ``init(rng) -> params``: the params tree; leaves may be Flax-boxed (``nn.LogicallyPartitioned``, as
  ``nn.with_logical_partitioning`` makes) to carry logical axis names, which shard them
  (``jp.train.init_state`` unboxes).
  ``apply(params, inputs) -> outputs``: the forward pass (e.g. ``tokens_BL (int32) -> logits_BLV``).
  ``loss(params, batch, rng) -> (loss, aux)``: a float scalar mean over the batch and a dict of scalars
  (``aux["weight"]``, e.g. a token count, weights accumulation); the train step's ``loss_fn``.
  ``check_batch(batch) -> None`` (optional): raises ValueError for a host batch ``loss`` cannot take
  (out-of-range token ids, wrong keys or shapes). ``jp.train.make_train_step(model.loss, ...)`` runs it on
  every host batch unless told ``check_batch=None``; device (``jax.Array``) leaves are not pulled back.
  ``shards_activations`` (attribute, optional, default False): True declares that the model's activations carry
  logical sharding constraints (``jp.sharding.constrain(x, "batch", ...)`` at least on the batch dimension of
  each layer's output), so GSPMD places the weight gathers per layer. Without it, on a mesh with ``fsdp > 1`` the
  train and eval steps gather each FSDP-sharded param whole over ``fsdp`` where the loss starts
  (``jp.train.make_train_step(..., gather_weights=)``): XLA's partitioner can give wrong gradients for a model
  with none (:func:`jaxpar._compat.gathers_fsdp_weights`). Read from the loss function itself or the object
  whose bound method it is (``model.loss``); an NNX module class declares it for ``loss_fn(model, ...)``.

Pipeline (``jp.pipeline.Pipeline.from_model``):
  ``stage_key`` (attribute, default ``"blocks"``): the params entry holding the stacked ``[layers, ...]`` leaves.
  ``embed(params, inputs) -> x``, ``stage(stage_params, x) -> x`` over any ``[layers', ...]`` slice of
  ``params[stage_key]`` (same shape and dtype out), ``head_loss(params, x, targets) -> (loss, aux)``.
  ``loss`` must equal ``head_loss(params, stage(params[stage_key], embed(params, inputs)), targets)``.

Structured pruning and compaction (``jp.pruning.compact`` / ``compact_state``):
  ``prune_groups() -> {axis: [(module, next_module, ...), ...]} | None``: the chains coupling a hidden unit
  across modules (``jp.pruning.structured_pruning(..., groups=)``), or None when the groups follow from the
  logical names alone (one module holds each ``mlp`` / ``heads`` axis, e.g. the GPT's ``blocks``).
  ``replace(sizes) -> config``: the smaller model's config after compaction; ``sizes`` maps each compacted
  group (its key path, e.g. ``("blocks", "heads")`` or ``("dense_0", "mlp")``) to its kept count. It returns
  the smaller model's config: anything :func:`as_model` turns into the smaller model (the GPT returns a
  ``GPTConfig``, ``MLPModel`` an ``MLP``); compaction checks that it builds params of the compacted shapes.
  (A flax.struct or chex dataclass model inherits a ``replace(**fields)``: give it ``as_model()`` instead.)
  A config object that is not itself a model (the GPT's ``GPTConfig``; the MLP's Linen module, whose ``init``
  needs an input) provides ``as_model(params=None) -> model``; :func:`as_model` resolves either.

Generation (:func:`jaxpar.models.generate`):
  ``init_cache(params, batch_size, max_len) -> cache``: a pytree of arrays holding what a one-token step reads
  of the past (the GPT: keys and values ``[layers, B, max_len, heads, head_dim]``), zero-filled.
  ``decode_step(params, tokens_B, cache, pos) -> (logits_BV, cache)``: the next-token logits (float32) after
  the token ``tokens_B`` (int32) at position ``pos`` (an int32 scalar, the same for every row), writing that
  position into the cache. It must equal ``apply(params, tokens)[:, pos]`` for the tokens written so far.
  ``max_seq_len`` (attribute or ``cfg.max_seq_len``): the longest context the cache holds.

Carried state (:func:`declare_carried`): state the train step carries that the optimizer does not update (fp8
  scales and amax histories, batch statistics, a token counter, an EMA of the weights) is a collection under a
  declared key, with a declared way its new values combine over microbatches and batch shards. The training
  core, the pipeline and checkpoints apply the declaration (:mod:`jaxpar.train.carried`) and never name the
  feature.

Shape-suffix names (:data:`SHAPE_LEGEND`) are shared by every model in ``jaxpar/models/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax

from jaxpar import _compat

SHAPE_LEGEND: dict[str, tuple[str, str | None]] = {
    "B": ("batch (rows of a batch)", "batch"),
    "L": ("sequence positions", "seq"),
    "T": ("tokens: batch and sequence flattened, B * L rows", "batch"),
    "Q": ("query positions of one attention block (a slice of L)", "seq"),
    "S": ("key / value positions attended to (a prefix of L, or the cache length)", None),
    "D": ("model width d_model", "embed"),
    "H": ("attention heads", "heads"),
    "G": ("key / value heads of grouped-query attention (each serves H // G query heads)", "kv_heads"),
    "K": ("head dimension", "kv"),
    "F": ("MLP hidden width", "mlp"),
    "V": ("vocabulary (padded)", "vocab"),
    "N": ("stacked layers", "layers"),
    "I": ("input features of a classifier", "embed"),
    "C": ("classes of a classifier", None),
}
"""Suffix letter of an array name (``x_BLD``, ``logits_BLV``) -> (what the axis is, its logical axis name or None
when it is never sharded by name). One legend for every model (nanodo's ``model.py`` convention)."""

PARTS = {
    "init": "init(rng) -> params",
    "apply": "apply(params, inputs) -> outputs",
    "loss": "loss(params, batch, rng) -> (loss, aux)",
    "check_batch": "check_batch(batch) -> None (raises ValueError on a bad host batch)",
    "embed": "embed(params, inputs) -> x",
    "stage": "stage(stage_params, x) -> x over a [layers, ...] slice of params[stage_key]",
    "head_loss": "head_loss(params, x, targets) -> (loss, aux)",
    "prune_groups": "prune_groups() -> {axis: [(module, next_module), ...]} or None",
    "replace": "replace(sizes) -> the smaller model's config",
    "init_cache": "init_cache(params, batch_size, max_len) -> cache",
    "decode_step": "decode_step(params, tokens_B, cache, pos) -> (logits_BV, cache)",
}
"""Every part of the protocol and its call form (used in error messages)."""


@runtime_checkable
class Model(Protocol):
    """The core of the protocol (see the module docstring for every part): ``init``, ``apply``, ``loss``."""

    def init(self, rng: jax.Array) -> Any: ...

    def apply(self, params: Any, inputs: Any) -> Any: ...

    def loss(self, params: Any, batch: Any, rng: jax.Array | None = None) -> tuple[jax.Array, dict]: ...


def as_model(config: Any, params: Any = None) -> Any:
    """The model a config stands for: ``config.as_model(params)`` when the config provides it (``GPTConfig``,
    the ``MLP`` module), else ``config`` itself (a model)."""
    resolve = getattr(config, "as_model", None)
    return resolve(params) if callable(resolve) else config


def require(model: Any, parts: tuple[str, ...] | str, feature: str, hint: str = "") -> Any:
    """``model`` when it provides every one of ``parts`` (callable methods); TypeError otherwise.

    Raises:
      TypeError: naming the first missing part, its call form (:data:`PARTS`), the model and the feature
        (e.g. "compaction") that needs it.
    """
    for part in (parts,) if isinstance(parts, str) else parts:
        if not callable(getattr(model, part, None)):
            raise TypeError(f"{feature} needs the model's {part!r} part, {PARTS.get(part, part)}; "
                            f"{type(model).__name__} has none: add the method (the model protocol: "
                            f"jaxpar.protocol){hint}")
    return model


def stage_key(model: Any) -> str:
    """The params entry holding the model's stacked layers (``model.stage_key``, default ``"blocks"``)."""
    key = getattr(model, "stage_key", "blocks")
    if not isinstance(key, str):
        raise TypeError(f"{type(model).__name__}.stage_key={key!r} must be a str: the params entry holding the "
                        "stacked [layers, ...] leaves")
    return key


def size(model: Any, name: str, feature: str, why: str) -> int:
    """A positive int the model declares, ``model.<name>`` or ``model.cfg.<name>`` (e.g. ``max_seq_len``: the
    longest context its cache holds; ``vocab_size``).

    Raises:
      TypeError: neither is a positive int (naming the attribute, the feature and why it needs it).
    """
    value = getattr(model, name, getattr(getattr(model, "cfg", None), name, None))
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TypeError(f"{feature} needs the model's {name} (an attribute, or cfg.{name}: {why}); "
                        f"{type(model).__name__} gives {value!r}")
    return value


def shards_activations(*declarers: Any) -> bool:
    """Whether one of ``declarers`` (a loss function, a gradient function, an NNX module class) declares
    ``shards_activations = True``, on itself or on the object whose bound method it is (``model.loss``).

    Raises:
      TypeError: a declaration that is not a bool (naming its owner).
    """
    for declarer in declarers:
        for owner in (declarer, getattr(declarer, "__self__", None)):
            value = getattr(owner, "shards_activations", None)
            if value is not None and not isinstance(value, bool):
                name = owner.__name__ if isinstance(owner, type) else type(owner).__name__
                raise TypeError(f"{name}.shards_activations={value!r} must be True (its activations "
                                "carry logical sharding constraints) or False")
            if value:
                return True
    return False


def batch_checker(loss_fn: Any) -> Any:
    """The ``check_batch`` of the model whose bound method ``loss_fn`` is (``model.loss``, ``model.embed``), or
    None: what the step builders run on host batches by default."""
    owner = getattr(loss_fn, "__self__", None)
    check = getattr(owner, "check_batch", None)
    return check if callable(check) else None


# ------------------------------------------------------------------------------------------- carried state

COMBINES = ("mean", "max", "sum", "last")
"""How the new values of a carried collection combine over accumulation microbatches, pipeline microbatches
and the batch shards of a manual region: the mean, the elementwise maximum, the old value plus the sum of the
increments the microbatches give, the last microbatch's (batch shards: their mean)."""
THROUGH = ("gradient", "loss")
"""How a carried collection's new value reaches the step: as the cotangent of its leaves (``"gradient"``: the
collection sits in the params tree, under its key at any depth, as fp8's overwrite-with-gradient state), or
returned by the loss (``"loss"``: a Linen collection beside ``params`` or NNX variables, the state's
``model_state``; microbatches read it in order, so it combines as ``"last"``)."""


@dataclasses.dataclass(frozen=True)
class Carried:
    """A declared collection of carried state (:func:`declare_carried`).

    Attributes:
      key: the dict key that marks it: in a params tree at any depth (``through="gradient"``), or the Linen
        collection name (``through="loss"``).
      combine: one of :data:`COMBINES`.
      what: what it holds, in words (error messages: "fp8 meta state (scales, amax histories)").
      through: one of :data:`THROUGH`.
      attribute: the ``TrainState`` attribute that reads this collection's part of the carried state (e.g.
        ``"fp8"``), or None.
      fix: how to build a state that holds it (said when a checkpoint and its target disagree).
      update: how the step turns the old value and the combined new value into the next value, called once per
        optimizer step as ``update(old_subtree, combined_subtree) -> new_subtree`` on the collection's subtree at
        its key (any leading stacked dims included); None: the combine rule's (``"sum"``: old + combined, else
        the combined value). A module-level function, so declaring the key again finds the same declaration.
      check: ``check(subtree)`` raises ValueError for a value of the collection (host numpy leaves, the subtree at
        its key) the step must not carry; the step runs it on a concrete state's first call, before tracing. A
        module-level function, or None.
    """
    key: str
    combine: str
    what: str
    through: str = "gradient"
    attribute: str | None = None
    fix: str = ""
    update: Callable[[Any, Any], Any] | None = None
    check: Callable[[Any], None] | None = None


_CARRIED: dict[str, Carried] = {}


def declare_carried(key: str, combine: str, *, what: str | None = None, through: str = "gradient",
                    attribute: str | None = None, fix: str = "",
                    update: Callable[[Any, Any], Any] | None = None,
                    check: Callable[[Any], None] | None = None) -> Carried:
    """Declares the collection under ``key`` as carried state (see :class:`Carried` for the arguments).

    A ``"gradient"`` collection's leaves are float arrays in the params tree; ``jp.train.init_state`` takes them
    out into ``TrainState.carried`` (sharded by their logical names, replicated without), the step puts them
    back for the loss, and the gradient function returns, as their cotangent, their new value (``"sum"``: the
    increment; :func:`overwrite` makes such a cotangent). With ``update``, the step's next value is
    ``update(old, combined)`` instead (the router bias's sign step). Declaring a key again with the same
    declaration is a no-op.

    Raises:
      TypeError: ``key`` is not a non-empty str, ``attribute`` neither None nor a Python identifier, or
        ``update`` or ``check`` neither None nor callable.
      ValueError: an unknown ``combine`` or ``through``; ``through="loss"`` with a combine other than ``"last"``
        or with an ``update``;
        ``key`` declared already with another declaration; ``attribute`` declared already by another key.
    """
    if not isinstance(key, str) or not key:
        raise TypeError(f"the key of a carried collection is the non-empty str that marks it in the params, got {key!r}")
    if attribute is not None and not (isinstance(attribute, str) and attribute.isidentifier()):
        raise TypeError(f"attribute={attribute!r} for the carried collection {key!r}; use None or a Python identifier")
    if combine not in COMBINES:
        raise ValueError(f"combine={combine!r} for the carried collection {key!r}; use one of {COMBINES}")
    if through not in THROUGH:
        raise ValueError(f"through={through!r} for the carried collection {key!r}; use one of {THROUGH}")
    if update is not None and not callable(update):
        raise TypeError(f"update={update!r} for the carried collection {key!r}; use None or a function "
                        "update(old_subtree, combined_subtree) -> new_subtree")
    if check is not None and not callable(check):
        raise TypeError(f"check={check!r} for the carried collection {key!r}; use None or a function check(subtree)")
    if through == "loss" and update is not None:
        raise ValueError(f"the carried collection {key!r} comes back from the loss (through='loss'), which returns "
                         "its next value itself: declare it without update")
    if through == "loss" and combine != "last":
        raise ValueError(f"the carried collection {key!r} comes back from the loss (through='loss'), which "
                         f"microbatches read in order: its combine is 'last', not {combine!r}")
    new = Carried(key, combine, what or f"carried state {key!r}", through, attribute, fix, update, check)
    owner = next((d for d in _CARRIED.values() if attribute is not None and d.attribute == attribute), None)
    if owner is not None and owner.key != key:
        raise ValueError(f"attribute={attribute!r} for the carried collection {key!r} reads {owner.key!r} already; "
                         "give each collection its own attribute (or None)")
    old = _CARRIED.setdefault(key, new)
    if old != new:
        raise ValueError(f"the carried collection {key!r} is declared already as {old}; a key has one declaration")
    return new


def carried_declarations(through: str = "gradient") -> tuple[Carried, ...]:
    """The declared carried collections whose new value comes ``through`` the gradient or the loss."""
    return tuple(d for d in _CARRIED.values() if d.through == through)


def carried_of(path: tuple) -> Carried | None:
    """The declaration of the ``"gradient"`` collection a key path (``jax.tree_util``'s) leads into, or None."""
    for k in path:
        d = _CARRIED.get(getattr(k, "key", None))
        if d is not None and d.through == "gradient":
            return d
    return None


def split_carried(tree: Any, keys: tuple[str, ...] | None = None) -> tuple[Any, Any]:
    """``(tree without its carried entries, the carried entries)``: every subtree under one of ``keys`` (default:
    every declared ``"gradient"`` collection) of a nested mapping, in a tree of the same nesting holding only
    those (None when there is none). A mapping that held carried state only is dropped from the first;
    :func:`merge_carried` restores it."""
    keys = tuple(d.key for d in carried_declarations()) if keys is None else keys
    if not isinstance(tree, Mapping):
        return tree, None
    rest, held = {}, {}
    for k, v in tree.items():
        if k in keys:
            held[k] = v
            continue
        rest[k], h = split_carried(v, keys)
        if h is not None:
            held[k] = h
            if not rest[k]:   # a module holding only carried state leaves no empty node
                del rest[k]
    return (rest, held) if held else (tree, None)   # a tree without carried state comes back as it is


def merge_carried(params: Any, held: Any) -> Any:
    """The inverse of :func:`split_carried`: ``held``'s entries put back into ``params`` (``params`` for None)."""
    if held is None:
        return params
    out = dict(params)
    for k, v in held.items():
        out[k] = v if k in _CARRIED else merge_carried(params.get(k, {}), v)
    return out


@jax.custom_vjp
def overwrite(x: Any, old: Any, new: Any) -> Any:
    """``x`` unchanged; under differentiation the cotangent of the carried leaves ``old`` is ``new`` (their new
    value, or a ``"sum"`` collection's increment), the gradient of nothing. ``x`` is any value on the loss's path
    (an activation, the loss itself), so the backward pass runs through here. The cotangent is the new value only
    if nothing else in the loss differentiates ``old``: read the leaves elsewhere through ``jax.lax.stop_gradient``
    (a loss divided by a running mean would add its gradient to the new mean). Here, below every room, so layers
    can return carried state; its public name is :func:`jaxpar.train.carried.overwrite`."""
    return x


def _overwrite_fwd(x, old, new):
    return x, (old, new)


def _overwrite_bwd(res, g):
    old, new = res

    def cast(o, n):   # a cotangent varies over the manual axes its leaf varies over (a constant new value too)
        n = jax.lax.stop_gradient(n).astype(o.dtype)
        missing = tuple(sorted(_compat.varying_axes(o) - _compat.varying_axes(n)))
        return jax.lax.pcast(n, missing, to="varying") if missing else n
    return g, jax.tree.map(cast, old, new), jax.tree.map(jax.numpy.zeros_like, new)


overwrite.defvjp(_overwrite_fwd, _overwrite_bwd)
