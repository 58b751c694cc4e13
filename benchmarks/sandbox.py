"""The sandbox's overhead per program: `run_python` against a plain subprocess.

    python benchmarks/sandbox.py --repeats 50

Runs a trivial passing program (a function and two asserts, like a tiny HumanEval check)
`repeats` times in each of four ways, interleaved so that drift hits them alike:
the sandbox (every layer), the sandbox without the audit hook, a plain
``subprocess.run([sys.executable, "-c", code])``, and the same with the sandbox's
interpreter flags (-I -S -B), which separates interpreter start-up from the sandbox's
own cost. Then times a batch of programs through `CodeTask.reward`'s thread pool.
Writes medians to benchmarks/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stabledrl.sandbox import SandboxLimits, run_python

PROGRAM = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\nprint('ok')\n"


def plain(flags: list[str]) -> None:
    r = subprocess.run([sys.executable, *flags, "-c", PROGRAM], capture_output=True, timeout=10)
    assert r.returncode == 0 and r.stdout == b"ok\n", r


def sandboxed(audit_hook: bool) -> None:
    r = run_python(PROGRAM, SandboxLimits(timeout_s=10), audit_hook=audit_hook)
    assert r.ok and r.stdout == "ok\n", r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32, help="programs in the batch measurement")
    ap.add_argument("--workers", type=int, default=2, help="threads in the batch measurement")
    ap.add_argument("--out", default="benchmarks/results/sandbox.json")
    args = ap.parse_args()

    variants = {
        "sandbox": lambda: sandboxed(True),
        "sandbox_without_audit_hook": lambda: sandboxed(False),
        "plain_subprocess": lambda: plain([]),
        "plain_subprocess_same_flags": lambda: plain(["-I", "-S", "-B"]),
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if r:
                runs[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(xs) for name, xs in runs.items()}

    with ThreadPoolExecutor(args.workers) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda _: run_python(PROGRAM, SandboxLimits(timeout_s=10)), range(args.batch)))
        batch_seconds = time.perf_counter() - t0
    assert all(r.ok for r in results)

    result = {
        "program": PROGRAM, "repeats": args.repeats,
        "median_seconds": median,
        "overhead_seconds_median": median["sandbox"] - median["plain_subprocess"],
        "overhead_vs_same_flags_seconds_median": median["sandbox"] - median["plain_subprocess_same_flags"],
        "slowdown_vs_plain": median["sandbox"] / median["plain_subprocess"],
        "batch": {"programs": args.batch, "workers": args.workers, "seconds": batch_seconds,
                  "programs_per_second": args.batch / batch_seconds},
        "layers": list(results[0].layers), "as_root": os.geteuid() == 0,
        "python": platform.python_version(), "machine": platform.machine(), "kernel": platform.release(),
        "cpus": os.cpu_count(), "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "program")}, indent=2))


if __name__ == "__main__":
    main()
