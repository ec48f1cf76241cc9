"""``jax.jit`` on a mesh: the one helper every jaxpar step and pipeline function is compiled through.

:class:`MeshJit` traces inside ``jax.set_mesh(mesh)`` and the logical axis rules (Flax's constraints need
both), compiles once per input structure and sharding, checks that inputs live on the devices (and were
not donated to an earlier call), dispatches through :func:`jaxpar.train._dispatch.bounded` (so no loop can queue
enough steps to abort XLA:CPU's collectives), compiles for CPU devices with :data:`CPU_COMPILER_OPTIONS`, and
lowers from abstract inputs: ``jax.ShapeDtypeStruct`` leaves with shardings, as ``jax.jit(...).lower`` does, for
planning and structure tests.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpar.train import _dispatch as dispatch
from jaxpar.sharding import rules as shd


def _check_placed(args: Any, allow_abstract: bool) -> None:
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.ShapeDtypeStruct) and allow_abstract:
            if x.sharding is None:
                raise TypeError("abstract inputs need shardings: jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
                                "(jp.train.abstract_state gives them)")
            continue
        if not isinstance(x, jax.Array):
            raise TypeError(f"expected jax arrays placed on the mesh (from jp.train.init_state or a checkpoint "
                            f"restore){' or jax.ShapeDtypeStruct' if allow_abstract else ''}; got "
                            f"{type(x).__name__}")
    check_live(args)


def check_live(tree: Any) -> None:
    """Raises ValueError when a jax array of ``tree`` was donated (its buffers deleted).

    Call it before handing arrays to a ``jax.jit`` function: jaxlib 0.10's CPU client can crash the process
    (a segmentation fault, not an exception) when a compiled function is called on a donated array.
    """
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree)):
        raise ValueError("this state was donated to an earlier step and its buffers are gone: use the state "
                         "that step returned (state, metrics = step(state, batch)), or build the step with "
                         "donate=False")


# XLA:CPU: YNNPACK for the dots alone, XLA's own loops for reductions (norms, softmax statistics, the loss).
# Measured on the 2-core AMD EPYC VM (jaxlib 0.10.2, benchmarks/README.md, in-process A/B of the same step): Gemma 3's
# train step of benchmarks/vs_pytorch.py 5-6% faster (four norms a layer and q/k norms), Qwen3's 2%, the Llama's
# unchanged; an RMSNorm forward and backward alone 32% less CPU time. The default also fuses reductions (with their
# elementwise producers) into YNNPACK, whose reduce kernels run these shapes slower.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def _cpu_options_accepted() -> bool:
    """Whether this jaxlib's XLA:CPU takes :data:`CPU_COMPILER_OPTIONS` (an experimental flag: a jaxlib without it
    refuses the compile with INVALID_ARGUMENT); one tiny compile, once per process."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(
            jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
        return True
    except Exception:   # noqa: BLE001 - any refusal means: compile with XLA's defaults
        return False


def compiler_options(mesh: Mesh) -> dict[str, str] | None:
    """The compile options of a jaxpar step on ``mesh``: :data:`CPU_COMPILER_OPTIONS` on CPU devices, unless
    ``XLA_FLAGS`` sets the option itself (the user's choice stands) or this jaxlib refuses it; None (XLA's
    defaults) elsewhere."""
    flags = os.environ.get("XLA_FLAGS", "")
    if mesh.devices.flat[0].platform != "cpu" or any(name in flags for name in CPU_COMPILER_OPTIONS):
        return None
    return dict(CPU_COMPILER_OPTIONS) if _cpu_options_accepted() else None


class MeshJit:
    """``fn`` jitted on ``mesh`` with shardings derived from its inputs' shardings.

    Args:
      fn: the traceable function ``fn(*args)``.
      mesh, rules: the mesh and the logical axis rules in context while tracing.
      out_shardings: ``out_shardings(*arg_shardings) -> shardings of fn's outputs`` (each argument's pytree
        of shardings); inputs keep their own shardings.
      donate_argnums: as ``jax.jit``'s.
      track: picks the outputs whose readiness marks a call finished for the bounded dispatch (outputs a
        later call will not donate, e.g. a train step's metrics).
      checked_args: the argument positions that must already be arrays on the devices (the others are placed
        by the caller and only need shardings).
      pass_shardings: call ``fn(arg_shardings, *args)``: the arguments' pytrees of shardings (static, one compile
        per shardings) come first, e.g. for a step that reads its state's ``PartitionSpec``\\ s.
      check_program: ``check_program(jaxpr, *args)``, run once per compiled program on the program traced for
        ``args`` (``jax.jit(...).trace``; the call and ``lower`` reuse that trace) before it runs or lowers:
        where a feature refuses a program it cannot serve (it raises).

    Calls return ``fn``'s outputs asynchronously. ``lower(*args)`` accepts arrays or ``ShapeDtypeStruct``\\ s.
    """

    def __init__(self, fn: Callable, mesh: Mesh, rules: shd.Rules, out_shardings: Callable[..., Any], *,
                 donate_argnums: Sequence[int] = (), track: Callable[[Any], Any] = lambda out: out,
                 checked_args: Sequence[int] = (0,), pass_shardings: bool = False,
                 check_program: Callable[..., None] | None = None):
        self._fn, self._mesh, self._rules, self._out = fn, mesh, rules, out_shardings
        self._check_program, self._programs_checked = check_program, set()
        self._pass = pass_shardings
        self._donate, self._track, self._checked = tuple(donate_argnums), track, tuple(checked_args)
        self._cache: dict = {}

    def _jitted(self, args: tuple, allow_abstract: bool) -> Callable:
        _check_placed(tuple(args[i] for i in self._checked), allow_abstract)
        shardings = tuple(jax.tree.map(lambda x: x.sharding, a) for a in args)
        key = (jax.tree.structure(args), tuple(jax.tree.leaves(shardings)))
        if key not in self._cache:
            fn = functools.partial(self._fn, shardings) if self._pass else self._fn
            self._cache[key] = jax.jit(fn, in_shardings=shardings, out_shardings=self._out(*shardings),
                                       donate_argnums=self._donate, compiler_options=compiler_options(self._mesh))
        if self._check_program is not None and key not in self._programs_checked:
            with shd.use(self._mesh, self._rules):
                traced = self._cache[key].trace(*args)
            self._check_program(traced.jaxpr, *args)
            self._programs_checked.add(key)
        return self._cache[key]

    def __call__(self, *args: Any) -> Any:
        fn = self._jitted(args, allow_abstract=False)

        def call():
            with shd.use(self._mesh, self._rules):
                return fn(*args)
        return dispatch.bounded(self._mesh, call, self._track)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower`` on these arguments (arrays or ``ShapeDtypeStruct`` with shardings)."""
        fn = self._jitted(args, allow_abstract=True)
        with shd.use(self._mesh, self._rules):
            return fn.lower(*args)
