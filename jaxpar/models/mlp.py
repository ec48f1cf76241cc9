"""An MLP classifier whose layers alternate Megatron column/row splits.

Hidden layer ``i`` has kernel axes ``('embed', 'mlp')`` for even ``i`` and ``('mlp', 'embed')`` for odd ``i``,
so under tensor parallelism a column-split layer feeds a row-split one (Shoeybi et al. 2019, sec. 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxpar.sharding import constrain


class MLP(nn.Module):
    """``x_BF -> logits_BC``: ReLU hidden layers then a linear classifier head.

    Attributes:
      hidden: widths of the hidden layers.
      num_classes: number of output classes C.
      dtype: compute dtype (always passed explicitly).
      param_dtype: parameter storage dtype.
    """
    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def prune_groups(self) -> dict[str, list[tuple[str, str]]]:
        """The chains across layers for ``jp.pruning.structured_pruning(..., groups=...)``: hidden layer ``i``
        (even ``i``) has its outputs named ``mlp`` and the next layer (``dense_{i+1}`` or ``head``) reads them, so
        a neuron is a column of ``dense_i`` (with its bias) and a row of the next kernel. Odd layers' outputs are
        named ``embed`` and are never pruned."""
        names = [f"dense_{i}" for i in range(len(self.hidden))] + ["head"]
        return {"mlp": [(names[i], names[i + 1]) for i in range(0, len(self.hidden), 2)]}

    @nn.compact
    def __call__(self, x_BF: jax.Array) -> jax.Array:
        x = x_BF.astype(self.dtype)
        names = [("embed", "mlp"), ("mlp", "embed")]
        for i, width in enumerate(self.hidden):
            axes = names[i % 2]
            x = nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype,
                         kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                         bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
                         name=f"dense_{i}")(x)
            x = constrain(nn.relu(x), "batch", axes[1])
        last = names[len(self.hidden) % 2][0]
        logits = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                          kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (last, None)),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                          name="head")(x)
        return logits.astype(jnp.float32)


def classification_loss(model: MLP):
    """``loss_fn(params, batch, rng) -> (mean cross-entropy in nats, {"accuracy", "weight"})``.

    ``batch = {"x": float [B, F], "y": int [B]}``.
    """
    def loss_fn(params, batch, rng):
        del rng
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        acc = (logits.argmax(-1) == batch["y"]).mean()
        return loss, {"accuracy": acc, "weight": jnp.asarray(batch["y"].shape[0], jnp.float32)}
    return loss_fn
