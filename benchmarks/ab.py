"""In-process A/B of jaxpar train-step variants: the way to measure a speed change on a shared machine.

    python benchmarks/ab.py --model llama --variants tree,autodiff_attention,opt:
                            [--rounds 15] [--steps-per-round 4] [--clock wall|cpu] [--patches my_patches.py]
                            [vs_pytorch.py's model options: --batch --seq --layers --d-model --heads ...]

Every variant's step is traced and compiled in this one process (the model and data of
``benchmarks/vs_pytorch.py``: ``--model gpt|llama|qwen3|gemma3`` at the same sizes, the same batches), then the
rounds alternate between them (each round: every variant runs ``--steps-per-round`` steps, in turn). The JSON gives
per variant the median ms/step (min and max over rounds) and the median over rounds of ``first variant's time /
this variant's time`` (above 1: this variant is faster). On the 2-core VM fresh-process timings of one and the same
tree drifted +-10% within minutes, so only a ratio measured within one process is read as a speed change.

A variant is ``tree`` (the step as the package builds it), ``opt:NAME=VALUE[;NAME=VALUE]`` (the step compiled
with these XLA compiler options in place of :data:`jaxpar.train._jit.CPU_COMPILER_OPTIONS`; ``opt:`` alone:
XLA's defaults), or a name in :data:`PATCHES` (code changes applied while that variant's step is traced and
compiled, and undone after; ``--patches FILE`` runs a file that registers more with ``@ab.patch("name")``). Each
variant's first losses are printed: a variant that changes the computation shows it there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from typing import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import jaxpar as jp  # noqa: E402
import torch_hf  # noqa: E402
import vs_pytorch  # noqa: E402
from jaxpar.layers import attention, attention_blocks  # noqa: E402
from jaxpar.train import _jit  # noqa: E402

# name -> a context manager factory: the code change, in place while the variant's step is traced and compiled.
PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}


def patch(name: str):
    """Registers a generator function (one ``yield`` between applying and undoing a change) as variant ``name``;
    raises ValueError for a name that ``tree`` or ``opt:`` would shadow, or one with a ``,`` or ``#``."""
    if name == "tree" or name.startswith("opt:") or any(c in name for c in ",#") or not name:
        raise ValueError(f"patch name {name!r}: pick another (not 'tree', not 'opt:...', no ',' or '#')")

    def register(fn):
        PATCHES[name] = contextlib.contextmanager(fn)
        return fn
    return register


@contextlib.contextmanager
def _setattr(obj, attr: str, value) -> Iterator[None]:
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


@patch("autodiff_attention")
def _autodiff_attention():
    """The one-device attention block's backward pass derived by ``jax.grad`` instead of written out (the
    comparison behind ``jaxpar.layers.attention_blocks.whole``'s custom VJP)."""
    with _setattr(attention, "_whole", lambda q, k, v, visible: attention_blocks.whole_fwd(q, k, v, visible)[0]):
        yield


def compile_options(spec: str) -> dict[str, str]:
    """The options of an ``opt:NAME=VALUE[;...]`` variant, each checked by a tiny compile (so a name or value XLA
    refuses fails here, naming the variant, before any step is built; booleans are ``True`` / ``False``)."""
    options = {}
    for item in filter(None, spec[len("opt:"):].split(";")):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"variant {spec!r}: {item!r} is not NAME=VALUE (e.g. opt:xla_cpu_use_onednn=True)")
        options[name.strip()] = value.strip()
    try:
        jax.jit(lambda x: x + 1, compiler_options=options or None).lower(
            jax.ShapeDtypeStruct((2,), "float32")).compile()
    except Exception as e:   # noqa: BLE001 - XLA's refusal, reworded with the variant
        raise ValueError(f"variant {spec!r}: XLA refuses these options ({str(e).splitlines()[0]}); booleans are "
                         "True / False") from None
    return options


def variant_context(spec: str) -> contextlib.AbstractContextManager:
    """The context a variant's step is built and compiled in (see the module docstring; ``NAME#2`` is ``NAME`` again,
    for an A/A run); raises ValueError for an unknown ``spec`` or options XLA refuses."""
    spec = spec.split("#", 1)[0]
    if spec == "tree":
        return contextlib.nullcontext()
    if spec.startswith("opt:"):
        options = compile_options(spec)
        return _setattr(_jit, "compiler_options", lambda mesh: options or None)
    if spec in PATCHES:
        return PATCHES[spec]()
    raise ValueError(f"variant {spec!r}: use 'tree', 'opt:NAME=VALUE[;...]' or one of {sorted(PATCHES)}")


def _variants(text: str) -> list[str]:
    """``--variants``: comma-separated, a repeated one numbered (``tree,tree`` -> ``tree``, ``tree#2``: an A/A run)."""
    out = []
    for v in (v.strip() for v in text.split(",")):
        if not v:
            raise argparse.ArgumentTypeError(f"--variants {text!r} has an empty entry")
        n = sum(1 for o in out if o.split("#", 1)[0] == v)
        out.append(v if n == 0 else f"{v}#{n + 1}")
    return out


def build_variant(spec: str, model, init_fn, lr: float, warm_batches) -> tuple[Callable, list[float]]:
    """``(run(batches) -> last loss, first losses)``: the variant's step, compiled and warmed up on
    ``warm_batches`` inside its context."""
    with variant_context(spec):
        run, _, _ = vs_pytorch.build_jaxpar(model, init_fn, lr)
        losses = [run([b]) for b in warm_batches]
    return run, losses


def measure(args) -> dict:
    if args.model in vs_pytorch.HF_FAMILIES and args.checkpoint is None:
        with tempfile.TemporaryDirectory() as d:
            return measure(argparse.Namespace(**{**vars(args), "checkpoint": d}))
    for spec in args.variants:
        variant_context(spec)   # refuses an unknown variant before anything is built
    corpus = jp.data.CharCorpus.load()
    if args.model in vs_pytorch.HF_FAMILIES:
        torch_hf.save_random(args.model, args.checkpoint, **vs_pytorch.hf_sizes(args, corpus.vocab_size))
    model, init_fn = vs_pytorch.make_model(args, corpus)
    first = args.warmup_steps
    batches = [corpus.batch(0, t, args.batch, args.seq) for t in range(first + args.rounds * args.steps_per_round)]
    runs, losses = {}, {}
    for spec in args.variants:
        runs[spec], losses[spec] = build_variant(spec, model, init_fn, args.lr, batches[:first])
    clock = vs_pytorch.CLOCKS[args.clock]
    samples = {spec: [] for spec in runs}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        chunk = batches[first + r * args.steps_per_round: first + (r + 1) * args.steps_per_round]
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]   # neither variant always runs first
        for spec in order:
            start = clock()
            runs[spec](chunk)
            samples[spec].append((clock() - start) / len(chunk))
    base = args.variants[0]
    out = {}
    for spec, ts in samples.items():
        ratio = [b / t for b, t in zip(samples[base], ts)]
        out[spec] = {"ms_per_step": round(1e3 * statistics.median(ts), 2),
                     "ms_min_max": [round(1e3 * min(ts), 2), round(1e3 * max(ts), 2)],
                     f"speedup_over_{base}": round(statistics.median(ratio), 4),
                     "speedup_min_max": [round(min(ratio), 3), round(max(ratio), 3)],
                     "first_losses": [round(x, 6) for x in losses[spec]]}
    return {"cpu_model": vs_pytorch.cpu_model(), "jax": jax.__version__, "model": args.model, "batch": args.batch,
            "seq": args.seq, "layers": model.cfg.num_layers, "d_model": model.cfg.d_model, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "clock": args.clock,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),   # with the rendezvous limit `import jaxpar` sets
            "variants": out,
            "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", type=_variants, default=["tree", "opt:"],
                    help="comma-separated; the first is the baseline of the ratios; a repeated one runs again (A/A)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument("--warmup-steps", type=int, default=3, help=">= 1: the first compiles the variant's step")
    ap.add_argument("--clock", choices=list(vs_pytorch.CLOCKS), default="wall")
    ap.add_argument("--no-reuse-host-memory", dest="reuse_host_memory", action="store_false",
                    help="skip jp.tools.cpu.reuse_host_memory() (as vs_pytorch.py)")
    ap.add_argument("--patches", default=None,
                    help="a Python file registering more variants with @ab.patch (experiments outside the package)")
    vs_pytorch.add_model_args(ap)   # the model, data and sizes: vs_pytorch.py's options
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    args.model_module = None
    for flag, value in (("--rounds", args.rounds), ("--steps-per-round", args.steps_per_round),
                        ("--warmup-steps", args.warmup_steps)):
        if value < 1:   # the first warm-up step compiles the variant inside its context
            raise ValueError(f"{flag}={value} must be >= 1")
    if args.patches:
        import runpy
        sys.modules.setdefault("ab", sys.modules[__name__])
        runpy.run_path(args.patches)
    return vs_pytorch.run_and_print(measure, args)


if __name__ == "__main__":
    main()
