"""How a batch is shared among training processes: each takes a contiguous share of the rows
(as even as possible), and gathers rebuild the whole batch on every process.

With one process the share is the whole batch and every gather is the identity. Every
random draw of a step is per row or drawn for the whole batch, so N processes compute the
update of one (docs/methods.md, "The training step").
"""

from __future__ import annotations

import torch

__all__ = ["Shards"]


class Shards:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    def __init__(self, accelerator) -> None:
        from accelerate.utils import DistributedType

        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        # Sharded parameters make every forward a collective: sample in lockstep.
        self.synced = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """The rows [start, end) of a batch of n rows that process `rank` (default: this one) holds;
        empty for some processes when n < the number of processes."""
        r = self.rank if rank is None else rank
        return r * n // self.world, (r + 1) * n // self.world

    def run_bounds(self, n: int) -> tuple[int, int]:
        """The rows this process runs the model on: its own, or row 0 as a stand-in (its result
        dropped) when it holds none, so that processes with sharded parameters make the same calls."""
        start, end = self.bounds(n)
        return (0, 1) if start == end else (start, end)

    def largest_share(self, n: int) -> int:
        """The rows of the process that holds the most of n (its sampler calls set everyone's, synced)."""
        return -(-n // self.world)

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(share, ...) on each process -> (n, ...) on every process; no gradient."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        sizes = [end - start for start, end in (self.bounds(n, r) for r in range(self.world))]
        if x.size(0) != sizes[self.rank]:
            raise RuntimeError(f"process {self.rank} holds {x.size(0)} rows, its share of {n} is {sizes[self.rank]}")
        kind = x.dtype
        y = x.detach().to(torch.uint8) if kind == torch.bool else x.detach()
        padded = y.new_zeros((max(sizes), *y.shape[1:]))
        padded[: y.size(0)] = y
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:k] for p, k in zip(parts, sizes)]).to(kind)

    def gather_keeping_graph(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(share, ...) with a graph -> (n, ...): the other processes' rows as constants, this
        process's rows still carrying their graph, so a loss of all n rows back-propagates
        into this process's share only."""
        if self.world == 1:
            return x
        others = self.gather(x, n)
        start, end = self.bounds(n)
        return torch.cat([others[:start], x, others[end:]])
