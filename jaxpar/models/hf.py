"""Hugging Face checkpoints in and out: ``LlamaForCausalLM`` as :class:`jaxpar.models.Llama`.

A checkpoint is a directory with ``config.json`` and ``model.safetensors``, or sharded
``model-0000i-of-0000n.safetensors`` files with their ``model.safetensors.index.json`` (the layout of
``transformers``' ``save_pretrained``). Weights are read through ``safetensors``' lazy slices: each device's
block of each parameter is read by itself (``jax.make_array_from_callback``), so the whole model never exists
on one device or in host memory at once, and in a multi-process run each process reads only its devices'
slices.

Layouts (HF ``nn.Linear`` weights are ``[out, in]``): ``q_proj [H*K, D] -> q_kernel [D, H, K]``, ``k_proj`` /
``v_proj [G*K, D] -> [D, G, K]``, ``o_proj [D, H*K] -> out_kernel [H, K, D]``, ``gate/up_proj [F, D] -> [D, F]``,
``down_proj [D, F] -> [F, D]``, ``lm_head [V, D] -> head/kernel [D, V]``, layers stacked on a leading axis, the
vocabulary padded with zero rows to ``vocab_multiple``. HF's ``q_proj``/``k_proj`` rows are already in the
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


def llama_config(hf: dict, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: a config another architecture wrote, or features the Llama here lacks (biases, another
        activation, a rope type other than Llama 3's).
    """
    arch = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, architectures={arch}; "
                         "jaxpar.models.hf loads LlamaForCausalLM checkpoints")
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


def _llama_leaves(cfg: LlamaConfig) -> dict:
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


def _fix_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*_span(s, n)) for s, n in zip(index, shape))


def load(path_or_dir: str, *, mesh: Any = None, rules: shd.Rules = shd.DEFAULT_RULES, dtype: Any = None,
         **config_overrides: Any) -> tuple[Llama, dict]:
    """``(model, params)`` of a Hugging Face ``LlamaForCausalLM`` checkpoint directory.

    Args:
      path_or_dir: the directory (``config.json`` and ``model.safetensors`` or sharded files with their index).
      mesh: place each param by the model's logical names and ``rules`` on this mesh (each device's block read
        from disk by itself); None: on the default device.
      dtype: the params' dtype (default float32, the tensors converted on read).
      config_overrides: fields of :class:`LlamaConfig` to set (e.g. ``scan_layers=True``, ``max_seq_len=``).

    Returns:
      the :class:`Llama` and its params ``{"embed", "blocks", "head"}`` (plain ``jax.Array`` leaves).

    Raises:
      ValueError: not a checkpoint directory, another architecture, a tensor missing or of another shape than
        the config says.
    """
    hf_cfg = _read_config(path_or_dir)
    cfg = llama_config(hf_cfg, **config_overrides)
    model = Llama(cfg)
    reader = _Reader(path_or_dir)
    boxed = jax.eval_shape(model.init, jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, jax.tree.map(lambda b: b.value, boxed,
                                                          is_leaf=lambda b: hasattr(b, "names")))
    if mesh is not None:
        shardings = shd.named_shardings(boxed, mesh, rules)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda s: dev, shapes, is_leaf=lambda s: isinstance(s, tuple))
    _check_shapes(reader, cfg)
    out_dtype = np.float32 if dtype is None else dtype

    def make(leaf_fn, shape, sharding):
        cb = lambda index: np.asarray(leaf_fn(reader, _fix_index(index, shape)), out_dtype)
        return jax.make_array_from_callback(shape, sharding, cb)
    params = jax.tree.map(make, _llama_leaves(cfg), shapes, shardings,
                          is_leaf=lambda x: callable(x) or isinstance(x, tuple))
    return model, params


def _check_shapes(reader: _Reader, cfg: LlamaConfig) -> None:
    D, H, G, K, F, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_mlp, cfg.vocab_size
    want = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        want["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        want.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (G * K, D),
                     p + "self_attn.v_proj.weight": (G * K, D), p + "self_attn.o_proj.weight": (D, H * K),
                     p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                     p + "mlp.down_proj.weight": (D, F)})
    for name, shape in want.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} in {reader.path!r} has shape {got}; config.json implies {shape}")


def _hf_config(cfg: LlamaConfig) -> dict:
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


def save(model: Llama, params: dict, dir: str, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes ``params`` of ``model`` as a Hugging Face ``LlamaForCausalLM`` checkpoint in ``dir``: ``config.json``
    and float32 safetensors (sharded into ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json`` when larger), loadable by
    ``LlamaForCausalLM.from_pretrained(dir)``. The vocabulary padding is dropped. Files are written under
    temporary names and renamed, so an interrupted save leaves no half-written checkpoint in their place.

    Raises:
      ValueError: ``model`` is not a :class:`Llama`; params of other shapes than its config's.
    """
    if not isinstance(model, Llama):
        raise ValueError(f"jaxpar.models.hf.save writes a jaxpar.models.Llama, got {type(model).__name__}")
    from safetensors.numpy import save_file
    cfg = model.cfg
    want = jax.tree.map(lambda b: b.value.shape, jax.eval_shape(model.init, jax.random.key(0)),
                        is_leaf=lambda b: hasattr(b, "names"))
    got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
    if got != want:
        raise ValueError(f"params do not match the model's config: shapes {got}, the config's {want}")
    host = lambda a: np.asarray(jax.device_get(a), np.float32)
    V = cfg.vocab_size
    tensors: dict[str, Callable[[], np.ndarray]] = {
        "model.embed_tokens.weight": lambda: host(params["embed"]["embedding"])[:V],
        "model.norm.weight": lambda: host(params["head"]["norm_scale"])}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = lambda: host(params["head"]["kernel"])[:, :V].T
    b = params["blocks"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = lambda k, i=i: host(b[k][i])
        tensors.update({
            p + "input_layernorm.weight": lambda layer=layer: layer("attn_norm_scale"),
            p + "post_attention_layernorm.weight": lambda layer=layer: layer("mlp_norm_scale"),
            p + "self_attn.q_proj.weight": lambda layer=layer: layer("q_kernel").reshape(cfg.d_model, -1).T,
            p + "self_attn.k_proj.weight": lambda layer=layer: layer("k_kernel").reshape(cfg.d_model, -1).T,
            p + "self_attn.v_proj.weight": lambda layer=layer: layer("v_kernel").reshape(cfg.d_model, -1).T,
            p + "self_attn.o_proj.weight": lambda layer=layer: layer("out_kernel").reshape(-1, cfg.d_model).T,
            p + "mlp.gate_proj.weight": lambda layer=layer: layer("gate_kernel").T,
            p + "mlp.up_proj.weight": lambda layer=layer: layer("up_kernel").T,
            p + "mlp.down_proj.weight": lambda layer=layer: layer("down_kernel").T})
    os.makedirs(dir, exist_ok=True)
    # group tensors into shards by size, materialising one shard at a time
    sizes = {k: 4 * math.prod(_shape_of(k, cfg)) for k in tensors}
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


def _shape_of(name: str, cfg: LlamaConfig) -> tuple[int, ...]:
    D, H, G, K, F, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_mlp, cfg.vocab_size
    for suffix, shape in (("embed_tokens.weight", (V, D)), ("lm_head.weight", (V, D)), ("norm.weight", (D,)),
                          ("layernorm.weight", (D,)), ("q_proj.weight", (H * K, D)), ("k_proj.weight", (G * K, D)),
                          ("v_proj.weight", (G * K, D)), ("o_proj.weight", (D, H * K)), ("gate_proj.weight", (F, D)),
                          ("up_proj.weight", (F, D)), ("down_proj.weight", (D, F))):
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
