"""benchmarks/fast_rollouts_rl.py's summary on made-up run directories: a step's time against
the exact preset's (`step_time_vs_A`) and the midway accuracy, by hand."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fast_rollouts_rl  # noqa: E402


def _run(root: Path, setting: str, seed: int, steps: list[tuple[float, float]], final: float,
         midway: float | None = None) -> None:
    """A finished run: per step (seconds, rollout seconds), its summary, and a midway evaluation."""
    out = root / "runs" / "fastrl" / f"countdown-{setting}-s{seed}"
    out.mkdir(parents=True)
    rows = [{"step": i, "reward_mean": 0.5, "seconds": s, "time_rollout": r} for i, (s, r) in enumerate(steps)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps({"eval_initial": {"accuracy": 0.3}, "eval_final": {"accuracy": final},
                                                  "skipped_steps": 0, "zero_variance_groups": 0, "collapse": None}))
    (out / "fastrl.json").write_text(json.dumps({"wall_seconds": 100.0, "forward_passes": 10}))
    if midway is not None:
        (out / "midway-100.json").write_text(json.dumps({"step": 100, "accuracy": midway}))


def test_step_time_against_the_exact_preset_uses_the_rest_of_the_step_as_yardstick(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fast_rollouts_rl, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    cfg = Path(fast_rollouts_rl.__file__).resolve().parents[1] / "configs" / "countdown-stabledrl.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "countdown-stabledrl.yaml").write_text(cfg.read_text())
    # A: rollouts 6 s of 9 s and 2 of 3 -> rollout 8 s over the rest 4 s: 2.0; seed 1: 3 over 1: 3.0 (mean 2.5)
    _run(tmp_path, "A", 0, [(9.0, 6.0), (3.0, 2.0)], 0.45, midway=0.43)
    _run(tmp_path, "A", 1, [(4.0, 3.0)], 0.44)
    # B: 1 s of rollout over 4 s of the rest: 0.25; under the same load its step takes (1 + 0.25) / (1 + 2.5) of A's
    _run(tmp_path, "B", 0, [(5.0, 1.0)], 0.31, midway=0.29)
    fast_rollouts_rl.cmd_summarise(argparse.Namespace(task="countdown", settings=["A", "B"], seeds=[0, 1], note=None))
    out = json.loads((tmp_path / "benchmarks" / "results" / "fast_rollouts_rl-countdown.json").read_text())
    A, B = out["per_setting"]["A"], out["per_setting"]["B"]
    assert [r["rollout_to_rest"] for r in out["runs"] if r["setting"] == "A"] == [2.0, 3.0]
    assert A["rollout_to_rest"] == 2.5 and B["rollout_to_rest"] == 0.25
    assert A["step_time_vs_A"] == 1.0
    assert B["step_time_vs_A"] == pytest.approx(1.25 / 3.5, rel=1e-12)
    # the midway accuracy: its mean over the seeds that have one
    assert A["at_step_100"] == 0.43 and B["at_step_100"] == 0.29
    assert A["final"] == pytest.approx(0.445, rel=1e-12) and B["gain_points"] == pytest.approx(1.0, rel=1e-9)
