"""Matplotlib figures: written to PNG files, or returned for a notebook to show inline.

matplotlib is optional (``pip install 'jaxpar[experiments]'``) and imported when a figure is drawn. Figures are
``matplotlib.figure.Figure`` objects drawn without pyplot, so no backend is chosen and no global state changes.

Every function takes ``path``: with a path it writes a PNG there and returns the ``Path``; with ``path=None``
(the default) it returns the ``Figure``. Inside IPython/Jupyter a returned Figure is displayed as ``image/png``
(the last expression of a cell, or ``IPython.display.display(fig)``), as pyplot figures are under the inline
backend; for that, the first figure drawn in an IPython session registers a PNG formatter for ``Figure`` with
the running shell if none is registered yet (nothing happens outside IPython).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar._optional import require
from jaxpar.tools.metrics import expert_load_rows

_DPI = 110


def _figure(figsize: tuple[float, float]):
    """A new (figure, axes) pair, off pyplot."""
    fig = require("matplotlib.figure", "jaxpar.tools.plot").Figure(figsize=figsize)
    return fig, fig.subplots()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def _register_inline(fig) -> None:
    """Inside IPython, lets the shell render ``Figure`` objects as image/png (if nothing renders them yet)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    formatter = shell.display_formatter.formatters["image/png"]
    try:
        formatter.lookup_by_type(type(fig))
    except KeyError:
        formatter.for_type(type(fig), _png)


def _write(fig, path: str | Path | None):
    """Lays the figure out; writes it to ``path`` (PNG) and returns the Path, or returns the Figure (None)."""
    fig.tight_layout()
    if path is None:
        _register_inline(fig)
        return fig
    path = Path(path)
    fig.savefig(path, dpi=_DPI)
    return path


def _save(fig, ax, title: str, path: str | Path | None):
    """Title, grid and legend (when something is labelled), then :func:`_write`."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _write(fig, path)


def loss_curve(rows: list[dict[str, Any]], path: str | Path | None = None, title: str = "loss", key: str = "loss"):
    """Plots ``key`` against ``step`` for each ``split`` in metrics rows (as in metrics.jsonl).

    Args:
      rows: dicts with ``step``, ``key`` and optionally ``split`` (default ``"train"``); one line per split
        (splits other than ``train`` drawn with markers).
      path: the PNG to write, or None to return the Figure.

    Returns:
      ``path`` as a ``Path``, or the ``matplotlib.figure.Figure`` when ``path`` is None.
    """
    fig, ax = _figure((7, 4))
    for split in sorted({r.get("split", "train") for r in rows}):
        pts = [(r["step"], r[key]) for r in rows if r.get("split", "train") == split and key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if split != "train" else None, ms=3, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{key} (nats)" if key == "loss" else key)
    return _save(fig, ax, title, path)


def curves(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str | Path | None = None, *,
           title: str = "", xlabel: str = "step", ylabel: str = "loss (nats)", logy: bool = False):
    """Line plot of several series, e.g. loss curves of runs in different precisions.

    Args:
      series: ``{label: (xs, ys)}``.
      path: the PNG to write, or None to return the Figure.
      title, xlabel, ylabel: text; ``logy``: a logarithmic y axis.
    """
    fig, ax = _figure((7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(np.asarray(xs), np.asarray(ys), label=label, lw=1.5)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _save(fig, ax, title, path)


def grouped_bars(values: dict[str, dict[str, float]], path: str | Path | None = None, *, title: str = "",
                 ylabel: str = "", logy: bool = False, fmt: str = "{:.3g}"):
    """Grouped bar chart: one group of bars per key of ``values``, one bar per series inside a group.

    E.g. per-device memory of layouts: ``{"DP": {"arguments": MiB, "temporaries": MiB}, "FSDP": {...}}``, or
    collectives per kind: ``{"DP": {"all-reduce": 3}, "TP": {"all-reduce": 8, "all-gather": 2}}``. A series a
    group lacks is drawn as 0, without a value label.

    Args:
      values: ``{group: {series: value}}`` (floats).
      path: the PNG to write, or None to return the Figure.
      title, ylabel: text; ``logy``: a logarithmic y axis; ``fmt``: the format of the value printed on each bar
        (None: no labels).

    Raises:
      ValueError: no groups.
    """
    if not values:
        raise ValueError("grouped_bars needs at least one group: values = {group: {series: value}}")
    groups = list(values)
    series = list(dict.fromkeys(s for g in groups for s in values[g]))
    fig, ax = _figure((max(6.0, 1.1 * len(groups) * max(1, len(series)) ** 0.5 + 2), 4))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, s in enumerate(series):
        heights = [float(values[g].get(s, 0.0)) for g in groups]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=s)
        if fmt is not None:
            ax.bar_label(bars, labels=[fmt.format(h) if s in values[g] else "" for g, h in zip(groups, heights)],
                         fontsize=7, padding=1)
    ax.set_xticks(x, groups)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.margins(y=0.12)
    return _save(fig, ax, title, path)


def expert_load(runs: list[dict[str, Any]] | dict[str, list[dict[str, Any]]], path: str | Path | None = None,
                title: str = "expert load over training"):
    """Each expert's share of the routed choices against the step: one panel per run, one line per expert.

    Args:
      runs: metrics rows (metrics.jsonl's, with ``expert_load_{i}`` from
        :func:`jaxpar.tools.metrics.expert_load_metrics`), or ``{label: rows}`` for several runs side by side
        (e.g. routing without balancing, with the auxiliary loss, with the aux-free bias). The dashed line is
        perfect balance, ``1/E``.
      path: the PNG to write, or None to return the Figure.

    Raises:
      ValueError: no runs, or a run whose rows carry no ``expert_load_{i}``.
    """
    runs = {"": runs} if isinstance(runs, list) else dict(runs)
    if not runs:
        raise ValueError("expert_load needs metrics rows, or {label: rows} of at least one run")
    loads = {label: expert_load_rows(rows) for label, rows in runs.items()}
    empty = [label or "the run" for label, (steps, _) in loads.items() if not steps]
    if empty:
        raise ValueError(f"no expert_load_<i> in the rows of {', '.join(map(repr, empty))}: log "
                         "jp.metrics.expert_load_metrics(state.carried) with each step's metrics")
    fig = require("matplotlib.figure", "jaxpar.tools.plot").Figure(figsize=(4.2 * len(runs) + 1.0, 3.8))
    axes = np.atleast_1d(fig.subplots(1, len(runs), sharey=True, squeeze=False)[0])
    for ax, (label, (steps, load)) in zip(axes, loads.items()):
        for i in range(load.shape[1]):
            ax.plot(steps, load[:, i], lw=1.0, label=f"expert {i}")
        ax.axhline(1.0 / load.shape[1], color="k", ls="--", lw=1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)   # steps are whole numbers
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of routed choices")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    return _write(fig, path)


def array_sharding(x: Any, path: str | Path | None = None, title: str | None = None):
    """Which devices hold which block of a 1-D or 2-D sharded array: one labelled rectangle per block.

    Drawn from ``x.sharding.devices_indices_map(x.shape)``, so it works for a ``jax.Array`` and for a
    ``jax.ShapeDtypeStruct`` with a sharding (e.g. a leaf of ``jp.train.abstract_state(...)``). A block held by
    several devices (replicated over some mesh axes) lists them all.

    Args:
      x: the array (or abstract array) with a ``sharding``.
      path: the PNG to write, or None to return the Figure.

    Raises:
      ValueError: ``x`` has no sharding, or is not 1-D or 2-D.
    """
    sharding = getattr(x, "sharding", None)
    shape = tuple(getattr(x, "shape", ()))
    if sharding is None or len(shape) not in (1, 2):
        raise ValueError(f"array_sharding needs a 1-D or 2-D array with a sharding, got shape {shape} and "
                         f"sharding {sharding!r}; index a stacked leaf first (x[0])")
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    blocks: dict[tuple[int, int, int, int], list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        index = ((slice(None),) if len(shape) == 1 else ()) + tuple(index)
        r0, r1, _ = index[0].indices(rows)
        c0, c1, _ = index[1].indices(cols)
        blocks.setdefault((r0, r1, c0, c1), []).append(device.id)
    fig, ax = _figure((6.5, 0.8 + 3.2 * min(1.0, max(0.25, rows / max(cols, 1)))))
    Rectangle = require("matplotlib.patches", "jaxpar.tools.plot").Rectangle
    colours = [f"C{i % 10}" for i in range(len(blocks))]
    for colour, ((r0, r1, c0, c1), ids) in zip(colours, sorted(blocks.items())):
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colour, alpha=0.35, edgecolor="k"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, "dev " + ",".join(map(str, sorted(ids))), ha="center",
                va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel(f"axis {len(shape) - 1} ({cols})")
    ax.set_ylabel("axis 0" if len(shape) == 2 else "")
    spec = getattr(sharding, "spec", None)
    ax.set_title(title or f"shape {list(shape)}" + (f", {spec}" if spec is not None else ""), fontsize=9)
    return _write(fig, path)


def accuracy_vs_sparsity(series: dict[str, list[tuple[float, float, float]]], path: str | Path | None = None,
                         dense: tuple[float, float] | None = None, title: str = "accuracy vs sparsity"):
    """Test accuracy against sparsity, one line per series (e.g. per distribution).

    Args:
      series: ``{label: [(sparsity, mean accuracy, std), ...]}``, sparsity and accuracy as fractions; a
        series of one point is drawn as a marker (e.g. ``"2:4"``).
      path: the PNG to write, or None to return the Figure.
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


def schedule_gantt(schedule: Any, path: str | Path | None = None, title: str | None = None):
    """A pipeline schedule's table as a Gantt chart (one row per stage, one column per tick).

    ``F`` actions are blue, ``B`` orange, ``W`` green; with several chunks (interleaved, ZB-V) each bar is
    labelled ``<microbatch>c<chunk>`` (e.g. ``3c1``: microbatch 3 on chunk 1) and later chunks are paler (hatched);
    with one chunk the label is the microbatch. A fused ``FB`` (DualPipeV) is a split bar, its ``F`` on top and its
    ``B`` below, labelled with both. The legend lists every (action, chunk) drawn. Idle ticks are
    blank, so the bubble is the white area. ``schedule`` is a ``jp.pipeline.Schedule``; ``path``: the PNG to
    write, or None to return the Figure.
    """
    Patch = require("matplotlib.patches", "jaxpar.tools.plot").Patch
    colours = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    chunks = schedule.num_chunks
    alpha = lambda c: 0.9 - 0.55 * c / max(chunks - 1, 1)
    hatch = lambda c: "//" if c % 2 else None
    fig, ax = _figure((max(6.0, 0.42 * schedule.num_ticks), 0.5 * schedule.num_stages + 1.4))
    drawn = set()
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is None:
                continue
            parts = a.parts()
            for i, x in enumerate(parts):        # an FB: the F in the top half, the B in the bottom half
                height = 0.8 / len(parts)
                ax.broken_barh([(t, 1)], (s - 0.4 + i * height, height), facecolors=colours[x.kind],
                               alpha=alpha(x.chunk), hatch=hatch(x.chunk), edgecolor="white", linewidth=0.5)
                drawn.add((x.kind, x.chunk))
            label = "/".join(f"{x.microbatch}c{x.chunk}" if chunks > 1 else str(x.microbatch) for x in parts)
            ax.text(t + 0.5, s, label, ha="center", va="center", fontsize=(6 if chunks > 1 else 7) - len(parts) + 1)
    ax.set_xlim(0, schedule.num_ticks)
    ax.set_ylim(schedule.num_stages - 0.5, -0.5)
    ax.set_yticks(range(schedule.num_stages), [f"stage {s}" for s in range(schedule.num_stages)])
    ax.set_xlabel("tick")
    when = schedule.ticks()
    full = [k for k in when if k[0] == "B" and ("W", *k[1:]) not in when]      # B's without a W: full backwards
    names = {"F": "F (forward)", "W": "W (weight grad)",
             "B": ("B (input grad)" if not full else "B (backward)" if not schedule.split_backward
                   else "B (backward; input grad before a W)")}
    handles = [Patch(facecolor=colours[k], alpha=alpha(c), hatch=hatch(c), edgecolor="white",
                     label=names[k] + (f", chunk {c}" if chunks > 1 else ""))
               for k, c in sorted(drawn, key=lambda kc: ("FBW".index(kc[0]), kc[1]))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"{schedule.name}: p={schedule.num_stages}, m={schedule.num_microbatches}"
                          + (f", {chunks} chunks" if chunks > 1 else "") + f", bubble {schedule.bubble_fraction:.2f}")
    return _write(fig, path)


def bubble_vs_microbatches(schedules: Sequence[Any], path: str | Path | None = None,
                           title: str = "pipeline bubble vs microbatches"):
    """Each schedule's measured bubble fraction against its number of microbatches, beside ``(p-1)/(m+p-1)``.

    The measured value is ``Schedule.bubble_fraction`` (idle slots over all slots of the table, every action
    one tick); the dashed line is the GPipe / 1F1B formula for each stage count ``p`` present (Huang et al.
    2019, sec. 2.2; Narayanan et al. 2021, sec. 2.2), drawn over continuous ``m``.

    Args:
      schedules: ``jp.pipeline.Schedule`` objects, e.g. every builder at several ``m``; points are joined per
        ``(name, num_stages)``.
      path: the PNG to write, or None to return the Figure.

    Raises:
      ValueError: no schedules.
    """
    if not schedules:
        raise ValueError("bubble_vs_microbatches needs at least one schedule, e.g. [jp.pipeline.gpipe(4, m) "
                         "for m in (4, 8, 16)]")
    fig, ax = _figure((7, 4.2))
    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for s in schedules:
        lines.setdefault((s.name, s.num_stages), []).append((s.num_microbatches, s.bubble_fraction))
    ms = [s.num_microbatches for s in schedules]
    grid = np.linspace(min(ms), max(ms), 200)
    for p in sorted({s.num_stages for s in schedules}):
        ax.plot(grid, (p - 1) / (grid + p - 1), "k--", lw=1, label=f"(p-1)/(m+p-1), p={p}")
    markers = "osD^v<>p*h"
    for i, ((name, p), pts) in enumerate(lines.items()):
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker=markers[i % len(markers)], ms=max(4, 10 - 2 * i), mfc="none", mew=1.5, ls=":",
                lw=1, label=f"{name} (p={p})")               # hollow, shrinking markers: equal values stay visible
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble fraction (idle / all slots)")
    ax.set_ylim(bottom=0)
    return _save(fig, ax, title, path)


def loss_scale_curve(steps: Sequence[int], scales: Sequence[float], skipped: Sequence[bool],
                     path: str | Path | None = None, title: str = "dynamic loss scale"):
    """The loss scale each step used (log2 axis), with the steps whose update was skipped marked.

    Args:
      steps, scales, skipped: per step, as in the train step's metrics ``loss_scale`` and ``skipped``.
      path: the PNG to write, or None to return the Figure.

    Raises:
      ValueError: sequences of different lengths.
    """
    steps, scales, skipped = np.asarray(steps), np.asarray(scales, float), np.asarray(skipped, bool)
    if not len(steps) == len(scales) == len(skipped):
        raise ValueError(f"steps, scales and skipped must have one entry per step; got lengths {len(steps)}, "
                         f"{len(scales)}, {len(skipped)}")
    fig, ax = _figure((7, 3.8))
    ax.step(steps, scales, where="post", lw=1.5, label="loss scale")
    if skipped.any():
        ax.plot(steps[skipped], scales[skipped], "x", color="tab:red", ms=9, mew=2,
                label=f"skipped step ({int(skipped.sum())})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    return _save(fig, ax, title, path)


def sparsity_schedule(schedule: Any, num_steps: int, path: str | Path | None = None,
                      measured: Sequence[tuple[int, float]] | None = None, title: str | None = None):
    """A pruning schedule's target sparsity over steps, the mask-refresh steps, and optionally measured sparsity.

    The target ``s_t`` is Zhu & Gupta 2017, eq. 1 (``schedule(t)``); masks only change at refresh steps
    (``schedule.refresh(t)``), so the sparsity the model has follows the stepped line.

    Args:
      schedule: a ``jp.pruning.SparsitySchedule`` (``polynomial_sparsity``, ``constant_sparsity``, ...).
      num_steps: steps to draw, ``0 .. num_steps - 1``.
      path: the PNG to write, or None to return the Figure.
      measured: ``[(step, sparsity)]`` read from a run (``jp.pruning.sparsity_report``), drawn as markers.

    Raises:
      ValueError: ``num_steps < 1``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    t = np.arange(num_steps)
    target = np.asarray(schedule(t), float)
    refresh = np.asarray(schedule.refresh(t), bool)
    held = np.maximum.accumulate(np.where(refresh, target, 0.0))   # sparsity as of the last refresh
    fig, ax = _figure((7, 3.8))
    ax.plot(t, 100 * target, lw=1.5, label="target s_t")
    ax.step(t, 100 * held, where="post", lw=1, color="tab:gray", label="masks (refreshed at the dots)")
    ax.plot(t[refresh], 100 * target[refresh], ".", color="tab:gray")
    if measured:
        ms, vs = zip(*measured)
        ax.plot(ms, 100 * np.asarray(vs), "o", mfc="none", color="tab:red", label="measured")
    ax.set_xlabel("step")
    ax.set_ylabel("sparsity (%)")
    return _save(fig, ax, title or f"sparsity schedule: {100 * schedule.final:.0f}% from step "
                                   f"{schedule.begin_step} to {schedule.end_step}", path)


def layer_sparsity(reports: dict[str, dict], path: str | Path | None = None,
                   title: str = "per-layer sparsity"):
    """Sparsity of every pruned tensor, one bar per report, e.g. the same model pruned uniformly, globally, ERK.

    Args:
      reports: ``{label: jp.pruning.sparsity_report(params)}``; the tensors marked ``prunable`` are drawn.
      path: the PNG to write, or None to return the Figure.

    Raises:
      ValueError: no reports, or a report without prunable tensors.
    """
    if not reports:
        raise ValueError("layer_sparsity needs at least one report: {label: jp.pruning.sparsity_report(params)}")
    values: dict[str, dict[str, float]] = {}
    for label, report in reports.items():
        tensors = {k: v for k, v in report["tensors"].items() if v["prunable"]}
        if not tensors:
            raise ValueError(f"report {label!r} has no prunable tensors")
        name = f"{label} ({100 * report['prunable']['sparsity']:.0f}% overall)"
        for path_name, stats in tensors.items():
            values.setdefault(f"{path_name}\n{list(stats['shape'])}", {})[name] = 100 * stats["sparsity"]
    return grouped_bars(values, path, title=title, ylabel="sparsity (%)", fmt="{:.0f}")


def nm_mask(mask: Any, n_m: tuple[int, int], path: str | Path | None = None, axis: int = 0, rows: int = 16,
            cols: int = 32, title: str | None = None):
    """A corner of a 2-D pruning mask as an image (black: kept), with the N:M groups along ``axis`` outlined.

    Args:
      mask: a 2-D bool array (True = kept), e.g. ``jp.pruning.masks(state.opt_state)[...]`` of a kernel.
      n_m: ``(N, M)``: groups of M consecutive weights along ``axis`` (each should keep N).
      path: the PNG to write, or None to return the Figure.
      axis: the axis the groups run along (the kernel's reduction axis: 0 for an ``[in, out]`` kernel).
      rows, cols: the size of the corner drawn.

    Raises:
      ValueError: a mask that is not 2-D, or ``axis`` not 0 or 1.
    """
    mask = np.asarray(mask, bool)
    if mask.ndim != 2 or axis not in (0, 1):
        raise ValueError(f"nm_mask needs a 2-D mask and axis 0 or 1, got shape {mask.shape} and axis={axis}; "
                         "pick one layer of a stacked kernel (mask[i])")
    n, m = n_m
    corner = mask[:rows, :cols]
    fig, ax = _figure((0.22 * corner.shape[1] + 1.5, 0.22 * corner.shape[0] + 1.2))
    ax.imshow(corner, cmap="Greys", vmin=0, vmax=1, interpolation="nearest", aspect="equal")
    lines = ax.axhline if axis == 0 else ax.axvline
    for k in range(m, corner.shape[axis], m):
        lines(k - 0.5, color="tab:red", lw=1)
    ax.set_xlabel("axis 1")
    ax.set_ylabel("axis 0")
    ax.set_title(title or f"{n}:{m} mask, first {corner.shape[0]}x{corner.shape[1]} weights (black: kept; "
                          f"groups of {m} along axis {axis})", fontsize=9)
    return _write(fig, path)


__all__ = ["accuracy_vs_sparsity", "array_sharding", "bubble_vs_microbatches", "curves", "expert_load",
           "grouped_bars", "layer_sparsity", "loss_curve", "loss_scale_curve", "nm_mask", "schedule_gantt",
           "sparsity_schedule"]
