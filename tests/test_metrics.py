import json
import logging

import pytest

from stabledrl.metrics import metrics_line, read_metrics


def _strict(line):
    """json.loads that refuses the bare NaN / Infinity tokens (not JSON)."""
    def refuse(token):
        raise ValueError(f"bare {token} in {line!r}")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null():
    line = metrics_line({"step": 3, "grad_norm": float("inf"), "loss": float("nan"), "lr": 1e-3, "ok": True})
    assert line.endswith("\n") and line.count("\n") == 1
    assert _strict(line) == {"step": 3, "grad_norm": None, "loss": None, "lr": 1e-3, "ok": True}


def test_a_truncated_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics_line({"step": 1, "loss": 0.5}) + metrics_line({"step": 2, "loss": 0.4}) + '{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert "line 3" in caplog.text and str(path) in caplog.text


def test_a_corrupt_line_elsewhere_is_an_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics_line({"step": 1}) + "garbage\n" + metrics_line({"step": 2}))
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: .*delete or repair"):
        read_metrics(path)
    path.write_text(metrics_line({"step": 1}) + "[1, 2]\n")  # JSON, but not a row
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_bare_non_finite_tokens_of_older_files_read_as_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "grad_norm": Infinity, "loss": NaN}\n\n{"step": 2, "grad_norm": 1.5}\n')
    assert read_metrics(path) == [{"step": 1, "grad_norm": None, "loss": None}, {"step": 2, "grad_norm": 1.5}]
