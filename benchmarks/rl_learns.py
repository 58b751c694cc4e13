"""Does the main command make the model better? Held-out accuracy, pass@k and the
difficulty-controlled training reward, over seeds.

    python benchmarks/rl_learns.py passk --model checkpoints/countdown-tiny-diverse --split test --n 1000
    python benchmarks/rl_learns.py main --seeds 0 1 2            # the README's main command, 3 seeds (~30 min)
    python benchmarks/rl_learns.py controlled --config C --run-dir RUN --tag T   # of a finished run
    python benchmarks/rl_learns.py decoders --models M1 M2 ... --split test --n 1592 --tag T
    python benchmarks/rl_learns.py curves --runs RUN0 RUN1 RUN2 --tag T   # validation curves -> best step
    python benchmarks/rl_learns.py overlap --start S --trained RUN/final --reference R --split test --n 1592

`passk`: greedy accuracy, and from k samples a problem at `--temperature` (default 1) pass@j
for j = 1, 2, 4, … and k (pass@1 is the mean over the samples, pass@k any of the k right; the
ones between are the unbiased estimate from the k), on `n` problems of a split (seed 0, as
`stabledrl eval`). With a large k (`--k 64`) the curve shows how far a model's own samples
reach: the ceiling that RL which sharpens the policy onto its right answers can climb to.

`main`: runs `--config` (default: configs/countdown-stabledrl.yaml) for each seed with
`eval_split` and `eval_n` set from `--split` / `--n`, then measures on the final model:
the above before and after, and the training reward with the difficulty of each step's
prompts controlled for: the step's prompts are drawn again and scored under the initial
model with the same G samples per prompt, so that `reward − reward_initial` per step
shows learning, not easier prompts (`summarise_gaps`: by sixths, the second half with its
standard error, the slope). `controlled`: that measurement alone, for a finished run.
`decoders`: greedy accuracy of each model under each greedy decoder of `DECODERS` (the
default one block of L slots, one a step; threshold 0.9; blocks of 2; blocks of 4): does a
gain survive a change of decoder, and how much of it does a decoder alone give the initial
model? `curves`: the held-out accuracy that runs trained with `eval_split=validation` and
`eval_every` recorded, its mean over the runs at each evaluated step, and the step where that
mean is highest (how long a preset trains), with each run's rollout entropy, share of tied
groups and reward over its first and last 10 steps. `overlap`: which problems RL turned
right: greedy correctness per problem of the start, the trained model and a reference model,
and how many of the problems the trained model gained (and lost) the reference gets right,
that is, whether RL found answers or got back the reference's.
Writes benchmarks/results/rl_learns-<cmd>-<tag>.json.

Choose settings with `--split validation`; report `--split test` (the test split has
1,592 Countdown-3 problems; `--n 1000` draws 1,000 of them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from stabledrl.checkpoint import finished_summary
from stabledrl.config import load_config
from stabledrl.data import encode_policy_prompts
from stabledrl.evaluate import evaluate, pass_at_k
from stabledrl.models import load_policy
from stabledrl.report import accuracy_curve, load_metrics
from stabledrl.sampling import SamplingConfig
from stabledrl.tasks import get_task
from stabledrl.train import TrainConfig, run_train

ROOT = Path(__file__).resolve().parents[1]


def sampled_pass_at_k(model: str | Path, task, problems: list, k: int = 8, seed: int = 0,
                      temperature: float = 1.0) -> dict[str, float]:
    """Greedy accuracy; from k samples per problem at `temperature`, pass@j for j = 1, 2, 4, …
    and k (the unbiased estimate, `stabledrl.evaluate.pass_at_k`; pass@k itself is the fraction
    of problems with a right answer among the k)."""
    policy = load_policy(model)
    greedy = evaluate(policy, task, problems, SamplingConfig(), progress=False)
    sampled = evaluate(policy, task, [p for p in problems for _ in range(k)], SamplingConfig(temperature=temperature),
                       seed=seed, progress=False)
    right = torch.tensor([s["correct"] for s in sampled.samples], dtype=torch.bool).view(len(problems), k)
    ks = sorted({2 ** i for i in range(k.bit_length())} | {k})  # 1, 2, 4, … up to k, and k
    return {"greedy": greedy.accuracy, "greedy_reward": greedy.mean_reward,
            **{f"pass@{j}": pass_at_k(right, j) for j in ks}, "n": len(problems), "k": k, "temperature": temperature}


def training_reward_controlled(cfg: TrainConfig, initial: str | Path, run_dir: Path, every: int = 5) -> dict:
    """Each `every`-th step: the run's reward on its step prompts minus the initial model's
    reward on the same prompts (G samples each, decoded as the rollouts: `cfg.rollout`, and the
    stop tokens and other settings of `cfg.model` with the initial weights)."""
    task = get_task(cfg.task.name, **cfg.task.options)
    policy = load_policy(dataclasses.replace(cfg.model, path=str(initial)))
    rows = {r["step"]: r for r in load_metrics(run_dir) if "reward_mean" in r}
    gaps = {}
    for step in range(0, cfg.steps, every):
        if step + 1 not in rows:  # not logged (log_every > 1) or a step without rows
            continue
        problems = task.generate(cfg.prompts_per_step, split="train", seed=cfg.seed * 1_000_003 + step)
        res = evaluate(policy, task, [p for p in problems for _ in range(cfg.group_size)], cfg.rollout,
                       seed=10_000 + step, progress=False)
        gaps[step + 1] = rows[step + 1]["reward_mean"] - res.mean_reward
    return {"every": every, "gap_by_step": gaps, **summarise_gaps(gaps)}


def summarise_gaps(gaps: dict[int, float]) -> dict[str, float]:
    """The controlled reward gap by step -> its mean over the first and last sixth of the
    measured steps, over the second half with its standard error, and the least-squares
    slope per 100 steps with its standard error. At step 1 the run's model is the initial
    one, so the gap there is sampling noise; one step's gap has a noise of a few hundredths,
    so a sixth (a few measured steps) is a rough summary and the slope a firmer one."""
    steps = sorted(gaps)
    sixth = max(1, len(steps) // 6)
    ys = [gaps[s] for s in steps]
    half = ys[len(ys) // 2:]
    slope, intercept = statistics.linear_regression(steps, ys)
    mean_x = statistics.mean(steps)
    residual_ss = sum((y - intercept - slope * x) ** 2 for x, y in zip(steps, ys))
    se_slope = (residual_ss / max(1, len(steps) - 2) / sum((x - mean_x) ** 2 for x in steps)) ** 0.5
    return {"gap_first_sixth": statistics.mean(gaps[s] for s in steps[:sixth]),
            "gap_last_sixth": statistics.mean(gaps[s] for s in steps[-sixth:]),
            "gap_second_half": statistics.mean(half),
            "gap_second_half_se": statistics.stdev(half) / len(half) ** 0.5 if len(half) > 1 else float("nan"),
            "slope_per_100_steps": 100 * slope, "slope_per_100_steps_se": 100 * se_slope}


DECODERS = {  # name -> the greedy SamplingConfig's options
    "one block": {},
    "threshold 0.9": {"threshold": 0.9},
    "blocks of 2": {"block_length": 2},
    "blocks of 4": {"block_length": 4},
}


@torch.no_grad()
def pad_at_first_step(policy, problems: list, gen_length: int) -> list[float] | None:
    """The model's mean probability of PAD at each completion slot, all L slots masked (the
    decoder's first step): where it is highest, the one-block decoder commits first. Full-
    attention models only (None for a block model, which decodes block by block)."""
    if getattr(policy, "block_size", None):
        return None
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    b = ids.shape[0]
    x = torch.cat([ids, torch.full((b, gen_length), policy.mask_token_id)], 1)
    attn = torch.cat([mask, torch.ones(b, gen_length, dtype=mask.dtype)], 1)
    probs = policy.logits(x, attn)[:, -gen_length:].float().softmax(-1)
    return probs[..., policy.pad_token_id].mean(0).tolist()


def _task_and_problems(args) -> tuple:
    """`--task`, `--task-options` and the first `--n` problems of `--split` (seed 0, as `stabledrl eval`)."""
    task = get_task(args.task, **json.loads(args.task_options))
    return task, task.generate(args.n, split=args.split, seed=0)


def cmd_decoders(args) -> dict:
    task, problems = _task_and_problems(args)
    rows, chars, pad = {}, {}, {}
    for model in args.models:
        rows[model], chars[model] = {}, {}
        policy = load_policy(model)
        pad[model] = pad_at_first_step(policy, problems, task.completion_length)
        for name, options in DECODERS.items():
            if getattr(policy, "block_size", None) and options.get("block_length", policy.block_size) != policy.block_size:
                rows[model][name] = chars[model][name] = None  # a block model decodes in its own blocks only
                continue
            res = evaluate(policy, task, problems, SamplingConfig(**options), progress=False)
            rows[model][name] = res.accuracy
            chars[model][name] = statistics.mean(len(s["completion"]) for s in res.samples)
        print(model, "  ".join(f"{name} {100 * acc:.2f}% ({chars[model][name]:.2f} chars)"
                               for name, acc in rows[model].items() if acc is not None),
              "p(PAD) at the first step", pad[model] and [round(v, 2) for v in pad[model]], flush=True)
    return {"split": args.split, "n": args.n, "decoders": DECODERS, "accuracy": rows, "mean_completion_chars": chars,
            "pad_at_first_step": pad}


def cmd_passk(args) -> dict:
    task, problems = _task_and_problems(args)
    res = sampled_pass_at_k(args.model, task, problems, k=args.k, temperature=args.temperature)
    print(json.dumps(res))
    return {"model": args.model, "split": args.split, **res}


def cmd_main(args) -> dict:
    runs = []
    for seed in args.seeds:
        out = Path(args.runs_dir) / f"seed{seed}"
        cfg = load_config(TrainConfig, args.config, [f"seed={seed}", f"output_dir={out}", f"eval_split={args.split}",
                                                     f"eval_n={args.n}", *args.set])
        t0 = time.perf_counter()
        summary = finished_summary(out, cfg) or run_train(cfg, progress=False)  # reuse a finished run
        seconds = time.perf_counter() - t0
        task = get_task(cfg.task.name, **cfg.task.options)
        problems = task.generate(args.n, split=args.split, seed=0)
        run = {"seed": seed, "seconds": seconds, "eval_initial": summary["eval_initial"],
               "eval_final": summary["eval_final"], "collapse": summary.get("collapse"),
               "final": sampled_pass_at_k(out / "final", task, problems, k=args.k),
               "training_reward": training_reward_controlled(cfg, cfg.model.path, out)}
        runs.append(run)
        print(f"seed {seed}: held-out {run['eval_initial']['accuracy']:.4f} -> {run['eval_final']['accuracy']:.4f}, "
              f"pass@1 {run['final']['pass@1']:.4f}, pass@{args.k} {run['final'][f'pass@{args.k}']:.4f}, "
              f"reward gap first/last sixth {run['training_reward']['gap_first_sixth']:+.3f} / "
              f"{run['training_reward']['gap_last_sixth']:+.3f} ({seconds:.0f} s)", flush=True)
    initial = sampled_pass_at_k(cfg.model.path, task, problems, k=args.k)
    gains = [r["eval_final"]["accuracy"] - r["eval_initial"]["accuracy"] for r in runs]
    print(f"initial: {json.dumps(initial)}")
    print(f"gain (points): {', '.join(f'{100 * g:+.1f}' for g in gains)}; mean {100 * statistics.mean(gains):+.1f}")
    return {"config": args.config, "set": args.set, "split": args.split, "n": args.n, "initial": initial,
            "runs": runs, "gain_mean": statistics.mean(gains), "gain_min": min(gains)}


def cmd_controlled(args) -> dict:
    """The controlled training reward of a finished run (`--run-dir`) of `--config`."""
    cfg = load_config(TrainConfig, args.config, list(args.set))
    res = training_reward_controlled(cfg, cfg.model.path, Path(args.run_dir))
    print(json.dumps({k: v for k, v in res.items() if k != "gap_by_step"}))
    return {"config": args.config, "set": args.set, "run_dir": args.run_dir, "training_reward": res}


def eval_curves(run_dirs: list[str | Path]) -> dict:
    """The held-out accuracy each run recorded at its evaluations (`eval_every`), the mean over
    the runs at each step, and the step whose mean is highest (the earliest, on a tie): how
    long a preset trains, chosen on runs with `eval_split=validation`. Every run must have
    been evaluated at the same steps."""
    curves = {str(run): dict(accuracy_curve(run)) for run in run_dirs}
    steps = sorted(next(iter(curves.values())))
    for run, curve in curves.items():
        if sorted(curve) != steps:
            raise SystemExit(f"{run} was evaluated at steps {sorted(curve)}, the first run at {steps}")
    mean = {s: statistics.mean(c[s] for c in curves.values()) for s in steps}
    best = max(steps, key=lambda s: (mean[s], -s))
    return {"runs": curves, "steps": steps, "mean": mean, "best_step": best,
            "rollouts": {str(run): rollout_ends(run) for run in run_dirs}}


ROLLOUT_KEYS = ("entropy", "zero_variance_fraction", "reward_mean")


def rollout_ends(run_dir: str | Path, k: int = 10) -> dict[str, list[float]]:
    """What the rollouts did over a run: the mean of each of `ROLLOUT_KEYS` over its first k and
    its last k training steps (rows with a rollout; a run stopped early counts to where it got)."""
    rows = [r for r in load_metrics(run_dir) if "reward_mean" in r]
    return {key: [statistics.mean(r[key] for r in rows[:k]), statistics.mean(r[key] for r in rows[-k:])]
            for key in ROLLOUT_KEYS}


def curves_table(res: dict) -> str:
    """A markdown table of `eval_curves`: one row per run and the mean, one column per step."""
    steps = res["steps"]
    lines = ["| run | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for run, curve in res["runs"].items():
        lines.append(f"| {run} | " + " | ".join(f"{100 * curve[s]:.1f}%" for s in steps) + " |")
    lines.append("| mean | " + " | ".join(f"**{100 * res['mean'][s]:.1f}%**" if s == res["best_step"]
                                          else f"{100 * res['mean'][s]:.1f}%" for s in steps) + " |")
    return "\n".join(lines)


def cmd_curves(args) -> dict:
    """Held-out accuracy over training of finished runs (`--runs`), and the best step."""
    res = eval_curves(args.runs)
    print(curves_table(res))
    print(f"best step: {res['best_step']}")
    return res


def greedy_overlap(start: list[bool], trained: list[bool], reference: list[bool]) -> dict[str, int]:
    """Counts over problems of greedy correctness: the problems RL gained (right after, wrong
    before) and lost, and how many of each the reference model gets right; beside them the
    reference's count on all the problems the start got wrong, the rate a gain would have
    if RL picked among those blindly."""
    if not len(start) == len(trained) == len(reference):
        raise ValueError("one correctness flag per problem for each model")
    rows = list(zip(start, trained, reference))
    gained = [r for s, t, r in rows if t and not s]
    lost = [r for s, t, r in rows if s and not t]
    return {"problems": len(rows), "start_right": sum(start), "trained_right": sum(trained),
            "reference_right": sum(reference), "gained": len(gained), "gained_reference_right": sum(gained),
            "lost": len(lost), "lost_reference_right": sum(lost),
            "start_wrong": sum(not s for s in start), "start_wrong_reference_right": sum(r for s, _, r in rows if not s),
            "trained_right_reference_wrong": sum(t and not r for _, t, r in rows)}


def cmd_overlap(args) -> dict:
    task, problems = _task_and_problems(args)
    correct = {}
    for role in ("start", "trained", "reference"):
        res = evaluate(load_policy(getattr(args, role)), task, problems, progress=False)
        correct[role] = [bool(s["correct"]) for s in res.samples]
    counts = greedy_overlap(correct["start"], correct["trained"], correct["reference"])
    print(json.dumps(counts))
    return {"start": args.start, "trained": args.trained, "reference": args.reference, "split": args.split,
            "n": args.n, **counts}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("passk")
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="countdown")
    p.add_argument("--task-options", default='{"num_numbers": 3}', help="JSON")
    p.add_argument("--temperature", type=float, default=1.0, help="of the k samples")
    p.set_defaults(func=cmd_passk)
    p = sub.add_parser("decoders")
    p.add_argument("--models", nargs="+", required=True, help="policy directories (a run's RUN/final)")
    p.add_argument("--task", default="countdown")
    p.add_argument("--task-options", default='{"num_numbers": 3}', help="JSON")
    p.set_defaults(func=cmd_decoders)
    p = sub.add_parser("main")
    p.add_argument("--config", default=str(ROOT / "configs" / "countdown-stabledrl.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[], help="config override, as `stabledrl train --set`")
    p.add_argument("--runs-dir", default="runs/rl-learns")
    p.set_defaults(func=cmd_main)
    p = sub.add_parser("controlled")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True, help="a finished run of --config (its metrics.jsonl)")
    p.add_argument("--set", action="append", default=[], help="config override, as `stabledrl train --set`")
    p.set_defaults(func=cmd_controlled)
    p = sub.add_parser("curves")
    p.add_argument("--runs", nargs="+", required=True, help="run directories evaluated at the same steps")
    p.set_defaults(func=cmd_curves)
    p = sub.add_parser("overlap")
    p.add_argument("--start", required=True, help="the model RL started from")
    p.add_argument("--trained", required=True, help="the trained model (RUN/final)")
    p.add_argument("--reference", required=True, help="the model to compare the gains with")
    p.add_argument("--task", default="countdown")
    p.add_argument("--task-options", default='{"num_numbers": 3}', help="JSON")
    p.set_defaults(func=cmd_overlap)
    for p in sub.choices.values():
        p.add_argument("--split", choices=["validation", "test"], default="validation")
        p.add_argument("--n", type=int, default=1000)
        p.add_argument("--k", type=int, default=8)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--tag", default="default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, **args.func(args)}
    out = ROOT / "benchmarks" / "results" / f"rl_learns-{args.cmd}-{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
