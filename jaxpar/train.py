"""Sharded training state and steps: data parallelism, FSDP and tensor parallelism through ``jax.jit``.

The layout comes from the logical axis rules (``jaxpar.sharding``): params and optimizer state are placed by
their logical names, the batch over the mesh axes ``batch`` maps to, and GSPMD inserts the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import dispatch, precision
from jaxpar.optim import adamw, decay_mask  # noqa: F401  (jp.train.adamw: the experiments' optimizer)
from jaxpar import sharding as shd
from jaxpar.precision import Policy

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
      step: int32 scalar, the number of updates applied so far.
      params: the parameter tree, unboxed (plain arrays), stored in the policy's ``param_dtype``.
      opt_state: the optax state, sharded like the params it mirrors.
      rng: a typed PRNG key; step ``t`` uses ``jax.random.fold_in(rng, t)``.
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def _as_key(rng: Any) -> jax.Array:
    if isinstance(rng, (int, np.integer)):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    if isinstance(rng, (jax.Array, np.ndarray)) and rng.dtype == np.uint32:
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"rng must be a typed key (jax.random.key(seed)), a raw uint32 key or an int seed; got {rng!r}")


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def _opt_state_shardings(opt_shapes: Any, param_shapes: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Gives every optimizer-state leaf the sharding of the parameter it mirrors.

    A leaf mirrors a parameter when its key path ends with that parameter's path and the shapes agree (Adam's
    ``mu``/``nu``, masks, EMA copies); every other leaf (counts, scales) is replicated.
    """
    by_path = {}
    for (path, shape), sharding in zip(jax.tree_util.tree_flatten_with_path(param_shapes)[0],
                                       jax.tree.leaves(param_shardings)):
        by_path[_path_key(path)] = (shape.shape, sharding)

    def pick(path, leaf):
        key = _path_key(path)
        for i in range(len(key)):
            hit = by_path.get(key[i:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(pick, opt_shapes)


def _abstract(init_fn, tx, rng, mesh, rules, policy):
    """(state shapes, state shardings) without computing anything."""
    with shd.use_for_init(mesh, rules):
        boxed = jax.eval_shape(init_fn, rng)
    param_shardings = shd.named_shardings(boxed, mesh, rules)
    param_shapes = nn.meta.unbox(boxed)
    if policy is not None:
        param_shapes = policy.cast_to_param(param_shapes)
    opt_shapes = jax.eval_shape(_effective_tx(tx, policy).init, param_shapes)
    rep = NamedSharding(mesh, P())
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=param_shapes, opt_state=opt_shapes,
                        rng=jax.eval_shape(lambda k: k, rng))
    shardings = TrainState(step=rep, params=param_shardings,
                           opt_state=_opt_state_shardings(opt_shapes, param_shapes, param_shardings, mesh), rng=rep)
    return shapes, shardings


def _effective_tx(tx: optax.GradientTransformation, policy: Policy | None) -> optax.GradientTransformation:
    """Keeps optimizer state in float32 when the policy stores params in a 16-bit dtype."""
    if policy is not None and policy.param_dtype.itemsize < 4:
        return precision.f32_optimizer_state(tx)
    return tx


def _check_tx(tx: Any) -> optax.GradientTransformation:
    """``tx`` as a GradientTransformation: optax's ``MultiSteps`` wrapper is taken as optax users pass it."""
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation (e.g. optax.adamw(1e-3), called) or an "
                        f"optax.MultiSteps, got {tx!r}")
    return tx


def _check_common(mesh, rules, policy):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (from jp.make_mesh), got {type(mesh).__name__}")
    shd.validate_rules(rules, mesh)
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a jp.precision.Policy or None, got {policy!r}")


def abstract_state(init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, *, mesh: Mesh,
                   rules: shd.Rules = shd.DEFAULT_RULES, policy: Policy | None = None) -> TrainState:
    """The ``TrainState`` of ``jax.ShapeDtypeStruct`` leaves, each with its ``NamedSharding``.

    It is what :func:`init_state` would return, without allocating anything: the restore target for
    checkpoints on the current mesh.
    """
    _check_common(mesh, rules, policy)
    tx = _check_tx(tx)
    shapes, shardings = _abstract(init_fn, tx, jax.random.key(0), mesh, rules, policy)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_state(init_fn: Callable[[jax.Array], Any], tx: optax.GradientTransformation, rng: Any, *, mesh: Mesh,
               rules: shd.Rules = shd.DEFAULT_RULES, policy: Policy | None = None) -> TrainState:
    """Initializes params and optimizer state directly in their sharded layout.

    The state's shapes come from ``jax.eval_shape`` and it is built by ``jax.jit(..., out_shardings=...)``, so
    the whole unsharded parameter tree never exists on one device.

    Args:
      init_fn: ``init_fn(rng) -> params``; params may be Flax-boxed (``nn.with_logical_partitioning``) to carry
        logical axis names, which ``rules`` map to mesh axes; plain leaves are replicated.
      tx: the optax transformation.
      rng: a typed key (``jax.random.key(seed)``) or an int seed. It is split into the init key and the
        state's key.
      mesh: from :func:`jaxpar.make_mesh`.
      rules: logical-to-mesh axis rules.
      policy: a mixed-precision policy; params are stored in its ``param_dtype``.

    Raises:
      ValueError: rules naming an axis the mesh lacks; a sharded parameter dimension not divisible by its
        mesh axes (the message names the parameter).
    """
    _check_common(mesh, rules, policy)
    tx = _check_tx(tx)
    init_rng, state_rng = jax.random.split(_as_key(rng))
    _, shardings = _abstract(init_fn, tx, init_rng, mesh, rules, policy)

    def _init(init_rng, state_rng):
        params = nn.meta.unbox(init_fn(init_rng))
        if policy is not None:
            params = policy.cast_to_param(params)
        opt_state = _effective_tx(tx, policy).init(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=state_rng)

    with shd.use_for_init(mesh, rules):
        return jax.jit(_init, out_shardings=shardings)(init_rng, state_rng)


# ----------------------------------------------------------------------------------------------- batches

def _global_batch_size(batch: Any, mesh: Mesh, rules: shd.Rules) -> int:
    """The global batch size: a jax array's leading size, or the global size of a host leaf's process rows."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no arrays; pass a pytree of arrays whose leading axis is the global batch")
    sizes = set()
    for leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError(f"batch leaf of shape {np.shape(leaf)} has no leading batch axis")
        n = np.shape(leaf)[0]
        sizes.add(n if isinstance(leaf, jax.Array) else shd.global_batch_rows(n, mesh, rules))
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}; give every leaf the same "
                         "leading (global batch) axis")
    return sizes.pop()


def check_batch_size(batch_size: int, mesh: Mesh, rules: shd.Rules, grad_accum_steps: int = 1) -> None:
    """Raises ValueError unless the global batch splits evenly over the batch mesh axes and microbatches."""
    axes = shd.batch_axes(rules, mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    names = "*".join(axes) or "1"
    if batch_size < 1:
        raise ValueError(f"batch {batch_size} is empty; pass at least {n * grad_accum_steps} rows")
    if batch_size % grad_accum_steps:
        raise ValueError(f"batch {batch_size} is not divisible by grad_accum_steps = {grad_accum_steps}; "
                         f"use a batch that is a multiple of {grad_accum_steps}")
    micro = batch_size // grad_accum_steps
    if micro % n:
        what = f"batch {batch_size}" if grad_accum_steps == 1 else \
            f"microbatch {micro} (batch {batch_size} / grad_accum_steps {grad_accum_steps})"
        raise ValueError(f"{what} is not divisible by {names} = {n}; use a batch that is a multiple of "
                         f"{n * grad_accum_steps}")


def shard_batch(batch: Any, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES) -> Any:
    """Places a batch on the mesh, leading axis split over the batch axes.

    Host (numpy) leaves are this process's rows of the global batch (``jp.data.process_slice(global_batch_size, mesh)``;
    the whole batch in a single-process run) and become global arrays through
    ``jax.make_array_from_process_local_data``; jax arrays are taken as global and resharded if needed.
    """
    def place(x):
        sharding = shd.batch_sharding(rules, mesh, np.ndim(x))
        if isinstance(x, jax.Array):
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        x = np.asarray(x)
        global_shape = (shd.global_batch_rows(x.shape[0], mesh, rules), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)
    return jax.tree.map(place, batch)


# ------------------------------------------------------------------------------------------------- steps

def _loss_and_grads(loss_fn: LossFn, policy: Policy | None):
    """``compute(params, batch, rng, scale) -> (loss, aux, grads)``: grads of ``scale * loss``, loss unscaled.

    Params are cast to the policy's compute dtype inside the differentiated function, so gradients come
    back in the param dtype (the step casts the batch's floating leaves beforehand); the loss is taken in
    float32.
    """
    def compute(params, batch, rng, scale):
        def f(p):
            if policy is not None:
                p = policy.cast_to_compute(p)
            loss, aux = check_loss_output(loss_fn(p, batch, rng))
            loss = loss.astype(jnp.float32)
            return loss * scale, (loss, aux)
        (_, (loss, aux)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, aux, grads
    return compute


RESERVED_METRICS = ("loss", "grad_norm", "loss_scale", "skipped")


def check_loss_output(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Validates ``loss_fn``'s return value (at trace time): ``(scalar float loss, dict of scalars or None)``."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"loss_fn must return (loss, aux) with aux a dict (or None); got {type(out).__name__}")
    loss, aux = out
    if not hasattr(loss, "shape") or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn's loss must be a floating scalar array (a mean over the batch), got "
                         f"{getattr(loss, 'shape', type(loss).__name__)} {getattr(loss, 'dtype', '')}")
    aux = {} if aux is None else aux
    if not isinstance(aux, dict):
        raise ValueError(f"loss_fn's aux must be a dict of scalars (or None), got {type(aux).__name__}")
    out_aux = {}
    for k, v in aux.items():
        if not isinstance(k, str) or k in RESERVED_METRICS:
            raise ValueError(f"aux key {k!r} is not allowed: keys are strings other than {RESERVED_METRICS}")
        v = jnp.asarray(v)
        if v.shape != ():
            raise ValueError(f"aux[{k!r}] has shape {v.shape}; aux values must be scalars (reduce them first)")
        out_aux[k] = v.astype(jnp.float32) if not jnp.issubdtype(v.dtype, jnp.floating) else v
    return loss, out_aux


def _accumulate(compute, params, batch, rng, scale, steps: int, batch_axes: tuple[str, ...]):
    """Weighted mean of loss, aux and grads over ``steps`` strided microbatches (scan, constant memory).

    Microbatch ``j`` holds rows ``j, j+steps, j+2*steps, ...`` so each stays spread over the batch axes.
    A microbatch's weight is ``aux["weight"]`` when present (e.g. its token count), else 1.
    """
    def split(x):
        x = x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1)
        return shd.constrain_spec(x, P(None, batch_axes or None))
    micro = jax.tree.map(split, batch)
    first = jax.tree.map(lambda x: x[0], micro)
    _, aux_shape, _ = jax.eval_shape(compute, params, first, rng, scale)
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)
    init = (jnp.zeros((), jnp.float32), zeros(aux_shape), zeros(params), jnp.zeros((), jnp.float32))

    def body(carry, xs):
        mb, j = xs
        loss_sum, aux_sum, grad_sum, w_sum = carry
        loss, aux, grads = compute(params, mb, jax.random.fold_in(rng, j), scale)
        w = aux.get("weight", jnp.ones((), jnp.float32)).astype(jnp.float32)
        # w * x, but 0 (not NaN) for an empty microbatch (weight 0, whose mean loss is 0/0).
        wx = lambda x: jnp.where(w > 0, w * x.astype(jnp.float32), 0.0)
        aux_w = {k: v if k == "weight" else wx(v) for k, v in aux.items()}
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)
        grad_sum = jax.tree.map(lambda a, g: a + wx(g), grad_sum, grads)
        return (loss_sum + wx(loss), add(aux_sum, aux_w), grad_sum, w_sum + w), None

    (loss_sum, aux_sum, grad_sum, w_sum), _ = jax.lax.scan(body, init, (micro, jnp.arange(steps)))
    w_sum = jnp.where(w_sum > 0, w_sum, 1.0)   # an all-empty batch: zero loss and gradients, not NaN
    aux = {k: v if k == "weight" else v / w_sum for k, v in aux_sum.items()}
    grads = jax.tree.map(lambda g, p: (g / w_sum).astype(p.dtype), grad_sum, params)
    return loss_sum / w_sum, aux, grads


def _global_norm(tree: Any) -> jax.Array:
    """L2 norm over all leaves, accumulated in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


class _Jitted:
    """Calls a jitted function inside the mesh + rules context, building it once per input structure."""

    def __init__(self, build: Callable[[Any], Callable], mesh: Mesh, rules: shd.Rules,
                 track: Callable[[Any], Any] = lambda out: out):
        self._build, self._mesh, self._rules, self._cache, self._track = build, mesh, rules, {}, track

    def get(self, state: Any) -> Callable:
        leaves = jax.tree.leaves(state)
        if any(not isinstance(x, jax.Array) for x in leaves):
            raise TypeError("the state must hold jax arrays placed on the mesh (from jp.train.init_state or a "
                            "checkpoint restore); got host values")
        if any(x.is_deleted() for x in leaves):
            raise ValueError("this state was donated to an earlier step and its buffers are gone: use the state "
                             "that step returned (state, metrics = step(state, batch)), or build the step with "
                             "donate=False")
        key = (jax.tree.structure(state), tuple(x.sharding for x in leaves))
        if key not in self._cache:
            self._cache[key] = self._build(jax.tree.map(lambda x: x.sharding, state))
        return self._cache[key]

    def __call__(self, state, *args):
        fn = self.get(state)

        def call():
            with shd.use(self._mesh, self._rules):
                return fn(state, *args)
        return dispatch.bounded(self._mesh, call, self._track)

    def lower(self, state, *args):
        """``jax.jit(...).lower`` of the step on these arguments, inside the mesh + rules context."""
        with shd.use(self._mesh, self._rules):
            return self.get(state).lower(state, *args)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, *, mesh: Mesh,
                    rules: shd.Rules = shd.DEFAULT_RULES, policy: Policy | None = None,
                    grad_accum_steps: int = 1, donate: bool = True, pipeline: Any = None,
                    check_batch: Callable[[Any], None] | None = None):
    """Builds ``step(state, batch) -> (state, metrics)``, jitted with the state's shardings.

    Args:
      loss_fn: ``loss_fn(params, batch, rng) -> (loss, aux)``; ``loss`` a scalar mean over the batch it gets,
        ``aux`` a dict of scalars (or None). If ``aux["weight"]`` exists (e.g. a token count), microbatches are
        weighted by it so the accumulated loss and gradient are the whole-batch mean.
      tx: the optax transformation.
      mesh, rules: as for :func:`init_state`.
      policy: as for :func:`init_state`; params and the batch's floating leaves are cast to its compute dtype
        (integer leaves such as token ids are untouched), as jmp's ``policy.cast_to_compute((params, inputs))``.
      grad_accum_steps: split the batch into this many microbatches (rows ``j::grad_accum_steps``) and
        accumulate gradients in float32 before one update.
      donate: donate the input state's buffers to the output.
      pipeline: a ``jp.pipeline.Pipeline`` (the model as embed / stage / head-loss parts and a schedule) to
        train with pipeline parallelism over the mesh's ``pipe`` axis; ``loss_fn`` is then unused (pass None).
        Required when the mesh has ``pipe > 1``. Composes with ``grad_accum_steps`` (each accumulation batch
        is split into the schedule's microbatches) and with ``policy``.
      check_batch: called with each batch as given (host leaves: this process's rows) before it is placed on
        the devices; it raises (ValueError) to reject a bad batch, e.g. ``GPT.check_batch`` for token ids.

    The returned step accepts ``batch``: a pytree of numpy or jax arrays whose leading axis is the global
    batch. In a multi-process run each process passes (numpy) the rows of the global batch its devices hold,
    ``jp.data.process_slice(batch_size, mesh)``. Metrics (global, replicated scalars): ``loss``,
    ``grad_norm`` (global L2 norm of the gradient), and every ``aux`` entry (``weight`` summed, others
    weight-averaged).

    Raises (on the first call with a bad batch, before tracing):
      ValueError: a global batch not divisible by the batch mesh axes (``data*fsdp``) times
        ``grad_accum_steps``; batch leaves of different leading sizes; with a pipeline, the checks of
        ``jp.pipeline.BoundPipeline.check`` (layers not divisible by stages, microbatches, stage shapes).
      ValueError (at once): a mesh with ``pipe > 1`` and no ``pipeline``; a pipeline whose schedule's
        ``num_stages`` is not the mesh's ``pipe`` size.
    """
    _check_common(mesh, rules, policy)
    tx = _check_tx(tx)
    if not isinstance(grad_accum_steps, (int, np.integer)) or isinstance(grad_accum_steps, bool) \
            or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps!r} must be a positive int")
    grad_accum_steps = int(grad_accum_steps)
    compute = _loss_and_grads(loss_fn, policy)
    bound = _bind_pipeline(pipeline, mesh, rules, policy, grad_accum_steps)
    if bound is not None:
        compute = bound.loss_and_grads
    tx = _effective_tx(tx, policy)
    axes = shd.batch_axes(rules, mesh)

    def _step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        if policy is not None:   # jmp's policy.cast_to_compute((params, inputs)): float inputs too
            batch = policy.cast_to_compute(batch)
        precision.check_outermost(state.opt_state)
        found = precision.loss_scale(state.opt_state)
        scale = jnp.ones((), jnp.float32) if found is None else found.astype(jnp.float32)
        if grad_accum_steps == 1:
            loss, aux, grads = compute(state.params, batch, rng, scale)
        else:
            loss, aux, grads = _accumulate(compute, state.params, batch, rng, scale, grad_accum_steps, axes)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads) / scale, **aux}
        if found is not None:
            metrics.update(loss_scale=scale, skipped=precision.skipped(opt_state).astype(jnp.float32))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def build(state_shardings):
        return jax.jit(_step, in_shardings=(state_shardings, None),
                       out_shardings=(state_shardings, NamedSharding(mesh, P())),
                       donate_argnums=(0,) if donate else ())

    jitted = _Jitted(build, mesh, rules, track=lambda out: out[1])   # the metrics: the state gets donated

    def step(state: TrainState, batch: Any):
        check_batch_size(_global_batch_size(batch, mesh, rules), mesh, rules, grad_accum_steps)
        if check_batch is not None:
            check_batch(batch)
        batch = shard_batch(batch, mesh, rules)
        if bound is not None:
            bound.check(state.params, batch)
        return jitted(state, batch)

    step.lower = lambda state, batch: jitted.lower(state, shard_batch(batch, mesh, rules))
    return step


def _bind_pipeline(pipeline: Any, mesh: Mesh, rules: shd.Rules, policy: Policy | None, grad_accum_steps: int):
    """The pipeline bound to the step's mesh (None without one); ValueError for ``pipe > 1`` without one."""
    from jaxpar.pipeline import Pipeline  # the pipeline package imports jaxpar.sharding only; no cycle
    if pipeline is None:
        if mesh.shape.get("pipe", 1) > 1:
            raise ValueError(f"the mesh has pipe={mesh.shape['pipe']} but no pipeline was given: pass "
                             "pipeline=jp.pipeline.Pipeline(embed_fn, stage_fn, head_loss_fn, schedule) (the GPT: "
                             "model.pipeline(schedule)), or build the mesh with pipe=1")
        return None
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a jp.pipeline.Pipeline, got {type(pipeline).__name__}")
    return pipeline.bind(mesh=mesh, rules=rules, policy=policy, grad_accum_steps=grad_accum_steps)


def make_eval_step(loss_fn: LossFn, *, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES,
                   policy: Policy | None = None, check_batch: Callable[[Any], None] | None = None):
    """Builds ``eval_step(state, batch) -> metrics`` (``loss`` and ``aux`` entries), no update.

    The batch follows :func:`make_train_step`'s conventions and checks (``check_batch`` included).
    """
    _check_common(mesh, rules, policy)

    def _eval(state: TrainState, batch):
        params, batch = (state.params, batch) if policy is None else policy.cast_to_compute((state.params, batch))
        loss, aux = check_loss_output(loss_fn(params, batch, jax.random.fold_in(state.rng, state.step)))
        return {"loss": loss.astype(jnp.float32), **aux}

    jitted = _Jitted(lambda s: jax.jit(_eval, in_shardings=(s, None), out_shardings=NamedSharding(mesh, P())),
                     mesh, rules)

    def eval_step(state: TrainState, batch: Any):
        check_batch_size(_global_batch_size(batch, mesh, rules), mesh, rules)
        if check_batch is not None:
            check_batch(batch)
        return jitted(state, shard_batch(batch, mesh, rules))
    return eval_step


# -------------------------------------------------------------------------------------------- the loop

def run_steps(step_fn: Callable, state: TrainState, batch_fn: Callable[[int], Any], start: int, stop: int,
              max_in_flight: int = 2) -> Iterator[tuple[int, dict[str, float], TrainState]]:
    """Runs steps ``start .. stop-1`` and yields ``(step, host_metrics, state)`` in order.

    Step ``t+1`` is dispatched before step ``t``'s metrics are pulled to the host, but never more than
    ``max_in_flight`` steps are outstanding: XLA:CPU's collective rendezvous aborts ("termination timeout")
    when many steps with collectives are queued. The yielded state is the newest dispatched one.
    """
    from jaxpar.checkpoint import run_steps as run  # one loop: the checkpointing one, with nothing to save
    return run(step_fn, state, batch_fn, start, stop, None, max_in_flight=max_in_flight)
