"""Sparsity schedules: the target sparsity and the mask-refresh steps as pure functions of the step.

A schedule is a frozen dataclass of Python numbers; ``schedule(step)`` and ``schedule.refresh(step)`` take an
int32 step (a traced array under ``jit``), so one compiled training step serves every step: nothing about the
step is static.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from jaxpar._validate import nonnegative_int, positive_int


def _check_sparsity(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name}={value!r} must be a sparsity in [0, 1) (the fraction of weights set to zero; "
                         "1 would remove every weight)")


@dataclasses.dataclass(frozen=True)
class SparsitySchedule:
    """Target sparsity ``s_t`` and mask-refresh steps (Zhu & Gupta 2017, "To prune or not to prune", eq. 1).

    ``s_t = final + (initial - final) * (1 - (t - begin_step) / (end_step - begin_step)) ** power`` for
    ``begin_step <= t <= end_step``, ``final`` after ``end_step`` and ``0`` before ``begin_step`` (nothing is
    pruned yet). Masks are recomputed at ``t`` when ``begin_step <= t <= end_step`` and ``t - begin_step`` is a
    multiple of ``frequency``, and also at ``t == end_step`` so the final sparsity is always reached.
    ``end_step=None`` (constant schedules only) refreshes forever.

    Use :func:`polynomial_sparsity`, :func:`constant_sparsity` or :func:`one_shot` to build one.

    Attributes:
      initial: sparsity at ``begin_step``, in [0, 1).
      final: sparsity from ``end_step`` on, in [0, 1).
      begin_step: first step (int >= 0) at which masks are computed.
      end_step: last refresh step (int >= begin_step), or None to refresh every ``frequency`` steps forever.
      power: exponent of the polynomial ramp (3 in Zhu & Gupta).
      frequency: steps between mask refreshes (``Delta t`` in Zhu & Gupta), int >= 1.
    """
    initial: float
    final: float
    begin_step: int
    end_step: int | None
    power: float = 3.0
    frequency: int = 1

    def __post_init__(self):
        _check_sparsity("initial", self.initial)
        _check_sparsity("final", self.final)
        nonnegative_int("begin_step", self.begin_step)
        if self.end_step is not None:
            nonnegative_int("end_step", self.end_step)
            if self.end_step < self.begin_step:
                raise ValueError(f"end_step={self.end_step} is before begin_step={self.begin_step}; "
                                 "give end_step >= begin_step")
        positive_int("frequency", self.frequency)
        if isinstance(self.power, bool) or not isinstance(self.power, numbers.Real) or not self.power > 0:
            raise ValueError(f"power={self.power!r} must be a positive number (Zhu & Gupta use 3)")

    @property
    def max_sparsity(self) -> float:
        """The largest sparsity the schedule ever asks for."""
        return max(float(self.initial), float(self.final))

    def __call__(self, step: jax.Array | int) -> jax.Array:
        """The target sparsity at ``step``: a float32 scalar (0 before ``begin_step``)."""
        step = jnp.asarray(step, jnp.int32)
        if self.end_step is None or self.end_step == self.begin_step:
            ramp = jnp.asarray(self.final, jnp.float32)
        else:
            frac = (step - self.begin_step).astype(jnp.float32) / float(self.end_step - self.begin_step)
            frac = jnp.clip(frac, 0.0, 1.0)
            ramp = self.final + (self.initial - self.final) * (1.0 - frac) ** self.power
        return jnp.where(step < self.begin_step, 0.0, ramp).astype(jnp.float32)

    def refresh(self, step: jax.Array | int) -> jax.Array:
        """Whether masks are recomputed at ``step``: a bool scalar."""
        step = jnp.asarray(step, jnp.int32)
        since = step - self.begin_step
        on_grid = (since >= 0) & (since % self.frequency == 0)
        if self.end_step is None:
            return on_grid
        return (on_grid & (step <= self.end_step)) | (step == self.end_step)


def polynomial_sparsity(final: float, begin_step: int, end_step: int, initial: float = 0.0, power: float = 3,
                        frequency: int = 1) -> SparsitySchedule:
    """Gradual pruning (Zhu & Gupta 2017, eq. 1): ``initial`` at ``begin_step`` to ``final`` at ``end_step``.

    Masks refresh every ``frequency`` steps from ``begin_step`` and at ``end_step``; after ``end_step`` they
    stay fixed. Raises ValueError for sparsities outside [0, 1), ``initial > final``, negative or non-int
    steps, ``end_step <= begin_step``, ``frequency < 1`` or ``power <= 0``.
    """
    nonnegative_int("begin_step", begin_step)
    nonnegative_int("end_step", end_step)
    if end_step <= begin_step:
        raise ValueError(f"end_step={end_step} must be after begin_step={begin_step} for a gradual schedule; "
                         "use one_shot(sparsity, step) to prune at a single step")
    _check_sparsity("initial", initial)
    _check_sparsity("final", final)
    if initial > final:
        raise ValueError(f"initial={initial} is above final={final}; gradual pruning raises the sparsity")
    return SparsitySchedule(float(initial), float(final), int(begin_step), int(end_step), power, int(frequency))


def constant_sparsity(sparsity: float, begin_step: int = 0, end_step: int | None = None,
                      frequency: int = 100) -> SparsitySchedule:
    """``sparsity`` from ``begin_step`` on; masks refresh every ``frequency`` steps (until ``end_step`` if given).

    As TF Model Optimization's ``ConstantSparsity``. Raises ValueError as :class:`SparsitySchedule` does.
    """
    _check_sparsity("sparsity", sparsity)
    return SparsitySchedule(float(sparsity), float(sparsity), begin_step, end_step, 1.0, frequency)


def one_shot(sparsity: float, step: int = 0) -> SparsitySchedule:
    """Prunes to ``sparsity`` once, at ``step``; the masks then stay fixed (train-prune-fine-tune, as NVIDIA ASP)."""
    _check_sparsity("sparsity", sparsity)
    return SparsitySchedule(float(sparsity), float(sparsity), step, step, 1.0, 1)


def as_schedule(sparsity) -> SparsitySchedule:
    """A schedule as given, or a plain number as :func:`constant_sparsity` from step 0.

    Raises:
      ValueError: a number outside [0, 1).
      TypeError: anything else.
    """
    if isinstance(sparsity, SparsitySchedule):
        return sparsity
    if isinstance(sparsity, numbers.Real) and not isinstance(sparsity, bool):
        _check_sparsity("sparsity", sparsity)
        return constant_sparsity(float(sparsity))
    raise TypeError(f"sparsity={sparsity!r} must be a number in [0, 1) or a schedule from "
                    "jp.pruning.polynomial_sparsity / constant_sparsity / one_shot")
