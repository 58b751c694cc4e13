"""GRPO vs StableDRL (and wd1, SPG, the authors' StableDRL) under noisy ratios: does GRPO's instability loop appear?

    # the README's regime: GRPO collapses, StableDRL gains (noisy ratios: independent masks)
    python benchmarks/stability.py --seeds 0 1 2 --steps 120 --lr 1e-4 --set masks=independent \
        --set estimator.num_samples=2 --set eval_n=1592 --set threads=1 --tag test-R5-120
    # one process per run (2 at a time on 2 cores), then once more with all seeds for the JSON
    python benchmarks/stability.py --seeds 1 --objectives grpo ... --tag test-R5-120
    # the authors' StableDRL (configs/countdown-stabledrl-official.yaml) in the same regime
    python benchmarks/stability.py --seeds 0 1 2 --steps 120 --lr 1e-4 --objectives stabledrl-official \
        --set eval_n=1592 --set threads=1 --tag test-R5-120-official

Runs `configs/<preset>-grpo.yaml` and `configs/<preset>-stabledrl.yaml` for each seed
(`--preset countdown`, the default, or `countdown-block` for the block-diffusion model)
with identical data, estimator, learning rate and μ (any `--set` applies to both), then
reports per run: the reward curve, gradient spikes (norm before clipping > 5x its running
median over the previous 10 steps), largest finite and median gradient norm, the number
of steps whose gradient was not finite (skipped by the trainer), variance of log ρ, mean
bypass fraction, and held-out accuracy before and after. Writes JSON and one figure to
benchmarks/results/stability-<tag>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from stabledrl.checkpoint import finished_summary
from stabledrl.config import load_config
from stabledrl.report import load_metrics, plot_runs
from stabledrl.objectives import OBJECTIVES
from stabledrl.train import TrainConfig, run_train


def spikes(norms: list[float], factor: float = 5.0, window: int = 10) -> int:
    """Count steps whose gradient norm exceeds `factor` x the median of the previous `window`."""
    count = 0
    for i in range(1, len(norms)):
        past = norms[max(0, i - window):i]
        if norms[i] > factor * statistics.median(past):
            count += 1
    return count


def summarise(run_dir: Path, summary: dict) -> dict:
    rows = [r for r in load_metrics(run_dir) if "grad_norm" in r]
    # metrics.jsonl writes a non-finite value as null: count it as an infinite norm (a spike)
    grad = [math.inf if r["grad_norm"] is None else r["grad_norm"] for r in rows]
    finite = [g for g in grad if math.isfinite(g)]
    norms = [g for g in grad if g == g]  # drop NaN, keep inf
    log_std = [r["log_ratio_std"] for r in rows if r.get("log_ratio_std") is not None]
    curve = [r["reward_mean"] for r in load_metrics(run_dir) if "reward_mean" in r]
    sixth = max(1, len(curve) // 6)
    return {
        "run": str(run_dir),
        "reward_curve": curve,
        # training reward, mean over the first and the last sixth of the steps
        "reward_first_sixth": statistics.mean(curve[:sixth]) if curve else None,
        "reward_last_sixth": statistics.mean(curve[-sixth:]) if curve else None,
        # the trainer's own verdict (stabledrl.diagnostics.CollapseMonitor): why it flagged the run
        "collapse": summary.get("collapse", []),
        "spikes": spikes(norms) if norms else 0,
        "grad_norm_max": max(finite) if finite else None,
        "grad_norm_nonfinite_steps": len(rows) - len(finite),
        "grad_norm_median": statistics.median(norms) if norms else None,
        "log_ratio_var_mean": statistics.mean(v ** 2 for v in log_std) if log_std else None,
        "bypass_fraction_mean": statistics.mean(r["bypass_fraction"] for r in rows) if rows else None,
        "skipped_steps": summary["skipped_steps"],
        "eval_initial": summary["eval_initial"], "eval_final": summary["eval_final"],
    }


def check_presets(ap: argparse.ArgumentParser, preset: str, names: list[str]) -> None:
    """Stop with a usage error naming each configs/<preset>-<name>.yaml that does not exist."""
    missing = [f"configs/{preset}-{name}.yaml" for name in names if not Path(f"configs/{preset}-{name}.yaml").is_file()]
    if missing:
        ap.error(f"no preset {', '.join(missing)}: choose --objectives that {preset} has")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--set", action="append", default=[], help="override for every objective")
    ap.add_argument("--preset", default="countdown", help="configs/<preset>-<objective>.yaml")
    ap.add_argument("--objectives", nargs="+", default=["grpo", "stabledrl"],
                    help="the presets' suffixes, configs/<preset>-<name>.yaml: an objective (grpo, stabledrl, wd1, "
                         "spg) or a variant such as stabledrl-official; run only these (say, one per process), "
                         "and a later call with all of them reuses finished runs")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--runs-dir", default="runs/stability")
    args = ap.parse_args()
    check_presets(ap, args.preset, args.objectives)
    results = []
    run_dirs = []
    for seed in args.seeds:
        for name in args.objectives:
            out = Path(args.runs_dir) / args.tag / f"{name}-seed{seed}"
            cfg = load_config(TrainConfig, f"configs/{args.preset}-{name}.yaml",
                              [f"output_dir={out}", f"seed={seed}", f"steps={args.steps}", f"lr={args.lr}",
                               "save_every=1000000", *args.set])
            summary = finished_summary(out, cfg)  # finished earlier with this config: reuse it
            if summary is None:  # fresh, or resumed after an interruption
                summary = run_train(cfg, resume=any(out.glob("checkpoint-*")))
            results.append({"objective": name, "seed": seed, **summarise(out, summary)})
            run_dirs.append(out)
            r = results[-1]
            print(f"{name:9s} seed {seed}: spikes {r['spikes']}, grad max {r['grad_norm_max']:.3g}, "
                  f"median {r['grad_norm_median']:.3g}, accuracy {r['eval_initial']['accuracy']:.3f} -> "
                  f"{r['eval_final']['accuracy']:.3f}, training reward {r['reward_first_sixth']:.3f} -> "
                  f"{r['reward_last_sixth']:.3f}, collapse {r['collapse'] or 'no'}", flush=True)
    out = Path("benchmarks/results") / f"stability-{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": results}, indent=2))
    # grpo blue, stabledrl orange, wd1 green, spg red, then the variants (stabledrl-official purple)
    names = [*OBJECTIVES, *sorted(set(args.objectives) - set(OBJECTIVES))]
    palette = {name: f"C{i}" for i, name in enumerate(names)}
    plot_runs(run_dirs, out.with_suffix(".png"), colors=[palette[r["objective"]] for r in results])
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
