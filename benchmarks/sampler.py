"""Sampler throughput and the share of sampling time spent outside the model's forward.

    python benchmarks/sampler.py --model checkpoints/countdown-tiny --batch 64 --repeats 5

Generates completions for held-out Countdown prompts, timing the whole `generate` call
and, separately, the time spent inside `policy.logits` (the model's forward). Writes
medians over repeats to benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from stabledrl.data import encode_prompts
from stabledrl.models import load_policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks import get_task


class TimedPolicy:
    """Wraps a policy and accumulates the wall time of its forward passes."""

    def __init__(self, policy):
        self.inner = policy
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def logits(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner.logits(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/countdown-tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/sampler.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    policy = TimedPolicy(load_policy(args.model))
    task = get_task("countdown")
    problems = task.generate(args.batch, split="test", seed=0)
    ids, mask = encode_prompts(policy.tokenizer, [p.prompt for p in problems])
    L = task.completion_length
    rows = []
    for r in range(args.repeats + 1):  # the first run warms up and is dropped
        policy.seconds = 0.0
        gen = torch.Generator().manual_seed(r)
        t0 = time.perf_counter()
        out = generate(policy, ids, mask, SamplingConfig(gen_length=L, temperature=args.temperature), generator=gen)
        total = time.perf_counter() - t0
        if r:
            rows.append({"seconds": total, "forward_seconds": policy.seconds, "forward_passes": out.forward_passes})
    total = statistics.median(x["seconds"] for x in rows)
    outside = statistics.median(1 - x["forward_seconds"] / x["seconds"] for x in rows)
    result = {
        "model": args.model, "batch": args.batch, "gen_length": L, "steps": L, "threads": args.threads,
        "temperature": args.temperature, "repeats": args.repeats,
        "tokens_per_second_median": args.batch * L / total,
        "seconds_per_batch_median": total,
        "share_outside_forward_median": outside,
        "runs": rows, "torch": torch.__version__, "machine": platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
