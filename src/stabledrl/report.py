"""Plots of one or several runs (the `report` verb): the instability loop made visible.

Reads each run's ``metrics.jsonl`` and draws, runs overlaid, six panels, each captioned
with what it shows and why it may look flat or negative: reward (raw, and its running
mean), gradient norm before clipping (log scale), std of log ρ, bypass fraction, drift
from the initial policy, held-out accuracy (a marker at every evaluation).

On every panel, a red dotted line marks each step that was skipped (`skipped_steps`
grew: a non-finite loss or gradient) and a black dashed line the step at which the run
was first flagged as collapsed (`collapse`, `stabledrl.diagnostics.CollapseMonitor`).
`run_marks` returns those steps, and `report_figure` tags the lines with gids
("skipped", "collapse", "eval"), so both can be checked without looking at a picture.

Imports nothing heavy: matplotlib only when a figure is drawn.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from stabledrl.metrics import read_metrics

__all__ = ["PANELS", "Panel", "RunMarks", "load_metrics", "plot_runs", "report_figure", "run_marks", "smooth"]


@dataclass(frozen=True)
class Panel:
    key: str
    title: str
    scale: str
    caption: str


DRIFT_K3_MEDIAN = Panel(
    "drift_k3_median", "drift from π_init: median k3 (log)", "log",
    "KL(π_old ‖ π_init)'s k3 terms (r − 1) − log r, r = exp(ℓ_init − ℓ_old), one per rollout of the step: their "
    "median, on a log scale. ℓ are likelihood estimates, so one rollout's noise can make its term huge (the mean, "
    "drift_k3 in metrics.jsonl, then spikes); the median rises only when most rollouts drift. Zero at the start "
    "(not drawn on a log scale).")
"""The drift panel: the median of the step's k3 terms (`stabledrl.diagnostics.drift_from_initial`)."""

PANELS = [
    Panel("reward_mean", "reward (train rollouts)", "linear",
          "Thin: the step's mean reward over its rollouts; thick: its running mean over the last 10 logged "
          "steps. One step holds few prompts, so the thin line is noisy."),
    Panel("grad_norm", "gradient norm before clipping", "log",
          "Global norm before clipping (log scale). Skipped steps have no finite norm: they leave gaps and "
          "are marked by red dotted lines."),
    Panel("log_ratio_std", "std of log ρ", "linear",
          "Spread of the importance log-ratios log ρ = ℓ_θ − ℓ_old in the update. Exactly zero at μ = 1 with "
          "masks: shared: the only update is at θ = θ_old on ℓ_old's own masks, so ρ ≡ 1."),
    Panel("bypass_fraction", "bypass fraction (A<0, ρ>1+ε)", "linear",
          "Share of terms with a negative advantage and ρ above the clip range, whose unclipped ρ·A passes "
          "through min(). Exactly zero where ρ ≡ 1 (μ = 1, masks: shared)."),
    DRIFT_K3_MEDIAN,
    Panel("eval_accuracy", "held-out accuracy", "linear",
          "Share of held-out problems solved (greedy unless eval_sampling says otherwise), one marker per "
          "evaluation: at the start, every eval_every steps, and at the end."),
]
DRIFT_K3_MEAN = Panel("drift_k3", "drift from π_init: k3 estimate (mean)", "linear",
                      "KL(π_old ‖ π_init) by k3, averaged over π_old's rollouts (runs that log no median).")
DRIFT_MEAN = Panel("drift_kl", "drift: mean of ℓ_old − ℓ_init", "linear",
                   "The mean over π_old's rollouts of ℓ_old − ℓ_init: KL(π_old ‖ π_init)'s k1 form with "
                   "likelihood estimates for log-probabilities. Each term can be negative, and so can the mean "
                   "when the drift is smaller than the estimates' noise: read its trend, not its sign.")


def load_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
    return read_metrics(path)


def accuracy_curve(run_dir: str | Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) at each evaluation the run recorded (`eval_every`), in step order."""
    return [(r["step"], r["eval_accuracy"]) for r in load_metrics(run_dir) if "eval_accuracy" in r]


@dataclass
class RunMarks:
    """The steps a report marks on a run."""

    skipped: list[int] = field(default_factory=list)
    """Steps whose row shows `skipped_steps` grown since the previous row."""
    collapse: int | None = None
    """The first step whose row says `collapse: true`."""
    evaluations: list[int] = field(default_factory=list)
    """Steps with an `eval_accuracy`."""


def run_marks(rows: Sequence[dict[str, Any]]) -> RunMarks:
    marks, seen = RunMarks(), 0
    for r in rows:
        if r.get("skipped_steps") is not None:
            if int(r["skipped_steps"]) > seen:
                marks.skipped.append(int(r["step"]))
            seen = int(r["skipped_steps"])
        if r.get("collapse") and marks.collapse is None:
            marks.collapse = int(r["step"])
        if r.get("eval_accuracy") is not None:
            marks.evaluations.append(int(r["step"]))
    return marks


def smooth(values: Sequence[float], window: int = 10) -> list[float]:
    """Running mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _panels(runs: dict[str, list[dict]]) -> list[Panel]:
    """PANELS, with an older run's drift where no run logs the median k3: the mean k3, else the
    mean difference."""
    logged = {k for rows in runs.values() for r in rows for k in r}
    drift = next((p for p in (DRIFT_K3_MEDIAN, DRIFT_K3_MEAN, DRIFT_MEAN) if p.key in logged), DRIFT_MEAN)
    return [drift if p is DRIFT_K3_MEDIAN else p for p in PANELS]


def _draw_series(ax, panel: Panel, rows: list[dict], label: str, color: str | None) -> None:
    """One run's line; a null value (a skipped step's norm) or, on a log scale, a value <= 0 is a gap."""
    pts = [(r["step"], r[panel.key]) for r in rows if panel.key in r]
    pts = [(s, math.nan if v is None or (panel.scale == "log" and v <= 0) else v) for s, v in pts]
    if not any(math.isfinite(v) for _, v in pts):
        return
    xs, ys = zip(*pts)
    if panel.key == "reward_mean":
        xs, ys = zip(*[(x, y) for x, y in pts if math.isfinite(y)])
        (raw,) = ax.plot(xs, ys, "-", lw=0.8, alpha=0.35, color=color)
        ax.plot(xs, smooth(ys), "-", lw=1.8, label=label, color=raw.get_color())
    elif panel.key == "eval_accuracy":  # two evaluations are two points, not a trend
        ax.plot(xs, ys, "o--" if len(xs) > 2 else "o", lw=0.8, ms=5, label=label, color=color, gid="eval")
    else:
        ax.plot(xs, ys, "o-" if len(xs) <= 30 else "-", lw=1.2, ms=3, label=label, color=color)


def report_figure(run_dirs: Sequence[str | Path], *, colors: Sequence[str] | None = None):
    """The report as a matplotlib Figure (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("no run directories given")
    runs = {str(d): load_metrics(d) for d in run_dirs}
    if colors is not None and len(colors) != len(runs):
        raise ValueError(f"{len(colors)} colours for {len(runs)} runs")
    color_of = dict(zip(runs, colors)) if colors is not None else {}
    fig, axes = plt.subplots(2, 3, figsize=(16, 10.5))
    marks = {name: run_marks(rows) for name, rows in runs.items()}
    for ax, panel in zip(axes.flat, _panels(runs)):
        for name, rows in runs.items():
            _draw_series(ax, panel, rows, Path(name).name, color_of.get(name))
        for m in marks.values():
            for s in m.skipped:
                ax.axvline(s, color="tab:red", ls=":", lw=1, gid="skipped")
            if m.collapse is not None:
                ax.axvline(m.collapse, color="black", ls="--", lw=1, gid="collapse")
        ax.set(title=panel.title, xlabel="step", yscale=panel.scale)
        ax.grid(alpha=0.3)
        caption = panel.caption + _eval_note(panel, marks)
        ax.text(0, -0.16, textwrap.fill(caption, 70), transform=ax.transAxes, va="top", fontsize=7.5, color="0.25")
    axes.flat[0].legend(fontsize=8)
    fig.text(0.01, 0.005, "red dotted: a skipped step (non-finite loss or gradient); black dashed: the run first "
             "flagged as collapsed (stabledrl.diagnostics.CollapseMonitor)", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1), h_pad=6)
    return fig


def _eval_note(panel: Panel, marks: dict[str, RunMarks]) -> str:
    if panel.key != "eval_accuracy" or any(len(m.evaluations) > 2 for m in marks.values()):
        return ""
    return " Only the start and the end were evaluated here: set eval_every for a curve."


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, colors: Sequence[str] | None = None) -> Path:
    """Draw every panel for every run into one PNG at `out`; `colors` (one per run)
    lets related runs share a colour (e.g. one per objective)."""
    fig = report_figure(run_dirs, colors=colors)
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
