"""RL post-training of a diffusion LM (the `train` verb): GRPO, StableDRL, wd1, SPG, diffu-GRPO, GDPO.

`train(cfg)` sets up, then runs one loop whose body is a step, read top to bottom in `train`:
prompts → G rollouts each from θ_old → rewards and group advantages (groups whose rewards all
tie: kept, skipped or replaced, `zero_variance_groups`) → a mask plan, ℓ_old and ℓ_ref, no
grad → μ inner iterations of ℓ_θ → objective → backward → clip → optimizer step (a non-finite
loss or gradient: skipped, counted, the weights untouched) → log, evaluate, save. With
`accumulation_rounds` R, scoring and backward run a round of whole groups at a time.

Reading the step takes five hops: `_rollouts` (here), `objectives.group_advantages`, the
scoring seam `scoring.StepScoring` (ℓ_old and ℓ_ref, a round's batch, its backward; several
processes and view budgets live there), the objective (`objectives.OBJECTIVES[name]`, a
function of a `ScoredBatch`), and `_clip_and_step` (here). The rest is metrics bookkeeping.
Every random draw is seeded by (seed, step, purpose) (`stabledrl.seeds`), so N processes
compute the update of one and a resumed run continues exactly. Deviations from the named
algorithms and the multi-process details: docs/methods.md, "The training step".

Shapes: P prompts per step, G group size, B' rows of the kept groups, L completion slots.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from stabledrl.checkpoint import save_checkpoint
from stabledrl.instruments import step_measuring_update
from stabledrl.objectives import group_advantages, objective_for
from stabledrl.rollouts import RolloutBatch, concat_groups, drop_flat_groups, roll_groups
from stabledrl.scoring import FIRST_ITERATION_SLOT, Share, StepScoring
from stabledrl.seeds import step_seed
from stabledrl.settings import EstimatorConfig, ObjectiveConfig, TrainConfig  # noqa: F401 (re-exported)
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
            groups, rollout_metrics = _rollouts(run, step)
        row = {"step": step + 1, **rollout_metrics, "groups_used": len(groups.problems), "lr": run.sched.get_last_lr()[0]}

        if groups.problems:
            # Advantages; a mask plan, and on it ℓ_old and ℓ_ref, no grad (the drift metrics beside them)
            advantages = group_advantages(groups.rewards.flatten(), cfg.group_size, cfg.objective.advantage_scale)
            scoring = StepScoring(run, groups, step)
            with run.timer.phase("likelihood_old"), torch.no_grad():
                old, drift = scoring.old()
            row.update(drift)

            iterations = []
            for it in range(cfg.mu):
                with run.timer.phase("update"):
                    # Score ℓ_θ on ℓ_old's masks (shared) or fresh ones (independent), a round at a time
                    plan = old.plan if cfg.masks == "shared" else scoring.plan(FIRST_ITERATION_SLOT + it)
                    run.opt.zero_grad(set_to_none=True)
                    rounds, finite = [], True
                    for share in scoring.rounds:  # one round's graph at a time; their gradients add up
                        batch = scoring.batch(old, plan, share, advantages, first_iteration=it == 0)
                        out = objective(batch)
                        rounds.append((out, share))
                        if not (finite := bool(torch.isfinite(out.loss))):
                            break
                        with run.timer.phase("backward", until_gpu_done=True):
                            row.update(scoring.backward(out.loss, batch, plan, share, objective, first_iteration=it == 0))
                    # Clip, then step (a non-finite loss or gradient: skipped, the weights untouched)
                    iterations.append({**_over_rounds(rounds), **_clip_and_step(run, finite)})
            row.update(_over_iterations(iterations))
        _advance_schedule(run)

        # Log, evaluate, save
        row.update({**run.counters, **run.timer.row()})
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            row.update(run.evaluate_row(done))
        row["collapse"] = run.check_collapse(row)
        if done % cfg.log_every == 0 or "eval_accuracy" in row:
            run.log(row)
        if done % cfg.save_every == 0 or done == cfg.steps:
            _save_checkpoint(run, done)
        bar.set_postfix(_progress(run, row))
    bar.close()
    return run.finish()


run_train = train
"""The name the command line and the benchmarks call."""


def _rollouts(run: Run, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """The step's groups to train on, and the on-policy statistics of its first round of P·G
    rollouts. The first round's groups: all (keep) or those whose rewards differ (skip); with
    resample, those of up to `max_resample_rounds` rounds of fresh problems refilling the step.
    Counts the groups whose rewards all tie, and the groups rolled out in extra rounds."""
    cfg = run.cfg
    first = _roll(run, run.task.generate(cfg.prompts_per_step, split="train", seed=step_seed(cfg.seed, step, "prompts")),
                  step, round_=0)
    run.counters["zero_variance_groups"] += int(first.flat().sum())
    parts = [first if cfg.zero_variance_groups == "keep" else drop_flat_groups(first)]
    for r in range(cfg.max_resample_rounds if cfg.zero_variance_groups == "resample" else 0):
        missing = cfg.prompts_per_step - sum(len(p.problems) for p in parts)
        if missing <= 0:
            break
        extra = _roll(run, run.task.generate(missing, split="train", seed=step_seed(cfg.seed, step, "resample", r)),
                      step, round_=r + 1)
        run.counters["zero_variance_groups"] += int(extra.flat().sum())
        run.counters["resampled_groups"] += missing
        parts.append(drop_flat_groups(extra))
    rewards = first.rewards.flatten()  # (P·G,)
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
               "accuracy_train": float((rewards == 1.0).float().mean()),
               "completion_length": float(first.completion_mask.sum(1).float().mean()),
               "entropy": float(first.entropy.mean()), "zero_variance_fraction": float(first.flat().float().mean())}
    return concat_groups(parts, run.policy.pad_token_id), metrics


def _roll(run: Run, problems: list, step: int, *, round_: int) -> RolloutBatch:
    cfg = run.cfg
    return roll_groups(run.policy, run.task, problems, group_size=cfg.group_size, sampling=cfg.rollout,
                       gen_length=cfg.rollout.gen_length or run.task.completion_length,
                       tag=f"{cfg.seed}/{step}/{round_}", shards=run.shards)


def _clip_and_step(run: Run, finite: bool) -> dict[str, float]:
    """Clip the gradient's norm (`grad_norm`: the norm before clipping), then the optimizer step;
    or, when the loss or the norm is not finite, the gradient dropped and the step counted as
    skipped. With update_norm, the norm of the change in the weights (`update_norm`)."""
    metrics = {"grad_norm": math.nan}
    if finite:
        norm = run.accelerator.clip_grad_norm_(run.params, run.cfg.grad_clip)  # DeepSpeed clips inside: may be None
        metrics["grad_norm"] = math.nan if norm is None else float(norm)
        finite = norm is None or math.isfinite(metrics["grad_norm"])
    if not finite:
        run.opt.zero_grad(set_to_none=True)
        run.counters["skipped_steps"] += 1
        return {**metrics, "update_norm": 0.0} if run.cfg.update_norm else metrics
    if run.cfg.update_norm:
        return {**metrics, "update_norm": step_measuring_update(run.opt, run.params)}
    run.opt.step()
    return metrics


def _advance_schedule(run: Run) -> None:
    """One step of the learning-rate schedule, which counts steps, skipped ones too. After a
    skipped first step no optimizer.step() came before it, and torch warns that the order is
    wrong; here it is the design, so that one warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        run.sched.step()


# --- Metrics: over the rounds of an inner iteration, over the iterations, on the progress bar --


def _over_rounds(rounds: list[tuple[Any, Share]]) -> dict[str, float]:
    """An inner iteration's loss and metrics from its rounds' (objective output, share): the loss
    weighted by each round's weight (their sum is the step's), the metrics by its part (a
    weighted mean), maxima of *_max."""
    out: dict[str, float] = {}
    for result, share in rounds:
        for k, v in {**result.metrics, "loss": float(result.loss.detach())}.items():
            weight = share.weight if k == "loss" else share.part
            if k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out[k] + v * weight if k in out else v * weight
    return out


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
