"""Training: the state, the jitted step on a mesh, gradients and accumulation, the loop, checkpoints, optimizers.

* :mod:`jaxpar.train.step`: ``TrainState``, ``init_state`` / ``abstract_state``, ``make_train_step``,
  ``make_eval_step``.
* :mod:`jaxpar.train.grads`: gradient functions (``GradFn``), loss functions, microbatch accumulation.
* :mod:`jaxpar.train.model_init`: what a model's init gives a state; :mod:`jaxpar.train.nnx_bridge`: NNX modules.
* :mod:`jaxpar.train.carried`: state the step carries beside the params (fp8 scales, counters), combined as declared.
* :mod:`jaxpar.train.loop`: the training loop, evaluation, preemption; :mod:`jaxpar.train.checkpoint`: orbax
  checkpoints restored onto any mesh; :mod:`jaxpar.train.optim`: AdamW with decay by what a leaf is.
"""

from jaxpar.train import carried, checkpoint, grads, loop, optim
from jaxpar.train.step import (TrainState, abstract_state, init_state, make_eval_step, make_train_step, shard_batch,
                               to_model_order)

__all__ = ["TrainState", "abstract_state", "carried", "checkpoint", "grads", "init_state", "loop", "make_eval_step",
           "make_train_step", "optim", "shard_batch", "to_model_order"]

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
