"""Geometry pictures logged with every trial: last-layer tokens on their top two PCs, and the variance split."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # workers have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from study.tasks import GeometryPictures  # noqa: E402


def draw_geometry(pictures: GeometryPictures, folder: Path, title: str) -> None:
    """pca.png and variance.png of one evaluation in `folder`; `title` says which (epoch, k)."""
    pca_plot(pictures.points, pictures.labels, folder / "pca.png", f"last-layer tokens on the top two PCs ({title})",
             label_name=pictures.label_name)
    variance_plot(pictures.parts, pictures.total, folder / "variance.png", f"token variance decomposition ({title})")


def pca_plot(points: np.ndarray, labels: np.ndarray, path: Path, title: str, label_name: str = "class") -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=110)
    values = np.unique(labels)
    cmap = plt.get_cmap("tab10" if len(values) <= 10 else "tab20")
    for i, value in enumerate(values):
        keep = labels == value
        name = "none" if value < 0 else str(value)
        ax.scatter(points[keep, 0], points[keep, 1], s=6, alpha=0.7, color=cmap(i % cmap.N), label=name, linewidths=0)
    if 1 < len(values) <= 20:
        ax.legend(title=label_name, fontsize=7, markerscale=2, loc="best", frameon=False)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def variance_plot(parts: dict[str, float], total: float, path: Path, title: str) -> Path:
    """Bars of the variance components with the total beside them (they add up to it: ANOVA identity)."""
    names = list(parts) + ["total"]
    values = [parts[n] for n in parts] + [total]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    bars = ax.bar(names, values, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(parts)] + ["#777777"])
    for bar, value in zip(bars, values):
        share = f"\n{value / total:.0%}" if total > 0 and bar is not bars[-1] else ""
        ax.annotate(f"{value:.3g}{share}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("variance (mean squared norm)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
