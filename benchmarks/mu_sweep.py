"""Rollout reuse: held-out accuracy per rollout for each objective at μ = 1, 2 and 4 inner iterations.

    # every cell, two processes at a time on 2 cores (--shard), then once more to write the JSON
    python benchmarks/mu_sweep.py --preset countdown --seeds 0 1 2 --shard 0/2 &
    python benchmarks/mu_sweep.py --preset countdown --seeds 0 1 2 --shard 1/2
    python benchmarks/mu_sweep.py --preset countdown --seeds 0 1 2

The question (issue 27, goal 3): a stabilised ratio objective exists to reuse rollouts —
several inner iterations on noisy ELBO ratios. So every run here draws the same number of
rollouts (`--steps` x `--rollouts` per step) and differs only in the objective's preset
(`configs/<preset>-<objective>.yaml`, its own estimator, decoder and learning rate) and μ.
The masks are independent (fresh masks for ℓ_θ in every inner iteration, as the authors of
StableDRL run it), so the ratio is noisy even at μ = 1: the regime where GRPO's conditional
clip lets it through and StableDRL's unconditional clip and group self-normalisation do not.

Per run: greedy accuracy (the default decoder) on `--eval-n` validation problems at steps 0,
`--eval-every`, ... (the curve, from which settings are read), on the whole test split at the
end (the figure reported, not tuned to), and the ratio diagnostics averaged over the run (std
of log ρ, bypass fraction, ESS, clip fraction) beside the gradient spikes and the trainer's
collapse verdict (benchmarks/stability.py's `summarise`). Runs go to
`<runs-dir>/<preset>-<tag>/<objective>-mu<μ>-seed<seed>`; a finished run is reused. Writes
benchmarks/results/mu_sweep-<preset>-<tag>.json and a figure beside it (accuracy against
rollouts, one panel per objective, one line per μ: the mean over seeds, each seed faint), and
prints the two tables of docs/rollout-reuse.md (per objective and μ; per run); `--table`
prints them again from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stability import check_presets, summarise  # noqa: E402  (benchmarks/ is a folder of scripts)

from stabledrl.checkpoint import finished_summary  # noqa: E402
from stabledrl.config import load_config  # noqa: E402
from stabledrl.evaluate import evaluate  # noqa: E402
from stabledrl.models import load_policy  # noqa: E402
from stabledrl.report import accuracy_curve, load_metrics  # noqa: E402
from stabledrl.tasks import get_task  # noqa: E402
from stabledrl.train import TrainConfig, run_train  # noqa: E402

OBJECTIVES = ["grpo", "stabledrl", "stabledrl-official", "spg"]
NAMES = {"grpo": "GRPO", "stabledrl": "StableDRL", "stabledrl-official": "StableDRL on SPG (the authors')",
         "spg": "SPG"}
TEST_N = {"countdown": 1592, "sudoku": 1000}  # the whole test split of each
RATIO_KEYS = ["log_ratio_std", "bypass_fraction", "ess", "clip_fraction"]


def cells(args) -> list[tuple[int, str, int]]:
    """Every (seed, objective, μ) of the sweep, seed-major so that seed 0 finishes first."""
    return [(seed, name, mu) for seed in args.seeds for name in args.objectives for mu in args.mus]


def config(args, seed: int, name: str, mu: int) -> TrainConfig:
    """The preset configs/<preset>-<name>.yaml with only what the sweep varies or fixes set:
    seed, μ, steps, `--rollouts` per step (prompts = rollouts / the preset's G), independent
    masks, the evaluation schedule, one thread; `--set` last, so it overrides any of them."""
    path = f"configs/{args.preset}-{name}.yaml"
    base = load_config(TrainConfig, path)
    if args.rollouts % base.group_size:
        raise SystemExit(f"--rollouts {args.rollouts} is not a multiple of {path}'s group_size {base.group_size}")
    out = Path(args.runs_dir) / f"{args.preset}-{args.tag}" / f"{name}-mu{mu}-seed{seed}"
    return load_config(TrainConfig, path, [
        f"output_dir={out}", f"seed={seed}", f"steps={args.steps}", f"mu={mu}",
        f"prompts_per_step={args.rollouts // base.group_size}", "masks=independent",
        f"eval_every={args.eval_every}", f"eval_n={args.eval_n}", f"eval_split={args.eval_split}",
        "save_every=1000000", "threads=1", *args.set])


def accuracy_on_test(cfg: TrainConfig, model: str | Path, cache: Path) -> float:
    """Greedy accuracy of `model` under the run's evaluation decoder on the whole test split
    (the preset's task; Countdown 1,592 problems, Sudoku 1,000), kept in `cache`."""
    if cache.is_file():
        return json.loads(cache.read_text())["accuracy"]
    task = get_task(cfg.task.name, **cfg.task.options)
    problems = task.generate(TEST_N[cfg.task.name], split="test", seed=0)
    res = evaluate(load_policy(model), task, problems, cfg.eval_sampling, progress=False)
    cache.parent.mkdir(parents=True, exist_ok=True)
    part = cache.with_suffix(f".{os.getpid()}.part")  # two shards may measure the base at once
    part.write_text(json.dumps({"model": str(model), "n": len(problems), "accuracy": res.accuracy}))
    part.replace(cache)
    return res.accuracy


def mean_or_none(values) -> float | None:
    """The mean of the values that are not None (an objective without weights logs no ESS)."""
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def run_means(run_dir: Path) -> dict[str, float | None]:
    """The ratio diagnostics averaged over the run's steps, and the rollouts' entropy over its last 5."""
    rows = [r for r in load_metrics(run_dir) if "grad_norm" in r]
    return {**{f"{key}_mean": mean_or_none(r.get(key) for r in rows) for key in RATIO_KEYS},
            "entropy_last_5": mean_or_none(r.get("entropy") for r in rows[-5:])}


def cell_runs(results: list[dict], name: str, mu: int) -> list[dict]:
    """The runs of one objective at one μ, in seed order."""
    return sorted((r for r in results if r["objective"] == name and r["mu"] == mu), key=lambda r: r["seed"])


def summary_table(results: list[dict], args) -> dict[str, dict]:
    """Per objective and μ: the test accuracy before and after, the run means of the diagnostics."""
    table = {}
    for name in args.objectives:
        for mu in args.mus:
            runs = cell_runs(results, name, mu)
            table[f"{name} mu={mu}"] = {
                "test_initial": runs[0]["test_initial"],
                "test_final": [r["test_final"] for r in runs],
                "test_final_mean": statistics.mean(r["test_final"] for r in runs),
                "validation_initial": runs[0]["eval_initial"]["accuracy"],
                "validation_final_mean": statistics.mean(r["eval_final"]["accuracy"] for r in runs),
                **{f"{key}_mean": mean_or_none(r[f"{key}_mean"] for r in runs) for key in RATIO_KEYS},
                "spikes": sum(r["spikes"] for r in runs),
                "collapsed_runs": sum(bool(r["collapse"]) for r in runs),
            }
    return table


def markdown_table(results: list[dict], args) -> str:
    """The table of docs/rollout-reuse.md §1: one row per objective and μ, test accuracy of every
    seed before → after, the mean change in points, the validation accuracy at the end (mean of
    the seeds), the run means of the ratio diagnostics, spikes per seed and the flagged runs."""

    def num(x, digits):
        return "—" if x is None else f"{x:.{digits}g}"

    def pct(x):
        return f"{100 * x:.1f}"

    lines = [f"| objective | μ | test before → after (seeds {' / '.join(map(str, args.seeds))}) | mean change "
             "| validation after (mean) | std log ρ | bypass | ESS (of G) | clipped | gradient spikes "
             "| runs flagged collapsed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.objectives:
        for mu in args.mus:
            runs = cell_runs(results, name, mu)
            if not runs:
                continue
            before, after = runs[0]["test_initial"], [r["test_final"] for r in runs]
            change = f"{100 * (statistics.mean(after) - before):+.1f}".replace("-", "\N{MINUS SIGN}")
            means = {key: mean_or_none(r[f"{key}_mean"] for r in runs) for key in RATIO_KEYS}
            lines.append(" | ".join([
                f"| {NAMES.get(name, name)}", str(mu), f"{pct(before)}% → {' / '.join(map(pct, after))}%", change,
                f"{pct(statistics.mean(r['eval_final']['accuracy'] for r in runs))}%",
                num(means["log_ratio_std"], 3), num(means["bypass_fraction"], 2), num(means["ess"], 3),
                num(means["clip_fraction"], 2), " / ".join(str(r["spikes"]) for r in runs),
                f"{sum(bool(r['collapse']) for r in runs)} of {len(runs)} |"]))
    return "\n".join(lines)


def short_float(x: float) -> str:
    """5e-05 -> 5e-5, 0.00025 -> 2.5e-4: a learning rate as the docs write it."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def curves_table(results: list[dict], args) -> str:
    """The table of docs/rollout-reuse.md §2: one row per run, with its masks and learning rate,
    the test accuracy at the end, the validation curve, the rollouts' entropy over the last 5 steps
    and the run's mean std of log ρ."""
    if not results:
        return ""
    order = {(name, mu): i for i, (name, mu) in enumerate((n, m) for n in args.objectives for m in args.mus)}
    runs = sorted(results, key=lambda r: (order[r["objective"], r["mu"]], r["seed"]))
    steps = " / ".join(str(s) for s, _ in runs[0]["accuracy_curve"])
    lines = [f"| objective | masks | lr | μ | seed | test after (from {100 * runs[0]['test_initial']:.1f}%) "
             f"| validation at steps {steps} | entropy, last 5 steps | std log ρ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cfg = config(args, r["seed"], r["objective"], r["mu"])
        entropy, std = r.get("entropy_last_5"), r["log_ratio_std_mean"]
        lines.append(" | ".join([
            f"| {NAMES.get(r['objective'], r['objective'])}", cfg.masks, short_float(cfg.lr), str(r["mu"]),
            str(r["seed"]), f"{100 * r['test_final']:.1f}%",
            " / ".join(f"{100 * a:.1f}" for _, a in r["accuracy_curve"]),
            "—" if entropy is None else f"{entropy:.2f}", "—" if std is None else f"{std:.3g}"]) + " |")
    return "\n".join(lines)


def plot(results: list[dict], args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.objectives), figsize=(4 * len(args.objectives), 3.4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, args.objectives):
        for i, mu in enumerate(args.mus):
            runs = cell_runs(results, name, mu)
            if not runs:
                continue
            for r in runs:
                steps, acc = zip(*r["accuracy_curve"])
                ax.plot([s * args.rollouts for s in steps], acc, color=f"C{i}", alpha=0.25, lw=0.8)
            steps = [s for s, _ in runs[0]["accuracy_curve"]]
            mean = [statistics.mean(r["accuracy_curve"][j][1] for r in runs) for j in range(len(steps))]
            ax.plot([s * args.rollouts for s in steps], mean, color=f"C{i}", lw=2, marker="o", label=f"μ = {mu}")
        ax.set_title(name)
        ax.set_xlabel("rollouts drawn")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out accuracy ({args.eval_split}, {args.eval_n})")
    axes[0].legend()
    masks = config(args, args.seeds[0], args.objectives[0], args.mus[0]).masks
    fig.suptitle(f"{args.preset}: accuracy per rollout at μ inner iterations\n({masks} masks; "
                 f"mean of {len(args.seeds)} seed(s), each seed faint)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="countdown", help="configs/<preset>-<objective>.yaml")
    ap.add_argument("--objectives", nargs="+", default=OBJECTIVES)
    ap.add_argument("--mus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rollouts", type=int, default=128, help="rollouts per step, the same for every objective")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-n", type=int, default=500)
    ap.add_argument("--eval-split", default="validation", choices=["validation", "test"])
    ap.add_argument("--set", action="append", default=[], help="override for every run")
    ap.add_argument("--shard", default="0/1", help="K/N: run only every N-th cell from the K-th (one per process)")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--runs-dir", default="runs/mu_sweep")
    ap.add_argument("--table", action="store_true",
                    help="print the two markdown tables of the sweep's JSON (benchmarks/results/) and run nothing")
    args = ap.parse_args()
    out = Path("benchmarks/results") / f"mu_sweep-{args.preset}-{args.tag}.json"
    if args.table:
        if not out.exists():
            raise SystemExit(f"{out} does not exist: run the sweep first")
        saved = json.loads(out.read_text())
        saved_args = argparse.Namespace(**saved["args"])
        print(markdown_table(saved["runs"], saved_args), curves_table(saved["runs"], saved_args), sep="\n\n")
        return
    check_presets(ap, args.preset, args.objectives)
    k, n = (int(x) for x in args.shard.split("/"))
    todo = cells(args)
    mine = todo[k::n]
    results = []
    for seed, name, mu in todo:
        cfg = config(args, seed, name, mu)
        summary = finished_summary(cfg.output_dir, cfg)
        if summary is None and (seed, name, mu) in mine:
            summary = run_train(cfg, resume=any(Path(cfg.output_dir).glob("checkpoint-*")))
        if summary is None:
            continue  # another shard's cell, not finished yet
        run_dir = Path(cfg.output_dir)
        base = accuracy_on_test(cfg, cfg.model, Path(args.runs_dir) / f"{args.preset}-{args.tag}" / "base-test.json")
        final = accuracy_on_test(cfg, run_dir / "final", run_dir / "test.json")
        r = {"objective": name, "mu": mu, "seed": seed, "test_initial": base, "test_final": final,
             "accuracy_curve": accuracy_curve(run_dir),
             **run_means(run_dir), **summarise(run_dir, summary)}
        results.append(r)
        print(f"{name:18s} mu {mu} seed {seed}: validation {r['eval_initial']['accuracy']:.3f} -> "
              f"{r['eval_final']['accuracy']:.3f}, test {base:.4f} -> {final:.4f}, std log rho {r['log_ratio_std_mean']}, "
              f"bypass {r['bypass_fraction_mean']}, ESS {r['ess_mean']}, spikes {r['spikes']}, "
              f"collapse {r['collapse'] or 'no'}", flush=True)
    if n > 1 or len(results) < len(todo):
        return  # a shard: the call without --shard writes the JSON once every cell has finished
    out.parent.mkdir(parents=True, exist_ok=True)
    table = summary_table(results, args)
    out.write_text(json.dumps({"args": vars(args), "table": table, "runs": results}, indent=2))
    plot(results, args, out.with_suffix(".png"))
    print(markdown_table(results, args), curves_table(results, args), sep="\n\n")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
