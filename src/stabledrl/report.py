"""Plots of one or several runs (the `report` verb): the instability loop made visible.

Reads each run's ``metrics.jsonl`` and draws, runs overlaid: reward, gradient norm before
clipping (log scale), log-ratio spread, bypass fraction (A < 0 and ρ > 1+ε), drift
(KL to the initial policy) and held-out accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from stabledrl.metrics import read_metrics

__all__ = ["load_metrics", "plot_runs"]

PANELS = [
    ("reward_mean", "reward (train rollouts)", "linear"),
    ("grad_norm", "gradient norm before clipping", "log"),
    ("log_ratio_std", "std of log ρ", "linear"),
    ("bypass_fraction", "bypass fraction (A<0, ρ>1+ε)", "linear"),
    ("drift_kl", "drift: KL(π_old ‖ π_init) estimate", "linear"),
    ("eval_accuracy", "held-out accuracy", "linear"),
]


def load_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
    return read_metrics(path)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, colors: Sequence[str] | None = None) -> Path:
    """Draw every panel for every run into one PNG at `out`; `colors` (one per run)
    lets related runs share a colour (e.g. one per objective)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("no run directories given")
    runs = {str(d): load_metrics(d) for d in run_dirs}
    if colors is not None and len(colors) != len(runs):
        raise ValueError(f"{len(colors)} colours for {len(runs)} runs")
    color_of = dict(zip(runs, colors)) if colors is not None else {}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, scale) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
            if scale == "log":
                pts = [(s, v) for s, v in pts if v > 0]
            if pts:
                xs, ys = zip(*pts)
                marker = "o-" if key == "eval_accuracy" or len(xs) <= 30 else "-"  # single points stay visible
                ax.plot(xs, ys, marker, label=Path(name).name, lw=1.2, ms=3, color=color_of.get(name))
        ax.set(title=title, xlabel="step", yscale=scale)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
