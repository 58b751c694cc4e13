"""The spike count reported by benchmarks/stability.py, against hand arithmetic."""

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
