"""Rollout engines: what turns prompts into completions for the trainer (docs/methods.md,
"Rollout engines").

The trainer asks an engine for the completions of a `RolloutRequest` and never calls the
sampler itself. The built-in engine is this library's sampler (`generate_micro_batched`);
an external one is named in the config, ``sampling.engine: "package.module:ClassName"``,
imported by name and built with ``sampling.engine_options`` as keyword arguments.

The contract (`RolloutEngine`): ``rollout(request) -> GenerationOutput`` where, for the B
prompts and L = ``request.gen_length``, ``completion_ids`` (B, L) long has PAD after the first
stop token; ``completion_mask`` (B, L) bool is True up to and including it; ``unmask_step``
(B, L) long is each slot's commit step (≥ 0 on every scored slot, what the ``path``
estimator replays); ``entropy`` (B,) float is a diagnostic (zeros if unknown); ``sequences``,
``forward_passes`` (0 allowed) and ``token_logprob`` (None allowed) as `GenerationOutput` says. Row b must be
a sample of ``request.policy`` as it is now, seeded by ``request.generators[b]`` only.
An engine may ignore ``micro_batch``, ``synced``, ``num_calls``, ``progress`` and
``sampling.sort_by_length``. `check_output` enforces the shapes and types.
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import torch

from stabledrl.models.policy import Policy
from stabledrl.sampling import GenerationOutput, RolloutRequest, SamplingConfig, check_sampler, generate_micro_batched

__all__ = ["RolloutRequest", "RolloutEngine", "BuiltinEngine", "load_engine", "check_engine", "check_output",
           "roll_out"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Produces the completions of a `RolloutRequest` (module docstring: the contract)."""

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        ...


class BuiltinEngine:
    """This library's sampler: `generate_micro_batched` with the request's settings."""

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        return generate_micro_batched(request)


def load_engine(spec: str = "builtin", options: dict[str, Any] | None = None) -> RolloutEngine:
    """The engine named `spec`: "builtin", or "package.module:ClassName" built with `options`
    as keyword arguments. One instance per (spec, options), kept for later calls."""
    return _load_engine(spec, json.dumps(options or {}, sort_keys=True))


@lru_cache(maxsize=8)
def _load_engine(spec: str, options_json: str) -> RolloutEngine:
    options = json.loads(options_json)
    if spec == "builtin":
        if options:
            raise ValueError("the builtin engine takes no engine_options (its options are the sampling settings)")
        return BuiltinEngine()
    module_name, sep, class_name = spec.partition(":")
    if not (sep and module_name and class_name):
        raise ValueError(f"sampling.engine must be 'builtin' or 'package.module:ClassName', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"sampling.engine {spec!r} does not import ({type(e).__name__}: {e}); install the "
                         "package that provides it or fix the name") from e
    engine = cls(**options)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"sampling.engine {spec!r} is not a rollout engine: it needs a method "
                        "rollout(request: RolloutRequest) -> GenerationOutput (stabledrl.engines)")
    return engine


def check_engine(sampling: SamplingConfig, policy: Policy) -> None:
    """At start-up: the engine of `sampling` imports and keeps the protocol, and (the built-in
    one) its fast-decoding options fit `policy`; else an error saying what to change."""
    load_engine(sampling.engine, sampling.engine_options)
    if sampling.engine == "builtin":
        check_sampler(policy, sampling)


def check_output(out: Any, request: RolloutRequest, name: str = "the engine") -> GenerationOutput:
    """`out` if it keeps the contract for `request` (module docstring), else a TypeError or
    ValueError saying what `name` returned wrong."""
    if not isinstance(out, GenerationOutput):
        raise TypeError(f"{name} returned {type(out).__name__}, not a stabledrl.sampling.GenerationOutput")
    B, L = request.prompt_ids.size(0), request.gen_length
    want = {"completion_ids": ((B, L), (torch.long,)), "completion_mask": ((B, L), (torch.bool,)),
            "unmask_step": ((B, L), (torch.long,)), "entropy": ((B,), (torch.float32, torch.float64))}
    for field, (shape, dtypes) in want.items():
        x = getattr(out, field)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype not in dtypes:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} returned {field} {got}; the contract is {shape} {dtypes[0]}")
    if (out.unmask_step[out.completion_mask] < 0).any():
        raise ValueError(f"{name} returned unmask_step < 0 on scored slots: every scored slot needs its commit step")
    return out


def roll_out(request: RolloutRequest) -> GenerationOutput:
    """The completions of `request` from the engine its sampling settings name, checked."""
    engine = load_engine(request.sampling.engine, request.sampling.engine_options)
    return check_output(engine.rollout(request), request, name=f"engine {request.sampling.engine!r}")
