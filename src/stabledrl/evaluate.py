"""Held-out evaluation: sample completions for problems, score them with the task."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from stabledrl.data import decode_completions, encode_prompts
from stabledrl.models.policy import Policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks.base import Problem, Task

__all__ = ["EvalResult", "evaluate"]


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    n: int
    seconds: float
    tokens_per_second: float
    samples: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "samples"}


@torch.no_grad()
def evaluate(
    policy: Policy,
    task: Task,
    problems: Sequence[Problem],
    sampling: SamplingConfig | None = None,
    *,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    synced: bool = False,
) -> EvalResult:
    """Accuracy (share of fully correct completions) and mean reward on `problems`.
    `synced`: see `stabledrl.sampling.generate` (processes with sharded parameters)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    sampling = sampling or SamplingConfig()
    gen_length = sampling.gen_length or task.completion_length
    generator = torch.Generator(device="cpu").manual_seed(seed)
    was_training = policy.model.training
    policy.model.eval()
    texts: list[str] = []
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(problems), batch_size), desc="eval", disable=not progress, leave=False):
        chunk = problems[i : i + batch_size]
        ids, mask = encode_prompts(policy.tokenizer, [p.prompt for p in chunk])
        out = generate(
            policy, ids.to(policy.device), mask.to(policy.device),
            gen_length=gen_length, generator=generator, synced=synced, **sampling.generate_kwargs(),
        )
        texts.extend(decode_completions(policy.tokenizer, out.completion_ids.cpu()))
    seconds = time.perf_counter() - t0
    policy.model.train(was_training)
    rewards = task.reward(texts, problems)
    correct = [task.is_correct(t, p) for t, p in zip(texts, problems)]
    samples = [
        {"prompt": p.prompt, "completion": t, "reward": r, "correct": c}
        for p, t, r, c in zip(problems, texts, rewards, correct)
    ]
    return EvalResult(
        accuracy=sum(correct) / len(problems),
        mean_reward=sum(rewards) / len(problems),
        n=len(problems),
        seconds=seconds,
        tokens_per_second=len(problems) * gen_length / seconds,
        samples=samples,
    )
