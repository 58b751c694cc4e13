"""Does the real run start on a GPU? `accelerate launch` of `stabledrl train` under the shipped
FSDP config on the stand-ins of LLaDA, Dream and SDAR, and the README's main command on the GPU.

    python benchmarks/gpu_start.py                         # CUDA: the three stand-ins, then the main command
    python benchmarks/gpu_start.py --models llada --no-main --mixed-precision no   # (any machine)

The stand-ins are `tests/models/fake_dllm.py`'s classes at tiny sizes, saved as remote-code
checkpoints by `tests/models/test_adapters.py:save_stand_ins`: each declares what the real
modelling file declares (`_no_split_modules`, the attention mask's handling, SDAR's flash-attn
imports; the file and line of each are written beside it there). Each runs as the recipes launch
a real checkpoint: `accelerate launch --config_file configs/accelerate/fsdp.yaml` (FSDP2, layers
wrapped by `_no_split_modules`) with `--num_processes` (1) and bf16 mixed precision, 2 steps of
StableDRL on Sudoku (adapter auto; the `mc` estimator, SDAR's `blockwise`). What is recorded per
model: the exit status, the seconds, the last lines of stderr on failure, the distributed type
and the modules FSDP wrapped (the launched process reports them), the losses of the 2 steps, and
whether the saved weights moved. `--main` (default on) runs the README's first command as it
stands (`stabledrl train --config configs/countdown-stabledrl.yaml`, default device: the GPU)
and records its last lines and seconds. JSON to `--out`. The stand-ins are built by the tests'
code, so this needs the repository checkout and the test extra (`pip install -e ".[test]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"


def _child(report: str, argv: list[str]) -> int:
    """The launched process: `stabledrl` with `argv`, reporting how `set_up` prepared the model."""
    import stabledrl.train as train_mod
    from stabledrl.cli import main

    real = train_mod.set_up

    def set_up(*args, **kwargs):
        run = real(*args, **kwargs)
        from torch.distributed.fsdp import FSDPModule

        model = run.policy.model
        if run.main:
            Path(report).write_text(json.dumps({
                "distributed_type": str(run.accelerator.distributed_type),
                "mixed_precision": run.accelerator.mixed_precision,
                "device": str(run.device),
                "fsdp_wrapped": sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)}),
                "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            }))
        return run

    train_mod.set_up = set_up
    return main(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_in_run(name: str, path: Path, work: Path, args) -> dict:
    sets = {"model.path": str(path), "model.adapter": "auto", "output_dir": str(work / f"run-{name}"),
            "task.name": "sudoku", "steps": 2, "prompts_per_step": 2, "group_size": 4, "mu": 1, "lr": 1e-3,
            "eval_n": 2, "save_every": 2, "zero_variance_groups": "keep", "estimator.num_samples": 2,
            "estimator.method": "blockwise" if name == "sdar" else "mc", "mixed_precision": args.mixed_precision}
    empty = work / "empty.yaml"
    empty.write_text("{}\n")
    report = work / f"report-{name}.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
           "--num_processes", str(args.processes), "--num_machines", "1", "--mixed_precision", args.mixed_precision,
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(Path(__file__).resolve()), "--child",
           str(report), "train", "--config", str(empty)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = {"model": name, "rc": res.returncode, "seconds": round(time.perf_counter() - start, 1)}
    if res.returncode != 0:
        out["stderr_tail"] = res.stderr[-3000:]
        return out
    rows = [json.loads(x) for x in (work / f"run-{name}" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    from safetensors.torch import load_file

    before = load_file(path / "model.safetensors")
    after = load_file(work / f"run-{name}" / "final" / "model.safetensors")
    out.update(json.loads(report.read_text()) if report.exists() else {"report": "missing"})
    out.update(losses=losses, losses_finite=all(math.isfinite(x) for x in losses),
               weights_moved=any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before))
    return out


def _main_command(work: Path, args) -> dict:
    cmd = [sys.executable, "-m", "stabledrl", "train", "--config", "configs/countdown-stabledrl.yaml",
           "--set", f"output_dir={work / 'main'}"]
    for s in args.main_set:
        cmd += ["--set", s]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout_main)
    out = {"command": " ".join(cmd[2:]), "rc": res.returncode, "seconds": round(time.perf_counter() - start, 1),
           "last_lines": res.stdout.strip().splitlines()[-3:]}
    if res.returncode != 0:
        out["stderr_tail"] = res.stderr[-3000:]
    return out


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["llada", "dream", "sdar"], choices=["llada", "dream", "sdar"])
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    ap.add_argument("--main", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--main-set", nargs="*", default=[], help="--set overrides of the main command (e.g. steps=10)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--timeout-main", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_start.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.models.test_adapters import save_stand_ins

    import transformers
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
              "processes": args.processes, "mixed_precision": args.mixed_precision, "stand_ins": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dirs = save_stand_ins(work / "checkpoints")
        for name in args.models:
            result["stand_ins"].append(_stand_in_run(name, dirs[name], work, args))
            print(json.dumps(result["stand_ins"][-1])[:600], flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if args.main:
            result["main_command"] = _main_command(work, args)
            print(json.dumps(result["main_command"]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return int(any(r["rc"] for r in result["stand_ins"]) or result.get("main_command", {}).get("rc", 0))


if __name__ == "__main__":
    sys.exit(main())
