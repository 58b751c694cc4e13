"""The spike count reported by benchmarks/stability.py, against hand arithmetic."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from stability import spikes  # noqa: E402


def test_spikes_counts_norms_over_five_times_the_running_median():
    # step 3: 10 > 5 x median(1, 1, 1) = 5 -> spike; step 4: 4 < 5 x median(1, 1, 1, 10) = 5;
    # step 6: 60 > 5 x median(1, 1, 1, 10, 4, 1) = 5 -> spike. Two spikes.
    assert spikes([1, 1, 1, 10, 4, 1, 60]) == 2
    # five 1s, then 100s: steps 5-9 spike (the median of the previous <= 10 norms is still 1);
    # at step 10 the window holds five 1s and five 100s, median 50.5, and 100 < 252.5.
    assert spikes([1] * 5 + [100] * 11) == 5
    assert spikes([3.0]) == 0


def test_summarise_reads_non_finite_gradient_norms_written_as_null(tmp_path):
    # metrics.jsonl writes an infinite or NaN norm as null: a skipped step counts as an
    # infinite norm (a spike), not as an error, and stays out of the finite maximum.
    from stability import summarise

    rows = [{"step": 1, "reward_mean": 0.5, "grad_norm": 1.0, "log_ratio_std": 0.5, "bypass_fraction": 0.0},
            {"step": 2, "reward_mean": 0.4, "grad_norm": 2.0, "log_ratio_std": 1.5, "bypass_fraction": 0.5},
            {"step": 3, "reward_mean": 0.3, "grad_norm": None, "log_ratio_std": None, "bypass_fraction": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = summarise(tmp_path, {"skipped_steps": 1, "eval_initial": {}, "eval_final": {}})
    assert out["grad_norm_max"] == 2.0
    assert out["grad_norm_nonfinite_steps"] == 1
    assert out["spikes"] == 1  # inf > 5 x median(1, 2)
    assert out["log_ratio_var_mean"] == (0.5 ** 2 + 1.5 ** 2) / 2
    assert out["reward_curve"] == [0.5, 0.4, 0.3]
    # 3 steps: a sixth is 1 step (at least one)
    assert (out["reward_first_sixth"], out["reward_last_sixth"]) == (0.5, 0.3)
    assert out["collapse"] == []
