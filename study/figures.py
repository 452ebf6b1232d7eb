"""The report's static figures (matplotlib, written as PNG beside the page): metrics and geometry against the searched
parameters with replicate error bars, the metric against the geometry and the Pareto front. Legends sit outside the
axes, never over the data. (The figures that compare many trials are interactive: study/interactive.py.)"""

from __future__ import annotations

import math
from pathlib import Path

from study.plots import colormap, legend_outside, save, subplots


def colour(index: int):
    """The index-th colour of the tab10 cycle."""
    return colormap("tab10")(index % 10)


def _positions(values: list) -> tuple[list[float], list[str] | None]:
    """x positions of parameter values: the numbers themselves, or indices for categorical values."""
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values], None
    labels = sorted({str(v) for v in values})
    return [float(labels.index(str(v))) for v in values], labels


def _errorbar_panel(ax, points: list[tuple], name: str, ylabel: str) -> None:
    """points: (x value, mean, std, group) per configuration; one colour per group."""
    xs, ticks = _positions([p[0] for p in points])
    groups = sorted({str(p[3]) for p in points})
    for index, group in enumerate(groups):
        chosen = [(x, p) for x, p in zip(xs, points) if str(p[3]) == group]
        ax.errorbar([x for x, _ in chosen], [p[1] for _, p in chosen],
                    yerr=[0.0 if not math.isfinite(p[2]) else p[2] for _, p in chosen], fmt="o", capsize=3,
                    color=colour(index), label=group if len(groups) > 1 else None)
    if ticks:
        ax.set_xticks(range(len(ticks)), ticks, rotation=30, fontsize=7)
    ax.set_xlabel(name)
    ax.set_ylabel(ylabel, fontsize=8)
    if len(groups) > 1:
        legend_outside(ax, fontsize=6)


def against_parameters(panels: dict[str, dict[str, list[tuple]]], path: Path, title: str) -> Path:
    """A grid: one row per quantity, one column per parameter; each panel `panels[quantity][parameter]` holds
    (value, mean, std, group) per configuration."""
    quantities = list(panels)
    parameters = list(next(iter(panels.values())))
    fig, axes = subplots(len(quantities), len(parameters), squeeze=False, dpi=110,
                             figsize=(3.4 * len(parameters) + 0.5, 2.6 * len(quantities) + 0.6))
    for row, quantity in enumerate(quantities):
        for column, parameter in enumerate(parameters):
            _errorbar_panel(axes[row][column], panels[quantity][parameter], parameter, quantity)
    return save(fig, path, title)


def scatter_panels(panels: list[tuple[str, list[float], list[float], str]], ylabel: str, path: Path,
                   title: str) -> Path:
    """One panel per (x name, x values, y values, caption)."""
    fig, axes = subplots(1, len(panels), squeeze=False, dpi=110, figsize=(3.6 * len(panels) + 0.5, 3.4))
    for ax, (name, xs, ys, caption) in zip(axes[0], panels):
        ax.scatter(xs, ys, s=18, color=colour(0))
        ax.set_xlabel(name)
        ax.set_ylabel(ylabel)
        ax.set_title(caption, fontsize=8)
    return save(fig, path, title)


def pareto(points: list[tuple[float, float, bool]], names: tuple[str, str], path: Path, title: str) -> Path:
    """Configurations' means on two objectives; those on the Pareto front marked."""
    fig, ax = subplots(figsize=(5, 4), dpi=110)
    for front, colour, label in ((False, "#999999", "dominated"), (True, "#c44e52", "Pareto front")):
        chosen = [(x, y) for x, y, on in points if on == front]
        if chosen:
            ax.scatter(*zip(*chosen), color=colour, label=label, s=24)
    ax.set_xlabel(names[0])
    ax.set_ylabel(names[1])
    legend_outside(ax, fontsize=7)
    ax.set_title(title, fontsize=10)
    return save(fig, path)
