"""Workarounds for third-party code, in one place (STYLE.md, habit 1).

The real checkpoints ship their own modelling code (``trust_remote_code``), written against
the `transformers` of their day. pyproject.toml pins ``transformers>=4.56,<4.58``, the
versions under which LLaDA's and Dream's code loads, samples and back-propagates; this
module covers the rest:

- **SDAR / TraDo import ``LossKwargs``** (``from transformers.utils import LossKwargs``, a
  ``TypedDict`` of the loss keyword arguments that their ``KwargsForCausalLM`` extends).
  transformers renamed it ``TransformersKwargs`` in 4.56 and dropped the old name, so their
  file fails at import under every version LLaDA and Dream need. `install_remote_code_shims`
  puts a ``LossKwargs`` back into ``transformers.utils`` (only when it is missing) before a
  remote-code model is loaded. It is only ever read as a type annotation.
- **Dream's ``DreamGenerationConfig.validate(self, is_init=False)``** predates the ``strict``
  argument that ``GenerationConfig.save_pretrained`` passes (``validate(strict=True)``), so
  saving a Dream model raises ``TypeError``. `save_pretrained` saves the model with a plain
  ``GenerationConfig`` in its place and then writes Dream's own generation config to
  ``generation_config.json`` unvalidated (as it was loaded).
- **Activation checkpointing only in train mode.** transformers' layers
  (``GradientCheckpointingLayer.__call__``) and the remote code built like them (Dream's
  ``DreamBaseModel.forward``, SDAR's decoder layers) checkpoint only when ``self.training``
  and ``gradient_checkpointing`` are both set, while stabledrl's update runs in eval mode (no
  dropout; SDAR's ``forward`` in train mode is its own SFT loss). `checkpointing_in_eval_mode`
  marks the modules that gate it (those whose ``gradient_checkpointing`` is on) as training
  while a forward with gradients runs, and only them: their submodules, which hold the
  dropout and the attention's train-mode paths, stay in eval mode. The checkpointed
  function is the layer's own ``__call__``, so its recomputation in the backward is the same
  eval-mode computation. LLaDA's own hook (``set_activation_checkpointing``) needs none of
  this: it checkpoints in eval mode too.
- **transformers 5.x** breaks LLaDA's code (``all_tied_weights_keys``: its model class never
  calls ``post_init``; ``tie_weights(missing_keys=...)``: its override takes no arguments) and
  Dream's (``ROPE_INIT_FUNCTIONS["default"]`` is gone; ``validate(user_set_attributes=...)``).
  No shim makes those work; `check_remote_code_supported` turns the first error into one line
  that says which versions to install.

Nothing here runs at import time: `stabledrl.models.adapters` calls these functions.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path
from typing import Any, Optional, TypedDict

import torch
import transformers

__all__ = ["REMOTE_CODE_TRANSFORMERS", "install_remote_code_shims", "check_remote_code_supported", "save_pretrained",
           "checkpointing_in_eval_mode"]

REMOTE_CODE_TRANSFORMERS = ">=4.56,<4.58"
"""The transformers versions under which the real LLaDA, Dream and SDAR code runs (pyproject.toml)."""


class LossKwargs(TypedDict, total=False):
    """What transformers < 4.56 called the loss keyword arguments of a causal LM's forward."""

    num_items_in_batch: Optional[torch.Tensor]


def install_remote_code_shims() -> None:
    """Make names that published modelling files import available again (idempotent)."""
    import transformers.utils

    if not hasattr(transformers.utils, "LossKwargs"):
        transformers.utils.LossKwargs = LossKwargs


def _major(version: str) -> int:
    return int(version.split(".")[0])


def check_remote_code_supported(adapter: str) -> None:
    """A ValueError naming the versions to install when the installed transformers cannot run
    the remote code of `adapter` (llada, dream: known to fail under 5.x)."""
    if adapter in ("llada", "dream") and _major(transformers.__version__) >= 5:
        raise ValueError(f"the published {adapter} modelling code does not run under transformers "
                         f"{transformers.__version__}; install transformers{REMOTE_CODE_TRANSFORMERS} "
                         f"(pip install 'transformers{REMOTE_CODE_TRANSFORMERS}', as pyproject.toml pins)")


def _validate_takes_strict(generation_config: Any) -> bool:
    params = inspect.signature(type(generation_config).validate).parameters
    return "strict" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def save_pretrained(model: Any, path: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained(path, state_dict=state_dict)``, also for models whose generation
    config class predates ``validate(strict=...)`` (Dream): their generation config is written as is."""
    from transformers import GenerationConfig, PreTrainedModel

    gen = getattr(model, "generation_config", None) if isinstance(model, PreTrainedModel) else None
    if gen is None or _validate_takes_strict(gen):  # (a PEFT model saves its adapters only)
        model.save_pretrained(path, state_dict=state_dict)
        return
    model.generation_config = GenerationConfig()  # validates; overwritten below
    try:
        model.save_pretrained(path, state_dict=state_dict)
    finally:
        model.generation_config = gen
    # Dream's config keeps its own fields (steps, alg, mask_token_id ...): all of them, no diff.
    (Path(path) / "generation_config.json").write_text(json.dumps(gen.to_dict(), indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def checkpointing_in_eval_mode(model: torch.nn.Module):
    """While open, the modules of `model` that gate transformers' activation checkpointing
    (``gradient_checkpointing`` on) count as training, themselves only (module docstring)."""
    gates = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and not m.training]
    for m in gates:
        m.training = True  # the attribute alone: .train() would switch on its submodules' dropout
    try:
        yield
    finally:
        for m in gates:
            m.training = False
