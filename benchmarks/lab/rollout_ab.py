"""This checkout's LoRA rollout against a baseline commit's, side by side, where launching
operations is the cost: `benchmarks/lora_rollout.py`'s proxy (LLaDA-8B's depth, width 64, LoRA r 16,
bf16 weights, accelerate's bf16 autocast, one CPU thread; 16 rows, 256 tokens in blocks of 32, 128
steps, the dual cache), one process per checkout and round, the checkouts alternated so that load
moves both alike. Each process seeds the same weights and prompts, so where a change keeps the
model's numbers the completions must agree, and are compared.

    python benchmarks/lab/rollout_ab.py --baseline b023383 --out benchmarks/results/rollout_ab-rope.json

Per checkout and variant (`lean`: the sampler's short LoRA forward; `off`: the adapters off, as
gpu_check times them): each timed rollout's seconds and their median, the operations dispatched in
a later model call (lora_rollout's count), and this checkout's median over the baseline's. The
baseline is checked out with `git worktree` into a temporary folder (it needs
benchmarks/lora_rollout.py: 2026-11-29 or later), removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
VARIANTS = ("lean", "off")


def child(root: Path, repeats: int) -> dict:
    """Times the rollouts of one checkout (imported from `root`): run in a process of its own."""
    sys.path[:0] = [str(root / "src"), str(root / "benchmarks")]
    import torch

    import lora_rollout as lr

    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = argparse.Namespace(width=64, vocab=1024, layers=32, lora_r=16, gen_length=256, block_length=32)
    policy = lr.build(args)
    policy.stop_token_ids = ()  # every row runs every step (lora_rollout.build does so since 2026-11-29)
    ids = torch.randint(5, args.vocab, (16, 32), generator=torch.Generator().manual_seed(0))
    out: dict = {"root": str(root)}
    for v in VARIANTS:  # warm-up, and the operations of a later call
        counted = lr._Counted(policy)
        lr.rollout(counted, args, ids, "dual", v, 16)
        out[v] = {"ops_last_call": counted.last, "seconds": []}
    for _ in range(repeats):
        for v in VARIANTS:
            seconds, tokens = lr.rollout(policy, args, ids, "dual", v, 128)
            out[v]["seconds"].append(seconds)
            out[v]["tokens_sha1"] = hashlib.sha1(tokens.numpy().tobytes()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare with (any git revision)")
    ap.add_argument("--rounds", type=int, default=4, help="processes per checkout, alternated")
    ap.add_argument("--repeats", type=int, default=2, help="timed rollouts per variant in each process")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_ab.json"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return {}
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], capture_output=True,
                          text=True, check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), base], check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                for name, root in (("baseline", tree), ("this", REPO)):
                    done = subprocess.run([sys.executable, str(HERE), "--baseline", base, "--child", str(root),
                                           "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
                    runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"round {r + 1}, {name}: " + ", ".join(
                        f"{v} {statistics.median(runs[name][-1][v]['seconds']):.2f} s" for v in VARIANTS), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    report: dict = {"command": "python benchmarks/lab/rollout_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "this": head, "baseline": base, "rounds": args.rounds, "repeats": args.repeats, "variants": {}}
    for v in VARIANTS:
        row = {}
        for name in runs:
            seconds = [s for run in runs[name] for s in run[v]["seconds"]]
            row[name] = {"seconds": seconds, "median_seconds": statistics.median(seconds),
                         "ops_last_call": runs[name][0][v]["ops_last_call"]}
        row["this_over_baseline"] = row["this"]["median_seconds"] / row["baseline"]["median_seconds"]
        row["same_tokens"] = len({run[v]["tokens_sha1"] for name in runs for run in runs[name]}) == 1
        report["variants"][v] = row
        print(f"{v}: this {row['this']['median_seconds']:.2f} s ({row['this']['ops_last_call']} ops a later call), "
              f"baseline {row['baseline']['median_seconds']:.2f} s ({row['baseline']['ops_last_call']}): "
              f"{row['this_over_baseline']:.3f}; same tokens: {row['same_tokens']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
