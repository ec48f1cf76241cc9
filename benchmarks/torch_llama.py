"""Hugging Face ``transformers``' ``LlamaForCausalLM`` as the PyTorch side of ``vs_pytorch.py --model llama``.

:func:`build` writes jaxpar's Llama params with ``jaxpar.models.hf.save`` and reads them back with
``LlamaForCausalLM.from_pretrained(dir, attn_implementation="sdpa")`` in float32, so both sides start from the
same weights through the checkpoint mapping the tests check against ``transformers``. The wrapper's
``forward(inputs_BL, targets_BL)`` is the mean token cross-entropy over HF's unpadded vocabulary (jaxpar's padded
logits are ``finfo.min / 2``, so the two losses agree), without HF's own label shift: the targets are given.
"""

from __future__ import annotations

import tempfile

from torch_gpt import torch_module


def build(model, params):
    """``(module, hf_model)``: ``module(inputs, targets) -> loss`` wrapping the ``LlamaForCausalLM`` made from
    ``params`` (an unboxed jaxpar Llama params tree) of ``model`` (a ``jaxpar.models.Llama``)."""
    torch = torch_module()
    from jaxpar._optional import require
    transformers = require("transformers", "vs_pytorch.py --model llama", extra="bench")
    from jaxpar.models import hf

    with tempfile.TemporaryDirectory() as d:
        hf.save(model, params, d)
        ref = transformers.LlamaForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float32)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = ref

        def forward(self, inputs, targets):
            logits = self.hf(input_ids=inputs, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Loss().train(), ref
