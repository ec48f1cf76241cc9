"""Layers any model calls, ours or a user's: causal attention (one kernel, with context parallelism), norms and
activations, rotary positions, the cross-entropy loss, the batch entries of packed documents, and the
mixture-of-experts MLP (:mod:`jaxpar.layers.moe`) with its expert-parallel dispatch
(:mod:`jaxpar.layers.expert_parallel`).

Nothing here imports the model zoo (:mod:`jaxpar.models`).
"""

from jaxpar.layers import attention, expert_parallel, moe
from jaxpar.layers.losses import check_token_ids, cross_entropy
from jaxpar.layers.norms import gelu, layer_norm, rms_norm, silu
from jaxpar.layers.rotary import rope
from jaxpar.layers.per_token import BATCH_KEYS, LM_KEYS, PACKED_KEYS, check_packed_entries, check_packed_shapes, token_names, tokens

__all__ = ["BATCH_KEYS", "LM_KEYS", "PACKED_KEYS", "attention", "check_packed_entries", "check_packed_shapes",
           "check_token_ids", "cross_entropy", "expert_parallel", "gelu", "layer_norm", "moe", "rms_norm", "rope",
           "silu", "token_names", "tokens"]
