"""Markdown tables and small PNG line plots for the experiment reports."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen before pyplot loads

POLICY_STYLES = {
    "llumnix": {"color": "tab:red", "marker": "o"},
    "llumnix-base": {"color": "tab:purple", "marker": "s"},
    "infaas++": {"color": "tab:blue", "marker": "^"},
    "llumnix-nomig": {"color": "tab:orange", "marker": "v"},
    "round-robin": {"color": "tab:gray", "marker": "x"},
    "least-requests": {"color": "tab:green", "marker": "d"},
}
DPI = 60
PALETTE_COLORS = 64
"""Line plots need few colours; a palette PNG keeps a 35-panel grid well under 200 KB."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def line_grid(
    path: Path,
    panels: Sequence[tuple[str, str, dict[str, tuple[Sequence[float], Sequence[float]]]]],
    columns: int,
    xlabel: str,
    log_y: bool = False,
) -> None:
    """One small subplot per (title, y label, {series name: (xs, ys)}), `columns` per row."""
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.1 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, ylabel, series) in zip(axes.flat, panels, strict=False):
        for name, (xs, ys) in series.items():
            style = POLICY_STYLES.get(name, {})
            ax.plot(xs, ys, label=name, markersize=3, linewidth=1, **style)
        ax.set_title(title, fontsize=7)
        ax.set_ylabel(ylabel, fontsize=6)
        ax.set_xlabel(xlabel, fontsize=6)
        ax.tick_params(labelsize=6)
        if log_y and all(min(ys) > 0 for _, ys in series.values() if len(ys)):
            ax.set_yscale("log")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    _save_png(fig, path)


def ratio_heat_map(
    path: Path,
    panels: Sequence[tuple[str, Sequence[Sequence[float]]]],
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    span: float = 4.0,
) -> None:
    """One heat map per (title, ratios[row][column]), on a log colour scale from 1/span to span
    (blue below 1, red above), each cell labelled with its ratio."""
    fig, axes = plt.subplots(
        1, len(panels), figsize=(0.6 * len(column_labels) * len(panels) + 2.5, 0.32 * len(row_labels) + 1.8),
        squeeze=False,
    )
    limit = math.log(span)
    for ax, (title, ratios) in zip(axes.flat, panels, strict=True):
        logs = [[math.log(max(min(r, span), 1 / span)) for r in row] for row in ratios]
        ax.imshow(logs, cmap="coolwarm", vmin=-limit, vmax=limit, aspect="auto")
        for i, row in enumerate(ratios):
            for j, ratio in enumerate(row):
                ax.text(j, i, f"{ratio:.2g}", ha="center", va="center", fontsize=6)
        ax.set_title(title, fontsize=7)
        ax.set_xticks(range(len(column_labels)), column_labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(row_labels)), row_labels if ax is axes.flat[0] else [], fontsize=7)
    fig.tight_layout()
    _save_png(fig, path)


def time_series(path: Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 2.4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, linewidth=0.8, color=POLICY_STYLES.get(name, {}).get("color"))
    ax.set_xlabel("time (s)", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    _save_png(fig, path)


def _save_png(fig: plt.Figure, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=PALETTE_COLORS).save(path, optimize=True)
