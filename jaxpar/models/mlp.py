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

from jaxpar.sharding import names as logical   # (its MLP constant would shadow the model class here)
from jaxpar.sharding.rules import constrain


class MLP(nn.Module):
    """``x_BI -> logits_BC``: ReLU hidden layers then a linear classifier head (I input features, C classes).

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

    def as_model(self, params: Any = None) -> "MLPModel":
        """The protocol model of this MLP (:mod:`jaxpar.protocol`); ``params`` (its params, boxed or not)
        give the input width ``I``, which the module itself does not hold.

        Raises:
          ValueError: no params, or params without ``dense_0/kernel`` (not this MLP's).
        """
        try:
            features = int(nn.meta.unbox(params)["dense_0"]["kernel"].shape[0])
        except (KeyError, TypeError, IndexError, AttributeError):
            raise ValueError("the MLP's model needs its params (no dense_0/kernel found) to know the input width: "
                             "pass the params the MLP built") from None
        return MLPModel(self, features)

    @nn.compact
    def __call__(self, x_BI: jax.Array) -> jax.Array:
        x = x_BI.astype(self.dtype)
        names = [(logical.EMBED, logical.MLP), (logical.MLP, logical.EMBED)]
        for i, width in enumerate(self.hidden):
            axes = names[i % 2]
            x = nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype,
                         kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                         bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
                         name=f"dense_{i}")(x)
            x = constrain(nn.relu(x), logical.BATCH, axes[1])
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
    loss_fn.shards_activations = True   # the model protocol's declaration: each hidden layer constrains its batch
    return loss_fn


class MLPModel:
    """An :class:`MLP` with its input width: the model protocol's parts (``init``, ``apply``, ``loss``,
    ``prune_groups``, ``replace``) over the Linen module.

    Attributes:
      mlp: the module (its config).
      features: the input width ``I``.
    """
    shards_activations = True   # each hidden layer constrains its output's batch dimension (the model protocol)

    def __init__(self, mlp: MLP, features: int):
        self.mlp, self.features = mlp, features

    def init(self, rng: jax.Array) -> Any:
        """Flax-boxed params (logical names), for inputs ``[B, features]``."""
        return self.mlp.init(rng, jnp.zeros((1, self.features), jnp.float32))["params"]

    def apply(self, params: Any, x_BI: jax.Array) -> jax.Array:
        return self.mlp.apply({"params": params}, x_BI)

    def loss(self, params: Any, batch: dict, rng: jax.Array | None = None):
        return classification_loss(self.mlp)(params, batch, rng)

    def prune_groups(self) -> dict[str, list[tuple[str, str]]]:
        return self.mlp.prune_groups()

    def replace(self, sizes: dict[tuple, int]) -> MLP:
        """The MLP with the compacted hidden widths: ``sizes`` maps ``(dense_i, "mlp")`` to layer ``i``'s count.

        Raises:
          ValueError: a key that is not one of :meth:`prune_groups`' chains.
        """
        hidden = list(self.mlp.hidden)
        index = {(chain[0], axis): int(chain[0].split("_")[-1])
                 for axis, chains in self.prune_groups().items() for chain in chains}
        for key, size in sizes.items():
            if tuple(key) not in index:
                raise ValueError(f"the MLP's prunable groups are {sorted('/'.join(k) for k in index)}; got "
                                 f"{'/'.join(key)}")
            hidden[index[tuple(key)]] = size
        return self.mlp.clone(hidden=tuple(hidden))
