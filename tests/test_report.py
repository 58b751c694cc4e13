import json

import pytest

from stabledrl.cli import main
from stabledrl.report import load_metrics, plot_runs


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
