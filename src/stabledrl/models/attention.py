"""Attention masks for block-diffusion models (docs/methods.md, "Policy interface").

A block-diffusion model (BD3-LM, Arriola et al. 2025; SDAR; TraDo) reads the prompt as
one bidirectional prefix and the completion in blocks of S slots: a block attends to the
prompt, to the earlier blocks and to itself (bidirectionally), never to later blocks.

**Staircase attention** computes every block's denoising term in one forward pass over
[q ; y ; ỹ] (length P + 2L): y the clean completion, ỹ its noised copy, ỹ's position ids
equal to y's. Allowed attention (True where query i may attend to key j):

    q          → q
    clean b    → q, clean blocks ≤ b
    noisy b    → q, clean blocks < b, noisy block b

The noisy-to-clean part is strictly block-lower-triangular: the staircase. Logits read
at ỹ_b equal those of a separate pass over [q ; y_<b ; ỹ_b] with the block-causal mask.

Masks are boolean; the batched helpers also hide left-padding keys. Blocks are counted
from the first completion slot, so they do not depend on the prompt length; the last
block is shorter when S does not divide L.

Shapes: B batch, P prompt columns, L completion slots, S block size.
"""

from __future__ import annotations

import math

import torch

from stabledrl.data import position_ids

__all__ = [
    "block_slices",
    "block_causal_mask",
    "staircase_mask",
    "block_causal_attention_mask",
    "staircase_attention_mask",
    "staircase_position_ids",
]


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


def _key_padding(mask: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """(T, T) mask, (B, P) prompt mask -> (B, T, T) with padding keys hidden."""
    B, P = prompt_mask.shape
    T = mask.size(0)
    keys = torch.cat([prompt_mask.bool(), torch.ones((B, T - P), dtype=torch.bool, device=prompt_mask.device)], 1)
    return mask[None] & keys[:, None, :]


def block_causal_attention_mask(prompt_mask: torch.Tensor, completion_len: int, block_size: int) -> torch.Tensor:
    """(B, P+L, P+L) block-causal mask for left-padded prompts (padding keys hidden)."""
    mask = block_causal_mask(prompt_mask.size(1), completion_len, block_size, prompt_mask.device)
    return _key_padding(mask, prompt_mask)


def staircase_attention_mask(prompt_mask: torch.Tensor, completion_len: int, block_size: int) -> torch.Tensor:
    """(B, P+2L, P+2L) staircase mask for left-padded prompts (padding keys hidden)."""
    mask = staircase_mask(prompt_mask.size(1), completion_len, block_size, prompt_mask.device)
    return _key_padding(mask, prompt_mask)


def staircase_position_ids(prompt_mask: torch.Tensor, completion_len: int) -> torch.Tensor:
    """(B, P+2L) positions of [q ; y ; ỹ]: counted over real prompt tokens, ỹ's equal y's."""
    B = prompt_mask.size(0)
    ones = torch.ones((B, completion_len), dtype=prompt_mask.dtype, device=prompt_mask.device)
    pos = position_ids(torch.cat([prompt_mask, ones], dim=1))  # (B, P+L)
    return torch.cat([pos, pos[:, prompt_mask.size(1):]], dim=1)
