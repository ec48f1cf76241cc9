"""Gradient functions: what a train step differentiates, and how a batch splits into microbatches.

A gradient function is a :class:`GradFn`: ``grad_fn(params, batch, rng, scale, ctx) -> (loss, aux, grads)``,
traced inside the train step, plus ``grad_fn.check(params, batch, ctx)``, run on the host before tracing.
``grads`` is the gradient of ``scale * loss`` (``scale``: the float32 loss scale of mixed-precision training,
1 without one) in the params' dtypes; ``loss`` is unscaled float32 and ``aux`` a dict of scalars. For a state
with a model state (Linen ``batch_stats``, NNX non-param variables; ``ctx.stateful``) a gradient function with
``carries_model_state`` returns ``(loss, aux, grads, new_model_state)``; :func:`call_loss` calls a user's loss
in the form the state asks for.

* :func:`value_and_grad` turns a ``loss_fn(params, batch, rng) -> (loss, aux)`` into one;
* :func:`accumulate` averages one over strided microbatches (gradient accumulation);
* ``jp.pipeline.Pipeline`` is one that runs a model's stages as a pipeline over the ``pipe`` mesh axis.

``jp.train.make_train_step`` takes a ``GradFn`` or a plain ``loss_fn`` (wrapped by :func:`value_and_grad`).

Microbatches are strided: microbatch ``j`` of ``m`` holds rows ``j, j+m, j+2m, ...`` of the batch, so each
stays spread over the batch mesh axes. :func:`split_microbatches`, :func:`microbatch` and
:func:`merge_microbatches` are the one implementation (accumulation and the pipeline share them), and
:func:`check_batch_size` the one divisibility check.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar._tree import key_path
from jaxpar import _compat
from jaxpar.sharding import rules as shd
from jaxpar.sharding.names import FSDP, entry_axes, spec_without
from jaxpar._validate import positive_int
from jaxpar.train import carried as carry
from jaxpar.train import nnx_bridge
from jaxpar import protocol
from jaxpar.precision.policy import Policy

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
RESERVED_METRICS = ("loss", "grad_norm", "loss_scale", "skipped")


class Context(NamedTuple):
    """Where a gradient function runs: the step's mesh, logical axis rules and precision policy, and the
    state's ``layout`` (``TrainState.layout``: None for params in model order, else the
    ``jaxpar.train.state_layout.StateLayout`` a pipelined gradient function reads; the step refuses a staged state
    for a gradient function without ``uses_pipe``), and ``param_specs``: the state's params' ``PartitionSpec``\\ s
    (a tree of the params' structure, None where a leaf has no named sharding; None when unknown), from which a
    pipeline reads which dim of a stage leaf is sharded over ``fsdp``; ``model_state`` and ``graphdef``: the
    state's (``TrainState.model_state``, ``TrainState.graphdef``), None without; ``gather_specs``: the
    ``PartitionSpec`` each param is gathered to where the loss starts (a tree of the params' structure, None
    where a leaf stays as placed; None for no gather), set by the steps (:func:`with_weight_gather`) and applied
    by :func:`gather_weights`."""
    mesh: Mesh
    rules: shd.Rules = shd.DEFAULT_RULES
    policy: Policy | None = None
    layout: Any = None
    param_specs: Any = None
    model_state: Any = None
    graphdef: Any = None
    gather_specs: Any = None

    @property
    def stateful(self) -> bool:
        """Whether the state has a model state or an NNX graph definition: the gradient function then returns
        ``(loss, aux, grads, new_model_state)``."""
        return self.model_state is not None or self.graphdef is not None

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch dimension is split over (``data``, ``fsdp`` by default)."""
        return shd.batch_axes(self.rules, self.mesh)


# ------------------------------------------------------------------------------------------ microbatches

def split_microbatches(x: jax.Array, m: int, batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """``[B, ...] -> [B/m, m, ...]`` (a reshape, no copy): microbatch ``j`` is ``[:, j]``, rows ``j, j+m, ...``,
    each spread over ``batch_axes``. Traced; under the step's mesh."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:])
    return shd.constrain_spec(x, P(batch_axes or None))


def microbatch(x_micro: jax.Array, j: jax.Array | int) -> jax.Array:
    """Microbatch ``j`` (a traced or static index) of a ``[B/m, m, ...]`` array: ``[B/m, ...]``."""
    return jax.lax.dynamic_index_in_dim(x_micro, j, 1, keepdims=False)


def merge_microbatches(x_micro: jax.Array, batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """Inverse of :func:`split_microbatches`: ``[B/m, m, ...] -> [B, ...]``."""
    x = x_micro.reshape(x_micro.shape[0] * x_micro.shape[1], *x_micro.shape[2:])
    return shd.constrain_spec(x, P(batch_axes or None))


def weighted_mean(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total / weight`` in float32, and 0 (not NaN) where ``weight`` is 0: the weighted mean of values
    whose weighted sum is ``total`` (an empty batch contributes nothing)."""
    return jnp.where(weight > 0, total.astype(jnp.float32) / jnp.where(weight > 0, weight, 1.0), 0.0)


def reduce_aux(aux_m: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-microbatch aux ``[m]`` -> scalars: ``weight`` summed, every other entry weight-averaged (the plain
    mean without a weight)."""
    leaves = list(aux_m.values())
    if not leaves:
        return {}
    w = aux_m.get("weight", jnp.ones(leaves[0].shape[:1], jnp.float32)).astype(jnp.float32)
    return {k: w.sum() if k == "weight" else weighted_mean((v.astype(jnp.float32) * w).sum(), w.sum())
            for k, v in aux_m.items()}


def check_batch_size(batch_size: int, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES,
                     grad_accum_steps: int = 1, microbatches: int = 1) -> None:
    """Raises ValueError unless a global batch of ``batch_size`` rows splits evenly.

    The batch splits into ``grad_accum_steps`` accumulation batches, each into ``microbatches`` pipeline
    microbatches, and each of those over the batch mesh axes (``data*fsdp`` with the default rules).

    Raises:
      ValueError: naming the size that does not divide and the smallest batch multiple that works.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise ValueError(f"batch_size={batch_size!r} must be an int")
    grad_accum_steps, microbatches = positive_int("grad_accum_steps", grad_accum_steps), positive_int(
        "microbatches", microbatches)
    axes = shd.batch_axes(rules, mesh)
    n, k, m = math.prod(mesh.shape[a] for a in axes), grad_accum_steps, microbatches
    names = "*".join(axes) or "1"
    if batch_size < 1:
        raise ValueError(f"batch {batch_size} is empty; pass at least {n * k * m} rows")
    if batch_size % k:
        raise ValueError(f"batch {batch_size} is not divisible by grad_accum_steps = {k}; use a batch that is a "
                         f"multiple of {k * m * n}")
    acc = batch_size // k
    step = "" if k == 1 else f" (the batch of one of the grad_accum_steps = {k} accumulation steps)"
    if acc % m:
        raise ValueError(f"batch {acc} is not divisible by num_microbatches = {m}{step}; use a batch that is a "
                         f"multiple of {k * m * n}, or another number of microbatches")
    if (acc // m) % n:
        if m > 1:
            what = f"microbatch {acc // m} (batch {acc} / {m} microbatches){step}"
        elif k > 1:
            what = f"microbatch {acc} (batch {batch_size} / grad_accum_steps {k})"
        else:
            what = f"batch {batch_size}"
        raise ValueError(f"{what} is not divisible by {names} = {n}; use a batch that is a multiple of {k * m * n}")


# ------------------------------------------------------------------------------------ gradient functions

class GradFn(abc.ABC):
    """A gradient function: ``grad_fn(params, batch, rng, scale, ctx) -> (loss, aux, grads)``.

    Attributes: ``grad_accum_steps`` accumulation batches per step and ``microbatches`` pipeline
    microbatches per accumulation batch (for the batch-size check; 1 and 1 unless a subclass splits);
    ``uses_pipe``: whether it runs over the mesh's ``pipe`` axis (a step on a mesh with ``pipe > 1`` needs one
    that does); ``carries_model_state``: whether, for a state with a model state or an NNX graph definition
    (``ctx.stateful``), it returns the new model state as a fourth output (else the step keeps it unchanged);
    ``shards_activations``: whether the model it differentiates declares activation constraints (the model
    protocol's attribute), so the step gathers no weights for it (:func:`with_weight_gather`). A gradient
    function of your own gathers by calling :func:`gather_weights` on the params inside what it differentiates.
    """
    grad_accum_steps: int = 1
    microbatches: int = 1
    uses_pipe: bool = False
    carries_model_state: bool = False
    shards_activations: bool = False

    def check_mesh(self, mesh: Mesh) -> None:
        """Raises TypeError/ValueError for a mesh this function cannot run on (when the step is built)."""

    @abc.abstractmethod
    def __call__(self, params: Any, batch: Any, rng: jax.Array, scale: jax.Array,
                 ctx: Context) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """Traced inside the step under ``ctx.mesh``: ``(loss, aux, grads)``; ``grads`` of ``scale * loss``."""

    def model_check_batch(self) -> Callable[[Any], None] | None:
        """The host batch check of the model this function was built from (a protocol model's
        ``check_batch``), or None: what the step builders run by default (``check_batch="auto"``)."""
        return None

    def check(self, params: Any, batch: Any, ctx: Context) -> None:
        """Raises ValueError (on the host, before tracing) for params or a batch this function cannot run.

        ``params`` and ``batch`` hold arrays or ``jax.ShapeDtypeStruct``\\ s (only shapes and dtypes are read);
        ``batch`` is the global batch, with the policy's dtypes. The batch size has already been checked.
        """

    def check_step(self, state: Any, grad_fn: "GradFn | None", mesh: Mesh) -> None:
        """Raises (on the host, before tracing) for a training state this function cannot step: the step calls
        the ``check_step`` of each of its parts that defines one (:func:`check_parts`).
        ``grad_fn`` is the step's gradient function (this one, or what wraps it)."""


def check_parts(state: Any, grad_fn: GradFn | None, mesh: Mesh) -> None:
    """Calls ``check_step(state, grad_fn, mesh)`` of every part of a step that defines one: the gradient function,
    then the static parts of the ``jp.train.TrainState`` (its policy, stage layout, graph definition), in order.

    Each feature keeps its compatibility rules where it is defined (a pipeline refuses state it cannot carry
    between stages, a stage layout a gradient function that would read it as model order), so the step checks
    any combination of features without naming one. Runs on the host, before tracing.

    Raises:
      whatever a part's ``check_step`` raises (ValueError naming the conflict and the fix).
    """
    statics = [getattr(state, f.name) for f in dataclasses.fields(state) if not f.metadata.get("pytree_node", True)]
    for part in (grad_fn, *statics):
        check = getattr(part, "check_step", None)
        if callable(check):
            check(state, grad_fn, mesh)


def check_loss_output(out: Any, what: str = "loss_fn") -> tuple[jax.Array, dict[str, jax.Array]]:
    """Validates ``loss_fn``'s return value (at trace time): ``(scalar float loss, dict of scalars or None)``.

    Returns ``(loss, aux)`` with ``aux`` a dict (``{}`` for None) of scalars, non-float ones as float32.
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        got = "a bare array" if hasattr(out, "shape") else type(out).__name__
        raise ValueError(f"{what} must return (loss, aux) with aux a dict (or None), e.g. return loss, {{}}; "
                         f"got {got}")
    loss, aux = out
    if not hasattr(loss, "shape") or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"{what}'s loss must be a floating scalar array (a mean over the batch), got "
                         f"{getattr(loss, 'shape', type(loss).__name__)} {getattr(loss, 'dtype', '')}")
    aux = {} if aux is None else aux
    if not isinstance(aux, dict):
        raise ValueError(f"{what}'s aux must be a dict of scalars (or None), got {type(aux).__name__}")
    out_aux = {}
    for k, v in aux.items():
        if not isinstance(k, str) or k in RESERVED_METRICS:
            raise ValueError(f"aux key {k!r} is not allowed: keys are strings other than {RESERVED_METRICS}")
        if not hasattr(v, "dtype") and not isinstance(v, (int, float)):
            raise ValueError(f"aux[{k!r}] is a {type(v).__name__}; aux values must be numeric scalars")
        v = jnp.asarray(v)
        if v.shape != ():
            raise ValueError(f"aux[{k!r}] has shape {v.shape}; aux values must be scalars (reduce them first)")
        out_aux[k] = v.astype(jnp.float32) if not jnp.issubdtype(v.dtype, jnp.floating) else v
    return loss, out_aux


def check_stateful_output(out: Any, what: str = "loss_fn") -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """``loss_fn(params, batch, rng, model_state)``'s ``(loss, aux, new_model_state)``, validated (trace time)."""
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"with a model state, {what}(params, batch, rng, model_state) must return (loss, aux, "
                         f"new_model_state), e.g. (out, updates) = model.apply(variables, x, mutable=['batch_stats']);"
                         f" return loss, {{}}, updates; got {type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}")
    return (*check_loss_output(out[:2], what), out[2])


def call_loss(loss_fn: Callable, params: Any, batch: Any, rng: jax.Array, ctx: Context,
              train: bool = True) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """``(loss, aux, new_model_state)`` of a user's loss in the form the state asks for (trace time):
    ``loss_fn(params, batch, rng)``; with a model state ``loss_fn(params, batch, rng, model_state) -> (loss, aux,
    new_model_state)``; with an NNX ``graphdef`` ``loss_fn(model, batch, rng) -> (loss, aux)`` on the merged
    model (``model.eval()`` first when not ``train``), whose non-``Param`` variables come back as the new model
    state. ``new_model_state`` is None without a model state."""
    if ctx.graphdef is not None:
        model = nnx_bridge.merge(ctx.graphdef, params, ctx.model_state)
        if not train:
            model.eval()
        loss, aux = check_loss_output(loss_fn(model, batch, rng), "the NNX loss_fn(model, batch, rng)")
        return loss, aux, check_model_state(nnx_bridge.model_state(model), ctx.model_state,
                                            "the NNX model's variables after loss_fn")
    if ctx.model_state is not None:
        out = loss_fn(params, batch, rng, ctx.model_state)
        if not train and isinstance(out, tuple) and len(out) == 2:
            return (*check_loss_output(out), ctx.model_state)
        loss, aux, new = check_stateful_output(out)
        return loss, aux, check_model_state(new, ctx.model_state, "loss_fn's new_model_state")
    return (*check_loss_output(loss_fn(params, batch, rng)), None)


def check_model_state(new: Any, old: Any, what: str) -> Any:
    """``new`` when it has the structure, shapes and dtypes of the state's model state ``old`` (trace time).

    Raises:
      ValueError: naming the first difference (a new or missing variable, a changed shape or dtype).
    """
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError(f"{what} must have the structure of the state's model state (the same collections and "
                         f"variables: Linen's updates from model.apply(..., mutable=[...]) as returned; in NNX no new "
                         f"non-param variables). Got {jax.tree.structure(new)}, expected {jax.tree.structure(old)}")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(old)):
        if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(f"{what}: {key_path(path, indexing=True)} is {jnp.result_type(a)}{list(np.shape(a))}, "
                             f"the state holds {jnp.result_type(b)}{list(np.shape(b))}: keep each variable's shape "
                             "and dtype")
    return new


def check_loss_arity(loss_fn: Callable, ctx: Context) -> None:
    """Raises TypeError (before tracing) when ``loss_fn`` cannot take the arguments the state's form passes."""
    n, form = (4, "loss_fn(params, batch, rng, model_state) -> (loss, aux, new_model_state)") \
        if ctx.model_state is not None and ctx.graphdef is None else (3, None)
    try:
        inspect.signature(loss_fn).bind(*([None] * n))
    except TypeError:
        form = form or ("loss_fn(model, batch, rng) -> (loss, aux), model the NNX module" if ctx.graphdef is not None
                        else "loss_fn(params, batch, rng) -> (loss, aux)")
        raise TypeError(f"the state's model {'has a model state' if n == 4 else 'takes'} {form}; {loss_fn!r} cannot "
                        f"be called with {n} arguments") from None
    except ValueError:      # no signature (a builtin): let the call decide
        pass


@dataclasses.dataclass(frozen=True)
class _ValueAndGrad(GradFn):
    loss_fn: LossFn
    carries_model_state = True

    def model_check_batch(self):
        return protocol.batch_checker(self.loss_fn)

    @property
    def shards_activations(self) -> bool:
        return protocol.shards_activations(self.loss_fn)

    def check(self, params, batch, ctx):
        check_loss_arity(self.loss_fn, ctx)

    def __call__(self, params, batch, rng, scale, ctx):
        policy = ctx.policy

        def f(p):
            if policy is not None:   # cast inside the differentiated function: grads come back in param dtype
                p = policy.cast_to_compute(p)
            p = gather_weights(p, ctx)   # after the cast: the gather moves compute-dtype bytes
            loss, aux, new_state = call_loss(self.loss_fn, p, batch, rng, ctx)
            loss = loss.astype(jnp.float32)
            return loss * scale, (loss, aux, new_state)
        (_, (loss, aux, new_state)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return (loss, aux, grads, new_state) if ctx.stateful else (loss, aux, grads)


def value_and_grad(loss_fn: LossFn) -> GradFn:
    """The gradient function of ``loss_fn(params, batch, rng) -> (loss, aux)``.

    ``loss`` is a floating scalar (a mean over the batch), ``aux`` a dict of scalars or None (keys other than
    ``loss``, ``grad_norm``, ``loss_scale``, ``skipped``). Under the context's policy, params are cast to its
    compute dtype inside the differentiated function, so gradients come back in the param dtype; the loss
    is taken in float32. Then, when the step asks (``ctx.gather_specs``), each FSDP-sharded param is gathered
    over ``fsdp`` (:func:`gather_weights`).

    Raises:
      TypeError: ``loss_fn`` is not callable (at once). ValueError: a bad ``loss_fn`` output (when traced).
    """
    if isinstance(loss_fn, GradFn) or not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(params, batch, rng) -> (loss, aux), got {loss_fn!r}")
    return _ValueAndGrad(loss_fn)


# ------------------------------------------------------------------- FSDP weights gathered where a loss starts

def check_gather_weights(gather_weights: Any, fn: Any) -> bool | None:
    """The steps' ``gather_weights`` option, checked when a step is built: None (automatic) or a bool; False
    for a pipelined gradient function (``uses_pipe``), which places its stages' weights itself.

    Raises:
      TypeError: not None or a bool. ValueError: True for a pipelined gradient function.
    """
    if gather_weights is not None and not isinstance(gather_weights, bool):
        raise TypeError(f"gather_weights must be None (gather FSDP weights unless the model declares "
                        f"shards_activations), True or False; got {gather_weights!r}")
    if getattr(fn, "uses_pipe", False):
        if gather_weights:
            raise ValueError("gather_weights=True applies to the GSPMD step (a loss_fn or jp.grads.value_and_grad), "
                             "not to a jp.pipeline.Pipeline, which places its stages' weights itself: leave it None")
        return False
    return gather_weights


def with_weight_gather(ctx: Context, gather_weights: bool | None, *declarers: Any) -> Context:
    """``ctx`` with ``gather_specs`` when the step gathers FSDP weights: on a mesh with ``fsdp > 1`` whose
    params' specs are known (``ctx.param_specs``), if ``gather_weights`` is True, or None and none of
    ``declarers`` (the step's loss or gradient function) nor the NNX module class of ``ctx.graphdef`` declares
    ``shards_activations`` (:func:`jaxpar.protocol.shards_activations`). Each leaf whose spec uses
    ``fsdp`` gets that spec without it (:func:`jaxpar._compat.gathers_fsdp_weights`: why); ``ctx`` unchanged
    otherwise."""
    if gather_weights is None:
        gather_weights = _compat.gathers_fsdp_weights() and not protocol.shards_activations(
            *declarers, nnx_bridge.module_class(ctx.graphdef))
    if not gather_weights or ctx.mesh.shape.get(FSDP, 1) == 1 or ctx.param_specs is None:
        return ctx
    return ctx._replace(gather_specs=jax.tree.map(_gather_spec, ctx.param_specs,
                                                  is_leaf=lambda x: x is None or isinstance(x, P)))


def _gather_spec(spec: P | None) -> P | None:
    """The spec a param of mesh spec ``spec`` is gathered to: ``spec`` without ``fsdp``; None when ``spec`` (None
    for no named sharding) does not use ``fsdp``."""
    if spec is None or not any(FSDP in entry_axes(e) for e in spec if isinstance(e, (str, tuple))):
        return None
    return spec_without(spec, (FSDP,))


def gather_weights(params: Any, ctx: Context) -> Any:
    """``params`` with each leaf that ``ctx.gather_specs`` names constrained to its spec (FSDP's weight
    all-gather; in the backward its transpose reduce-scatters the gradient). Traced, under the step's mesh.

    The gathered weights stay live for the whole step (forward and backward), in the dtype they have here: a
    ZeRO-2-like param memory (params whole over ``fsdp`` during the step, gradients and optimizer state still
    sharded) for models that do not constrain their activations."""
    if ctx.gather_specs is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    specs = treedef.flatten_up_to(ctx.gather_specs)
    return treedef.unflatten([x if s is None else shd.constrain_spec(x, s) for x, s in zip(leaves, specs)])


@dataclasses.dataclass(frozen=True)
class _Accumulate(GradFn):
    inner: GradFn
    steps: int

    def __post_init__(self):   # the batch splits into steps x the inner function's splits
        for name, value in (("grad_accum_steps", self.steps * self.inner.grad_accum_steps),
                            ("microbatches", self.inner.microbatches), ("uses_pipe", self.inner.uses_pipe),
                            ("carries_model_state", self.inner.carries_model_state),
                            ("shards_activations", self.inner.shards_activations)):
            object.__setattr__(self, name, value)

    def check_mesh(self, mesh):
        self.inner.check_mesh(mesh)

    def model_check_batch(self):
        return self.inner.model_check_batch()

    def check_step(self, state, grad_fn, mesh):
        self.inner.check_step(state, grad_fn, mesh)

    def check(self, params, batch, ctx):
        struct = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // self.steps, *np.shape(a)[1:]),
                                                jnp.result_type(a))
        self.inner.check(params, jax.tree.map(struct, batch), ctx)

    def __call__(self, params, batch, rng, scale, ctx):
        micro = jax.tree.map(lambda x: split_microbatches(x, self.steps, ctx.batch_axes), batch)
        take = lambda j: jax.tree.map(lambda x: microbatch(x, j), micro)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)

        threads = ctx.stateful and self.carries_model_state
        plain, held = carry.split(params)   # carried state: new values combine as declared, not by a mean

        def body(acc, j):     # the model state (batch statistics) passes from microbatch to microbatch
            (grad_sum, new), model_state = acc
            out = self.inner(params, take(j), jax.random.fold_in(rng, j), scale, ctx._replace(model_state=model_state))
            loss, aux, grads = out[:3]
            grads, new_j = carry.split(grads)
            w = aux.get("weight", jnp.ones((), jnp.float32)).astype(jnp.float32)
            # w * x, but 0 (not NaN) for an empty microbatch (weight 0, whose mean loss is 0/0).
            wx = lambda x: jnp.where(w > 0, w * x.astype(jnp.float32), 0.0)
            grad_sum = jax.tree.map(lambda a, g: a + wx(g), grad_sum, grads)
            new = None if new is None else carry.add(new, new_j)
            return ((grad_sum, new), out[3] if threads else model_state), (
                wx(loss), {k: v if k == "weight" else wx(v) for k, v in aux.items()}, w)

        with jax.named_scope("accumulation"):
            ((grad_sum, new), model_state), (loss_m, aux_m, w_m) = jax.lax.scan(
                body, ((zeros(plain), None if held is None else carry.start(held)), ctx.model_state),
                jnp.arange(self.steps))
        w_sum = w_m.sum()
        aux = {k: v.sum() if k == "weight" else weighted_mean(v.sum(), w_sum) for k, v in aux_m.items()}
        new = None if new is None else carry.finish(new, self.steps)
        grads = carry.merge(jax.tree.map(lambda g, p: weighted_mean(g, w_sum).astype(p.dtype), grad_sum, plain), new)
        out = weighted_mean(loss_m.sum(), w_sum), aux, grads
        return (*out, model_state) if threads else out


def accumulate(grad_fn: GradFn, steps: int) -> GradFn:
    """Gradient accumulation: the weighted mean of ``grad_fn`` over ``steps`` strided microbatches.

    Microbatch ``j`` holds rows ``j, j+steps, ...`` and the key ``fold_in(rng, j)``; it is run in a
    ``lax.scan``, so memory stays that of one microbatch, and gradients are summed in float32. A microbatch's
    weight is ``aux["weight"]`` when present (e.g. its token count), else 1, so the result is the whole
    batch's mean; ``aux["weight"]`` is summed, other aux entries weight-averaged. Carried state in the params
    (:mod:`jaxpar.train.carried`) is not averaged: every microbatch reads its old value and their new values
    combine as its collection declares; a model state passes from microbatch to microbatch in order. An
    all-empty batch (total weight 0) gives zero loss and gradients, not NaN.

    Raises:
      TypeError: ``grad_fn`` is not a GradFn. ValueError: ``steps`` is not a positive int.
    """
    if not isinstance(grad_fn, GradFn):
        raise TypeError(f"accumulate needs a jp.grads.GradFn (e.g. jp.grads.value_and_grad(loss_fn)), got {grad_fn!r}")
    steps = positive_int("grad_accum_steps", steps)
    return grad_fn if steps == 1 else _Accumulate(grad_fn, steps)


__all__ = ["Context", "GradFn", "LossFn", "RESERVED_METRICS", "accumulate", "call_loss", "check_batch_size",
           "check_loss_output", "gather_weights",
           "value_and_grad"]
