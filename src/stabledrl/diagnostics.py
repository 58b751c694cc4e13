"""Run-level diagnostics of the instability loop: a collapse flag and gradient agreement.

`CollapseMonitor` reads a run's step rows as they come and raises a flag when the run
has fallen far below its own best or its gradient norm keeps spiking:

- reward: the mean training reward over the last `window` steps has fallen below
  `drop` × its best windowed value (the windowed mean removes the single-step noise of
  16 prompts);
- held-out: an evaluation's accuracy has fallen below `drop` × the best evaluation so far
  (the initial one included);
- spikes: `spikes` or more of the last `window` steps had a gradient norm above
  `spike_factor` × the running median of the last 50 norms before them, an infinite one,
  or were skipped (a non-finite loss or gradient: `skipped_steps` grew). A NaN norm of a
  step that was not skipped (DeepSpeed may report none) is no spike.

The flag is sticky once raised and names its reasons; a diagnostic, not a stopping rule.

`flat_grad_cosine` computes the trainer's `grad_agreement`, the cosine between the gradients
of two halves of a step's groups: near 0 the batch is too small to learn from (README, "RL
that learns").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

__all__ = ["CollapseMonitor", "drift_from_initial", "flat_grad_cosine"]


@dataclass
class CollapseMonitor:
    """Feed it each step row with `update`; `reasons` lists why the run looks collapsed."""

    window: int = 10
    """Steps in the reward window and the spike window."""
    drop: float = 0.5
    """Collapse when a windowed reward or an evaluation falls below drop × its best."""
    spike_factor: float = 10.0
    """A gradient norm above spike_factor × the running median is a spike."""
    spikes: int = 3
    """Spikes within the last `window` steps that make a collapse."""
    reasons: list[str] = field(default_factory=list)
    _rewards: deque = field(default_factory=deque, repr=False)
    _best_reward: float = -math.inf
    _best_eval: float = -math.inf
    _norms: deque = field(default_factory=lambda: deque(maxlen=50), repr=False)
    _skipped: int = 0
    _spike_steps: deque = field(default_factory=deque, repr=False)
    _steps: int = 0

    def update(self, row: dict) -> list[str]:
        """Read one metrics row (a step's, an evaluation's or both); returns the new reasons."""
        new: list[str] = []
        if "reward_mean" in row:
            self._steps += 1
            self._rewards.append(float(row["reward_mean"]))
            if len(self._rewards) > self.window:
                self._rewards.popleft()
            if len(self._rewards) == self.window:
                mean = sum(self._rewards) / self.window
                self._best_reward = max(self._best_reward, mean)
                if self._best_reward > 0 and mean < self.drop * self._best_reward:
                    new.append("reward")
        norm = row.get("grad_norm_max", row.get("grad_norm"))
        skipped = "skipped_steps" in row and int(row["skipped_steps"]) > self._skipped
        if "skipped_steps" in row:
            self._skipped = int(row["skipped_steps"])
        if norm is not None:
            norm = float(norm)
            history = [n for n in self._norms if math.isfinite(n)]
            spike = skipped or math.isinf(norm) or (
                len(history) >= 3 and norm > self.spike_factor * statistics.median(history))
            if spike:
                self._spike_steps.append(self._steps)
            self._norms.append(norm)
            while self._spike_steps and self._spike_steps[0] <= self._steps - self.window:
                self._spike_steps.popleft()
            if len(self._spike_steps) >= self.spikes:
                new.append("grad_spikes")
        if "eval_accuracy" in row:
            acc = float(row["eval_accuracy"])
            if self._best_eval > 0 and acc < self.drop * self._best_eval:
                new.append("held_out")
            self._best_eval = max(self._best_eval, acc)
        new = [r for r in new if r not in self.reasons]
        self.reasons.extend(new)
        return new

    @property
    def collapsed(self) -> bool:
        return bool(self.reasons)


def flat_grad_cosine(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Cosine between two gradients given parameter by parameter (None: zero), in float64."""
    dot = na = nb = 0.0
    for x, y in zip(a, b):
        x64 = None if x is None else x.detach().double()
        y64 = None if y is None else y.detach().double()
        if x64 is not None:
            na += float((x64 * x64).sum())
        if y64 is not None:
            nb += float((y64 * y64).sum())
        if x64 is not None and y64 is not None:
            dot += float((x64 * y64).sum())
    if na == 0 or nb == 0:
        return float("nan")
    return dot / math.sqrt(na * nb)


def drift_from_initial(old_logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, float]:
    """KL(π_old ‖ π_init) from π_old's own rollouts, given ℓ_old and ℓ_init on the same masks
    ((B,) estimates, or (B, L) per-token terms summed per row): ``drift_kl``, the mean of
    gap = ℓ_old − ℓ_init (k1, which can fall below 0), ``drift_k3``, the mean of
    (r − 1) − log r with r = π_init / π_old = e^{−gap} (every term ≥ 0), in float64, and
    ``drift_k3_median``, their median: one rollout's likelihood noise (a gap of −30 is a term of
    1e13) moves the mean, not the median, which rises only when most rollouts drift."""
    gap = old_logp - ref_logp
    gap = gap.sum(-1) if gap.dim() == 2 else gap  # (B,)
    k3 = torch.expm1(-gap.double()) + gap.double()  # (B,)
    return {"drift_kl": float(gap.mean()), "drift_k3": float(k3.mean()), "drift_k3_median": float(k3.median())}
