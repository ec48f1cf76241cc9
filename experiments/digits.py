"""An MLP classifier on scikit-learn's bundled 8x8 digits, on a data x fsdp x tensor mesh.

Command::

    python experiments/digits.py                 # CPU: 8 simulated devices, data=2 x fsdp=2 x tensor=2

    python experiments/digits.py --sparsity 0.9 --distribution global   # gradual magnitude pruning
    python experiments/digits.py --n-m 2 4                                # 2:4 structured sparsity

Expected (2-core CPU): 10-20 seconds; test accuracy about 97-98% (at least 95%), also at 90% global sparsity.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log_devices, simulate_cpu_devices  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """Digits MLP configuration."""
    data: int = -1                      # data-parallel axis size (-1: the devices left over)
    fsdp: int = 2                       # FSDP axis size
    tensor: int = 2                     # tensor-parallel axis size
    simulate_devices: int = 8           # host CPU devices to simulate when running on CPU
    hidden: tuple[int, ...] = (256, 256)  # hidden layer widths (divisible by tensor)
    steps: int = 600                    # optimizer steps
    batch_size: int = 64                # global batch
    learning_rate: float = 2e-3         # peak AdamW learning rate
    weight_decay: float = 1e-4          # decoupled weight decay on kernels
    seed: int = 0                       # seeds init and data order
    out_dir: str = "runs/digits"        # metrics and the loss plot go here
    sparsity: float = 0.0               # final fraction of pruned kernel weights (0: dense; with n_m: 1 - N/M)
    distribution: Literal["uniform", "global", "erk"] = "uniform"  # uniform, global (one threshold) or erk
    n_m: tuple[int, int] | None = None  # N:M structured sparsity along each kernel's input axis, e.g. 2 4
    prune_begin: int = 60               # first pruning step (Zhu & Gupta gradual schedule, cubic ramp)
    prune_end: int = 300                # step at which the final sparsity is reached (masks fixed after)
    prune_frequency: int = 10           # steps between mask refreshes

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"--hidden {self.hidden} needs at least one layer, every width >= 1")
        if self.learning_rate <= 0 or self.seed < 0:
            raise ValueError(f"need --learning-rate > 0 and --seed >= 0, got {self.learning_rate}, {self.seed}")
        # Pruning settings are checked here without importing jax (it must come after simulate_cpu_devices).
        if not 0 <= self.sparsity < 1 or self.distribution not in ("uniform", "global", "erk"):
            raise ValueError(f"need 0 <= --sparsity < 1 and --distribution uniform|global|erk, got "
                             f"{self.sparsity}, {self.distribution!r}")
        if self.n_m is not None and not 0 < self.n_m[0] < self.n_m[1]:
            raise ValueError(f"--n-m {self.n_m} must be N M with 0 < N < M, e.g. 2 4")
        if self.pruned and not 0 <= self.prune_begin < self.prune_end <= self.steps:
            raise ValueError(f"need 0 <= prune_begin < prune_end <= steps, got {self.prune_begin}, "
                             f"{self.prune_end}, {self.steps}; pick pruning steps inside the run")

    @property
    def pruned(self) -> bool:
        return self.sparsity > 0 or self.n_m is not None

    def pruning(self, axis_names):
        """The magnitude_pruning transformation this config asks for (raises ValueError on a bad setting)."""
        import jaxpar as jp
        final = self.sparsity if self.sparsity > 0 else 1 - self.n_m[0] / self.n_m[1]
        schedule = jp.pruning.polynomial_sparsity(final, self.prune_begin, self.prune_end,
                                                  frequency=self.prune_frequency)
        return jp.pruning.magnitude_pruning(schedule, self.distribution, self.n_m, axis_names=axis_names)


def main(cfg: Config) -> float:
    """Trains and returns the test accuracy."""
    return run(cfg)["accuracy"]


def run(cfg: Config) -> dict[str, float]:
    """Trains; returns the test metrics (``accuracy``, ``loss``) and the kernels' ``sparsity``."""
    simulate_cpu_devices(cfg.simulate_devices)
    import jax
    import optax
    from tqdm import tqdm

    import jaxpar as jp
    from jaxpar.models import MLP, classification_loss

    digits = jp.data.Digits.load(seed=cfg.seed)
    mesh = jp.make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor)
    log_devices(mesh)
    model = MLP(hidden=cfg.hidden, num_classes=10)
    init_fn = lambda rng: model.init(rng, digits.x_train[:1])["params"]
    loss_fn = classification_loss(model)
    axis_names = jax.eval_shape(init_fn, jax.random.key(0))   # logical names: what each leaf is
    tx = jp.train.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=cfg.steps // 20,
                        weight_decay=cfg.weight_decay, b2=0.999, clip_norm=None, axis_names=axis_names)
    if cfg.pruned:
        tx = optax.chain(tx, cfg.pruning(axis_names))
    state = jp.train.init_state(init_fn, tx, jax.random.key(cfg.seed), mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    evaluate = jp.train.make_eval_step(loss_fn, mesh=mesh)
    writer = jp.metrics.MetricsWriter(cfg.out_dir, tensorboard=False)
    batch_fn = lambda t: digits.batch(cfg.seed, t, cfg.batch_size)
    for t, m, state in tqdm(jp.train.run_steps(step, state, batch_fn, 0, cfg.steps), total=cfg.steps,
                            disable=jax.process_index() != 0, mininterval=1.0):
        writer.write(t + 1, m)
    test = {k: float(v) for k, v in evaluate(state, digits.test_set(multiple=jax.device_count())).items()}
    test["sparsity"] = jp.pruning.sparsity_report(state.params)["prunable"]["sparsity"]
    writer.write(cfg.steps, test, "test")
    writer.close()
    if writer.active:
        jp.plot.loss_curve(jp.metrics.read_jsonl(Path(cfg.out_dir) / "metrics.jsonl"),
                           Path(cfg.out_dir) / "loss.png", title="digits MLP")
        print(f"test accuracy {test['accuracy']:.4f}, test loss {test['loss']:.4f} "
              f"({int(test['weight'])} test images), kernel sparsity {test['sparsity']:.3f}")
    return test


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
