"""What a policy adds to a task's raw text: its chat template and its stop tokens.

Both are properties of the policy, not of a loop, so that SFT, RL rollouts, evaluation and
`stabledrl sample` encode the same prompt text and end completions at the same tokens
(`stabledrl.data.encode_policy_prompts`, `decode_policy_completions`).

- Chat template: an instruct checkpoint (LLaDA-Instruct, Dream-Instruct, SDAR-Chat) was
  trained on prompts wrapped in its tokenizer's chat template (``tokenizer.chat_template``);
  the prompt then goes in as one user turn followed by the assistant's generation prompt.
  ``None`` (auto) wraps when the tokenizer has a template: the shipped tiny models have none,
  so their prompts are the raw text.
- Stop tokens: EOS, the EOS ids of the checkpoint's generation config, and any named in
  ``model.stop_tokens`` (by id, or by text that is one token, e.g. LLaDA-Instruct's
  ``<|eot_id|>``).
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase

__all__ = ["resolve_chat_template", "resolve_stop_tokens"]


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, setting: bool | None) -> bool:
    """Whether prompts are wrapped in the chat template: `setting`, or (None) whether the
    tokenizer has one. True for a tokenizer without one is a ValueError."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if setting is None:
        return has_template
    if setting and not has_template:
        raise ValueError("model.chat_template is on, but the tokenizer has no chat template; "
                         "set model.chat_template: auto or off")
    return bool(setting)


def resolve_stop_tokens(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int | str],
                        vocab_size: int) -> tuple[int, ...]:
    """The ids of `tokens`, each an id or the text of one token; a ValueError names one that
    is not a token of the tokenizer or lies outside the model's vocabulary."""
    ids = []
    for token in tokens:
        if isinstance(token, str):
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
                encoded = tokenizer.encode(token, add_special_tokens=False)  # plain text that is one token
                if len(encoded) != 1 or encoded[0] == tokenizer.unk_token_id:
                    raise ValueError(f"model.stop_tokens: {token!r} is not one token of the tokenizer "
                                     f"(it encodes to {encoded}); name a single token or give its id")
                tid = encoded[0]
        else:
            tid = token
        if not 0 <= tid < vocab_size:
            raise ValueError(f"model.stop_tokens: id {tid} is outside the model's vocabulary of {vocab_size}")
        ids.append(int(tid))
    return tuple(ids)
