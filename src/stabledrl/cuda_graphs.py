"""A model call captured once into a CUDA graph and replayed (`sampling.cuda_graphs`).

At 8B a cached rollout's later calls feed a block of 32 tokens a row and are bound by launching
some 2,000 kernels each, not by arithmetic (docs/gpu-check.md). A CUDA graph launches a captured
call's kernels again in one go, the same kernels on the same tensors. So a replay relies on:
- one static tensor for the call's input, overwritten before each replay; every other tensor it
  reads (weights, the KV cache written in place, the key padding, positions) where it was at
  capture: the sampler captures again when rows leave the block (the cache is cut) and after a
  refresh (a new cache);
- Python run once, at capture: no branch on a value that changes between calls, no read of the
  device (the native models read a key-padding mask once, `stabledrl.models.native._no_padding`);
- the output is the graph's own tensor, which the next replay overwrites: a call returns a copy.
`CapturedCall(fn, static)` runs `fn` once as an ordinary call on a side stream (CUDA graphs'
warm-up; its output is `first`, its cache writes the call's own), then captures it; `call(new)`
copies `new` into `static` and replays. Not under FSDP or DeepSpeed ZeRO-3, whose Python hooks
gather and free the weights in every call (`check_capturable`). tests/cpu_graphs.py emulates a
capture on the CPU for the tests (docs/methods.md, "Fast decoding").
"""

from __future__ import annotations

from typing import Callable

import torch

from stabledrl._compat import SHARDING_CLASSES


def check_capturable(model: torch.nn.Module) -> None:
    """A ValueError where the model's calls cannot be replayed: sharded (FSDP, DeepSpeed ZeRO-3),
    whose weights are gathered and freed by Python hooks in every call."""
    if any(SHARDING_CLASSES & {c.__name__ for c in type(m).__mro__} for m in model.modules()) or \
            any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("sampling.cuda_graphs cannot replay a sharded model's calls (FSDP or ZeRO-3 gather its "
                         "weights in Python hooks each call): set cuda_graphs: false")


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # the captures' stream on each device


class CapturedCall:
    """`fn` (which reads `static`) run once, then captured into a CUDA graph; calling the
    object with a tensor of `static`'s shape copies it in and replays."""

    def __init__(self, fn: Callable[[], torch.Tensor], static: torch.Tensor) -> None:
        if static.device.type != "cuda":
            raise ValueError(f"sampling.cuda_graphs needs the model on a CUDA device; its inputs are on "
                             f"{static.device}: set cuda_graphs: false")
        self.static = static
        with torch.cuda.device(static.device):  # the model's device, not the current one: its streams
            if static.device not in _SIDE_STREAMS:  # one a device: cuBLAS keeps a workspace for each stream
                _SIDE_STREAMS[static.device] = torch.cuda.Stream()
            side = _SIDE_STREAMS[static.device]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.first = fn()  # the warm-up (lazy initialisations, cuBLAS workspaces): a real call
            torch.cuda.current_stream().wait_stream(side)
            self.first.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
            self.graph = torch.cuda.CUDAGraph()
            # the warm-up's stream (its per-stream handles made already); other threads' CUDA calls go on
            with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
                self.out = fn()

    def __call__(self, new: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self.static.device):
            self.static.copy_(new)
            self.graph.replay()
            return self.out.clone()
