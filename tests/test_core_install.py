"""``import jaxpar`` needs only the core dependencies, and changes no global state.

Each check runs in a fresh interpreter: one where the optional libraries cannot be imported (a meta-path hook
refuses them, as in a venv with ``pip install .`` and no extras) imports jaxpar and trains a step; one with
matplotlib installed checks that importing jaxpar neither imports it nor picks its backend.
"""

import os
import subprocess
import sys
import textwrap

import pytest

OPTIONAL = ("matplotlib", "tqdm", "tyro", "tensorboardX", "sklearn", "IPython")

_BLOCK = f"""
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ImportError(f"{{name}} is not installed (refused by the test)")
        return None
sys.meta_path.insert(0, _Refuse())
"""


def run(code: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_core_only_import_and_one_training_step(tmp_path):
    out = run(_BLOCK + """
import jax, jax.numpy as jnp, numpy as np, optax
import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
model = GPT(GPTConfig(vocab_size=50, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
tx = jp.optim.adamw(1e-3, total_steps=10, axis_names=jax.eval_shape(model.init, jax.random.key(0)))
state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch)
rng = np.random.default_rng(0)
batch = {k: rng.integers(0, 50, (8, 8)).astype(np.int32) for k in ("inputs", "targets")}
state, metrics = step(state, batch)
assert np.isfinite(float(metrics["loss"]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {OPTIONAL!r})
assert not loaded, loaded
try:
    jp.plot.loss_curve([{"step": 0, "loss": 1.0}], "x.png")
except ImportError as e:
    assert "jaxpar[experiments]" in str(e) and "matplotlib" in str(e), e
else:
    raise AssertionError("plotting without matplotlib must raise ImportError")
try:
    jp.metrics.MetricsWriter("run_dir", tensorboard=True)
except ImportError as e:
    assert "jaxpar[experiments]" in str(e) and "tensorboardX" in str(e), e
else:
    raise AssertionError("TensorBoard logging without tensorboardX must raise ImportError")
print("ok", float(metrics["loss"]))
""".replace("{OPTIONAL!r}", repr(OPTIONAL)), tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_import_jaxpar_changes_no_matplotlib_state(tmp_path):
    out = run("""
import sys, matplotlib
backend = matplotlib.rcParams._get_backend_or_none()
import jaxpar
assert "matplotlib.pyplot" not in sys.modules
assert matplotlib.rcParams._get_backend_or_none() == backend, (backend, matplotlib.get_backend())
print("ok")
""", tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "pip install 'jaxpar[experiments]' (from a checkout: pip install -e '.[experiments]')"


def test_experiments_extra_lists_pyproject_libraries():
    """jaxpar._optional.EXTRAS names, by import name, exactly the libraries of pyproject.toml's extra."""
    import re
    import tomllib

    from jaxpar._optional import EXTRAS
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        wanted = tomllib.load(f)["project"]["optional-dependencies"]["experiments"]
    import_names = {"scikit-learn": "sklearn"}  # pip name -> import name
    names = {import_names.get(n, n) for n in (re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in wanted)}
    assert set(EXTRAS["experiments"]) == names
    assert len(EXTRAS["experiments"]) == len(names)


def test_require_extra_rejects_an_unknown_extra():
    from jaxpar.cli import experiment
    with pytest.raises(ValueError, match="extra='bench'"):
        experiment.require_extra("x", extra="bench")


def run_script(name: str, block: str) -> subprocess.CompletedProcess:
    """``python experiments/<name>.py --help`` from the repository root, after ``block`` ran."""
    return run(block + f"""
import runpy
sys.path.insert(0, "experiments")   # as `python experiments/{name}.py` puts the script's directory first
sys.argv = ["experiments/{name}.py", "--help"]
runpy.run_path("experiments/{name}.py", run_name="__main__")
""", ROOT)


@pytest.mark.parametrize("name", ["charlm", "digits", "prune_sweep"])
def test_entry_point_without_the_extra_names_it(name):
    """On a core-only install every experiment fails at start with one ImportError naming the script, every
    missing library of the extra, and the pip command; no bare ModuleNotFoundError."""
    out = run_script(name, _BLOCK)
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: experiments/{name}.py needs the 'experiments' extra, and tyro, tqdm, "
                    f"tensorboardX, matplotlib, scikit-learn are not installed: {INSTALL}"), out.stderr[-3000:]
    assert "ModuleNotFoundError" not in out.stderr and "usage" not in out.stdout


def test_entry_point_names_only_the_missing_library():
    """Only tyro missing (``sys.modules['tyro'] = None``, as Python marks a failed import): only tyro named."""
    out = run_script("digits", "import sys\nsys.modules['tyro'] = None\n")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"ImportError: experiments/digits.py needs the 'experiments' extra, and tyro is not installed: {INSTALL}")
