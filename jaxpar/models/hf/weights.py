"""The pieces a Hugging Face weight adapter is made of: readers that give one device's block of a jaxpar leaf from
the checkpoint's tensors (lazily, through :class:`jaxpar.models.hf.files.Reader`), and :class:`Adapter`, the table
of one family's weights (:mod:`jaxpar.models.hf.gpt2`, :mod:`jaxpar.models.hf.llama`) that
:mod:`jaxpar.models.hf.checkpoint` dispatches on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np

from jaxpar.models.hf.files import Reader


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One model family's Hugging Face weights: how its checkpoints map to a jaxpar config, model and params.

    A leaf reader is ``(reader, index) -> numpy block`` of the jaxpar leaf at ``index`` (a tuple of slices); an
    export thunk ``() -> numpy tensor`` gives one HF tensor (float32) of the params.
    """
    model_type: str                                  # HF config.json's model_type
    config_type: type                                # the jaxpar config class
    model: Callable[[Any], Any]                      # config -> model
    from_hf: Callable[..., Any]                      # (config.json dict, **overrides) -> config
    to_hf: Callable[[Any], dict]                     # config -> config.json dict
    prefix: Callable[[Any], str]                     # the tensor files' names -> the prefix their names carry
    save_prefix: str                                 # the prefix save writes (save_pretrained's)
    hf_shapes: Callable[[Any, str], dict]            # (config, prefix) -> {HF tensor name: shape}
    leaves: Callable[[Any, str], dict]               # (config, prefix) -> the params tree of leaf readers
    export: Callable[[Any, dict], dict]              # (config, params) -> {HF tensor name: export thunk}
    check_save: Callable[[Any], None] = lambda cfg: None   # raises ValueError for a config with no HF checkpoint
    accepts: Callable[[Any], bool] = lambda cfg: True    # whether it writes this config (one config class, several
                                                         # families: the family's adapter)
    saves: bool = True                               # False: it reads checkpoints only (another adapter writes them)
    left_on_disk: tuple[str, ...] = ()               # name prefixes of tensors it does not read (a vision tower)


def host(a: Any) -> np.ndarray:
    """A (device) array as a float32 numpy array on the host."""
    return np.asarray(jax.device_get(a), np.float32)


def span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    assert step == 1
    return start, stop


# A leaf's reader: (reader, index tuple of the jaxpar leaf) -> numpy block. Built per leaf below.
def linear(name: Callable[[int], str], view: tuple[int, ...], rows: int, out_axes: tuple[int, ...],
            layers: int | None):
    """A jaxpar leaf that is ``HF[out, in]`` (or a stack over layers of them) reshaped to ``view``: its first
    ``rows`` axes split the HF rows, the rest the columns; the leaf is ``view`` with view axis ``a`` as leaf axis
    ``out_axes[a]``. A block reads the contiguous rows and columns covering it, then cuts the inner axes."""
    def covering(vsl: list[slice], dims: tuple[int, ...]) -> slice:
        lo, hi = span(vsl[0], dims[0])
        inner = math.prod(dims[1:])
        return slice(lo * inner, hi * inner)

    def read(reader: Reader, index: tuple[slice, ...], layer: int) -> np.ndarray:
        idx = index[1:] if layers is not None else index
        vsl = [idx[out_axes[a]] for a in range(len(view))]
        r, c = covering(vsl[:rows], view[:rows]), covering(vsl[rows:], view[rows:])
        lead_r, lead_c = span(vsl[0], view[0]), span(vsl[rows], view[rows])
        shape = (lead_r[1] - lead_r[0],) + view[1:rows] + (lead_c[1] - lead_c[0],) + view[rows + 1:]
        block = reader.read(name(layer), r, c).reshape(shape)
        cut = (slice(None),) + tuple(vsl[1:rows]) + (slice(None),) + tuple(vsl[rows + 1:])
        return np.transpose(block[cut], np.argsort(out_axes))

    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return read(reader, index, 0)
        lo, hi = span(index[0], layers)
        return np.stack([read(reader, index, i) for i in range(lo, hi)])
    return leaf


def vector(name: Callable[[int], str], layers: int | None):
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return reader.read(name(0), index[0])
        lo, hi = span(index[0], layers)
        return np.stack([reader.read(name(i), index[1]) for i in range(lo, hi)])
    return leaf


def vocab_rows(name: str, vocab: int, transpose: bool):
    """``[V, D]`` HF table as the padded ``[Vp, D]`` (or, ``transpose``, ``[D, Vp]``) leaf; padding rows are 0."""
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        vsl, dsl = (index[1], index[0]) if transpose else index
        lo, hi = vsl.start or 0, vsl.stop
        d0, d1 = span(dsl, reader.shape(name)[1])
        out = np.zeros((hi - lo, d1 - d0), np.float32)
        if lo < vocab:
            out[: min(hi, vocab) - lo] = reader.read(name, slice(lo, min(hi, vocab)), slice(d0, d1))
        return out.T if transpose else out
    return leaf


def small(name: Callable[[int], str], transform: Callable[[np.ndarray], np.ndarray], layers: int | None):
    """A small leaf (a bias) read whole, reshaped by ``transform``, then cut to the block."""
    def leaf(reader: Reader, index: tuple[slice, ...]) -> np.ndarray:
        if layers is None:
            return transform(reader.read(name(0), slice(None)))[index]
        lo, hi = span(index[0], layers)
        return np.stack([transform(reader.read(name(i), slice(None)))[index[1:]] for i in range(lo, hi)])
    return leaf


def checkpoint_shapes(top: dict, per_layer: dict, layer_prefix: str, num_layers: int,
                      head: tuple[int, ...] | None) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a family's checkpoint holds: the ``top`` entries, ``lm_head.weight`` of shape ``head``
    (None: a tied head, no such tensor), and each ``per_layer`` entry under ``f"{layer_prefix}{i}."`` for every
    layer ``i``."""
    want = dict(top)
    if head is not None:
        want["lm_head.weight"] = head
    for i in range(num_layers):
        want.update({f"{layer_prefix}{i}.{k}": v for k, v in per_layer.items()})
    return want


