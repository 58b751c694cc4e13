"""Does a version of stabledrl train exactly as another? Short runs of every RL preset.

    python benchmarks/equivalence.py --root /path/to/old/checkout --out old.json
    python benchmarks/equivalence.py --root . --out new.json
    python benchmarks/equivalence.py --compare old.json new.json

Each run is `stabledrl train --config <preset>` for 3 steps with a small held-out set
(`eval_n=8`), in a fresh process that imports `--root`'s src/ and reads its configs/ and checkpoints/. The JSON holds, per run, the
sha256 of every tensor of the final weights and the metrics.jsonl rows without their
timing keys. `--compare` says which runs differ: the weights must be bit-identical and the
metrics equal (keys one side logs and the other does not are listed, not failed).
Besides the presets, a few variants exercise the loop's other paths (gradient agreement,
resampling, the weights' own masks, LoRA). The large-batch preset runs with 64 prompts a
step instead of 6,400 (its view budget is what it adds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["steps=3", "eval_n=8", "save_every=3", "threads=1", "eval_every=0"]
EXTRA = {  # preset -> overrides beyond COMMON
    "countdown-block-stabledrl-large-batch": ["prompts_per_step=64"],
}
VARIANTS = {  # name -> (preset, overrides): paths no preset takes
    "grad-agreement": ("countdown-stabledrl", ["grad_agreement=true", "prompts_per_step=8"]),
    "resample": ("countdown-grpo", ["zero_variance_groups=resample", "prompts_per_step=8"]),
    "keep-sgd": ("countdown-wd1", ["zero_variance_groups=keep", "optimizer=sgd", "prompts_per_step=8"]),
    "weight-masks": ("countdown-stabledrl", ["objective.separate_weight_masks=true", "masks=independent", "mu=2",
                                             "prompts_per_step=8"]),
    "view-budget-mu2": ("countdown-stabledrl", ["estimator.max_views_per_forward=3", "mu=2", "prompts_per_step=8"]),
    "lora-beta": ("countdown-grpo", ["lora={r: 4}", "objective.beta=0.05", "mu=2", "masks=independent",
                                     "prompts_per_step=8"]),
}
TIMING = ("seconds", "framework_share")


def _local_model(config: Path, root: Path) -> bool:
    """Whether a preset's model ships in the checkout (the real-model recipes name Hub checkpoints)."""
    import yaml

    model = (yaml.safe_load(config.read_text()) or {}).get("model", "checkpoints/countdown-tiny")
    return (root / (model["path"] if isinstance(model, dict) else model)).is_dir()


def _runs(root: Path) -> dict[str, tuple[str, list[str]]]:
    presets = sorted(p.stem for p in (root / "configs").glob("*.yaml")
                     if not p.stem.startswith("sft-") and _local_model(p, root))
    return {**{p: (p, EXTRA.get(p, [])) for p in presets}, **VARIANTS}


def _weights(model_dir: Path) -> dict[str, str]:
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k, t in sorted(load_file(str(f)).items()):
            out[f"{f.name}:{k}"] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time_")} for r in rows]


def run_all(root: Path, out: Path, only: list[str] | None) -> None:
    root = root.resolve()
    results = json.loads(out.read_text()) if out.exists() else {}
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    for name, (preset, sets) in _runs(root).items():
        if (only and name not in only) or results.get(name, {}).get("returncode") == 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / name
            args = [sys.executable, "-m", "stabledrl", "train", "--config", str(root / "configs" / f"{preset}.yaml")]
            for s in [*COMMON, *sets, f"output_dir={run_dir}"]:
                args += ["--set", s]
            t0 = time.time()
            proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
            entry = {"returncode": proc.returncode, "seconds": round(time.time() - t0, 1)}
            if proc.returncode == 0:
                entry.update(weights=_weights(run_dir / "final"), metrics=_metrics(run_dir / "metrics.jsonl"),
                             summary=json.loads((run_dir / "summary.json").read_text()))
            else:
                entry["stderr"] = proc.stderr[-3000:]
        results[name] = entry
        out.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"{name}: rc {entry['returncode']} in {entry['seconds']} s", flush=True)


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'new' if name in b else 'old'}")
            bad += 1
            continue
        ra, rb = a[name], b[name]
        if ra["returncode"] or rb["returncode"]:
            print(f"{name}: return codes {ra['returncode']} / {rb['returncode']}")
            bad += 1
            continue
        same_w = ra["weights"] == rb["weights"]
        only_a, only_b, diff = set(), set(), []
        if len(ra["metrics"]) != len(rb["metrics"]):
            diff.append(f"{len(ra['metrics'])} rows vs {len(rb['metrics'])}")
        for x, y in zip(ra["metrics"], rb["metrics"]):
            only_a |= set(x) - set(y)
            only_b |= set(y) - set(x)
            diff += [f"step {x.get('step')} {k}: {x[k]!r} vs {y[k]!r}" for k in set(x) & set(y) if x[k] != y[k]]
        sa = ra["summary"]
        sb = rb["summary"]
        diff += [f"summary {k}" for k in set(sa) | set(sb) if sa.get(k) != sb.get(k)]
        ok = same_w and not diff
        bad += not ok
        print(f"{name}: weights {'identical' if same_w else 'DIFFER'}, metrics {'equal' if not diff else 'DIFFER'}"
              + (f"; keys only old {sorted(only_a)}" if only_a else "") + (f"; only new {sorted(only_b)}" if only_b else ""))
        for d in diff[:10]:
            print("   ", d)
    print("all equal" if not bad else f"{bad} run(s) differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="the checkout to run (its src, configs, checkpoints)")
    ap.add_argument("--out", type=Path, help="JSON to write (runs already in it are not run again)")
    ap.add_argument("--only", nargs="*", help="run these names only")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    run_all(args.root, args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
