"""Matplotlib figures written to PNG files.

matplotlib is optional (``pip install 'jaxpar[experiments]'``) and imported when a figure is drawn. Figures are
``matplotlib.figure.Figure`` objects drawn without pyplot, so no backend is chosen and no global state changes
(inline figures in notebooks keep working); saving a PNG needs no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxpar._optional import require


def _figure(figsize: tuple[float, float]):
    """A new (figure, axes) pair, off pyplot."""
    fig = require("matplotlib.figure", "jaxpar.plot").Figure(figsize=figsize)
    return fig, fig.subplots()


def loss_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "loss", key: str = "loss") -> Path:
    """Plots ``key`` against ``step`` for each ``split`` in metrics rows (as in metrics.jsonl) into a PNG."""
    fig, ax = _figure((7, 4))
    for split in sorted({r.get("split", "train") for r in rows}):
        pts = [(r["step"], r[key]) for r in rows if r.get("split", "train") == split and key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if split != "train" else None, ms=3, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{key} (nats)" if key == "loss" else key)
    return _save(fig, ax, title, path)


def _save(fig, ax, title: str, path: str | Path) -> Path:
    """Title, grid and legend, then writes the figure to ``path`` (PNG)."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _write(fig, path)


def _write(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def accuracy_vs_sparsity(series: dict[str, list[tuple[float, float, float]]], path: str | Path,
                         dense: tuple[float, float] | None = None, title: str = "accuracy vs sparsity") -> Path:
    """Test accuracy against sparsity, one line per series (e.g. per distribution), into a PNG.

    Args:
      series: ``{label: [(sparsity, mean accuracy, std), ...]}``, sparsity and accuracy as fractions; a
        series of one point is drawn as a marker (e.g. ``"2:4"``).
      path: the PNG to write.
      dense: ``(mean, std)`` of the unpruned model, drawn as a horizontal band.
    """
    fig, ax = _figure((7, 4.5))
    if dense is not None:
        ax.axhline(100 * dense[0], color="k", ls="--", lw=1, label="dense")
        ax.axhspan(100 * (dense[0] - dense[1]), 100 * (dense[0] + dense[1]), color="k", alpha=0.08)
    for label, points in series.items():
        points = sorted(points)
        xs = [100 * p[0] for p in points]
        ys = [100 * p[1] for p in points]
        err = [100 * p[2] for p in points]
        ax.errorbar(xs, ys, yerr=err, marker="o" if len(points) > 1 else "*", ms=5 if len(points) > 1 else 12,
                    capsize=3, ls="-" if len(points) > 1 else "none", label=label)
    ax.set_xlabel("sparsity of the pruned kernels (%)")
    ax.set_ylabel("test accuracy (%)")
    return _save(fig, ax, title, path)


def schedule_gantt(schedule: Any, path: str | Path, title: str | None = None) -> Path:
    """A pipeline schedule's table as a Gantt chart (one row per stage, one column per tick) into a PNG.

    Forward actions are blue, backward orange (``W`` green), labelled with their microbatch; idle ticks are
    blank, so the bubble is the white area. ``schedule`` is a ``jp.pipeline.Schedule``.
    """
    Patch = require("matplotlib.patches", "jaxpar.plot").Patch
    colours = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, ax = _figure((max(6.0, 0.35 * schedule.num_ticks), 0.5 * schedule.num_stages + 1.2))
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                ax.broken_barh([(t, 1)], (s - 0.4, 0.8), facecolors=colours[a.kind], alpha=0.35 + 0.65 / (1 + a.chunk))
                ax.text(t + 0.5, s, str(a.microbatch), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, schedule.num_ticks)
    ax.set_ylim(schedule.num_stages - 0.5, -0.5)
    ax.set_yticks(range(schedule.num_stages), [f"stage {s}" for s in range(schedule.num_stages)])
    ax.set_xlabel("tick")
    kinds = sorted({a.kind for row in schedule.table for a in row if a is not None}, key="FBW".index)
    ax.legend(handles=[Patch(color=colours[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"{schedule.name}: p={schedule.num_stages}, m={schedule.num_microbatches}, "
                          f"bubble {schedule.bubble_fraction:.2f}")
    return _write(fig, path)
