"""LoRA through `peft` (Hu et al. 2021): low-rank adapters on a frozen policy.

`add_lora(policy, LoraSettings(...))` wraps ``policy.model`` in a `peft.PeftModel`; only
the adapter matrices train. `base_policy(policy)` is the same policy with the adapters
switched off (``PeftModel.disable_adapter``): the initial policy, for the KL reference
and the drift diagnostic, without a second copy of the weights in memory.
"""

from __future__ import annotations

from typing import Any

import torch

from stabledrl.settings import LoraSettings  # defined without torch, for the command line

__all__ = ["LoraSettings", "add_lora", "base_policy"]


def add_lora(policy: Any, settings: LoraSettings, *, seed: int = 0) -> Any:
    """Wrap `policy.model` with trainable LoRA adapters, in place; returns the policy.

    peft draws the A matrices from the global RNG; here they come from `seed` (B starts at
    zero, so the policy is unchanged), and the global RNG state is left as it was."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = settings.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy.model = get_peft_model(policy.model, config)
    return policy


class _AdaptersOff:
    """`policy` with its LoRA adapters disabled in every `logits` call."""

    def __init__(self, policy: Any) -> None:
        self._policy = policy

    def __getattr__(self, name: str) -> Any:  # mask ids, tokenizer, attention kind ...
        return getattr(self._policy, name)

    def logits(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        peft_model = getattr(self._policy.model, "module", self._policy.model)  # under DDP, the wrapped model
        with peft_model.disable_adapter():
            return self._policy.logits(*args, **kwargs)


def base_policy(policy: Any) -> Any:
    """The LoRA policy's base model (adapters off), sharing its weights."""
    if not hasattr(policy.model, "disable_adapter"):
        raise TypeError("base_policy needs a policy whose model has LoRA adapters (add_lora)")
    return _AdaptersOff(policy)
