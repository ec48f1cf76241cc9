"""Sharded training state and steps: data parallelism, FSDP and tensor parallelism through ``jax.jit``.

The layout comes from the logical axis rules (``jaxpar.sharding``): params and optimizer state are placed by
their logical names, the batch over the mesh axes ``batch`` maps to, and GSPMD inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.train import carried as carry
from jaxpar.train import grads as gr
from jaxpar.train import model_init
from jaxpar.sharding import params as placement
from jaxpar.precision import policy as precision, scaling
from jaxpar.sharding import rules as shd
from jaxpar.sharding.batches import Batches, shard_batch
from jaxpar._validate import nonnegative_int
from jaxpar.train.grads import GradFn, LossFn, check_batch_size
from jaxpar.train._jit import MeshJit
from jaxpar import protocol
from jaxpar.train.state_layout import StateLayout, permute_state, to_layout, to_model_order  # noqa: F401
from jaxpar.precision.policy import Policy
from jaxpar.sharding.names import FSDP, PIPE


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
      step: int32 scalar, the number of updates applied so far.
      params: the parameter tree, unboxed (plain arrays), stored in the policy's ``param_dtype``.
      opt_state: the optax state, sharded like the params it mirrors.
      rng: a typed PRNG key; step ``t`` uses ``jax.random.fold_in(rng, t)``.
      policy: the mixed-precision policy (static: part of the tree structure, not an array), or None for no
        casts. Given once, to :func:`init_state` / :func:`abstract_state`; the steps read it from here.
      layout: None (params and optimizer state in model order), or the
        :class:`~jaxpar.train.state_layout.StateLayout` of a pipeline's schedule (static): ``params[stage_key]``
        and every optimizer-state leaf that follows it are in the schedule's stage layout, so the pipelined
        step moves no weight over ``pipe``. Set by ``init_state(..., pipeline=)`` / ``abstract_state(...,
        pipeline=)``; checkpoints are written in model order (:func:`to_model_order`) and restored into the
        target's layout. Code that reads ``params`` as the model (sampling, export, compaction) takes
        ``to_model_order(state).params``.
      model_state: the model's non-trainable variables, or None: Linen collections other than ``params``
        (``batch_stats``), NNX variables other than ``nnx.Param`` (``BatchStat``, RNG streams). Sharded by their
        names like params, updated by the train step from the loss (``loss_fn(params, batch, rng, model_state)
        -> (loss, aux, new_model_state)``; NNX: read back from the model), never touched by the optimizer,
        checkpointed with the rest, read by the eval step.
      graphdef: a Flax NNX model's ``nnx.GraphDef`` (static), or None: the step merges it with ``params`` and
        ``model_state`` into the model its ``loss_fn(model, batch, rng)`` takes (:mod:`jaxpar.train.nnx_bridge`).
      carried: the carried state the params tree held under declared keys (scaled matmuls' scales and amax
        histories, a user's counter), in the params' nesting, or None: taken out of the params at init,
        replicated, put back by the step for the loss and replaced by the new values their cotangents give,
        combined as each collection declares, never seen by the optimizer (:mod:`jaxpar.train.carried`);
        checkpointed. A collection's part reads as the attribute it declares (``Carried.attribute``;
        ``replace`` takes it too).
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    model_state: Any = None
    carried: Any = None
    policy: Policy | None = flax.struct.field(pytree_node=False, default=None)
    layout: StateLayout | None = flax.struct.field(pytree_node=False, default=None)
    graphdef: Any = flax.struct.field(pytree_node=False, default=None)

    def report(self) -> shd.ShardingReport:
        """Where the params' and optimizer state's bytes live (``jp.sharding.describe_params``): per device
        against global, the fraction sharded, the largest replicated leaves; ``print`` it for the summary."""
        return shd.describe_params(self.params, self.opt_state)

    def __getattr__(self, name: str) -> Any:   # a carried collection's declared attribute
        return carry.read_attribute(self.carried, name, type(self).__name__)


_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainState))   # no carried attribute may shadow these

# ``dataclasses.replace``, where a carried collection's attribute replaces its part of ``carried``
TrainState.replace = lambda self, **updates: dataclasses.replace(self, **carry.attribute_updates(self.carried, updates))


def _as_key(rng: Any) -> jax.Array:
    if isinstance(rng, (int, np.integer)):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    if isinstance(rng, (jax.Array, np.ndarray)) and rng.dtype == np.uint32:
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"rng must be a typed key (jax.random.key(seed)), a raw uint32 key or an int seed; got {rng!r}")


@dataclasses.dataclass(frozen=True)
class _PlacementOptions:
    """How ``init_state`` / ``abstract_state`` place a model: path rules and automatic FSDP (see
    :mod:`jaxpar.sharding.params`)."""
    param_rules: Any = None
    auto_fsdp: bool = True
    auto_fsdp_min_size: int = placement.AUTO_FSDP_MIN_SIZE

    def __post_init__(self):
        if self.param_rules is not None:
            object.__setattr__(self, "param_rules", shd.path_rules(self.param_rules))
        if not isinstance(self.auto_fsdp, bool):
            raise TypeError(f"auto_fsdp must be True (shard params nothing names over fsdp) or False, got "
                            f"{self.auto_fsdp!r}")
        nonnegative_int("auto_fsdp_min_size", self.auto_fsdp_min_size)


def _abstract(init_fn, tx, rng, mesh, rules, policy, pipeline=None, how: _PlacementOptions = _PlacementOptions()):
    """(state shapes, state shardings, model init, placement) without computing anything; shapes and
    shardings carry the pipeline's layout."""
    model = model_init.describe(init_fn, rng, mesh)
    carry.check_state(model.carried_shapes, _FIELDS)
    placed = placement.place(model.param_shapes, model.param_names, mesh, rules, param_rules=how.param_rules,
                             auto_fsdp=how.auto_fsdp, auto_fsdp_min_size=how.auto_fsdp_min_size)
    placement.check_tensor_used(placed, mesh)
    state_shardings = None if model.state_shapes is None else placement.place(
        model.state_shapes, model.state_names, mesh, rules, auto_fsdp=how.auto_fsdp,
        auto_fsdp_min_size=how.auto_fsdp_min_size, what="model state").shardings
    param_shapes = model.param_shapes
    if policy is not None:
        param_shapes = policy.cast_to_param(param_shapes)
    etx = _effective_tx(tx, policy)
    opt_shapes = jax.eval_shape(etx.init, param_shapes)
    layout = None if pipeline is None else pipeline.state_layout(etx, param_shapes, opt_shapes, mesh)
    rep = NamedSharding(mesh, P())
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=param_shapes, opt_state=opt_shapes,
                        rng=jax.eval_shape(lambda k: k, rng), model_state=model.state_shapes, policy=policy,
                        layout=layout, graphdef=model.graphdef, carried=model.carried_shapes)
    # a stage layout permutes whole blocks of the layers axis: shapes, and so shardings, are those of model order
    shardings = TrainState(step=rep, params=placed.shardings, rng=rep, model_state=state_shardings, policy=policy,
                           layout=layout, graphdef=model.graphdef,
                           carried=jax.tree.map(lambda _: rep, model.carried_shapes),
                           opt_state=shd.opt_state_shardings(etx, param_shapes, placed.shardings, mesh))
    return shapes, shardings, model, placed


def _report(shapes: TrainState, shardings: TrainState, placed: placement.Placement, mesh: Mesh,
            report: bool | None, min_size: int) -> None:
    """Prints the placement summary (``report=True``; None: when, on a mesh with ``fsdp > 1``, a param was placed
    by automatic FSDP or one of at least ``min_size`` elements was left replicated) and warns of unknown names and
    unmatched path rules."""
    for note in placed.notes:
        warnings.warn(note, stacklevel=3)
    big = {shd.key_path(p) for p, x in jax.tree_util.tree_flatten_with_path(shapes.params)[0]
           if math.prod(x.shape) >= min_size}
    guessed = mesh.shape.get(FSDP, 1) > 1 and any(
        s.endswith("auto fsdp") or (s == "replicated" and p in big) for p, s in placed.sources.items())
    if report or (report is None and guessed):
        with_sharding = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
        tree = jax.tree.map(with_sharding, (shapes.params, shapes.opt_state), (shardings.params, shardings.opt_state))
        summary = shd.describe_params(*tree, sources=placed.sources)
        if jax.process_index() == 0:
            print(f"jaxpar: the state's layout on mesh {dict(mesh.shape)} (init_state(report=False) to silence)\n"
                  f"{summary}")


def _check_pipeline(pipeline: Any) -> None:
    if pipeline is not None and not callable(getattr(pipeline, "state_layout", None)):
        raise TypeError(f"pipeline must be the jp.pipeline.Pipeline the state will be trained with (its "
                        f"state_layout sets the stage layout), or None for model order; got {pipeline!r}")


def _effective_tx(tx: optax.GradientTransformation, policy: Policy | None) -> optax.GradientTransformation:
    """Keeps optimizer state in float32 when the policy stores params in a 16-bit dtype."""
    if policy is not None and policy.param_dtype.itemsize < 4:
        return precision.f32_optimizer_state(tx)
    return tx


def _check_common(mesh, rules, policy=None):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (from jp.make_mesh), got {type(mesh).__name__}")
    shd.validate_rules(rules, mesh)
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a jp.precision.Policy or None, got {policy!r}")


def abstract_state(init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, *, mesh: Mesh,
                   rules: shd.Rules = shd.DEFAULT_RULES, policy: Policy | None = None, pipeline: Any = None,
                   param_rules: Any = None, auto_fsdp: bool = True,
                   auto_fsdp_min_size: int = placement.AUTO_FSDP_MIN_SIZE) -> TrainState:
    """The ``TrainState`` of ``jax.ShapeDtypeStruct`` leaves, each with its ``NamedSharding``.

    It is what :func:`init_state` would return (with the same arguments: the same ``layout`` and placement),
    without allocating anything: the restore target for checkpoints on the current mesh, whose arrays a
    restore puts in this layout whatever schedule or mesh wrote them.
    """
    _check_common(mesh, rules, policy)
    _check_pipeline(pipeline)
    tx = shd.check_transformation(tx)
    how = _PlacementOptions(param_rules, auto_fsdp, auto_fsdp_min_size)
    with precision.using(policy):
        shapes, shardings, _, _ = _abstract(init_fn, tx, jax.random.key(0), mesh, rules, policy, pipeline, how)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_state(init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, rng: Any, *, mesh: Mesh,
               rules: shd.Rules = shd.DEFAULT_RULES, policy: Policy | None = None, pipeline: Any = None,
               param_rules: Any = None, auto_fsdp: bool = True,
               auto_fsdp_min_size: int = placement.AUTO_FSDP_MIN_SIZE, report: bool | None = None) -> TrainState:
    """Initializes params, model state and optimizer state directly in their sharded layout.

    The state's shapes come from abstract evaluation and it is built by ``jax.jit(..., out_shardings=...)``, so
    the whole unsharded parameter tree never exists on one device.

    Args:
      init_fn: what builds the model (:mod:`jaxpar.train.model_init`): ``init_fn(rng) -> params`` (a Linen
        ``model.init``, boxed with ``nn.with_logical_partitioning`` / ``nn.with_partitioning`` or not, or any
        function returning a pytree of arrays); a Linen variables dict with collections beside ``params``
        (``batch_stats``: they become ``state.model_state``); or a Flax NNX model: ``model_fn(rngs) ->
        nnx.Module`` (first parameter named ``rngs``), an ``nnx.Module`` class (``functools.partial(cls, ...)``
        for its arguments), or a function of a key returning one (``nnx.Param`` -> params, other variables ->
        ``model_state``, the graph definition -> ``state.graphdef``).
      tx: the optax transformation.
      rng: a typed key (``jax.random.key(seed)``) or an int seed. It is split into the init key and the
        state's key.
      mesh: from :func:`jaxpar.make_mesh`.
      rules: logical-to-mesh axis rules.
      policy: a mixed-precision policy; params are stored in its ``param_dtype``.
      pipeline: the ``jp.pipeline.Pipeline`` the state will train with, or None. With a schedule of several
        chunks per stage (interleaved 1F1B, ZB-V) the state is built in its stage layout (``state.layout``):
        the model-order init, then ``params[pipeline.stage_key]`` and every optimizer-state leaf computed
        along its layers (moments, masks; :func:`jaxpar.train.state_layout.state_layout`) permuted, so the
        state equals ``to_layout(model-order state)`` exactly. The identity (``layout=None``) for one chunk.
      param_rules: ``jp.sharding.path_rules([(regex, names | PartitionSpec), ...])`` (or its list): params named
        by key path, over the model's own names.
      auto_fsdp: with ``fsdp > 1``, shard over ``fsdp``, along its largest divisible dimension, each param of at
        least ``auto_fsdp_min_size`` elements that nothing names (source ``auto fsdp``), or whose logical names
        map to other mesh axes only (source ``rules + auto fsdp``: on a dimension named None or by a name no rule
        knows; a dimension a rule maps to None stays whole; mesh-axis names and path rules are kept as written)
        (:mod:`jaxpar.sharding.params`). False: such params stay as their names say (replicated over ``fsdp``).
      report: print the layout summary (``state.report()``, with how each param was placed): True always,
        False never, None (default) when, on a mesh with ``fsdp > 1``, automatic FSDP placed a param (alone or
        beside its names) or one of at least ``auto_fsdp_min_size`` elements was left replicated. Logical names no
        rule knows and path rules matching nothing are warned of always.

    Raises:
      ValueError: rules naming an axis the mesh lacks; a sharded parameter dimension not divisible by its
        mesh axes, names longer than a param's rank, a path rule's target of the wrong rank (each naming the
        parameter); ``tensor > 1`` with no param mapped to ``tensor``; with ``pipeline``, stage params whose
        layers the schedule's virtual stages do not divide.
      TypeError: ``pipeline`` is not a Pipeline; ``init_fn`` is not callable; ``auto_fsdp`` not a bool.
    """
    _check_common(mesh, rules, policy)
    _check_pipeline(pipeline)
    tx = shd.check_transformation(tx)
    init_rng, state_rng = jax.random.split(_as_key(rng))
    how = _PlacementOptions(param_rules, auto_fsdp, auto_fsdp_min_size)
    with precision.using(policy):
        shapes, shardings, model, placed = _abstract(init_fn, tx, init_rng, mesh, rules, policy, pipeline, how)
    _report(shapes, shardings, placed, mesh, report, how.auto_fsdp_min_size)

    def _init(init_rng, state_rng):
        params, model_state, held = model.init(init_rng)
        if policy is not None:
            params = policy.cast_to_param(params)
        opt_state = _effective_tx(tx, policy).init(params)
        if shardings.layout is not None:   # the model-order init, put in the stage layout
            params, opt_state = permute_state(params, opt_state, shardings.layout)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=state_rng,
                          model_state=model_state, policy=policy, layout=shardings.layout, graphdef=model.graphdef,
                          carried=held)

    with shd.use_for_init(mesh, rules), precision.using(policy):
        return jax.jit(_init, out_shardings=shardings)(init_rng, state_rng)


# ------------------------------------------------------------------------------------------------- steps

def _as_grad_fn(fn: Any) -> GradFn:
    """A GradFn as given; a plain ``loss_fn`` through :func:`jaxpar.train.grads.value_and_grad`."""
    if isinstance(fn, GradFn):
        return fn
    if fn is None or not callable(fn):
        raise TypeError(f"make_train_step needs a loss_fn(params, batch, rng) -> (loss, aux) or a jp.grads.GradFn "
                        f"(e.g. jp.pipeline.Pipeline(...)), got {fn!r}")
    return gr.value_and_grad(fn)


def _check_pipe(grad_fn: GradFn, mesh: Mesh) -> None:
    grad_fn.check_mesh(mesh)
    if mesh.shape.get(PIPE, 1) > 1 and not grad_fn.uses_pipe:
        raise ValueError(f"the mesh has pipe={mesh.shape['pipe']} but the step's gradient function does not "
                         "pipeline: pass jp.pipeline.Pipeline(embed_fn, stage_fn, head_loss_fn, schedule) (the "
                         "GPT: Pipeline(model.embed, model.stage, model.head_loss, schedule)), or build the mesh "
                         "with pipe=1")


def _cast_inputs(policy: Policy | None, batch: Any) -> Any:
    """jmp's ``policy.cast_to_compute((params, inputs))`` for the inputs: floating batch leaves to the compute
    dtype (integer leaves such as token ids untouched)."""
    return batch if policy is None else policy.cast_to_compute(batch)


def _check_grad_output(out: Any, params: Any, grad_fn: GradFn, stateful: bool) -> tuple[jax.Array, dict, Any, Any]:
    """A gradient function's ``(loss, aux, grads)``, validated at trace time (loss and aux as every loss's;
    grads with the params' structure)."""
    name = type(grad_fn).__name__
    n = 4 if stateful else 3
    if not (isinstance(out, tuple) and len(out) == n):
        raise ValueError(f"the gradient function {name} must return (loss, aux, grads{', new_model_state' * stateful})"
                         f" for this state; got {type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}")
    loss, aux = gr.check_loss_output(out[:2], f"the gradient function {name}")
    if jax.tree.structure(out[2]) != jax.tree.structure(params):
        raise ValueError(f"the gradient function {name} returned grads of structure {jax.tree.structure(out[2])}; "
                         f"they must have the params' structure {jax.tree.structure(params)}")
    return loss, aux, out[2], out[3] if stateful else None


def param_specs(params: Any) -> Any:
    """The ``PartitionSpec`` of every params leaf (a tree of the params' structure): a leaf's ``.sharding.spec``
    (arrays, ``jax.ShapeDtypeStruct`` with a sharding, or the shardings themselves), None where it has no named
    sharding. What a gradient function reads from ``jp.grads.Context.param_specs``."""
    def spec(x):
        sharding = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
        return getattr(sharding, "spec", None)
    return jax.tree.map(spec, params)


def _check_batch_fn(check_batch: Any, fn: Any) -> Callable[[Any], None] | None:
    """``check_batch`` resolved for the step's gradient function or loss ``fn``: ``"auto"`` is the model's own
    check (a protocol model's ``check_batch`` when ``fn`` is its bound method, or built from one), None none."""
    if isinstance(check_batch, str) and check_batch == "auto":
        return fn.model_check_batch() if isinstance(fn, GradFn) else protocol.batch_checker(fn)
    if check_batch is not None and not callable(check_batch):
        raise TypeError(f"check_batch must be a function check_batch(batch) that raises on a bad batch, \"auto\" (the "
                        f"model's own check_batch, when the loss is a method of a model that has one) or None (no "
                        f"check); got {check_batch!r}")
    return check_batch


def _global_norm(tree: Any) -> jax.Array:
    """L2 norm over all leaves, accumulated in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _scale_metrics(scale: jax.Array, new_opt_state: Any) -> dict[str, jax.Array]:
    """With loss scaling: the scale this step used and whether its update was skipped."""
    skipped = scaling.skipped(new_opt_state)
    return {} if skipped is None else {"loss_scale": scale, "skipped": skipped.astype(jnp.float32)}


def _apply_update(tx: optax.GradientTransformation, state: TrainState, grads: Any) -> TrainState:
    updates, opt_state = _effective_tx(tx, state.policy).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


class Step:
    """A built step: ``step(state, batch)`` runs it; ``step.lower(state, batch)`` lowers it without running.

    Before the jitted computation it checks the batch (size, ``check_batch``, the gradient function's own
    checks, once per shapes) and places it on the mesh. ``lower`` takes arrays or ``jax.ShapeDtypeStruct``
    leaves (``jp.train.abstract_state(...)`` and a batch of structs), so a step can be compiled for a mesh
    without allocating its state (e.g. ``step.lower(abstract_state, batch_structs).compile()``).
    """

    def __init__(self, jitted: MeshJit, batches: Batches, grad_fn: GradFn | None,
                 check_batch: Callable[[Any], None] | None, tx: optax.GradientTransformation | None = None,
                 loss_fn: Callable | None = None):
        self._jitted, self._batches, self._grad_fn, self._check_batch = jitted, batches, grad_fn, check_batch
        self._tx, self._checked, self._loss_fn = tx, set(), loss_fn

    def _check_state(self, state: Any, batch: Any, concrete: bool) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a jp.train.TrainState (from jp.train.init_state or a checkpoint "
                            f"restore), got {type(state).__name__}")
        _check_common(self._batches.mesh, self._batches.rules, state.policy)
        if concrete and any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch))):
            raise TypeError("step(state, batch) runs the step and needs arrays; for jax.ShapeDtypeStruct inputs "
                            "(e.g. jp.train.abstract_state) use step.lower(state, batch)")
        if self._tx is not None:
            expected = jax.eval_shape(_effective_tx(self._tx, state.policy).init, state.params)
            if jax.tree.structure(expected) != jax.tree.structure(state.opt_state):
                raise ValueError("the state's opt_state does not have the structure this step's tx gives "
                                 "(tx.init(params)): build the state with the same tx as the step "
                                 f"(state: {jax.tree.structure(state.opt_state)}; tx: {jax.tree.structure(expected)})")
        gr.check_parts(state, self._grad_fn, self._batches.mesh)
        if concrete:
            carry.check_values(state.carried)

    def _prepare(self, state: TrainState, batch: Any, concrete: bool) -> Any:
        b = self._batches
        g = self._grad_fn
        key = jax.tree.structure((state, batch)), tuple(
            (np.shape(x), jnp.result_type(x), isinstance(x, jax.ShapeDtypeStruct)) for x in jax.tree.leaves((state, batch)))
        first = key not in self._checked
        if first:
            self._check_state(state, batch, concrete)
        check_batch_size(b.size(batch), b.mesh, b.rules, g.grad_accum_steps if g else 1, g.microbatches if g else 1)
        if self._check_batch is not None and concrete:
            self._check_batch(batch)
        batch = b.place(batch, abstract=not concrete)
        if first:
            if g is not None:
                abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
                params = carry.merge(state.params, state.carried)
                g.check(abstract(params), _cast_inputs(state.policy, abstract(batch)), _context(
                    b.mesh, b.rules, state, param_specs(params)))
            elif self._loss_fn is not None:
                gr.check_loss_arity(self._loss_fn, _context(b.mesh, b.rules, state, None))
            self._checked.add(key)
        return batch

    def __call__(self, state: TrainState, batch: Any) -> Any:
        return self._jitted(state, self._prepare(state, batch, concrete=True))

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower`` of the step; ``state`` and ``batch`` may hold ``jax.ShapeDtypeStruct``\\ s."""
        return self._jitted.lower(state, self._prepare(state, batch, concrete=False))


def make_train_step(grad_fn: GradFn | LossFn, tx: optax.GradientTransformation, *, mesh: Mesh,
                    rules: shd.Rules = shd.DEFAULT_RULES, grad_accum_steps: int = 1, donate: bool = True,
                    check_batch: Callable[[Any], None] | str | None = "auto", batch_axis: str | None = None,
                    gather_weights: bool | None = None) -> Step:
    """Builds ``step(state, batch) -> (state, metrics)``, jitted with the state's shardings.

    Args:
      grad_fn: a gradient function (``jp.grads.GradFn``: ``jp.grads.value_and_grad(loss_fn)``, a
        ``jp.pipeline.Pipeline``, ...), or a plain ``loss_fn(params, batch, rng) -> (loss, aux)``, which is
        wrapped by ``jp.grads.value_and_grad``: ``loss`` a scalar mean over the batch it gets, ``aux`` a dict
        of scalars (or None). If ``aux["weight"]`` exists (e.g. a token count), accumulation microbatches are
        weighted by it so the accumulated loss and gradient are the whole-batch mean. The loss's form follows
        the state: with a ``model_state`` (Linen ``batch_stats``) ``loss_fn(params, batch, rng, model_state) ->
        (loss, aux, new_model_state)``, the new model state written to the state (with accumulation it passes
        through the microbatches in order); for an NNX state (``state.graphdef``) ``loss_fn(model, batch, rng)
        -> (loss, aux)`` on the model ``nnx.merge`` rebuilds, whose non-param variables (batch statistics, RNG
        counts) after the call are the new model state (:func:`jaxpar.train.grads.call_loss`).
      tx: the optax transformation (or an ``optax.MultiSteps``).
      mesh, rules: as for :func:`init_state`. A mesh with ``pipe > 1`` needs a pipelined gradient function.
      grad_accum_steps: split the batch into this many microbatches (rows ``j::grad_accum_steps``) and
        accumulate gradients in float32 before one update (``jp.grads.accumulate``).
      donate: donate the input state's buffers to the output.
      batch_axis: the logical name of the batch axis in ``rules`` (MaxText's ``activation_batch``), whose mesh
        axes the batch's leading axis is split over; None: the ``batch`` rule, else the first rule whose name
        contains ``batch``. Activation constraints naming logical axes no rule knows are warned of once, when
        the step is traced (Flax would leave them unsharded silently).
      check_batch: called with each batch as given (host leaves: this process's rows) before it is placed on
        the devices; it raises (ValueError) to reject a bad batch, e.g. ``GPT.check_batch`` for token ids.
        ``"auto"`` (default): the model's own ``check_batch`` when ``grad_fn`` is a bound method of a model that
        has one (``model.loss``; a ``Pipeline`` of ``model.embed``, ...: the model protocol,
        :mod:`jaxpar.protocol`), else none. None: no check. Protocol models read host (numpy) leaves
        only, so a batch already on the devices costs nothing.
      gather_weights: on a mesh with ``fsdp > 1``, gather each param sharded over ``fsdp`` whole over it where the
        loss starts (inside the differentiated function, after the policy's cast: compute-dtype bytes; the
        gradient comes back reduce-scattered), :func:`jaxpar.train.grads.gather_weights`. None (default): unless the
        model declares ``shards_activations`` (a ``model.loss`` whose model has the attribute, a loss function
        carrying it, an NNX module class; the built-in GPT, Llama and MLP do: :mod:`jaxpar.protocol`).
        Why: XLA's partitioner (jax 0.10.2) can give wrong gradients for a model whose activations carry no
        sharding constraints, params on ``fsdp`` and ``tensor``, batch on ``(data, fsdp)``
        (:func:`jaxpar._compat.gathers_fsdp_weights`). Cost: the gathered weights live for the whole step (ZeRO-2-like
        param memory; gradients and optimizer state stay sharded). False: never (a model that constrains its
        batch axis, its ``model.loss`` wrapped in a lambda); True: always. For a ``loss_fn`` or
        ``jp.grads.value_and_grad`` (with accumulation); a ``jp.pipeline.Pipeline`` places its own weights
        (True raises ValueError).

    The precision policy is the state's (``state.policy``, given to :func:`init_state`): params are cast to its
    compute dtype inside the differentiated function and the batch's floating leaves before it (integer leaves
    such as token ids are untouched), as jmp's ``policy.cast_to_compute((params, inputs))``. A loss scale is
    read from the outermost optimizer state (``jp.precision.loss_scaling``).

    The returned :class:`Step` accepts ``batch``: a pytree of numpy or jax arrays whose leading axis is the
    global batch. In a multi-process run each process passes (numpy) the rows of the global batch its devices
    hold, ``jp.data.process_slice(batch_size, mesh)``. Metrics (global, replicated float32 scalars): ``loss``,
    ``grad_norm`` (global L2 norm of the unscaled gradient), every ``aux`` entry (``weight`` summed, others
    weight-averaged), and with loss scaling ``loss_scale`` and ``skipped``.

    Raises (on the first call with a bad batch, before tracing):
      ValueError: a global batch not divisible by the batch mesh axes (``data*fsdp``) times
        ``grad_accum_steps`` (and a pipeline's microbatches); batch leaves of different leading sizes; the
        gradient function's own checks (a pipeline: layers not divisible by stages, stage shapes).
      TypeError, ValueError (at once): a bad ``grad_fn``, ``tx``, mesh or rules; ``grad_accum_steps`` not a
        positive int; a mesh with ``pipe > 1`` and no pipeline.
      ValueError (first call, before tracing): a state in a stage layout (``state.layout``) for a gradient
        function that is not a pipeline, or in another schedule's layout than the pipeline's. (First call or
        lower, traced, before running): a precision feature's own check of the traced program fails (:func:`jaxpar.precision.policy.check_program`).
    """
    _check_common(mesh, rules)
    rules = shd.with_batch_axis(rules, batch_axis)
    tx = shd.check_transformation(tx)
    grad_fn = gr.accumulate(_as_grad_fn(grad_fn), grad_accum_steps)
    _check_pipe(grad_fn, mesh)
    gather_weights = gr.check_gather_weights(gather_weights, grad_fn)

    def _step(shardings: tuple, state: TrainState, batch: Any):
        scale = scaling.loss_scale(state.opt_state)
        scale = jnp.ones((), jnp.float32) if scale is None else scale.astype(jnp.float32)
        rng = jax.random.fold_in(state.rng, state.step)
        ctx = gr.with_weight_gather(_context(mesh, rules, state, param_specs(carry.merge(
            shardings[0].params, shardings[0].carried))), gather_weights, grad_fn)
        params = carry.merge(state.params, state.carried)   # carried state's "gradient" is its new value
        with jax.named_scope("forward_backward"), placement.audit_activation_names(mesh, rules), precision.using(state.policy):
            out = grad_fn(params, _cast_inputs(state.policy, batch), rng, scale, ctx)
        carried = ctx.stateful and grad_fn.carries_model_state
        loss, aux, grads, model_state = _check_grad_output(out, params, grad_fn, carried)
        grads, new = carry.split(grads)
        with jax.named_scope("optimizer_update"):
            state = _apply_update(tx, state, grads).replace(carried=carry.apply(state.carried, new))
        if carried:
            state = state.replace(model_state=model_state)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads) / scale, **aux, **_scale_metrics(scale, state.opt_state)}
        return state, metrics

    jitted = MeshJit(_step, mesh, rules, lambda s, b: (s, shd.replicated(mesh)), pass_shardings=True,
                     donate_argnums=(0,) if donate else (), track=lambda out: out[1],  # metrics: state is donated
                     check_program=lambda jaxpr, state, batch: precision.check_program(jaxpr, state.policy))
    return Step(jitted, Batches(mesh, rules), grad_fn, _check_batch_fn(check_batch, grad_fn), tx)


def _context(mesh: Mesh, rules: shd.Rules, state: TrainState, specs: Any) -> gr.Context:
    return gr.Context(mesh, rules, state.policy, state.layout, specs, state.model_state, state.graphdef)


def make_eval_step(loss_fn: LossFn | GradFn, *, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES,
                   check_batch: Callable[[Any], None] | str | None = "auto", batch_axis: str | None = None,
                   gather_weights: bool | None = None) -> Step:
    """Builds ``eval_step(state, batch) -> metrics`` (``loss`` and ``aux`` entries), no update.

    Args:
      loss_fn: a ``loss_fn(params, batch, rng) -> (loss, aux)``, or a ``jp.pipeline.Pipeline`` (any gradient
        function with an ``eval_loss(params, batch, rng, ctx)`` method): the batch then runs through the
        pipeline's forward-only table over the mesh's ``pipe`` axis (``Pipeline.eval_loss``), and the
        pipeline's checks (schedule against the mesh, params and batch shapes) run as in the train step.
      mesh, rules, check_batch, batch_axis, gather_weights: as for :func:`make_train_step` (the gather after the
        policy's cast, before the loss; none for a Pipeline).

    The loss's form follows the state as in :func:`make_train_step`; with a model state the loss reads it (a
    Linen loss returns ``(loss, aux)`` or ``(loss, aux, new_model_state)``, the new state dropped) and an NNX
    model is put in inference mode first (``model.eval()``: BatchNorm reads its running statistics, Dropout
    is off). The loss gets ``fold_in(state.rng, state.step)``, params and batch cast by the state's policy. The batch
    follows :func:`make_train_step`'s conventions and checks (``check_batch`` included).

    Raises:
      TypeError (at once): ``loss_fn`` is neither callable nor a gradient function with ``eval_loss``; a bad
        mesh or rules.
      ValueError (at once): a Pipeline whose ``num_stages`` is not the mesh's ``pipe`` size. (On the first call
        with a bad batch, before tracing): as for :func:`make_train_step`.
    """
    _check_common(mesh, rules)
    rules = shd.with_batch_axis(rules, batch_axis)
    grad_fn, check, plain = None, _check_batch_fn(check_batch, loss_fn), None
    if isinstance(loss_fn, GradFn):
        if not callable(getattr(loss_fn, "eval_loss", None)):
            raise TypeError(f"make_eval_step needs a loss_fn(params, batch, rng) -> (loss, aux) or a "
                            f"jp.pipeline.Pipeline; the gradient function {loss_fn!r} has no eval_loss: pass the "
                            "loss_fn it was built from")
        loss_fn.check_mesh(mesh)
        grad_fn, pipeline = loss_fn, loss_fn
        loss_fn = lambda params, batch, rng, ctx: pipeline.eval_loss(params, batch, rng,
                                                                     gr.Context(mesh, rules, layout=ctx.layout))
    elif callable(loss_fn):
        plain = loss_fn
        loss_fn = lambda params, batch, rng, ctx: gr.call_loss(plain, params, batch, rng, ctx, train=False)[:2]
    else:
        raise TypeError(f"make_eval_step needs a loss_fn(params, batch, rng) -> (loss, aux), got {loss_fn!r}")
    gather_weights = gr.check_gather_weights(gather_weights, grad_fn)

    def _eval(shardings: tuple, state: TrainState, batch: Any):
        params = carry.merge(state.params, state.carried)
        params = params if state.policy is None else state.policy.cast_to_compute(params)
        ctx = gr.with_weight_gather(_context(mesh, rules, state, param_specs(carry.merge(
            shardings[0].params, shardings[0].carried))), gather_weights, plain, grad_fn)
        with placement.audit_activation_names(mesh, rules), precision.using(state.policy):
            loss, aux = gr.check_loss_output(loss_fn(gr.gather_weights(params, ctx), _cast_inputs(
                state.policy, batch), jax.random.fold_in(state.rng, state.step), ctx))
        return {"loss": loss.astype(jnp.float32), **aux}

    jitted = MeshJit(_eval, mesh, rules, lambda s, b: shd.replicated(mesh), pass_shardings=True)
    return Step(jitted, Batches(mesh, rules), grad_fn, check, loss_fn=plain)



__all__ = ["TrainState", "abstract_state", "init_state", "make_eval_step", "make_train_step", "shard_batch",
           "to_model_order"]
