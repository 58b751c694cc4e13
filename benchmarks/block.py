"""Block diffusion: one-pass staircase likelihood vs NB passes, cached vs uncached sampler.

    python benchmarks/block.py                 # ~10 min on 2 cores; JSON + PNG in benchmarks/results/
    python benchmarks/block.py --plot-only     # redraw the figure from the JSON

Both parts use a randomly initialised block model of the shipped size (width 192, 4
layers, 6 heads, block size S = 4): speed does not depend on the weights.

1. Likelihood. B sequences, prompt length P, NB blocks (L = NB·S), one blockwise mc view
   per sequence. One pass over [q ; y ; ỹ] under the staircase mask (`score_views`)
   against NB separate passes over [q ; y_<b ; ỹ_b] with the block-causal mask, batched
   over the B sequences, on the same masks: the values must agree (max |diff| recorded).
   Time: no-grad forward, median of `--repeats`, the two methods interleaved. Memory:
   peak RSS above the start, forward + backward, each in a fresh process.
2. Sampler. B prompts, completion lengths 32-256, one slot per step (T = L), greedy;
   EOS is disabled so that every row decodes every block. Tokens/s with and without the
   KV cache (identical tokens, checked), median of `--repeats`; peak RSS of both at
   L = 128 in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from stabledrl.likelihood import Completions, block_logprobs_by_separate_passes, plan_views, score_views
from stabledrl.models import TinyDiffusionConfig, TinyDiffusionLM, TinyPolicy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tokenizer import build_char_tokenizer

OUT = Path(__file__).parent / "results" / "block.json"
S = 4


def make_policy(seed: int = 0) -> TinyPolicy:
    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    cfg = TinyDiffusionConfig(vocab_size=len(tok), hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
                              attention_kind="block", block_size=S, mask_token_id=tok.mask_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id)
    return TinyPolicy(TinyDiffusionLM(cfg).eval(), tok)


def make_data(policy: TinyPolicy, B: int, P: int, L: int, seed: int = 0):
    """Random non-special tokens: BOS + P-1 prompt tokens, L completion tokens (no EOS, all scored)."""
    g = torch.Generator().manual_seed(seed)
    first = 5  # ids 0-4 are the special tokens of the char tokenizer
    p_ids = torch.randint(first, len(policy.tokenizer), (B, P), generator=g)
    p_ids[:, 0] = policy.tokenizer.bos_token_id
    c_ids = torch.randint(first, len(policy.tokenizer), (B, L), generator=g)
    return p_ids, torch.ones_like(p_ids), c_ids, torch.ones_like(c_ids, dtype=torch.bool)


def nb_pass_score(policy, plan, p_ids, p_mask, c_ids, c_mask) -> torch.Tensor:
    """(B,) the plan's estimate from NB separate passes over [q ; y_<b ; ỹ_b] (one view per sequence)."""
    assert plan.num_views == c_ids.size(0) and torch.equal(plan.seq_index, torch.arange(c_ids.size(0)))
    logp = block_logprobs_by_separate_passes(policy, p_ids, p_mask, c_ids, plan.masked)  # (B, L)
    return (logp * plan.weight.float() * (plan.masked & c_mask)).sum(1)


def one_pass_score(policy, plan, p_ids, p_mask, c_ids, c_mask) -> torch.Tensor:
    rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
    return score_views(policy, plan, rows).sequence


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def likelihood_rows(B: int, prompts: list[int], blocks: list[int], repeats: int, threads: int) -> list[dict]:
    policy = make_policy()
    rows = []
    for P in prompts:
        for NB in blocks:
            L = NB * S
            data = make_data(policy, B, P, L)
            plan = plan_views("blockwise", Completions(data[3]), num_samples=1, block_size=S,
                              generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                one, many = one_pass_score(policy, plan, *data), nb_pass_score(policy, plan, *data)
                t_one, t_many = [], []
                for _ in range(repeats):  # interleaved, so drifts in machine load hit both
                    t_one.append(_median_time(lambda: one_pass_score(policy, plan, *data), 1))
                    t_many.append(_median_time(lambda: nb_pass_score(policy, plan, *data), 1))
            mem = {m: _child_memory("likelihood", m, B, P, NB, threads) for m in ("one_pass", "nb_pass")}
            row = {
                "P": P, "NB": NB, "L": L, "B": B,
                "max_abs_diff": float((one - many).abs().max()),
                "one_pass_s": statistics.median(t_one), "nb_pass_s": statistics.median(t_many),
                "tokens_one_pass": P + 2 * L, "tokens_nb_pass": NB * P + S * NB * (NB + 1) // 2,
                "peak_mb": {m: v for m, v in mem.items()},
            }
            row["speedup"] = row["nb_pass_s"] / row["one_pass_s"]
            row["token_ratio"] = row["tokens_nb_pass"] / row["tokens_one_pass"]
            rows.append(row)
            print(f"likelihood P={P:3d} NB={NB:2d}: one pass {row['one_pass_s'] * 1e3:7.1f} ms, NB passes "
                  f"{row['nb_pass_s'] * 1e3:7.1f} ms, speed-up {row['speedup']:.2f}x (token ratio "
                  f"{row['token_ratio']:.2f}), |diff| {row['max_abs_diff']:.1e}, peak MB one {mem['one_pass']:.0f} "
                  f"/ NB {mem['nb_pass']:.0f}", flush=True)
    return rows


class NoEOS:
    """A policy whose EOS logit is -inf, so that every row decodes every block."""

    def __init__(self, policy):
        self.inner = policy

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def logits(self, *args, **kwargs):
        out = self.inner.logits(*args, **kwargs)
        out[..., self.inner.eos_token_id] = -math.inf
        return out


def sampler_rows(B: int, P: int, lengths: list[int], repeats: int, threads: int) -> list[dict]:
    policy = NoEOS(make_policy())
    rows = []
    for L in lengths:
        p_ids, p_mask, _, _ = make_data(policy, B, P, 1)
        outs, t = {}, {True: [], False: []}
        for _ in range(repeats):
            for cache in (True, False):
                t0 = time.perf_counter()
                outs[cache] = generate(policy, p_ids, p_mask, SamplingConfig(gen_length=L, kv_cache=cache))
                t[cache].append(time.perf_counter() - t0)
        same = torch.equal(outs[True].completion_ids, outs[False].completion_ids)
        row = {"L": L, "B": B, "P": P, "identical_tokens": same,
               "cached_s": statistics.median(t[True]), "uncached_s": statistics.median(t[False])}
        row["cached_tokens_per_s"] = B * L / row["cached_s"]
        row["uncached_tokens_per_s"] = B * L / row["uncached_s"]
        row["speedup"] = row["uncached_s"] / row["cached_s"]
        if L == 128:
            row["peak_mb"] = {m: _child_memory("sampler", m, B, P, L, threads) for m in ("cached", "uncached")}
        rows.append(row)
        print(f"sampler L={L:3d}: cached {row['cached_tokens_per_s']:7.0f} tok/s, uncached "
              f"{row['uncached_tokens_per_s']:7.0f} tok/s, speed-up {row['speedup']:.2f}x, identical {same}", flush=True)
    return rows


def _child_memory(part: str, mode: str, B: int, P: int, n: int, threads: int) -> float:
    """Peak RSS increase (MB) of one run of `part`/`mode` in a fresh process."""
    res = subprocess.run([sys.executable, __file__, "--child", part, mode, str(B), str(P), str(n), str(threads)],
                         capture_output=True, text=True, check=True)
    before, peak = map(int, res.stdout.split()[-2:])
    return (peak - before) / 2**20


def child(part: str, mode: str, B: int, P: int, n: int, threads: int) -> None:
    import os
    import threading

    torch.set_num_threads(threads)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    policy = make_policy()
    if part == "likelihood":
        data = make_data(policy, B, P, n * S)
        plan = plan_views("blockwise", Completions(data[3]), num_samples=1, block_size=S,
                          generator=torch.Generator().manual_seed(1))
        fn = one_pass_score if mode == "one_pass" else nb_pass_score
        run = lambda: fn(policy, plan, *data).sum().backward()  # noqa: E731 - training-time memory
    else:
        p_ids, p_mask, _, _ = make_data(policy, B, P, 1)
        wrapped = NoEOS(policy)
        sampling = SamplingConfig(gen_length=n, kv_cache=mode == "cached")
        run = lambda: generate(wrapped, p_ids, p_mask, sampling)  # noqa: E731
    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    th = threading.Thread(target=sample)
    th.start()
    run()
    done.set()
    th.join()
    print(before, max(peak[0], rss()))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for P in sorted({r["P"] for r in result["likelihood"]}):
        rows = [r for r in result["likelihood"] if r["P"] == P]
        nb = [r["NB"] for r in rows]
        a.plot(nb, [r["speedup"] for r in rows], "o-", label=f"measured, P = {P}")
        a.plot(nb, [r["token_ratio"] for r in rows], "x:", label=f"token ratio, P = {P}")
    nb = sorted({r["NB"] for r in result["likelihood"]})
    a.plot(nb, [0.5 * x for x in nb], "k--", label="goal 0.5·NB")
    a.set(xscale="log", xlabel="blocks NB", ylabel="NB passes / one pass (time)", xticks=nb, xticklabels=nb,
          title="staircase likelihood: one pass vs NB passes")
    a.legend(fontsize=8)
    rows = result["sampler"]
    Ls = [r["L"] for r in rows]
    b.plot(Ls, [r["cached_tokens_per_s"] for r in rows], "o-", label="KV cache")
    b.plot(Ls, [r["uncached_tokens_per_s"] for r in rows], "s-", label="no cache")
    b.set(xscale="log", xlabel="completion length L", ylabel="tokens / s", xticks=Ls, xticklabels=Ls,
          title=f"block sampler (S = {S}, T = L, batch {rows[0]['B']})")
    b.legend()
    for ax in (a, b):
        ax.minorticks_off()  # log axes: only the measured points are labelled
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="sequences per likelihood call")
    ap.add_argument("--sampler-batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, nargs="+", default=[12, 128], help="prompt lengths P")
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        part, mode, *nums = args.child
        child(part, mode, *map(int, nums))
        return
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "block_size": S,
        "likelihood": likelihood_rows(args.batch, args.prompts, args.blocks, args.repeats, args.threads),
        "sampler": sampler_rows(args.sampler_batch, 12, args.lengths, max(1, args.repeats // 2), args.threads),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
