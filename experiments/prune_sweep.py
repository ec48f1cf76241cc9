"""Test accuracy vs sparsity of the digits MLP under gradual magnitude pruning, per sparsity distribution.

Command::

    python experiments/prune_sweep.py            # dense; 50/80/90/95% x uniform/global/erk; 2:4; 3 seeds each

Every run is ``experiments/digits.py`` (8 simulated devices, data=2 x fsdp=2 x tensor=2, 600 AdamW steps) with
``jp.pruning.magnitude_pruning`` chained after the optimizer: Zhu & Gupta's cubic schedule from step 60 to 300,
masks refreshed every 10 steps, then fixed while training continues. Writes ``results.json`` (every run and the
per-configuration mean and standard deviation) and ``accuracy_vs_sparsity.png`` to ``--out-dir`` and prints a
markdown table (the README's "Pruning" section).

Expected (2-core CPU): about 7 minutes for the 42 runs; dense about 98%, 90% global within 1 point of it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Annotated

import jaxpar as jp
from jaxpar.cli import experiment

experiment.require_extra("experiments/prune_sweep.py")  # a core-only install stops here, told which extra to install
import digits  # noqa: E402  experiments/digits.py: Python puts the script's directory first on sys.path
import tyro  # noqa: E402

DISTRIBUTIONS = ("uniform", "global", "erk")


@dataclasses.dataclass(frozen=True)
class Config:
    """Sweep configuration; each run is a ``digits.Config`` with these settings."""
    sparsities: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)   # final sparsities of the pruned kernels
    distributions: tuple[str, ...] = DISTRIBUTIONS          # uniform, global and/or erk
    n_m: tuple[int, int] | None = (2, 4)                    # also run this N:M pattern (None: skip it)
    seeds: tuple[int, ...] = (0, 1, 2)                      # seeds (init and data order) per configuration
    steps: int = 600                                        # optimizer steps per run
    prune_begin: int = 60                                   # first pruning step
    prune_end: int = 300                                    # final sparsity reached here; masks fixed after
    prune_frequency: int = 10                               # steps between mask refreshes
    mesh: Annotated[experiment.MeshConfig, tyro.conf.OmitArgPrefixes] = experiment.MeshConfig()  # every run's mesh
    out_dir: str = "runs/prune_sweep"                       # results.json, the PNG and one folder per run

    def __post_init__(self):
        if not self.seeds or not self.sparsities and self.n_m is None:
            raise ValueError("the sweep needs at least one seed and one sparsity (or n_m)")
        if any(s <= 0 for s in self.sparsities):
            raise ValueError(f"sparsities {self.sparsities} must be > 0 (the dense run is always included)")
        self.runs()  # every run's digits.Config: the library checks distributions, sparsities and steps now

    def runs(self) -> list[tuple[str, digits.Config]]:
        """(configuration name, the digits run) for every configuration and seed, dense first."""
        settings = [("dense", {})]
        settings += [(f"{d} {s:.0%}", dict(sparsity=s, distribution=d)) for s in self.sparsities
                     for d in self.distributions]
        if self.n_m is not None:
            settings.append((f"{self.n_m[0]}:{self.n_m[1]}", dict(n_m=self.n_m)))
        out = Path(self.out_dir)
        schedule = dict(prune_begin=self.prune_begin, prune_end=self.prune_end, prune_frequency=self.prune_frequency)
        return [(name, digits.Config(
                    steps=self.steps, seed=seed, mesh=self.mesh, pruning=experiment.PruningConfig(**schedule, **kw),
                    out_dir=str(out / name.replace(" ", "_").replace(":", "of").replace("%", "") / f"seed{seed}")))
                for name, kw in settings for seed in self.seeds]


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Mean and standard deviation (over seeds) of accuracy and achieved sparsity per configuration."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        acc = [r["accuracy"] for r in rows if r["name"] == name]
        first = next(r for r in rows if r["name"] == name)
        out[name] = {"distribution": first["distribution"], "target": first["target"], "n_m": first["n_m"],
                     "accuracy": statistics.fmean(acc), "std": statistics.pstdev(acc), "seeds": len(acc),
                     "sparsity": statistics.fmean(r["sparsity"] for r in rows if r["name"] == name)}
    return out


def table(summary: dict[str, dict], distributions=DISTRIBUTIONS) -> str:
    """Markdown table: a row per target sparsity, a column per distribution; dense and N:M rows."""
    cell = lambda s: f"{100 * s['accuracy']:.1f} ± {100 * s['std']:.1f}"
    head = "| sparsity | " + " | ".join(distributions) + " |\n|---|" + "---|" * len(distributions) + "\n"
    lines = []
    if "dense" in summary:
        lines.append("| 0% (dense) | " + " | ".join([cell(summary["dense"])] + ["—"] * (len(distributions) - 1))
                     + " |")
    targets = sorted({s["target"] for s in summary.values() if s["distribution"] and not s["n_m"]})
    for t in targets:
        cells = [cell(summary[f"{d} {t:.0%}"]) if f"{d} {t:.0%}" in summary else "" for d in distributions]
        lines.append(f"| {t:.0%} | " + " | ".join(cells) + " |")
    for name, s in summary.items():
        if s["n_m"]:
            lines.append(f"| {name} ({s['target']:.0%}) | " + " | ".join([cell(s)] + ["—"] * (len(distributions) - 1))
                         + " |")
    return head + "\n".join(lines)


def row(name: str, run: digits.Config, test: dict[str, float]) -> dict:
    """One run's line of results.json: its configuration, seed and test metrics."""
    p = run.pruning
    return {"name": name, "distribution": p.distribution if p.enabled and p.n_m is None else None,
            "target": p.target, "n_m": list(p.n_m) if p.n_m else None, "seed": run.seed,
            **{k: test[k] for k in ("accuracy", "loss", "sparsity")}}


def main(cfg: Config) -> dict[str, dict]:
    experiment.simulate_cpu_devices(cfg.mesh.simulate_devices)
    experiment.reuse_cpu_host_memory()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(name, run, digits.run(run)) for name, run in cfg.runs()]
    summary = summarize(rows)
    (out / "results.json").write_text(json.dumps({"config": experiment.flat_config(cfg), "runs": rows,
                                                  "summary": summary}, indent=1))
    series = {d: [(s["sparsity"], s["accuracy"], s["std"]) for s in summary.values()
                  if s["distribution"] == d and not s["n_m"]] for d in cfg.distributions}
    series.update({name: [(s["sparsity"], s["accuracy"], s["std"])] for name, s in summary.items() if s["n_m"]})
    dense = (summary["dense"]["accuracy"], summary["dense"]["std"])
    jp.plot.accuracy_vs_sparsity(series, out / "accuracy_vs_sparsity.png", dense=dense,
                                 title=f"digits MLP, gradual magnitude pruning ({len(cfg.seeds)} seeds)")
    print(f"\ntest accuracy (%) over {len(cfg.seeds)} seeds, mean ± std:\n")
    print(table(summary, cfg.distributions))
    return summary


if __name__ == "__main__":
    main(tyro.cli(Config))
