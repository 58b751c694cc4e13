"""A step's rollouts: G completions of each problem from the current policy, their rewards,
and the groups kept for training (`RolloutBatch`, `roll_groups`, `drop_flat_groups`).

Each process samples and rewards its share of the rows (`stabledrl.shards`); the completions,
rewards and entropies are gathered, so every process holds every group. Row b of a batch
tagged t draws from its own generator (`stabledrl.sampling.row_generators`), so the tokens
do not depend on how the rows are split.

Shapes: n problems, G group size, B = n·G rows, L completion slots, Lp prompt slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from stabledrl.data import decode_policy_completions, encode_policy_prompts, keep_last_tokens
from stabledrl.engines import RolloutRequest, roll_out
from stabledrl.sampling import micro_batch_calls, row_generators
from stabledrl.settings import SamplingConfig

__all__ = ["RolloutBatch", "roll_groups", "drop_flat_groups", "concat_groups"]


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch:
    """Rollouts: whole groups (G consecutive rows per problem, with their problems, rewards
    and entropies), or a share of their rows (`rows`), which need not hold whole groups and
    carries the five tensors the likelihoods read only."""

    prompt_ids: torch.Tensor  # (B, Lp) left-padded
    prompt_mask: torch.Tensor  # (B, Lp)
    completion_ids: torch.Tensor  # (B, L)
    completion_mask: torch.Tensor  # (B, L) scored slots
    unmask_step: torch.Tensor  # (B, L) the sampler step that committed each slot
    problems: list | None = None  # (n,) one per group
    rewards: torch.Tensor | None = None  # (n, G)
    entropy: torch.Tensor | None = None  # (B,)

    def _scored(self) -> tuple[torch.Tensor, ...]:
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask, self.unmask_step

    def rows(self, start: int, end: int, device: Any) -> RolloutBatch:
        """Rows start:end of the five scored tensors, moved to `device`."""
        return RolloutBatch(*(x[start:end].to(device) for x in self._scored()))

    def flat(self) -> torch.Tensor:
        """(n,) True where every reward of the group is equal: no signal."""
        return (self.rewards == self.rewards[:, :1]).all(1)

    def select(self, groups: torch.Tensor) -> RolloutBatch:
        """The groups of the (n',) indices `groups`, whole."""
        G = self.rewards.size(1)
        rows = (groups[:, None] * G + torch.arange(G)).flatten()  # (n'·G,)
        return RolloutBatch(*(x[rows] for x in self._scored()), problems=[self.problems[i] for i in groups.tolist()],
                            rewards=self.rewards[groups], entropy=self.entropy[rows])


def drop_flat_groups(batch: RolloutBatch) -> RolloutBatch:
    """The groups whose rewards differ."""
    return batch.select((~batch.flat()).nonzero().flatten())


def roll_groups(policy, task, problems: list, *, group_size: int, sampling: SamplingConfig, gen_length: int,
                tag: str, shards) -> RolloutBatch:
    """G rollouts per problem from the current policy, and their rewards. Each process
    samples and rewards its share of the n·G rows; every process returns all of them."""
    G = group_size
    group_problems = [p for p in problems for _ in range(G)]
    n = len(group_problems)
    p_ids, p_mask = encode_policy_prompts(policy, [p.prompt for p in group_problems])  # (n·G, Lp) all rows
    p_ids, p_mask = keep_last_tokens(p_ids, p_mask, sampling.max_prompt_length)
    start, end = shards.bounds(n)
    k, (lo, hi) = end - start, shards.run_bounds(n)  # this process's rows; it runs lo:hi (a stand-in if none)
    dev = policy.device
    calls = micro_batch_calls(shards.largest_share(n), sampling.micro_batch)  # the largest share's (synced: collectives)
    roll = roll_out(RolloutRequest(policy, p_ids[lo:hi].to(dev), p_mask[lo:hi].to(dev), gen_length,
                                   row_generators(tag, lo, hi), sampling, micro_batch=sampling.micro_batch,
                                   synced=shards.synced, num_calls=calls))
    texts = decode_policy_completions(policy, roll.completion_ids[:k].cpu())
    rewards = torch.tensor(task.reward(texts, group_problems[start:end]), dtype=torch.float32)  # (share,)
    ids, mask, order, rewards, entropy = (shards.gather(x[:k].to(dev), n).cpu() for x in (
        roll.completion_ids, roll.completion_mask, roll.unmask_step, rewards, roll.entropy))
    return RolloutBatch(p_ids, p_mask, ids, mask, order, problems=list(problems), rewards=rewards.view(-1, G),
                        entropy=entropy)


def _left_pad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.cat([x.new_full((x.size(0), width - x.size(1)), value), x], dim=1)


def concat_groups(parts: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The groups of several rollout rounds in one batch (prompts re-padded to the widest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.prompt_ids.size(1) for p in parts)
    return RolloutBatch(torch.cat([_left_pad(p.prompt_ids, width, pad_token_id) for p in parts]),
                        torch.cat([_left_pad(p.prompt_mask, width, 0) for p in parts]),
                        *(torch.cat([getattr(p, f) for p in parts]) for f in ("completion_ids", "completion_mask",
                                                                              "unmask_step")),
                        problems=[q for p in parts for q in p.problems],
                        rewards=torch.cat([p.rewards for p in parts]), entropy=torch.cat([p.entropy for p in parts]))
