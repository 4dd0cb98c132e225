"""PNG figures in the style of the paper's (matplotlib, Agg): P99 TTFT vs rate (log y), TTFT /
end-to-end box plots, throughput bars, and the per-worker load-factor heatmap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .baselines import SHORT  # noqa: E402

STYLE = {
    "central-directory": ("tab:purple", "s"), "planetserve": ("tab:brown", "v"),
    "consistent-hash": ("tab:orange", "^"), "chord": ("tab:olive", "D"), "skywalker": ("tab:green", "P"),
    "dynamo": ("tab:blue", "X"), "kvcompass": ("tab:red", "o"), "load-balance-oracle": ("black", "*"),
}


def _style(scheme: str) -> tuple[str, str]:
    return STYLE.get(scheme, ("gray", "."))


def _save(fig, path: Path, window: str) -> None:
    """Save ``fig``; a non-empty ``window`` (the seeds and window the figures were measured over,
    ``cli.window_text``) is printed under it, so a figure never travels without its window."""
    if window:
        fig.text(0.5, 0.0, window, ha="center", va="top", fontsize=5.5, color="dimgray")
        fig.savefig(path, dpi=150, bbox_inches="tight")
    else:
        fig.savefig(path, dpi=150)
    plt.close(fig)


def p99_vs_rate(rows: Sequence[Mapping], path: Path, *, title: str, metric: str = "ttft_p99_ms",
                window: str = "") -> None:
    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = sorted((r["rate"], r[metric]) for r in rows if r["scheme"] == scheme)
        color, marker = _style(scheme)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=SHORT.get(scheme, scheme),
                markersize=4, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("Arrival Rate (req/s)")
    ax.set_ylabel("P99 TTFT (ms)" if metric == "ttft_p99_ms" else metric)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    _save(fig, path, window)


def boxes(samples: Mapping[str, np.ndarray], path: Path, *, ylabel: str, title: str, window: str = "") -> None:
    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    names = list(samples)
    data = [np.maximum(samples[n], 1e-3) for n in names]
    bp = ax.boxplot(data, whis=(1, 99), showfliers=False, patch_artist=True)
    for patch, n in zip(bp["boxes"], names):
        patch.set_facecolor(_style(n)[0])
        patch.set_alpha(0.6)
    ax.set_xticks(range(1, len(names) + 1), [SHORT.get(n, n) for n in names], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path, window)


def bars(values: Mapping[str, float], path: Path, *, ylabel: str, title: str, fmt: str = "{:.2f}",
         window: str = "") -> None:
    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    names = list(values)
    ys = [values[n] for n in names]
    ax.bar(range(len(names)), ys, color=[_style(n)[0] for n in names], alpha=0.8)
    for i, y in enumerate(ys):
        ax.text(i, y, fmt.format(y), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(names)), [SHORT.get(n, n) for n in names], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path, window)


def heatmaps(factors: Mapping[str, np.ndarray], peaks: Mapping[str, float], path: Path, *, title: str,
             window: str = "") -> None:
    n = len(factors)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.0, 2.6 * rows), squeeze=False,
                             constrained_layout=True)
    im = None
    for i, (ax, (name, lf)) in enumerate(zip(axes.flat, factors.items())):
        im = ax.imshow(np.nan_to_num(lf, nan=0.0), aspect="auto", cmap="magma", vmin=0, vmax=2.0,
                       interpolation="nearest")
        ax.set_title(f"{SHORT.get(name, name)} (peak: {peaks[name]:.2f})", fontsize=8)
        ax.set_xlabel("Time bins", fontsize=7)
        if i % cols == 0:
            ax.set_ylabel("Node (by region)", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="load factor")
    fig.suptitle(title, fontsize=9)
    _save(fig, path, window)
