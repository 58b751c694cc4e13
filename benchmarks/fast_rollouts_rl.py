"""Does RL learn as well when its rollouts are decoded with Fast-dLLM's approximate caches and
threshold parallel decoding? The task's preset, over seeds, with only `rollout` changed
(evaluation stays the exact built-in sampler).

    python benchmarks/fast_rollouts_rl.py launch --task countdown --seeds 0 1 2 --settings A B C --jobs 2
    python benchmarks/fast_rollouts_rl.py midway --task countdown --settings A B C R2
    python benchmarks/fast_rollouts_rl.py summarise --task countdown --settings A B C R2

Settings (`SETTINGS`): A the preset (exact, uncached), B `rollout.approx_cache=dual`, C dual and
`rollout.threshold=0.9`; A4/B4/C4 the same with `rollout.block_length=4`; R2/R4 dual refreshed
every 2 / 4 calls.

`launch` runs each (setting, seed) as its own process (`run`, at most `--jobs` at a time,
`threads=1`), into runs/fastrl/<task>-<setting>-s<seed> with a log beside it, then summarises.
`run` trains one of them in this process, counting the rollouts' model calls (the sampler's
`forward_passes`, through a wrapper of `stabledrl.rollouts.roll_out`) and timing the whole run;
it writes fastrl.json into the run directory. A finished run is reused (`finished_summary`).
`summarise` reads the run directories into benchmarks/results/fast_rollouts_rl-<task>.json:
per run the held-out accuracy before and after, wall seconds (the process: both evaluations
included) and the training steps' seconds, rollout seconds (the metrics' time_rollout), rollout
model calls, the means over the steps of the ratio diagnostics and of the rollout entropy,
skipped steps and collapse flags; per setting the means over seeds, and a step's time against
A's (`step_time_vs_A`: 1 + rollout time over the rest of the step, whose work is the same in
every setting, so the machine's varying load cancels). `midway` evaluates each finished run's
checkpoint of step 100 as the final evaluation is made (midway-100.json, read by `summarise`):
the accuracy at two thirds of the run's time, to compare settings at equal time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"countdown": "configs/countdown-stabledrl.yaml", "sudoku": "configs/sudoku-stabledrl.yaml"}
DUAL, THRESHOLD, BLOCKS4 = ["rollout.approx_cache=dual"], ["rollout.threshold=0.9"], ["rollout.block_length=4"]
SETTINGS = {"A": [], "B": DUAL, "C": DUAL + THRESHOLD,
            "A4": BLOCKS4, "B4": BLOCKS4 + DUAL, "C4": BLOCKS4 + DUAL + THRESHOLD,
            "R2": DUAL + ["rollout.approx_refresh=2"], "R4": DUAL + ["rollout.approx_refresh=4"]}
# The step means reported (those present in the metrics): ratio diagnostics, then the rollouts'.
STEP_KEYS = ["ratio_max", "ratio_mean", "log_ratio_std", "ess", "clip_fraction", "bypass_fraction", "drift_kl", "drift_k3",
             "entropy", "reward_mean", "completion_length", "zero_variance_fraction", "grad_norm", "time_rollout",
             "seconds"]


def run_dir(task: str, setting: str, seed: int) -> Path:
    return ROOT / "runs" / "fastrl" / f"{task}-{setting}-s{seed}"


def overrides(task: str, setting: str, seed: int, extra: list[str]) -> list[str]:
    return [f"seed={seed}", f"output_dir={run_dir(task, setting, seed)}", "threads=1", *SETTINGS[setting], *extra]


def cmd_run(args) -> None:
    import stabledrl.rollouts as rollouts
    from stabledrl.checkpoint import finished_summary
    from stabledrl.config import load_config
    from stabledrl.train import TrainConfig, run_train

    cfg = load_config(TrainConfig, ROOT / CONFIGS[args.task], overrides(args.task, args.setting, args.seed, args.set))
    out = Path(cfg.output_dir)
    if finished_summary(out, cfg):
        print(f"{out}: finished already")
        return
    calls = {"forward_passes": 0, "row_forward_passes": 0, "rollout_calls": 0}
    roll_out = rollouts.roll_out

    def counting(request):  # the same rollout; its model calls counted
        res = roll_out(request)
        calls["forward_passes"] += res.forward_passes  # batch calls: a call runs the rows with masks left
        # a row's own calls: the distinct steps it committed at (each call commits >= 1 slot of each row it runs)
        calls["row_forward_passes"] += sum(len(set(row)) for row in res.unmask_step.tolist())
        calls["rollout_calls"] += 1
        return res

    rollouts.roll_out = counting
    git = ["git", "-C", str(ROOT)]  # the library this run imported (src is edited alongside)
    calls["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    calls["src_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True).stdout)
    t0 = time.perf_counter()
    summary = run_train(cfg, progress=False)
    wall = time.perf_counter() - t0
    (out / "fastrl.json").write_text(json.dumps({"wall_seconds": wall, **calls}, indent=2))
    print(f"{out}: held-out accuracy {summary['eval_initial']['accuracy']:.4f} -> "
          f"{summary['eval_final']['accuracy']:.4f} ({wall:.0f} s)")


def cmd_launch(args) -> None:
    todo = [(args.task, s, seed) for seed in args.seeds for s in args.settings]  # seed by seed: stopped early, seeds compare
    if args.runs:  # an explicit order, [TASK:]SETTING:SEED ...
        todo = [(*([args.task] if r.count(":") == 1 else []), *r.split(":")) for r in args.runs]
    running: list[subprocess.Popen] = []
    def busy() -> int:  # training runs of this script on the machine, ours or another launcher's
        ps = subprocess.run(["pgrep", "-fc", "fast_rollouts_rl.py run "], capture_output=True, text=True)
        return int(ps.stdout.strip() or 0)

    while todo or running:
        running = [p for p in running if p.poll() is None]
        while todo and busy() < args.jobs:
            task, setting, seed = todo.pop(0)
            log = run_dir(task, setting, seed).with_suffix(".log")
            log.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "run", "--task", task, "--setting", setting, "--seed", str(seed),
                   *(x for kv in args.set for x in ("--set", kv))]
            running.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT))
            print(f"started {task} {setting} seed {seed} -> {log}", flush=True)
            time.sleep(2)
        time.sleep(5)
    cmd_summarise(args)


def cmd_midway(args) -> None:
    """Each finished run's checkpoint of step `--step` evaluated as the run's final evaluation is
    (its config's held-out problems and eval_sampling), into the run directory's midway-<step>.json:
    the accuracy at a fraction of the run's time, to compare settings at equal time."""
    import dataclasses

    import torch

    from stabledrl.config import load_config
    from stabledrl.evaluate import evaluate
    from stabledrl.models.policy import load_policy
    from stabledrl.tasks import get_task
    from stabledrl.train import TrainConfig

    for setting in args.settings:
        for seed in args.seeds:
            out = run_dir(args.task, setting, seed)
            ckpt, path = out / f"checkpoint-{args.step:07d}", out / f"midway-{args.step}.json"
            if not (out / "summary.json").is_file() or not ckpt.is_dir() or path.is_file():
                continue
            cfg = load_config(TrainConfig, out / "config.yaml", [])
            torch.set_num_threads(cfg.threads or 1)
            task = get_task(cfg.task.name, **cfg.task.options)
            problems = task.generate(cfg.eval_n, split=cfg.eval_split, seed=0)
            policy = load_policy(dataclasses.replace(cfg.model, path=str(ckpt)), device="cpu")
            res = evaluate(policy, task, problems, cfg.eval_sampling, progress=False)
            path.write_text(json.dumps({"step": args.step, "accuracy": res.accuracy, "mean_reward": res.mean_reward,
                                        "n": res.n, "checkpoint": str(ckpt.relative_to(ROOT))}, indent=2))
            print(f"{out.name}: step {args.step} held-out accuracy {res.accuracy:.4f}", flush=True)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def summarise_run(task: str, setting: str, seed: int) -> dict | None:
    from stabledrl.report import load_metrics

    out = run_dir(task, setting, seed)
    if not (out / "summary.json").is_file():
        return None
    summary = json.loads((out / "summary.json").read_text())
    extra = json.loads((out / "fastrl.json").read_text()) if (out / "fastrl.json").is_file() else {}
    steps = [r for r in load_metrics(out) if "reward_mean" in r]
    means = {k: _mean(r.get(k) for r in steps) for k in STEP_KEYS if any(k in r for r in steps)}
    if "drift_k3" in means:  # heavy-tailed (exp of a log-likelihood gap): its median says more than its mean
        means["drift_k3_median"] = statistics.median(r["drift_k3"] for r in steps if r.get("drift_k3") is not None)
    start, final = summary["eval_initial"]["accuracy"], summary["eval_final"]["accuracy"]
    wall = extra.get("wall_seconds")
    midway = out / "midway-100.json"  # written by `midway`
    at_100 = json.loads(midway.read_text())["accuracy"] if midway.is_file() else None
    return {"setting": setting, "seed": seed, "run_dir": str(out.relative_to(ROOT)), "start": start, "final": final,
            "at_step_100": at_100, "gain_points": 100 * (final - start), "wall_seconds": wall,
            "train_seconds": sum(r.get("seconds", 0.0) for r in steps),
            "rollout_seconds": sum(r.get("time_rollout", 0.0) for r in steps),
            # rollout time over the rest of the steps' time (the same work in every setting): robust to a shared machine's load
            "rollout_to_rest": sum(r.get("time_rollout", 0.0) for r in steps) / sum(
                r.get("seconds", 0.0) - r.get("time_rollout", 0.0) for r in steps),
            "rollout_forward_passes": extra.get("forward_passes"),
            "rollout_row_forward_passes": extra.get("row_forward_passes"), "rollouts": None,
            "gain_points_per_1000_s": 100 * (final - start) / wall * 1000 if wall else None,
            "step_means": means,
            "first_last_10_steps": {k: [_mean(r.get(k) for r in steps[:10]), _mean(r.get(k) for r in steps[-10:])]
                                    for k in ("reward_mean", "accuracy_train", "entropy", "zero_variance_fraction")},
            "skipped_steps": summary.get("skipped_steps"),
            "zero_variance_groups": summary.get("zero_variance_groups"), "collapse": summary.get("collapse"),
            "steps_logged": len(steps)}


def cmd_summarise(args) -> None:
    from stabledrl.config import load_config
    from stabledrl.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / CONFIGS[args.task], [])
    rollouts = cfg.steps * cfg.prompts_per_step * cfg.group_size
    runs = [r for s in args.settings for seed in args.seeds if (r := summarise_run(args.task, s, seed))]
    for r in runs:
        r["rollouts"] = rollouts
        r["gain_points_per_1000_rollouts"] = r["gain_points"] / rollouts * 1000
    per_setting = {}
    for s in args.settings:
        rs = [r for r in runs if r["setting"] == s]
        if not rs:
            continue
        keys = ["start", "final", "gain_points", "wall_seconds", "train_seconds", "rollout_seconds", "rollout_to_rest",
                "rollout_forward_passes", "rollout_row_forward_passes", "gain_points_per_1000_s", "gain_points_per_1000_rollouts"]
        per_setting[s] = {"overrides": SETTINGS[s], "seeds": [r["seed"] for r in rs],
                          **{k: _mean(r[k] for r in rs) for k in keys},
                          "at_step_100": _mean(r["at_step_100"] for r in rs),
                          "final_min": min(r["final"] for r in rs), "final_max": max(r["final"] for r in rs),
                          "rollout_share": _mean(r["rollout_seconds"] / r["wall_seconds"] for r in rs
                                                 if r["wall_seconds"]),
                          "step_means": {k: _mean(r["step_means"].get(k) for r in rs) for k in rs[0]["step_means"]},
                          "skipped_steps": sum(r["skipped_steps"] or 0 for r in rs),
                          "collapsed_runs": sum(bool(r["collapse"]) for r in rs)}
    if "A" in per_setting:  # a step's time against the exact preset's, with the rest of the step as the yardstick
        for m in per_setting.values():
            m["step_time_vs_A"] = (1 + m["rollout_to_rest"]) / (1 + per_setting["A"]["rollout_to_rest"])
    result = {"command": " ".join(["python", *sys.argv]), "note": args.note, "config": CONFIGS[args.task], "task": args.task,
              "rollouts_per_run": rollouts, "settings": {s: SETTINGS[s] for s in args.settings},
              "per_setting": per_setting, "runs": runs}
    path = ROOT / "benchmarks" / "results" / f"fast_rollouts_rl-{args.task}.json"
    path.write_text(json.dumps(result, indent=2))
    for s, m in per_setting.items():
        print(f"{s}: {100 * m['start']:.1f}% -> {100 * m['final']:.1f}% (min {100 * m['final_min']:.1f}, "
              f"max {100 * m['final_max']:.1f}); wall {m['wall_seconds']:.0f} s, rollouts {m['rollout_seconds']:.0f} s, "
              f"model calls {m['rollout_forward_passes']}")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run", "launch", "summarise", "midway"):
        p = sub.add_parser(name)
        p.add_argument("--task", choices=sorted(CONFIGS), required=True)
        p.add_argument("--set", action="append", default=[], help="another override, KEY=VALUE (every run)")
        if name == "run":
            p.add_argument("--setting", choices=sorted(SETTINGS), required=True)
            p.add_argument("--seed", type=int, required=True)
        else:
            p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["A", "B", "C"])
            p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
        if name == "midway":
            p.add_argument("--step", type=int, default=100, help="the checkpoint's step")
        if name not in ("run", "midway"):
            p.add_argument("--note", default="", help="kept in the JSON (e.g. how the runs were launched)")
        if name == "launch":
            p.add_argument("--jobs", type=int, default=2, help="runs at a time (this script's runs on the machine)")
            p.add_argument("--runs", nargs="+", default=[], help="[TASK:]SETTING:SEED in this order (default: each seed's settings)")
    args = parser.parse_args()
    {"run": cmd_run, "launch": cmd_launch, "summarise": cmd_summarise, "midway": cmd_midway}[args.cmd](args)


if __name__ == "__main__":
    main()
