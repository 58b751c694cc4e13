"""A training step's scoring, behind one seam (`StepScoring`): the mask plans, ℓ_old and ℓ_ref
with no graph (`old`), a round's `ScoredBatch` of ℓ_θ (`batch`) and that round's backward
(`backward`). `stabledrl.train` calls these three and nothing below them.

Accumulation rounds (`split_rounds`): the K kept groups are cut in order into min(R, K) rounds
of whole groups; a round's loss counts as the objective's normaliser says, so that the rounds'
gradients add up to the one-round step's. Several processes share each round's rows
(`stabledrl.shards`): each scores its own, the objective sees the gathered ℓ of all rows with
only this process's carrying a graph, and a process with none scores a stand-in row whose
gradient is 0 (DDP and FSDP need a forward and a backward on every process). With a view budget
(`estimator.max_views_per_forward`) ℓ_θ is a leaf scored without a graph and the backward
pushes ∂loss/∂ℓ back view batch by view batch.

Shapes: B' rows of the kept groups, G group size, L completion slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from stabledrl.diagnostics import drift_from_initial
from stabledrl.instruments import backward_measuring_agreement, first_half_loss
from stabledrl.likelihood import ViewPlan, backward_views, eubo, plan_for, score_views
from stabledrl.objectives import ScoredBatch, share_of_loss
from stabledrl.rollouts import RolloutBatch
from stabledrl.seeds import step_seed

__all__ = ["Share", "OldScores", "StepScoring", "split_rounds"]

OLD_SLOT, WEIGHT_SLOT, FIRST_ITERATION_SLOT = 1, 2, 3
"""Mask seed slots (`stabledrl.seeds`): ℓ_old's plan, the weights' plan, inner iteration 0's."""


@dataclasses.dataclass(frozen=True, eq=False)
class Share:
    """This process's rows of one accumulation round: rows [start, end) of B', within the
    round's whole groups [lo, hi), on its device; the round's weight in the step's loss, and
    its part of the step (its rows, or its tokens for a token mean) for the logged metrics. A
    process with none (the round has fewer rows than processes) scores the round's first row
    in their place, a stand-in whose result is dropped and whose gradient is 0."""

    rows: RolloutBatch  # the rows `span` of B'
    start: int
    end: int
    lo: int
    hi: int
    weight: float = 1.0  # the round's loss counts this much in the step's (`share_of_loss`)
    part: float = 1.0  # the round's part of the step, which weighs its metrics (they average to the step's)

    @property
    def n(self) -> int:
        """The round's rows."""
        return self.hi - self.lo

    @property
    def stand_in(self) -> bool:
        return self.start == self.end

    @property
    def span(self) -> tuple[int, int]:
        """The rows [lo, hi) of B' this process scores: its own, or the stand-in (the round's first row)."""
        return (self.lo, self.lo + 1) if self.stand_in else (self.start, self.end)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """(scored rows, ...) -> (end - start, ...): the stand-in's row dropped."""
        return x[: self.end - self.start]


def split_rounds(run: Any, groups: RolloutBatch) -> list[Share]:
    """This process's share of each accumulation round: the K kept groups cut in order into
    min(R, K) rounds as equal as possible. A round's loss counts as the objective's normaliser
    says (its groups / K, its scored tokens / the step's, or 1 for a constant): their weighted
    sum is the one-round loss. `run`: anything with cfg, shards and device (a `Run`)."""
    G, K, normaliser = run.cfg.group_size, len(groups.problems), run.cfg.objective.normaliser
    R, mask = min(run.cfg.accumulation_rounds, K), groups.completion_mask  # (B', L)
    out = []
    for r in range(R):
        lo, hi = r * K // R * G, (r + 1) * K // R * G
        (a, b), (x, y) = run.shards.bounds(hi - lo), run.shards.run_bounds(hi - lo)
        weight = part = 1.0
        if R > 1:  # the loss as the normaliser says; the metrics by the round's rows (a token mean's: tokens)
            weight = share_of_loss(normaliser, mask, lo, hi)
            part = share_of_loss("sequences", mask, lo, hi) if normaliser == "constant" else weight
        out.append(Share(groups.rows(lo + x, lo + y, run.device), lo + a, lo + b, lo, hi, weight, part))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class OldScores:
    """A step's likelihoods under θ_old (and the initial policy), no graph: what its inner iterations share."""

    plan: ViewPlan  # ℓ_old's mask plan (OLD_SLOT), all B' rows
    logp: torch.Tensor  # ℓ_old of all B' rows: (B',), or (B', L) per-token terms
    ref_logp: torch.Tensor | None  # ℓ under the initial policy on the same plan, when there is a reference
    weight_plan: ViewPlan | None = None  # the weights' own plan (WEIGHT_SLOT), when the objective reads it ...
    weight_logp: torch.Tensor | None = None  # ... and ℓ_old on it


class StepScoring:
    """The scoring of one step's kept groups: `old` once, then per inner iteration and round
    `batch` and `backward`. `run` is the training run (`stabledrl.training_run.Run`): its cfg,
    policy, reference, shards, accelerator and device."""

    def __init__(self, run: Any, groups: RolloutBatch, step: int):
        self.run, self.cfg, self.groups, self.step = run, run.cfg, groups, step

    @functools.cached_property
    def rounds(self) -> list[Share]:
        """This process's share of each accumulation round (`split_rounds`)."""
        return split_rounds(self.run, self.groups)

    def plan(self, slot: int) -> ViewPlan:
        """The mask plan of a seed slot of the step, drawn for all B' rows (the same on every
        process, whatever the processes and rounds; each scores its rows of it)."""
        est = self.cfg.estimator
        generator = torch.Generator().manual_seed(step_seed(self.cfg.seed, self.step, "masks", slot))
        return plan_for(self.run.policy, est.method, self.groups, generator=generator,
                        num_samples=est.num_samples, **est.options)

    def old(self) -> tuple[OldScores, dict[str, float]]:
        """ℓ_old on ℓ_old's plan, ℓ_ref on the same plan (and the drift KL(π_old ‖ π_init) as
        metrics), and the weights' ℓ_old on their own plan when the objective reads them."""
        plan = self.plan(OLD_SLOT)
        logp, ref, drift = self.scores(self.run.policy, plan, self.rounds), None, {}
        if self.run.reference is not None:
            with self.run.accelerator.autocast():  # ℓ_old's precision, for a copy accelerate did not prepare
                ref = self.scores(self.run.reference, plan, self.rounds)
            drift = drift_from_initial(logp, ref)
        if not self.cfg.objective.weight_masks:
            return OldScores(plan, logp, ref), drift
        weight_plan = self.plan(WEIGHT_SLOT)
        return OldScores(plan, logp, ref, weight_plan, self.scores(self.run.policy, weight_plan, self.rounds)), drift

    def scores(self, policy, plan: ViewPlan, rounds: list[Share]) -> torch.Tensor:
        """ℓ under `policy` of the rows of `rounds`, a round at a time (each process scores its own), no graph."""
        parts = []
        for share in rounds:
            with torch.no_grad():
                logp, _ = self.own(policy, plan.rows(*share.span), share.rows)
            parts.append(self.run.shards.gather(share.own(logp), share.n).cpu())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def batch(self, old: OldScores, plan: ViewPlan, share: Share, advantages: torch.Tensor, *,
              first_iteration: bool) -> ScoredBatch:
        """ℓ_θ of a round's rows on `plan`, only this process's carrying a graph, beside the step's
        ℓ_old, ℓ_ref and the weights' ℓ of those rows. With a view budget ℓ_θ is a leaf scored
        without a graph (at θ = θ_old on ℓ_old's plan it is ℓ_old, not scored again)."""
        cfg, (lo, hi), shards = self.cfg, (share.lo, share.hi), self.run.shards
        weights = {}
        if cfg.objective.weight_masks:  # before the first step, the weights' ℓ_θ is their ℓ_old
            weights = {"weight_old_logp": old.weight_logp[lo:hi], "weight_logp": old.weight_logp[lo:hi]
                       if first_iteration else self.scores(self.run.policy, old.weight_plan, [share])}
        if cfg.estimator.max_views_per_forward is not None:
            same = first_iteration and cfg.masks == "shared"
            logp = old.logp[lo:hi].clone() if same else self.scores(self.run.policy, plan, [share])
            logp, eubo_ = logp.requires_grad_(), None
        else:
            logp, eubo_ = self.own(self.run.policy, plan.rows(*share.span), share.rows,
                                    eubo_beta=cfg.objective.eubo_beta)
            # A stand-in's empty slice keeps its graph: the backward reaches every weight, with gradient 0
            logp = shards.gather_keeping_graph(share.own(logp), share.n).cpu()
            eubo_ = None if eubo_ is None else shards.gather_keeping_graph(share.own(eubo_), share.n).cpu()
        return ScoredBatch(logp, old.logp[lo:hi], advantages[lo:hi], cfg.group_size, self.groups.completion_mask[lo:hi],
                           ref_logp=None if old.ref_logp is None else old.ref_logp[lo:hi], eubo=eubo_,
                           step_rows=cfg.prompts_per_step * cfg.group_size, **weights)

    def backward(self, loss: torch.Tensor, batch: ScoredBatch, plan: ViewPlan, share: Share, objective, *,
                 first_iteration: bool) -> dict[str, float]:
        """∇ of the round's share of the loss (loss × its weight) into the parameters' .grad, added
        to what earlier rounds left, × N: DDP averages the processes' gradients, and the loss's
        gradient is their sum. With grad_agreement (first iteration, one round), in two halves,
        whose cosine it returns as `grad_agreement`; with a view budget, view batch by view batch."""
        run, est = self.run, self.cfg.estimator
        acc, world, loss = run.accelerator, run.shards.world, loss * share.weight
        if self.cfg.grad_agreement and first_iteration and batch.advantages.size(0) >= 2 * batch.group_size:
            part = first_half_loss(objective, batch, normaliser=self.cfg.objective.normaliser)
            return {"grad_agreement": backward_measuring_agreement(loss, part, run.params, acc.backward)}
        if est.max_views_per_forward is None:
            acc.backward(loss * world)
            return {}
        loss.backward()  # ℓ_θ is a leaf: ∂loss/∂ℓ, then back through the views a batch at a time
        grad = (torch.zeros_like(batch.logp.grad[:1]) if share.stand_in  # the stand-in row: gradient 0
                else batch.logp.grad[share.start - share.lo:share.end - share.lo] * world)
        backward_views(run.policy, plan.rows(*share.span), share.rows, grad,
                       reduction=est.reduction, max_views_per_forward=est.max_views_per_forward,
                       backward=acc.backward, no_sync=lambda: acc.no_sync(run.policy.model))
        return {}

    def own(self, policy, plan: ViewPlan, rows: RolloutBatch, *,
             eubo_beta: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ℓ of this process's rows under `policy`: (share,), or (share, L) for an objective of
        per-token terms; with `eubo_beta`, SPG's EUBO on the same views too."""
        est = score_views(policy, plan, rows, reduction=self.cfg.estimator.reduction,
                          max_views_per_forward=self.cfg.estimator.max_views_per_forward)
        logp = est.token if self.cfg.objective.token_terms else est.sequence
        return logp, None if eubo_beta is None else eubo(plan, est.views, rows.completion_mask, beta=eubo_beta)
