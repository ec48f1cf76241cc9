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
tx = jp.train.adamw(1e-3, total_steps=10, axis_names=jax.eval_shape(model.init, jax.random.key(0)))
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
