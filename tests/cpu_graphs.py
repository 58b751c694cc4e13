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
As on a GPU, the capture computes nothing: the tensors it made hold garbage (NaN, or the largest
integer) until the first replay, and the tensors it wrote into in place are given back their
values; and the graph keeps no tensor of the caller alive (a replay that reads one the caller
has dropped raises).
"""

from __future__ import annotations

import weakref
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
        self.made: set[int] = set()  # the storages the capture allocated (the graph's own memory)
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # tensors written in place: their values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masks = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
        to_host = func is aten._to_copy.default and kwargs.get("device") not in (None, args[0].device)
        if func in SYNCS or masks or to_host:  # boolean indexing runs nonzero; a copy to another device waits
            raise RuntimeError(f"{func} reads the device during a capture (a host sync)")
        for t in _written(func, args, kwargs):
            if id(t) not in self.before and _storage(t) not in self.made:
                self.before[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        if not func.is_view and not func._schema.is_mutable:
            self.made.update(_storage(t) for t in _tensors(out))
        self.ops.append((func, self._held(args), self._held(kwargs), out))
        return out

    def _held(self, value):
        """`value` as the graph holds it: its own tensors, weak references to the caller's."""
        if isinstance(value, torch.Tensor):
            return value if _storage(value) in self.made else weakref.ref(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._held(v) for v in value)
        if isinstance(value, dict):
            return {k: self._held(v) for k, v in value.items()}
        return value


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes into in place (its schema's mutable arguments)."""
    named = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
    return [named[a.name] for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and isinstance(named.get(a.name), torch.Tensor)]


def _alive(value):
    if isinstance(value, weakref.ref):
        t = value()
        if t is None:
            raise RuntimeError("a replay read a tensor freed since the capture (a CUDA graph holds none alive)")
        return t
    if isinstance(value, (list, tuple)):
        return type(value)(_alive(v) for v in value)
    if isinstance(value, dict):
        return {k: _alive(v) for k, v in value.items()}
    return value


def _garbage(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)


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
        for t, values in reversed(record.before.values()):  # a capture writes nothing
            t.copy_(values)
        for func, _, _, out in self.ops:  # nor computes anything
            if not func.is_view and not func._schema.is_mutable:
                for t in _tensors(out):
                    _garbage(t)
        type(self).captures += 1

    def __call__(self, new: torch.Tensor) -> torch.Tensor:
        self.static.copy_(new)
        for func, args, kwargs, out in self.ops:
            if func.is_view:
                continue
            args, kwargs = _alive(args), _alive(kwargs)
            if func._schema.is_mutable:
                func(*args, **kwargs)
                continue
            for made, fresh in zip(_tensors(out), _tensors(func(*args, **kwargs))):
                made.copy_(fresh)
        type(self).replays_made += 1
        return self.out.clone()
