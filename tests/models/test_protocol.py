"""The model protocol on a model nobody in jaxpar wrote: a tiny causal LM defined here, as plain functions over a
pytree (logical names boxed by hand), with its own kind of cache (running sums, not keys and values).

It is pruned structurally, compacted, trained through a 1F1B pipeline on pipe=2 x fsdp=2 and samples text, each
through the protocol parts only; references are written out here (``jax.value_and_grad`` of its loss on one
device, a sampler that re-runs ``apply`` on the whole window).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_scalar_close, assert_tree_close

import jaxpar as jp


def _box(x, *names):
    return nn.LogicallyPartitioned(x, names)


@dataclasses.dataclass(frozen=True)
class CumLM:
    """Token embedding, ``num_layers`` residual blocks ``x + relu((x + causal_mean(x)) @ w_in + b_in) @ w_out *
    scale``, and an unembedding. Shapes: ``x_BLD``; params ``{"embed", "blocks", "head"}``, blocks stacked
    ``[layers, ...]``. Its cache is each layer's running sum of inputs ``[layers, B, D]``."""
    vocab_size: int = 16
    d_model: int = 8
    d_mlp: int = 12
    num_layers: int = 4
    max_seq_len: int = 10
    stage_key = "blocks"

    def init(self, rng):
        k = jax.random.split(rng, 5)
        N, D, F, V = self.num_layers, self.d_model, self.d_mlp, self.vocab_size
        normal = lambda key, shape, std: std * jax.random.normal(key, shape, jnp.float32)
        return {"embed": {"table": _box(normal(k[0], (V, D), 1.0), "vocab", "embed")},
                "blocks": {"w_in": _box(normal(k[1], (N, D, F), D ** -0.5), "layers", "embed", "mlp"),
                           "b_in": _box(normal(k[2], (N, F), 0.1), "layers", "mlp"),
                           "w_out": _box(normal(k[3], (N, F, D), F ** -0.5), "layers", "mlp", "embed"),
                           "scale": _box(jnp.ones((N, D)), "layers", "embed")},
                "head": {"w": _box(normal(k[4], (D, V), D ** -0.5), "embed", "vocab")}}

    def embed(self, params, tokens_BL):
        return params["embed"]["table"][tokens_BL]

    def _block(self, p, x_BLD, mean_BLD):
        h = jax.nn.relu((x_BLD + mean_BLD) @ p["w_in"] + p["b_in"])
        return x_BLD + (h @ p["w_out"]) * p["scale"]

    def stage(self, blocks, x_BLD):
        for i in range(jax.tree.leaves(blocks)[0].shape[0]):
            p = jax.tree.map(lambda a: a[i], blocks)
            count = jnp.arange(1, x_BLD.shape[1] + 1, dtype=x_BLD.dtype)[None, :, None]
            x_BLD = self._block(p, x_BLD, jnp.cumsum(x_BLD, axis=1) / count)
        return x_BLD

    def _logits(self, params, x):
        return x @ params["head"]["w"]

    def head_loss(self, params, x_BLD, targets_BL):
        logits = self._logits(params, x_BLD)
        one_hot = jax.nn.one_hot(targets_BL, self.vocab_size, dtype=logits.dtype)
        loss = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(logits * one_hot, -1))
        return loss, {"weight": jnp.asarray(targets_BL.size, jnp.float32)}

    def apply(self, params, tokens_BL):
        return self._logits(params, self.stage(params["blocks"], self.embed(params, tokens_BL)))

    def loss(self, params, batch, rng=None):
        return self.head_loss(params, self.stage(params["blocks"], self.embed(params, batch["inputs"])),
                              batch["targets"])

    def check_batch(self, batch):
        for key in ("inputs", "targets"):
            ids = batch[key]
            if not isinstance(ids, jax.Array) and ((np.asarray(ids) < 0) | (np.asarray(ids) >= self.vocab_size)).any():
                raise ValueError(f"CumLM: batch[{key!r}] holds ids outside [0, {self.vocab_size})")

    def prune_groups(self):
        return None   # the mlp axis is held by one module, blocks

    def replace(self, sizes):
        return dataclasses.replace(self, d_mlp=sizes.get(("blocks", "mlp"), self.d_mlp))

    def init_cache(self, params, batch_size, max_len):
        return {"sum": jnp.zeros((self.num_layers, batch_size, self.d_model), jnp.float32)}

    def decode_step(self, params, tokens_B, cache, pos):
        x = self.embed(params, tokens_B)[:, None]
        sums = []
        for i in range(self.num_layers):
            p = jax.tree.map(lambda a: a[i], params["blocks"])
            s = cache["sum"][i] + x[:, 0]
            sums.append(s)
            x = self._block(p, x, (s / (pos + 1).astype(x.dtype))[:, None])
        return self._logits(params, x)[:, 0], {"sum": jnp.stack(sums)}


MODEL = CumLM()


def _batch(seed, rows, model=MODEL):
    ids = np.random.default_rng(seed).integers(0, model.vocab_size, (rows, model.max_seq_len + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _unboxed(model, seed):
    # jitted: op by op, each random.normal shape compiles its own program (~1 CPU-s each)
    return nn.meta.unbox(jax.jit(model.init)(jax.random.key(seed)))


def test_pruned_structurally_and_compacted(mesh_factory):
    """One-shot structured pruning of half the mlp units per layer, then compaction: the smaller model (its own
    ``replace``) computes what the masked model computes, and trains on."""
    mesh = mesh_factory(data=2, tensor=2)
    names = jax.eval_shape(MODEL.init, jax.random.key(0))
    tx = optax.chain(optax.sgd(0.05), jp.pruning.structured_pruning(jp.pruning.one_shot(0.5, 0), axes=("mlp",),
                                                                    axis_names=names))
    state = jp.train.init_state(MODEL.init, tx, 1, mesh=mesh)
    step = jp.train.make_train_step(MODEL.loss, tx, mesh=mesh, donate=False)
    state, _ = step(state, _batch(2, 8))
    masks = jax.device_get(jp.pruning.group_masks(state.opt_state))["blocks"]["mlp"]
    assert masks.shape == (MODEL.num_layers, MODEL.d_mlp) and (masks.sum(-1) == MODEL.d_mlp // 2).all()
    small, small_model = jp.pruning.compact_state(state, MODEL, tx, mesh=mesh)
    assert small_model == dataclasses.replace(MODEL, d_mlp=MODEL.d_mlp // 2)
    assert jax.tree.leaves(small.params["blocks"]["w_in"])[0].shape == (4, 8, 6)

    # reference: the full model on params with the pruned units zeroed, by the masks (written out here)
    params = jax.device_get(state.params)
    keep = masks.astype(np.float32)
    masked = {**params, "blocks": {**params["blocks"], "w_in": params["blocks"]["w_in"] * keep[:, None, :],
                                   "b_in": params["blocks"]["b_in"] * keep,
                                   "w_out": params["blocks"]["w_out"] * keep[:, :, None]}}
    tokens = jnp.asarray(_batch(3, 4)["inputs"])
    assert_tree_close(small_model.apply(jax.device_get(small.params), tokens), MODEL.apply(masked, tokens),
                      what="compacted logits")
    small_step = jp.train.make_train_step(small_model.loss, tx, mesh=mesh)
    small, metrics = small_step(small, _batch(4, 8))
    assert np.isfinite(float(metrics["loss"]))


def test_pipelined_1f1b_matches_one_device(mesh_factory):
    """``Pipeline.from_model`` with 1F1B on pipe=2 x fsdp=2: the loss and gradients of one step equal
    ``jax.value_and_grad(model.loss)`` on one device; stage leaves sharded over fsdp by the state stay so."""
    mesh = mesh_factory(pipe=2, fsdp=2)
    tx = optax.sgd(0.1, momentum=0.9)
    pipe = jp.pipeline.Pipeline.from_model(MODEL, jp.pipeline.one_f_one_b(2, 4))
    state = jp.train.init_state(MODEL.init, tx, 5, mesh=mesh, pipeline=pipe)
    step = jp.train.make_train_step(pipe, tx, mesh=mesh, donate=False)
    batch = _batch(6, 16)
    params = jax.device_get(state.params)
    (loss, _), grads = jax.jit(jax.value_and_grad(MODEL.loss, has_aux=True))(params, batch)
    new_state, metrics = step(state, batch)
    assert_scalar_close(metrics["loss"], loss, what="pipelined loss")
    trace = next(s for s in jax.tree.leaves(new_state.opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                 if isinstance(s, optax.TraceState)).trace
    assert_tree_close(jax.device_get(trace), jax.device_get(grads), what="pipelined grads")
    w_in = new_state.params["blocks"]["w_in"]
    assert "fsdp" in tuple(w_in.sharding.spec), w_in.sharding.spec


def _reference_sample(model, params, prompt, num_tokens, rng, temperature):
    """Sampling without a cache: every token from ``apply`` over the last ``max_seq_len`` tokens."""
    L, apply, tokens = model.max_seq_len, jax.jit(model.apply), list(prompt)
    for i in range(num_tokens):
        window = tokens[-L:]   # padded to L (one compile); causal: the padding after it is not seen
        logits = apply(params, jnp.asarray(window + [0] * (L - len(window)), jnp.int32)[None])[0, len(window) - 1]
        tokens.append(int(jax.random.categorical(jax.random.fold_in(rng, i), logits[:model.vocab_size] / temperature)))
    return tokens[len(prompt):]


def test_generates_with_its_own_cache():
    """``jp.models.generate`` through ``init_cache`` / ``decode_step``: the one-token step equals ``apply`` at
    every position, and the samples equal the cache-free sampler's, also after the window slides."""
    params = _unboxed(MODEL, 7)
    tokens = jnp.asarray(_batch(8, 2)["inputs"])
    cache = MODEL.init_cache(params, 2, MODEL.max_seq_len)
    steps, decode = [], jax.jit(MODEL.decode_step)
    for pos in range(MODEL.max_seq_len):
        logits, cache = decode(params, tokens[:, pos], cache, jnp.int32(pos))
        steps.append(logits)
    assert_tree_close(jnp.stack(steps, 1), MODEL.apply(params, tokens), what="decode_step vs apply")
    rng = jax.random.key(9)
    got = jp.models.generate(MODEL, params, [3, 1, 4], 14, rng, temperature=0.7)   # 3 + 14 > max_seq_len 10
    assert got == _reference_sample(MODEL, params, [3, 1, 4], 14, rng, 0.7)
    assert all(0 <= t < MODEL.vocab_size for t in got)


def test_train_step_checks_host_batches_by_default(mesh_factory):
    mesh = mesh_factory(data=2)
    tx = optax.sgd(0.1)
    state = jp.train.init_state(MODEL.init, tx, 0, mesh=mesh)
    bad = _batch(1, 4)
    bad["inputs"][1, 2] = MODEL.vocab_size
    with pytest.raises(ValueError, match="CumLM"):
        jp.train.make_train_step(MODEL.loss, tx, mesh=mesh)(state, bad)
    _, metrics = jp.train.make_train_step(MODEL.loss, tx, mesh=mesh, check_batch=None, donate=False)(state, _batch(1, 4))
    assert np.isfinite(float(metrics["loss"]))


class _NoParts:
    """A model with only the core parts."""
    vocab_size, max_seq_len = 5, 4
    init, apply, loss = MODEL.init, MODEL.apply, MODEL.loss


@pytest.mark.parametrize("feature,part", [("generate", "init_cache"), ("pipeline", "embed"), ("compact", "replace")])
def test_missing_part_is_named(feature, part):
    model = _NoParts()
    with pytest.raises(TypeError, match=f"'{part}'"):
        if feature == "generate":
            jp.models.generate(model, {}, [1], 2, jax.random.key(0))
        elif feature == "pipeline":
            jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 2))
        else:
            params = _unboxed(MODEL, 0)
            names = jax.eval_shape(MODEL.init, jax.random.key(0))
            tx = jp.pruning.structured_pruning(0.5, axes=("mlp",), axis_names=names)
            jp.pruning.compact(params, tx.init(params), model)


def test_shape_suffixes_of_every_model_are_in_the_legend():
    """Every ``name_SUFFIX`` array name in jaxpar/models uses letters of the one legend (SHAPE_LEGEND)."""
    legend = jp.models.SHAPE_LEGEND
    assert all(isinstance(axis, (str, type(None))) for _, axis in legend.values())
    used = {}
    for path in (Path(jp.__file__).parent / "models").glob("*.py"):
        for suffix in re.findall(r"\b[a-z][a-z0-9]*_([A-Z]{1,5})\b", path.read_text()):
            used.setdefault(suffix, path.name)
    assert used, "no shape-suffixed name found: the scan is broken"
    unknown = {s: f for s, f in used.items() if any(letter not in legend for letter in s)}
    assert not unknown, f"suffix letters outside jp.models.SHAPE_LEGEND: {unknown}"


@pytest.mark.parametrize("replace,error,match", [
    (lambda self, sizes: None, TypeError, "neither a model nor a config"),
    (lambda self, sizes: self, ValueError, "must set the kept counts"),
    (lambda self, **fields: self, TypeError, "flax.struct or chex dataclass"),
])
def test_compaction_checks_what_replace_returns(replace, error, match):
    """A model whose replace returns no model, forgets to shrink, or is a dataclass' replace(**fields)."""
    Bad = type("Bad", (CumLM,), {"replace": replace})
    model = Bad()
    params = _unboxed(model, 0)
    keep = np.zeros((model.num_layers, model.d_mlp), bool)
    keep[:, ::2] = True                      # half the mlp units of every layer
    masks = {"blocks": {"mlp": keep}}        # group masks, as jp.pruning.group_masks gives them
    with pytest.raises(error, match=match):
        jp.pruning.compact(params, masks, model)


def test_shards_activations_is_read_from_the_loss_its_model_or_an_nnx_class():
    """Built-in models that constrain their activations declare it; a lambda hides it; a bad value is named."""
    from flax import nnx

    from jaxpar.train import nnx_bridge
    from jaxpar import protocol
    mlp = jp.models.MLP(hidden=(8,))
    declared = [jp.models.GPT(jp.models.GPTConfig(vocab_size=8, num_layers=1, num_heads=1, d_model=8)).loss,
                jp.models.Llama(jp.models.LlamaConfig(vocab_size=8, num_layers=1, num_heads=1, d_model=8)).loss,
                jp.models.MLPModel(mlp, 4).loss, jp.models.classification_loss(mlp)]
    assert all(protocol.shards_activations(fn) for fn in declared)
    assert not protocol.shards_activations(MODEL.loss, lambda p, b, r: declared[0](p, b, r), None)

    class Declares(nnx.Module):
        shards_activations = True

        def __init__(self):
            self.w = nnx.Param(np.zeros(2, np.float32))
    graphdef = nnx.graphdef(Declares())
    assert nnx_bridge.module_class(graphdef) is Declares and nnx_bridge.module_class(None) is None
    assert protocol.shards_activations(MODEL.loss, nnx_bridge.module_class(graphdef))
    bad = type("Bad", (), {"shards_activations": "yes", "loss": lambda self, params, batch, rng: None})()
    with pytest.raises(TypeError, match=r"Bad.shards_activations='yes' must be True \(its activations .*\) or False"):
        protocol.shards_activations(bad.loss)
