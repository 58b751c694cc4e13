"""A control for RL on the block model: plain online REINFORCE, no ratios, no trainer.

    python benchmarks/lab/plain_reinforce.py          # ~8 min on 2 cores; JSON in benchmarks/results/

For each shipped Countdown model (full attention with the `mc` estimator, block with
`blockwise`): 60 iterations of 16 fresh training prompts x G = 8 rollouts at temperature 1,
advantage r - group mean, loss -Σ A ℓ / (number of non-zero advantages), ℓ estimated with 2
samples, gradient clipped to 1, Adam at lr 3e-5 -- the presets' data, budget and learning
rate with everything of `stabledrl.train` stripped away (μ = 1, no importance ratios, no
clipping, no skipped groups). Held-out accuracy (greedy, 500 test problems) before and after.
If the block model loses accuracy here too, the cause lies in the block model or the
blockwise estimator, not in the objectives or the trainer.

`--likelihood path` replaces ℓ by the log-probability of each rollout's own sampling path
(`benchmarks/lab/likelihood_fit.py`: the committed tokens along the sampler's order), i.e.
REINFORCE on the sampler's likelihood given its order, no ELBO at all; `--models` picks
the models. Results go to plain_reinforce_path.json then.

    python benchmarks/lab/plain_reinforce.py --likelihood path --models block

`--likelihood sft` uses instead minus the SFT loss of each rollout (one mask level per
block, every slot a target including the PAD after EOS, as `stabledrl sft` trains), and
`--advantages positive` (or `negative`) keeps only that half of the advantages: with
`positive` the update is reward-weighted training on the model's own correct answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from stabledrl.data import decode_completions, encode_prompts
from stabledrl.evaluate import evaluate
from stabledrl.likelihood import Completions, estimate
from stabledrl.models import load_policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.sft import diffusion_loss
from stabledrl.tasks import get_task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from likelihood_fit import path_logprob  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/lab/ -> the repository
MODELS = {"full": ("checkpoints/countdown-tiny", "mc"), "block": ("checkpoints/countdown-tiny-block", "blockwise")}


def run(model: str, method: str, *, iterations: int, prompts: int, group: int, lr: float, seed: int,
        likelihood: str = "elbo", advantages: str = "both") -> dict:
    policy = load_policy(ROOT / model)
    task = get_task("countdown")
    held_out = task.generate(500, split="test", seed=0)
    before = evaluate(policy, task, held_out, progress=False)
    opt = torch.optim.Adam(policy.model.parameters(), lr=lr)
    rewards = []
    for it in range(iterations):
        problems = task.generate(prompts, split="train", seed=seed * 100_000 + it)
        ids, mask = encode_prompts(policy.tokenizer, [p.prompt for p in problems])
        ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
        gen = torch.Generator().manual_seed(seed * 100_000 + it)
        policy.model.eval()
        with torch.no_grad():
            out = generate(policy, ids, mask, SamplingConfig(gen_length=task.completion_length, temperature=1.0),
                           generator=gen)
        texts = decode_completions(policy.tokenizer, out.completion_ids)
        r = torch.tensor(task.reward(texts, [p for p in problems for _ in range(group)]))  # (prompts·G,)
        adv = (r.view(-1, group) - r.view(-1, group).mean(1, keepdim=True)).flatten()
        if advantages == "positive":
            adv = adv.clamp(min=0)
        elif advantages == "negative":
            adv = adv.clamp(max=0)
        policy.model.train()
        if likelihood == "path":
            ell = path_logprob(policy, ids, mask, out)  # (prompts·G,)
        elif likelihood == "sft":
            # minus each row's SFT loss (one draw of t per row or block; every slot a target,
            # PAD after EOS included, as `stabledrl sft` trains)
            ell = -diffusion_loss(policy, ids, mask, out.completion_ids, generator=gen, reduction="none")[0]
        else:
            rows = Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids, prompt_mask=mask)
            ell = estimate(policy, rows, method=method, num_samples=2, generator=gen).sequence  # (prompts·G,)
        loss = -(adv * ell).sum() / (adv != 0).sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        opt.step()
        rewards.append(float(r.mean()))
        print(f"{model} iteration {it + 1}/{iterations}: reward {rewards[-1]:.3f}", flush=True)
    after = evaluate(policy, task, held_out, progress=False)
    return {"model": model, "estimator": {"elbo": method, "path": "sampler path", "sft": "SFT loss"}[likelihood], "accuracy_before": before.accuracy, "accuracy_after": after.accuracy,
            "reward_before": before.mean_reward, "reward_after": after.mean_reward, "advantages": advantages, "reward_curve": rewards}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--likelihood", choices=["elbo", "path", "sft"], default="elbo")
    ap.add_argument("--advantages", choices=["both", "positive", "negative"], default="both",
                    help="keep only the positive (or negative) advantages: which half of the update moves the model")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.out is None:
        name = "plain_reinforce.json" if args.likelihood == "elbo" else "plain_reinforce_path.json"
        args.out = ROOT / "benchmarks" / "results" / name
    torch.set_num_threads(args.threads)
    rows = [run(*MODELS[m], iterations=args.iterations, prompts=args.prompts, group=args.group, lr=args.lr,
                seed=args.seed, likelihood=args.likelihood, advantages=args.advantages) for m in args.models]
    for row in rows:
        print(f"{row['model']}: held-out accuracy {row['accuracy_before']:.4f} -> {row['accuracy_after']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
