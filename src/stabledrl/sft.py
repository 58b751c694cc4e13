"""Supervised training of a tiny masked-diffusion LM from scratch (the `sft` verb;
docs/methods.md, "SFT of the tiny models").

Loss (LLaDA, Nie et al. 2025, Eq. 5 for SFT): with t ~ U(0, 1], mask each completion slot
independently with probability t (the prompt is never masked) and take

    L = -(1 / (B L)) Σ_b (1 / t_b) Σ_{i masked} log p_θ(y_i | x_t, q),

an upper bound on the completion's negative log-likelihood. Every slot is a target,
EOS and the PAD after it included, so the model learns where the answer ends; PAD is a stop
token of every policy (`stabledrl.data.completion_stop_ids`), so the sampler may write it.
Deviations, variance reductions that keep t's marginal U(t_min, 1]: t is stratified across
the batch (t_b = 1 - (1 - t_min) frac(u + b / B)), and t_min = 1e-3 keeps 1/t finite.
Block models train with BD3-LM's one-pass block-diffusion loss (Arriola et al. 2025, Eq. 8):
[q ; y ; ỹ] under the staircase mask, each block of ỹ noised at its own level.

The loop: fresh problems each step, AdamW with warmup and cosine decay, clipping, JSONL
metrics, atomic checkpoints with exact resume, evaluation, the model saved to ``final/``.

Shapes: B batch, P prompt columns, L completion length, V vocabulary.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup  # (not at the top before 4.57)

from stabledrl.checkpoint import (
    open_run_dir,
    load_trainer_state,
    rewind_metrics,
    save_checkpoint,
    save_final,
    write_atomic,
)
from stabledrl.config import to_dict
from stabledrl.data import encode_completions, encode_policy_prompts
from stabledrl.evaluate import evaluate
from stabledrl.likelihood import completion_logits
from stabledrl.metrics import metrics_line
from stabledrl.models.attention import block_offset, completion_blocks, prompt_attention_of
from stabledrl.models.policy import Policy, TinyPolicy
from stabledrl.models.tiny import TinyDiffusionConfig, TinyDiffusionLM
from stabledrl.seeds import step_seed
from stabledrl.settings import SFTConfig, TaskConfig, TinyModelConfig  # no torch: for the CLI
from stabledrl.tasks import Task, get_task
from stabledrl.tokenizer import build_char_tokenizer

__all__ = [
    "TinyModelConfig",
    "TaskConfig",
    "SFTConfig",
    "sample_mask_levels",
    "diffusion_loss",
    "run_sft",
]


def sample_mask_levels(
    n: int, *, generator: torch.Generator, t_min: float = 1e-3, stratified: bool = True, device=None
) -> torch.Tensor:
    """(n,) masking levels t in (t_min, 1]: i.i.d. uniform, or stratified (one per
    stratum of width (1 - t_min)/n, at a common random offset)."""
    if stratified:
        u = (torch.rand(1, generator=generator, device=device) + torch.arange(n, device=device) / n) % 1.0
    else:
        u = torch.rand(n, generator=generator, device=device)
    return 1.0 - (1.0 - t_min) * u


def diffusion_loss(
    policy: Policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    generator: torch.Generator,
    t_min: float = 1e-3,
    stratified_t: bool = True,
    reduction: Literal["mean", "none"] = "mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SFT loss of the module docstring: one masking level per row, or per block of a
    block model (the one-pass staircase loss); returns (loss, metrics). `reduction`
    "mean": the loss L; "none": (B,) each row's Σ (1/t) Σ_{masked} −log p, whose negative
    is a one-draw ELBO of the row (benchmarks/lab/plain_reinforce.py)."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    B, L = completion_ids.shape
    device = completion_ids.device
    S = None  # full attention: one level per row (every slot in "block" 0)
    blk_of = torch.zeros((B, L), dtype=torch.long, device=device)
    if getattr(policy, "attention_kind", "full") == "block":  # one level per block of the row
        S = policy.block_size
        if not S:
            raise ValueError("a block-attention policy needs a block_size for its SFT loss")
        # under sequence_blocks a prompt's tail shortens the first block
        blk_of = completion_blocks(block_offset(prompt_mask, S, prompt_attention_of(policy)), L, S)  # (B, L)
    NB = int(blk_of.max()) + 1 if L else 1
    t_blocks = sample_mask_levels(B * NB, generator=generator, t_min=t_min, stratified=stratified_t, device=device)
    t = t_blocks.view(B, NB).gather(1, blk_of)  # (B, L) the level of each slot's row or block
    masked = torch.rand((B, L), generator=generator, device=device) < t  # (B, L)
    noisy = completion_ids.masked_fill(masked, policy.mask_token_id)  # (B, L)
    logits = completion_logits(policy, prompt_ids, prompt_mask, completion_ids, noisy, S)  # (B, L, V)
    nll = F.cross_entropy(logits.float().transpose(1, 2), completion_ids, reduction="none")  # (B, L)
    weighted = nll * masked / t  # (B, L)
    loss = weighted.sum(-1) if reduction == "none" else weighted.sum() / (B * L)
    with torch.no_grad():
        n_masked = masked.sum().clamp(min=1)
        acc = ((logits.argmax(-1) == completion_ids) & masked).sum() / n_masked
        metrics = {"masked_nll": float((nll * masked).sum() / n_masked), "masked_acc": float(acc)}
    return loss, metrics


def _new_policy(cfg: SFTConfig, task: Task) -> TinyPolicy:
    tok = build_char_tokenizer()
    mc = TinyDiffusionConfig(
        vocab_size=len(tok),
        hidden_size=cfg.model.hidden_size,
        num_hidden_layers=cfg.model.num_layers,
        num_attention_heads=cfg.model.num_heads,
        intermediate_size=cfg.model.intermediate_size,
        max_position_embeddings=task.prompt_length + task.completion_length + 2,
        attention_kind=cfg.model.attention_kind,
        block_size=cfg.model.block_size,
        mask_token_id=tok.mask_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = TinyDiffusionLM(mc)
    if cfg.model.init_from:
        init = TinyDiffusionLM.from_pretrained(cfg.model.init_from)
        try:
            model.load_state_dict(init.state_dict())
        except RuntimeError as e:
            raise ValueError(f"model.init_from {cfg.model.init_from}: its weights do not fit this model.* size ({e})")
    return TinyPolicy(model, tok)


def _optimizer(model: torch.nn.Module, cfg: SFTConfig):
    """AdamW (weight decay on matrices only) and its warmup-then-cosine schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    return opt, get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup_steps, cfg.steps,
                                                            min_lr_rate=cfg.min_lr_ratio)


def _resume(ckpt: Path, out: Path, model, opt, sched, gen: torch.Generator) -> int:
    """Load the weights, optimiser, schedule and noise state of checkpoint `ckpt` and rewind
    the metrics to it; returns its step."""
    loaded = TinyDiffusionLM.from_pretrained(ckpt)
    model.load_state_dict(loaded.state_dict())
    state = load_trainer_state(ckpt)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    gen.set_state(state["generator"])
    rewind_metrics(out / "metrics.jsonl", ckpt)
    return state["step"]


def _train_step(cfg: SFTConfig, policy, task, step: int, opt, gen: torch.Generator) -> tuple[float, float, dict, int]:
    """One optimiser step on a fresh batch of training problems -> the loss, the gradient
    norm before clipping, the loss's metrics and the tokens the batch holds."""
    problems = task.generate(cfg.batch_size, split="train", seed=step_seed(cfg.seed, step, "prompts"))
    p_ids, p_mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    c_ids = encode_completions(policy.tokenizer, [p.answer for p in problems], task.completion_length)
    loss, m = diffusion_loss(policy, p_ids, p_mask, c_ids, generator=gen, t_min=cfg.t_min,
                             stratified_t=cfg.stratified_t)
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"non-finite SFT loss at step {step}; lower lr (now {cfg.lr})")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.grad_clip))
    opt.step()
    return loss_value, grad_norm, m, p_ids.numel() + c_ids.numel()


def run_sft(cfg: SFTConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train, evaluate and save; returns the final evaluation summary."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    ckpt = open_run_dir(out, to_dict(cfg), resume=resume)

    task = get_task(cfg.task.name, **cfg.task.options)
    with torch.random.fork_rng(devices=[]):  # the initial weights from the seed; the global RNG is left as it was
        torch.manual_seed(cfg.seed)
        policy = _new_policy(cfg, task)
    model = policy.model
    model.train()
    opt, sched = _optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = 0 if ckpt is None else _resume(ckpt, out, model, opt, sched, gen)

    eval_problems = task.generate(cfg.eval_n, split=cfg.eval_split, seed=0)
    metrics_file = open(out / "metrics.jsonl", "a")
    tokens = 0
    t0 = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="sft", disable=not progress)
    for step in bar:
        loss_value, grad_norm, m, n_tokens = _train_step(cfg, policy, task, step, opt, gen)
        sched.step()
        tokens += n_tokens
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            elapsed = time.perf_counter() - t0
            row = {"step": done, "loss": loss_value, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
                   "tokens_per_s": tokens / elapsed, **m}
            metrics_file.write(metrics_line(row))
            metrics_file.flush()
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{m['masked_acc']:.3f}", tok_s=f"{tokens / elapsed:.0f}")
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            res = evaluate(policy, task, eval_problems, cfg.sampling, progress=False)
            model.train()
            metrics_file.write(metrics_line({"step": done, "eval_accuracy": res.accuracy, "eval_reward": res.mean_reward}))
            metrics_file.flush()
            bar.write(f"step {done}: held-out accuracy {res.accuracy:.3f}, mean reward {res.mean_reward:.3f}")
        if done % cfg.save_every == 0 or done == cfg.steps:
            state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                     "generator": gen.get_state(), "step": done}
            save_checkpoint(out, done, policy, state)
    bar.close()

    res = evaluate(policy, task, eval_problems, cfg.sampling, progress=progress)
    summary = {"step": cfg.steps, "eval_accuracy": res.accuracy, "eval_reward": res.mean_reward}
    metrics_file.write(metrics_line(summary))
    metrics_file.close()
    policy.model.eval()
    save_final(out, policy)
    write_atomic(out / "eval.json", json.dumps({**res.summary(), "samples": res.samples[:50]}, indent=2))
    return summary
