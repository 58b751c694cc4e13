"""LoRA through `peft` (Hu et al. 2021): low-rank adapters on a frozen policy.

`add_lora(policy, LoraSettings(...))` wraps ``policy.model`` in a `peft.PeftModel`; only
the adapter matrices train. `base_policy(policy)` is the same policy with the adapters
switched off (``PeftModel.disable_adapter``): the initial policy, for the KL reference
and the drift diagnostic, without a second copy of the weights in memory.

`lean_adapters(model)` is what the sampler runs under: peft's LoRA layers take a short
forward, their adapters cast once to the compute dtype, with the same result to the bit as
peft's own (docs/scale-out.md, "LoRA rollouts").
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from stabledrl.settings import LoraSettings  # defined without torch, for the command line

__all__ = ["LoraSettings", "add_lora", "base_policy", "lean_adapters"]


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


@contextmanager
def lean_adapters(model: torch.nn.Module) -> Iterator[int]:
    """Within it, each of `model`'s peft LoRA linear layers (plain LoRA: one active adapter, no
    bias or variant such as DoRA, no dropout drawing) runs, in calls without gradients,
    ``base(x) + B(A(x))·scaling`` with A and B cast once to the compute dtype (autocast's where
    it is on, else peft's casting of x to the adapters' dtype), instead of peft's forward: the
    same values to the bit, with fewer kernels and less Python a call (under bf16 autocast peft
    casts x to float32 and back and both adapter matrices to bf16 in every call). Where the
    scaling (alpha / r) is a power of two, the scaling and the sum are one kernel: the product
    by it is then exact, so one rounding after the sum is peft's two (but for values in the
    subnormal range, below 1e-38). Yields the number of layers given the short forward.

    A call with gradients, adapters switched off (`base_policy`) or merged, or other arguments
    keeps peft's forward; so does a layer whose adapter or base modules carry hooks or wrappers
    of their own (DeepSpeed ZeRO-3 and offloading gather weights in them; an FSDP unit per
    adapter), or whose output a hook could keep (the short forward adds to the base's output in
    place). Under FSDP units of whole blocks (the shipped configs) the casts are made inside the
    first forward, from the gathered weights. The casts are dropped on leaving; the weights must
    not change within it (a rollout)."""
    layers = _plain_lora_layers(model)
    for layer, name in layers:
        layer.forward = _LeanForward(layer, name)
    try:
        yield len(layers)
    finally:
        for layer, _ in layers:
            del layer.forward  # back to the class's


_AUTOCASTS = {torch.float32, torch.bfloat16, torch.float16}  # the dtypes autocast casts


def _plain_lora_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(layer, its one adapter's name) for each peft `lora.Linear` the short forward serves."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # no peft: no adapters
        return []
    found = []
    for module in model.modules():
        if type(module) is not LoraLinear or "forward" in vars(module):  # a subclass, or already lean
            continue
        names = [n for n in module.active_adapters if n in module.lora_A]
        if len(names) != 1:
            continue
        name = names[0]
        A, B = module.lora_A[name], module.lora_B[name]
        hooked = any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in (A, B, module.base_layer))
        wrapped = type(A) is not torch.nn.Linear or type(B) is not torch.nn.Linear  # FSDP units of their own
        if (name in module.lora_variant or A.bias is not None or B.bias is not None or hooked or wrapped
                or any(hasattr(w, "ds_id") for w in (A.weight, B.weight))  # DoRA & co, lora_bias, ZeRO-3, offload
                or not {A.weight.dtype, B.weight.dtype} <= _AUTOCASTS):  # float64: autocast leaves it be
            continue
        found.append((module, name))
    return found


class _LeanForward:
    """A LoRA layer's short forward (`lean_adapters`); peft's where it does not apply."""

    def __init__(self, layer: torch.nn.Module, name: str) -> None:
        self.layer, self.name, self.active = layer, name, [name]  # the layer holds this: a cycle, cut on leaving
        self.dropout, self.cast = layer.lora_dropout[name], {}  # autocast's dtype -> (Aᵀ, Bᵀ) in it
        self.calls = 0  # calls that took the short forward

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        m, name = self.layer, self.name
        if (args or kwargs or torch.is_grad_enabled() or m.disable_adapters or m.merged or m.active_adapters != self.active
                or (self.dropout.training and isinstance(self.dropout, torch.nn.Dropout))):
            return type(m).forward(m, x, *args, **kwargs)
        self.calls += 1
        result = m.base_layer(x)
        A, B = m.lora_A[name].weight, m.lora_B[name].weight
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # peft: x.to(A.dtype), then autocast casts x, A and B to its dtype in each linear; where
            # A's dtype holds x's values (float32 holds the others'), x → A.dtype → autocast's dtype
            # is x → autocast's dtype, and peft's cast can go
            if x.dtype != A.dtype and not (A.dtype == torch.float32 and x.dtype in _AUTOCASTS):
                x = x.to(A.dtype)
            dtype = torch.get_autocast_dtype(device)
            if dtype not in self.cast:  # cast once (under FSDP inside the first forward: gathered weights)
                self.cast[dtype] = (A.to(dtype).t(), B.to(dtype).t())
            At, Bt = self.cast[dtype]
        else:
            x, At, Bt = x.to(A.dtype), A.t(), B.t()  # views of the weights as they are now
        # peft's lora_B(lora_A(x)) · scaling: two linears without bias, which fold x to (N, in) and
        # multiply by the transposed weights, as here; then the sum with the base's output
        y = torch.mm(torch.mm(x.reshape(-1, x.size(-1)), At), Bt).view(*result.shape[:-1], -1)
        scaling = m.scaling[name]
        if y.dtype != result.dtype:
            return (result + y * scaling).to(result.dtype)
        if isinstance(scaling, float) and scaling > 0 and math.frexp(scaling)[0] == 0.5:
            # a power of two (alpha / r = 2, 0.5 ...): y · scaling is exact, so rounding once after
            # the sum is rounding after each, as peft does (but in the subnormal range)
            return result.add_(y, alpha=scaling)
        return result.add_(y.mul_(scaling))  # the same sums, without new tensors
