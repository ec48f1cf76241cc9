"""A model given to the train step as three parts (embedding, stacked stages, head and loss), run as a pipeline.

``jp.train.make_train_step(None, tx, mesh=mesh, pipeline=Pipeline(embed_fn, stage_fn, head_loss_fn, schedule))``
trains a model whose params tree holds its stacked layers under one key (``"blocks"`` for the GPT). Each step:

1. the stacked ``[layers, ...]`` leaves are reshaped to ``[num_stages, layers / num_stages, ...]``. With a
   ``pipe`` axis larger than 1 the layers axis is already split over ``pipe`` (``jp.sharding.effective_rules``),
   so stage ``s`` finds layers ``s*L/p .. (s+1)*L/p - 1`` on its own devices and nothing moves;
2. ``x = embed_fn(params, inputs)`` runs before the pipeline (GSPMD over the batch axes, replicated over
   ``pipe``); :func:`jaxpar.pipeline.value_and_grad`'s interpreter runs the stages and the head/loss;
3. the embedding's gradient comes from ``g_x`` through ``jax.vjp(embed_fn)``; it is added to the head's
   gradient of the same tree, so tied weights (the GPT's embedding used as the unembedding) get the sum of
   both uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.pipeline import runtime
from jaxpar.pipeline.schedules import Schedule


def _split_params(params: Any, key: str) -> tuple[Any, Any]:
    return params[key], {k: v for k, v in params.items() if k != key}


def _to_stages(a: jax.Array, p: int) -> jax.Array:
    """``[L, ...] -> [p, L/p, ...]``, stage axis on ``pipe`` (free when the layers axis is already on pipe)."""
    a = a.reshape(p, a.shape[0] // p, *a.shape[1:])
    return jax.lax.with_sharding_constraint(a, P(runtime.AXIS, *([P.UNCONSTRAINED] * (a.ndim - 1))))


def _from_stages(a: jax.Array) -> jax.Array:
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _reduce_aux(aux: dict, num_microbatches: int) -> dict:
    """Per-microbatch aux ``[m]`` -> scalars: ``weight`` summed, the rest weight-averaged (mean without weight)."""
    weight = aux.get("weight")
    out = {}
    for k, v in aux.items():
        v = v.astype(jnp.float32)
        if k == "weight":
            out[k] = v.sum()
        elif weight is not None:
            out[k] = (v * weight).sum() / weight.sum()
        else:
            out[k] = v.sum() / num_microbatches
    return out


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A model as three parts plus a schedule, for ``jp.train.make_train_step(None, tx, pipeline=...)``.

    Attributes:
      embed_fn: ``embed_fn(params, inputs) -> x``, ``x`` of shape ``[B, ...]`` (e.g. ``x_BLD``). ``params``
        is the model's params tree without ``stage_key``.
      stage_fn: ``stage_fn(stage_params, x_mb) -> y_mb`` over one stage's ``[layers / num_stages, ...]`` slice
        of the stacked params; keeps ``x_mb``'s shape and dtype.
      head_loss_fn: ``head_loss_fn(params, y_mb, targets_mb) -> loss`` or ``(loss, aux)``: a float scalar
        mean over the microbatch and a dict of scalars (``aux["weight"]`` is summed, other entries are
        weight-averaged). ``params`` as for ``embed_fn``. Runs on the last stage.
      schedule: e.g. ``jp.pipeline.one_f_one_b(num_stages, num_microbatches)``; ``num_stages`` must be the
        mesh's ``pipe`` size.
      stage_key: the params entry holding the stacked ``[layers, ...]`` stage params.
      inputs_key, targets_key: the batch entries given to ``embed_fn`` and ``head_loss_fn``.
      stash: ``'residuals'`` or ``'inputs'`` (see :func:`jaxpar.pipeline.value_and_grad`).

    The loss is the mean of the microbatch losses (microbatches have equal size); the step's ``rng`` is not
    used (no dropout inside pipelined stages). The GPT gives its parts with ``GPT.pipeline(schedule)``.
    """
    embed_fn: Callable
    stage_fn: Callable
    head_loss_fn: Callable
    schedule: Schedule
    stage_key: str = "blocks"
    inputs_key: str = "inputs"
    targets_key: str = "targets"
    stash: str = "residuals"

    def __post_init__(self):
        for name in ("embed_fn", "stage_fn", "head_loss_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Pipeline.{name} must be callable, got {getattr(self, name)!r}")
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"Pipeline.schedule must be a jp.pipeline.Schedule, got {type(self.schedule).__name__}")
        if not self.schedule.has_backward:
            raise ValueError(f"Pipeline.schedule {self.schedule.name!r} is forward-only; training needs gpipe or "
                             "one_f_one_b")
        if self.stash not in runtime.STASH_MODES:
            raise ValueError(f"Pipeline.stash={self.stash!r}; use one of {runtime.STASH_MODES}")

    def bind(self, *, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES, policy: Any = None,
             grad_accum_steps: int = 1) -> BoundPipeline:
        """The train step's view: ``check(params, batch)`` and ``loss_and_grads(params, batch, rng)``.

        Raises:
          TypeError, ValueError: the mesh's ``pipe`` size is not ``schedule.num_stages`` (and the other
            mesh/schedule checks of :func:`jaxpar.pipeline.value_and_grad`).
        """
        runtime.check_mesh_and_schedule(self.schedule, mesh, self.stash)
        return BoundPipeline(self, mesh, rules, policy, grad_accum_steps)


class BoundPipeline:
    """A :class:`Pipeline` bound to a mesh, rules, policy and accumulation steps (built by ``Pipeline.bind``)."""

    def __init__(self, pipeline: Pipeline, mesh: Mesh, rules: shd.Rules, policy: Any, grad_accum_steps: int):
        self.pipeline, self.mesh, self.rules, self.policy = pipeline, mesh, rules, policy
        self.grad_accum_steps = grad_accum_steps
        self.batch_axes = shd.batch_axes(rules, mesh)
        self._checked: set = set()

    # ------------------------------------------------------------------------------------------- checks
    def check(self, params: Any, batch: Any) -> None:
        """Raises ValueError (before tracing) for params or a batch the pipeline cannot run.

        Checked: ``params`` is a dict holding ``stage_key`` whose every leaf has a leading layers axis
        divisible by ``num_stages``; ``batch`` holds ``inputs_key`` and ``targets_key``; the batch of one
        accumulation step splits into ``num_microbatches`` microbatches that split over ``data*fsdp``; the
        stage function keeps the embedded activation's shape and dtype. Cached per shapes.
        """
        pl = self.pipeline
        key = (jax.tree.structure((params, batch)),
               tuple((np.shape(a), str(jnp.result_type(a))) for a in jax.tree.leaves((params, batch))))
        if key in self._checked:
            return
        if not isinstance(params, dict) or pl.stage_key not in params:
            have = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"Pipeline.stage_key={pl.stage_key!r} is not an entry of the params ({have}); "
                             "name the entry that holds the stacked [layers, ...] stage params")
        stages, rest = _split_params(params, pl.stage_key)
        p = pl.schedule.num_stages
        for path, leaf in jax.tree_util.tree_flatten_with_path(stages)[0]:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % p:
                raise ValueError(
                    f"params[{pl.stage_key!r}]{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}: its layers "
                    f"axis is not divisible by num_stages = {p}; use a number of layers that is a multiple of {p}, "
                    f"or another pipe size")
        for k in (pl.inputs_key, pl.targets_key):
            if not isinstance(batch, dict) or k not in batch:
                raise ValueError(f"the batch has no {k!r} entry (Pipeline.inputs_key / targets_key name the "
                                 f"entries given to embed_fn and head_loss_fn)")
        self._check_shapes(stages, rest, batch)
        self._checked.add(key)

    def _check_shapes(self, stages: Any, rest: Any, batch: Any) -> None:
        pl, n = self.pipeline, self.grad_accum_steps
        p, m = pl.schedule.num_stages, pl.schedule.num_microbatches
        micro = lambda a: runtime._struct(a, (np.shape(a)[0] // n, *np.shape(a)[1:]))
        inputs, targets = jax.tree.map(micro, batch[pl.inputs_key]), jax.tree.map(micro, batch[pl.targets_key])
        try:
            runtime.check_batch(jax.tree.leaves(inputs)[0], targets, m, self.mesh, self.batch_axes)
        except ValueError as e:
            if n == 1:
                raise
            raise ValueError(f"{e} (the batch of one of the grad_accum_steps = {n} accumulation steps)") from None
        structs = lambda t: jax.tree.map(runtime._struct, t)
        if self.policy is not None:
            rest, stages = self.policy.cast_to_compute(structs(rest)), self.policy.cast_to_compute(structs(stages))
        staged = jax.tree.map(lambda a: runtime._struct(a, (p, np.shape(a)[0] // p, *np.shape(a)[1:])), stages)
        with shd.use(self.mesh, self.rules):
            x = jax.eval_shape(pl.embed_fn, structs(rest), inputs)
            runtime.check_stage_fn(pl.stage_fn, staged, x, m)

    # ------------------------------------------------------------------------------------------ compute
    def _has_aux(self, rest, x, targets) -> bool:
        m = self.pipeline.schedule.num_microbatches
        mb = lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype)
        out = jax.eval_shape(self.pipeline.head_loss_fn, rest, mb(x), jax.tree.map(mb, targets))
        return isinstance(out, (tuple, list)) and len(out) == 2

    def loss_and_grads(self, params: Any, batch: Any, rng: jax.Array,
                       scale: jax.Array | None = None) -> tuple[jax.Array, dict, Any]:
        """``(loss, aux, grads)`` of one (accumulation) batch, traced inside the train step under the mesh.

        ``grads`` has ``params``' structure and dtypes and is the gradient of ``scale * loss`` (``scale``: the
        float32 loss scale of mixed-precision training, 1 when None; ``loss`` is unscaled); ``aux`` holds
        scalars (``weight`` summed).
        """
        del rng
        pl, m = self.pipeline, self.pipeline.schedule.num_microbatches
        compute_params = params if self.policy is None else self.policy.cast_to_compute(params)
        stages, rest = _split_params(compute_params, pl.stage_key)
        staged = jax.tree.map(lambda a: _to_stages(a, pl.schedule.num_stages), stages)
        targets = batch[pl.targets_key]
        x, embed_vjp = jax.vjp(lambda r: pl.embed_fn(r, batch[pl.inputs_key]), rest)
        has_aux = self._has_aux(rest, x, targets)
        core = runtime.value_and_grad_core(pl.stage_fn, pl.head_loss_fn, pl.schedule, self.mesh, self.batch_axes,
                                           pl.stash, has_aux)
        (loss, (g_staged, g_head, g_x)), aux = core(staged, rest, x, targets, scale)
        (g_embed,) = embed_vjp(g_x)
        g_rest = jax.tree.map(jnp.add, g_embed, g_head)       # tied weights: both uses add up
        grads = {k: jax.tree.map(_from_stages, g_staged) if k == pl.stage_key else g_rest[k] for k in params}
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return loss, _reduce_aux(aux, m), grads
