"""What the training loop measures beside the maths, as hooks it calls: where a step's time
goes (`StepTimer`), the norm of an optimizer step's change (`step_measuring_update`, opt-in
`update_norm`), and the agreement of two halves' gradients (`backward_measuring_agreement`,
opt-in `grad_agreement`). None of them changes what is computed.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

from stabledrl.diagnostics import flat_grad_cosine
from stabledrl.objectives import LossOutput, ScoredBatch, share_of_loss
from stabledrl.settings import Normaliser

__all__ = ["ForwardClock", "StepTimer", "step_measuring_update", "backward_measuring_agreement", "UPDATE_CHUNK"]


class ForwardClock:
    """Sums the wall time spent inside the models' forward passes (via hooks). On a GPU a
    forward returns once its kernels are queued, so there each forward is timed by CUDA
    events on the current stream instead, and `seconds` synchronises once to read them:
    no synchronisation inside a step. `event`: the event class (default torch.cuda.Event;
    a test passes a fake)."""

    def __init__(self, *models: torch.nn.Module, event: Any = None) -> None:
        self._seconds = 0.0
        self._t0: Any = 0.0
        models = tuple({id(m): m for m in models}.values())  # a LoRA reference shares the policy's model
        self.cuda = any(p.is_cuda for m in models for p in m.parameters())
        self._event = torch.cuda.Event if event is None else event
        self._events: list[tuple[Any, Any]] = []
        for m in models:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, *args) -> None:
        if self.cuda:
            self._t0 = self._event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _stop(self, *args) -> None:
        if self.cuda:
            end = self._event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            self._seconds += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000  # ms -> s
            self._events.clear()
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._events.clear()
        self._seconds = value


class StepTimer:
    """A step's wall time, the time of its named phases, and the models' forward time."""

    def __init__(self, *models: torch.nn.Module) -> None:
        self.forward = ForwardClock(*models)
        self.start()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._phases: dict[str, float] = {}
        self.forward.seconds = 0.0

    @contextmanager
    def phase(self, name: str, *, until_gpu_done: bool = False):
        """Add the block's wall time to phase `name`; `until_gpu_done`: until the GPU has
        finished the work the block queued (one synchronisation, on a GPU only)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if until_gpu_done and self.forward.cuda:
                torch.cuda.synchronize()
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def row(self) -> dict[str, float]:
        """The timing keys of the step's metrics row, so far."""
        row = {"seconds": time.perf_counter() - self._t0, **{f"time_{k}": v for k, v in self._phases.items()},
               "time_model_forward": self.forward.seconds}
        # The framework's share: time in neither the model's forward nor the backward.
        row["framework_share"] = 1 - (row["time_model_forward"] + self._phases.get("backward", 0.0)) / row["seconds"]
        return row


UPDATE_CHUNK = 2**26
"""Parameter elements copied at a time to measure the update (256 MB in float32)."""


def step_measuring_update(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                          chunk_size: int | None = None) -> float:
    """opt.step(); returns the norm of the change it made to the parameters, without a copy
    of all of them: the optimizer steps one chunk of about `chunk_size` elements at a time
    (torch's optimizers skip a parameter whose .grad is None, and their updates are per
    parameter, so the weights and states are those of one step), and only that chunk is
    copied to take the difference."""
    chunk_size = UPDATE_CHUNK if chunk_size is None else chunk_size
    grads = [p.grad for p in params]
    chunks: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if grads[i] is None:
            continue
        if chunks[-1] and size + p.numel() > chunk_size:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += p.numel()
    total = 0.0
    try:
        for chunk in chunks:
            for p in params:
                p.grad = None
            for i in chunk:
                params[i].grad = grads[i]
            before = [params[i].detach().clone() for i in chunk]
            opt.step()
            total += sum(float((params[i].detach() - b).float().square().sum()) for i, b in zip(chunk, before))
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return math.sqrt(total)


def first_half_loss(objective: Callable[[ScoredBatch], LossOutput], batch: ScoredBatch, *,
                    normaliser: Normaliser) -> torch.Tensor:
    """The part of the step's loss that comes from its first ⌊n/2⌋ groups: the loss of those
    groups alone, weighted as the objective's `normaliser` says (`share_of_loss`): a loss that is
    a mean over groups is Σ_g c_g / n, and this is Σ_{g < n/2} c_g / n."""
    rows = batch.advantages.size(0) // batch.group_size // 2 * batch.group_size
    return objective(batch.first_rows(rows)).loss * share_of_loss(normaliser, batch.completion_mask, 0, rows)


def backward_measuring_agreement(loss: torch.Tensor, part: torch.Tensor, params: list,
                                 backward: Callable[..., None]) -> float:
    """Back-propagate `loss` as `part` + (loss − part), leaving ∇loss in the parameters'
    .grad; returns the cosine between the two parts' gradients (one extra backward)."""
    backward(part, retain_graph=True)
    g_a = [None if p.grad is None else p.grad.clone() for p in params]
    backward(loss - part)
    g_b = [None if p.grad is None else (p.grad if a is None else p.grad - a) for p, a in zip(params, g_a)]
    return flat_grad_cosine(g_a, g_b)
