"""The seed of every random draw a run makes, from (seed, step, purpose): a step's draws depend
on nothing else, so N processes draw alike and a resumed run continues exactly.

Purposes (`index` counts within one):
- ``prompts``: the step's training problems (`stabledrl train`, `stabledrl sft`), or the i-th
  request of an lm-eval run (step = i);
- ``resample``: the problems of resampling round `index` (< 64), a stream apart from the prompts';
- ``masks``: the mask plan of seed slot `index` (< `SLOTS`): 1 ℓ_old's, 2 the weights', 3 + k
  inner iteration k's (independent masks); slot 0 is unused, the rollouts draw per row
  (`stabledrl.sampling.row_generators`, tagged "seed/step/round").

The formulas are those the runs have always used (the shipped figures depend on them):
prompts seed·1,000,003 + step; resample 2^48 + (seed·1,000,003 + step)·64 + index; masks
seed·1,000,003 + step·SLOTS + index. The prompts' and the masks' seed different generators
(the task's and torch's), so their values may coincide.
"""

from __future__ import annotations

from typing import Literal

from stabledrl.settings import MAX_MU

__all__ = ["Purpose", "SLOTS", "RESAMPLE_STREAMS", "step_seed"]

Purpose = Literal["prompts", "resample", "masks"]
SLOTS = MAX_MU + 3
"""Mask seed slots per step: 0 unused, 1 ℓ_old's plan, 2 the weights', 3.. the inner iterations'."""
RESAMPLE_STREAMS = 64
"""Resampling rounds per step at most (`TrainConfig.max_resample_rounds` < this)."""
_PRIME = 1_000_003


def step_seed(seed: int, step: int, purpose: Purpose, index: int = 0) -> int:
    """The seed of draw `index` of `purpose` at `step` of a run seeded `seed`."""
    if purpose == "prompts":
        if index:
            raise ValueError("the prompts of a step have one seed: index must be 0")
        return seed * _PRIME + step
    if purpose == "resample":
        if not 0 <= index < RESAMPLE_STREAMS:
            raise ValueError(f"resample round {index} out of range [0, {RESAMPLE_STREAMS})")
        return 2**48 + (seed * _PRIME + step) * RESAMPLE_STREAMS + index
    if purpose == "masks":
        if not 0 <= index < SLOTS:
            raise ValueError(f"seed slot {index} out of range [0, {SLOTS})")
        return seed * _PRIME + step * SLOTS + index
    raise ValueError(f"unknown purpose {purpose!r}: prompts, resample or masks")
