"""RL post-training of a diffusion LM (the `train` verb): GRPO, StableDRL, wd1, SPG, diffu-GRPO, GDPO.

`train(cfg)` sets up, then runs one loop whose body is a step, in order: prompts → G
rollouts each from θ_old → rewards and group advantages (groups whose rewards all tie:
kept, skipped or replaced, `zero_variance_groups`) → a mask plan, ℓ_old and ℓ_ref, no grad
→ μ inner iterations of ℓ_θ → objective → backward → clip → optimizer step (a non-finite
loss or gradient: skipped, counted, the weights untouched) → log, evaluate, save. With
`accumulation_rounds` R, scoring and backward run a round of whole groups at a time, each
round's loss weighted by its share of the step's, the gradients adding up before the step.

The objective is `objectives.OBJECTIVES[cfg.objective.name]`, a function of a `ScoredBatch`.
Several processes (``accelerate launch``) share each batch's rows (`stabledrl.shards`): every
process sees every group, the objective runs on the gathered ℓ of all rows with only this
process's rows carrying a graph (a process with none scores a stand-in row with gradient 0),
and the loss is scaled by N because DDP averages gradients.
Every random draw comes from a generator seeded by (seed, step, purpose), so N processes
compute the update of one and a resumed run continues exactly. Deviations from the named
algorithms and the multi-process details: docs/methods.md, "The training step".

Shapes: P prompts per step, G group size, B' rows of the kept groups, L completion slots.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from stabledrl.checkpoint import save_checkpoint
from stabledrl.diagnostics import drift_from_initial
from stabledrl.instruments import backward_measuring_agreement, first_half_loss, step_measuring_update
from stabledrl.likelihood import ViewPlan, backward_views, eubo, plan_for, score_views
from stabledrl.objectives import ScoredBatch, group_advantages, objective_for, share_of_loss
from stabledrl.rollouts import RolloutBatch, concat_groups, drop_flat_groups, roll_groups
from stabledrl.settings import MAX_MU, EstimatorConfig, ObjectiveConfig, TrainConfig  # noqa: F401 (re-exported)
from stabledrl.training_run import GatheredPolicy, Run, set_up

__all__ = ["train", "run_train", "set_up", "Run", "TrainConfig", "EstimatorConfig", "ObjectiveConfig"]


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, task: Any = None) -> dict[str, Any]:
    """Train; returns the run's summary (initial and final held-out evaluations, counters).
    `task`: a task object to use instead of cfg.task's."""
    objective = objective_for(cfg.objective)  # before set-up: an objective without a loss stops here
    run = set_up(cfg, resume=resume, task=task)
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps, desc=f"train {cfg.objective.name}",
               disable=not (progress and run.main))
    for step in bar:
        run.timer.start()
        run.policy.model.eval()  # the update too: no dropout, so ρ = 1 at θ = θ_old and every process agrees

        # Prompts, G rollouts of each from θ_old, their rewards; groups whose rewards tie carry no signal
        with run.timer.phase("rollout"):
            first = _roll(run, run.task.generate(cfg.prompts_per_step, split="train", seed=cfg.seed * 1_000_003 + step),
                          step, round_=0)
            groups = _groups_to_train_on(run, first, step)
        row = {"step": step + 1, **_rollout_metrics(first), "groups_used": len(groups.problems),
               "lr": run.sched.get_last_lr()[0]}

        if groups.problems:
            # Advantages; the accumulation rounds; a mask plan, and on it ℓ_old and ℓ_ref, no grad
            advantages = group_advantages(groups.rewards.flatten(), cfg.group_size, cfg.objective.advantage_scale)
            with run.timer.phase("likelihood_old"), torch.no_grad():
                old = _old_scores(run, groups, step, _rounds(run, groups), row)

            iterations = []
            for it in range(cfg.mu):
                with run.timer.phase("update"):
                    # Score ℓ_θ on ℓ_old's masks (shared) or fresh ones (independent), a round at a time
                    plan = old.plan if cfg.masks == "shared" else _plan(run, groups, step, 3 + it)
                    run.opt.zero_grad(set_to_none=True)
                    it_row, finite = {}, True
                    for share in old.rounds:  # one round's graph at a time; their gradients add up
                        batch = _scored_batch(run, groups, old, plan, share, advantages, first_iteration=it == 0)
                        # Objective, backward of the round's share of the step's loss
                        out = objective(batch)
                        _add_round(it_row, out, share)
                        if not (finite := bool(torch.isfinite(out.loss))):
                            break
                        with run.timer.phase("backward", until_gpu_done=True):
                            _backward(run, out.loss, batch, plan, share, objective, row, first_iteration=it == 0)
                    finite = finite and _clip(run, it_row)  # clip, then step (a non-finite loss or gradient: skipped)
                    it_row.update(_step_or_skip(run, finite))
                iterations.append(it_row)
            row.update(_over_iterations(iterations))
        _advance_schedule(run)

        # Log, evaluate, save
        row.update({**run.counters, **run.timer.row()})
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            row.update(run.evaluate_row(done))
        run.check_collapse(row)
        if done % cfg.log_every == 0 or "eval_accuracy" in row:
            run.log(row)
        if done % cfg.save_every == 0 or done == cfg.steps:
            _save_checkpoint(run, done)
        bar.set_postfix(_progress(run, row))
    bar.close()
    return run.finish()


run_train = train
"""The name the command line and the benchmarks call."""


def _advance_schedule(run: Run) -> None:
    """One step of the learning-rate schedule, which counts steps, skipped ones too. After a
    skipped first step no optimizer.step() came before it, and torch warns that the order is
    wrong; here it is the design, so that one warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        run.sched.step()


# --- The phases' helpers, in the order the step calls them ---------------------------------


def _roll(run: Run, problems: list, step: int, *, round_: int) -> RolloutBatch:
    cfg = run.cfg
    return roll_groups(run.policy, run.task, problems, group_size=cfg.group_size, sampling=cfg.rollout,
                       gen_length=cfg.rollout.gen_length or run.task.completion_length,
                       tag=f"{cfg.seed}/{step}/{round_}", shards=run.shards)


def _groups_to_train_on(run: Run, first: RolloutBatch, step: int) -> RolloutBatch:
    """The groups of the first round, all (keep) or those whose rewards differ (skip), and
    (resample) those of up to `max_resample_rounds` rounds of fresh problems refilling the step.
    Counts the groups whose rewards all tie, and the groups rolled out in extra rounds."""
    cfg = run.cfg
    run.counters["zero_variance_groups"] += int(first.flat().sum())
    parts = [first if cfg.zero_variance_groups == "keep" else drop_flat_groups(first)]
    for r in range(cfg.max_resample_rounds if cfg.zero_variance_groups == "resample" else 0):
        missing = cfg.prompts_per_step - sum(len(p.problems) for p in parts)
        if missing <= 0:
            break
        extra = _roll(run, run.task.generate(missing, split="train", seed=_resample_seed(cfg.seed, step, r)), step,
                      round_=r + 1)
        run.counters["zero_variance_groups"] += int(extra.flat().sum())
        run.counters["resampled_groups"] += missing
        parts.append(drop_flat_groups(extra))
    return concat_groups(parts, run.policy.pad_token_id)


def _resample_seed(seed: int, step: int, round_: int) -> int:
    """Prompts of resampling round r: a stream apart from the training problems' seeds."""
    return 2**48 + (seed * 1_000_003 + step) * 64 + round_


def _rollout_metrics(first: RolloutBatch) -> dict[str, float]:
    """On-policy statistics of the step's first round of P·G rollouts."""
    rewards = first.rewards.flatten()  # (P·G,)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy_train": float((rewards == 1.0).float().mean()),
            "completion_length": float(first.completion_mask.sum(1).float().mean()),
            "entropy": float(first.entropy.mean()), "zero_variance_fraction": float(first.flat().float().mean())}


@dataclasses.dataclass(frozen=True, eq=False)
class Share:
    """This process's rows of one accumulation round: rows [start, end) of B', within the
    round's whole groups [lo, hi), on its device; the round's weight in the step's loss, and
    its part of the step (its rows, or its tokens for a token mean) for the logged metrics. A
    process with none (the round has fewer rows than processes) scores the round's first row
    in their place, a stand-in whose result is dropped and whose gradient is 0: DDP and FSDP
    need a forward and a backward on every process."""

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


def _rounds(run: Run, groups: RolloutBatch) -> list[Share]:
    """This process's share of each accumulation round: the K kept groups cut in order into
    min(R, K) rounds as equal as possible. A round's loss counts as the objective's normaliser
    says (its groups / K, its scored tokens / the step's, or 1 for a constant): their weighted
    sum is the one-round loss."""
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

    rounds: list[Share]  # this process's rows of each accumulation round
    plan: ViewPlan  # ℓ_old's mask plan (seed slot 1), all B' rows
    logp: torch.Tensor  # ℓ_old of all B' rows: (B',), or (B', L) per-token terms
    ref_logp: torch.Tensor | None  # ℓ under the initial policy on the same plan, when there is a reference
    weight_plan: ViewPlan | None = None  # the weights' own plan (seed slot 2), when the objective reads it ...
    weight_logp: torch.Tensor | None = None  # ... and ℓ_old on it


_SEED_SLOTS = MAX_MU + 3  # per step: 0 unused (rollouts draw per row), 1 ℓ_old's plan, 2 the weights', 3.. inner iterations'


def _plan(run: Run, groups: RolloutBatch, step: int, slot: int) -> ViewPlan:
    """The mask plan of a seed slot of a step, drawn for all B' rows (the same on every
    process, whatever the processes and rounds; each scores its rows of it)."""
    if not 0 <= slot < _SEED_SLOTS:
        raise ValueError(f"seed slot {slot} out of range")
    est = run.cfg.estimator
    generator = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step * _SEED_SLOTS + slot)
    return plan_for(run.policy, est.method, groups, generator=generator, num_samples=est.num_samples, **est.options)


def _old_scores(run: Run, groups: RolloutBatch, step: int, rounds: list[Share], row: dict[str, Any]) -> OldScores:
    """ℓ_old on the plan of seed slot 1, ℓ_ref on the same plan (and the drift KL(π_old ‖ π_init)
    into `row`), and the weights' ℓ_old on their own plan when the objective reads them."""
    plan = _plan(run, groups, step, 1)
    logp, ref = _scores(run, run.policy, plan, rounds), None
    if run.reference is not None:
        with run.accelerator.autocast():  # ℓ_old's precision, for a copy accelerate did not prepare (DDP, FSDP)
            ref = _scores(run, run.reference, plan, rounds)
        row.update(drift_from_initial(logp, ref))
    if not run.cfg.objective.weight_masks:
        return OldScores(rounds, plan, logp, ref)
    weight_plan = _plan(run, groups, step, 2)
    return OldScores(rounds, plan, logp, ref, weight_plan, _scores(run, run.policy, weight_plan, rounds))


def _own_scores(run: Run, policy, plan: ViewPlan, rows: RolloutBatch, *,
                eubo_beta: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ℓ of this process's rows under `policy`: (share,), or (share, L) for an objective of
    per-token terms; with `eubo_beta`, SPG's EUBO on the same views too."""
    est = score_views(policy, plan, rows, reduction=run.cfg.estimator.reduction,
                      max_views_per_forward=run.cfg.estimator.max_views_per_forward)
    logp = est.token if run.cfg.objective.token_terms else est.sequence
    return logp, None if eubo_beta is None else eubo(plan, est.views, rows.completion_mask, beta=eubo_beta)


def _scores(run: Run, policy, plan: ViewPlan, rounds: list[Share]) -> torch.Tensor:
    """ℓ under `policy` of the rows of `rounds`, a round at a time (each process scores its own), no graph."""
    parts = []
    for share in rounds:
        with torch.no_grad():
            logp, _ = _own_scores(run, policy, plan.rows(*share.span), share.rows)
        parts.append(run.shards.gather(share.own(logp), share.n).cpu())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scored_batch(run: Run, groups: RolloutBatch, old: OldScores, plan: ViewPlan, share: Share,
                  advantages: torch.Tensor, *, first_iteration: bool) -> ScoredBatch:
    """ℓ_θ of a round's rows on `plan`, only this process's carrying a graph, beside the step's
    ℓ_old, ℓ_ref and the weights' ℓ of those rows. With a view budget ℓ_θ is a leaf scored
    without a graph (at θ = θ_old on ℓ_old's plan it is ℓ_old, not scored again), and `_backward`
    pushes ∂loss/∂ℓ back view batch by view batch: the update never holds more than one micro-batch's graph."""
    cfg, (lo, hi) = run.cfg, (share.lo, share.hi)
    weights = {}
    if cfg.objective.weight_masks:  # before the first step, the weights' ℓ_θ is their ℓ_old
        weights = {"weight_old_logp": old.weight_logp[lo:hi], "weight_logp": old.weight_logp[lo:hi]
                   if first_iteration else _scores(run, run.policy, old.weight_plan, [share])}
    if cfg.estimator.max_views_per_forward is not None:
        same = first_iteration and cfg.masks == "shared"
        logp = old.logp[lo:hi].clone() if same else _scores(run, run.policy, plan, [share])
        logp, eubo_ = logp.requires_grad_(), None
    else:
        logp, eubo_ = _own_scores(run, run.policy, plan.rows(*share.span), share.rows,
                                  eubo_beta=cfg.objective.eubo_beta)
        # A stand-in's empty slice keeps its graph: the backward reaches every weight, with gradient 0
        logp = run.shards.gather_keeping_graph(share.own(logp), share.n).cpu()
        eubo_ = None if eubo_ is None else run.shards.gather_keeping_graph(share.own(eubo_), share.n).cpu()
    return ScoredBatch(logp, old.logp[lo:hi], advantages[lo:hi], cfg.group_size, groups.completion_mask[lo:hi],
                       ref_logp=None if old.ref_logp is None else old.ref_logp[lo:hi], eubo=eubo_,
                       step_rows=cfg.prompts_per_step * cfg.group_size, **weights)


def _add_round(it_row: dict[str, Any], out, share: Share) -> None:
    """A round's loss and metrics into its inner iteration's row: the loss weighted by the round's
    weight (their sum is the step's), the metrics by its part (a weighted mean), maxima of *_max."""
    for k, v in {**out.metrics, "loss": float(out.loss.detach())}.items():
        weight = share.weight if k == "loss" else share.part
        if k.endswith("_max"):
            it_row[k] = max(it_row.get(k, v), v)
        else:
            it_row[k] = it_row[k] + v * weight if k in it_row else v * weight
    it_row.setdefault("grad_norm", math.nan)


def _backward(run: Run, loss: torch.Tensor, batch: ScoredBatch, plan: ViewPlan, share: Share, objective,
              row: dict[str, Any], *, first_iteration: bool) -> None:
    """∇ of the round's share of the loss (loss × its weight) into the parameters' .grad, added to
    what earlier rounds left, × N: DDP averages the processes' gradients, and the loss's gradient
    is their sum. With grad_agreement (first iteration, one round), in two halves whose cosine
    goes into `row`; with a view budget, view batch by view batch."""
    acc, est, world = run.accelerator, run.cfg.estimator, run.shards.world
    loss = loss * share.weight
    if run.cfg.grad_agreement and first_iteration and batch.advantages.size(0) >= 2 * batch.group_size:
        part = first_half_loss(objective, batch, normaliser=run.cfg.objective.normaliser)
        row["grad_agreement"] = backward_measuring_agreement(loss, part, run.params, acc.backward)
    elif est.max_views_per_forward is None:
        acc.backward(loss * world)
    else:
        loss.backward()  # ℓ_θ is a leaf: ∂loss/∂ℓ, then back through the views a batch at a time
        grad = (torch.zeros_like(batch.logp.grad[:1]) if share.stand_in  # the stand-in row: gradient 0
                else batch.logp.grad[share.start - share.lo:share.end - share.lo] * world)
        backward_views(run.policy, plan.rows(*share.span), share.rows, grad,
                       reduction=est.reduction, max_views_per_forward=est.max_views_per_forward,
                       backward=acc.backward, no_sync=lambda: acc.no_sync(run.policy.model))


def _clip(run: Run, it_row: dict[str, Any]) -> bool:
    """Clip the gradient's norm; log the norm before clipping; whether it is finite."""
    norm = run.accelerator.clip_grad_norm_(run.params, run.cfg.grad_clip)
    it_row["grad_norm"] = float("nan") if norm is None else float(norm)  # DeepSpeed clips inside, may report none
    return norm is None or math.isfinite(it_row["grad_norm"])


def _step_or_skip(run: Run, finite: bool) -> dict[str, float]:
    """The optimizer step, or (not finite) the gradient dropped and the step counted as skipped;
    with update_norm, the norm of the change in the weights."""
    if not finite:
        run.opt.zero_grad(set_to_none=True)
        run.counters["skipped_steps"] += 1
        return {"update_norm": 0.0} if run.cfg.update_norm else {}
    if run.cfg.update_norm:
        return {"update_norm": step_measuring_update(run.opt, run.params)}
    run.opt.step()
    return {}


def _over_iterations(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the μ inner iterations: maxima of *_max metrics, means of the others."""
    out = {k: (max if k.endswith("_max") else lambda v: sum(v) / len(v))([r[k] for r in rows]) for k in rows[0]}
    # NaN (a skipped inner iteration) wins: the step's largest norm is then not a number
    out["grad_norm_max"] = max((r["grad_norm"] for r in rows), key=lambda v: (math.isnan(v), v))
    return out


def _progress(run: Run, row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's values: only those the step computed (no gradient norm or ratio in a step
    with no group to train on, none of the ratio diagnostics for an objective that returns none)."""
    shown = {"reward": f"{row['reward_mean']:.3f}"}
    if "grad_norm" in row:
        shown["gnorm"] = f"{row['grad_norm']:.2g}"
    if "ratio_max" in row:
        shown["ratio_max"] = f"{row['ratio_max']:.3g}"
    collapse = {"COLLAPSE": ",".join(run.monitor.reasons)} if run.monitor.collapsed else {}
    return {**shown, "skipped": run.counters["skipped_steps"], **collapse}


def _save_checkpoint(run: Run, done: int) -> Path:
    """The optimizer goes into accelerate's state, the rest (the same on every process) here."""
    state = {"scheduler": run.sched.state_dict(), "step": done, "counters": run.counters,
             "history": run.history, "collapse": run.monitor}
    return save_checkpoint(run.out, done, GatheredPolicy(run.policy, run.accelerator), state,
                           keep=run.cfg.keep_checkpoints, accelerator=run.accelerator)
