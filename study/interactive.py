"""The report's interactive figures (plotly), where a reader compares many trials: each configuration's paired
difference to the baseline, the geometry over the epochs, per-layer geometry by trial, and Optuna's own plotly
visualisations of the study's journal (history, slices, parallel coordinates, contour, importance). Every trial is
named by its configuration's values ("k=3, lr=0.003, seed 1"), never by a trial id, and a parameter that no shown
trial holds (a conditional one the study never sampled) gets no panel. The page embeds plotly's JavaScript once
(`plotly_js`), so it opens offline."""

from __future__ import annotations

import math

import numpy as np
import optuna
import plotly.graph_objects as go
import plotly.io
import plotly.offline
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from study.stats import PairedDifference

PALETTE = qualitative.Plotly
# Legends sit above the plotting area, never over the data.
LEGEND_ABOVE = dict(orientation="h", yanchor="bottom", y=1.08, xanchor="left", x=0)


def label(values: dict) -> str:
    """A configuration as its reader names it: its sampled values in the space's order ("k=3, lr=0.003")."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def trial_label(values: dict, seed: int) -> str:
    """One replicate: its configuration's values and its seed."""
    return f"{label(values)}, seed {seed}"


def with_values(names: list[str], samples: list[dict]) -> list[str]:
    """The parameters among `names` (kept in their order) that at least one sample holds: a conditional parameter
    no shown trial sampled gets no panel."""
    return [name for name in names if any(name in sample for sample in samples)]


def paired_differences(rows: list[tuple[str, dict[str, PairedDifference | None]]], metrics: list[str]) -> go.Figure:
    """Per metric, one point per configuration (`rows`: its label, its difference per metric): the mean difference
    to the baseline, paired by seed, with its 95% t interval; those beyond the seed noise in red."""
    fig = make_subplots(rows=1, cols=len(metrics), shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=[f"{metric} − baseline" for metric in metrics])
    for column, metric in enumerate(metrics, start=1):
        for beyond, colour, name in ((True, "#c44e52", "beyond the seed noise"), (False, "#4c72b0", "within it")):
            chosen = [(text, d[metric]) for text, d in rows if d.get(metric) is not None
                      and math.isfinite(d[metric].mean) and d[metric].beyond_noise == beyond]
            if not chosen:
                continue
            means = [d.mean for _, d in chosen]
            highs = [d.high - d.mean if math.isfinite(d.high) else 0.0 for _, d in chosen]
            lows = [d.mean - d.low if math.isfinite(d.low) else 0.0 for _, d in chosen]
            fig.add_trace(go.Scatter(
                x=means, y=[text for text, _ in chosen], mode="markers", name=name, legendgroup=name,
                showlegend=column == 1, marker=dict(color=colour, size=9),
                error_x=dict(type="data", symmetric=False, array=highs, arrayminus=lows, color=colour),
                customdata=[[d.low, d.high, d.n] for _, d in chosen],
                hovertemplate=("%{y}<br>" + metric + " − baseline: %{x:.4f}<br>95% interval "
                               "[%{customdata[0]:.4f}, %{customdata[1]:.4f}], %{customdata[2]} seeds<extra></extra>"),
            ), row=1, col=column)
        fig.add_vline(x=0, line_dash="dot", line_color="#777", row=1, col=column)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(height=140 + 26 * len(rows), legend=LEGEND_ABOVE, margin=dict(t=80))
    return fig


def trajectories(series: dict[str, list[tuple[str, str, list[int], list[float]]]]) -> go.Figure:
    """One panel per quantity (`series[quantity]`: per trial its configuration's label, its own label, epochs and
    values); a line per trial, one colour and one legend entry per configuration (a click hides its replicates)."""
    names = [name for name, lines in series.items() if any(epochs for _, _, epochs, _ in lines)]
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.07)
    configurations = list(dict.fromkeys(config for lines in series.values() for config, _, _, _ in lines))
    for column, name in enumerate(names, start=1):
        shown: set[str] = set()
        for config, trial, epochs, values in series[name]:
            if not epochs:
                continue
            fig.add_trace(go.Scatter(
                x=epochs, y=values, mode="lines+markers", name=config, legendgroup=config,
                showlegend=column == 1 and config not in shown,
                line=dict(color=PALETTE[configurations.index(config) % len(PALETTE)]), text=[trial] * len(epochs),
                hovertemplate="%{text}<br>epoch %{x}: " + name + " %{y:.4f}<extra></extra>",
            ), row=1, col=column)
            shown.add(config)
        fig.update_xaxes(title_text="epoch", row=1, col=column)
    fig.update_layout(height=420, legend=dict(title="configuration"), margin=dict(t=60))
    return fig


def layers_by_trial(values: np.ndarray, trials: list[str], name: str) -> go.Figure:
    """A per-layer geometry metric, layer by trial (`values`: (layers, trials)), each trial named by its
    configuration."""
    fig = go.Figure(go.Heatmap(
        z=values, x=trials, y=list(range(values.shape[0])), colorscale="Viridis", colorbar=dict(title=name),
        hovertemplate="%{x}<br>layer %{y}: " + name + " %{z:.4f}<extra></extra>",
    ))
    fig.update_xaxes(title_text="trial", tickangle=-30, automargin=True)
    fig.update_yaxes(title_text="layer", dtick=1)
    fig.update_layout(height=260 + 22 * values.shape[0])
    return fig


def optuna_figures(study: optuna.Study, parameters: list[str], target_name: str,
                   importances: dict[str, float] | None) -> list[tuple[str, str, go.Figure]]:
    """Optuna's own plotly figures of the sampler's study (its COMPLETE trials: configurations that ran every epoch
    of every replicate, each value their replicates' mean): (title, caption, figure). Only parameters some complete
    trial sampled get a panel or an axis; the contour shows the two most important numeric ones."""
    # Imported here: optuna.visualization imports matplotlib, which writes its caches under ~ when first imported,
    # and a command refused before it reports must leave no trace there (tests/test_refused_at_once.py).
    import optuna.visualization as optuna_plots

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    shown = with_values(parameters, [trial.params for trial in complete])
    if not complete:
        return []
    found = [("Optimisation history", "The sampler's value of each configuration in the order it was proposed, "
              "and the best so far.", optuna_plots.plot_optimization_history(study, target_name=target_name))]
    if shown:
        found += [
            ("Slices", "The value against each searched parameter; colour: the order in which the sampler chose "
             "the configurations.", optuna_plots.plot_slice(study, params=shown, target_name=target_name)),
            ("Parallel coordinates", "Each line a configuration; drag along an axis to select a range.",
             optuna_plots.plot_parallel_coordinate(study, params=shown, target_name=target_name)),
        ]
    varied = [name for name in sorted(shown, key=lambda p: -(importances or {}).get(p, 0.0))
              if len({trial.params[name] for trial in complete if name in trial.params}) > 1
              and all(isinstance(trial.params[name], int | float) for trial in complete if name in trial.params)]
    if len(varied) >= 2:
        found.append(("Contour", f"The value over {varied[0]} and {varied[1]}"
                      + (" (the two most important parameters)" if importances else "") + ".",
                      optuna_plots.plot_contour(study, params=varied[:2], target_name=target_name)))
    return found


def importance_figure(importances: dict[str, float]) -> go.Figure:
    """The parameters' importances, largest on top."""
    names = sorted(importances, key=importances.get)
    fig = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h", marker_color=PALETTE[0],
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_xaxes(title_text="importance")
    fig.update_layout(height=140 + 30 * len(names))
    return fig


def to_html(fig: go.Figure, div_id: str) -> str:
    """The figure as a <div> and the script that draws it, without plotly's JavaScript (the page holds it once)."""
    fig.update_layout(template="plotly_white")
    return plotly.io.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                             config={"displaylogo": False, "responsive": True})


def plotly_js() -> str:
    """plotly.js itself, embedded in the page (no CDN: the report opens offline)."""
    return plotly.offline.get_plotlyjs()
