"""Does a shipped model leave RL room from a sound start? For each model and decoder (the
default; `--decoders` names others of `DECODERS`, stop tokens added): greedy accuracy and the
share of well-formed greedy answers; at each temperature, k samples per problem: pass@1,
pass@k, the share of well-formed samples, and the share of groups of k whose rewards are
all equal (a group RL learns nothing from).

    python benchmarks/lab/decoding_start.py --models checkpoints/countdown-tiny checkpoints/countdown-tiny-diverse \
        --split validation --n 500 --threads 1 --tag countdown-validation

Well-formed: Countdown, the answer parses and uses exactly the given numbers (its value
may be wrong; `parses` is the weaker reward > 0); Sudoku, 16 digits 1-4 that keep the
givens. Writes benchmarks/results/decoding_start-<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from stabledrl.evaluate import evaluate
from stabledrl.models import ModelConfig, load_policy
from stabledrl.sampling import SamplingConfig
from stabledrl.tasks import get_task
from stabledrl.tasks.countdown import parse_expression

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/lab/ -> the repository
DECODERS = {"default": []}  # name -> stop tokens besides EOS and PAD (which end a completion by default)


def well_formed(task_name: str, completion: str, problem) -> bool:
    """The answer has the task's form, right or wrong (see the module docstring)."""
    if task_name == "countdown":
        try:
            _, literals = parse_expression(completion)
        except (ValueError, RecursionError):
            return False
        return sorted(literals) == sorted(problem.meta["numbers"])
    text, puzzle = completion.strip(), problem.meta["puzzle"]
    return (len(text) == 16 and set(text) <= set("1234")
            and all(c == "." or c == t for c, t in zip(puzzle, text)))


def measure(policy, task, problems, temperature: float, k: int) -> dict:
    """Greedy (temperature 0, k = 1) or k samples per problem at `temperature`."""
    rows = [p for p in problems for _ in range(k)]
    res = evaluate(policy, task, rows, SamplingConfig(temperature=temperature), progress=False)
    right = torch.tensor([s["correct"] for s in res.samples], dtype=torch.float64).view(len(problems), k)
    reward = torch.tensor([s["reward"] for s in res.samples], dtype=torch.float64).view(len(problems), k)
    formed = [well_formed(task.name, s["completion"], p) for s, p in zip(res.samples, rows)]
    out = {"temperature": temperature, "k": k, "pass@1": float(right.mean()), f"pass@{k}": float(right.max(1).values.mean()),
           "mean_reward": float(reward.mean()), "well_formed": sum(formed) / len(formed),
           "parses": sum(s["reward"] > 0 for s in res.samples) / len(rows),
           "mean_chars": sum(len(s["completion"]) for s in res.samples) / len(rows), "seconds": res.seconds}
    if k > 1:
        out["zero_variance_groups"] = float((reward.max(1).values == reward.min(1).values).double().mean())
        out["distinct_per_problem"] = sum(len({s["completion"] for s in res.samples[i * k:(i + 1) * k]})
                                          for i in range(len(problems))) / len(problems)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--task", default="countdown")
    ap.add_argument("--task-options", default='{"num_numbers": 3}', help="JSON")
    ap.add_argument("--split", choices=["validation", "test"], default="validation")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--decoders", nargs="+", choices=list(DECODERS), default=list(DECODERS))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task(args.task, **json.loads(args.task_options))
    problems = task.generate(args.n, split=args.split, seed=0)
    out = ROOT / "benchmarks" / "results" / f"decoding_start-{args.tag}.json"
    result = {"args": vars(args), "decoders": DECODERS, "results": {}}
    for model in args.models:
        result["results"][model] = {}
        for name in args.decoders:
            stops = DECODERS[name]
            t0 = time.perf_counter()
            policy = load_policy(ModelConfig(path=model, stop_tokens=stops))
            row = {"greedy": measure(policy, task, problems, 0.0, 1)}
            for temp in args.temperatures:
                row[f"t{temp:g}"] = measure(policy, task, problems, temp, args.k)
            result["results"][model][name] = row
            print(model, name, f"({time.perf_counter() - t0:.0f} s)", json.dumps(row), flush=True)
            out.write_text(json.dumps(result, indent=1))  # partial results survive an interruption
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
