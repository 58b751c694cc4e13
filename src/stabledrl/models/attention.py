"""Attention masks and position ids for block-diffusion models.

A block-diffusion model (BD3-LM, SDAR, TraDo) reads a sequence in blocks of S slots; a
block attends to the earlier blocks and to itself, never to later ones. This module builds
the boolean masks every block policy needs, in one place so that the sampler, the
likelihood and SFT agree:

- where the prompt's blocks fall, per model (``prompt_attention``: ``bidirectional``,
  ``sequence_blocks``, ``prompt_blocks``), and the block ids of [q ; y];
- the block-causal mask over [q ; y] (sampling, SFT);
- the staircase mask over [q ; y ; q̃ ; ỹ], which computes every block's denoising term in
  one forward pass, equal to separate block-causal passes over [q ; y_<b ; ỹ_b].

Masks are boolean (True: query i may attend to key j) and hide left-padding keys.
docs/methods.md, "Block attention masks", gives each layout and the published code of
SDAR and dLLM-RL it was read from; "Policy interface" how policies use them.

Shapes: B batch, P prompt columns, L completion slots, S block size, W prompt tail copies.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from stabledrl.data import position_ids

__all__ = [
    "PROMPT_ATTENTION",
    "PromptAttention",
    "check_prompt_attention",
    "prompt_attention_of",
    "block_slices",
    "block_causal_mask",
    "staircase_mask",
    "block_ids",
    "block_offset",
    "completion_blocks",
    "completion_block_slices",
    "tail_width",
    "block_causal_attention_mask",
    "staircase_attention_mask",
    "staircase_position_ids",
    "staircase_inputs",
]

PromptAttention = Literal["bidirectional", "sequence_blocks", "prompt_blocks"]
PROMPT_ATTENTION: tuple[str, ...] = ("bidirectional", "sequence_blocks", "prompt_blocks")
"""Where a block model's prompt blocks fall (module docstring)."""


def _check(prompt_len: int, completion_len: int, block_size: int) -> None:
    if prompt_len < 0 or completion_len < 0:
        raise ValueError(f"lengths must be >= 0, got prompt {prompt_len}, completion {completion_len}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def block_slices(completion_len: int, block_size: int) -> list[slice]:
    """The completion's blocks as slices: [0, S), [S, 2S), ...; the last is shorter when S does not divide L."""
    _check(0, completion_len, block_size)
    num_blocks = math.ceil(completion_len / block_size)
    return [slice(j * block_size, min(completion_len, (j + 1) * block_size)) for j in range(num_blocks)]


def _blocks(prompt_len: int, completion_len: int, block_size: int, device=None) -> torch.Tensor:
    """(P + L,) block index: 0 for the prompt, 1 + i // S for completion slot i."""
    comp = 1 + torch.arange(completion_len, device=device) // block_size
    return torch.cat([torch.zeros(prompt_len, dtype=torch.long, device=device), comp])


def block_causal_mask(prompt_len: int, completion_len: int, block_size: int, device=None) -> torch.Tensor:
    """(P+L, P+L) bool for [q ; y]: each block sees the prompt, earlier blocks and itself."""
    _check(prompt_len, completion_len, block_size)
    blk = _blocks(prompt_len, completion_len, block_size, device)  # (P+L,)
    return blk[None, :] <= blk[:, None]


def staircase_mask(prompt_len: int, completion_len: int, block_size: int, device=None) -> torch.Tensor:
    """(P+2L, P+2L) bool for [q ; y ; ỹ], as in the module docstring."""
    _check(prompt_len, completion_len, block_size)
    P, L = prompt_len, completion_len
    clean = block_causal_mask(P, L, block_size, device)  # (P+L, P+L): q and y rows
    blk = _blocks(P, L, block_size, device)[P:]  # (L,) completion block ids
    noisy_to_q = torch.ones((L, P), dtype=torch.bool, device=device)
    noisy_to_clean = blk[None, :] < blk[:, None]  # (L, L) strictly earlier blocks: the staircase
    noisy_to_noisy = blk[None, :] == blk[:, None]  # (L, L) its own block
    top = torch.cat([clean, torch.zeros((P + L, L), dtype=torch.bool, device=device)], dim=1)
    bottom = torch.cat([noisy_to_q, noisy_to_clean, noisy_to_noisy], dim=1)
    return torch.cat([top, bottom], dim=0)


def check_prompt_attention(prompt_attention: str) -> None:
    """A ValueError unless `prompt_attention` is one of `PROMPT_ATTENTION`."""
    if prompt_attention not in PROMPT_ATTENTION:
        raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, got {prompt_attention!r}")


def prompt_attention_of(policy) -> str:
    """Where a block policy's prompt blocks fall; ``bidirectional`` for a policy that does not say."""
    return getattr(policy, "prompt_attention", "bidirectional")


def block_ids(
    prompt_mask: torch.Tensor, completion_len: int, block_size: int, prompt_attention: PromptAttention = "bidirectional"
) -> torch.Tensor:
    """(B, P+L) the block of every column of [q ; y], comparable within a row: a query may
    attend to a real key of a block not after its own. Padding columns get some prompt
    block; they are hidden as keys and never read."""
    B, P = prompt_mask.shape
    L, S, device = completion_len, block_size, prompt_mask.device
    _check(P, L, S)
    check_prompt_attention(prompt_attention)
    if prompt_attention == "bidirectional":
        return _blocks(P, L, S, device)[None].expand(B, P + L)  # 0 for the prompt, 1 + i // S after
    ones = torch.ones((B, L), dtype=prompt_mask.dtype, device=device)
    pos = position_ids(torch.cat([prompt_mask, ones], dim=1))  # (B, P+L) counted over real tokens
    if prompt_attention == "sequence_blocks":
        return pos // S  # blocks of S from the first real token, across the prompt's end
    # prompt_blocks: the prompt's blocks end at its end (-1 for its last S tokens, ...), then 0, 1, ...
    n = prompt_mask.long().sum(1, keepdim=True)  # (B, 1) real prompt tokens
    prompt = torch.div(pos[:, :P] - n, S, rounding_mode="floor")  # (B, P)
    return torch.cat([prompt, (torch.arange(L, device=device) // S).expand(B, L)], dim=1)


def block_offset(prompt_mask: torch.Tensor, block_size: int, prompt_attention: PromptAttention) -> torch.Tensor:
    """(B,) long: the prompt tokens in each row's first completion block (its real prompt
    length mod S under ``sequence_blocks``; 0 otherwise)."""
    check_prompt_attention(prompt_attention)
    n = prompt_mask.long().sum(1)  # (B,)
    return n % block_size if prompt_attention == "sequence_blocks" else torch.zeros_like(n)


def completion_blocks(offset: torch.Tensor, completion_len: int, block_size: int) -> torch.Tensor:
    """(B, L) the completion block (0, 1, ... per row) of each slot, given the (B,) `block_offset`."""
    slot = torch.arange(completion_len, device=offset.device)
    return torch.div(offset[:, None] + slot, block_size, rounding_mode="floor")


def completion_block_slices(offset: int, completion_len: int, block_size: int) -> list[slice]:
    """One row's completion blocks as slices: [0, S − offset), then S at a time, the last cut at L."""
    _check(0, completion_len, block_size)
    if not 0 <= offset < block_size:
        raise ValueError(f"a block offset is in [0, {block_size}), got {offset}")
    ends = list(range(block_size - offset, completion_len, block_size)) + [completion_len]
    starts = [0] + ends[:-1]
    return [slice(a, b) for a, b in zip(starts, ends) if b > a]


def tail_width(prompt_len: int, block_size: int, prompt_attention: PromptAttention) -> int:
    """W, the prompt columns copied into the staircase's noisy stream: min(P, S − 1) under
    ``sequence_blocks`` (a row's tail sharing the first completion block is shorter than S), else 0."""
    check_prompt_attention(prompt_attention)
    return min(prompt_len, block_size - 1) if prompt_attention == "sequence_blocks" else 0


def _real_keys(prompt_mask: torch.Tensor, completion_len: int) -> torch.Tensor:
    """(B, P+L) bool: the columns of [q ; y] that are tokens, not left padding."""
    B = prompt_mask.size(0)
    ones = torch.ones((B, completion_len), dtype=torch.bool, device=prompt_mask.device)
    return torch.cat([prompt_mask.bool(), ones], dim=1)


def block_causal_attention_mask(
    prompt_mask: torch.Tensor, completion_len: int, block_size: int, prompt_attention: PromptAttention = "bidirectional"
) -> torch.Tensor:
    """(B, P+L, P+L) block-causal mask of [q ; y] for left-padded prompts (padding keys hidden)."""
    blk = block_ids(prompt_mask, completion_len, block_size, prompt_attention)  # (B, P+L)
    keys = _real_keys(prompt_mask, completion_len)  # (B, P+L)
    return (blk[:, None, :] <= blk[:, :, None]) & keys[:, None, :]


def staircase_attention_mask(
    prompt_mask: torch.Tensor, completion_len: int, block_size: int, prompt_attention: PromptAttention = "bidirectional"
) -> torch.Tensor:
    """(B, T, T) staircase mask of [q ; y ; q̃ ; ỹ] (T = P + 2L + W, module docstring) for
    left-padded prompts (padding keys hidden)."""
    P, L = prompt_mask.size(1), completion_len
    W = tail_width(P, block_size, prompt_attention)
    blk = block_ids(prompt_mask, L, block_size, prompt_attention)  # (B, P+L) clean columns
    keys = _real_keys(prompt_mask, L)  # (B, P+L)
    first = blk[:, P : P + 1] if L else torch.full_like(blk[:, :1], P + 1)  # (B, 1) the first completion block
    live_tail = keys[:, P - W : P] & (blk[:, P - W : P] == first)  # (B, W) copies in the first block's noisy view
    noisy_blk = torch.cat([blk[:, P - W : P], blk[:, P:]], dim=1)  # (B, W+L)
    noisy = torch.cat([live_tail, torch.ones_like(blk[:, P:], dtype=torch.bool)], dim=1)  # (B, W+L) non-inert
    clean_to_clean = (blk[:, None, :] <= blk[:, :, None]) & keys[:, None, :]  # (B, P+L, P+L)
    clean_to_noisy = torch.zeros(clean_to_clean.shape[:2] + (W + L,), dtype=torch.bool, device=blk.device)
    noisy_to_clean = (blk[:, None, :] < noisy_blk[:, :, None]) & keys[:, None, :] & noisy[:, :, None]  # the staircase
    noisy_to_noisy = (noisy_blk[:, None, :] == noisy_blk[:, :, None]) & noisy[:, None, :] & noisy[:, :, None]
    top = torch.cat([clean_to_clean, clean_to_noisy], dim=2)  # (B, P+L, T)
    bottom = torch.cat([noisy_to_clean, noisy_to_noisy], dim=2)  # (B, W+L, T)
    return torch.cat([top, bottom], dim=1)


def staircase_position_ids(
    prompt_mask: torch.Tensor, completion_len: int, block_size: int | None = None,
    prompt_attention: PromptAttention = "bidirectional",
) -> torch.Tensor:
    """(B, T) positions of [q ; y ; q̃ ; ỹ]: counted over real prompt tokens, each copy's
    equal to what it copies (`block_size` is needed only under ``sequence_blocks``)."""
    B, P = prompt_mask.shape
    W = 0 if prompt_attention == "bidirectional" else tail_width(P, block_size, prompt_attention)
    ones = torch.ones((B, completion_len), dtype=prompt_mask.dtype, device=prompt_mask.device)
    pos = position_ids(torch.cat([prompt_mask, ones], dim=1))  # (B, P+L)
    return torch.cat([pos, pos[:, P - W : P], pos[:, P:]], dim=1)


def staircase_inputs(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, noisy_ids: torch.Tensor,
    block_size: int, prompt_attention: PromptAttention = "bidirectional",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one staircase pass for (B, L) clean `completion_ids` and their noised copy
    `noisy_ids`: input ids [q ; y ; q̃ ; ỹ] (B, T), the mask (B, T, T) and position ids
    (B, T). The logits of ỹ are the last L columns."""
    P, L = prompt_ids.size(1), completion_ids.size(1)
    W = tail_width(P, block_size, prompt_attention)
    ids = torch.cat([prompt_ids, completion_ids, prompt_ids[:, P - W :], noisy_ids], dim=1)  # (B, T)
    mask = staircase_attention_mask(prompt_mask, L, block_size, prompt_attention)
    return ids, mask, staircase_position_ids(prompt_mask, L, block_size, prompt_attention)
