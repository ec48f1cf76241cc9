"""The jaxpar GPT written in PyTorch, for the benchmarks (``vs_pytorch.py``, ``gpu.py``); torch is imported lazily.

Same architecture as ``jaxpar.models.GPT`` with learned positions and tied embeddings: token + learned position
embedding, ``N`` pre-LN blocks (LayerNorm eps 1e-5; causal attention through
``torch.nn.functional.scaled_dot_product_attention``; a qkv projection without bias, out/up/down with bias; GELU
with the tanh approximation), a final LayerNorm and logits ``h @ embedding.T`` over the padded vocabulary, with the
padded entries set to ``finfo.min / 2`` as jaxpar does. The loss is the mean token cross-entropy.

:func:`load_jaxpar_params` copies a jaxpar params tree into the module (qkv ``[D, H, 3, K]`` becomes the
``[3 * H * K, D]`` Linear weight in ``(3, H, K)`` order), so both start from the same weights and their losses
can be compared step by step. :func:`make_optimizer` is ``jp.optim.adamw``'s recipe in torch: global-norm
clipping, AdamW with weight decay on the four weight matrices only, linear warm-up then cosine decay.
"""

from __future__ import annotations

import math

import numpy as np


def torch_module():
    from jaxpar._optional import require
    return require("torch", "the PyTorch benchmarks", extra="bench")


def build(cfg, device: str = "cpu"):
    """A ``torch.nn.Module`` GPT for a ``jaxpar.models.GPTConfig`` (learned positions, tied embeddings).

    ``module(inputs_BL, targets_BL) -> loss`` (float32 scalar, nats per token); ``module.logits(inputs_BL)``.
    """
    torch = torch_module()
    nn, F = torch.nn, torch.nn.functional
    if cfg.positions != "learned" or not cfg.tie_embeddings:
        raise ValueError("the PyTorch GPT implements learned positions with tied embeddings only")
    D, H, K, Fm, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.padded_vocab

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D, eps=1e-5), nn.LayerNorm(D, eps=1e-5)
            self.qkv = nn.Linear(D, 3 * H * K, bias=False)
            self.out = nn.Linear(H * K, D)
            self.up, self.down = nn.Linear(D, Fm), nn.Linear(Fm, D)

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, H, K).permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, K]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(B, L, H * K))
            return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(V, D)
            self.pos_embedding = nn.Parameter(torch.zeros(cfg.max_seq_len, D))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(D, eps=1e-5)
            self.register_buffer("pad", torch.arange(V) >= cfg.vocab_size, persistent=False)
            _init(self, cfg, nn)

        def logits(self, inputs):
            x = self.embedding(inputs) + self.pos_embedding[: inputs.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.embedding.weight.T
            return logits.masked_fill(self.pad, torch.finfo(logits.dtype).min / 2)

        def forward(self, inputs, targets):
            logits = self.logits(inputs)
            return F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1))

    return GPT().to(device)


def _init(model, cfg, nn) -> None:
    """GPT-2 initialisation as jaxpar's: normal(0.02), out/down normal(0.02 / sqrt(2N)), positions normal(0.01)."""
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, p in model.named_parameters():
        if p.ndim < 2:
            nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
        else:
            std = out_std if name.endswith(("out.weight", "down.weight")) else cfg.init_std
            nn.init.normal_(p, 0.0, cfg.init_std / 2 if name == "pos_embedding" else std)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def load_jaxpar_params(model, params) -> None:
    """Copies an unboxed jaxpar GPT params tree (float32) into ``model`` in place."""
    torch = torch_module()
    t = lambda a: torch.tensor(np.asarray(a, np.float32))
    emb, blocks, head = params["embed"], params["blocks"], params["head"]
    with torch.no_grad():
        model.embedding.weight.copy_(t(emb["embedding"]))
        model.pos_embedding.copy_(t(emb["pos_embedding"]))
        model.ln_f.weight.copy_(t(head["ln_scale"]))
        model.ln_f.bias.copy_(t(head["ln_bias"]))
        for i, b in enumerate(model.blocks):
            p = {k: np.asarray(v[i], np.float32) for k, v in blocks.items()}
            D = p["qkv_kernel"].shape[0]
            b.qkv.weight.copy_(t(p["qkv_kernel"].transpose(2, 1, 3, 0).reshape(-1, D)))  # [D,H,3,K] -> [3HK, D]
            b.out.weight.copy_(t(p["out_kernel"].reshape(-1, D).T))
            b.out.bias.copy_(t(p["out_bias"]))
            b.up.weight.copy_(t(p["up_kernel"].T))
            b.up.bias.copy_(t(p["up_bias"]))
            b.down.weight.copy_(t(p["down_kernel"].T))
            b.down.bias.copy_(t(p["down_bias"]))
            for j in (1, 2):
                getattr(b, f"ln{j}").weight.copy_(t(p[f"ln{j}_scale"]))
                getattr(b, f"ln{j}").bias.copy_(t(p[f"ln{j}_bias"]))


def make_optimizer(model, lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.1,
                   betas=(0.9, 0.95), final_lr_ratio: float = 0.1, decay_prefix: str = "blocks.", **adamw_kwargs):
    """``(optimizer, scheduler)``: AdamW with decay on the 2-D weights under ``decay_prefix`` (the blocks' Linear
    weights; embeddings and the unembedding do not decay, as in ``jp.optim.decay_mask``), the learning rate of
    ``optax.warmup_cosine_decay_schedule``."""
    torch = torch_module()
    decays = lambda n, p: p.ndim == 2 and n.startswith(decay_prefix)
    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    rest = [p for n, p in model.named_parameters() if not decays(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=1e-8, **adamw_kwargs)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        t = min(step - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
        return final_lr_ratio + (1 - final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(model, opt, sched, inputs, targets, clip_norm: float = 1.0, autocast=None):
    """One step: forward, backward, clip, AdamW update, scheduler step; returns the loss tensor (not synced)."""
    torch = torch_module()
    opt.zero_grad(set_to_none=True)
    if autocast is not None:
        with torch.autocast(device_type=autocast[0], dtype=autocast[1]):
            loss = model(inputs, targets)
    else:
        loss = model(inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    opt.step()
    sched.step()
    return loss
