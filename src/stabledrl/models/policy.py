"""The policy interface every estimator, sampler and trainer talks to (SPEC §5).

A policy gives logits for a batch of (possibly noised) token sequences, with
``logits[:, i]`` predicting token ``i``; knows its mask token (required, never guessed);
and says which attention it uses: ``full`` (LLaDA, Dream, MDLM) or ``block`` with a block
size (SDAR, BD3-LM). Adapters for real checkpoints implement the same protocol.

A block policy takes a boolean (B, T, T) mask (`stabledrl.models.attention`). One that can
cache keys and values also has ``new_cache()`` and accepts ``cache=`` and
``extend_cache=`` in `logits`; the block sampler uses them when present.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from stabledrl.models.tiny import KVCache, TinyDiffusionLM

__all__ = ["Policy", "TinyPolicy", "load_policy"]


@runtime_checkable
class Policy(Protocol):
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    mask_token_id: int
    pad_token_id: int
    eos_token_id: int
    attention_kind: Literal["full", "block"]
    block_size: int | None

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, V) logits; logits[:, i] predicts token i."""
        ...


@dataclass
class TinyPolicy:
    """`TinyDiffusionLM` (or any model whose logits are unshifted) behind the interface."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    def __post_init__(self) -> None:
        cfg = self.model.config
        mask_id = getattr(cfg, "mask_token_id", None)
        if mask_id is None:
            mask_id = self.tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError("the model config and the tokenizer both lack mask_token_id; set one")
        if mask_id == self.tokenizer.pad_token_id:
            raise ValueError(f"mask_token_id {mask_id} equals pad_token_id: they must differ")
        if self.tokenizer.eos_token_id is None or self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs both an EOS and a PAD token")
        self.mask_token_id = int(mask_id)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.attention_kind = getattr(cfg, "attention_kind", "full")
        self.block_size = getattr(cfg, "block_size", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        extend_cache: bool = False,
    ) -> torch.Tensor:
        """Logits of `input_ids`; with `cache`, the new tokens also attend to the cached
        ones (the mask's first columns), and `extend_cache` appends them to it."""
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, extend_cache=extend_cache,
        ).logits

    def new_cache(self) -> KVCache:
        return KVCache()

    def save(self, path: str | Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def load_policy(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> TinyPolicy:
    """Load a policy saved by `stabledrl sft` (a tiny model and its tokenizer)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a saved model directory (no config.json)")
    model = TinyDiffusionLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return TinyPolicy(model, tokenizer)
