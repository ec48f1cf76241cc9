"""Matplotlib figures (written to files; the Agg backend needs no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "loss", key: str = "loss") -> Path:
    """Plots ``key`` against ``step`` for each ``split`` in metrics rows (as in metrics.jsonl) into a PNG."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for split in sorted({r.get("split", "train") for r in rows}):
        pts = [(r["step"], r[key]) for r in rows if r.get("split", "train") == split and key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if split != "train" else None, ms=3, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{key} (nats)" if key == "loss" else key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
