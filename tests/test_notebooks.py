"""Executes every notebook in ``notebooks/`` top to bottom in a fresh Jupyter kernel, as the tutorial's test.

For each ``notebooks/*.ipynb`` (found by glob, so a new notebook is picked up and must declare its figures in
``FIGURES``), before running anything it checks that the committed file has no outputs (every code cell's
``outputs`` empty and ``execution_count`` null), that its first code cell sets the simulated device count
before importing JAX, and that no code uses an underscore-prefixed (private) name, so the notebooks exercise
only jaxpar's public API. Then it executes the notebook with nbclient (the library behind nbmake) in a new
``python3`` kernel started from this interpreter, with its working directory in ``notebooks/`` and a per-cell
timeout; a failing cell fails the test with that cell's source and traceback. It asserts the notebook drew at
least its declared number of figures (``image/png`` outputs) and records its wall-clock runtime
(``record_property("runtime_s")``, printed; never asserted).

The kernel inherits this process's environment (``XLA_FLAGS`` for 8 CPU devices and ``JAX_PLATFORMS=cpu``, from
``conftest.py``) and uses the suite's persistent compilation cache (``.jax_cache``), so a rerun compiles less;
on an empty cache every notebook compiles everything it runs.
"""

from __future__ import annotations

import ast
import os
import re
import time
from pathlib import Path

import jax
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 240      # per cell; each notebook takes well under a minute on the 2-core CPU

# Figures (image/png outputs) each notebook draws at least: one per required picture.
FIGURES = {
    "01_quickstart.ipynb": 1,             # the loss curve
    "02_mesh_and_sharding.ipynb": 5,      # 2 array-sharding pictures, per-device memory, collective counts, bytes
    "03_pipeline_schedules.ipynb": 7,     # a Gantt chart for each of the 5 schedules, bubble vs m, compiled memory
    "04_mixed_precision.ipynb": 3,        # fp16 loss scale over steps, loss curves by dtype, saved activation bytes
    "05_pruning.ipynb": 5,                # schedule, schedule with measured sparsity, per-layer sparsity, 2:4 mask,
                                          # accuracy vs sparsity
    "06_charlm_end_to_end.ipynb": 1,      # the loss curve across the checkpoint restore
    "07_plan_a_gpu_run.ipynb": 1,         # time per step split into compute, exposed communication and bubble
    "08_experts.ipynb": 3,                # expert load over training, characters' experts, dispatch collectives
    "09_finetune_hugging_face.ipynb": 1,  # the fine-tuning loss curve (train and validation)
}
# Notebooks that compile for compile-only GPUs (jp.plan.gpu_target): they need the jax CUDA plugin (the gpu extra).
NEEDS_CUDA_PLUGIN = ("07_plan_a_gpu_run.ipynb",)
DEVICE_FLAG = 'os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")'
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
DOTTED = re.compile(r"\b(?:jp|jaxpar)(?:\.\w+)+")


def is_private(name: str) -> bool:
    """A single-underscore name (``_x``, ``__x``); dunders (``__version__``) and the throwaway ``_`` are not."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def private_names(source: str) -> list[str]:
    """Every underscore-prefixed identifier a code cell uses: names, attributes, imports (module paths
    included), definitions, arguments and keywords; plus dotted ``jp._x`` / ``jaxpar.x._y`` paths anywhere in
    the text (strings included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.append(node.id)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [part for alias in node.names for part in alias.name.split(".")]
            found += [alias.asname for alias in node.names if alias.asname]
            if isinstance(node, ast.ImportFrom) and node.module:
                found += node.module.split(".")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node.name)
        elif isinstance(node, ast.arg):
            found.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.append(node.arg)
    dotted = [path for path in DOTTED.findall(source) if any(is_private(part) for part in path.split("."))]
    return [n for n in found if is_private(n)] + dotted


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def check_committed(path: Path, nb) -> None:
    """The static checks of a notebook as committed (no kernel needed)."""
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} have outputs or an execution count; commit notebooks "
                       "with outputs stripped (e.g. jupyter nbconvert --clear-output --inplace)")
    first = code_cells(nb)[0].source
    assert DEVICE_FLAG in first and first.index(DEVICE_FLAG) < first.index("import jax"), (
        f"{path.name}: the first code cell must run {DEVICE_FLAG} before importing jax")
    for i, cell in enumerate(nb.cells):
        bad = (private_names(cell.source) if cell.cell_type == "code" else
               [p for p in DOTTED.findall(cell.source) if any(is_private(part) for part in p.split("."))])
        assert not bad, (f"{path.name}: cell {i} uses underscore-prefixed names {bad}; notebooks use only "
                         "public names")


def kernel_env() -> dict[str, str]:
    """This process's environment, plus the persistent compilation cache conftest configured (``.jax_cache``),
    passed as the environment variables JAX reads its options from, so reruns of the notebooks compile less."""
    env = dict(os.environ)
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def execute(path: Path, nb) -> float:
    """Runs every cell in a fresh kernel; fails with the failing cell's error. Returns seconds taken."""
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    with client.setup_kernel(env=kernel_env()):
        for index, cell in enumerate(nb.cells):
            try:
                client.execute_cell(cell, index)
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
                text = ANSI.sub("", str(e))      # the cell's source, then its traceback
                text = text if len(text) < 9000 else f"{text[:3000]}\n[...]\n{text[-6000:]}"
                pytest.fail(f"{path.name}: cell {index} failed ({type(e).__name__}):\n{text}", pytrace=False)
    return time.perf_counter() - start


def count_figures(nb) -> int:
    return sum("image/png" in out.get("data", {}) for c in code_cells(nb) for out in c.outputs)


def test_private_names_finds_underscores():
    source = ("import jaxpar._optional\nfrom jaxpar.train import _as_key as k\nx = jp._compat.y\n_y = 1\n"
              "def f(_a, b=jp.plot._png): return g(_k=1)\ns = 'jp.plot._write'\nfor _ in range(2): print(jax.__version__)")
    assert sorted(private_names(source)) == sorted(
        ["_optional", "_as_key", "_compat", "_y", "_a", "_png", "_k",                  # identifiers
         "jaxpar._optional", "jp._compat.y", "jp.plot._png", "jp.plot._write"])       # dotted paths, strings too
    assert private_names("import jaxpar as jp\njp.plot.loss_curve(rows)\nprint(jax.__version__, jp.pipeline.__all__)") == []


# Every notebook runs in the slow set (a kernel each, ~17 to 33 CPU-s); their committed form is checked fast
# (test_notebook_is_committed_clean) and their code paths have fast tests: 01 (quickstart) in
# test_readme_example_runs_and_trains (a documented block run as written), test_mesh.py (describe),
# test_sharding.py and test_placement.py (rules, describe_params), test_optim.py (adamw with the GPT's axis names
# on data x fsdp x tensor), test_loop.py (run_steps), test_data.py (CharCorpus); 06 (charlm end to end) in
# pipeline/test_model.py (the GPT's 1F1B step on data x pipe x tensor), test_checkpoint.py (restore on another
# mesh), test_loop.py (loop.run with the checkpoint hook), models/test_generation.py, test_plot.py.
FAST_NOTEBOOKS = ()
ALL_NOTEBOOKS = sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path: Path):
    """The static checks of every notebook (no kernel): outputs stripped, the device count set before jax,
    public names only, its figures declared."""
    assert path.name in FIGURES, f"{path.name}: declare how many figures it draws in FIGURES"
    check_committed(path, nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p.name in FAST_NOTEBOOKS else [pytest.mark.slow])
                                  for p in ALL_NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs(path: Path, record_property):
    assert path.name in FIGURES, f"{path.name}: declare how many figures it draws in FIGURES"
    nb = nbformat.read(path, as_version=4)
    check_committed(path, nb)
    if path.name in NEEDS_CUDA_PLUGIN:
        from jaxpar.plan import targets
        try:
            targets.check_cuda_plugin()
        except (ImportError, RuntimeError) as e:
            pytest.skip(f"{path.name} compiles for compile-only H100s and needs the jax CUDA plugin (the gpu extra): {e}")
    seconds = execute(path, nb)
    record_property("runtime_s", round(seconds, 1))
    print(f"{path.name}: {seconds:.1f} s, {count_figures(nb)} figures")
    assert count_figures(nb) >= FIGURES[path.name], (
        f"{path.name} drew {count_figures(nb)} figures (image/png outputs), expected at least {FIGURES[path.name]}")
