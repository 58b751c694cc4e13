import json

import pytest

from stabledrl.cli import main
from stabledrl.report import accuracy_curve, load_metrics, plot_runs, report_figure, run_marks, smooth


def _run(path, spike):
    path.mkdir()
    rows = [{"step": s, "reward_mean": 0.1 * s, "grad_norm": spike if s == 3 else 1.0, "log_ratio_std": 0.1,
             "bypass_fraction": 0.0, "drift_kl": 0.01 * s} for s in range(1, 6)]
    rows.append({"step": 5, "eval_accuracy": 0.3, "eval_reward": 0.4})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_overlays_runs_into_a_png(tmp_path, capsys):
    a, b = _run(tmp_path / "a", 1e6), _run(tmp_path / "b", 2.0)
    assert len(load_metrics(a)) == 6
    out = plot_runs([a, b], tmp_path / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["report", str(a), str(b)]) == 0
    assert (a / "report.png").is_file()


def test_report_rejects_a_directory_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_runs([tmp_path], tmp_path / "r.png")


def test_report_reads_a_run_cut_off_mid_line_and_names_a_corrupt_line(tmp_path, capsys):
    run = _run(tmp_path / "a", 2.0)
    good = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(good + '{"step": 6, "reward_mean": 0.')  # killed while writing
    assert main(["report", str(run)]) == 0
    assert len(load_metrics(run)) == 6
    lines = good.splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + '{"step": 2, "rew\n' + "".join(lines[1:]))
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "metrics.jsonl, line 2" in err


def _troubled_run(path, *, k3=False, eval_every=0):
    """Ten steps; step 4 skipped (NaN norm, the counter grows), the collapse flagged from step 7."""
    path.mkdir()
    rows = [{"step": 0, "eval_accuracy": 0.5, "collapse": False}]
    for s in range(1, 11):
        row = {"step": s, "reward_mean": (s * 0.37) % 1, "grad_norm": None if s == 4 else 1.0,
               "skipped_steps": int(s >= 4),
               "log_ratio_std": 0.0, "bypass_fraction": 0.0, "drift_kl": -0.2, "collapse": s >= 7}
        if k3:
            row["drift_k3"] = 0.01
        if eval_every and s % eval_every == 0 and s != 10:  # the final evaluation has its own row
            row["eval_accuracy"] = 0.4
        rows.append(row)
    rows.append({"step": 10, "eval_accuracy": 0.1, "collapse": True})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _vlines(ax, gid):
    return sorted({float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_gid() == gid})


def test_report_marks_the_skipped_step_and_the_collapse_on_every_panel(tmp_path):
    import matplotlib.pyplot as plt

    run = _troubled_run(tmp_path / "a")
    marks = run_marks(load_metrics(run))
    assert marks.skipped == [4] and marks.collapse == 7 and marks.evaluations == [0, 10]
    fig = report_figure([run])
    for ax in fig.axes:
        assert _vlines(ax, "skipped") == [4.0] and _vlines(ax, "collapse") == [7.0]
    titles = [ax.get_title() for ax in fig.axes]
    assert "drift: mean of ℓ_old − ℓ_init" in titles  # no k3 in the metrics: labelled for what it is
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "set eval_every for a curve" in texts and "ρ ≡ 1" in " ".join(texts.split())
    plt.close(fig)


def test_report_draws_k3_drift_every_evaluation_and_a_smoothed_reward(tmp_path):
    import matplotlib.pyplot as plt

    run = _troubled_run(tmp_path / "a", k3=True, eval_every=2)
    fig = report_figure([run])
    by_title = {ax.get_title(): ax for ax in fig.axes}
    assert "drift from π_init: k3 estimate (mean)" in by_title  # a run that logs no median
    [evals] = [ln for ln in by_title["held-out accuracy"].get_lines() if ln.get_gid() == "eval"]
    assert list(evals.get_xdata()) == [0, 2, 4, 6, 8, 10]
    assert "set eval_every" not in " ".join(t.get_text() for t in by_title["held-out accuracy"].texts)
    raw, smoothed = [ln for ln in by_title["reward (train rollouts)"].get_lines() if ln.get_gid() is None][:2]
    assert list(smoothed.get_ydata()) == smooth(list(raw.get_ydata()))
    plt.close(fig)


def test_smooth_is_the_running_mean_of_the_last_window_values():
    # window 2: 1, (1+3)/2, (3+5)/2, (5+7)/2
    assert smooth([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0, 6.0], window=10) == [2.0, 3.0, 4.0]


def test_accuracy_curve_is_the_evaluation_rows_in_step_order(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.25, "collapse": False}, {"step": 1, "reward_mean": 0.5},
            {"step": 10, "reward_mean": 0.6}, {"step": 10, "eval_accuracy": 0.5, "collapse": False}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert accuracy_curve(tmp_path) == [(0, 0.25), (10, 0.5)]


def test_the_drift_panel_plots_the_median_k3_on_a_log_scale_and_older_runs_their_own(tmp_path):
    from stabledrl.report import _panels

    def drift_panel(rows):
        return next(p for p in _panels({"r": rows}) if p.key.startswith("drift"))

    new = drift_panel([{"step": 1, "drift_kl": 0.1, "drift_k3": 3e11, "drift_k3_median": 0.02}])
    assert (new.key, new.scale) == ("drift_k3_median", "log")
    assert drift_panel([{"step": 1, "drift_kl": 0.1, "drift_k3": 0.01}]).key == "drift_k3"  # a run of before
    assert drift_panel([{"step": 1, "drift_kl": 0.1}]).key == "drift_kl"
