"""Step time of one training process vs two (gloo, CPU) on the shipped tiny model.

Runs the README's main preset (configs/countdown-stabledrl.yaml) for a few steps in
three layouts — 1 process × 1 thread, 1 process × 2 threads, 2 processes × 1 thread
(`accelerate launch --multi_gpu --num_processes 2`, which the trainer turns into a gloo
group of CPU processes) — and reports the median step time and its parts from each run's
metrics.jsonl. The layouts run one after another on an otherwise idle machine; the
first step of each run is dropped (warm-up).

    python benchmarks/processes.py --steps 12   # -> benchmarks/results/processes.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("seconds", "time_rollout", "time_likelihood_old", "time_update", "time_backward", "framework_share")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(layout: str, processes: int, threads: int, steps: int, out: Path) -> dict:
    sets = [f"output_dir={out}", f"steps={steps}", "eval_n=16", f"threads={threads}", f"save_every={steps}"]
    train = ["-m", "stabledrl", "train", "--config", str(ROOT / "configs" / "countdown-stabledrl.yaml")]
    for s in sets:
        train += ["--set", s]
    if processes == 1:
        cmd = [sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_port()), *train]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"{layout} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "seconds" in r][1:]  # drop the warm-up step
    summary = {k: statistics.median(r.get(k, 0.0) for r in steps_rows) for k in KEYS}
    summary.update(layout=layout, processes=processes, threads_per_process=threads, steps_timed=len(steps_rows))
    print(f"{layout}: median step {summary['seconds']:.3f} s (rollout {summary['time_rollout']:.3f}, "
          f"update {summary['time_update']:.3f})", flush=True)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "processes.json"))
    args = p.parse_args()
    layouts = [("1 process x 1 thread", 1, 1), ("1 process x 2 threads", 1, 2), ("2 processes x 1 thread", 2, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, n, t, args.steps, Path(tmp) / f"run{i}") for i, (name, n, t) in enumerate(layouts)]
    base = results[0]["seconds"]
    for r in results:
        r["speedup_vs_1x1"] = base / r["seconds"]
    report = {"preset": "configs/countdown-stabledrl.yaml", "steps": args.steps, "results": results,
              "command": "python benchmarks/processes.py --steps %d" % args.steps}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
