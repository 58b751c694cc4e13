"""CUDA graphs' semantics on the CPU, for the tests of `sampling.cuda_graphs`.

`RecordedCall` has `stabledrl.cuda_graphs.CapturedCall`'s interface: `fn` runs once as an
ordinary call (its output `first`), then once more under a `TorchDispatchMode` that records every
operation with the very tensors it read and wrote ("capture"). A replay copies the new input into
the static tensor and runs the recorded operations again on those tensors: in-place operations
in place, the others with their results copied into the tensors they made at capture, views
left as they are (they alias storage that the others update). As in a CUDA graph, the Python of
`fn` does not run again: a branch that depended on a value, a tensor read that was replaced
between calls, or an input left out of `static` makes a replay differ from an ordinary call,
which the tests compare it with. An operation that reads the device on a GPU (a host sync:
`.item()`, `bool()`, `nonzero`, `torch.equal` ...), which a capture refuses, raises here too.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.masked_select.default,
         aten.is_nonzero.default, aten._unique2.default, aten.unique_consecutive.default}


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masks = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
        to_host = func is aten._to_copy.default and kwargs.get("device") not in (None, args[0].device)
        if func in SYNCS or masks or to_host:  # boolean indexing runs nonzero; a copy to another device waits
            raise RuntimeError(f"{func} reads the device during a capture (a host sync)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _tensors(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
        if isinstance(out, (tuple, list)) else []


class RecordedCall:
    """`CapturedCall`, emulated on the CPU (module docstring)."""

    captures = replays_made = 0  # over all instances: calls captured, replays made

    def __init__(self, fn: Callable[[], torch.Tensor], static: torch.Tensor) -> None:
        self.static = static
        self.first = fn()
        with _Record() as record:
            self.out = fn()
        self.ops = record.ops
        type(self).captures += 1

    def __call__(self, new: torch.Tensor) -> torch.Tensor:
        self.static.copy_(new)
        for func, args, kwargs, out in self.ops:
            if func.is_view:
                continue
            if func._schema.is_mutable:
                func(*args, **kwargs)
                continue
            for made, fresh in zip(_tensors(out), _tensors(func(*args, **kwargs))):
                made.copy_(fresh)
        type(self).replays_made += 1
        return self.out.clone()
