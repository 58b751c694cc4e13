"""RL post-training of a diffusion LM (the `train` verb): GRPO, StableDRL, wd1, SPG, diffu-GRPO, GDPO.

`train(cfg)` sets up, then runs one loop whose body is a step, in order: prompts → G
rollouts each from θ_old → rewards and group advantages (groups whose rewards all tie:
kept, skipped or replaced, `zero_variance_groups`) → a mask plan, ℓ_old and ℓ_ref, no grad
→ μ inner iterations of ℓ_θ → objective → backward → clip → optimizer step (a non-finite
loss or gradient: skipped, counted, the weights untouched) → log, evaluate, save.

The objective is `objectives.OBJECTIVES[cfg.objective.name]`, a function of a `ScoredBatch`.
Several processes (``accelerate launch``) share each batch's rows (`stabledrl.shards`): every
process sees every group, the objective runs on the gathered ℓ of all rows with only this
process's rows carrying a graph, and the loss is scaled by N because DDP averages gradients.
Every random draw comes from a generator seeded by (seed, step, purpose), so N processes
compute the update of one and a resumed run continues exactly. Deviations from the named
algorithms and the multi-process details: docs/methods.md, "The training step".

Shapes: P prompts per step, G group size, B' rows of the kept groups, L completion slots.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from stabledrl.checkpoint import save_checkpoint
from stabledrl.instruments import backward_measuring_agreement, first_half_loss, step_measuring_update
from stabledrl.likelihood import backward_views, eubo, plan_for, score_views
from stabledrl.objectives import ScoredBatch, group_advantages, objective_for
from stabledrl.rollouts import RolloutBatch, concat_groups, drop_flat_groups, roll_groups
from stabledrl.settings import MAX_MU, EstimatorConfig, ObjectiveConfig, TrainConfig  # noqa: F401 (re-exported)
from stabledrl.training_run import GatheredPolicy, Run, set_up

__all__ = ["train", "run_train", "set_up", "Run", "TrainConfig", "EstimatorConfig", "ObjectiveConfig"]


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, task: Any = None) -> dict[str, Any]:
    """Train; returns the run's summary (initial and final held-out evaluations, counters).
    `task`: a task object to use instead of cfg.task's."""
    run = set_up(cfg, resume=resume, task=task)
    policy, shards, timer, G = run.policy, run.shards, run.timer, cfg.group_size
    objective = objective_for(cfg.objective)
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps, desc=f"train {cfg.objective.name}",
               disable=not (progress and run.main))
    for step in bar:
        timer.start()
        policy.model.eval()  # the update too: no dropout, so ρ = 1 at θ = θ_old and every process agrees

        # Prompts, G rollouts of each from θ_old, rewards; groups whose rewards tie carry no signal
        with timer.phase("rollout"):
            first = _roll(run, run.task.generate(cfg.prompts_per_step, split="train", seed=cfg.seed * 1_000_003 + step),
                          step, 0)
            groups, zero, resampled = _groups_to_train_on(run, first, step)
        row = {"step": step + 1, **_rollout_metrics(first), "groups_used": len(groups.problems),
               "lr": run.sched.get_last_lr()[0]}
        run.counters["zero_variance_groups"] += zero
        run.counters["resampled_groups"] += resampled

        if groups.problems:
            advantages = group_advantages(groups.rewards.flatten(), G, cfg.objective.advantage_scale)  # (B',)
            n = groups.completion_ids.size(0)  # B'
            start, end = shards.bounds(n)  # this process's rows of the likelihoods
            mine = groups.rows(start, end, run.device)

            # The mask plan (seed slot 1), ℓ_old and ℓ_ref on it; the weights' own plan (slot 2)
            with timer.phase("likelihood_old"), torch.no_grad():
                plan_old = _plan(run, groups, step, 1, start, end)
                old = _scores(run, policy, plan_old, mine, n)
                ref = None
                if run.reference is not None:
                    with run.accelerator.autocast():  # a reference copy is not prepared: ℓ_old's precision
                        ref = _scores(run, run.reference, plan_old, mine, n)
                    row["drift_kl"] = _drift_kl(old, ref)
                if cfg.objective.weight_masks:
                    plan_weight = _plan(run, groups, step, 2, start, end)
                    weight_old = _scores(run, policy, plan_weight, mine, n)

            iterations = []
            for it in range(cfg.mu):
                with timer.phase("update"):
                    # Score ℓ_θ on ℓ_old's plan (shared masks) or a fresh one (slot 3 + it)
                    plan = plan_old if cfg.masks == "shared" else _plan(run, groups, step, 3 + it, start, end)
                    weights = {}
                    if cfg.objective.weight_masks:  # before the first step, the weights' ℓ_θ is their ℓ_old
                        with torch.no_grad():
                            weights = {"weight_old_logp": weight_old, "weight_logp": weight_old if it == 0 else
                                       _scores(run, policy, plan_weight, mine, n)}
                    run.opt.zero_grad(set_to_none=True)
                    logp, eubo_ = _theta_scores(run, plan, mine, n, old if it == 0 and cfg.masks == "shared" else None)
                    batch = ScoredBatch(logp, old, advantages, groups.completion_mask, G, ref_logp=ref, eubo=eubo_,
                                        **weights)

                    # Objective, backward, clip
                    out = objective(batch)
                    finite, grad_norm = bool(torch.isfinite(out.loss)), float("nan")
                    it_row = {**out.metrics, "loss": float(out.loss.detach())}
                    if finite:
                        with timer.phase("backward", until_gpu_done=True):
                            if cfg.grad_agreement and it == 0 and len(groups.problems) >= 2:
                                part = first_half_loss(objective, batch, token_weighted=cfg.objective.token_weighted)
                                row["grad_agreement"] = backward_measuring_agreement(
                                    out.loss, part, run.params, run.accelerator.backward)
                            else:
                                _backward(run, out.loss, logp, plan, mine, start, end)
                        norm = run.accelerator.clip_grad_norm_(run.params, cfg.grad_clip)
                        grad_norm = float("nan") if norm is None else float(norm)  # DeepSpeed may report none
                        finite = norm is None or math.isfinite(grad_norm)
                    it_row["grad_norm"] = grad_norm

                    # Step, or skip: a non-finite loss or gradient never reaches the weights
                    if not finite:
                        run.opt.zero_grad(set_to_none=True)
                        run.counters["skipped_steps"] += 1
                    elif cfg.update_norm:
                        it_row["update_norm"] = step_measuring_update(run.opt, run.params)
                    else:
                        run.opt.step()
                    if cfg.update_norm and not finite:
                        it_row["update_norm"] = 0.0
                iterations.append(it_row)
            row.update(_over_iterations(iterations))
        run.sched.step()

        # Log, evaluate, save
        row.update(run.counters)
        row.update(timer.row())
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            res = run.evaluate()
            row.update(eval_accuracy=res["accuracy"], eval_reward=res["mean_reward"])
        run.check_collapse(row)
        if done % cfg.log_every == 0 or "eval_accuracy" in row:
            run.log(row)
        if done % cfg.save_every == 0 or done == cfg.steps:
            _save_checkpoint(run, done)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", gnorm=f"{row.get('grad_norm', 0):.2g}",
                        ratio_max=f"{row.get('ratio_max', 1):.3g}", skipped=run.counters["skipped_steps"],
                        **({"COLLAPSE": ",".join(run.monitor.reasons)} if run.monitor.collapsed else {}))
    bar.close()
    return run.finish()


run_train = train
"""The name the command line and the benchmarks call."""


# --- The phases' helpers, in the order the step calls them ---------------------------------


def _roll(run: Run, problems: list, step: int, round_: int) -> RolloutBatch:
    cfg = run.cfg
    return roll_groups(run.policy, run.task, problems, group_size=cfg.group_size, sampling=cfg.rollout,
                       gen_length=cfg.rollout.gen_length or run.task.completion_length,
                       tag=f"{cfg.seed}/{step}/{round_}", shards=run.shards)


def _groups_to_train_on(run: Run, first: RolloutBatch, step: int) -> tuple[RolloutBatch, int, int]:
    """The groups of the first round, all (keep) or those whose rewards differ (skip), and
    (resample) those of up to `max_resample_rounds` rounds of fresh problems refilling the step;
    with the number of groups whose rewards all tie, and of groups rolled out in extra rounds."""
    cfg = run.cfg
    zero, resampled = int(first.flat().sum()), 0
    parts = [first if cfg.zero_variance_groups == "keep" else drop_flat_groups(first)]
    for r in range(cfg.max_resample_rounds if cfg.zero_variance_groups == "resample" else 0):
        missing = cfg.prompts_per_step - sum(len(p.problems) for p in parts)
        if missing <= 0:
            break
        extra = _roll(run, run.task.generate(missing, split="train", seed=_resample_seed(cfg.seed, step, r)), step, r + 1)
        zero, resampled = zero + int(extra.flat().sum()), resampled + missing
        parts.append(drop_flat_groups(extra))
    return concat_groups(parts, run.policy.pad_token_id), zero, resampled


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


_SEED_SLOTS = MAX_MU + 3  # per step: 0 unused (rollouts draw per row), 1 ℓ_old's plan, 2 the weights', 3.. inner iterations'


def _plan(run: Run, groups: RolloutBatch, step: int, slot: int, start: int, end: int):
    """The mask plan of a seed slot of a step, drawn for all B' rows (the same on every
    process), for this process's rows start:end."""
    if not 0 <= slot < _SEED_SLOTS:
        raise ValueError(f"seed slot {slot} out of range")
    est = run.cfg.estimator
    generator = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step * _SEED_SLOTS + slot)
    return plan_for(run.policy, est.method, groups.completion_mask, num_samples=est.num_samples, generator=generator,
                    prompt_ids=groups.prompt_ids, prompt_mask=groups.prompt_mask,
                    unmask_step=groups.unmask_step if est.method == "path" else None, **est.options).rows(start, end)


def _own_scores(run: Run, policy, plan, mine: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ℓ of this process's rows under `policy`: (share,) or, for an objective of per-token
    terms, (share, L); and SPG's EUBO on the same views when the objective reads it."""
    beta = run.cfg.objective.eubo_beta
    est = score_views(policy, plan, mine.prompt_ids, mine.completion_ids, mine.completion_mask,
                      prompt_mask=mine.prompt_mask, reduction=run.cfg.estimator.reduction,
                      max_views_per_forward=run.cfg.estimator.max_views_per_forward, keep_views=beta is not None)
    logp = est.token if run.cfg.objective.token_terms else est.sequence
    return logp, None if beta is None else eubo(plan, est.views, mine.completion_mask, beta=beta)


def _scores(run: Run, policy, plan, mine: RolloutBatch, n: int) -> torch.Tensor:
    """ℓ under `policy` of all n rows (each process scores its own), no graph."""
    with torch.no_grad():
        est = score_views(policy, plan, mine.prompt_ids, mine.completion_ids, mine.completion_mask,
                          prompt_mask=mine.prompt_mask, reduction=run.cfg.estimator.reduction,
                          max_views_per_forward=run.cfg.estimator.max_views_per_forward)
    logp = est.token if run.cfg.objective.token_terms else est.sequence
    return run.shards.gather(logp, n).cpu()


def _drift_kl(old: torch.Tensor, ref: torch.Tensor) -> float:
    """KL(π_old ‖ π_init) ≈ the mean over π_old's own samples of ℓ_old − ℓ_init."""
    gap = old - ref  # (B',) or per-token terms (B', L)
    return float((gap.sum(-1) if gap.dim() == 2 else gap).mean())


def _theta_scores(run: Run, plan, mine: RolloutBatch, n: int,
                  old: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ℓ_θ (and the EUBO) of all n rows, only this process's carrying a graph. With a view
    budget none does: ℓ_θ is a leaf scored without a graph (`old`: θ is θ_old on ℓ_old's
    plan, so it is ℓ_old, not scored again), and `_backward` pushes ∂loss/∂ℓ back view batch
    by view batch, so the update never holds more than one micro-batch's graph."""
    if run.cfg.estimator.max_views_per_forward is not None:
        logp = old.clone() if old is not None else _scores(run, run.policy, plan, mine, n)
        return logp.requires_grad_(), None
    logp, eubo_ = _own_scores(run, run.policy, plan, mine)  # (share,) with a graph, on the device
    gather = run.shards.gather_keeping_graph
    return gather(logp, n).cpu(), None if eubo_ is None else gather(eubo_, n).cpu()


def _backward(run: Run, loss: torch.Tensor, logp: torch.Tensor, plan, mine: RolloutBatch, start: int,
              end: int) -> None:
    """∇loss into the parameters' .grad, × N: DDP averages the processes' gradients, and
    their sum is the gradient of the loss."""
    acc, est, world = run.accelerator, run.cfg.estimator, run.shards.world
    if est.max_views_per_forward is None:
        acc.backward(loss * world)
        return
    loss.backward()  # ℓ_θ is a leaf: ∂loss/∂ℓ, then back through the views a batch at a time
    backward_views(run.policy, plan, mine.prompt_ids, mine.completion_ids, mine.completion_mask,
                   logp.grad[start:end] * world, prompt_mask=mine.prompt_mask, reduction=est.reduction,
                   max_views_per_forward=est.max_views_per_forward, backward=acc.backward,
                   no_sync=lambda: acc.no_sync(run.policy.model))


def _over_iterations(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the μ inner iterations: maxima of *_max metrics, means of the others."""
    out = {k: (max if k.endswith("_max") else lambda v: sum(v) / len(v))([r[k] for r in rows]) for k in rows[0]}
    # NaN (a skipped inner iteration) wins: the step's largest norm is then not a number
    out["grad_norm_max"] = max((r["grad_norm"] for r in rows), key=lambda v: (math.isnan(v), v))
    return out



def _save_checkpoint(run: Run, done: int) -> Path:
    """The optimizer goes into accelerate's state, the rest (the same on every process) here."""
    state = {"scheduler": run.sched.state_dict(), "step": done, "counters": run.counters,
             "history": run.history, "collapse": run.monitor}
    return save_checkpoint(run.out, done, GatheredPolicy(run.policy, run.accelerator), state,
                           accelerator=run.accelerator)
