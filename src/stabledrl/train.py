"""RL post-training of a diffusion LM (the `train` verb): GRPO, StableDRL, wd1, SPG, diffu-GRPO, GDPO.

One step, top to bottom:

1. prompts: `prompts_per_step` training problems, each repeated `group_size` (G) times;
2. rollouts: masked-diffusion sampling from the current policy (θ_old), seeded per step;
3. rewards → group advantages; groups whose rewards are all equal carry no signal:
   kept, dropped, or dropped and replaced by groups of fresh prompts (`zero_variance_groups`:
   keep | skip | resample, DAPO's dynamic sampling); counted in every mode;
4. ℓ_old = the likelihood estimate of each rollout under θ_old, no grad, from a mask plan
   drawn from a per-step generator (and ℓ_ref under the initial policy when β > 0 or
   for the drift diagnostic, on the same plan);
5. μ inner iterations: ℓ_θ on the same plan (``masks: shared``, common random numbers)
   or a fresh one (``independent``) → objective → backward → clip → AdamW step.
   Non-finite loss or gradient: the step is skipped, counted and logged, and the
   weights are not touched.

The code reads in that order. `run_train` is `set_up`, then per step `train_step`, then
`finish`; a step is four phases, each a function returning a dataclass:

    set_up          -> Run         accelerator, policy, reference, optimizer, schedule, counters
    collect_groups  -> Collected   steps 1-3: rollouts, rewards, the zero-variance policy
    score_groups    -> Scored      step 4: plan, ℓ_old, ℓ_ref, the weights' ℓ_old, drift
    update_policy   -> Updated     step 5: ℓ_θ → objective → backward → clip → step or skip
    end_of_step     -> StepEnd     schedule, counters, evaluation, log, checkpoint

The objective is built by name from `OBJECTIVES` (name -> builder); the rollouts of a
step, whole groups or a process's share of their rows, are one container, `Rollouts`.

Several processes (``accelerate launch --num_processes N -m stabledrl train ...``): each
process rolls out and rewards its share of the step's P·G rows (a group may span
processes), the ids, rewards and entropies are gathered so that every process sees every
group; the kept rows are split again for the likelihoods. The objective is evaluated on
the gathered ℓ of all rows, with only this process's rows carrying a graph, so group
advantages and StableDRL's self-normalisation are computed on whole groups exactly as in
one process; gradients are averaged by DDP (FSDP, DeepSpeed), so the loss is scaled by
N to make the sum. Every random draw is per row or drawn for the whole batch, so N
processes compute the update of one process. Metrics are written by the main process
only; checkpoints and the final model are saved by every process together (under FSDP or
DeepSpeed ZeRO-3 each holds a shard of the weights and of the optimizer state).

Deviations from the named algorithms, deliberate:
- The model stays in eval mode for the update too: no dropout, so ρ = 1 at θ = θ_old
  and several processes compute the same function.
- ``diffu-grpo`` (d1) recomputes the prompt mask per inner iteration; here the plan
  (prompt mask included) follows the ``masks`` switch like every other estimator.
- Every random draw comes from a generator seeded by (seed, step, purpose), so a run
  resumed from a checkpoint continues exactly as the uninterrupted run.
- Where each preset's estimator and objective part from the authors' code (StableDRL's
  on SPG, d1's masking, GDPO's 1/t): docs/methods.md, "Fidelity to the authors' runs".

Shapes: P prompts per step, G group size, B = P·G rollouts (B' those of the kept groups),
L completion slots, Lp prompt slots, N processes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from stabledrl.checkpoint import (
    ACCELERATE_STATE,
    latest_checkpoint,
    open_run_dir,
    load_trainer_state,
    rewind_metrics,
    save_checkpoint,
    save_final,
    write_atomic,
)
from stabledrl.config import ConfigError, check, to_dict
from stabledrl.data import decode_policy_completions, encode_policy_prompts
from stabledrl.diagnostics import CollapseMonitor, flat_grad_cosine
from stabledrl.engines import RolloutRequest, check_engine, roll_out
from stabledrl.evaluate import EVAL_MICRO_BATCH, evaluate
from stabledrl.likelihood import backward_views, eubo, plan_views, score_views
from stabledrl.metrics import metrics_line
from stabledrl.models.attention import prompt_attention_of
from stabledrl.models.lora import add_lora, base_policy
from stabledrl.models.policy import load_policy
from stabledrl.objectives import (LossOutput, group_advantages, grpo_loss, spg_likelihood, spg_loss, stabledrl_loss,
                                  wd1_loss)
from stabledrl.sampling import SamplingConfig, micro_batch_calls, row_generators
from stabledrl.settings import MAX_MU, EstimatorConfig, ObjectiveConfig, TrainConfig  # no torch: for the CLI
from stabledrl.tasks import get_task

__all__ = [
    "OBJECTIVES", "Collected", "EstimatorConfig", "ObjectiveConfig", "Rollouts", "Run", "Scored", "StepEnd",
    "StepResult", "TrainConfig", "Updated", "build_objective", "collect_groups", "end_of_step", "finish",
    "run_train", "score_groups", "set_up", "train_step", "update_policy",
]


_SEED_SLOTS = MAX_MU + 3  # per step: 0 unused (rollouts draw per row: `row_generators`), 1 ℓ_old masks, 2 weight masks, 3.. inner-iteration masks


def _seeded(seed: int, step: int, purpose: int) -> torch.Generator:
    """A generator for one purpose of one step: draws never depend on earlier steps."""
    if not 0 <= purpose < _SEED_SLOTS:
        raise ValueError(f"seed slot {purpose} out of range")
    return torch.Generator().manual_seed(seed * 1_000_003 + step * _SEED_SLOTS + purpose)


class _ForwardClock:
    """Sums the wall time spent inside the models' forward passes (via hooks). On a GPU a
    forward returns once its kernels are queued, so there each forward is timed by CUDA
    events on the current stream instead, and `seconds` synchronises once to read them:
    no synchronisation inside a step. `event`: the event class (default torch.cuda.Event;
    a test passes a fake)."""

    def __init__(self, *models: torch.nn.Module, event: Any = None) -> None:
        self._seconds = 0.0
        self._t0 = 0.0
        models = list({id(m): m for m in models}.values())  # a LoRA reference shares the policy's model
        self._cuda = any(p.is_cuda for m in models for p in m.parameters())
        self._event = torch.cuda.Event if event is None else event
        self._events: list[tuple[Any, Any]] = []
        for m in models:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, *args) -> None:
        if self._cuda:
            self._t0 = self._event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _stop(self, *args) -> None:
        if self._cuda:
            end = self._event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            self._seconds += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000  # ms -> s
            self._events.clear()
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._events.clear()
        self._seconds = value

    @property
    def cuda(self) -> bool:
        return self._cuda


@contextmanager
def _timed(seconds: dict[str, float], name: str, *, cuda: bool = False):
    """Add the wall time of the block to seconds[name]; `cuda`: until the GPU has finished
    the work the block queued (one synchronisation at its end)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0


class _Procs:
    """This process's place among the training processes (one process: rank 0 of 1).

    A batch of n rows is split in contiguous shares, as even as possible; `gather`
    rebuilds the whole batch on every process from the shares."""

    def __init__(self, accelerator) -> None:
        from accelerate.utils import DistributedType

        self.accelerator = accelerator
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        # Sharded parameters make every forward a collective: sample in lockstep.
        self.synced = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * n // self.world, (r + 1) * n // self.world

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(share, ...) on each process -> (n, ...) on every process; no gradient."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        sizes = [hi - lo for lo, hi in (self.bounds(n, r) for r in range(self.world))]
        if x.size(0) != sizes[self.rank]:
            raise RuntimeError(f"process {self.rank} holds {x.size(0)} rows, its share of {n} is {sizes[self.rank]}")
        kind = x.dtype
        y = x.detach().to(torch.uint8) if kind == torch.bool else x.detach()
        padded = y.new_zeros((max(sizes), *y.shape[1:]))
        padded[: y.size(0)] = y
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:k] for p, k in zip(parts, sizes)]).to(kind)


@dataclasses.dataclass(frozen=True, eq=False)
class Rollouts:
    """A step's rollouts: whole groups (G consecutive rows per problem, with their problems,
    rewards and entropies), or a share of their rows (`rows`), which need not hold whole
    groups and carries the five tensors the likelihoods read only."""

    prompt_ids: torch.Tensor  # (B, Lp) left-padded
    prompt_mask: torch.Tensor  # (B, Lp)
    completion_ids: torch.Tensor  # (B, L)
    completion_mask: torch.Tensor  # (B, L) scored slots
    unmask_step: torch.Tensor  # (B, L) the sampler step that committed each slot
    problems: list | None = None  # (B/G,) one per group
    rewards: torch.Tensor | None = None  # (B/G, G)
    entropy: torch.Tensor | None = None  # (B,)

    def _scored(self) -> tuple[torch.Tensor, ...]:
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask, self.unmask_step

    def rows(self, lo: int, hi: int, device: Any) -> Rollouts:
        """Rows lo:hi of the five scored tensors, moved to `device`."""
        return Rollouts(*(x[lo:hi].to(device) for x in self._scored()))

    def flat(self) -> torch.Tensor:
        """(B/G,) True where every reward of the group is equal."""
        return (self.rewards == self.rewards[:, :1]).all(1)

    def select(self, groups: torch.Tensor) -> Rollouts:
        """The groups of the (n',) indices `groups`, whole."""
        G = self.rewards.size(1)
        rows = (groups[:, None] * G + torch.arange(G)).flatten()  # (n'·G,)
        return Rollouts(*(x[rows] for x in self._scored()), problems=[self.problems[i] for i in groups.tolist()],
                        rewards=self.rewards[groups], entropy=self.entropy[rows])


def _left_pad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.cat([x.new_full((x.size(0), width - x.size(1)), value), x], dim=1)


def _concat(parts: list[Rollouts], pad_token_id: int) -> Rollouts:
    """Groups of several rollout rounds in one batch (prompts re-padded to the widest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.prompt_ids.size(1) for p in parts)
    return Rollouts(torch.cat([_left_pad(p.prompt_ids, width, pad_token_id) for p in parts]),
                    torch.cat([_left_pad(p.prompt_mask, width, 0) for p in parts]),
                    *(torch.cat([getattr(p, f) for p in parts]) for f in ("completion_ids", "completion_mask",
                                                                          "unmask_step")),
                    problems=[q for p in parts for q in p.problems],
                    rewards=torch.cat([p.rewards for p in parts]), entropy=torch.cat([p.entropy for p in parts]))


def _roll_groups(cfg: TrainConfig, policy, task, problems: list, tag: str, gen_length: int, procs: _Procs) -> Rollouts:
    """G rollouts per problem from the current policy, and their rewards. Each process
    samples and rewards its share of the n·G rows; every process returns all of them."""
    G = cfg.group_size
    group_problems = [p for p in problems for _ in range(G)]
    n = len(group_problems)
    p_ids, p_mask = encode_policy_prompts(policy, [p.prompt for p in group_problems])  # (n·G, Lp) all rows
    lo, hi = procs.bounds(n)
    dev = policy.device
    mb = cfg.rollout.micro_batch
    calls = micro_batch_calls(-(-n // procs.world), mb)  # those of the largest share (synced: collectives)
    roll = roll_out(RolloutRequest(policy, p_ids[lo:hi].to(dev), p_mask[lo:hi].to(dev), gen_length,
                                   row_generators(tag, lo, hi), cfg.rollout, micro_batch=mb, synced=procs.synced,
                                   num_calls=calls))
    texts = decode_policy_completions(policy, roll.completion_ids.cpu())
    rewards = torch.tensor(task.reward(texts, group_problems[lo:hi]), dtype=torch.float32)  # (share,)
    full = [procs.gather(x.to(dev), n).cpu() for x in (roll.completion_ids, roll.completion_mask, roll.unmask_step,
                                                         rewards, roll.entropy)]
    return Rollouts(p_ids, p_mask, full[0], full[1], full[2], problems=list(problems), rewards=full[3].view(-1, G),
                    entropy=full[4])


def _resample_seed(seed: int, step: int, round_: int) -> int:
    """Prompts of resampling round r: a stream apart from the training problems' seeds."""
    return 2**48 + (seed * 1_000_003 + step) * 64 + round_


def _plan(cfg: TrainConfig, batch: Rollouts, step: int, slot: int, policy):
    """The mask plan of one seed slot of one step."""
    method = cfg.estimator.method
    block = policy.attention_kind == "block"
    block_size = policy.block_size if method == "blockwise" or (method == "path" and block) else None
    return plan_views(method, batch.completion_mask, num_samples=cfg.estimator.num_samples,
                      generator=_seeded(cfg.seed, step, slot), prompt_ids=batch.prompt_ids,
                      prompt_mask=batch.prompt_mask, bos_token_id=policy.tokenizer.bos_token_id,
                      block_size=block_size, prompt_attention=prompt_attention_of(policy),
                      unmask_step=batch.unmask_step if method == "path" else None, **cfg.estimator.options)


def _score(cfg: TrainConfig, policy, plan, batch: Rollouts) -> torch.Tensor:
    """ℓ under `policy`: (B',) sequence estimates, (B', L) per-token terms for token ratios, or
    (B', 2) the estimate (the ELBO) and SPG's EUBO on the same views for the sandwich (`_bounds`)."""
    o = cfg.objective
    est = score_views(policy, plan, batch.prompt_ids, batch.completion_ids, batch.completion_mask,
                      prompt_mask=batch.prompt_mask, reduction=cfg.estimator.reduction,
                      max_views_per_forward=cfg.estimator.max_views_per_forward, keep_views=o.sandwich)
    if o.sandwich:
        return torch.stack([est.sequence, eubo(plan, est.views, batch.completion_mask, beta=o.spg_beta)], dim=1)
    return est.token if o.ratio_level == "token" else est.sequence


def _bounds(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B', 2) scores of the sandwich (`_score`) -> the (B',) ELBO and EUBO."""
    return logp[:, 0], logp[:, 1]


Objective = Callable[..., LossOutput]
"""``objective(logp, old_logp, advantages, *, completion_mask, ref_logp, weight_logp=None,
weight_old_logp=None) -> LossOutput``: ℓ_θ, ℓ_old, (B',) advantages; ℓ is (B',) or (B', L)."""


def _grpo_objective(cfg: TrainConfig) -> Objective:
    """GRPO (conditional clipping, 1/G), with a k3 KL term to the reference when β > 0."""
    o = cfg.objective

    def objective(logp, old_logp, advantages, *, completion_mask, ref_logp=None) -> LossOutput:
        return grpo_loss(logp, old_logp, advantages, group_size=cfg.group_size, clip_eps=o.clip_eps,
                         ratio_level=o.ratio_level, completion_mask=completion_mask,
                         ref_logp=ref_logp if o.beta else None, beta=o.beta, token_aggregation=o.token_aggregation)

    return objective


def _stabledrl_objective(cfg: TrainConfig) -> Objective:
    """StableDRL (unconditional clipping, group self-normalisation); no KL term (β = 0 is
    checked in ObjectiveConfig), so `ref_logp` is not read."""
    o = cfg.objective

    def objective(logp, old_logp, advantages, *, completion_mask, ref_logp=None, weight_logp=None,
                  weight_old_logp=None) -> LossOutput:
        if o.sandwich:  # the authors' StableDRL: weights from the ELBO, the sandwich in the gradient
            (elbo, eubo_), (old_logp, _) = _bounds(logp), _bounds(old_logp)
            weight_logp, weight_old_logp = elbo, old_logp
            logp = spg_likelihood(elbo, eubo_, advantages, omega=o.spg_omega)
        return stabledrl_loss(logp, old_logp, advantages, group_size=cfg.group_size, clip=o.clip,
                              clip_max=o.clip_max, clip_eps=o.clip_eps, ratio_level=o.ratio_level,
                              completion_mask=completion_mask, weight_logp=weight_logp,
                              weight_old_logp=weight_old_logp)

    return objective


def _wd1_objective(cfg: TrainConfig) -> Objective:
    """wd1 (ratio-free weighted likelihood); `old_logp` feeds only its ratio diagnostics."""
    o = cfg.objective

    def objective(logp, old_logp, advantages, *, completion_mask, ref_logp=None) -> LossOutput:
        return wd1_loss(logp, old_logp, advantages, group_size=cfg.group_size, psi=o.psi, clip_eps=o.clip_eps,
                        ratio_level=o.ratio_level, completion_mask=completion_mask)

    return objective


def _spg_objective(cfg: TrainConfig) -> Objective:
    """SPG (ratio-free, its sandwich in the gradient); `old_logp` feeds only its ratio diagnostics."""
    o = cfg.objective

    def objective(logp, old_logp, advantages, *, completion_mask, ref_logp=None) -> LossOutput:
        (elbo, eubo_), (old_elbo, _) = _bounds(logp), _bounds(old_logp)
        return spg_loss(elbo, eubo_, old_elbo, advantages, group_size=cfg.group_size,
                        completion_mask=completion_mask, omega=o.spg_omega, clip_eps=o.clip_eps)

    return objective


OBJECTIVES: dict[str, Callable[[TrainConfig], Objective]] = {
    "grpo": _grpo_objective,
    "stabledrl": _stabledrl_objective,
    "wd1": _wd1_objective,
    "spg": _spg_objective,
}
"""objective.name -> builder: the config in, the objective of tensors out."""


def build_objective(cfg: TrainConfig) -> Objective:
    return OBJECTIVES[cfg.objective.name](cfg)


def _first_half_loss(cfg: TrainConfig, logp, old, advantages, batch: Rollouts, ref, weight_kw: dict,
                     num_groups: int, *, objective: Objective) -> torch.Tensor:
    """The part of the step's loss that comes from its first ⌊n/2⌋ groups: every objective
    is a mean over groups, so loss = Σ_g c_g / n and this is Σ_{g < n/2} c_g / n; with
    batch_token_mean the loss is a mean over scored tokens, and the half's share is its
    fraction of them. `objective`: the step's."""
    half = num_groups // 2
    rows = half * cfg.group_size
    kw = {k: v[:rows] for k, v in weight_kw.items()}
    res = objective(logp[:rows], old[:rows], advantages[:rows], completion_mask=batch.completion_mask[:rows],
                    ref_logp=None if ref is None else ref[:rows], **kw)
    if cfg.objective.token_aggregation == "batch_token_mean":
        return res.loss * (batch.completion_mask[:rows].sum() / batch.completion_mask.sum()).item()
    return res.loss * (half / num_groups)


def _backward_in_halves(loss: torch.Tensor, part: torch.Tensor, params: list, backward) -> float:
    """Back-propagate `loss` as `part` + (loss − part), leaving ∇loss in the parameters'
    .grad; returns the cosine between the two parts' gradients (one extra backward)."""
    backward(part, retain_graph=True)
    g_a = [None if p.grad is None else p.grad.clone() for p in params]
    backward(loss - part)
    g_b = [None if p.grad is None else (p.grad if a is None else p.grad - a) for p, a in zip(params, g_a)]
    return flat_grad_cosine(g_a, g_b)


def _check_estimator_fits_model(cfg: TrainConfig, policy) -> None:
    """At start-up, not mid-run: block models need the blockwise (or path) estimator and
    only they take blockwise."""
    kind = policy.attention_kind
    if cfg.estimator.method != "path" and (kind == "block") != (cfg.estimator.method == "blockwise"):
        raise ConfigError(f"estimator.method {cfg.estimator.method!r} does not fit the {kind}-attention model "
                          f"{cfg.model.path}: use 'blockwise' (or 'path') for block models and mc, sdmc, mean_field, "
                          "exact (or path) otherwise")


def _check_processes(cfg: TrainConfig, world: int) -> None:
    """Every process needs at least one row of every batch (DDP needs a backward on each)."""
    if world > 1:
        check(cfg.group_size >= world, f"group_size ({cfg.group_size}) must be >= the number of processes "
              f"({world}): a step may keep a single group, and every process needs a row of it")
        check(cfg.eval_n >= world, f"eval_n ({cfg.eval_n}) must be >= the number of processes ({world})")
        check(not cfg.grad_agreement, "grad_agreement runs in one process only")


def _evaluate(policy, task, problems: list, sampling: SamplingConfig, procs: _Procs) -> dict[str, float]:
    """Held-out accuracy and mean reward; each process decodes its share of the problems."""
    n = len(problems)
    lo, hi = procs.bounds(n)
    calls = micro_batch_calls(-(-n // procs.world), sampling.micro_batch or EVAL_MICRO_BATCH)
    res = evaluate(policy, task, problems[lo:hi], sampling, progress=False, synced=procs.synced, first_index=lo,
                   num_calls=calls)
    scores = torch.tensor([[float(s["correct"]), s["reward"]] for s in res.samples], device=policy.device)  # (share, 2)
    full = procs.gather(scores, len(problems)).double().mean(0)
    return {"accuracy": float(full[0]), "mean_reward": float(full[1])}


def _needs_reference(cfg: TrainConfig) -> bool:
    return cfg.drift_kl or cfg.objective.beta > 0


def _optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


_UPDATE_CHUNK = 2**26
"""Parameter elements copied at a time to measure the update (256 MB in float32)."""


def _step_measuring_update(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                           chunk_size: int = _UPDATE_CHUNK) -> float:
    """opt.step(); returns the norm of the change it made to the parameters, without a copy
    of all of them: the optimizer steps one chunk of about `chunk_size` elements at a
    time (torch's optimizers skip a parameter whose .grad is None, and their updates are
    per parameter, so the weights and states are those of one step), and only that chunk
    is copied to take the difference."""
    grads = [p.grad for p in params]
    chunks: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if grads[i] is None:
            continue
        if chunks[-1] and size + p.numel() > chunk_size:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += p.numel()
    total = 0.0
    try:
        for chunk in chunks:
            for p in params:
                p.grad = None
            for i in chunk:
                params[i].grad = grads[i]
            before = [params[i].detach().clone() for i in chunk]
            opt.step()
            total += sum(float((params[i].detach() - b).float().square().sum()) for i, b in zip(chunk, before))
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return math.sqrt(total)


def _broadcast_from_main(model: torch.nn.Module) -> None:
    """Give every process the main process's weights of an unprepared model. Under FSDP with
    `fsdp_cpu_ram_efficient_loading` (configs/accelerate/fsdp.yaml) transformers loads the
    weights on the first process only and leaves the others' uninitialised (`torch.empty`),
    for FSDP to broadcast when it wraps the model: the reference copy is never wrapped."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in model.state_dict().values():  # parameters and persistent buffers
            dist.broadcast(t, src=0)


class _FullWeights:
    """The policy as it is saved: its bare model (DDP/FSDP wrappers removed) with the full
    weights. Under FSDP or DeepSpeed ZeRO-3 each process holds a shard of them and
    `get_state_dict` gathers them (onto the main process): a collective, so every process
    makes this object, and the main process saves it."""

    def __init__(self, policy, accelerator) -> None:
        self.state_dict = accelerator.get_state_dict(policy.model)
        self.policy = copy.copy(policy)
        self.policy.model = accelerator.unwrap_model(policy.model)

    def save(self, path: str | Path) -> None:
        self.policy.save(path, state_dict=self.state_dict)


def _save_no_weights(models: list, weights: list, output_dir: str) -> None:
    """accelerate's `save_state` hook: with one process or DDP it would save the model's
    weights, which the checkpoint's policy holds already: drop them. (Under FSDP and
    DeepSpeed accelerate saves the sharded model itself, and `weights` is empty.)"""
    weights.clear()


def _load_no_weights(models: list, input_dir: str) -> None:
    """accelerate's `load_state` hook: the weights come with the checkpoint's policy (the
    list is accelerate's own copy of its models to load, not the prepared models)."""
    models.clear()


# --- The recipe: set_up, then per step collect → score → update → end of step, then finish. ---


@dataclasses.dataclass
class Run:
    """What `set_up` returns: the run's parts, and its state from step to step."""

    cfg: TrainConfig
    accelerator: Any  # accelerate.Accelerator
    procs: _Procs
    task: Any
    device: Any  # where this process scores its rows
    policy: Any  # its model prepared by accelerate (DDP / FSDP / DeepSpeed with several processes)
    reference: Any  # KL reference and drift baseline (the initial policy), or None
    params: list[torch.nn.Parameter]  # the trainable parameters, as the optimizer holds them
    opt: torch.optim.Optimizer
    sched: Any  # the learning-rate schedule: warm-up, then cosine to min_lr_ratio
    objective: Objective  # OBJECTIVES[cfg.objective.name](cfg)
    out: Path  # the run directory
    start: int = 0  # the first step to run (a resumed run: its checkpoint's step)
    counters: dict[str, int] = dataclasses.field(default_factory=lambda: {
        "skipped_steps": 0, "zero_variance_groups": 0, "resampled_groups": 0})
    monitor: CollapseMonitor = dataclasses.field(default_factory=CollapseMonitor)
    history: dict[str, Any] = dataclasses.field(default_factory=dict)  # eval_initial, eval_final
    eval_problems: list = dataclasses.field(default_factory=list)
    metrics_file: Any = None  # metrics.jsonl, on the main process only
    tb: Any = None  # the TensorBoard writer, on the main process only
    clock: _ForwardClock | None = None  # time in the models' forward passes
    update_chunk: int = _UPDATE_CHUNK  # parameter elements stepped at a time (`_step_measuring_update`)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


@dataclasses.dataclass
class Collected:
    """What `collect_groups` returns."""

    groups: Rollouts  # the groups the step trains on: all (keep), or those whose rewards differ
    metrics: dict[str, Any]  # step, on-policy statistics of the first round's P·G rollouts, groups_used
    zero_variance_groups: int  # groups whose rewards all tie, in every round
    resampled_groups: int  # groups rolled out to replace them (resample)
    seconds: dict[str, float]  # rollout


@dataclasses.dataclass
class Scored:
    """What `score_groups` returns: the kept rows' likelihoods under θ_old (and the reference), no graph."""

    batch: Rollouts  # the B' rows of the kept groups
    mine: Rollouts  # this process's rows lo:hi of them, on its device
    lo: int
    hi: int
    step: int
    advantages: torch.Tensor  # (B',)
    plan_old: Any  # ℓ_old's mask plan (seed slot 1), this process's rows
    old: torch.Tensor  # (B',) ℓ_old, or (B', L) per-token terms for token ratios
    ref: torch.Tensor | None  # ℓ_ref on the same plan, when there is a reference
    plan_weight: Any  # separate_weight_masks: the weights' own plan (slot 2), else None ...
    weight_old: torch.Tensor | None  # ... and ℓ_old on it
    metrics: dict[str, Any]  # drift_kl
    seconds: dict[str, float]  # likelihood_old

    @property
    def n_rows(self) -> int:
        return self.batch.completion_ids.size(0)

    @property
    def num_groups(self) -> int:
        return len(self.batch.problems)


@dataclasses.dataclass
class Updated:
    """What `update_policy` returns."""

    metrics: dict[str, Any]  # grad_agreement; over the μ iterations the maxima of *_max, means of the rest
    skipped: int  # inner iterations whose loss or gradient was not finite: no optimizer step
    seconds: dict[str, float]  # update, backward


@dataclasses.dataclass
class StepEnd:
    """What `end_of_step` returns."""

    row: dict[str, Any]  # the step's metrics row
    checkpoint: Path | None  # saved at this step, or None


@dataclasses.dataclass
class StepResult:
    """What `train_step` returns: each phase's result (a step that kept no group: no score, no update)."""

    collected: Collected
    scored: Scored | None
    updated: Updated | None
    end: StepEnd


def run_train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train; returns the final held-out evaluation (and the initial one)."""
    run = set_up(cfg, resume=resume)
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps, desc=f"train {cfg.objective.name}",
               disable=not (progress and run.main))
    for step in bar:
        row = train_step(run, step).end.row
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", gnorm=f"{row.get('grad_norm', 0):.2g}",
                        ratio_max=f"{row.get('ratio_max', 1):.3g}", skipped=run.counters["skipped_steps"],
                        **({"COLLAPSE": ",".join(run.monitor.reasons)} if run.monitor.collapsed else {}))
    bar.close()
    return finish(run)


def train_step(run: Run, step: int) -> StepResult:
    """Step `step` (from 0): collect groups → score → update → end of step."""
    t0 = time.perf_counter()
    run.clock.seconds = 0.0
    run.policy.model.eval()
    collected = collect_groups(run, step)
    scored = score_groups(run, collected.groups, step) if collected.groups.problems else None
    updated = update_policy(run, scored) if scored is not None else None
    return StepResult(collected, scored, updated, end_of_step(run, step, collected, scored, updated, t0=t0))


def set_up(cfg: TrainConfig, *, resume: bool = False, task: Any = None) -> Run:
    """Set-up phase: the accelerator, the task (`task`: a task object to use instead of
    cfg.task's), the policy (from the checkpoint when resuming) and its reference, the
    optimizer and schedule (and their state, the counters and history of a resumed run),
    the initial evaluation, the logs. Settings that do not fit the model or the processes
    are refused before a run directory exists."""
    accelerator = _accelerator(cfg)
    procs = _Procs(accelerator)
    _check_processes(cfg, procs.world)
    task = get_task(cfg.task.name, **cfg.task.options) if task is None else task
    # One process may name its device; with several, each process uses the one accelerate gives it.
    device = accelerator.device if cfg.model.device == "auto" or accelerator.num_processes > 1 else cfg.model.device
    initial = load_policy(cfg.model, device=device)
    _check_estimator_fits_model(cfg, initial)  # before a run directory exists
    check_engine(cfg.rollout, initial)
    check_engine(cfg.eval_sampling, initial)
    out = Path(cfg.output_dir)
    ckpt = _open_run_dir(cfg, out, accelerator, resume)
    policy, reference = _policy_and_reference(cfg, initial, ckpt, device, accelerator, procs)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = _optimizer(cfg, params)
    policy.model, opt = accelerator.prepare(policy.model, opt)  # DDP / FSDP / DeepSpeed with N processes
    accelerator.register_save_state_pre_hook(_save_no_weights)
    accelerator.register_load_state_pre_hook(_load_no_weights)
    params = [p for p in policy.model.parameters() if p.requires_grad]  # FSDP replaces the parameters
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio)
    run = Run(cfg, accelerator, procs, task, device, policy, reference, params, opt, sched, build_objective(cfg), out)
    if ckpt is not None:
        _restore(run, ckpt)
    _begin(run)
    return run


def _accelerator(cfg: TrainConfig):
    """The run's accelerator (CPU or GPU, precision; DDP / FSDP / DeepSpeed from the launcher)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # No buffer broadcast in forward: the models' buffers are constants, and a collective in
    # every forward would tie the processes' (data-dependent) numbers of model calls together.
    on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
    # The precision is the run's (not the launcher's): a process may run several trainings
    # (tests, benchmarks), so accelerate's per-process state is set afresh; the process group stays.
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=cfg.mixed_precision,  # autocast of the prepared model
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    if accelerator.distributed_type.value == "DEEPSPEED":
        # accelerate's DeepSpeed backward also steps (and clips, with the DeepSpeed config's
        # gradient_clipping): one backward per optimizer step only.
        check(cfg.estimator.max_views_per_forward is None,
              "under DeepSpeed leave estimator.max_views_per_forward unset (its backward steps the optimizer)")
        check(not cfg.grad_agreement, "under DeepSpeed leave grad_agreement off (its backward steps the optimizer)")
    return accelerator


def _open_run_dir(cfg: TrainConfig, out: Path, accelerator, resume: bool) -> Path | None:
    """The main process opens the run directory; every process returns the checkpoint to resume from, or None."""
    main = accelerator.is_main_process
    if main:
        ckpt = open_run_dir(out, to_dict(cfg), resume=resume)
    accelerator.wait_for_everyone()
    if not main:
        ckpt = latest_checkpoint(out) if resume else None
    return ckpt


def _policy_and_reference(cfg: TrainConfig, initial, ckpt: Path | None, device, accelerator, procs: _Procs):
    """The policy to train and the reference (None when nothing reads it), from the initial policy."""
    if ckpt is not None:  # the checkpoint holds the weights (or the LoRA adapters) of the policy
        policy = load_policy(dataclasses.replace(cfg.model, path=str(ckpt)), device=device, trainable=True)
    elif cfg.lora is not None:
        policy = add_lora(initial, cfg.lora, seed=cfg.seed)
    else:  # the reference is a second copy, loaded only if something reads it
        policy, initial = initial, (load_policy(cfg.model, device=device) if _needs_reference(cfg) else None)
    if cfg.lora is not None:  # the initial policy is the base model: no second copy, scored only if read
        return policy, base_policy(policy) if _needs_reference(cfg) else None
    reference = initial  # KL reference and drift baseline, or None
    if reference is not None:
        reference.model.requires_grad_(False)
        if procs.world > 1 and accelerator.distributed_type.value == "FSDP":
            _broadcast_from_main(reference.model)
    return policy, reference


def _restore(run: Run, ckpt: Path) -> None:
    """A resumed run: the optimizer's, the schedule's and the trainer's state from `ckpt`;
    the metrics file cut back to what it held then."""
    state = load_trainer_state(ckpt)
    if (ckpt / ACCELERATE_STATE).is_dir():  # every process loads its part of the optimizer state
        run.accelerator.load_state(str(ckpt / ACCELERATE_STATE))
    else:  # saved by an earlier version: one process's whole optimizer state
        run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    run.start, run.history = state["step"], state["history"]
    run.counters.update(state["counters"])
    run.monitor = state.get("collapse", run.monitor)
    if run.main:
        rewind_metrics(run.out / "metrics.jsonl", ckpt)


def _begin(run: Run) -> None:
    """The held-out problems and the initial evaluation (once per run: a resumed run has it
    in its history), the logs, a fresh run's step-0 row, the forward clock."""
    from torch.utils.tensorboard import SummaryWriter

    cfg = run.cfg
    run.eval_problems = run.task.generate(cfg.eval_n, split=cfg.eval_split, seed=0)
    if "eval_initial" not in run.history:
        run.history["eval_initial"] = _evaluate(run.policy, run.task, run.eval_problems, cfg.eval_sampling, run.procs)
    run.metrics_file = open(run.out / "metrics.jsonl", "a") if run.main else None
    run.tb = SummaryWriter(str(run.out / "tensorboard")) if run.main else None
    if run.start == 0:
        initial = run.history["eval_initial"]
        run.monitor.update({"eval_accuracy": initial["accuracy"]})
        _log(run.metrics_file, run.tb, {"step": 0, "eval_accuracy": initial["accuracy"],
                                        "eval_reward": initial["mean_reward"], "collapse": False})
    run.clock = _ForwardClock(run.policy.model, *([run.reference.model] if run.reference is not None else []))


def collect_groups(run: Run, step: int) -> Collected:
    """Collect phase (steps 1-3): G rollouts of each of the step's P problems from θ_old and
    their rewards; groups whose rewards all tie are kept, skipped, or skipped and replaced by
    groups of fresh problems, for at most `max_resample_rounds` rounds (`zero_variance_groups`)."""
    cfg, task = run.cfg, run.task
    gen_length = cfg.rollout.gen_length or task.completion_length

    def roll(problems: list, round_: int) -> Rollouts:
        return _roll_groups(cfg, run.policy, task, problems, f"{cfg.seed}/{step}/{round_}", gen_length, run.procs)

    seconds: dict[str, float] = {}
    with _timed(seconds, "rollout"):
        first = roll(task.generate(cfg.prompts_per_step, split="train", seed=cfg.seed * 1_000_003 + step), 0)
        flat = first.flat()  # (P,)
        zero, resampled = int(flat.sum()), 0
        parts = [first if cfg.zero_variance_groups == "keep" else first.select((~flat).nonzero().flatten())]
        for r in range(cfg.max_resample_rounds if cfg.zero_variance_groups == "resample" else 0):
            missing = cfg.prompts_per_step - sum(len(p.problems) for p in parts)
            if missing <= 0:
                break
            extra = roll(task.generate(missing, split="train", seed=_resample_seed(cfg.seed, step, r)), r + 1)
            e_flat = extra.flat()
            zero, resampled = zero + int(e_flat.sum()), resampled + missing
            parts.append(extra.select((~e_flat).nonzero().flatten()))
        groups = _concat(parts, run.policy.pad_token_id)
    rewards = first.rewards.flatten()  # (P·G,) the step's on-policy statistics come from the first round
    metrics = {
        "step": step + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "accuracy_train": float((rewards == 1.0).float().mean()),
        "completion_length": float(first.completion_mask.sum(1).float().mean()),
        "entropy": float(first.entropy.mean()), "zero_variance_fraction": float(flat.float().mean()),
        "groups_used": len(groups.problems),
    }
    return Collected(groups, metrics, zero, resampled, seconds)


def _plan_rows(run: Run, batch: Rollouts, step: int, slot: int, lo: int, hi: int):
    """The plan of a seed slot, drawn for all B' rows (the same on every process), for rows lo:hi."""
    return _plan(run.cfg, batch, step, slot, run.policy).rows(lo, hi)


def _gather_scores(run: Run, policy, plan, mine: Rollouts, n_rows: int) -> torch.Tensor:
    """ℓ under `policy` of every row (each process scores its own), no graph: (B',) or (B', L)."""
    return run.procs.gather(_score(run.cfg, policy, plan, mine), n_rows).cpu()


def score_groups(run: Run, groups: Rollouts, step: int) -> Scored:
    """Score phase (step 4), no grad: the group advantages; ℓ_old on the plan of seed slot 1,
    and ℓ_ref under the reference on the same plan with the drift KL(π_old ‖ π_init); with
    separate_weight_masks, ℓ_old on the weights' own plan (slot 2)."""
    cfg = run.cfg
    n_rows = groups.completion_ids.size(0)  # B' = kept groups · G
    lo, hi = run.procs.bounds(n_rows)  # this process's rows of the likelihoods
    mine = groups.rows(lo, hi, run.device)
    advantages = group_advantages(groups.rewards.flatten(), cfg.group_size, cfg.objective.advantage_scale)  # (B',)
    ref = plan_weight = weight_old = None
    metrics: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    with _timed(seconds, "likelihood_old"), torch.no_grad():
        plan_old = _plan_rows(run, groups, step, 1, lo, hi)
        old = _gather_scores(run, run.policy, plan_old, mine, n_rows)
        if run.reference is not None:
            with run.accelerator.autocast():  # a reference copy is not prepared: same precision as ℓ_old
                ref = _gather_scores(run, run.reference, plan_old, mine, n_rows)
            # KL(π_old ‖ π_init) ≈ mean over π_old's own samples of ℓ_old − ℓ_init
            if cfg.objective.ratio_level == "token":
                gap = (old - ref).sum(-1)  # (B',)
            else:  # the sandwich's scores: the ELBO's gap
                gap = _bounds(old)[0] - _bounds(ref)[0] if cfg.objective.sandwich else old - ref
            metrics["drift_kl"] = float(gap.mean())
        if cfg.objective.separate_weight_masks:
            plan_weight = _plan_rows(run, groups, step, 2, lo, hi)
            weight_old = _gather_scores(run, run.policy, plan_weight, mine, n_rows)
    return Scored(groups, mine, lo, hi, step, advantages, plan_old, old, ref, plan_weight, weight_old, metrics, seconds)


class _Iteration(NamedTuple):
    row: dict[str, Any]  # the objective's metrics, loss, grad_norm, update_norm
    stepped: bool  # False: a non-finite loss or gradient, no optimizer step
    grad_agreement: float | None  # measured (grad_agreement, first iteration), or None


def update_policy(run: Run, s: Scored) -> Updated:
    """Update phase (step 5): μ inner iterations of ℓ_θ → objective → backward → clip →
    optimizer step, or skip (`_inner_iteration`). The update runs in eval mode too: no
    dropout, so ρ = 1 at θ = θ_old and every process computes the same function (dropout
    would draw from each one's RNG)."""
    metrics: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    inner_rows = []
    skipped = 0
    for it in range(run.cfg.mu):
        with _timed(seconds, "update"):
            res = _inner_iteration(run, s, it, seconds)
        if res.grad_agreement is not None:
            metrics["grad_agreement"] = res.grad_agreement
        inner_rows.append(res.row)
        skipped += not res.stepped
    # Over the μ inner iterations: maxima of *_max metrics, means of the others.
    for k in inner_rows[0]:
        vals = [r[k] for r in inner_rows]
        metrics[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    # NaN (a skipped inner iteration) wins: the step's largest norm is then not a number
    metrics["grad_norm_max"] = max((r["grad_norm"] for r in inner_rows), key=lambda v: (math.isnan(v), v))
    return Updated(metrics, skipped, seconds)


def _inner_iteration(run: Run, s: Scored, it: int, seconds: dict[str, float]) -> _Iteration:
    """One of the μ inner iterations: ℓ_θ on ℓ_old's plan (masks: shared) or on the plan of
    slot 3 + it (independent) → objective → backward → clip → optimizer step. A non-finite
    loss or gradient: the gradient is dropped and the weights are not touched."""
    cfg = run.cfg
    pl = s.plan_old if cfg.masks == "shared" else _plan_rows(run, s.batch, s.step, 3 + it, s.lo, s.hi)
    w_kw = {}
    if cfg.objective.separate_weight_masks:  # before the first step the weights' ℓ is their ℓ_old
        with torch.no_grad():
            w_kw = {"weight_logp": s.weight_old if it == 0 else
                    _gather_scores(run, run.policy, s.plan_weight, s.mine, s.n_rows), "weight_old_logp": s.weight_old}
    run.opt.zero_grad(set_to_none=True)
    # Before the first step, on ℓ_old's own plan, ℓ_θ's value is ℓ_old's: with a view budget it is not scored again.
    res, logp = _loss(run, s, pl, w_kw, old_is_current=it == 0 and cfg.masks == "shared")
    finite, grad_norm, agreement = bool(torch.isfinite(res.loss)), float("nan"), None
    if finite:
        with _timed(seconds, "backward", cuda=run.clock.cuda):
            agreement = _backward(run, s, pl, res.loss, logp, w_kw, first=it == 0)
        norm = run.accelerator.clip_grad_norm_(run.params, cfg.grad_clip)
        # DeepSpeed clips inside its engine and may not report a norm
        grad_norm = float("nan") if norm is None else float(norm)
        finite = norm is None or math.isfinite(grad_norm)
    row = {**res.metrics, "loss": float(res.loss.detach()), "grad_norm": grad_norm}
    if not finite:  # never let a non-finite update reach the weights
        run.opt.zero_grad(set_to_none=True)
        return _Iteration({**row, "update_norm": 0.0}, False, agreement)
    update = _step_measuring_update(run.opt, run.params, run.update_chunk)
    return _Iteration({**row, "update_norm": update}, True, agreement)


def _loss(run: Run, s: Scored, pl, w_kw: dict, *, old_is_current: bool) -> tuple[LossOutput, torch.Tensor]:
    """The objective on ℓ_θ of all B' rows, of which only this process's carry a graph, so
    that its gradient is this process's part of the sum. With a view budget
    (max_views_per_forward) none does: ℓ_θ is a leaf, ∂loss/∂ℓ is taken on it and pushed
    back view batch by view batch (`_backward`), so the update never holds more than one
    micro-batch's graph; `old_is_current` (θ = θ_old, ℓ_old's plan): the leaf is a copy of
    ℓ_old, not scored again. Returns the loss and ℓ_θ."""
    cfg, procs = run.cfg, run.procs
    if _view_budget(cfg):
        with torch.no_grad():
            logp = s.old.clone() if old_is_current else _gather_scores(run, run.policy, pl, s.mine, s.n_rows)
        logp.requires_grad_()
    else:
        mine_logp = _score(cfg, run.policy, pl, s.mine)  # (B'/N,) with a graph, on the device
        logp = mine_logp
        if procs.world > 1:  # the other processes' rows, as constants (gathered on the device)
            others = procs.gather(mine_logp, s.n_rows)
            logp = torch.cat([others[:s.lo], mine_logp, others[s.hi:]])
        logp = logp.cpu()
    res = run.objective(logp, s.old, s.advantages, completion_mask=s.batch.completion_mask, ref_logp=s.ref, **w_kw)
    return res, logp


def _view_budget(cfg: TrainConfig) -> bool:
    """Whether the update back-propagates view batch by view batch (estimator.max_views_per_forward)."""
    return cfg.estimator.max_views_per_forward is not None


def _backward(run: Run, s: Scored, pl, loss: torch.Tensor, logp: torch.Tensor, w_kw: dict, *,
              first: bool) -> float | None:
    """∇loss into the parameters' .grad; returns the gradient agreement when it is measured
    (grad_agreement, the first inner iteration, two groups or more, no view budget)."""
    cfg, acc, world = run.cfg, run.accelerator, run.procs.world
    if _view_budget(cfg):  # ℓ_θ is a leaf: ∂loss/∂ℓ, then pushed back view batch by view batch
        loss.backward()
        backward_views(run.policy, pl, s.mine.prompt_ids, s.mine.completion_ids, s.mine.completion_mask,
                       logp.grad[s.lo:s.hi] * world, prompt_mask=s.mine.prompt_mask,
                       reduction=cfg.estimator.reduction, max_views_per_forward=cfg.estimator.max_views_per_forward,
                       backward=acc.backward, no_sync=lambda: acc.no_sync(run.policy.model))
        return None
    if cfg.grad_agreement and first and s.num_groups >= 2:
        part = _first_half_loss(cfg, logp, s.old, s.advantages, s.batch, s.ref, w_kw, s.num_groups,
                                objective=run.objective)
        return _backward_in_halves(loss, part, run.params, acc.backward)
    acc.backward(loss * world)  # DDP averages the processes' gradients: × N makes their sum
    return None


def end_of_step(run: Run, step: int, collected: Collected, scored: Scored | None, updated: Updated | None, *,
                t0: float) -> StepEnd:
    """End-of-step phase: the step's metrics row (`t0`: when the step began), the learning-rate
    schedule stepped, the counters added up, an evaluation every `eval_every` steps, the
    collapse monitor, the log, a checkpoint every `save_every` steps and at the last."""
    cfg, done = run.cfg, step + 1
    row = {**collected.metrics, "lr": run.sched.get_last_lr()[0]}
    seconds = dict(collected.seconds)
    for phase in (scored, updated):
        if phase is not None:
            row.update(phase.metrics)
            seconds.update(phase.seconds)
    run.sched.step()
    run.counters["zero_variance_groups"] += collected.zero_variance_groups
    run.counters["resampled_groups"] += collected.resampled_groups
    run.counters["skipped_steps"] += updated.skipped if updated is not None else 0
    row.update(run.counters)
    row["seconds"] = time.perf_counter() - t0
    row.update({f"time_{k}": v for k, v in seconds.items()})
    row["time_model_forward"] = run.clock.seconds
    # The framework's share: time in neither the model's forward nor the backward.
    row["framework_share"] = 1 - (row["time_model_forward"] + seconds.get("backward", 0.0)) / row["seconds"]
    if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
        res = _evaluate(run.policy, run.task, run.eval_problems, cfg.eval_sampling, run.procs)
        row.update({"eval_accuracy": res["accuracy"], "eval_reward": res["mean_reward"]})
    _flag_collapse(run.monitor, row, run.main)
    if done % cfg.log_every == 0 or "eval_accuracy" in row:
        _log(run.metrics_file, run.tb, row)
    checkpoint = None
    if done % cfg.save_every == 0 or done == cfg.steps:
        # The optimizer goes into accelerate's state, the rest (the same on every process) here.
        state = {"scheduler": run.sched.state_dict(), "step": done, "counters": run.counters,
                 "history": run.history, "collapse": run.monitor}
        checkpoint = save_checkpoint(run.out, done, _FullWeights(run.policy, run.accelerator), state,
                                     accelerator=run.accelerator)
    return StepEnd(row, checkpoint)


def finish(run: Run) -> dict[str, Any]:
    """Last phase: the final held-out evaluation, logged; the final model and summary.json
    saved. Returns the summary."""
    summary = _final_evaluation(run)
    _save_final(run, summary)
    return summary


def _final_evaluation(run: Run) -> dict[str, Any]:
    """The final held-out evaluation, logged; returns the run's summary."""
    run.history["eval_final"] = _evaluate(run.policy, run.task, run.eval_problems, run.cfg.eval_sampling, run.procs)
    final_row = {"step": run.cfg.steps, "eval_accuracy": run.history["eval_final"]["accuracy"],
                 "eval_reward": run.history["eval_final"]["mean_reward"]}
    _flag_collapse(run.monitor, final_row, run.main)
    _log(run.metrics_file, run.tb, final_row)
    return {**run.history, **run.counters, "processes": run.procs.world, "collapse": list(run.monitor.reasons)}


def _save_final(run: Run, summary: dict[str, Any]) -> None:
    """Close the logs; save the final model and summary.json (every process: a collective)."""
    run.policy.model.eval()
    weights = _FullWeights(run.policy, run.accelerator)  # every process: a gather under FSDP / ZeRO-3
    if run.main:
        run.metrics_file.close()
        run.tb.close()
        save_final(run.out, weights)
        write_atomic(run.out / "summary.json", json.dumps(summary, indent=2))
    run.accelerator.wait_for_everyone()


def _flag_collapse(monitor: CollapseMonitor, row: dict[str, Any], main: bool) -> None:
    """Feed the row to the collapse monitor; write `collapse` into it; say so once per reason."""
    new = monitor.update(row)
    row["collapse"] = monitor.collapsed
    if new and main:
        tqdm.write(f"step {row['step']}: the run looks collapsed ({', '.join(new)}; "
                   "see stabledrl.diagnostics.CollapseMonitor)", file=sys.stderr)


def _log(f, tb, row: dict[str, Any]) -> None:
    if f is None:  # not the main process
        return
    f.write(metrics_line(row))
    f.flush()
    for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
            tb.add_scalar(k, v, row["step"])
