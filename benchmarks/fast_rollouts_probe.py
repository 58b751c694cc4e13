"""What Fast-dLLM's caches sample from the tiny tasks' start models, before any RL.

    python benchmarks/fast_rollouts_probe.py          # ~5 min on one thread

For Countdown (`countdown-tiny-rl-base`) and Sudoku (`sudoku-tiny`): 32 training prompts × 8
rollouts at the presets' temperature 1.5 under each setting of `SETTINGS` (exact; dual cache;
dual cache and threshold 0.9; the same three in blocks of 4; the dual cache refreshed every 2
or 4 calls, `approx_refresh`), every setting with the same
per-row noise (`row_generators`). Per setting: the share of completions identical to the exact
sampler's of the same blocks, the mean reward, the share solved, the sampler's entropy, the
completion length, the batch's model calls, each row's calls, and the seconds. Writes
benchmarks/results/fast_rollouts_rl-probe.json (docs/experiments.md, "RL on approximate rollouts").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from stabledrl.data import decode_policy_completions, encode_policy_prompts
from stabledrl.models import load_policy
from stabledrl.sampling import SamplingConfig, generate, row_generators
from stabledrl.tasks import get_task

SETTINGS = {"A": {}, "B": {"approx_cache": "dual"}, "C": {"approx_cache": "dual", "threshold": 0.9},
            "A4": {"block_length": 4}, "B4": {"block_length": 4, "approx_cache": "dual"},
            "C4": {"block_length": 4, "approx_cache": "dual", "threshold": 0.9},
            "R2": {"approx_cache": "dual", "approx_refresh": 2}, "R4": {"approx_cache": "dual", "approx_refresh": 4}}
TASKS = {"countdown": ({"num_numbers": 3}, "checkpoints/countdown-tiny-rl-base"),
         "sudoku": ({"min_empty": 8, "max_empty": 12}, "checkpoints/sudoku-tiny")}


def probe(task_name: str) -> dict[str, dict]:
    options, checkpoint = TASKS[task_name]
    task = get_task(task_name, **options)
    problems = [p for p in task.generate(32, split="train", seed=123) for _ in range(8)]
    policy = load_policy(checkpoint)
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    exact, out = {}, {}
    for name, options in SETTINGS.items():
        sampling = SamplingConfig(temperature=1.5, gen_length=task.completion_length, **options)
        t0 = time.perf_counter()
        gen = generate(policy, ids, mask, sampling, generator=row_generators("probe", 0, len(problems)))
        seconds = time.perf_counter() - t0
        rewards = torch.tensor(task.reward(decode_policy_completions(policy, gen.completion_ids), problems))
        reference = "A4" if name.endswith("4") else "A"
        exact.setdefault(reference, gen.completion_ids)
        out[name] = {"identical_to_exact": (gen.completion_ids == exact[reference]).all(1).float().mean().item(),
                     "reward": rewards.mean().item(), "solved": (rewards == 1).float().mean().item(),
                     "entropy": gen.entropy.mean().item(), "length": gen.completion_mask.sum(1).float().mean().item(),
                     "batch_calls": gen.forward_passes,
                     "calls_per_row": sum(len(set(r)) for r in gen.unmask_step.tolist()) / len(problems),
                     "seconds": seconds}
        print(task_name, name, {k: round(v, 3) for k, v in out[name].items()}, flush=True)
    return out


def main() -> int:
    torch.set_num_threads(1)
    results = {task: probe(task) for task in TASKS}
    path = Path(__file__).parent / "results" / "fast_rollouts_rl-probe.json"
    path.write_text(json.dumps({"command": "python benchmarks/fast_rollouts_probe.py", "threads": 1,
                                "torch": torch.__version__, "results": results}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
