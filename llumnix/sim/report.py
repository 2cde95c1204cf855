"""Markdown tables and small PNG line plots for the experiment reports."""

from __future__ import annotations

import io
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
