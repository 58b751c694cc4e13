"""Where a cached rollout's time goes: one rollout of `benchmarks/gpu_check.py`'s policy (the
native LLaDA at 8B shape, LoRA, bf16 autocast) under the dual cache, timed, then run again
under torch.profiler, then timed with the LoRA weights merged into the base (peft's
`merge_adapter`: the adapters' own kernels gone, the model's function unchanged up to rounding;
last, as unmerging bf16 weights does not give them back to the bit). The sampler runs LoRA layers
through its short forward (`stabledrl.models.lora.lean_adapters`) since 2026-11-29; the profile
in docs/gpu-check.md was taken before, under peft's.

    python benchmarks/lab/rollout_profile.py --out benchmarks/results/rollout_profile-h200.json
    python benchmarks/lab/rollout_profile.py --size tiny --device cpu --rows 4 --gen-length 16 \\
        --block-length 4 --steps 8 --prompt-length 8                       # the same path, in seconds

Prints the profiler's operators by their own device time and by their own host time, and
writes the timings and both tables' top rows to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_check  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--scheme", default="dual", choices=list(gpu_check.SCHEMES), help="the rollout's cache")
    mine, rest = own.parse_known_args(argv)
    args = gpu_check._args(rest)  # the model, the rows, the lengths and --out, as gpu_check takes them
    scheme = mine.scheme
    cuda = torch.device(args.device).type == "cuda"
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    policy, _ = gpu_check.build(args)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=not cuda, mixed_precision="bf16")
    policy.model = acc.prepare(policy.model)
    vocab = gpu_check._inner(policy.model).config.vocab_size
    ids = torch.randint(5, vocab, (args.rows, args.prompt_length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(policy.device)

    def rollout(steps: int) -> tuple[float, int]:
        seconds, gen = gpu_check.timed_rollout(policy, args, ids, cuda, scheme, steps)
        return seconds, gen.forward_passes

    blocks = -(-args.gen_length // args.block_length)
    rollout(min(2 * blocks, args.steps))  # warm-up: a block's first call and a later one (gpu_check's)
    report: dict = {"command": "python benchmarks/lab/rollout_profile.py " + " ".join(argv),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "scheme": scheme}
    report["seconds"], report["calls"] = rollout(args.steps)
    print(f"{scheme}: {report['seconds']:.2f} s, {report['calls']} calls", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        report["profiled_seconds"], _ = rollout(2 * blocks)  # a block's first call and one later call (whole rollouts: too many events to sort)
    events = prof.key_averages()
    dev = "self_device_time_total" if cuda else "self_cpu_time_total"
    for key, label in ((dev, "device"), ("self_cpu_time_total", "host")):
        rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:25]
        report[f"top_by_{label}"] = [{"op": e.key, "count": e.count, "self_device_ms": getattr(e, dev) / 1e3,
                                      "self_host_ms": e.self_cpu_time_total / 1e3} for e in rows]
        print(f"-- by own {label} time: op, calls, device ms, host ms")
        for r in report[f"top_by_{label}"]:
            print(f"{r['op'][:60]:60s} {r['count']:7d} {r['self_device_ms']:10.1f} {r['self_host_ms']:10.1f}")
    report["device_ms_total"] = sum(getattr(e, dev) for e in events) / 1e3
    report["host_ms_total"] = sum(e.self_cpu_time_total for e in events) / 1e3
    print(f"total own device time {report['device_ms_total']:.0f} ms, host {report['host_ms_total']:.0f} ms", flush=True)
    inner = policy.model
    while hasattr(inner, "module"):
        inner = inner.module
    if hasattr(inner, "merge_adapter"):
        inner.merge_adapter()
        report["merged_seconds"], _ = rollout(args.steps)
        inner.unmerge_adapter()
        print(f"{scheme}, LoRA merged: {report['merged_seconds']:.2f} s", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
