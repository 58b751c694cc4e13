"""A training run's parts and its state from step to step (`Run`), made by `set_up`: the
accelerator, the policy and its reference, the optimizer and schedule, the run directory,
the logs; and what the loop calls at a step's end: `evaluate`, `log`, and `finish` (the
final evaluation and save). A resumed run takes its state from the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup  # (not at the top before 4.57)

from stabledrl.checkpoint import (ACCELERATE_STATE, latest_checkpoint, load_trainer_state, open_run_dir,
                                  rewind_metrics, save_final, write_atomic)
from stabledrl.config import ConfigError, check, to_dict
from stabledrl.diagnostics import CollapseMonitor
from stabledrl.engines import check_engine
from stabledrl.evaluate import EVAL_MICRO_BATCH, EvalShare, evaluate
from stabledrl.instruments import StepTimer
from stabledrl.likelihood import check_method_fits
from stabledrl.models.lora import add_lora, base_policy
from stabledrl.models.policy import load_policy
from stabledrl.preflight import check_run, eval_rows_per_call, longest_prompt_tokens, machine_of, predict_run
from stabledrl.sampling import micro_batch_calls
from stabledrl.settings import TrainConfig
from stabledrl.shards import Shards
from stabledrl.tasks import get_task
from stabledrl.tracking import Tracker

__all__ = ["Run", "set_up", "check_processes", "GatheredPolicy", "prepare_reference_copy"]


@dataclasses.dataclass
class Run:
    """What `set_up` returns: the run's parts, and its state from step to step."""

    cfg: TrainConfig
    accelerator: Any  # accelerate.Accelerator
    shards: Shards
    task: Any
    device: Any  # where this process scores its rows
    policy: Any  # its model prepared by accelerate (DDP / FSDP / DeepSpeed with several processes)
    reference: Any  # the initial policy (KL reference and drift baseline), or None when nothing reads it
    params: list[torch.nn.Parameter]  # the trainable parameters, as the optimizer holds them
    opt: torch.optim.Optimizer
    sched: Any  # warm-up, then cosine to min_lr_ratio
    out: Path  # the run directory
    start: int = 0  # the first step to run (a resumed run: its checkpoint's step)
    counters: dict[str, int] = dataclasses.field(default_factory=lambda: {
        "skipped_steps": 0, "zero_variance_groups": 0, "resampled_groups": 0})
    monitor: CollapseMonitor = dataclasses.field(default_factory=CollapseMonitor)
    history: dict[str, Any] = dataclasses.field(default_factory=dict)  # eval_initial, eval_final
    eval_problems: list = dataclasses.field(default_factory=list)
    tracker: Tracker | None = None  # metrics.jsonl, samples.jsonl and the report_to backends (main process)
    timer: StepTimer | None = None

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy and mean reward; each process decodes its share of the problems, and
        the main process's samples go to the tracker's table for `step`."""
        n, sampling = len(self.eval_problems), self.cfg.eval_sampling
        start, end = self.shards.bounds(n)
        calls = micro_batch_calls(self.shards.largest_share(n), sampling.micro_batch or EVAL_MICRO_BATCH)
        res = evaluate(self.policy, self.task, self.eval_problems[start:end], sampling, progress=False,
                       share=EvalShare(start, synced=self.shards.synced, num_calls=calls))
        scores = torch.tensor([[float(s["correct"]), s["reward"]] for s in res.samples],
                              device=self.policy.device)  # (share, 2)
        full = self.shards.gather(scores, n).double().mean(0)
        self.tracker.log_samples(res.samples, step)
        return {"accuracy": float(full[0]), "mean_reward": float(full[1])}

    def evaluate_row(self, step: int) -> dict[str, float]:
        """The held-out evaluation as a metrics row's keys."""
        res = self.evaluate(step)
        return _eval_keys(res)

    def check_collapse(self, row: dict[str, Any]) -> bool:
        """Feed the row to the collapse monitor, say so once per new reason; whether the run
        looks collapsed (the row's `collapse`)."""
        new = self.monitor.update(row)
        if new and self.main:
            tqdm.write(f"step {row['step']}: the run looks collapsed ({', '.join(new)}; "
                       "see stabledrl.diagnostics.CollapseMonitor)", file=sys.stderr)
        return self.monitor.collapsed

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row into metrics.jsonl and each report_to backend (the main process only)."""
        self.tracker.log(row)

    def finish(self) -> dict[str, Any]:
        """The final held-out evaluation, logged; the final model and summary.json saved (every
        process: under FSDP / ZeRO-3 gathering the weights is a collective). Returns the summary."""
        final = self.history["eval_final"] = self.evaluate(self.cfg.steps)
        row = {"step": self.cfg.steps, **_eval_keys(final)}
        row["collapse"] = self.check_collapse(row)
        self.log(row)
        summary = {**self.history, **self.counters, "processes": self.shards.world,
                   "collapse": list(self.monitor.reasons)}
        self.policy.model.eval()
        final = self.cfg.final_precision
        weights = GatheredPolicy(self.policy, self.accelerator, dtype=None if final is None else getattr(torch, final))
        if self.main:
            self.tracker.close()
            save_final(self.out, weights)
            write_atomic(self.out / "summary.json", json.dumps(summary, indent=2))
        self.accelerator.wait_for_everyone()
        return summary


def set_up(cfg: TrainConfig, *, resume: bool = False, task: Any = None) -> Run:
    """The accelerator, the task, the policy (from the checkpoint when resuming) and its
    reference, the optimizer and schedule (and a resumed run's state), the initial
    evaluation, the logs. Settings that do not fit the model or the processes are refused
    before a run directory exists."""
    accelerator = _accelerator(cfg)
    shards = Shards(accelerator)
    check_processes(cfg, shards.world)
    task = get_task(cfg.task.name, **cfg.task.options) if task is None else task
    # One process may name its device; with several, each process uses the one accelerate gives it.
    device = accelerator.device if cfg.model.device == "auto" or shards.world > 1 else cfg.model.device
    _preflight(cfg, task, accelerator, shards.world, device)
    initial = load_policy(cfg.model, device=device)
    try:
        check_method_fits(cfg.estimator.method, initial)
    except ValueError as e:
        raise ConfigError(f"{e} ({cfg.model.path})") from None
    check_engine(cfg.rollout, initial)
    check_engine(cfg.eval_sampling, initial)
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        ckpt = open_run_dir(out, to_dict(cfg), resume=resume)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        ckpt = latest_checkpoint(out) if resume else None
    policy, reference = _policy_and_reference(cfg, initial, ckpt, device, accelerator)
    opt = _optimizer(cfg, [p for p in policy.model.parameters() if p.requires_grad])
    policy.model, opt = accelerator.prepare(policy.model, opt)  # DDP / FSDP / DeepSpeed with N processes
    if cfg.lora is None:  # a LoRA reference is the policy itself, its adapters off
        prepare_reference_copy(reference, accelerator)
    # accelerate's state would hold the weights, which the checkpoint's policy holds already
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())
    params = [p for p in policy.model.parameters() if p.requires_grad]  # FSDP replaces the parameters
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio)
    run = Run(cfg, accelerator, shards, task, device, policy, reference, params, opt, sched, out)
    if ckpt is not None:  # every process loads its part of the optimizer state
        run.accelerator.load_state(str(ckpt / ACCELERATE_STATE))
        state = load_trainer_state(ckpt)
        run.sched.load_state_dict(state["scheduler"])
        run.start, run.history, run.monitor = state["step"], state["history"], state["collapse"]
        run.counters.update(state["counters"])
        if run.main:
            rewind_metrics(run.out / "metrics.jsonl", ckpt)
    _open_logs(run)
    return run


def _preflight(cfg: TrainConfig, task: Any, accelerator: Any, world: int, device: Any) -> None:
    """Print the memory model's prediction for this run, and refuse one that cannot fit
    (`stabledrl.preflight`), before the model's weights load."""
    from stabledrl.models.adapters import _load_tokenizer
    from stabledrl.models.prompting import resolve_chat_template

    try:
        tokenizer = _load_tokenizer(cfg.model.path, bool(cfg.model.trust_remote_code), True, None)
        chat = resolve_chat_template(tokenizer, None if cfg.model.chat_template == "auto" else cfg.model.chat_template)
        longest = longest_prompt_tokens(task, tokenizer, chat)
        tokens = tuple(min(longest, s.max_prompt_length or longest) for s in (cfg.rollout, cfg.eval_sampling))
        sharded = accelerator.distributed_type.value in ("FSDP", "DEEPSPEED")
        pred = predict_run(cfg, task, machine_of(device, world, sharded), prompt_tokens=tokens,
                           eval_rows=eval_rows_per_call(cfg, world, EVAL_MICRO_BATCH))
    except Exception as e:  # noqa: BLE001 (a model or task the memory model cannot read must not stop the run)
        if accelerator.is_main_process:
            print(f"preflight: no prediction ({type(e).__name__}: {e})")
        return
    try:
        check_run(pred, cfg.output_dir)
    except ConfigError:
        if cfg.preflight:
            raise
    if accelerator.is_main_process:
        print(pred.line())


def check_processes(cfg: TrainConfig, world: int) -> None:
    """Settings that several processes cannot run. Any group size can: a process whose share of
    a step's rows is empty scores a stand-in row with weight 0 (`stabledrl.train.Share`)."""
    if world > 1:
        check(cfg.eval_n >= world, f"eval_n ({cfg.eval_n}) must be >= the number of processes ({world})")
        check(not cfg.grad_agreement, "grad_agreement runs in one process only")


def _accelerator(cfg: TrainConfig):
    """The run's accelerator (CPU or GPU, precision; DDP / FSDP / DeepSpeed from the launcher)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
    # The precision is the run's, not the launcher's: a process may run several trainings
    # (tests, benchmarks), so accelerate's per-process state is set afresh; the process group stays.
    AcceleratorState._reset_state()
    # No buffer broadcast in forward: the buffers are constants, and a collective in every
    # forward would tie the processes' (data-dependent) numbers of model calls together.
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=cfg.mixed_precision,
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    if accelerator.distributed_type.value == "DEEPSPEED":
        # accelerate's DeepSpeed backward also steps (and clips): one backward per optimizer step only.
        check(cfg.estimator.max_views_per_forward is None,
              "under DeepSpeed leave estimator.max_views_per_forward unset (its backward steps the optimizer)")
        check(not cfg.grad_agreement, "under DeepSpeed leave grad_agreement off (its backward steps the optimizer)")
        check(cfg.accumulation_rounds == 1,
              "under DeepSpeed set accumulation_rounds: 1 (its backward steps the optimizer after every round)")
    return accelerator


def _policy_and_reference(cfg: TrainConfig, initial, ckpt: Path | None, device, accelerator):
    """The policy to train and the reference (None when nothing reads it), from the initial policy."""
    needs_reference = cfg.drift_kl or cfg.objective.needs_reference
    if ckpt is not None:  # the checkpoint holds the weights (or the LoRA adapters) of the policy
        policy = load_policy(dataclasses.replace(cfg.model, path=str(ckpt)), device=device, trainable=True)
        initial = initial if needs_reference else None
    elif cfg.lora is not None:
        policy = add_lora(initial, cfg.lora, seed=cfg.seed)
    else:  # the reference is a second copy, loaded only if something reads it
        policy, initial = initial, (load_policy(cfg.model, device=device) if needs_reference else None)
    if cfg.lora is not None:  # the reference is the base model (adapters off): no second copy
        return policy, base_policy(policy) if needs_reference else None
    if initial is not None:
        initial.model.requires_grad_(False)
        if accelerator.num_processes > 1 and accelerator.distributed_type.value == "FSDP":
            # With fsdp_cpu_ram_efficient_loading only the first process loads the weights, and FSDP
            # broadcasts them when it wraps a model: the reference is never wrapped, so broadcast here.
            import torch.distributed as dist

            with torch.no_grad():
                for t in initial.model.state_dict().values():
                    dist.broadcast(t, src=0)
    return policy, initial


def prepare_reference_copy(reference, accelerator) -> None:
    """Under DeepSpeed, a reference copy (None: nothing) becomes an engine of its own with the
    policy's config and no optimizer, as TRL prepares its reference models: under ZeRO-3 its
    parameters are partitioned like the policy's (by zero.Init at load, with `zero3_init_flag`)
    and gathered for each forward; under stages 0-2 it is whole on every process. Either way it
    runs in the policy's precision. Call it after the policy's `prepare`, which fills the
    config's "auto" values."""
    if reference is None or accelerator.distributed_type.value != "DEEPSPEED":
        return
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for frozen in ("optimizer", "scheduler"):  # nothing to step
        config.pop(frozen, None)
    if config["zero_optimization"].get("stage", 0) != 3:  # stages 1-2 partition optimizer states only
        config["zero_optimization"]["stage"] = 0
    reference.model, *_ = deepspeed.initialize(model=reference.model, config=config)
    reference.model.eval()


def _optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _open_logs(run: Run) -> None:
    """The logs, the held-out problems and the initial evaluation (a resumed run has it in its
    history), a fresh run's step-0 row, the step timer."""
    cfg = run.cfg
    run.tracker = Tracker(run.out, cfg.report_to, config=to_dict(cfg), start_step=run.start, enabled=run.main)
    run.eval_problems = run.task.generate(cfg.eval_n, split=cfg.eval_split, seed=0)
    if "eval_initial" not in run.history:
        run.history["eval_initial"] = run.evaluate(0)
    if run.start == 0:
        initial = run.history["eval_initial"]
        run.monitor.update({"eval_accuracy": initial["accuracy"]})
        run.log({"step": 0, **_eval_keys(initial), "collapse": False})
    run.timer = StepTimer(run.policy.model, *([run.reference.model] if run.reference is not None else []))


def _eval_keys(res: dict[str, float]) -> dict[str, float]:
    """A held-out evaluation as a metrics row's keys."""
    return {"eval_accuracy": res["accuracy"], "eval_reward": res["mean_reward"]}


class GatheredPolicy:
    """The policy as it is saved: its bare model (DDP/FSDP wrappers removed) with the full
    weights, gathered (onto the main process) under FSDP or ZeRO-3: a collective, so every
    process makes this object, and the main process saves it."""

    def __init__(self, policy, accelerator, dtype: torch.dtype | None = None) -> None:
        self.state_dict = accelerator.get_state_dict(policy.model)
        if dtype is not None and self.state_dict is not None:  # the main process's full weights, cast
            self.state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state_dict.items()}
        self.policy = copy.copy(policy)
        self.policy.model = accelerator.unwrap_model(policy.model)

    @property
    def model(self) -> torch.nn.Module:
        """The bare model, whose trainable parameters size a save before one exists (`stabledrl.checkpoint`)."""
        return self.policy.model

    def save(self, path: str | Path) -> None:
        self.policy.save(path, state_dict=self.state_dict)
