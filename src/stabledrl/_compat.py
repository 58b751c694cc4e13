"""Workarounds for third-party code, in one place (STYLE.md, habit 1).

The real checkpoints ship their own modelling code (``trust_remote_code``), written against
the `transformers` of their day; stabledrl runs its own code of LLaDA, Dream and SDAR by
default (`stabledrl.models.native`), and this module covers what the published files need
when a user asks for them:

- `install_remote_code_shims`: a ``LossKwargs`` for SDAR / TraDo, and a pure-torch
  ``flash_attn`` where flash-attn is not installed;
- `save_pretrained`: saves Dream, whose generation config predates ``validate(strict=...)``;
- `checkpointing_in_eval_mode`: activation checkpointing in the eval-mode RL update, which
  transformers' layers only do in train mode;
- `fit_no_split_modules`, `gathered_parameters`, `weights_loaded_here`, `sharded_at_prepare`:
  FSDP's layer wrap, DeepSpeed ZeRO-3's partitioned load and FSDP's RAM-efficient load;
- `check_remote_code_supported`: one clear line where transformers 5.x breaks the published code.

docs/scale-out.md, "Workarounds for third-party code", says what each works around and why.
Nothing here runs at import time: `stabledrl.models.adapters` calls these functions.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any, Optional, TypedDict

import torch
import transformers

__all__ = ["REMOTE_CODE_TRANSFORMERS", "install_remote_code_shims", "check_remote_code_supported", "save_pretrained",
           "checkpointing_in_eval_mode", "fit_no_split_modules", "flash_attn_func", "rms_norm_fn",
           "gathered_parameters", "weights_loaded_here", "sharded_at_prepare", "SHARDING_CLASSES"]

REMOTE_CODE_TRANSFORMERS = ">=4.56,<4.58"
"""The transformers versions under which the published LLaDA, Dream and SDAR code runs."""

SHARDING_CLASSES = frozenset({"FSDPModule", "FullyShardedDataParallel", "DeepSpeedEngine"})
"""Class names of the wrappers (FSDP2, FSDP1, DeepSpeed) whose forward gathers sharded weights:
every call a collective, run by Python hooks."""


class LossKwargs(TypedDict, total=False):
    """What transformers < 4.56 called the loss keyword arguments of a causal LM's forward."""

    num_items_in_batch: Optional[torch.Tensor]


def install_remote_code_shims() -> None:
    """Make names that published modelling files import available again (idempotent)."""
    import transformers.utils

    if not hasattr(transformers.utils, "LossKwargs"):
        transformers.utils.LossKwargs = LossKwargs
    if importlib.util.find_spec("flash_attn") is None:
        _install_flash_attn_fallback()


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False, **unsupported: Any) -> torch.Tensor:
    """flash-attn's ``flash_attn_func`` in torch: (B, T, H, Dh) queries, (B, S, Hkv, Dh) keys
    and values (grouped-query heads repeated), output (B, T, H, Dh). A causal mask aligns the
    last query with the last key, as flash-attn's does."""
    if not all(map(_is_default, unsupported.values())):
        raise NotImplementedError(f"the torch stand-in for flash_attn_func takes no {sorted(unsupported)}; "
                                  "install flash-attn (pip install 'stabledrl[gpu]')")
    if k.shape[2] != q.shape[2]:  # grouped-query heads, repeated (SDPA's enable_gqa needs torch >= 2.5)
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
    T, S = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, S)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale)
    return out.transpose(1, 2)


def rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, eps: float = 1e-6, prenorm: bool = False,
                residual_in_fp32: bool = False, **unsupported: Any):
    """flash-attn's Triton ``rms_norm_fn`` in torch: RMS-normalise, scale by `weight` and add
    `bias` in float32, return in x's dtype (as its kernel does); with `residual`, normalise
    x + residual, and with `prenorm` also return that sum."""
    if not all(map(_is_default, unsupported.values())):
        raise NotImplementedError(f"the torch stand-in for rms_norm_fn takes no {sorted(unsupported)}; "
                                  "install flash-attn (pip install 'stabledrl[gpu]')")
    dtype = x.dtype
    if residual is not None:
        x = x.float() + residual.float() if residual_in_fp32 else x + residual
    wide = torch.promote_types(x.dtype, torch.float32)
    h = x.to(wide)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(wide)
    y = (y if bias is None else y + bias.to(wide)).to(dtype)
    return (y, x.to(torch.float32 if residual_in_fp32 else dtype)) if prenorm else y


def _is_default(value: Any) -> bool:
    """An argument of flash-attn's functions left at a value the torch stand-ins also mean."""
    return value is None or value is False or (isinstance(value, (tuple, int, float)) and value in ((-1, -1), 0, 0.0))


def _missing(name: str):
    def call(*args: Any, **kwargs: Any):
        raise NotImplementedError(f"flash_attn.{name} has no torch stand-in; install flash-attn "
                                  "(pip install 'stabledrl[gpu]')")
    return call


def _install_flash_attn_fallback() -> None:
    """Register a ``flash_attn`` package (and the submodules SDAR imports) backed by the torch
    functions above. It carries a module spec, so `importlib.util.find_spec` finds it, while
    transformers' availability check (which reads the installed distribution) still says no."""
    names = {"flash_attn": {"flash_attn_func": flash_attn_func,
                            "flash_attn_varlen_func": _missing("flash_attn_varlen_func")},
             "flash_attn.bert_padding": {n: _missing(n) for n in ("index_first_axis", "pad_input", "unpad_input")},
             "flash_attn.ops": {}, "flash_attn.ops.triton": {},
             "flash_attn.ops.triton.layer_norm": {"rms_norm_fn": rms_norm_fn}}
    for name, attrs in names.items():
        module = types.ModuleType(name, "stabledrl's torch stand-in (stabledrl._compat); flash-attn is not installed")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def sharded_at_prepare() -> bool:
    """True where accelerate's FSDP loads the model RAM-efficiently (``fsdp_cpu_ram_efficient_loading``,
    configs/accelerate/fsdp.yaml): the loaded model must stay on the CPU, where `prepare` moves it to the
    meta device, shards it and sends each process its shards, so that no GPU ever holds the whole model."""
    from transformers.integrations.fsdp import is_fsdp_enabled

    return is_fsdp_enabled()


def weights_loaded_here() -> bool:
    """False on the processes to which transformers gave uninitialised weights, for FSDP to
    broadcast the first process's at `prepare` (``fsdp_cpu_ram_efficient_loading``, as in
    configs/accelerate/fsdp.yaml): only local rank 0 reads the checkpoint then."""
    from transformers.integrations.fsdp import is_fsdp_enabled
    from transformers.modeling_utils import is_local_dist_rank_0

    return not (is_fsdp_enabled() and not is_local_dist_rank_0())


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module):
    """While open, a model loaded under DeepSpeed ZeRO-3's ``zero.Init`` (its parameters
    partitioned, empty on each process) holds its full parameters, for a forward outside the
    engine (the load-time attention probe); any other model is left as it is."""
    params = [p for p in model.parameters() if hasattr(p, "ds_numel")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


def fit_no_split_modules(model: torch.nn.Module) -> list[str] | None:
    """Reduce ``model._no_split_modules`` to the listed classes that `model` contains, so that
    accelerate's transformer-layer wrap (which raises on a listed class it cannot find) wraps
    what there is. Returns the new list; None (nothing changed) for a model that lists none.
    A list none of whose classes is present is an error naming them."""
    listed = getattr(model, "_no_split_modules", None)
    if not listed:
        return None
    present = {type(m).__name__ for m in model.modules()}
    kept = [name for name in listed if name in present]
    if not kept:
        raise ValueError(f"{type(model).__name__} lists _no_split_modules {list(listed)}, none of which it "
                         "contains: FSDP could not wrap its layers")
    model._no_split_modules = kept  # an instance attribute: the class's list stays as published
    return kept


def _major(version: str) -> int:
    return int(version.split(".")[0])


def check_remote_code_supported(family: str) -> None:
    """A ValueError naming what to do when the installed transformers cannot run the published
    code of `family` (llada, dream, sdar: a model_type, lowercased; each fails under 5.x)."""
    if family in ("llada", "dream", "sdar") and _major(transformers.__version__) >= 5:
        raise ValueError(f"the published {family} modelling code does not run under transformers "
                         f"{transformers.__version__}: drop model.trust_remote_code to run stabledrl's own {family} "
                         f"code, or install 'transformers{REMOTE_CODE_TRANSFORMERS}'")


def _validate_takes_strict(generation_config: Any) -> bool:
    params = inspect.signature(type(generation_config).validate).parameters
    return "strict" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


MAX_SHARD_SIZE = "5GB"
"""Safetensors files of at most this size, as the Hub's checkpoints are split (transformers 5 writes 50 GB)."""


def save_pretrained(model: Any, path: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained(path, state_dict=state_dict)``, also for models whose generation
    config class predates ``validate(strict=...)`` (Dream): their generation config is written as is."""
    from transformers import GenerationConfig, PreTrainedModel

    gen = getattr(model, "generation_config", None) if isinstance(model, PreTrainedModel) else None
    shards = {"max_shard_size": MAX_SHARD_SIZE} if isinstance(model, PreTrainedModel) else {}
    if gen is None or _validate_takes_strict(gen):  # (a PEFT model saves its adapters only)
        model.save_pretrained(path, state_dict=state_dict, **shards)
        return
    model.generation_config = GenerationConfig()  # validates; overwritten below
    try:
        model.save_pretrained(path, state_dict=state_dict, **shards)
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
