"""A model given to the train step as three parts (embedding, stacked stages, head and loss), run as a pipeline.

``Pipeline(embed_fn, stage_fn, head_loss_fn, schedule)`` is a gradient function (``jp.grads.GradFn``):
``jp.train.make_train_step(Pipeline(...), tx, mesh=mesh)`` trains a model whose params tree holds its stacked layers under one key (``"blocks"`` for the GPT). Each step:

1. the stacked ``[layers, ...]`` leaves are put in the schedule's stage layout
   (:func:`jaxpar.pipeline.stage_layout.to_stage_layout`; the identity for one chunk per stage) and reshaped to
   ``[num_stages * num_chunks, layers / (num_stages * num_chunks), ...]``. With a ``pipe`` axis larger than 1
   the layers axis is already split over ``pipe`` (``jp.sharding.effective_rules``), so with one chunk stage
   ``s`` finds layers ``s*L/p .. (s+1)*L/p - 1`` on its own devices and nothing moves. With several chunks
   (interleaved, ZB-V) the step follows the state's layout (``TrainState.layout``): a state built by
   ``jp.train.init_state(..., pipeline=pipeline)`` (or restored into ``abstract_state(..., pipeline=pipeline)``)
   holds the stage layout and nothing moves; a state in model order is permuted to the stage layout, and the
   gradient back, inside every step (weights cross ``pipe`` every step). A state in another schedule's layout
   is refused (ValueError before tracing);
2. ``x = embed_fn(params, inputs)`` runs before the pipeline (GSPMD over the batch axes, replicated over
   ``pipe``); :func:`jaxpar.pipeline.value_and_grad`'s interpreter runs the stages and the head/loss;
3. the embedding's gradient comes from ``g_x`` through ``jax.vjp(embed_fn)``; it is added to the head's
   gradient of the same tree, so tied weights (the GPT's embedding used as the unembedding) get the sum of
   both uses.

With a ``context`` mesh axis (context parallelism) the per-token leaves (rank >= 2) of the inputs and targets are put
in the zigzag layout first (:func:`jaxpar.layers.attention.shard_sequence`); the sequence stays sharded over ``context``
inside the stages (an automatic axis of the interpreter's ``shard_map``), where a stage function attends with
``jp.attention.causal(..., layout="zigzag")`` and reads positions from ``jp.attention.positions`` (the GPT and
the Llama do).

``jp.train.make_eval_step(Pipeline(...), mesh=mesh)`` evaluates through the schedule's forward-only table
(:meth:`Pipeline.eval_loss`). With ``stage_takes_rng=True`` the stage function gets per-layer keys folded from
the step's key (see the class docstring, "Keys").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar._tree import key_path
from jaxpar.train import grads as gr
from jaxpar.sharding import rules as shd
from jaxpar import protocol
from jaxpar.layers.attention import shard_sequence
from jaxpar.layers.per_token import PACKED_KEYS
from jaxpar.pipeline.checks import check_comm_options, check_mesh_and_schedule, check_stage_fn, struct
from jaxpar.pipeline.shard_map import apply_core, value_and_grad_core
from jaxpar.pipeline.interpreter import AXIS
from jaxpar.pipeline.stage_layout import from_stage_layout, stage_order, to_stage_layout
from jaxpar.train import carried as carry
from jaxpar.train.state_layout import state_layout
from jaxpar.pipeline.schedules import Schedule
from jaxpar.pipeline.stash import STASH_MODES


def _split_params(params: Any, key: str) -> tuple[Any, Any]:
    return params[key], {k: v for k, v in params.items() if k != key}


def _to_stages(a: jax.Array, n: int) -> jax.Array:
    """``[L, ...] -> [n, L/n, ...]`` (``n`` virtual stages), leading axis on ``pipe`` (free when the layers axis
    is already on pipe)."""
    a = a.reshape(n, a.shape[0] // n, *a.shape[1:])
    return jax.lax.with_sharding_constraint(a, P(AXIS, *([P.UNCONSTRAINED] * (a.ndim - 1))))


def _from_stages(a: jax.Array) -> jax.Array:
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _checked_head_loss(head_loss_fn: Callable) -> Callable:
    """``head_loss_fn`` whose output is validated as every loss is: ``(scalar loss, dict of scalars)``."""
    return lambda params, y, targets: gr.check_loss_output(head_loss_fn(params, y, targets), "head_loss_fn")


@dataclasses.dataclass(frozen=True)
class Pipeline(gr.GradFn):
    """A model as three parts plus a schedule: the gradient function of a pipelined model.

    ``jp.train.make_train_step(Pipeline(embed_fn, stage_fn, head_loss_fn, schedule), tx, mesh=mesh)`` trains
    it over the mesh's ``pipe`` axis; it composes with ``grad_accum_steps`` (each accumulation batch is split
    into the schedule's microbatches) and with the state's precision policy.

    Attributes:
      embed_fn: ``embed_fn(params, inputs) -> x``, ``x`` of shape ``[B, ...]`` (e.g. ``x_BLD``). ``params``
        is the model's params tree without ``stage_key``.
      stage_fn: ``stage_fn(stage_params, x_mb) -> y_mb`` over one virtual stage's ``[layers / (num_stages *
        num_chunks), ...]`` slice of the stacked params; keeps ``x_mb``'s shape and dtype. With
        ``stage_takes_rng=True``: ``stage_fn(stage_params, x_mb, keys) -> y_mb``, ``keys`` a typed key array
        ``[layers / (num_stages * num_chunks)]``, one per layer of the slice (e.g. for dropout; see "Keys").
      head_loss_fn: ``head_loss_fn(params, y_mb, targets_mb) -> (loss, aux)``, like every loss: a float
        scalar mean over the microbatch and a dict of scalars or None (``aux["weight"]`` is summed, other
        entries are weight-averaged). ``params`` as for ``embed_fn``. Runs on the last stage.
      schedule: e.g. ``jp.pipeline.one_f_one_b(num_stages, num_microbatches)``, ``interleaved_1f1b``,
        ``zero_bubble``, ``zero_bubble_v``; ``num_stages`` must be the mesh's ``pipe`` size.
      stage_key: the params entry holding the stacked ``[layers, ...]`` stage params.
      inputs_key, targets_key: the batch entries given to ``embed_fn`` and ``head_loss_fn``.
      stash: ``'residuals'`` or ``'inputs'`` (see :func:`jaxpar.pipeline.value_and_grad`).
      params_layout: ``'auto'`` (default: the layout the state records, ``TrainState.layout``: the stage
        layout for a state from ``jp.train.init_state(..., pipeline=self)``, else model order, converted
        inside every step), ``'stage'`` (the same, but a model-order state is refused: no weight may cross
        ``pipe`` in a step) or ``'model'`` (a staged state is refused). All three are the same for one chunk
        per stage, whose stage layout is the model order. (Before the state recorded its layout, ``'stage'``
        meant params staged by hand through :meth:`to_stage_layout`; such a state does not say its layout, so
        checkpoints and evaluation took it for model order: it is refused, build it with ``pipeline=``.)
      stage_takes_rng: whether ``stage_fn`` takes the layer keys (default False: ``stage_fn(params, x_mb)`` and
        the step's ``rng`` is not used).
      fsdp_gather: with ``fsdp > 1`` (and ``pipe > 1``), when a stage's weights are all-gathered over ``fsdp``:
        ``'step'`` (default) once per step, before the tick loop, kept for all microbatches (the weights of the
        device's own layers, unsharded, stay in memory for the step; least traffic: as MaxText's
        ``pipeline_fsdp_ag_once``), or ``'action'``: inside every F, B and W (``2m``-``3m`` gathers of each
        weight per step, the unsharded weights live only during an action). Either way the stage gradient is
        accumulated unsharded in float32 over the microbatches (4 bytes per parameter of the device's layers)
        and reduce-scattered over ``fsdp`` once per step. The default: that accumulator already holds the
        unsharded stage in float32, so keeping the weights too adds at most as much again (the compute dtype's
        bytes per parameter), while gathering per action multiplies the all-gather traffic by ``2m`` to ``3m``.
        See :func:`jaxpar.pipeline.value_and_grad` ("Communication").
      grad_reduce: with more than one stage and a batch axis (``data``, ``fsdp``) of size > 1, where the
        data-parallel gradient is reduced: ``'step'`` (default): the interpreter's ``shard_map`` is manual over the
        batch axes too, each device accumulates its stage's gradient over the microbatches and it is reduced once
        after the tick loop (least traffic); ``'action'``: the ``shard_map`` is manual over ``pipe`` only and GSPMD
        reduces the gradient inside every backward action, once per microbatch (``m`` times the traffic: a
        baseline for ``benchmarks/pipeline_comm.py``). A stage function that takes an rng always runs the
        ``'action'`` path (its dropout masks are drawn over the global microbatch); a mesh with ``context > 1``
        needs ``'step'`` (ValueError when the step is traced).

    The loss is the mean of the microbatch losses (microbatches have equal size). The GPT's parts:
    ``Pipeline(model.embed, model.stage, model.head_loss, schedule)``.

    Keys (``stage_takes_rng=True``). With the step's key ``rng`` (``fold_in(state.rng, step)``, and under
    ``grad_accum_steps`` the accumulation batch's ``fold_in`` of it), microbatch ``j`` (rows ``j, j+m, ...``)
    has the key ``k_j = fold_in(rng, j)``, which is what ``jp.grads.accumulate`` gives its microbatch ``j``
    (``make_train_step(loss_fn, tx, grad_accum_steps=m)`` on the same rows), and layer ``l`` (row ``l`` of
    ``params[stage_key]`` in model order, whatever the schedule, stage layout or ``pipe`` size) runs on it with
    ``fold_in(k_j, l)``: the virtual stage ``vs`` running layers ``vs*R .. vs*R + R - 1`` (``R = layers /
    (num_stages * num_chunks)``) gets ``keys = [fold_in(k_j, vs*R + r) for r in range(R)]``. So the pipelined
    step equals the accumulating step of the sequential ``loss_fn(params, batch, key)`` that runs
    ``stage_fn(params[stage_key], x, [fold_in(key, l) for l in range(layers)])`` on the whole stack. A
    microbatch's B and W rebuild its pullback with the keys of its F (same masks); the eval step
    (:meth:`eval_loss`) uses the same keys.
    """
    embed_fn: Callable
    stage_fn: Callable
    head_loss_fn: Callable
    schedule: Schedule
    stage_key: str = "blocks"
    inputs_key: str = "inputs"
    targets_key: str = "targets"
    stash: str = "residuals"
    params_layout: str = "auto"
    stage_takes_rng: bool = False
    fsdp_gather: str = "step"
    grad_reduce: str = "step"
    uses_pipe = True

    def __post_init__(self):
        for name in ("embed_fn", "stage_fn", "head_loss_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Pipeline.{name} must be callable, got {getattr(self, name)!r}")
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"Pipeline.schedule must be a jp.pipeline.Schedule, got {type(self.schedule).__name__}")
        if not self.schedule.has_backward:
            raise ValueError(f"Pipeline.schedule {self.schedule.name!r} is forward-only; training needs gpipe or "
                             "one_f_one_b (or interleaved_1f1b, zero_bubble, zero_bubble_v)")
        if self.stash not in STASH_MODES:
            raise ValueError(f"Pipeline.stash={self.stash!r}; use one of {STASH_MODES}")
        if self.params_layout not in ("auto", "model", "stage"):
            raise ValueError(f"Pipeline.params_layout={self.params_layout!r}; use 'auto' (the state's layout), "
                             "'stage' (a state from jp.train.init_state(..., pipeline=pipeline)) or 'model'")
        if not isinstance(self.stage_takes_rng, bool):
            raise TypeError(f"Pipeline.stage_takes_rng={self.stage_takes_rng!r} must be a bool: True when stage_fn is "
                            "stage_fn(params, x_mb, keys)")
        check_comm_options(self.fsdp_gather, self.grad_reduce, "Pipeline.")

    def state_layout(self, tx: Any, param_shapes: Any, opt_shapes: Any, mesh: Any) -> Any:
        """The opaque stage layout ``jp.train.init_state(..., pipeline=self)`` keeps in ``TrainState.layout``:
        :func:`jaxpar.train.state_layout.state_layout` of this schedule's stage order (None for model order)."""
        return state_layout(self.stage_key, stage_order(self.schedule), tx, param_shapes, opt_shapes, mesh)

    def to_stage_layout(self, params: Any) -> Any:
        """``params`` with ``params[stage_key]`` put in the schedule's stage layout (boxed Flax params too). A
        training state is put in it by ``jp.train.init_state(..., pipeline=pipeline)``, which records it."""
        return {**params, self.stage_key: to_stage_layout(params[self.stage_key], self.schedule)}

    def from_stage_layout(self, params: Any) -> Any:
        """The inverse of :meth:`to_stage_layout`: ``params[stage_key]`` back in model order."""
        return {**params, self.stage_key: from_stage_layout(params[self.stage_key], self.schedule)}

    @property
    def microbatches(self) -> int:
        return self.schedule.num_microbatches

    def check_mesh(self, mesh) -> None:
        """Raises TypeError/ValueError unless the mesh's ``pipe`` size is ``schedule.num_stages`` (and the other
        mesh/schedule checks of :func:`jaxpar.pipeline.value_and_grad`)."""
        check_mesh_and_schedule(self.schedule, mesh, self.stash)

    # ------------------------------------------------------------------------------------------- checks
    def check_step(self, state: Any, grad_fn: Any, mesh: Any) -> None:
        """Raises ValueError (the step calls it before tracing) for state the stages do not carry
        (:meth:`check_carried` of what ``state`` holds)."""
        held = () if state.carried is None else carry.declarations_in(state.carried)
        self.check_carried(model_state=bool(jax.tree.leaves(state.model_state)),
                           carried=" and ".join(d.what for d in held), staged=state.layout is not None)

    @staticmethod
    def check_carried(*, model_state: bool = False, carried: str = "", staged: bool = False) -> None:
        """Raises ValueError for state a pipeline's stages do not carry, described by what it holds (so an entry
        point can check its flags before building anything): ``model_state``: non-param variables (batch
        statistics); ``carried``: what the state's carried collections are, e.g. ``"fp8 meta state"`` ("" for
        none: :mod:`jaxpar.train.carried`); ``staged``: params in a multi-chunk stage layout
        (``jp.train.init_state(..., pipeline=)`` with a schedule of several chunks per stage). Refused: a model
        state; carried state with a multi-chunk stage layout (its leaves under the stage params would need the
        stage layout's permutation too)."""
        if model_state:
            raise ValueError("this state has a model state (batch statistics or other non-param variables), which "
                             "the pipeline does not carry between stages yet: train it without pipe, or keep the "
                             "statistics out of the pipelined model (e.g. LayerNorm instead of BatchNorm)")
        if carried and staged:
            raise ValueError(f"this state carries {carried} and has a multi-chunk stage layout, which the pipeline "
                             "does not carry yet: use a one-chunk schedule (gpipe, 1f1b, zb), or train without that "
                             "state")

    def _params_staged(self, ctx: gr.Context) -> bool:
        """Whether ``params[stage_key]`` comes in the stage layout (``ctx.layout``, the state's); ValueError for
        a state in another schedule's layout or one ``params_layout`` refuses."""
        layout, order = ctx.layout, stage_order(self.schedule)
        if layout is not None and (layout.stage_key != self.stage_key or tuple(layout.order) != order):
            raise ValueError(f"the state is in the stage layout of another pipeline (stage_key={layout.stage_key!r}, "
                             f"virtual stage order {layout.order}); this one ({self.schedule.name!r}, stage_key="
                             f"{self.stage_key!r}) needs order {order}: restore a checkpoint into "
                             "jp.train.abstract_state(..., pipeline=this_pipeline) (checkpoints are in model order), "
                             "or convert with jp.train.to_model_order(state)")
        if layout is not None and self.params_layout == "model":
            raise ValueError("Pipeline(params_layout='model') got a state in its stage layout (state.layout is set); "
                             "use params_layout='auto', or jp.train.to_model_order(state)")
        if layout is None and self.params_layout == "stage" and order != tuple(range(len(order))):
            raise ValueError(f"Pipeline(params_layout='stage') got a state in model order (state.layout is None), which "
                             f"the {self.schedule.name!r} step would permute over pipe every step: build it with "
                             "jp.train.init_state(..., pipeline=pipeline) (or restore into abstract_state(..., "
                             "pipeline=pipeline)); a state staged by hand through Pipeline.to_stage_layout does not "
                             "record its layout")
        return layout is not None
    def check(self, params: Any, batch: Any, ctx: gr.Context) -> None:
        """Raises ValueError (before tracing) for params or a batch the pipeline cannot run; TypeError for
        inputs ``embed_fn`` cannot index with because they are not integers (float token ids).

        Checked: ``params`` is a dict holding ``stage_key`` whose every leaf has a leading layers axis
        divisible by ``num_stages``; ``batch`` holds ``inputs_key`` and ``targets_key`` and no packed documents'
        entries (``segment_ids``, ``positions``, ``loss_mask``: not carried through the stages yet); the stage function
        keeps the embedded activation's shape and dtype; ``head_loss_fn`` returns ``(loss, aux)``.
        """
        if not isinstance(params, dict) or self.stage_key not in params:
            have = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"Pipeline.stage_key={self.stage_key!r} is not an entry of the params ({have}); "
                             "name the entry that holds the stacked [layers, ...] stage params")
        self._params_staged(ctx)
        stages, rest = _split_params(params, self.stage_key)
        p, n = self.schedule.num_stages, self.schedule.num_virtual_stages
        what = f"num_stages = {p}" if n == p else f"num_stages * num_chunks = {n}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(stages)[0]:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % n:
                raise ValueError(
                    f"params[{self.stage_key!r}]{key_path(path, indexing=True)} has shape {np.shape(leaf)}: its layers "
                    f"axis is not divisible by {what}; use a number of layers that is a multiple of {n}, "
                    f"or another pipe size")
        for k in (self.inputs_key, self.targets_key):
            if not isinstance(batch, dict) or k not in batch:
                raise ValueError(f"the batch has no {k!r} entry (Pipeline.inputs_key / targets_key name the "
                                 f"entries given to embed_fn and head_loss_fn)")
        packed = sorted(set(batch) & set(PACKED_KEYS))
        if packed:
            raise ValueError(f"the batch holds packed documents' entries {packed}, which the pipeline does not carry "
                             "yet (its stages take the activations only, so attention would cross documents): train "
                             "packed batches without a pipeline (pipe=1), or unpacked batches with it")
        self._check_shapes(stages, rest, batch, ctx)

    def _check_shapes(self, stages: Any, rest: Any, batch: Any, ctx: gr.Context) -> None:
        n, m = self.schedule.num_virtual_stages, self.schedule.num_microbatches
        structs = lambda t: jax.tree.map(struct, t)
        if ctx.policy is not None:
            rest, stages = ctx.policy.cast_to_compute(structs(rest)), ctx.policy.cast_to_compute(structs(stages))
        staged = jax.tree.map(lambda a: struct(a, (n, np.shape(a)[0] // n, *np.shape(a)[1:])), stages)
        mb = lambda a: struct(a, (np.shape(a)[0] // m, *np.shape(a)[1:]))
        with shd.use(ctx.mesh, ctx.rules):
            x = self._embed_shape(structs(rest), batch[self.inputs_key])
            y = check_stage_fn(self._checked_stage_fn(staged), staged, x, m)
            jax.eval_shape(_checked_head_loss(self.head_loss_fn), structs(rest), y,
                           jax.tree.map(mb, batch[self.targets_key]))

    def _embed_shape(self, rest: Any, inputs: Any) -> Any:
        """``embed_fn``'s output shape; an embedding that fails because it indexes with non-integer inputs (float
        token ids) is a TypeError naming their dtype."""
        try:
            return jax.eval_shape(self.embed_fn, rest, inputs)
        except (TypeError, ValueError) as e:
            dtypes = sorted({jnp.result_type(a).name for a in jax.tree.leaves(inputs)})
            if "integer" not in str(e) or all(jnp.issubdtype(d, jnp.integer) for d in dtypes):
                raise
            raise TypeError(f"batch[{self.inputs_key!r}] has dtype {', '.join(dtypes)}, which embed_fn cannot index "
                            f"with: token ids must be integers; pass them as int32 (e.g. batch[{self.inputs_key!r}]"
                            f".astype(np.int32)), not floats (embed_fn raised: {e})") from e

    def _checked_stage_fn(self, staged: Any) -> Callable:
        """``stage_fn`` as ``(params, x) -> y`` for the shape checks (with abstract layer keys if it takes them)."""
        if not self.stage_takes_rng:
            return self.stage_fn
        rows = np.shape(jax.tree.leaves(staged)[0])[1]
        return lambda params, x: self.stage_fn(params, x, jax.random.split(jax.random.key(0), rows))

    # ------------------------------------------------------------------------------------------ compute
    def __call__(self, params: Any, batch: Any, rng: jax.Array, scale: jax.Array,
                 ctx: gr.Context) -> tuple[jax.Array, dict, Any]:
        """``(loss, aux, grads)`` of one (accumulation) batch, traced inside the train step under the mesh.

        ``grads`` has ``params``' structure and dtypes and is the gradient of ``scale * loss`` (``scale``: the
        float32 loss scale; ``loss`` is unscaled); ``aux`` holds scalars (``weight`` summed).
        """
        staged, rest = self._staged(params, ctx)
        batch = shard_sequence(batch, (self.inputs_key, self.targets_key))   # context > 1: the zigzag layout
        x, embed_vjp = jax.vjp(lambda r: self.embed_fn(r, batch[self.inputs_key]), rest)
        core = value_and_grad_core(self.stage_fn, _checked_head_loss(self.head_loss_fn), self.schedule,
                                   ctx.mesh, ctx.batch_axes, self.stash, True, self.stage_takes_rng,
                                   self.fsdp_gather, self.grad_reduce)
        (loss, (g_staged, g_head, g_x)), aux = core(staged, rest, x, batch[self.targets_key], scale,
                                                    rng if self.stage_takes_rng else None, self._stage_specs(ctx))
        (g_embed,) = embed_vjp(g_x)
        g_rest = jax.tree.map(jnp.add, g_embed, g_head)       # tied weights: both uses add up
        g_stages = jax.tree.map(_from_stages, g_staged)
        if not self._params_staged(ctx):
            g_stages = from_stage_layout(g_stages, self.schedule)
        grads = {k: g_stages if k == self.stage_key else g_rest[k] for k in params}
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return loss, gr.reduce_aux(aux), grads

    def _stage_specs(self, ctx: gr.Context) -> Any:
        """The state's ``PartitionSpec``\\ s of ``params[stage_key]`` (``ctx.param_specs``) for the ``[V, layers /
        V, ...]`` blocks the interpreter runs (a leading chunk dim added), or None when the step gave none."""
        specs = None if ctx.param_specs is None else ctx.param_specs.get(self.stage_key)
        if specs is None:
            return None
        return jax.tree.map(lambda s: P(None, *(s or ())), specs, is_leaf=lambda s: isinstance(s, P) or s is None)

    def model_check_batch(self):
        """The model's ``check_batch`` when ``embed_fn`` is a bound method of a model that has one (the
        protocol; :meth:`from_model`), else None: what the step builders run on host batches by default."""
        return protocol.batch_checker(self.embed_fn)

    @classmethod
    def from_model(cls, model: Any, schedule: Schedule, **kwargs: Any) -> "Pipeline":
        """``Pipeline(model.embed, model.stage, model.head_loss, schedule, stage_key=model.stage_key, **kwargs)``
        for a model of the protocol (:mod:`jaxpar.protocol`; ``stage_key`` defaults to ``"blocks"``).

        Raises:
          TypeError: the model lacks ``embed``, ``stage`` or ``head_loss`` (the part is named); the
            dataclass' own checks (a bad schedule or option).
        """
        protocol.require(model, ("embed", "stage", "head_loss"), "a pipeline")
        kwargs.setdefault("stage_key", protocol.stage_key(model))
        return cls(model.embed, model.stage, model.head_loss, schedule, **kwargs)

    def _staged(self, params: Any, ctx: gr.Context) -> tuple[Any, Any]:
        """``(stage params as [V, layers / V, ...] in stage layout, the other params)``, cast by the policy."""
        compute_params = params if ctx.policy is None else ctx.policy.cast_to_compute(params)
        stages, rest = _split_params(compute_params, self.stage_key)
        if not self._params_staged(ctx):
            stages = to_stage_layout(stages, self.schedule)
        return jax.tree.map(lambda a: _to_stages(a, self.schedule.num_virtual_stages), stages), rest

    def eval_loss(self, params: Any, batch: Any, rng: jax.Array, ctx: gr.Context) -> tuple[jax.Array, dict]:
        """``(loss, aux)`` of a batch through the pipeline's forward-only table (``jp.train.make_eval_step``).

        Traced inside the step under ``ctx.mesh``: ``embed_fn``, then the schedule's forward-only table
        (:meth:`Schedule.forward_only`, the interpreter of :func:`jaxpar.pipeline.apply`; with
        ``stage_takes_rng`` the keys of the train step, see "Keys"), then ``head_loss_fn`` on each of the ``m``
        microbatches (``lax.map``: one microbatch's logits at a time). The loss is the mean of the microbatch
        losses and ``aux`` is reduced as in training (``weight`` summed, the rest weight-averaged), so the
        eval loss equals the train step's loss at the same params. ``params`` in the layout ``ctx.layout`` says.
        """
        staged, rest = self._staged(params, ctx)
        batch = shard_sequence(batch, (self.inputs_key, self.targets_key))
        x = self.embed_fn(rest, batch[self.inputs_key])
        core = apply_core(self.stage_fn, self.schedule, ctx.mesh, ctx.batch_axes, self.stage_takes_rng)
        y = core(staged, x, rng if self.stage_takes_rng else None)
        m, axes = self.schedule.num_microbatches, ctx.batch_axes
        y_micro = gr.split_microbatches(y, m, axes)
        t_micro = jax.tree.map(lambda t: gr.split_microbatches(t, m, axes), batch[self.targets_key])
        head = _checked_head_loss(self.head_loss_fn)

        def one(j):
            loss, aux = head(rest, gr.microbatch(y_micro, j), jax.tree.map(lambda t: gr.microbatch(t, j), t_micro))
            return loss.astype(jnp.float32), aux
        loss_m, aux_m = jax.lax.map(one, jnp.arange(m))
        return loss_m.mean(), gr.reduce_aux(aux_m)
