"""How much of one step's update is mask noise? Why GRPO collapses under noisy ratios while
StableDRL keeps learning (README, "GRPO vs StableDRL", its Sudoku part).

    python benchmarks/lab/mask_noise.py --preset sudoku     # ~15 min on one thread

For a preset's first `--batches` training batches (its own rollouts from the shipped model,
the groups with a signal), the update direction of one step is computed, without stepping,
under several mask draws of the likelihood estimator:

- `reference`: the expected update at μ = 1 with shared masks: StableDRL's gradient at ρ = 1
  (uniform weights: ∇ mean_groups (1/G) Σ_i A_i ℓ(y_i)), averaged over `--reference-draws`
  mask draws (disjoint from the others);
- `shared`: one draw, ℓ_old on the same masks as ℓ_θ (masks: shared), so ρ = 1 exactly and
  every objective is that gradient with one draw's noise;
- `stabledrl-independent` / `grpo-independent`: ℓ_old on one draw and ℓ_θ on another
  (masks: independent): the log-ratios are pure estimation noise at θ = θ_old.

Per variant: the median over `--draws` draws of the cosine with the reference and of the
gradient norm, the cosine of the draws' mean with the reference (a variant whose noise
averages out over steps comes closer to it as draws are added; a bias does not), and
(StableDRL) the weights' effective sample size. Writes benchmarks/results/mask_noise-<preset>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stabledrl.config import load_config
from stabledrl.diagnostics import flat_grad_cosine
from stabledrl.objectives import ScoredBatch, grpo_loss, group_advantages, stabledrl_loss
from stabledrl.settings import GRPOConfig
from stabledrl.scoring import StepScoring
from stabledrl.train import TrainConfig, _rollouts, set_up

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/lab/ -> the repository


def _grad(run, loss: torch.Tensor) -> list[torch.Tensor]:
    """∇ `loss` in the policy's parameters, as a list of tensors."""
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in run.params]
    run.opt.zero_grad(set_to_none=True)
    return grads


def _norm(g: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((x.double() ** 2).sum() for x in g)))


def measure_batch(run, step: int, *, draws: int, reference_draws: int) -> dict:
    cfg = run.cfg
    groups, _ = _rollouts(run, step)  # the trainer's prompts and groups of this step
    G = cfg.group_size
    adv = group_advantages(groups.rewards.flatten(), G, cfg.objective.advantage_scale)
    policy = run.policy

    def plan(k: int):  # mask draw k of this batch (seeds apart from the trainer's slots)
        other = dataclasses.replace(run, cfg=dataclasses.replace(cfg, seed=10_000 + k))
        return StepScoring(other, groups, step).plan(1)  # all rows: one process

    def logp(k: int, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return StepScoring(run, groups, step).own(policy, plan(k), groups)[0]

    def stabledrl(k_new: int, old: torch.Tensor | None = None):  # ℓ_old = ℓ_θ's own value: ρ = 1, uniform weights
        ell = logp(k_new, True)
        return stabledrl_loss(cfg.objective, ScoredBatch(ell, ell.detach() if old is None else old, adv, G))

    ref = None
    for k in range(reference_draws):
        g = _grad(run, stabledrl(1000 + k).loss)
        ref = g if ref is None else [a + b for a, b in zip(ref, g)]
    rows: dict[str, list] = {"shared": [], "stabledrl-independent": [], "grpo-independent": []}
    sums: dict[str, list[torch.Tensor] | None] = dict.fromkeys(rows)
    ess, log_std = [], []
    for k in range(draws):
        old = logp(2 * k, False)  # ℓ_old on draw 2k; ℓ_θ on draw 2k+1 (independent)
        indep = stabledrl(2 * k + 1, old)
        grads = {"shared": _grad(run, stabledrl(2 * k).loss), "stabledrl-independent": _grad(run, indep.loss),
                 "grpo-independent": _grad(run, grpo_loss(GRPOConfig(clip_eps=cfg.objective.clip_eps),
                                                           ScoredBatch(logp(2 * k + 1, True), old, adv, G)).loss)}
        for name, g in grads.items():
            rows[name].append({"cos_reference": flat_grad_cosine(g, ref), "norm": _norm(g)})
            sums[name] = g if sums[name] is None else [a + b for a, b in zip(sums[name], g)]
        ess.append(indep.metrics["ess"])
        log_std.append(indep.metrics["log_ratio_std"])
    summary = {name: {"cos_reference_median": statistics.median(r["cos_reference"] for r in rs),
                      "norm_median": statistics.median(r["norm"] for r in rs),
                      "cos_reference_of_mean": flat_grad_cosine(sums[name], ref), "draws": rs}
               for name, rs in rows.items()}
    return {"step": step, "rows": int(groups.completion_ids.size(0)), "groups": len(groups.problems),
            "reference_norm": _norm([x / reference_draws for x in ref]),
            "stabledrl_ess_median": statistics.median(ess), "log_ratio_std_median": statistics.median(log_std),
            "variants": summary}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sudoku", help="configs/<preset>-stabledrl.yaml")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--reference-draws", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(TrainConfig, ROOT / "configs" / f"{args.preset}-stabledrl.yaml",
                          [f"output_dir={tmp}", "eval_n=1", "threads=1"])
        run = set_up(cfg)
        run.policy.model.eval()  # as the trainer's update: no dropout
        batches = []
        for step in range(args.batches):
            batches.append(measure_batch(run, step, draws=args.draws, reference_draws=args.reference_draws))
            b = batches[-1]
            print(f"step {step}: {b['groups']} groups, ESS {b['stabledrl_ess_median']:.2f}, log-ratio std "
                  f"{b['log_ratio_std_median']:.2f}; cos with the reference: "
                  + ", ".join(f"{n} {v['cos_reference_median']:.3f} (mean of draws {v['cos_reference_of_mean']:.3f})"
                             for n, v in b["variants"].items()), flush=True)
        run.tracker.close()
    out = ROOT / "benchmarks" / "results" / f"mask_noise-{args.preset}.json"
    out.write_text(json.dumps({"command": "python benchmarks/lab/mask_noise.py " + " ".join(sys.argv[1:]),
                               "config": f"configs/{args.preset}-stabledrl.yaml", "estimator": cfg.estimator.method,
                               "num_samples": cfg.estimator.num_samples, "batches": batches,
                               "seconds": time.perf_counter() - t0, "device": "cpu, one thread"}, indent=2))
    print(out)


if __name__ == "__main__":
    main()
