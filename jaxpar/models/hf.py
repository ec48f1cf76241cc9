"""Hugging Face checkpoints in and out: ``LlamaForCausalLM`` as :class:`jaxpar.models.Llama`, ``GPT2LMHeadModel``
as :class:`jaxpar.models.GPT` (learned positions, tied embeddings, ``qkv_bias=True``).

A checkpoint is a directory with ``config.json`` and ``model.safetensors``, or sharded
``model-0000i-of-0000n.safetensors`` files with their ``model.safetensors.index.json`` (the layout of
``transformers``' ``save_pretrained``). Weights are read through ``safetensors``' lazy slices: each device's
block of each parameter is read by itself (``jax.make_array_from_callback``), so the whole model never exists
on one device or in host memory at once, and in a multi-process run each process reads only its devices'
slices.

Layouts (HF ``nn.Linear`` weights are ``[out, in]``): ``q_proj [H*K, D] -> q_kernel [D, H, K]``, ``k_proj`` /
``v_proj [G*K, D] -> [D, G, K]``, ``o_proj [D, H*K] -> out_kernel [H, K, D]``, ``gate/up_proj [F, D] -> [D, F]``,
``down_proj [D, F] -> [F, D]``, ``lm_head [V, D] -> head/kernel [D, V]``, layers stacked on a leading axis, the
vocabulary padded with zero rows to ``vocab_multiple``. GPT-2's ``Conv1D`` weights are ``[in, out]`` already:
``c_attn [D, 3*H*K]`` (columns q | k | v) ``-> qkv_kernel [D, H, 3, K]``, ``c_attn.bias -> qkv_bias [H, 3, K]``,
``attn.c_proj [H*K, D] -> out_kernel [H, K, D]``, ``c_fc``/``mlp.c_proj`` as they are. HF's ``q_proj``/``k_proj`` rows are already in the
half-rotation order jaxpar's rotary embedding uses (``transformers``' ``convert_llama_weights_to_hf`` permutes
Meta's interleaved pairs), so they are copied as they are.

Needs the optional ``safetensors`` package (``pip install 'jaxpar[hf]'``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxpar import sharding as shd
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.llama import Llama, LlamaConfig

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("jaxpar.models.hf needs safetensors: pip install 'jaxpar[hf]' (or pip install safetensors)"
                          ) from e
    return safe_open


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory; pass a Hugging Face checkpoint directory (config.json and "
                         "model*.safetensors, as save_pretrained writes)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} has no config.json; it is not a Hugging Face checkpoint directory")
    with open(cfg_path) as f:
        return json.load(f)


def _arch(hf: dict) -> str:
    arch = hf.get("architectures") or []
    if hf.get("model_type") == "llama" or "LlamaForCausalLM" in arch:
        return "llama"
    if hf.get("model_type") == "gpt2" or "GPT2LMHeadModel" in arch:
        return "gpt2"
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, architectures={arch}; "
                     "jaxpar.models.hf loads LlamaForCausalLM and GPT2LMHeadModel checkpoints")


def gpt2_config(hf: dict, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``GPT2LMHeadModel`` ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: features the GPT here lacks (another activation, LayerNorm epsilon, unscaled attention).
    """
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"config.json has activation_function={hf['activation_function']!r}; the GPT's MLP uses "
                         "GELU with the tanh approximation (gelu_new)")
    if abs(float(hf.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise ValueError(f"config.json has layer_norm_epsilon={hf['layer_norm_epsilon']}; the GPT's LayerNorm uses 1e-5")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx") \
            or hf.get("reorder_and_upcast_attn"):
        raise ValueError("config.json changes GPT-2's attention scaling; the GPT scales logits by 1/sqrt(head_dim)")
    kwargs = dict(vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], num_heads=hf["n_head"], d_model=hf["n_embd"],
                  d_mlp=hf.get("n_inner") or 0, max_seq_len=hf["n_positions"], positions="learned",
                  tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qkv_bias=True,
                  init_std=float(hf.get("initializer_range", 0.02)))
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def llama_config(hf: dict, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: a config another architecture wrote, or features the Llama here lacks (biases, another
        activation, a rope type other than Llama 3's).
    """
    if _arch(hf) != "llama":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; llama_config reads a Llama's")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"config.json sets {key}=true; jaxpar's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json has hidden_act={hf['hidden_act']!r}; the Llama's SwiGLU uses silu")
    rope = dict(hf.get("rope_parameters") or {})       # transformers >= 5
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    kwargs = dict(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
                  num_kv_heads=hf.get("num_key_value_heads") or heads, d_model=d, d_mlp=hf["intermediate_size"],
                  head_dim=hf.get("head_dim") or d // heads, max_seq_len=hf.get("max_position_embeddings", 2048),
                  rope_theta=float(theta), rope_scaling=scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  init_std=float(hf.get("initializer_range", 0.02)))
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


class _Reader:
    """Lazy reads of named tensors across a checkpoint's safetensors files."""

    def __init__(self, path: str):
        safe_open = _safetensors()
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, _SINGLE)):
            files = None
        else:
            raise ValueError(f"{path!r} has neither {_SINGLE} nor {_INDEX}; jaxpar reads safetensors checkpoints "
                             "(save_pretrained(..., safe_serialization=True))")
        self.path, self._open, self._handles = path, safe_open, {}
        if files is None:
            with safe_open(os.path.join(path, _SINGLE), framework="numpy") as f:
                files = {k: _SINGLE for k in f.keys()}
        self.files = files

    def _handle(self, name: str):
        if name not in self.files:
            raise ValueError(f"the checkpoint in {self.path!r} has no tensor {name!r}")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(os.path.join(self.path, file), framework="numpy")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: slice, cols: slice | None = None) -> np.ndarray:
        """``tensor[rows, cols]`` (1-D tensors: ``tensor[rows]``) read from disk; float32."""
        sl = self._handle(name).get_slice(name)
        out = sl[rows] if cols is None else sl[rows, cols]
        return np.asarray(out, np.float32)


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    assert step == 1
    return start, stop


# A leaf's reader: (reader, index tuple of the jaxpar leaf) -> numpy block. Built per leaf below.
def _linear(name: Callable[[int], str], view: tuple[int, ...], rows: int, out_axes: tuple[int, ...],
            layers: int | None):
    """A jaxpar leaf that is ``HF[out, in]`` (or a stack over layers of them) reshaped to ``view``: its first
    ``rows`` axes split the HF rows, the rest the columns; the leaf is ``view`` with view axis ``a`` as leaf axis
    ``out_axes[a]``. A block reads the contiguous rows and columns covering it, then cuts the inner axes."""
    def covering(vsl: list[slice], dims: tuple[int, ...]) -> slice:
        lo, hi = _span(vsl[0], dims[0])
        inner = math.prod(dims[1:])
        return slice(lo * inner, hi * inner)

    def read(reader: _Reader, index: tuple[slice, ...], layer: int) -> np.ndarray:
        idx = index[1:] if layers is not None else index
        vsl = [idx[out_axes[a]] for a in range(len(view))]
        r, c = covering(vsl[:rows], view[:rows]), covering(vsl[rows:], view[rows:])
        lead_r, lead_c = _span(vsl[0], view[0]), _span(vsl[rows], view[rows])
        shape = (lead_r[1] - lead_r[0],) + view[1:rows] + (lead_c[1] - lead_c[0],) + view[rows + 1:]
        block = reader.read(name(layer), r, c).reshape(shape)
        cut = (slice(None),) + tuple(vsl[1:rows]) + (slice(None),) + tuple(vsl[rows + 1:])
        return np.transpose(block[cut], np.argsort(out_axes))

    def leaf(reader: _Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return read(reader, index, 0)
        lo, hi = _span(index[0], layers)
        return np.stack([read(reader, index, i) for i in range(lo, hi)])
    return leaf


def _vector(name: Callable[[int], str], layers: int | None):
    def leaf(reader: _Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return reader.read(name(0), index[0])
        lo, hi = _span(index[0], layers)
        return np.stack([reader.read(name(i), index[1]) for i in range(lo, hi)])
    return leaf


def _vocab_rows(name: str, vocab: int, transpose: bool):
    """``[V, D]`` HF table as the padded ``[Vp, D]`` (or, ``transpose``, ``[D, Vp]``) leaf; padding rows are 0."""
    def leaf(reader: _Reader, index: tuple[slice, ...]) -> np.ndarray:
        vsl, dsl = (index[1], index[0]) if transpose else index
        lo, hi = vsl.start or 0, vsl.stop
        d0, d1 = _span(dsl, reader.shape(name)[1])
        out = np.zeros((hi - lo, d1 - d0), np.float32)
        if lo < vocab:
            out[: min(hi, vocab) - lo] = reader.read(name, slice(lo, min(hi, vocab)), slice(d0, d1))
        return out.T if transpose else out
    return leaf


def _small(name: Callable[[int], str], transform: Callable[[np.ndarray], np.ndarray], layers: int | None):
    """A small leaf (a bias) read whole, reshaped by ``transform``, then cut to the block."""
    def leaf(reader: _Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return transform(reader.read(name(0), slice(None)))[index]
        lo, hi = _span(index[0], layers)
        return np.stack([transform(reader.read(name(i), slice(None)))[index[1:]] for i in range(lo, hi)])
    return leaf


def _llama_leaves(cfg: LlamaConfig, prefix: str) -> dict:
    N, D, H, G, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_mlp
    lay = lambda suffix: (lambda i: f"model.layers.{i}.{suffix}")
    blocks = {
        "attn_norm_scale": _vector(lay("input_layernorm.weight"), N),
        "mlp_norm_scale": _vector(lay("post_attention_layernorm.weight"), N),
        # leaf [D, H, K] from view [H, K, D]: view axes (H, K, D) are leaf axes (1, 2, 0)
        "q_kernel": _linear(lay("self_attn.q_proj.weight"), (H, K, D), 2, (1, 2, 0), N),
        "k_kernel": _linear(lay("self_attn.k_proj.weight"), (G, K, D), 2, (1, 2, 0), N),
        "v_kernel": _linear(lay("self_attn.v_proj.weight"), (G, K, D), 2, (1, 2, 0), N),
        # leaf [H, K, D] from view [D, H, K]: (D, H, K) -> leaf axes (2, 0, 1)
        "out_kernel": _linear(lay("self_attn.o_proj.weight"), (D, H, K), 1, (2, 0, 1), N),
        "gate_kernel": _linear(lay("mlp.gate_proj.weight"), (F, D), 1, (1, 0), N),
        "up_kernel": _linear(lay("mlp.up_proj.weight"), (F, D), 1, (1, 0), N),
        "down_kernel": _linear(lay("mlp.down_proj.weight"), (D, F), 1, (1, 0), N),
    }
    head = {"norm_scale": _vector(lambda i: "model.norm.weight", None)}
    if not cfg.tie_embeddings:
        head["kernel"] = _vocab_rows("lm_head.weight", cfg.vocab_size, transpose=True)
    return {"embed": {"embedding": _vocab_rows("model.embed_tokens.weight", cfg.vocab_size, transpose=False)},
            "blocks": blocks, "head": head}


def _gpt2_leaves(cfg: GPTConfig, prefix: str) -> dict:
    N, D, H, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    lay = lambda suffix: (lambda i: f"{prefix}h.{i}.{suffix}")
    one = lambda suffix: (lambda i: prefix + suffix)
    blocks = {
        "ln1_scale": _vector(lay("ln_1.weight"), N), "ln1_bias": _vector(lay("ln_1.bias"), N),
        "ln2_scale": _vector(lay("ln_2.weight"), N), "ln2_bias": _vector(lay("ln_2.bias"), N),
        # leaf [D, H, 3, K] from view [D, 3, H, K] (Conv1D [in, out], out = q | k | v)
        "qkv_kernel": _linear(lay("attn.c_attn.weight"), (D, 3, H, K), 1, (0, 2, 1, 3), N),
        "qkv_bias": _small(lay("attn.c_attn.bias"), lambda b: b.reshape(3, H, K).transpose(1, 0, 2), N),
        "out_kernel": _linear(lay("attn.c_proj.weight"), (H, K, D), 2, (0, 1, 2), N),
        "out_bias": _vector(lay("attn.c_proj.bias"), N),
        "up_kernel": _linear(lay("mlp.c_fc.weight"), (D, F), 1, (0, 1), N), "up_bias": _vector(lay("mlp.c_fc.bias"), N),
        "down_kernel": _linear(lay("mlp.c_proj.weight"), (F, D), 1, (0, 1), N),
        "down_bias": _vector(lay("mlp.c_proj.bias"), N),
    }
    head = {"ln_scale": _vector(one("ln_f.weight"), None), "ln_bias": _vector(one("ln_f.bias"), None)}
    if not cfg.tie_embeddings:
        head["kernel"] = _vocab_rows("lm_head.weight", cfg.vocab_size, transpose=True)
    return {"embed": {"embedding": _vocab_rows(prefix + "wte.weight", cfg.vocab_size, transpose=False),
                      "pos_embedding": _linear(one("wpe.weight"), (cfg.max_seq_len, D), 1, (0, 1), None)},
            "blocks": blocks, "head": head}


def _hf_shapes(cfg: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``cfg`` and its shape."""
    D, H, K, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    if isinstance(cfg, LlamaConfig):
        G, F = cfg.num_kv_heads, cfg.d_mlp
        want = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
        per = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
               "self_attn.q_proj.weight": (H * K, D), "self_attn.k_proj.weight": (G * K, D),
               "self_attn.v_proj.weight": (G * K, D), "self_attn.o_proj.weight": (D, H * K),
               "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
        layer = "model.layers."
    else:
        F = cfg.mlp_dim
        want = {prefix + "wte.weight": (V, D), prefix + "wpe.weight": (cfg.max_seq_len, D),
                prefix + "ln_f.weight": (D,), prefix + "ln_f.bias": (D,)}
        per = {"ln_1.weight": (D,), "ln_1.bias": (D,), "ln_2.weight": (D,), "ln_2.bias": (D,),
               "attn.c_attn.weight": (D, 3 * H * K), "attn.c_attn.bias": (3 * H * K,),
               "attn.c_proj.weight": (H * K, D), "attn.c_proj.bias": (D,), "mlp.c_fc.weight": (D, F),
               "mlp.c_fc.bias": (F,), "mlp.c_proj.weight": (F, D), "mlp.c_proj.bias": (D,)}
        layer = prefix + "h."
    if not cfg.tie_embeddings:
        want["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        want.update({f"{layer}{i}.{k}": v for k, v in per.items()})
    return want


def _fix_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*_span(s, n)) for s, n in zip(index, shape))


def load(path_or_dir: str, *, mesh: Any = None, rules: shd.Rules = shd.DEFAULT_RULES, dtype: Any = None,
         **config_overrides: Any) -> tuple[Any, dict]:
    """``(model, params)`` of a Hugging Face ``LlamaForCausalLM`` (a :class:`Llama`) or ``GPT2LMHeadModel`` (a
    :class:`GPT`) checkpoint directory.

    Args:
      path_or_dir: the directory (``config.json`` and ``model.safetensors`` or sharded files with their index).
      mesh: place each param by the model's logical names and ``rules`` on this mesh (each device's block read
        from disk by itself: the whole model is never on one device or in host memory); None: the default device.
      dtype: the params' dtype (default float32, the tensors converted on read).
      config_overrides: config fields to set (e.g. ``scan_layers=True``, ``remat="full"``).

    Returns:
      the model and its params ``{"embed", "blocks", "head"}`` (plain ``jax.Array`` leaves), ready for
      ``model.apply``, or for a ``TrainState`` through ``jp.train.init_state(lambda rng: with_names(model,
      params), tx, rng, mesh=mesh)`` (:func:`with_names`).

    Raises:
      ValueError: not a checkpoint directory, another architecture, a tensor missing or of another shape than
        the config says.
    """
    hf_cfg = _read_config(path_or_dir)
    if _arch(hf_cfg) == "llama":
        cfg = llama_config(hf_cfg, **config_overrides)
        model, leaves = Llama(cfg), _llama_leaves
    else:
        cfg = gpt2_config(hf_cfg, **config_overrides)
        model, leaves = GPT(cfg), _gpt2_leaves
    reader = _Reader(path_or_dir)
    # GPT-2 checkpoints name their tensors "transformer.h.0..." (save_pretrained) or "h.0..." (the original ones)
    prefix = "transformer." if isinstance(cfg, GPTConfig) and "transformer.wte.weight" in reader.files else ""
    for name, shape in _hf_shapes(cfg, prefix).items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} in {reader.path!r} has shape {got}; config.json implies {shape}")
    boxed = jax.eval_shape(model.init, jax.random.key(0))
    is_box = lambda b: hasattr(b, "names")
    shapes = jax.tree.map(lambda b: b.value.shape if is_box(b) else b.shape, boxed, is_leaf=is_box)
    if mesh is not None:
        shardings = shd.named_shardings(boxed, mesh, rules)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda s: dev, shapes, is_leaf=lambda s: isinstance(s, tuple))
    out_dtype = np.float32 if dtype is None else dtype

    def make(leaf_fn, shape, sharding):
        cb = lambda index: np.asarray(leaf_fn(reader, _fix_index(index, shape)), out_dtype)
        return jax.make_array_from_callback(shape, sharding, cb)
    params = jax.tree.map(make, leaves(cfg, prefix), shapes, shardings,
                          is_leaf=lambda x: callable(x) or isinstance(x, tuple))
    return model, params


def with_names(model: Any, params: dict) -> dict:
    """``params`` boxed with the model's logical axis names (``nn.LogicallyPartitioned``), so that
    ``jp.train.init_state(lambda rng: with_names(model, params), tx, rng, mesh=mesh)`` places them, and the
    optimizer state, by the rules (as ``model.init``'s would be): loaded params become a ``TrainState``."""
    is_box = lambda b: hasattr(b, "names")
    boxed = jax.eval_shape(model.init, jax.random.key(0))
    return jax.tree.map(lambda b, a: b.replace(value=a) if is_box(b) else a, boxed, params, is_leaf=is_box)


def _hf_config(cfg: Any) -> dict:
    if isinstance(cfg, GPTConfig):
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
                "n_inner": cfg.mlp_dim, "n_positions": cfg.max_seq_len, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "tie_word_embeddings": cfg.tie_embeddings,
                "initializer_range": cfg.init_std, "scale_attn_weights": True, "torch_dtype": "float32"}
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
           "initializer_range": cfg.init_std, "rope_theta": cfg.rope_theta, "torch_dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(dict(cfg.rope_scaling))
        out["rope_scaling"] = dict(cfg.rope_scaling)
    out["rope_parameters"] = rope
    return out


def _export(cfg: Any, params: dict) -> dict[str, Callable[[], np.ndarray]]:
    """Each HF tensor of ``params`` as a thunk (so a shard's tensors are gathered to the host one shard at a time)."""
    host = lambda a: np.asarray(jax.device_get(a), np.float32)
    V, D, b = cfg.vocab_size, cfg.d_model, params["blocks"]
    lay = lambda k, i: (lambda: host(b[k][i]))
    if isinstance(cfg, LlamaConfig):
        out = {"model.embed_tokens.weight": lambda: host(params["embed"]["embedding"])[:V],
               "model.norm.weight": lambda: host(params["head"]["norm_scale"])}
        for i in range(cfg.num_layers):
            p, L = f"model.layers.{i}.", (lambda k, i=i: host(b[k][i]))
            out.update({
                p + "input_layernorm.weight": lay("attn_norm_scale", i),
                p + "post_attention_layernorm.weight": lay("mlp_norm_scale", i),
                p + "self_attn.q_proj.weight": lambda L=L: L("q_kernel").reshape(D, -1).T,
                p + "self_attn.k_proj.weight": lambda L=L: L("k_kernel").reshape(D, -1).T,
                p + "self_attn.v_proj.weight": lambda L=L: L("v_kernel").reshape(D, -1).T,
                p + "self_attn.o_proj.weight": lambda L=L: L("out_kernel").reshape(-1, D).T,
                p + "mlp.gate_proj.weight": lambda L=L: L("gate_kernel").T,
                p + "mlp.up_proj.weight": lambda L=L: L("up_kernel").T,
                p + "mlp.down_proj.weight": lambda L=L: L("down_kernel").T})
    else:
        t = "transformer."
        out = {t + "wte.weight": lambda: host(params["embed"]["embedding"])[:V],
               t + "wpe.weight": lambda: host(params["embed"]["pos_embedding"]),
               t + "ln_f.weight": lambda: host(params["head"]["ln_scale"]),
               t + "ln_f.bias": lambda: host(params["head"]["ln_bias"])}
        for i in range(cfg.num_layers):
            p, L = f"{t}h.{i}.", (lambda k, i=i: host(b[k][i]))
            qkv_bias = (lambda L=L: L("qkv_bias").transpose(1, 0, 2).reshape(-1)) if cfg.qkv_bias else \
                (lambda: np.zeros(3 * cfg.num_heads * cfg.head_dim, np.float32))
            out.update({
                p + "ln_1.weight": lay("ln1_scale", i), p + "ln_1.bias": lay("ln1_bias", i),
                p + "ln_2.weight": lay("ln2_scale", i), p + "ln_2.bias": lay("ln2_bias", i),
                p + "attn.c_attn.weight": lambda L=L: L("qkv_kernel").transpose(0, 2, 1, 3).reshape(D, -1),
                p + "attn.c_attn.bias": qkv_bias,
                p + "attn.c_proj.weight": lambda L=L: L("out_kernel").reshape(-1, D),
                p + "attn.c_proj.bias": lay("out_bias", i),
                p + "mlp.c_fc.weight": lay("up_kernel", i), p + "mlp.c_fc.bias": lay("up_bias", i),
                p + "mlp.c_proj.weight": lay("down_kernel", i), p + "mlp.c_proj.bias": lay("down_bias", i)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = lambda: host(params["head"]["kernel"])[:, :V].T
    return out


def save(model: Any, params: dict, dir: str, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes ``params`` of ``model`` (a :class:`Llama`, or a :class:`GPT` with learned positions) as a Hugging Face
    ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` checkpoint in ``dir``: ``config.json`` and float32 safetensors
    (sharded into ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json`` when larger), read by ``from_pretrained(dir)``. The vocabulary padding is
    dropped; a GPT without ``qkv_bias`` writes zero biases. Each file is written under a temporary name and
    renamed, ``config.json`` last, so an interrupted save never leaves a half-written file in a file's place.

    Raises:
      ValueError: another model, a GPT with rotary positions (GPT-2 has learned ones), params of other shapes
        than its config's.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"jaxpar.models.hf.save writes a jaxpar.models.Llama or GPT, got {type(model).__name__}")
    cfg = model.cfg
    if isinstance(cfg, GPTConfig) and cfg.positions != "learned":
        raise ValueError("a GPT with positions='rotary' has no GPT-2 checkpoint (GPT-2 learns its positions); "
                         "save a GPTConfig(positions='learned') model")
    from safetensors.numpy import save_file
    want = jax.tree.map(lambda b: b.value.shape, jax.eval_shape(model.init, jax.random.key(0)),
                        is_leaf=lambda b: hasattr(b, "names"))
    got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
    if got != want:
        flat_want = {shd.key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            want, is_leaf=lambda x: isinstance(x, tuple))[0]}
        flat_got = {shd.key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            got, is_leaf=lambda x: isinstance(x, tuple))[0]}
        bad = sorted(k for k in flat_want.keys() | flat_got.keys() if flat_want.get(k) != flat_got.get(k))
        raise ValueError(f"params do not match the model's config: {bad[0]} has shape {flat_got.get(bad[0])}, the "
                         f"config's {flat_want.get(bad[0])} ({len(bad)} leaves differ)")
    tensors = _export(cfg, params)
    shapes = _hf_shapes(cfg, "transformer." if isinstance(cfg, GPTConfig) else "")
    sizes = {k: 4 * math.prod(shapes[k]) for k in tensors}
    os.makedirs(dir, exist_ok=True)
    shards, current, total = [], [], 0
    for k in tensors:
        if current and total + sizes[k] > max_shard_bytes:
            shards.append(current)
            current, total = [], 0
        current.append(k)
        total += sizes[k]
    shards.append(current)
    names = [_SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    for name, keys in zip(names, shards):
        tmp = os.path.join(dir, name + ".tmp")
        save_file({k: np.ascontiguousarray(tensors[k]()) for k in keys}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(dir, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: n for n, keys in zip(names, shards) for k in keys}}
        _write_json(os.path.join(dir, _INDEX), index)
    _write_json(os.path.join(dir, "config.json"), _hf_config(cfg))


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
