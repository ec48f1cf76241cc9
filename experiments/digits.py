"""An MLP classifier on scikit-learn's bundled 8x8 digits, on a data x fsdp x tensor mesh.

Command::

    python experiments/digits.py                 # CPU: 8 simulated devices, data=2 x fsdp=2 x tensor=2

Expected (2-core CPU): under a minute; test accuracy about 97-98% (at least 95%).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

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

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"--hidden {self.hidden} needs at least one layer, every width >= 1")
        if self.learning_rate <= 0 or self.seed < 0:
            raise ValueError(f"need --learning-rate > 0 and --seed >= 0, got {self.learning_rate}, {self.seed}")


def main(cfg: Config) -> float:
    simulate_cpu_devices(cfg.simulate_devices)
    import jax
    from tqdm import tqdm

    import jaxpar as jp
    from jaxpar.models import MLP, classification_loss

    digits = jp.data.Digits.load(seed=cfg.seed)
    mesh = jp.make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor)
    log_devices(mesh)
    model = MLP(hidden=cfg.hidden, num_classes=10)
    init_fn = lambda rng: model.init(rng, digits.x_train[:1])["params"]
    loss_fn = classification_loss(model)
    tx = jp.train.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=cfg.steps // 20,
                        weight_decay=cfg.weight_decay, b2=0.999, clip_norm=None)
    state = jp.train.init_state(init_fn, tx, jax.random.key(cfg.seed), mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    evaluate = jp.train.make_eval_step(loss_fn, mesh=mesh)
    writer = jp.metrics.MetricsWriter(cfg.out_dir, tensorboard=False)
    batch_fn = lambda t: digits.batch(cfg.seed, t, cfg.batch_size)
    for t, m, state in tqdm(jp.train.run_steps(step, state, batch_fn, 0, cfg.steps), total=cfg.steps,
                            disable=jax.process_index() != 0, mininterval=1.0):
        writer.write(t + 1, m)
    test = {k: float(v) for k, v in evaluate(state, digits.test_set(multiple=jax.device_count())).items()}
    writer.write(cfg.steps, test, "test")
    writer.close()
    if writer.active:
        jp.plot.loss_curve(jp.metrics.read_jsonl(Path(cfg.out_dir) / "metrics.jsonl"),
                           Path(cfg.out_dir) / "loss.png", title="digits MLP")
        print(f"test accuracy {test['accuracy']:.4f}, test loss {test['loss']:.4f} "
              f"({int(test['weight'])} test images)")
    return test["accuracy"]


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
