"""An MLP classifier on scikit-learn's bundled 8x8 digits, on a data x fsdp x tensor mesh.

Command::

    python experiments/digits.py                 # CPU: 8 simulated devices, data=2 x fsdp=2 x tensor=2

    python experiments/digits.py --sparsity 0.9 --distribution global   # gradual magnitude pruning
    python experiments/digits.py --n-m 2 4                                # 2:4 structured sparsity

Expected (2-core CPU): 10-20 seconds; test accuracy about 97-98% (at least 95%), also at 90% global sparsity.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import jax
import optax

import jaxpar as jp
from jaxpar.cli import experiment
from jaxpar.models import MLP, classification_loss

experiment.require_extra("experiments/digits.py")  # a core-only install stops here, told which extra to install
import tyro  # noqa: E402  (after the check above)

Flat = tyro.conf.OmitArgPrefixes  # a shared config piece's flags stay flat: --fsdp, --sparsity


@dataclasses.dataclass(frozen=True)
class Config:
    """Digits MLP configuration."""
    mesh: Annotated[experiment.MeshConfig, Flat] = experiment.MeshConfig()
    hidden: tuple[int, ...] = (256, 256)  # hidden layer widths (divisible by tensor)
    steps: int = 600                    # optimizer steps
    batch_size: int = 64                # global batch
    learning_rate: float = 2e-3         # peak AdamW learning rate
    weight_decay: float = 1e-4          # decoupled weight decay on kernels
    seed: int = 0                       # seeds init and data order
    out_dir: str = "runs/digits"        # metrics and the loss plot go here
    pruning: Annotated[experiment.PruningConfig, Flat] = experiment.PruningConfig(prune_begin=60, prune_end=300,
                                                                          prune_frequency=10)

    def __post_init__(self):
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"--hidden {self.hidden} needs at least one layer, every width >= 1")
        self.optimizer()  # the library checks the optimizer and pruning flags now, before any work

    def optimizer(self, axis_names=None) -> optax.GradientTransformation:
        """AdamW (warm-up + cosine, no clipping), then pruning. ValueError on bad flags."""
        tx = jp.optim.adamw(self.learning_rate, total_steps=self.steps, warmup_steps=self.steps // 20,
                            weight_decay=self.weight_decay, b2=0.999, clip_norm=None, axis_names=axis_names)
        return self.pruning.apply(tx, self.steps, axis_names, groups=MLP(hidden=self.hidden).prune_groups())


def main(cfg: Config) -> float:
    """Trains and returns the test accuracy."""
    return run(cfg)["accuracy"]


def run(cfg: Config) -> dict[str, float]:
    """Trains; returns the test metrics (``accuracy``, ``loss``, ``weight``) and the kernels' ``sparsity``."""
    jp.gpu.apply_gpu_defaults(collective_matmul=cfg.mesh.tensor > 1)  # XLA flags on GPU only; before any device use
    experiment.simulate_cpu_devices(cfg.mesh.simulate_devices)
    experiment.reuse_cpu_host_memory()
    digits = jp.data.Digits.load(seed=cfg.seed)
    mesh = cfg.mesh.make()
    experiment.log_devices(mesh)
    model = MLP(hidden=cfg.hidden, num_classes=10)
    init_fn = lambda rng: model.init(rng, digits.x_train[:1])["params"]
    loss_fn = classification_loss(model)
    tx = cfg.optimizer(jax.eval_shape(init_fn, jax.random.key(0)))  # logical names: what each leaf is
    state = jp.train.init_state(init_fn, tx, jax.random.key(cfg.seed), mesh=mesh)
    writer = jp.metrics.MetricsWriter(cfg.out_dir, tensorboard=False)
    state = jp.loop.run(jp.train.make_train_step(loss_fn, tx, mesh=mesh), state,
                        lambda t: digits.batch(cfg.seed, t, cfg.batch_size), 0, cfg.steps,
                        hooks=[experiment.write_metrics(writer), experiment.progress_bar(cfg.steps)]).state
    test = jp.loop.mean_metrics(jp.train.make_eval_step(loss_fn, mesh=mesh), state,
                                [digits.test_set(multiple=jax.device_count())])
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
    main(tyro.cli(Config))
