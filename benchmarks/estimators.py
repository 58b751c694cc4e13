"""Bias, variance, MSE and cost of the likelihood estimators on real rollouts.

    python benchmarks/estimators.py --model checkpoints/countdown-tiny
    python benchmarks/estimators.py --estimators sdmc-N2 sdmc-N2-time sdmc-NF sdmc-NF-time --budgets 2 4 \
        --out benchmarks/results/estimators-sdmc-weight.json     # 1/t (GDPO) vs n/k (ours)

1. Rollouts: the shipped model samples completions (temperature 1) for held-out
   Countdown prompts — real sequences, not random tokens.
2. Reference: the exact ELBO of each completion by enumerating every mask
   (`method="exact"`; completions have at most 11 scored slots).
3. For budgets of 1, 2, 4, 8 forward passes per sequence, each estimator is drawn
   `--repeats` times with different seeds: bias (mean − exact ELBO), variance across
   draws, MSE = mean over sequences of (bias² + variance), and wall time per sequence.
4. Batched views vs a naive loop with one view per forward at K = 8 (same plan, same
   values): the speed-up.
5. Peak memory of a training-time backward (`backward_views`, micro-batches of B views)
   at K = 1 vs K = 16, each in a fresh subprocess: peak RSS during the call (sampled
   every 0.5 ms) and its increase over the RSS just before.

Writes benchmarks/results/estimators.json and estimators.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from stabledrl.data import encode_prompts
from stabledrl.likelihood import Completions, plan_views, score_views
from stabledrl.models import load_policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks import get_task

# name -> (method, options, num_samples as a function of the budget F or None if F unsupported)
ESTIMATORS = {
    "mc": ("mc", {"masking": "count"}, lambda F: F),
    "mc-stratified": ("mc", {"masking": "count", "stratified": True}, lambda F: F),
    "mc-bernoulli": ("mc", {"masking": "bernoulli"}, lambda F: F),
    "mc-antithetic": ("mc", {"masking": "bernoulli", "antithetic": True}, lambda F: F if F % 2 == 0 else None),
    "sdmc-N1": ("sdmc", {"num_nodes": 1}, lambda F: F),
    "sdmc-N2": ("sdmc", {"num_nodes": 2}, lambda F: F // 2 if F % 2 == 0 else None),
    "sdmc-NF": ("sdmc", {"num_nodes": None}, lambda F: 1),  # N = F nodes, one mask each
    # GDPO's node factor 1/t instead of our n/k (docs/methods.md, "sdmc")
    "sdmc-N2-time": ("sdmc", {"num_nodes": 2, "weight": "time"}, lambda F: F // 2 if F % 2 == 0 else None),
    "sdmc-NF-time": ("sdmc", {"num_nodes": None, "weight": "time"}, lambda F: 1),
    "mean_field": ("mean_field", {"p_prompt": 0.15}, lambda F: 1 if F == 1 else None),
}


def rollouts(policy, n: int, seed: int):
    task = get_task("countdown")
    problems = task.generate(n, split="test", seed=seed)
    p_ids, p_mask = encode_prompts(policy.tokenizer, [p.prompt for p in problems])
    out = generate(policy, p_ids, p_mask, SamplingConfig(gen_length=task.completion_length, temperature=1.0),
                   generator=torch.Generator().manual_seed(seed))
    return p_ids, p_mask, out.completion_ids, out.completion_mask


def score(policy, plan, data, max_views=None):
    p_ids, p_mask, c_ids, c_mask = data
    with torch.no_grad():
        return score_views(policy, plan,
                           Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                           max_views_per_forward=max_views).sequence.double()


def quality(policy, data, exact, budgets, repeats, max_views, names=tuple(ESTIMATORS)):
    p_ids, _, _, c_mask = data
    B = c_mask.size(0)
    rows = []
    for name in names:
        method, opts, k_of = ESTIMATORS[name]
        for F in budgets:
            K = k_of(F)
            if K is None:
                continue
            opts_f = dict(opts)
            if opts_f.get("num_nodes", 0) is None:
                opts_f["num_nodes"] = F
            draws, seconds, views = [], [], []
            for r in range(repeats):
                gen = torch.Generator().manual_seed(1000 * F + r)
                t0 = time.perf_counter()
                plan = plan_views(method, Completions(c_mask, prompt_ids=p_ids), num_samples=K, generator=gen,
                                  bos_token_id=policy.tokenizer.bos_token_id, **opts_f)
                draws.append(score(policy, plan, data, max_views))
                seconds.append(time.perf_counter() - t0)
                views.append(plan.num_views / B)
            d = torch.stack(draws)  # (R, B)
            bias = d.mean(0) - exact  # (B,)
            var = d.var(0)  # (B,)
            rows.append({
                "estimator": name, "method": method, "options": opts_f, "budget": F, "num_samples": K,
                "views_per_sequence": statistics.mean(views),
                "bias_mean": float(bias.mean()), "abs_bias_mean": float(bias.abs().mean()),
                "variance_mean": float(var.mean()), "mse": float((bias**2 + var).mean()),
                "ms_per_sequence_median": 1000 * statistics.median(seconds) / B,
            })
            print(f"{name:14s} F={F}: bias {rows[-1]['bias_mean']:+.3f}  var {rows[-1]['variance_mean']:.3f}  "
                  f"mse {rows[-1]['mse']:.3f}  {rows[-1]['ms_per_sequence_median']:.3f} ms/seq", flush=True)
    return rows


def speedup(policy, data, repeats):
    """Batched scoring vs one view per forward, K = 8, the same plan."""
    p_ids, p_mask, c_ids, c_mask = data
    plan = plan_views("mc", Completions(c_mask), num_samples=8, generator=torch.Generator().manual_seed(0))
    batched, naive = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = score(policy, plan, data)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = score(policy, plan, data, max_views=1)
        naive.append(time.perf_counter() - t0)
    return {
        "num_views": plan.num_views, "batched_s_median": statistics.median(batched),
        "naive_s_median": statistics.median(naive),
        "speedup": statistics.median(naive) / statistics.median(batched),
        "max_abs_difference": float((a - b).abs().max()),
    }


MEMORY_CHILD = r"""
import os, sys, threading, time, torch
from stabledrl.models import load_policy
from stabledrl.likelihood import Completions, plan_views, backward_views
torch.set_num_threads(int(sys.argv[4]))
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
policy = load_policy(sys.argv[1]); policy.model.train()
p_ids, p_mask, c_ids, c_mask = torch.load(sys.argv[3])
rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
plan = plan_views("mc", Completions(c_mask), num_samples=int(sys.argv[2]), generator=torch.Generator().manual_seed(0))
before, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
th = threading.Thread(target=sample); th.start()
backward_views(policy, plan, rows, torch.ones(c_ids.size(0)), max_views_per_forward=c_ids.size(0))
done.set(); th.join()
print(before, max(peak[0], rss()))
"""


def memory(model: str, data, threads: int) -> dict:
    """Peak RSS during a training-time backward (micro-batches of B views), sampled
    every 0.5 ms in a fresh process, above the RSS just before it."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "data.pt")
        torch.save(tuple(data), path)
        for K in (1, 16):
            res = subprocess.run([sys.executable, "-c", MEMORY_CHILD, model, str(K), path, str(threads)],
                                 capture_output=True, text=True, check=True)
            before, peak = map(int, res.stdout.split()[-2:])
            out[f"K{K}"] = {"rss_before_mb": before / 2**20, "peak_rss_mb": peak / 2**20,
                            "increase_mb": (peak - before) / 2**20}
    out["peak_ratio_K16_over_K1"] = out["K16"]["peak_rss_mb"] / out["K1"]["peak_rss_mb"]
    out["increase_ratio_K16_over_K1"] = out["K16"]["increase_mb"] / max(out["K1"]["increase_mb"], 1e-9)
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = [("mse", "MSE vs exact ELBO (nats²)", "log"), ("abs_bias_mean", "|mean of the draws − exact ELBO| (nats)", "log"),
              ("ms_per_sequence_median", "ms per sequence", "linear")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label, yscale) in zip(axes, panels):
        for name in ESTIMATORS:
            rs = [r for r in rows if r["estimator"] == name]
            if rs:
                ax.plot([r["budget"] for r in rs], [r[key] for r in rs], "o-", label=name)
        ax.set(xscale="log", yscale=yscale, xlabel="forward passes per sequence", ylabel=label)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_title("Estimator error on real rollouts of the shipped model")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/countdown-tiny")
    ap.add_argument("--n", type=int, default=64, help="rollouts (sequences)")
    ap.add_argument("--repeats", type=int, default=64, help="draws per estimator and budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/estimators.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from an existing JSON")
    ap.add_argument("--estimators", nargs="+", choices=list(ESTIMATORS),
                    help="only these, at --budgets: their rows and no speed-up or memory parts")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text())["rows"], Path(args.out).with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    policy = load_policy(args.model)
    data = rollouts(policy, args.n, seed=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        plan = plan_views("exact", Completions(data[3]))
        exact = score(policy, plan, data, max_views=4096)
    exact_s = time.perf_counter() - t0
    print(f"exact ELBO: mean {exact.mean():.3f} nats over {args.n} rollouts, {plan.num_views} views in {exact_s:.1f}s")
    rows = quality(policy, data, exact, args.budgets, args.repeats, None, args.estimators or tuple(ESTIMATORS))

    def mse(name, F):
        return next((r["mse"] for r in rows if r["estimator"] == name and r["budget"] == F), None)

    if args.estimators:  # a subset: the rows, and GDPO's 1/t against our n/k where both ran
        by_key = {(r["estimator"], r["budget"]): r for r in rows}
        pairs = {}
        for (name, F), r in by_key.items():
            ours = by_key.get((name.removesuffix("-time"), F))
            if name.endswith("-time") and ours is not None:
                pairs[f"{name}/{ours['estimator']}, F={F}"] = {k: r[k] / ours[k] for k in ("mse", "abs_bias_mean")}
        result = {"model": args.model, "rollouts": args.n, "repeats": args.repeats,
                  "scored_slots_mean": float(data[3].sum(1).float().mean()),
                  "exact_elbo_mean": float(exact.mean()), "rows": rows, "time_over_count": pairs}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(pairs, indent=2))
        return

    ratios = {F: mse("sdmc-N2", F) / mse("mc", F) for F in (2, 4, 8)}
    result = {
        "model": args.model, "rollouts": args.n, "repeats": args.repeats, "threads": args.threads,
        "scored_slots_mean": float(data[3].sum(1).float().mean()),
        "exact_elbo_mean": float(exact.mean()), "exact_seconds": exact_s,
        "rows": rows,
        "sdmc_N2_over_mc_mse": ratios,
        "batched_vs_naive_K8": speedup(policy, data, repeats=5),
        "memory_backward_K1_vs_K16": memory(args.model, data, args.threads),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
