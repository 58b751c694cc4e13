"""Masked-diffusion generation for full-attention models (SPEC §6).

Start from L mask tokens after the prompt; over T steps, predict every masked slot and
commit the ones chosen by the remasking rule: ``low_confidence`` keeps the slots whose
predicted token has the highest probability (LLaDA, Nie et al. 2025, Alg. 5), ``random``
picks slots uniformly. With ``block_length`` < L the completion is decoded in
semi-autoregressive blocks, left to right, the steps split evenly among blocks.

Deliberate choices:
- The number of slots committed per step is ceil(masked left in the block / steps left),
  so the schedule adapts when slots are filled early (see EOS below) and every mask is
  filled by the last step.
- EOS: as soon as a slot decodes to EOS, every slot after it becomes PAD (decoded or not).
  The completion's text ends at its first EOS, and the model, trained on PAD after EOS,
  sees the same layout in RL likelihoods. Special tokens other than EOS (MASK, PAD, BOS,
  UNK) are never sampled.
- Temperature uses the Gumbel-max trick with noise from the explicit `generator`;
  temperature 0 is greedy and needs no generator.
- The prompt columns are never written.

Shapes: B batch, P prompt columns, L completion length, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from stabledrl.config import check
from stabledrl.data import completion_mask as _completion_mask
from stabledrl.data import position_ids
from stabledrl.models.policy import Policy

__all__ = ["SamplingConfig", "GenerationOutput", "generate"]


@dataclass
class SamplingConfig:
    """How completions are sampled (rollouts and evaluation)."""

    gen_length: int | None = None
    """Completion slots L; None = the task's `completion_length`."""
    steps: int | None = None
    """Denoising steps T; None = L (one slot per step)."""
    block_length: int | None = None
    """Semi-autoregressive block size; None = one block of L."""
    temperature: float = 0.0
    """Gumbel temperature; 0 = greedy."""
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    """Which masked slots to commit each step."""

    def __post_init__(self) -> None:
        for name in ("gen_length", "steps", "block_length"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"sampling.{name} must be a positive integer or null, got {v}")
        check(self.temperature >= 0, f"sampling.temperature must be >= 0, got {self.temperature}")


@dataclass
class GenerationOutput:
    sequences: torch.Tensor
    """(B, P + L) prompt and completion."""
    completion_ids: torch.Tensor
    """(B, L) completion tokens; PAD after the first EOS."""
    completion_mask: torch.Tensor
    """(B, L) bool, True up to and including the first EOS: the scored positions."""
    unmask_step: torch.Tensor
    """(B, L) the step (0-based, global over blocks) at which each slot was committed
    (or turned into PAD by an EOS before it); with the generator's seed and the
    sampling settings this replays the rollout."""
    forward_passes: int
    """Model calls made (each on the rows that still had masks)."""
    entropy: torch.Tensor
    """(B,) mean entropy (nats) of the model's distribution at each slot it committed,
    at the step it committed it (special tokens other than EOS excluded)."""


def _rows_topk(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, L) scores, (B,) counts -> (B, L) bool selecting each row's k[b] highest scores."""
    order = scores.argsort(dim=-1, descending=True)  # (B, L)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.size(-1), device=scores.device).expand_as(order))
    return rank < k[:, None]


@torch.no_grad()
def generate(
    policy: Policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    *,
    gen_length: int,
    steps: int | None = None,
    block_length: int | None = None,
    temperature: float = 0.0,
    remasking: Literal["low_confidence", "random"] = "low_confidence",
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """Generate `gen_length` tokens after each (left-padded) prompt.

    `steps` defaults to `gen_length` (one slot per step); `block_length` defaults to
    `gen_length` (one block). `generator` is required when sampling is random
    (temperature > 0 or random remasking).
    """
    B, P = prompt_ids.shape
    L = gen_length
    steps = L if steps is None else steps
    block_length = L if block_length is None else block_length
    if L < 1 or steps < 1 or block_length < 1:
        raise ValueError(f"gen_length, steps and block_length must be >= 1, got {L}, {steps}, {block_length}")
    num_blocks = math.ceil(L / block_length)
    if steps < num_blocks:
        raise ValueError(f"steps ({steps}) must be at least the number of blocks ({num_blocks})")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if generator is None and (temperature > 0 or remasking == "random"):
        raise ValueError("random sampling needs an explicit generator=torch.Generator().manual_seed(seed)")
    if policy.attention_kind != "full":
        raise NotImplementedError(f"this sampler is for full-attention models, not {policy.attention_kind!r}")
    device = prompt_ids.device
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)

    mask_id, eos_id, pad_id = policy.mask_token_id, policy.eos_token_id, policy.pad_token_id
    banned = sorted({mask_id, pad_id, *policy.tokenizer.all_special_ids} - {eos_id})
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=device)], dim=1)  # (B, P+L)
    attn = torch.cat([prompt_mask, torch.ones((B, L), dtype=prompt_mask.dtype, device=device)], dim=1)
    pos = position_ids(attn)  # (B, P+L)
    comp = x[:, P:]  # (B, L) view: writing it writes x, never the prompt
    unmask_step = torch.full((B, L), -1, dtype=torch.long, device=device)
    entropy_sum = torch.zeros(B, device=device)
    committed = torch.zeros(B, device=device)
    slot = torch.arange(L, device=device)
    # Steps per block: as even as possible, earlier blocks take the remainder.
    per_block = [steps // num_blocks + (b < steps % num_blocks) for b in range(num_blocks)]
    step = 0
    passes = 0
    for b in range(num_blocks):
        in_block = (slot >= b * block_length) & (slot < (b + 1) * block_length)  # (L,)
        for s in range(per_block[b]):
            eligible = (comp == mask_id) & in_block  # (B, L)
            active = eligible.any(dim=1).nonzero().squeeze(1)  # rows with work left in this block
            if active.numel() == 0:
                step += per_block[b] - s
                break
            logits = policy.logits(x[active], attn[active], pos[active])[:, P:].float()  # (A, L, V)
            passes += 1
            logits[..., banned] = -math.inf
            if temperature > 0:
                u = torch.rand(logits.shape, generator=generator, device=device, dtype=torch.float64)
                gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
                x0 = (logits.double() / temperature + gumbel).argmax(-1)  # (A, L)
            else:
                x0 = logits.argmax(-1)  # (A, L)
            if remasking == "low_confidence":
                score = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)  # (A, L) p(x0)
            else:
                score = torch.rand(x0.shape, generator=generator, device=device)
            elig = eligible[active]  # (A, L)
            score = score.masked_fill(~elig, -math.inf)
            left = per_block[b] - s
            k = (elig.sum(-1) + left - 1) // left  # ceil(masked / steps left), (A,)
            chosen = _rows_topk(score, k) & elig  # (A, L)
            logq = logits.log_softmax(-1)  # (A, L, V)
            ent = -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1)  # (A, L)
            entropy_sum[active] += (ent * chosen).sum(-1)
            committed[active] += chosen.sum(-1)
            rows = comp[active]
            rows = torch.where(chosen, x0, rows)
            # After the first EOS only PAD, whether those slots were decoded or not.
            after_eos = ~_completion_mask(rows, eos_id)  # (A, L)
            comp[active] = rows.masked_fill(after_eos, pad_id)
            stamped = unmask_step[active]  # (A, L); a slot keeps the step it was first filled at
            unmask_step[active] = torch.where((chosen | after_eos) & (stamped < 0), step, stamped)
            step += 1
    if (comp == mask_id).any():  # cannot happen with the ceil schedule; guard the invariant
        raise RuntimeError("generation left masks unfilled")
    return GenerationOutput(
        sequences=x,
        completion_ids=comp.clone(),
        completion_mask=_completion_mask(comp, eos_id),
        unmask_step=unmask_step,
        forward_passes=passes,
        entropy=entropy_sum / committed.clamp(min=1),
    )
