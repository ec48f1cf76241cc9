"""Hugging Face checkpoints in and out: ``LlamaForCausalLM`` as :class:`jaxpar.models.Llama`, ``GPT2LMHeadModel``
as :class:`jaxpar.models.GPT` (learned positions, tied embeddings, ``qkv_bias=True``).

A checkpoint is a directory with ``config.json`` and ``model.safetensors``, or sharded
``model-0000i-of-0000n.safetensors`` files with their ``model.safetensors.index.json`` (the layout of
``transformers``' ``save_pretrained``). Weights are read through ``safetensors``' lazy slices: each device's
block of each parameter is read by itself (``jax.make_array_from_callback``), so the whole model never exists
on one device or in host memory at once, and in a multi-process run each process reads only its devices'
slices. The files are data (:mod:`jaxpar.models.hf.files`): read from inside the directory only, as float32,
float16 or bfloat16; config fields the models here do not compute are refused (:mod:`jaxpar.models.hf.config`).

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

import math
import os
import re
import shutil
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from jaxpar.precision import fp8
from jaxpar.sharding import rules as shd
from jaxpar.models.hf import files as hf_files
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.hf.config import _arch, _hf_config, _read_config, gpt2_config, llama_config
from jaxpar.models.hf.files import INDEX, SINGLE, Reader
from jaxpar.models.llama import Llama, LlamaConfig

# buffers some checkpoints carry that are not weights: rotary frequencies, GPT-2's causal mask
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


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

    def read(reader: Reader, index: tuple[slice, ...], layer: int) -> np.ndarray:
        idx = index[1:] if layers is not None else index
        vsl = [idx[out_axes[a]] for a in range(len(view))]
        r, c = covering(vsl[:rows], view[:rows]), covering(vsl[rows:], view[rows:])
        lead_r, lead_c = _span(vsl[0], view[0]), _span(vsl[rows], view[rows])
        shape = (lead_r[1] - lead_r[0],) + view[1:rows] + (lead_c[1] - lead_c[0],) + view[rows + 1:]
        block = reader.read(name(layer), r, c).reshape(shape)
        cut = (slice(None),) + tuple(vsl[1:rows]) + (slice(None),) + tuple(vsl[rows + 1:])
        return np.transpose(block[cut], np.argsort(out_axes))

    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return read(reader, index, 0)
        lo, hi = _span(index[0], layers)
        return np.stack([read(reader, index, i) for i in range(lo, hi)])
    return leaf


def _vector(name: Callable[[int], str], layers: int | None):
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return reader.read(name(0), index[0])
        lo, hi = _span(index[0], layers)
        return np.stack([reader.read(name(i), index[1]) for i in range(lo, hi)])
    return leaf


def _vocab_rows(name: str, vocab: int, transpose: bool):
    """``[V, D]`` HF table as the padded ``[Vp, D]`` (or, ``transpose``, ``[D, Vp]``) leaf; padding rows are 0."""
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
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
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
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
        Every file read is inside it once links are resolved (a Hugging Face hub cache snapshot's links into its
        repo's ``blobs`` count as inside). Weights may be stored as float32, float16 or bfloat16. A save into it
        that was killed is first finished or undone (:func:`save`).
      mesh: place each param by the model's logical names and ``rules`` on this mesh (each device's block read
        from disk by itself: the whole model is never on one device or in host memory); None: the default device.
      dtype: the params' dtype (default: an overridden ``param_dtype``, else float32; converted on read). The
        compute dtype is the config's ``dtype`` (an override, e.g. ``dtype=jnp.bfloat16`` here sets the params'
        dtype, ``config_overrides`` cannot: pass a policy to the train step instead).
      config_overrides: config fields to set (e.g. ``scan_layers=True``, ``remat="full"``).

    Returns:
      the model and its params ``{"embed", "blocks", "head"}`` (plain ``jax.Array`` leaves), ready for
      ``model.apply``, or for a ``TrainState`` through ``jp.train.init_state(lambda rng: with_names(model,
      params), tx, rng, mesh=mesh)`` (:func:`with_names`).

    Raises:
      ValueError: not a checkpoint directory, another architecture (``model_type`` / ``architectures``), a missing
        or malformed config field, a config field that changes the computation in a way the model here does not
        (``hf_config.UNSUPPORTED``: a sliding window, soft-capping, ...), a tensor missing, of another shape than
        the config says, stored as another dtype than float32, float16 or bfloat16, or with no place in the model
        (it would be dropped), an index naming a file outside the directory, a torn safetensors file or index.
    """
    hf_files.recover(path_or_dir)
    hf_cfg = _read_config(path_or_dir)
    if _arch(hf_cfg) == "llama":
        cfg = llama_config(hf_cfg, **config_overrides)
        model, leaves = Llama(cfg), _llama_leaves
    else:
        cfg = gpt2_config(hf_cfg, **config_overrides)
        model, leaves = GPT(cfg), _gpt2_leaves
    reader = Reader(path_or_dir)
    # GPT-2 checkpoints name their tensors "transformer.h.0..." (save_pretrained) or "h.0..." (the original ones)
    prefix = "transformer." if isinstance(cfg, GPTConfig) and "transformer.wte.weight" in reader.files else ""
    expected = _hf_shapes(cfg, prefix)
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} in {reader.path!r} has shape {got}; config.json implies {shape}")
        reader.check_dtype(name)
    unused = sorted(k for k in reader.files if k not in expected and not k.endswith(_BUFFERS))
    if unused:
        raise ValueError(f"{reader.path!r} holds {len(unused)} tensors the {type(model).__name__} of its config.json "
                         f"has no place for, e.g. {unused[:3]}: another architecture (biases, more layers than "
                         "num_hidden_layers, another head) whose weights would be dropped")
    boxed, _ = _abstract_init(model)
    shapes = _shapes(boxed)
    if mesh is not None:
        shardings = shd.named_shardings(boxed, mesh, rules)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda s: dev, shapes, is_leaf=lambda s: isinstance(s, tuple))
    out_dtype = np.dtype(dtype if dtype is not None else (cfg.param_dtype or np.float32))
    if not np.issubdtype(out_dtype, np.floating) and out_dtype != jax.numpy.bfloat16:
        raise ValueError(f"dtype={dtype!r} must be a floating dtype (float32, bfloat16, float16) for the params")

    def make(leaf_fn, shape, sharding):
        cb = lambda index: np.asarray(leaf_fn(reader, _fix_index(index, shape)), out_dtype)
        return jax.make_array_from_callback(shape, sharding, cb)
    params = jax.tree.map(make, leaves(cfg, prefix), shapes, shardings,
                          is_leaf=lambda x: callable(x) or isinstance(x, tuple))
    return model, params


def with_names(model: Any, params: dict) -> dict:
    """``params`` boxed with the model's logical axis names (``nn.LogicallyPartitioned``), so that
    ``jp.train.init_state(lambda rng: with_names(model, params), tx, rng, mesh=mesh)`` places them, and the
    optimizer state, by the rules (as ``model.init``'s would be): loaded params become a ``TrainState``. Under a
    policy with fp8 matmuls of delayed scaling (``dot=fp8``), the fp8 meta state ``model.init`` adds is added as
    ``model.init`` makes it (amax histories of zeros, scales of one).

    Raises:
      ValueError: a leaf whose shape is not the one the model's config gives (named).
    """
    boxed, meta = _abstract_init(model)
    _check_shapes(boxed, params)
    is_box = lambda b: hasattr(b, "names")
    named = jax.tree.map(lambda b, a: b.replace(value=a) if is_box(b) else a, boxed, params, is_leaf=is_box)
    if meta is None:
        return named
    # only the meta state is an output: the random params of this init are dead code, never computed
    return fp8.merge(named, jax.jit(lambda key: fp8.split(model.init(key))[1])(jax.random.key(0)))


def _abstract_init(model: Any) -> tuple[dict, Any]:
    """``(boxed params, fp8 meta state or None)`` of ``model.init``, as shapes (the policy in context decides
    whether there is meta state: :mod:`jaxpar.precision.fp8`)."""
    return fp8.split(jax.eval_shape(model.init, jax.random.key(0)))


def _shapes(boxed: dict) -> dict:
    is_box = lambda b: hasattr(b, "names")
    return jax.tree.map(lambda b: tuple(b.value.shape) if is_box(b) else tuple(b.shape), boxed, is_leaf=is_box)


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


# files of a checkpoint directory that save() writes (others, e.g. a tokenizer's, are kept)
_WEIGHTS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json)$")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def save(model: Any, params: dict, dir: str, *, max_shard_bytes: int = 5 * 2**30, like: str | None = None) -> None:
    """Writes ``params`` of ``model`` (a :class:`Llama`, or a :class:`GPT` with learned positions) as a Hugging Face
    ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` checkpoint in ``dir``: ``config.json`` and float32 safetensors
    (sharded into ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json`` when larger), read by ``from_pretrained(dir)``. The vocabulary padding is
    dropped; a GPT without ``qkv_bias`` writes zero biases.

    Atomic as a whole: the checkpoint is written to a temporary directory ``.<name>.jaxpar-tmp-<owner>-*`` beside
    ``dir`` and swapped in by two renames, so an interrupted or failed save leaves the previous ``dir`` as it was
    (in the instant between the renames it is ``.<name>.jaxpar-old-<owner>-*`` beside it), and no file of an
    earlier checkpoint (a stale index or shard) survives next to the new one. A save killed on the way (``kill
    -9``) is recovered by the next ``save`` or :func:`load` of ``dir``: its temporary directory is removed and a
    previous checkpoint it left aside is renamed back, once the process that wrote them (``<owner>``: host,
    process id and start time) no longer runs. Other files and folders of an existing ``dir`` (a tokenizer's,
    ``generation_config.json``, an export in a subfolder) are kept, as are those of ``like``. A ``dir`` that is a
    link to a directory stays a link: the checkpoint is written to its target.

    Args:
      like: a Hugging Face checkpoint directory (e.g. the one fine-tuned): its ``bos_token_id``, ``eos_token_id``
        and ``pad_token_id`` go into the new ``config.json``, and its files other than weights and config
        (tokenizer, ``generation_config.json``) are copied, so ``transformers`` tokenizes and stops as before.

    Raises:
      ValueError: another model, a GPT with rotary positions (GPT-2 has learned ones), params of other shapes
        than its config's, ``dir`` an existing file, ``like`` not a checkpoint directory, a file to carry over
        that is a link out of its directory.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"jaxpar.models.hf.save writes a jaxpar.models.Llama or GPT, got {type(model).__name__}")
    cfg = model.cfg
    if isinstance(cfg, GPTConfig) and cfg.positions != "learned":
        raise ValueError("a GPT with positions='rotary' has no GPT-2 checkpoint (GPT-2 learns its positions); "
                         "save a GPTConfig(positions='learned') model")
    dir = os.path.realpath(dir)   # a link to a checkpoint stays a link: the save goes to (and swaps) its target
    hf_files.recover(dir)
    if os.path.exists(dir) and not os.path.isdir(dir):
        raise ValueError(f"{dir!r} is a file; save writes a checkpoint directory there: pass a directory path")
    extra = _read_config(like) if like is not None else {}
    from safetensors.numpy import save_file
    params = nn.meta.unbox(params)   # model.init's Flax-boxed params are accepted as they are
    _check_shapes(_abstract_init(model)[0], params)
    tensors = _export(cfg, params)
    shapes = _hf_shapes(cfg, "transformer." if isinstance(cfg, GPTConfig) else "")
    sizes = {k: 4 * math.prod(shapes[k]) for k in tensors}
    shards, current, total = [], [], 0
    for k in tensors:
        if current and total + sizes[k] > max_shard_bytes:
            shards.append(current)
            current, total = [], 0
        current.append(k)
        total += sizes[k]
    shards.append(current)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    parent, base = os.path.split(os.path.abspath(dir))
    os.makedirs(parent, exist_ok=True)
    tmp = hf_files.temp_dir(dir, "tmp")
    try:
        for source in (like, dir):   # the tokenizer and other files of the source and of the old checkpoint
            if source is not None and os.path.isdir(source):
                for f in os.listdir(source):
                    if _WEIGHTS.match(f):
                        continue
                    if os.path.isdir(os.path.join(source, f)):   # copied as it is: links stay links, none is read
                        shutil.rmtree(os.path.join(tmp, f), ignore_errors=True)   # the later source's wins
                        shutil.copytree(hf_files.inside(source, f, repr(source)), os.path.join(tmp, f), symlinks=True)
                    elif os.path.isfile(os.path.join(source, f)):
                        shutil.copy2(hf_files.inside(source, f, repr(source)), os.path.join(tmp, f))
        for name, keys in zip(names, shards):
            save_file({k: np.ascontiguousarray(tensors[k]()) for k in keys}, os.path.join(tmp, name),
                      metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {k: n for n, keys in zip(names, shards) for k in keys}}
            hf_files.write_json(os.path.join(tmp, INDEX), index)
        hf_files.write_json(os.path.join(tmp, "config.json"),
                    {**_hf_config(cfg), **{k: extra[k] for k in _TOKEN_IDS if k in extra}})
        hf_files.swap_in(tmp, os.path.join(parent, base))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_shapes(boxed: dict, params: dict) -> None:
    """Raises a ValueError naming the first leaf of ``params`` whose shape is not that of the leaf of ``boxed``
    (``model.init``'s abstract params, :func:`_abstract_init`)."""
    want = _shapes(boxed)
    got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
    if got != want:
        flat_want = {shd.key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            want, is_leaf=lambda x: isinstance(x, tuple))[0]}
        flat_got = {shd.key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            got, is_leaf=lambda x: isinstance(x, tuple))[0]}
        bad = sorted(k for k in flat_want.keys() | flat_got.keys() if flat_want.get(k) != flat_got.get(k))
        raise ValueError(f"params do not match the model's config: {bad[0]} has shape {flat_got.get(bad[0])}, the "
                         f"config's {flat_want.get(bad[0])} ({len(bad)} leaves differ)")
