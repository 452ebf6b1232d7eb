"""Geometry pictures logged with every trial: last-layer tokens on their top two PCs, the variance split, and each
layer's geometry over the epochs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from study.tasks import GeometryPictures


def _pyplot():
    """matplotlib's pyplot, imported on the first figure: a command refused before it draws anything never loads
    matplotlib, which writes its configuration and font cache under ~ when it is first imported."""
    import matplotlib

    matplotlib.use("Agg")  # workers have no display
    import matplotlib.pyplot as plt

    return plt


def subplots(*args, **kwargs):
    """pyplot.subplots (figure and axes) on the Agg backend."""
    return _pyplot().subplots(*args, **kwargs)


def legend_outside(ax, **kwargs) -> None:
    """The legend to the right of the axes (`save`'s tight_layout makes room for it), so it never covers a point."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False, **kwargs)


def colormap(name: str):
    return _pyplot().get_cmap(name)


def draw_geometry(pictures: GeometryPictures, folder: Path, title: str) -> None:
    """pca.png and variance.png of one evaluation in `folder`; `title` says which (epoch, k)."""
    pca_plot(pictures.points, pictures.labels, folder / "pca.png", f"last-layer tokens on the top two PCs ({title})",
             label_name=pictures.label_name)
    variance_plot(pictures.parts, pictures.total, folder / "variance.png", f"token variance decomposition ({title})")
    if pictures.patch_rgb is not None:
        patch_pca_plot(pictures.images, pictures.patch_rgb, folder / "patch_pca.png",
                       f"patch features, top three PCs as RGB ({title})")


def save(fig, path: Path, title: str | None = None) -> Path:
    """Lay the figure out (a suptitle if given), write it as PNG and free it."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


LAYER_METRIC = re.compile(r"^geom_l(\d+)_(.+)$")


def layer_history(history: list[dict]) -> dict[str, tuple[list[int], np.ndarray]]:
    """Per-layer geometry over the epochs that have it: name -> (epochs, values (layers, epochs))."""
    found: dict[str, dict[int, dict[int, float]]] = {}
    for row in history:
        for key, value in row.items():
            match = LAYER_METRIC.match(key)
            if match:
                found.setdefault(match[2], {}).setdefault(row["epoch"], {})[int(match[1])] = value
    tables = {}
    for name, by_epoch in found.items():
        epochs = sorted(by_epoch)
        layers = 1 + max(layer for values in by_epoch.values() for layer in values)
        values = np.array([[by_epoch[e].get(layer, np.nan) for e in epochs] for layer in range(layers)])
        tables[name] = (epochs, values)
    return tables


def layer_heatmap(values: np.ndarray, columns: list, path: Path, title: str, column_name: str) -> Path:
    """A (layers, columns) table of one geometry metric as a heatmap, each cell annotated; layer 0 at the bottom."""
    layers, count = values.shape
    fig, ax = subplots(figsize=(max(4.0, 0.6 * count + 2.5), max(2.5, 0.35 * layers + 1.5)), dpi=110)
    image = ax.imshow(values, origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, fraction=0.05)
    ax.set_xticks(range(count), [str(c) for c in columns], rotation=45 if count > 8 else 0, fontsize=7)
    ax.set_yticks(range(layers), [str(layer) for layer in range(layers)], fontsize=7)
    ax.set_xlabel(column_name)
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    if layers * count <= 200:
        for (i, j), value in np.ndenumerate(values):
            ax.annotate(f"{value:.3g}", (j, i), ha="center", va="center", fontsize=6, color="white")
    return save(fig, path)


def draw_layer_history(history: list[dict], folder: Path, title: str) -> list[Path]:
    """layers_<metric>.png: each per-layer geometry metric, layer by epoch."""
    return [layer_heatmap(values, epochs, folder / f"layers_{name}.png", f"{name} per layer ({title})", "epoch")
            for name, (epochs, values) in layer_history(history).items()]


def pca_plot(points: np.ndarray, labels: np.ndarray, path: Path, title: str, label_name: str = "class") -> Path:
    fig, ax = subplots(figsize=(6.3, 5), dpi=110)
    values = np.unique(labels)
    cmap = colormap("tab10" if len(values) <= 10 else "tab20")
    for i, value in enumerate(values):
        keep = labels == value
        name = "none" if value < 0 else str(value)
        ax.scatter(points[keep, 0], points[keep, 1], s=6, alpha=0.7, color=cmap(i % cmap.N), label=name, linewidths=0)
    if 1 < len(values) <= 20:
        legend_outside(ax, title=label_name, fontsize=7, markerscale=2)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.set_title(title, fontsize=10)
    return save(fig, path)


def patch_pca_plot(images: np.ndarray, rgb: np.ndarray, path: Path, title: str) -> Path:
    """Each image (top row) over the PCA picture of its patch features (bottom row), as in DINO's figures."""
    count = len(rgb)
    fig, axes = subplots(2, count, figsize=(1.6 * count + 0.4, 3.6), dpi=110, squeeze=False)
    for column in range(count):
        for row, picture in enumerate((images[column], rgb[column])):
            axes[row, column].imshow(picture, interpolation="nearest")
            axes[row, column].set_axis_off()
    return save(fig, path, title)


def variance_plot(parts: dict[str, float], total: float, path: Path, title: str) -> Path:
    """Bars of the variance components with the total beside them (they add up to it: ANOVA identity)."""
    names = list(parts) + ["total"]
    values = [parts[n] for n in parts] + [total]
    fig, ax = subplots(figsize=(5.5, 3.6), dpi=110)
    bars = ax.bar(names, values, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(parts)] + ["#777777"])
    for bar, value in zip(bars, values):
        share = f"\n{value / total:.0%}" if total > 0 and bar is not bars[-1] else ""
        ax.annotate(f"{value:.3g}{share}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("variance (mean squared norm)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    return save(fig, path)
