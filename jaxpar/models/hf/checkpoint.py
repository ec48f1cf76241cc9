"""Hugging Face checkpoints in and out, for any family with a weight adapter (:data:`ADAPTERS`):
``LlamaForCausalLM`` as :class:`jaxpar.models.Llama` (:mod:`jaxpar.models.hf.llama`), ``GPT2LMHeadModel`` as
:class:`jaxpar.models.GPT` (:mod:`jaxpar.models.hf.gpt2`), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM``, ``Gemma3ForCausalLM`` and ``Gemma3ForConditionalGeneration``'s text decoder as
:class:`jaxpar.models.FamilyModel` (:mod:`jaxpar.models.hf.families`), and the mixtures of experts
``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` as a ``FamilyModel`` with ``moe`` (:mod:`jaxpar.models.hf.moe`).
Load dispatches on ``config.json``'s architecture, save on the model's config.

A checkpoint is a directory with ``config.json`` and ``model.safetensors``, or sharded
``model-0000i-of-0000n.safetensors`` files with their ``model.safetensors.index.json`` (the layout of
``transformers``' ``save_pretrained``). Weights are read through ``safetensors``' lazy slices: each device's
block of each parameter is read by itself (``jax.make_array_from_callback``), so the whole model never exists
on one device or in host memory at once, and in a multi-process run each process reads only its devices'
slices. The files are data (:mod:`jaxpar.models.hf.files`): read from inside the directory only, as float32,
float16 or bfloat16; config fields the models here do not compute are refused (:mod:`jaxpar.models.hf.config`).

Needs the optional ``safetensors`` package (``pip install 'jaxpar[hf]'``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxpar import protocol
from jaxpar.models.hf import files as hf_files
from jaxpar.models.hf import families, gpt2, llama, moe
from jaxpar.models.hf.config import _arch, _read_config, eos_token_ids
from jaxpar.models.hf.files import INDEX, SINGLE, Reader
from jaxpar.models.hf.weights import Adapter, span
from jaxpar.precision import fp8
from jaxpar.sharding import rules as shd

# buffers some checkpoints carry that are not weights: rotary frequencies, GPT-2's causal mask
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

ADAPTERS = {adapter.model_type: adapter
            for adapter in (llama.ADAPTER, gpt2.ADAPTER) + families.ADAPTERS + moe.ADAPTERS}
"""The weight adapter of each family, by ``config.json``'s ``model_type``."""


def _adapter_of(model: Any) -> Adapter:
    """The adapter whose config class is the model's config's.

    Raises:
      ValueError: a model of no family with a Hugging Face adapter.
    """
    cfg = getattr(model, "cfg", None)
    for adapter in ADAPTERS.values():
        if type(cfg) is adapter.config_type and isinstance(model, adapter.model) and adapter.saves \
                and adapter.accepts(cfg):
            return adapter
    if getattr(cfg, "moe", None) is not None:
        raise ValueError(f"jaxpar.models.hf.save writes experts as a MixtralForCausalLM (a FamilyConfig of family "
                         f"'mistral' with moe) or a Qwen3MoeForCausalLM (family 'qwen3' with moe); got a "
                         f"{type(cfg).__name__}{' of family ' + repr(cfg.family) if hasattr(cfg, 'family') else ''} "
                         "with moe, which no Hugging Face checkpoint here holds")
    names = " or ".join(dict.fromkeys(a.model.__name__ for a in ADAPTERS.values()))
    raise ValueError(f"jaxpar.models.hf.save writes a jaxpar.models.{names}, got {type(model).__name__}")


def _fix_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*span(s, n)) for s, n in zip(index, shape))


def load(path_or_dir: str, *, mesh: Any = None, rules: shd.Rules = shd.DEFAULT_RULES, dtype: Any = None,
         **config_overrides: Any) -> tuple[Any, dict]:
    """``(model, params)`` of a Hugging Face ``LlamaForCausalLM`` (a :class:`Llama`), ``GPT2LMHeadModel`` (a
    :class:`GPT`), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM``, or
    the mixtures of experts ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` (a :class:`jaxpar.models.FamilyModel`
    whose config has ``moe``) checkpoint directory; a ``Gemma3ForConditionalGeneration``'s text decoder with
    ``text_only=True`` (its vision tower is refused without it).

    Args:
      path_or_dir: the directory (``config.json`` and ``model.safetensors`` or sharded files with their index).
        Every file read is inside it once links are resolved (a Hugging Face hub cache snapshot's links into its
        repo's ``blobs`` count as inside). Weights may be stored as float32, float16 or bfloat16. A save into it
        that was killed is first finished or undone (:func:`save`).
      mesh: place each param by the model's logical names and ``rules`` on this mesh (each device's block read
        from disk by itself: the whole model is never on one device or in host memory); None: the default device.
      rules: the logical-name rules that placement reads (default ``jp.sharding.DEFAULT_RULES``; for a mixture of
        experts split over the batch axes, ``jp.sharding.expert_parallel_rules(mesh, E)``).
      dtype: the params' dtype (default: an overridden ``param_dtype``, else float32; converted on read). The
        compute dtype is the config's ``dtype`` (an override, e.g. ``dtype=jnp.bfloat16`` here sets the params'
        dtype, ``config_overrides`` cannot: pass a policy to the train step instead).
      config_overrides: config fields to set (e.g. ``scan_layers=True``, ``remat="full"``); ``text_only=True``
        for a ``Gemma3ForConditionalGeneration`` (the vision tower's tensors are left on disk). The config's
        ``eos_token_ids`` (where ``model.generate`` stops by default, as ``transformers``' ``generate`` does) are
        ``generation_config.json``'s ``eos_token_id``, else ``config.json``'s, unless overridden here.

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
    adapter = ADAPTERS[_arch(hf_cfg)]
    cfg = adapter.from_hf(hf_cfg, **config_overrides)
    if hasattr(cfg, "eos_token_ids") and "eos_token_ids" not in config_overrides:   # generate stops as HF's does
        cfg = dataclasses.replace(cfg, eos_token_ids=eos_token_ids(path_or_dir, hf_cfg, cfg.vocab_size))
    model = adapter.model(cfg)
    reader = Reader(path_or_dir)
    prefix = adapter.prefix(reader.files)
    expected = adapter.hf_shapes(cfg, prefix)
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} in {reader.path!r} has shape {got}; config.json implies {shape}")
        reader.check_dtype(name)
    unused = sorted(k for k in reader.files if k not in expected and not k.endswith(_BUFFERS)
                    and not k.startswith(adapter.left_on_disk))
    head, embed = llama.head_name(prefix), f"{prefix}embed_tokens.weight"
    if getattr(cfg, "tie_embeddings", False) and head in unused and embed in expected:
        _check_tied_copy(reader, head, embed)   # a tied checkpoint that stores its head anyway
        unused.remove(head)
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
    params = jax.tree.map(make, adapter.leaves(cfg, prefix), shapes, shardings,
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


# files of a checkpoint directory that save() writes (others, e.g. a tokenizer's, are kept)
_WEIGHTS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json)$")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _check_tied_copy(reader: Reader, head: str, embed: str, rows: int = 8192) -> None:
    """Accepts the ``head`` tensor of a checkpoint whose config ties it to ``embed`` when it is a copy of it (what
    some exporters write; transformers ties it and ignores the copy); a ValueError when it differs."""
    same = reader.shape(head) == reader.shape(embed)
    for start in range(0, reader.shape(embed)[0], rows) if same else ():
        block = slice(start, min(start + rows, reader.shape(embed)[0]))
        if not np.array_equal(reader.read(head, block), reader.read(embed, block)):
            same = False
            break
    if not same:
        raise ValueError(f"config.json has tie_word_embeddings=true (the output layer is the embedding {embed!r}), "
                         f"but {reader.path!r} also holds {head!r}, which differs from it (transformers would ignore "
                         "it): set tie_word_embeddings to false to load that head, or delete the tensor")


def save(model: Any, params: dict, dir: str, *, max_shard_bytes: int = 5 * 2**30, like: str | None = None) -> None:
    """Writes ``params`` of ``model`` (a :class:`Llama`, a :class:`GPT` with learned positions, a
    :class:`jaxpar.models.FamilyModel`) as a Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` /
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM``, ``MixtralForCausalLM``,
    ``Qwen3MoeForCausalLM`` (experts written one by one) checkpoint in ``dir``:
    ``config.json`` and float32 safetensors
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
        Without it (or where it has no ``eos_token_id``) the config's ``eos_token_ids`` are written; ``like``'s
        ``eos_token_id`` (and its ``generation_config.json``) win over them.

    Raises:
      ValueError: another model, a GPT with rotary positions (GPT-2 has learned ones), params of other shapes
        than its config's, ``dir`` an existing file, ``like`` not a checkpoint directory, a file to carry over
        that is a link out of its directory.
    """
    adapter = _adapter_of(model)
    cfg = model.cfg
    adapter.check_save(cfg)
    dir = os.path.realpath(dir)   # a link to a checkpoint stays a link: the save goes to (and swaps) its target
    hf_files.recover(dir)
    if os.path.exists(dir) and not os.path.isdir(dir):
        raise ValueError(f"{dir!r} is a file; save writes a checkpoint directory there: pass a directory path")
    extra = _read_config(like) if like is not None else {}
    from safetensors.numpy import save_file
    params = nn.meta.unbox(params)   # model.init's Flax-boxed params are accepted as they are
    want = _abstract_init(model)[0]
    if protocol.split_carried(params)[1] is None:   # the optimizer's params (carried state apart) are accepted
        want = protocol.split_carried(want)[0]
    _check_shapes(want, params)
    tensors = adapter.export(cfg, params)
    shapes = adapter.hf_shapes(cfg, adapter.save_prefix)
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
        eos = list(getattr(cfg, "eos_token_ids", ()))
        own = {"eos_token_id": eos[0] if len(eos) == 1 else eos} if eos else {}
        hf_files.write_json(os.path.join(tmp, "config.json"),
                            {**adapter.to_hf(cfg), **own, **{k: extra[k] for k in _TOKEN_IDS if k in extra}})
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
