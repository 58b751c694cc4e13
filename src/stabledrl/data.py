"""Turning problems into tensors and completions back into text.

Layout of every sequence: ``[PAD .. PAD, BOS, prompt ; completion]`` (no BOS when the
tokenizer has none, as SDAR's and other Qwen-family tokenizers). Prompts are
left-padded (attention mask 0 on padding) so that all completions start at the same
column P. A completion is the answer, one EOS, then PAD up to its fixed length L; the
*scored* positions (``completion_mask``) are those up to and including the first EOS (or
the first of several stop tokens, `stabledrl.models.HFPolicy.stop_token_ids`).

Shapes: B batch, P prompt columns, L completion length.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

__all__ = ["encode_prompts", "encode_completions", "completion_mask", "decode_completions", "position_ids"]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *,
                   strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (B, P) with BOS first (if the tokenizer has one), and their attention mask (B, P).
    `strict`: a ValueError naming the characters the tokenizer does not know (else they
    become UNK, which a model never saw: its completion answers another prompt)."""
    if not prompts:
        raise ValueError("no prompts to encode")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    rows = [bos + (_strict_encode(tokenizer, p, "prompt") if strict else tokenizer.encode(p, add_special_tokens=False))
            for p in prompts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def encode_completions(tokenizer: PreTrainedTokenizerBase, answers: Sequence[str], length: int) -> torch.Tensor:
    """Completion ids (B, L): answer, EOS, then PAD. Raises if an answer does not fit."""
    ids = torch.full((len(answers), length), tokenizer.pad_token_id, dtype=torch.long)
    for i, a in enumerate(answers):
        r = tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(r) > length:
            raise ValueError(f"answer {a!r} needs {len(r)} slots with EOS; completion length is {length}")
        ids[i, : len(r)] = torch.tensor(r)
    return ids


def _strict_encode(tokenizer: PreTrainedTokenizerBase, text: str, what: str) -> list[int]:
    """Token ids of `text`; a ValueError naming the characters that would become UNK."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        bad = [c for c in dict.fromkeys(text) if unk in tokenizer.encode(c, add_special_tokens=False)]
        raise ValueError(f"{what} {text!r} has characters the tokenizer does not know: "
                         f"{', '.join(map(repr, bad)) or '(a sequence of them)'}; write it with the task's characters")
    return ids


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted over real tokens, so left padding shifts nothing."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """(B, L) bool: True up to and including the first EOS (everything if there is none).
    Several ids: the first of any of them ends the completion."""
    stops = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                            device=completion_ids.device)
    is_eos = torch.isin(completion_ids, stops)  # (B, L)
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()  # EOS strictly before each slot
    return eos_before == 0


def decode_completions(tokenizer: PreTrainedTokenizerBase, completion_ids: torch.Tensor) -> list[str]:
    """Text of each completion up to (not including) its first EOS, specials dropped."""
    keep = completion_mask(completion_ids, tokenizer.eos_token_id) & (completion_ids != tokenizer.eos_token_id)
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(completion_ids, keep)
    ]
