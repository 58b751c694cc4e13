"""Turning problems into tensors and completions back into text.

Layout of every sequence: ``[PAD .. PAD, BOS, prompt ; completion]`` (no BOS when the
tokenizer has none, as SDAR's and other Qwen-family tokenizers). Prompts are
left-padded (attention mask 0 on padding) so that all completions start at the same
column P. A completion is the answer, one EOS, then PAD up to its fixed length L; the
*scored* positions (``completion_mask``) are those up to and including the first stop token.
One convention holds in SFT targets, the sampler and the likelihood: PAD fills the slots
after a completion's end and PAD is itself a stop token (`completion_stop_ids`), so the
sampler bans (`banned_token_ids`) nothing that SFT targets contain (docs/decoding.md).

With a chat template (an instruct checkpoint's tokenizer), the prompt text is the template
applied to one user turn holding the prompt, with the assistant's generation prompt after
it; the template writes its own special tokens (LLaDA's starts with BOS), so no BOS is
added. The loops encode and decode through the policy (`encode_policy_prompts`,
`decode_policy_completions`), so SFT, RL and evaluation see the same prompt text and cut
completions at the same stop tokens.

Shapes: B batch, P prompt columns, L completion length.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

__all__ = ["encode_prompts", "encode_policy_prompts", "encode_completions", "completion_mask", "decode_completions",
           "decode_policy_completions", "chat_prompt", "position_ids", "completion_stop_ids", "stop_ids_of",
           "banned_token_ids"]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """`prompt` as one user turn of the tokenizer's chat template, followed by the assistant's
    generation prompt: the text an instruct checkpoint was trained to answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *, strict: bool = False,
                   chat_template: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (B, P) and their attention mask (B, P).

    `chat_template`: wrap each prompt with `chat_prompt` (the template writes its own special
    tokens); None: when the tokenizer has a template. Without one: BOS (if the tokenizer has
    one), then the prompt's tokens.
    `strict`: a ValueError naming the characters of a prompt the tokenizer does not know (else
    they become UNK, which a model never saw: its completion answers another prompt)."""
    if not prompts:
        raise ValueError("no prompts to encode")
    if chat_template is None:
        chat_template = bool(getattr(tokenizer, "chat_template", None))
    if strict:
        for p in prompts:
            _strict_encode(tokenizer, p, "prompt")
    if chat_template:
        rows = [tokenizer.encode(chat_prompt(tokenizer, p), add_special_tokens=False) for p in prompts]
    else:
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        rows = [bos + tokenizer.encode(p, add_special_tokens=False) for p in prompts]
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


def completion_stop_ids(tokenizer: PreTrainedTokenizerBase, named: Sequence[int]) -> tuple[int, ...]:
    """The tokens that end a completion: `named` (EOS first), then PAD. SFT targets put PAD
    after the answer's EOS, so a model learns to predict PAD where a completion is over; were
    PAD not a stop token the sampler would have to ban it, and the model's answer would have to
    fit around the slots it is surest are PAD (docs/decoding.md). LLaDA, Dream and SDAR pad with
    EOS, for which this adds nothing."""
    return tuple(dict.fromkeys((*map(int, named), int(tokenizer.pad_token_id))))


def stop_ids_of(policy) -> tuple[int, ...]:
    """``policy.stop_token_ids``; for a policy that names none, EOS and PAD."""
    named = getattr(policy, "stop_token_ids", None)
    return tuple(named) if named is not None else completion_stop_ids(policy.tokenizer, (policy.eos_token_id,))


def banned_token_ids(policy) -> list[int]:
    """The tokens the sampler never draws and the likelihood refuses to score: MASK and the
    tokenizer's special tokens, less the policy's stop tokens (EOS and PAD among them)."""
    return sorted({policy.mask_token_id, *policy.tokenizer.all_special_ids} - set(stop_ids_of(policy)))


def decode_completions(tokenizer: PreTrainedTokenizerBase, completion_ids: torch.Tensor,
                       stop_token_ids: int | Sequence[int] | None = None) -> list[str]:
    """Text of each completion up to (not including) its first stop token, specials dropped.
    `stop_token_ids`: the tokens that end a completion; None: EOS and PAD."""
    stops = (completion_stop_ids(tokenizer, [tokenizer.eos_token_id]) if stop_token_ids is None else
             [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids))
    is_stop = torch.isin(completion_ids, torch.as_tensor(stops, device=completion_ids.device))  # (B, L)
    keep = completion_mask(completion_ids, stops) & ~is_stop  # (B, L)
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(completion_ids, keep)
    ]


def encode_policy_prompts(policy, prompts: Sequence[str], *, strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode_prompts` with the policy's tokenizer and its chat-template setting (``policy.chat_template``;
    a policy without one: the tokenizer's template if it has one)."""
    chat_template = getattr(policy, "chat_template", None)
    return encode_prompts(policy.tokenizer, prompts, strict=strict, chat_template=chat_template)


def keep_last_tokens(ids: torch.Tensor, mask: torch.Tensor, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) prompt ids and mask cut to each prompt's last `n` tokens, as TRL cuts
    them (`max_prompt_length`); None: as they are."""
    return (ids, mask) if n is None else (ids[:, -n:], mask[:, -n:])


def decode_policy_completions(policy, completion_ids: torch.Tensor) -> list[str]:
    """`decode_completions` cut at the policy's stop tokens (`stop_ids_of`)."""
    return decode_completions(policy.tokenizer, completion_ids, stop_ids_of(policy))
