"""The training-reward summaries of benchmarks/rl_learns.py, against hand arithmetic."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from rl_learns import summarise_gaps  # noqa: E402


def test_summarise_gaps_on_a_line_and_on_hand_arithmetic():
    # gap = 0.001 * step exactly: slope 0.1 per 100 steps, no residual.
    line = summarise_gaps({s: 0.001 * s for s in (1, 11, 21, 31, 41, 51)})
    assert line["slope_per_100_steps"] == pytest.approx(0.1, abs=1e-12)
    assert line["slope_per_100_steps_se"] == pytest.approx(0.0, abs=1e-12)
    assert line["gap_first_sixth"] == pytest.approx(0.001)  # 6 steps: a sixth is one step
    assert line["gap_last_sixth"] == pytest.approx(0.051)
    assert line["gap_second_half"] == pytest.approx((0.031 + 0.041 + 0.051) / 3)
    # steps 0, 1, 2, 3 with gaps 0, 1, 1, 2 (the keys are sorted first):
    # x̄ = 1.5, ȳ = 1, Σ(x−x̄)(y−ȳ) = (−1.5)(−1) + (−0.5)(0) + (0.5)(0) + (1.5)(1) = 3,
    # Σ(x−x̄)² = 5 -> slope 0.6; residuals −0.1, 0.3, −0.3, 0.1 -> Σ r² = 0.2,
    # SE² = 0.2 / (4 − 2) / 5 = 0.02. Second half: 1 and 2 -> mean 1.5, SE = std / √2 = 0.5.
    hand = summarise_gaps({3: 2.0, 0: 0.0, 2: 1.0, 1: 1.0})
    assert hand["slope_per_100_steps"] == pytest.approx(60.0)
    assert hand["slope_per_100_steps_se"] == pytest.approx(100 * 0.02**0.5)
    assert hand["gap_second_half"] == pytest.approx(1.5)
    assert hand["gap_second_half_se"] == pytest.approx(0.5)
