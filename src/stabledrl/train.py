"""RL post-training of a diffusion LM (the `train` verb): GRPO, StableDRL, diffu-GRPO, GDPO.

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

Shapes: P prompts per step, G group size, B = P·G rollouts, L completion slots.
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
from typing import Any, NamedTuple

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
from stabledrl.evaluate import EVAL_MICRO_BATCH, evaluate
from stabledrl.likelihood import backward_views, plan_views, score_views
from stabledrl.metrics import metrics_line
from stabledrl.models.lora import add_lora, base_policy
from stabledrl.models.policy import load_policy
from stabledrl.objectives import LossOutput, group_advantages, grpo_loss, stabledrl_loss
from stabledrl.sampling import SamplingConfig, generate_micro_batched, micro_batch_calls, row_generators
from stabledrl.settings import MAX_MU, EstimatorConfig, ObjectiveConfig, TrainConfig  # no torch: for the CLI
from stabledrl.tasks import get_task

__all__ = ["EstimatorConfig", "ObjectiveConfig", "TrainConfig", "run_train"]


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
    no synchronisation inside a step."""

    def __init__(self, *models: torch.nn.Module) -> None:
        self._seconds = 0.0
        self._t0 = 0.0
        models = list({id(m): m for m in models}.values())  # a LoRA reference shares the policy's model
        self._cuda = any(p.is_cuda for m in models for p in m.parameters())
        self._events: list[tuple[Any, Any]] = []
        for m in models:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, *args) -> None:
        if self._cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _stop(self, *args) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
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


class Rollouts(NamedTuple):
    """The scored part of a step's rollouts (rows of the kept groups)."""

    prompt_ids: torch.Tensor  # (B', P)
    prompt_mask: torch.Tensor  # (B', P)
    completion_ids: torch.Tensor  # (B', L)
    completion_mask: torch.Tensor  # (B', L) scored slots
    unmask_step: torch.Tensor  # (B', L) the sampler step that committed each slot


class _Groups(NamedTuple):
    """Rollouts of whole groups: G consecutive rows per problem."""

    problems: list  # (n,) one per group
    prompt_ids: torch.Tensor  # (n·G, P) left-padded
    prompt_mask: torch.Tensor  # (n·G, P)
    completion_ids: torch.Tensor  # (n·G, L)
    completion_mask: torch.Tensor  # (n·G, L)
    unmask_step: torch.Tensor  # (n·G, L)
    rewards: torch.Tensor  # (n, G)
    entropy: torch.Tensor  # (n·G,)

    def flat(self) -> torch.Tensor:
        """(n,) True where every reward of the group is equal."""
        return (self.rewards == self.rewards[:, :1]).all(1)

    def select(self, groups: torch.Tensor) -> "_Groups":
        G = self.rewards.size(1)
        rows = (groups[:, None] * G + torch.arange(G)).flatten()  # (n'·G,)
        return _Groups([self.problems[i] for i in groups.tolist()], self.prompt_ids[rows], self.prompt_mask[rows],
                       self.completion_ids[rows], self.completion_mask[rows], self.unmask_step[rows],
                       self.rewards[groups], self.entropy[rows])


def _left_pad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.cat([x.new_full((x.size(0), width - x.size(1)), value), x], dim=1)


def _concat(parts: list[_Groups], pad_token_id: int) -> _Groups:
    """Groups of several rollout rounds in one batch (prompts re-padded to the widest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.prompt_ids.size(1) for p in parts)
    return _Groups([q for p in parts for q in p.problems],
                   torch.cat([_left_pad(p.prompt_ids, width, pad_token_id) for p in parts]),
                   torch.cat([_left_pad(p.prompt_mask, width, 0) for p in parts]),
                   *(torch.cat([getattr(p, f) for p in parts]) for f in ("completion_ids", "completion_mask",
                                                                         "unmask_step", "rewards", "entropy")))


def _roll_groups(cfg: TrainConfig, policy, task, problems: list, tag: str, gen_length: int, procs: _Procs) -> _Groups:
    """G rollouts per problem from the current policy, and their rewards. Each process
    samples and rewards its share of the n·G rows; every process returns all of them."""
    G = cfg.group_size
    group_problems = [p for p in problems for _ in range(G)]
    n = len(group_problems)
    p_ids, p_mask = encode_policy_prompts(policy, [p.prompt for p in group_problems])  # (n·G, P) all rows
    lo, hi = procs.bounds(n)
    dev = policy.device
    mb = cfg.rollout.micro_batch
    calls = micro_batch_calls(-(-n // procs.world), mb)  # those of the largest share (synced: collectives)
    roll = generate_micro_batched(policy, p_ids[lo:hi].to(dev), p_mask[lo:hi].to(dev), gen_length=gen_length,
                                  micro_batch=mb, generator=row_generators(tag, lo, hi), synced=procs.synced,
                                  num_calls=calls, **cfg.rollout.generate_kwargs())
    texts = decode_policy_completions(policy, roll.completion_ids.cpu())
    rewards = torch.tensor(task.reward(texts, group_problems[lo:hi]), dtype=torch.float32)  # (share,)
    full = [procs.gather(x.to(dev), n).cpu() for x in (roll.completion_ids, roll.completion_mask, roll.unmask_step,
                                                         rewards, roll.entropy)]
    return _Groups(list(problems), p_ids, p_mask, full[0], full[1], full[2], full[3].view(-1, G), full[4])


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
                      block_size=block_size, unmask_step=batch.unmask_step if method == "path" else None,
                      **cfg.estimator.options)


def _score(cfg: TrainConfig, policy, plan, batch: Rollouts) -> torch.Tensor:
    """ℓ under `policy`: (B',) sequence estimates, or (B', L) per-token terms for token ratios."""
    est = score_views(policy, plan, batch.prompt_ids, batch.completion_ids, batch.completion_mask,
                      prompt_mask=batch.prompt_mask, reduction=cfg.estimator.reduction,
                      max_views_per_forward=cfg.estimator.max_views_per_forward)
    return est.token if cfg.objective.ratio_level == "token" else est.sequence


def _objective(cfg: TrainConfig, logp, old, advantages, batch: Rollouts, ref, weight_kw: dict) -> LossOutput:
    o = cfg.objective
    if o.name == "grpo":
        return grpo_loss(logp, old, advantages, group_size=cfg.group_size, clip_eps=o.clip_eps,
                         ratio_level=o.ratio_level, completion_mask=batch.completion_mask,
                         ref_logp=ref if o.beta else None, beta=o.beta, token_aggregation=o.token_aggregation)
    return stabledrl_loss(logp, old, advantages, group_size=cfg.group_size, clip=o.clip, clip_max=o.clip_max,
                          clip_eps=o.clip_eps, ratio_level=o.ratio_level, completion_mask=batch.completion_mask,
                          **weight_kw)


def _first_half_loss(cfg: TrainConfig, logp, old, advantages, batch: Rollouts, ref, weight_kw: dict,
                     num_groups: int) -> torch.Tensor:
    """The part of the step's loss that comes from its first ⌊n/2⌋ groups: both objectives
    are means over groups, so loss = Σ_g c_g / n and this is Σ_{g < n/2} c_g / n; with
    batch_token_mean the loss is a mean over scored tokens, and the half's share is its
    fraction of them."""
    half = num_groups // 2
    rows = half * cfg.group_size
    part = Rollouts(*(x[:rows] for x in batch))
    kw = {k: v[:rows] for k, v in weight_kw.items()}
    res = _objective(cfg, logp[:rows], old[:rows], advantages[:rows], part, None if ref is None else ref[:rows], kw)
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


def _step_measuring_update(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
    """opt.step(); returns the norm of the change it made to the parameters, without a copy
    of all of them: the optimizer steps one chunk of about `_UPDATE_CHUNK` elements at a
    time (torch's optimizers skip a parameter whose .grad is None, and their updates are
    per parameter, so the weights and states are those of one step), and only that chunk
    is copied to take the difference."""
    grads = [p.grad for p in params]
    chunks: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if grads[i] is None:
            continue
        if chunks[-1] and size + p.numel() > _UPDATE_CHUNK:
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


def run_train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train; returns the final held-out evaluation (and the initial one)."""
    from accelerate import Accelerator
    from torch.utils.tensorboard import SummaryWriter

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    # No buffer broadcast in forward: the models' buffers are constants, and a collective in
    # every forward would tie the processes' (data-dependent) numbers of model calls together.
    on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
    # The precision is the run's (not the launcher's): a process may run several trainings
    # (tests, benchmarks), so accelerate's per-process state is set afresh; the process group stays.
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=cfg.mixed_precision,  # autocast of the prepared model
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    procs = _Procs(accelerator)
    if accelerator.distributed_type.value == "DEEPSPEED":
        # accelerate's DeepSpeed backward also steps (and clips, with the DeepSpeed config's
        # gradient_clipping): one backward per optimizer step only.
        check(cfg.estimator.max_views_per_forward is None,
              "under DeepSpeed leave estimator.max_views_per_forward unset (its backward steps the optimizer)")
        check(not cfg.grad_agreement, "under DeepSpeed leave grad_agreement off (its backward steps the optimizer)")
    main = accelerator.is_main_process
    _check_processes(cfg, procs.world)
    task = get_task(cfg.task.name, **cfg.task.options)
    # One process may name its device; with several, each process uses the one accelerate gives it.
    device = accelerator.device if cfg.model.device == "auto" or accelerator.num_processes > 1 else cfg.model.device
    initial = load_policy(cfg.model, device=device)
    _check_estimator_fits_model(cfg, initial)  # before a run directory exists
    out = Path(cfg.output_dir)
    if main:
        ckpt = open_run_dir(out, to_dict(cfg), resume=resume)
    accelerator.wait_for_everyone()
    if not main:
        ckpt = latest_checkpoint(out) if resume else None

    if ckpt is not None:  # the checkpoint holds the weights (or the LoRA adapters) of the policy
        policy = load_policy(dataclasses.replace(cfg.model, path=str(ckpt)), device=device, trainable=True)
    elif cfg.lora is not None:
        policy = add_lora(initial, cfg.lora, seed=cfg.seed)
    else:  # the reference is a second copy, loaded only if something reads it
        policy, initial = initial, (load_policy(cfg.model, device=device) if _needs_reference(cfg) else None)
    if cfg.lora is not None:
        reference = base_policy(policy)  # the initial policy is the base model: no second copy
    else:
        reference = initial  # KL reference and drift baseline, or None
        if reference is not None:
            reference.model.requires_grad_(False)
            if procs.world > 1 and accelerator.distributed_type.value == "FSDP":
                _broadcast_from_main(reference.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = _optimizer(cfg, params)
    policy.model, opt = accelerator.prepare(policy.model, opt)  # DDP / FSDP / DeepSpeed with N processes
    accelerator.register_save_state_pre_hook(_save_no_weights)
    accelerator.register_load_state_pre_hook(_load_no_weights)
    params = [p for p in policy.model.parameters() if p.requires_grad]  # FSDP replaces the parameters
    model = policy.model
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio)
    start = 0
    counters = {"skipped_steps": 0, "zero_variance_groups": 0, "resampled_groups": 0}
    monitor = CollapseMonitor()
    history: dict[str, Any] = {}
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        if (ckpt / ACCELERATE_STATE).is_dir():  # every process loads its part of the optimizer state
            accelerator.load_state(str(ckpt / ACCELERATE_STATE))
        else:  # saved by an earlier version: one process's whole optimizer state
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, history = state["step"], state["history"]
        counters.update(state["counters"])
        monitor = state.get("collapse", monitor)
        if main:
            rewind_metrics(out / "metrics.jsonl", ckpt)

    eval_problems = task.generate(cfg.eval_n, split=cfg.eval_split, seed=0)
    if "eval_initial" not in history:
        history["eval_initial"] = _evaluate(policy, task, eval_problems, cfg.eval_sampling, procs)
    metrics_file = open(out / "metrics.jsonl", "a") if main else None
    tb = SummaryWriter(str(out / "tensorboard")) if main else None
    if start == 0:
        monitor.update({"eval_accuracy": history["eval_initial"]["accuracy"]})
        _log(metrics_file, tb, {"step": 0, "eval_accuracy": history["eval_initial"]["accuracy"],
                                "eval_reward": history["eval_initial"]["mean_reward"], "collapse": False})
    forward_clock = _ForwardClock(policy.model, *([reference.model] if reference is not None else []))
    gen_length = cfg.rollout.gen_length or task.completion_length
    G = cfg.group_size
    need_tokens = cfg.objective.ratio_level == "token"
    # With a view budget, the update never holds more than one micro-batch's graph.
    two_pass = cfg.estimator.max_views_per_forward is not None
    world = procs.world

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {cfg.objective.name}",
               disable=not (progress and main))
    for step in bar:
        times: dict[str, float] = {}
        forward_clock.seconds = 0.0
        t_step = time.perf_counter()
        model.eval()
        # 1-2. prompts and rollouts from θ_old
        with _timed(times, "rollout"):
            problems = task.generate(cfg.prompts_per_step, split="train", seed=cfg.seed * 1_000_003 + step)
            first = _roll_groups(cfg, policy, task, problems, f"{cfg.seed}/{step}/0", gen_length, procs)
            # 3. groups with zero reward variance: keep, skip, or replace by fresh ones
            flat = first.flat()  # (P,)
            counters["zero_variance_groups"] += int(flat.sum())
            if cfg.zero_variance_groups == "keep":
                groups = first
            else:
                parts = [first.select((~flat).nonzero().flatten())]
            if cfg.zero_variance_groups == "resample":
                for r in range(cfg.max_resample_rounds):
                    missing = cfg.prompts_per_step - sum(len(p.problems) for p in parts)
                    if missing <= 0:
                        break
                    seed_r = _resample_seed(cfg.seed, step, r)
                    extra = _roll_groups(cfg, policy, task, task.generate(missing, split="train", seed=seed_r),
                                         f"{cfg.seed}/{step}/{r + 1}", gen_length, procs)
                    e_flat = extra.flat()
                    counters["zero_variance_groups"] += int(e_flat.sum())
                    counters["resampled_groups"] += missing
                    parts.append(extra.select((~e_flat).nonzero().flatten()))
            if cfg.zero_variance_groups != "keep":
                groups = _concat(parts, policy.pad_token_id)
        rewards = first.rewards.flatten()  # (P·G,) the step's on-policy statistics come from the first round
        row: dict[str, Any] = {
            "step": step + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy_train": float((rewards == 1.0).float().mean()),
            "completion_length": float(first.completion_mask.sum(1).float().mean()),
            "entropy": float(first.entropy.mean()), "zero_variance_fraction": float(flat.float().mean()),
            "groups_used": len(groups.problems), "lr": sched.get_last_lr()[0],
        }
        if groups.problems:
            batch = Rollouts(groups.prompt_ids, groups.prompt_mask, groups.completion_ids, groups.completion_mask,
                             groups.unmask_step)
            n_rows = batch.completion_ids.size(0)  # B' = kept groups · G
            lo, hi = procs.bounds(n_rows)  # this process's rows of the likelihoods
            mine = Rollouts(*(x[lo:hi].to(device) for x in batch))
            b_adv = group_advantages(groups.rewards.flatten(), G, cfg.objective.advantage_scale)  # (B',)

            def plan(slot: int):  # drawn for all B' rows (the same on every process), scored on mine
                return _plan(cfg, batch, step, slot, policy).rows(lo, hi)

            def scored(pol, pl) -> torch.Tensor:  # ℓ of every row, no graph: (B',) or (B', L)
                return procs.gather(_score(cfg, pol, pl, mine), n_rows).cpu()

            # 4. ℓ_old (and ℓ_ref) under no grad
            with _timed(times, "likelihood_old"), torch.no_grad():
                plan_old = plan(1)
                old = scored(policy, plan_old)
                ref = None
                if reference is not None:
                    with accelerator.autocast():  # a reference copy is not prepared: same precision as ℓ_old
                        ref = scored(reference, plan_old)
                    # KL(π_old ‖ π_init) ≈ mean over π_old's own samples of ℓ_old − ℓ_init
                    gap = (old - ref).sum(-1) if need_tokens else old - ref  # (B',)
                    row["drift_kl"] = float(gap.mean())
                if cfg.objective.separate_weight_masks:
                    plan_w = plan(2)
                    w_old = scored(policy, plan_w)
            # 5. μ inner iterations
            # The update runs in eval mode too: no dropout, so ρ = 1 at θ = θ_old and every
            # process computes the same function (dropout would draw from each one's RNG).
            inner_rows = []
            for it in range(cfg.mu):
                with _timed(times, "update"):
                    pl = plan_old if cfg.masks == "shared" else plan(3 + it)
                    w_kw = {}
                    if cfg.objective.separate_weight_masks:
                        with torch.no_grad():
                            w_kw = {"weight_logp": scored(policy, plan_w), "weight_old_logp": w_old}
                    opt.zero_grad(set_to_none=True)
                    # The objective sees ℓ of all B' rows; only this process's rows carry a
                    # graph (two_pass: none, ∂loss/∂ℓ is taken on a leaf and pushed back view
                    # batch by view batch). Its gradient is this process's part of the sum.
                    if two_pass:
                        with torch.no_grad():
                            leaf = scored(policy, pl).requires_grad_()
                        res = _objective(cfg, leaf, old, b_adv, batch, ref, w_kw)
                    else:
                        mine_logp = _score(cfg, policy, pl, mine)  # (B'/N,) with a graph, on the device
                        full = mine_logp
                        if world > 1:  # the other processes' rows, as constants (gathered on the device)
                            others = procs.gather(mine_logp, n_rows)
                            full = torch.cat([others[:lo], mine_logp, others[hi:]])
                        full = full.cpu()
                        res = _objective(cfg, full, old, b_adv, batch, ref, w_kw)
                    finite = bool(torch.isfinite(res.loss))
                    if finite:
                        with _timed(times, "backward", cuda=forward_clock.cuda):
                            if two_pass:
                                res.loss.backward()
                                backward_views(policy, pl, mine.prompt_ids, mine.completion_ids, mine.completion_mask,
                                               leaf.grad[lo:hi] * world, prompt_mask=mine.prompt_mask,
                                               reduction=cfg.estimator.reduction,
                                               max_views_per_forward=cfg.estimator.max_views_per_forward,
                                               backward=accelerator.backward,
                                               no_sync=lambda: accelerator.no_sync(model))
                            elif cfg.grad_agreement and it == 0 and len(groups.problems) >= 2:
                                part = _first_half_loss(cfg, full, old, b_adv, batch, ref, w_kw, len(groups.problems))
                                row["grad_agreement"] = _backward_in_halves(res.loss, part, params,
                                                                            accelerator.backward)
                            else:  # DDP averages the processes' gradients: × N makes their sum
                                accelerator.backward(res.loss * world)
                        norm = accelerator.clip_grad_norm_(params, cfg.grad_clip)
                        # DeepSpeed clips inside its engine and may not report a norm
                        grad_norm = float("nan") if norm is None else float(norm)
                        finite = norm is None or math.isfinite(grad_norm)
                    else:
                        grad_norm = float("nan")
                    if not finite:  # never let a non-finite update reach the weights
                        opt.zero_grad(set_to_none=True)
                        counters["skipped_steps"] += 1
                        inner_rows.append({**res.metrics, "loss": float(res.loss.detach()), "grad_norm": grad_norm,
                                           "update_norm": 0.0})
                        continue
                    update = _step_measuring_update(opt, params)
                    inner_rows.append({**res.metrics, "loss": float(res.loss.detach()), "grad_norm": grad_norm,
                                       "update_norm": update})
            # Over the μ inner iterations: maxima of *_max metrics, means of the others.
            for k in inner_rows[0]:
                vals = [r[k] for r in inner_rows]
                row[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
            # NaN (a skipped inner iteration) wins: the step's largest norm is then not a number
            row["grad_norm_max"] = max((r["grad_norm"] for r in inner_rows), key=lambda v: (math.isnan(v), v))
        sched.step()
        row.update(counters)
        row["seconds"] = time.perf_counter() - t_step
        row.update({f"time_{k}": v for k, v in times.items()})
        row["time_model_forward"] = forward_clock.seconds
        # The framework's share: time in neither the model's forward nor the backward.
        row["framework_share"] = 1 - (forward_clock.seconds + times.get("backward", 0.0)) / row["seconds"]
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            res_e = _evaluate(policy, task, eval_problems, cfg.eval_sampling, procs)
            row.update({"eval_accuracy": res_e["accuracy"], "eval_reward": res_e["mean_reward"]})
        _flag_collapse(monitor, row, bar, main)
        if done % cfg.log_every == 0 or "eval_accuracy" in row:
            _log(metrics_file, tb, row)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", gnorm=f"{row.get('grad_norm', 0):.2g}",
                        ratio_max=f"{row.get('ratio_max', 1):.3g}", skipped=counters["skipped_steps"],
                        **({"COLLAPSE": ",".join(monitor.reasons)} if monitor.collapsed else {}))
        if done % cfg.save_every == 0 or done == cfg.steps:
            # The optimizer goes into accelerate's state, the rest (the same on every process) here.
            state = {"scheduler": sched.state_dict(), "step": done, "counters": counters, "history": history,
                     "collapse": monitor}
            save_checkpoint(out, done, _FullWeights(policy, accelerator), state, accelerator=accelerator)
    bar.close()

    history["eval_final"] = _evaluate(policy, task, eval_problems, cfg.eval_sampling, procs)
    final_row = {"step": cfg.steps, "eval_accuracy": history["eval_final"]["accuracy"],
                 "eval_reward": history["eval_final"]["mean_reward"]}
    _flag_collapse(monitor, final_row, bar, main)
    _log(metrics_file, tb, final_row)
    policy.model.eval()
    summary = {**history, **counters, "processes": world, "collapse": list(monitor.reasons)}
    weights = _FullWeights(policy, accelerator)  # every process: a gather under FSDP / ZeRO-3
    if main:
        metrics_file.close()
        tb.close()
        save_final(out, weights)
        write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    accelerator.wait_for_everyone()
    return summary


def _flag_collapse(monitor: CollapseMonitor, row: dict[str, Any], bar, main: bool) -> None:
    """Feed the row to the collapse monitor; write `collapse` into it; say so once per reason."""
    new = monitor.update(row)
    row["collapse"] = monitor.collapsed
    if new and main:
        bar.write(f"step {row['step']}: the run looks collapsed ({', '.join(new)}; "
                  "see stabledrl.diagnostics.CollapseMonitor)", file=sys.stderr)


def _log(f, tb, row: dict[str, Any]) -> None:
    if f is None:  # not the main process
        return
    f.write(metrics_line(row))
    f.flush()
    for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
            tb.add_scalar(k, v, row["step"])
