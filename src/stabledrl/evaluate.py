"""Held-out evaluation: sample completions for problems, score them with the task (each
completion once: its reward and whether it is correct come from one `Score`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from stabledrl.data import decode_policy_completions, encode_policy_prompts, keep_last_tokens
from stabledrl.models.policy import Policy
from stabledrl.sampling import RolloutRequest, SamplingConfig, generate_micro_batched, row_generators
from stabledrl.tasks.base import Problem, Task, score_all

__all__ = ["EVAL_MICRO_BATCH", "EvalResult", "EvalShare", "evaluate", "pass_at_k"]


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


def pass_at_k(correct: torch.Tensor, k: int) -> float:
    """The chance that at least one of k samples is right, from n ≥ k samples per problem:
    `correct` is a boolean [problems, n]. Each problem with c right answers among its n
    contributes 1 − C(n−c, k) / C(n, k), the unbiased estimate (Chen et al., 2021, "Evaluating
    Large Language Models Trained on Code", §2.1), averaged over problems. With k = 1 it is
    the mean of `correct`; with k = n the fraction of problems with a right answer among all n."""
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per problem")
    wrong = (~correct.bool()).sum(1).tolist()
    return sum(1.0 - math.comb(w, k) / math.comb(n, k) for w in wrong) / len(wrong)


@dataclass(frozen=True)
class EvalShare:
    """Where one process's problems sit among all processes' (a single process: the default)."""

    first_index: int = 0
    """The index of this share's first problem among all: it seeds that problem's noise."""
    synced: bool = False
    """Processes with sharded parameters: see `stabledrl.sampling.generate_micro_batched`."""
    num_calls: int | None = None
    """Sampler calls every process makes (synced); None: as many as this share needs."""


EVAL_MICRO_BATCH = 256
"""Rows per sampler call of an evaluation whose sampling settings leave micro_batch unset."""


@torch.no_grad()
def evaluate(
    policy: Policy,
    task: Task,
    problems: Sequence[Problem],
    sampling: SamplingConfig | None = None,
    *,
    seed: int = 0,
    progress: bool = True,
    share: EvalShare = EvalShare(),
) -> EvalResult:
    """Accuracy (share of fully correct completions) and mean reward on `problems`.

    The problems are decoded `sampling.micro_batch` at a time (None: `EVAL_MICRO_BATCH`);
    problem i draws its noise from its own generator, seeded by
    (`seed`, `share.first_index` + i), so the completions do not depend on the batch size,
    nor on how processes split the problems (each passes its `EvalShare`)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    sampling = sampling or SamplingConfig()
    gen_length = sampling.gen_length or task.completion_length
    micro_batch = sampling.micro_batch or EVAL_MICRO_BATCH
    generators = row_generators(f"eval/{seed}", share.first_index, share.first_index + len(problems))
    was_training = policy.model.training
    policy.model.eval()
    t0 = time.perf_counter()
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])  # (n, P): one padding for all
    ids, mask = keep_last_tokens(ids, mask, sampling.max_prompt_length)
    out = generate_micro_batched(RolloutRequest(policy, ids.to(policy.device), mask.to(policy.device), gen_length,
                                                generators, sampling, micro_batch=micro_batch, synced=share.synced,
                                                num_calls=share.num_calls, progress=progress))
    texts = decode_policy_completions(policy, out.completion_ids.cpu())
    seconds = time.perf_counter() - t0
    policy.model.train(was_training)
    scores = score_all(task, texts, problems)  # each completion scored once, for its reward and correctness
    samples = [
        {"prompt": p.prompt, "completion": t, "reward": float(s), "correct": s.correct}
        for p, t, s in zip(problems, texts, scores)
    ]
    return EvalResult(
        accuracy=sum(s["correct"] for s in samples) / len(problems),
        mean_reward=sum(s["reward"] for s in samples) / len(problems),
        n=len(problems),
        seconds=seconds,
        tokens_per_second=len(problems) * gen_length / seconds,
        samples=samples,
    )
