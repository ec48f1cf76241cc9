"""Precision: dtype policies (jmp's strings), loss scaling as an optax transform, and fp8 matmuls.

* :mod:`jaxpar.precision.policy`: ``Policy`` (``jp.Policy.from_string("mixed_bf16")``), float32 optimizer state.
* :mod:`jaxpar.precision.scaling`: static and dynamic loss scaling (``loss_scaling``) and its state.
* :mod:`jaxpar.precision.fp8`: fp8 dot_generals with delayed or current scaling, and their meta state.
"""

import jaxpar.precision.policy as _policy
from jaxpar.precision import fp8
from jaxpar.precision.scaling import (DynamicLossScale, LossScaleState, NoOpLossScale, StaticLossScale,
                                      check_outermost, loss_scale, loss_scaling, skipped)
from jaxpar.precision.policy import f32_optimizer_state

__all__ = ["DynamicLossScale", "LossScaleState", "NoOpLossScale", "StaticLossScale", "check_outermost",
           "f32_optimizer_state", "fp8", "loss_scale", "loss_scaling", "skipped"]

Policy = _policy.Policy   # also here, where the error messages point; exported as jp.Policy

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
