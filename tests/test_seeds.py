"""`stabledrl.seeds.step_seed`: the formulas the runs have always used, worked by hand."""

import pytest

from stabledrl.seeds import RESAMPLE_STREAMS, SLOTS, step_seed


def test_the_prompts_seed_by_hand():
    assert step_seed(0, 7, "prompts") == 7
    assert step_seed(2, 5, "prompts") == 2 * 1_000_003 + 5 == 2_000_011


def test_the_resampling_rounds_seed_by_hand():
    # 2^48 + (seed·1,000,003 + step)·64 + round
    assert step_seed(0, 0, "resample", 0) == 281_474_976_710_656
    assert step_seed(1, 2, "resample", 3) == 281_474_976_710_656 + 64_000_320 + 3 == 281_475_040_710_979
    assert RESAMPLE_STREAMS == 64


def test_the_mask_slots_seed_by_hand():
    assert SLOTS == 16  # MAX_MU 13 + 3
    assert step_seed(0, 3, "masks", 1) == 3 * 16 + 1 == 49
    assert step_seed(1, 3, "masks", 15) == 1_000_003 + 48 + 15 == 1_000_066


def test_the_draws_of_a_step_never_share_a_seed_across_steps_or_slots():
    seen = {step_seed(4, s, "masks", k) for s in range(50) for k in range(SLOTS)}
    assert len(seen) == 50 * SLOTS
    seen = {step_seed(4, s, "resample", r) for s in range(50) for r in range(RESAMPLE_STREAMS)}
    assert len(seen) == 50 * RESAMPLE_STREAMS


@pytest.mark.parametrize("purpose, index, message", [
    ("masks", 16, "seed slot 16 out of range"), ("masks", -1, "seed slot -1"),
    ("resample", 64, "resample round 64 out of range"), ("prompts", 1, "index must be 0"),
    ("rollouts", 0, "unknown purpose 'rollouts'")])
def test_an_index_out_of_its_range_or_an_unknown_purpose_is_refused(purpose, index, message):
    with pytest.raises(ValueError, match=message):
        step_seed(0, 0, purpose, index)
