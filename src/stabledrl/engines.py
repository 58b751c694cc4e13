"""Rollout engines: what turns prompts into completions for the trainer and the evaluation
(docs/methods.md, "Rollout engines").

The trainer asks an engine for the completions of a batch of prompts and gets back what RL
needs of them; it never calls the sampler itself. The built-in engine is this library's
sampler (`stabledrl.sampling.generate_micro_batched`, every option of `SamplingConfig`). An
external engine (e.g. a serving system with dLLM decoding) is named in the config,
``sampling.engine: "package.module:ClassName"``, imported by name and built with
``sampling.engine_options`` as keyword arguments.

The contract (`RolloutEngine`): ``rollout(request) -> GenerationOutput`` where, for the B
prompts of the request and L = ``request.gen_length``,
- ``completion_ids`` (B, L) long: the completion tokens, PAD after the first stop token;
- ``completion_mask`` (B, L) bool: True up to and including the first stop token (the slots
  the likelihood scores);
- ``unmask_step`` (B, L) long: the step at which each slot was committed (slots committed
  together share a step; ≥ 0 on every scored slot), what the ``path`` estimator replays;
- ``entropy`` (B,) float: the mean entropy of the committed slots' distributions (a
  diagnostic; zeros if the engine does not know it);
- ``sequences``, ``forward_passes`` and ``token_logprob`` as `GenerationOutput` describes them
  (an engine may set ``forward_passes`` 0 and ``token_logprob`` None: the trainer does not read
  ``token_logprob``, and the built-in engine leaves it None).
Row b must be a sample of the policy ``request.policy`` *as it is now* (the trainer scores it
with those weights), seeded by ``request.generators[b]``: a row's completion may depend on its
generator and prompt only, not on its batch. The engine may ignore ``micro_batch``,
``synced``, ``num_calls``, ``progress`` and ``sampling.sort_by_length`` (the built-in sampler's
options). `check_output` enforces the shapes and types, with an error naming the engine.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import torch

from stabledrl.models.policy import Policy
from stabledrl.sampling import GenerationOutput, SamplingConfig, check_fast_decoding, generate_micro_batched

__all__ = ["RolloutRequest", "RolloutEngine", "BuiltinEngine", "load_engine", "check_engine", "check_output",
           "roll_out"]


@dataclass
class RolloutRequest:
    """What an engine is asked for: B prompts and how to sample them."""

    policy: Policy
    """The current policy: its weights are those the trainer scores the rollouts with."""
    prompt_ids: torch.Tensor
    """(B, P) left-padded prompt ids, on the policy's device."""
    prompt_mask: torch.Tensor
    """(B, P) 1 for prompt tokens, 0 for padding."""
    gen_length: int
    """Completion slots L."""
    generators: list[torch.Generator]
    """One per row (`stabledrl.sampling.row_generators`): row b's randomness comes from its own."""
    sampling: SamplingConfig
    """The sampling settings (temperature, steps, block length, ...)."""
    micro_batch: int | None = None
    """Rows per call of the built-in sampler (None: all)."""
    synced: bool = False
    """Processes with sharded parameters must make the same model calls (built-in sampler)."""
    num_calls: int | None = None
    """With `synced`: the sampler calls of the largest share of the processes."""
    progress: bool = False
    """A progress bar over the micro-batches."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Produces the completions of a `RolloutRequest` (module docstring: the contract)."""

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        ...


class BuiltinEngine:
    """This library's sampler: `generate_micro_batched` with the request's settings."""

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        r = request
        return generate_micro_batched(r.policy, r.prompt_ids, r.prompt_mask, micro_batch=r.micro_batch,
                                      generator=r.generators, synced=r.synced, num_calls=r.num_calls,
                                      progress=r.progress, sort_by_length=r.sampling.sort_by_length,
                                      gen_length=r.gen_length, **r.sampling.generate_kwargs())


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
        check_fast_decoding(policy, sampling.remasking, sampling.noise, sampling.threshold, sampling.approx_cache)


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
