"""Does the policy gradient carry from one set of prompts to another?

    python benchmarks/lab/gradient_signal.py cosines       # ~10 min; -> benchmarks/results/gradient_signal.json
    python benchmarks/lab/gradient_signal.py line-search --models block --prompts 6400 --parts 2
                                                       # ~25 min on 2 cores; -> gradient_line_search.json

RL on the shipped Countdown models does not raise held-out accuracy reliably (README,
"Block diffusion"). This measures why. For a model and its preset estimator, a batch
gives the REINFORCE gradient g = ∇ Σ_i A_i ℓ(y_i) (A = r − group mean, G = 8 rollouts
per prompt at temperature 1, the groups with a signal only):

- `cosines`: pairwise cosines of g from `--batches` disjoint batches of fresh training
  prompts (`fresh`), and from as many independent rollouts of one fixed batch (`fixed`).
  With g = S + noise, cos_fresh ≈ |S|² / (|S|² + V/n) for n prompts: the part of the
  gradient that all prompts share. cos_fixed is the same for the one batch's own
  prompts. `prompts_for_half_signal` = n (1 − cos_fresh) / cos_fresh estimates the
  prompts per step at which the shared part would be half of the gradient's square norm.
- `line-search`: one gradient from `--prompts` fresh prompts (in `--parts` disjoint
  parts; their cosine is reported), then the model moved by η along g/|g| and scored:
  greedy accuracy on 500 held-out problems (`--held-out`: test or validation) and on 500
  training problems, and the mean reward of 4 rollouts per problem at temperature 1 on
  both (the same noise for every η). η = 0 is the model itself.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from stabledrl.data import decode_completions, encode_prompts
from stabledrl.likelihood import Completions, estimate
from stabledrl.models import load_policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/lab/ -> the repository
MODELS = {"full": ("checkpoints/countdown-tiny", "mc"), "block": ("checkpoints/countdown-tiny-block", "blockwise")}
G = 8
CHUNK = 16  # prompts per rollout batch


def policy_gradient(policy, task, problems, method: str, seed: int) -> tuple[torch.Tensor, int]:
    """(flat gradient of Σ A ℓ over the rollouts of `problems`, rows with a non-zero advantage)."""
    total, rows = None, 0
    for c in range(0, len(problems), CHUNK):
        chunk = [p for p in problems[c : c + CHUNK] for _ in range(G)]
        ids, mask = encode_prompts(policy.tokenizer, [p.prompt for p in chunk])
        gens = [torch.Generator().manual_seed(seed * 10**8 + c * G + j) for j in range(len(chunk))]
        with torch.no_grad():
            out = generate(policy, ids, mask, SamplingConfig(gen_length=task.completion_length, temperature=1.0),
                           generator=gens)
        r = torch.tensor(task.reward(decode_completions(policy.tokenizer, out.completion_ids), chunk))
        adv = (r.view(-1, G) - r.view(-1, G).mean(1, keepdim=True)).flatten()  # (chunk·G,)
        keep = adv != 0
        if not keep.any():
            continue
        rows += int(keep.sum())
        kw = {} if method == "path" else {"num_samples": 2, "generator": torch.Generator().manual_seed(seed * 10**8 + c)}
        kept = Completions(out.completion_mask[keep], prompt_ids=ids[keep], completion_ids=out.completion_ids[keep],
                           prompt_mask=mask[keep], unmask_step=out.unmask_step[keep])
        ell = estimate(policy, kept, method=method, **kw).sequence
        policy.model.zero_grad(set_to_none=True)
        (adv[keep] * ell).sum().backward()
        g = torch.cat([p.grad.flatten() for p in policy.model.parameters()])
        total = g if total is None else total + g
    return total, rows


def _pairwise(gs: list[torch.Tensor]) -> list[float]:
    return [float(torch.nn.functional.cosine_similarity(gs[i], gs[j], dim=0))
            for i in range(len(gs)) for j in range(i + 1, len(gs))]


def cosines(name: str, method: str, *, prompts: int, batches: int) -> dict:
    policy = load_policy(ROOT / MODELS[name][0])
    task = get_task("countdown")
    fresh = [policy_gradient(policy, task, task.generate(prompts, split="train", seed=50_000 + k), method, seed=k + 1)[0]
             for k in range(batches)]
    one = task.generate(prompts, split="train", seed=50_000)
    fixed = [policy_gradient(policy, task, one, method, seed=100 + k)[0] for k in range(batches)]
    cf, cx = _pairwise(fresh), _pairwise(fixed)
    mean_fresh = sum(cf) / len(cf)
    return {"model": name, "estimator": method, "prompts_per_batch": prompts, "cos_fresh": cf, "cos_fixed": cx,
            "prompts_for_half_signal": prompts * (1 - mean_fresh) / mean_fresh if mean_fresh > 0 else None}


def _rewards(policy, task, problems, temperature: float, reps: int, seed: int) -> list[float]:
    out_r = []
    for c in range(0, len(problems), 128):
        chunk = [p for p in problems[c : c + 128] for _ in range(reps)]
        ids, mask = encode_prompts(policy.tokenizer, [p.prompt for p in chunk])
        gens = None if temperature == 0 else [torch.Generator().manual_seed(seed * 10**6 + c * reps + j)
                                              for j in range(len(chunk))]
        with torch.no_grad():
            out = generate(policy, ids, mask,
                           SamplingConfig(gen_length=task.completion_length, temperature=temperature),
                           generator=gens)
        out_r += task.reward(decode_completions(policy.tokenizer, out.completion_ids), chunk)
    return out_r


def line_search(name: str, method: str, *, prompts: int, parts: int, etas: list[float],
                held_out_split: str = "test") -> dict:
    policy = load_policy(ROOT / MODELS[name][0])
    task = get_task("countdown")
    t0 = time.perf_counter()
    share = prompts // parts
    gs, rows = [], 0
    for k in range(parts):
        g, n = policy_gradient(policy, task, task.generate(share, split="train", seed=60_000 + k), method, seed=k + 1)
        gs.append(g)
        rows += n
        print(f"{name}: gradient part {k + 1}/{parts}, {time.perf_counter() - t0:.0f} s", flush=True)
    direction = sum(gs)
    direction = direction / direction.norm()
    held_out = task.generate(500, split=held_out_split, seed=0)
    train = task.generate(500, split="train", seed=4242)
    start = [p.detach().clone() for p in policy.model.parameters()]
    scores = []
    for eta in etas:
        with torch.no_grad():
            off = 0
            for p, p0 in zip(policy.model.parameters(), start):
                p.copy_(p0 + eta * direction[off : off + p.numel()].view_as(p))
                off += p.numel()
        row = {"eta": eta}
        for split, problems in ((held_out_split, held_out), ("train", train)):
            greedy = _rewards(policy, task, problems, 0.0, 1, seed=0)
            sampled = _rewards(policy, task, problems, 1.0, 4, seed=1)
            row[f"greedy_accuracy_{split}"] = sum(r == 1.0 for r in greedy) / len(greedy)
            row[f"sampled_reward_{split}"] = sum(sampled) / len(sampled)
        print(row, flush=True)
        scores.append(row)
    return {"model": name, "estimator": method, "prompts": prompts, "rows_with_signal": rows,
            "cos_between_parts": _pairwise(gs), "scores": scores, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["cosines", "line-search"])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--likelihood", choices=["elbo", "path"], default="elbo",
                    help="elbo: the model's preset estimator (mc / blockwise); path: the sampler-path likelihood")
    ap.add_argument("--prompts", type=int, help="per batch (cosines, default 128) or in all (line-search, default 6400)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--etas", type=float, nargs="+", default=[0.0, 0.01, 0.02, 0.05, 0.1])
    ap.add_argument("--held-out", choices=["test", "validation"], default="test",
                    help="line-search: the split of the 500 held-out problems (choose a step on validation)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for m in args.models:
        method = MODELS[m][1] if args.likelihood == "elbo" else "path"
        if args.mode == "cosines":
            rows.append(cosines(m, method, prompts=args.prompts or 128, batches=args.batches))
        else:
            rows.append(line_search(m, method, prompts=args.prompts or 6400, parts=args.parts, etas=args.etas,
                                    held_out_split=args.held_out))
        print(json.dumps(rows[-1]), flush=True)
    name = "gradient_signal.json" if args.mode == "cosines" else "gradient_line_search.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
