"""The `stabledrl` command: sft, train, report, eval, sample.

    stabledrl sft --config configs/sft-countdown.yaml [--set steps=100 ...] [--resume]
    stabledrl train --config configs/countdown-stabledrl.yaml [--set lr=3e-5 ...] [--resume]
    stabledrl report runs/countdown-stabledrl runs/countdown-grpo
    stabledrl eval --model checkpoints/countdown-tiny --task countdown --split test --n 500
    stabledrl sample --model checkpoints/countdown-tiny --prompt 3,5,7=22 --prompt 2,4,9=17

Bad input (a config value, a file, an option) ends in one line on stderr that names it and
the fix, and exit status 2. The config is checked before torch is imported, so that line
comes at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence, get_args

import yaml

from stabledrl.config import ConfigError, check, load_config
from stabledrl.settings import ApproxCache, Noise  # no torch

__all__ = ["main"]


def _parse_options(items: Sequence[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"option {item!r} must look like key=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError:
            raise ConfigError(f"option {item!r}: the value is not valid YAML; quote it, e.g. key='text'") from None
    return out


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--gen-length", type=int, help="completion slots L (default: the task's)")
    g.add_argument("--steps", type=int, help="denoising steps T (default: L)")
    g.add_argument("--block-length", type=int, help="semi-autoregressive block size (default: L)")
    g.add_argument("--temperature", type=float, default=0.0, help="Gumbel temperature, 0 = greedy")
    g.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence")
    g.add_argument("--no-kv-cache", action="store_true", help="block models: recompute the prefix every step")
    g.add_argument("--top-k", type=int, help="draw from the k most likely tokens only (temperature > 0)")
    g.add_argument("--top-p", type=float,
                   help="nucleus sampling: the smallest set of tokens of mass p (temperature > 0)")
    g.add_argument("--eos-confidence-scale", type=float, default=1.0,
                   help="EOS damping: scale of the remasking score of a slot that drew a stop token, in (0, 1]")
    g.add_argument("--noise", choices=get_args(Noise), default="generator",
                   help="counter: device-side counter noise for the decoded slots only (same distribution, "
                        "other tokens than the default generator noise)")
    g.add_argument("--threshold", type=float,
                   help="parallel decoding: also commit every slot whose confidence exceeds it, in (0, 1]")
    g.add_argument("--approx-cache", choices=get_args(ApproxCache), default="none",
                   help="full attention: Fast-dLLM's approximate prefix / dual KV cache, refreshed per block")


def _sampling(args: argparse.Namespace):
    from stabledrl.settings import SamplingConfig

    return load_config(SamplingConfig, {
        "gen_length": args.gen_length, "steps": args.steps, "block_length": args.block_length,
        "temperature": args.temperature, "remasking": args.remasking, "kv_cache": not args.no_kv_cache,
        "top_k": args.top_k, "top_p": args.top_p, "eos_confidence_scale": args.eos_confidence_scale,
        "noise": args.noise, "threshold": args.threshold, "approx_cache": args.approx_cache,
    })


def _cmd_sft(args: argparse.Namespace) -> int:
    from stabledrl.settings import SFTConfig  # no torch: a bad config is reported at once

    cfg = load_config(SFTConfig, args.config, args.set)
    _quiet_transformers()
    from stabledrl.sft import run_sft

    summary = run_sft(cfg, resume=args.resume)
    print(json.dumps(summary))
    print(f"final model: {Path(cfg.output_dir) / 'final'}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from stabledrl.settings import TrainConfig  # no torch: a bad config is reported at once

    overrides = list(args.set) + ([f"model.path={args.model}"] if args.model else [])
    cfg = load_config(TrainConfig, args.config, overrides)
    _quiet_transformers()
    from stabledrl.train import run_train

    summary = run_train(cfg, resume=args.resume)
    from accelerate import PartialState

    main_process = PartialState().is_main_process
    several = _end_process_group()
    if main_process:  # one report per run, not one per process
        before, after = summary["eval_initial"], summary["eval_final"]
        print(f"held-out accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f}, "
              f"mean reward {before['mean_reward']:.4f} -> {after['mean_reward']:.4f}")
        print(f"skipped steps {summary['skipped_steps']}, zero-variance groups {summary['zero_variance_groups']}")
        print(f"final model: {Path(cfg.output_dir) / 'final'}")
    if several:
        _leave(0)
    return 0


def _end_process_group() -> bool:
    """End the process group of a run on several processes; True if there was one.

    The run's objects (under FSDP, its sharded model and the collectives' pending work) are
    freed first, while the group and the interpreter are whole."""
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    gc.collect()
    dist.destroy_process_group()
    return True


def _leave(code: int) -> None:
    """Exit now, without the interpreter's teardown: a process of a finished multi-process run.

    Left to the interpreter's exit (or to C++ static destructors), gloo's threads can abort a
    process whose run is complete and saved: SIGABRT, "terminate called without an active
    exception", seen in about 1 of 12 two-process launches, and under FSDP on CPU even after
    the group was ended. Every file of the run is closed by now; only stdout and stderr wait."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_report(args: argparse.Namespace) -> int:
    from stabledrl.report import plot_runs

    out = Path(args.out) if args.out else Path(args.runs[0]) / "report.png"
    print(f"wrote {plot_runs(args.runs, out)}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    check(args.n >= 1, f"--n must be >= 1, got {args.n}")
    check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    sampling, options = _sampling(args), _parse_options(args.task_option)
    sampling.sort_by_length = args.sort_by_length
    _quiet_transformers()
    from stabledrl.evaluate import evaluate
    from stabledrl.models import load_policy
    from stabledrl.tasks import get_task

    task = get_task(args.task, **options)
    policy = load_policy(_model_config(args))
    problems = task.generate(args.n, split=args.split, seed=args.seed)
    res = evaluate(policy, task, problems, sampling, batch_size=args.batch_size, seed=args.seed)
    report = {"model": str(args.model), "task": args.task, "split": args.split, "seed": args.seed, **res.summary()}
    print(f"{args.task} {args.split} n={res.n}: accuracy {res.accuracy:.4f}, mean reward {res.mean_reward:.4f} "
          f"({res.tokens_per_second:.0f} tokens/s)")
    out = Path(args.out) if args.out else Path(args.model) / f"eval-{args.task}-{args.split}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "samples": res.samples}, indent=2))
        print(f"wrote {out}")
    except OSError as e:
        print(f"could not write {out}: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    check(args.num_samples >= 1, f"--num-samples must be >= 1, got {args.num_samples}")
    sampling, options = _sampling(args), _parse_options(args.task_option)
    _quiet_transformers()
    import torch

    from stabledrl.data import decode_policy_completions, encode_policy_prompts
    from stabledrl.models import load_policy
    from stabledrl.sampling import generate
    from stabledrl.tasks import get_task
    from stabledrl.tasks.base import score_all

    task = get_task(args.task, **options)
    policy = load_policy(_model_config(args))
    gen_length = sampling.gen_length or task.completion_length
    prompts = [p for p in args.prompt for _ in range(args.num_samples)]
    ids, mask = encode_policy_prompts(policy, prompts, strict=True)  # typed by hand: no silent UNK
    problems = {p: _problem_of(task, p) for p in args.prompt}  # None: no reward to show
    out = generate(
        policy, ids, mask, gen_length=gen_length, generator=torch.Generator().manual_seed(args.seed),
        **sampling.generate_kwargs(),
    )
    for prompt, text in zip(prompts, decode_policy_completions(policy, out.completion_ids)):
        problem = problems[prompt]
        if problem is None:
            print(f"{prompt}\t{text}")
            continue
        score = score_all(task, [text], [problem])[0]  # scored once (the code task runs the program once)
        print(f"{prompt}\t{text}\treward {score:.3g} ({'correct' if score.correct else 'wrong'})")
    return 0


def _problem_of(task, prompt: str):
    """The task's problem that `prompt` states, or None (said on stderr) if it states none."""
    parse = getattr(task, "problem_from_prompt", None)
    if parse is None:
        return None
    try:
        return parse(prompt)
    except ValueError as e:
        print(f"stabledrl sample: {e}; no reward shown for it", file=sys.stderr)
        return None


def _quiet_transformers() -> None:
    """No per-file load/save bars: they drown the command's own output. (Imports
    transformers: call it after the arguments and the config are checked.)"""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _model_config(args: argparse.Namespace):
    from stabledrl.settings import ModelConfig

    chat = {"auto": "auto", "on": True, "off": False}[args.chat_template]
    stops = [int(t) if t.isdigit() else t for t in args.stop_token]
    return ModelConfig(path=args.model, adapter=args.adapter, mask_token_id=args.mask_token_id,
                       block_size=args.block_size, dtype=args.dtype, device=args.device,
                       trust_remote_code=args.trust_remote_code, chat_template=chat, stop_tokens=stops)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory (stabledrl, a run's final/, or a transformers "
                   "checkpoint) or a Hub name")
    p.add_argument("--adapter", default="auto", choices=["auto", "tiny", "llada", "dream", "masked_lm", "decoder"],
                   help="how to read the checkpoint (auto: from its config)")
    p.add_argument("--mask-token-id", type=int, help="the mask token (default: the checkpoint's or tokenizer's)")
    p.add_argument("--block-size", type=int, help="decoder adapter: block size S")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                   help="run the checkpoint's own modelling code (default: on for llada and dream, for a checkpoint "
                   "whose config.json names its code, and as a saved stabledrl model records it)")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one, or as a saved "
                   "stabledrl model records it)")
    p.add_argument("--stop-token", action="append", default=[], metavar="TOKEN",
                   help="another token that ends a completion: an id (digits) or a token's text (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:1 ...")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stabledrl", description="RL post-training for diffusion language models")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("sft", help="train a tiny masked-diffusion LM from scratch")
    p.add_argument("--config", required=True, help="YAML file (fields: stabledrl.sft.SFTConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("train", help="RL post-training (grpo, stabledrl, wd1, diffu-grpo, gdpo, coupled-grpo presets)")
    p.add_argument("--config", required=True, help="YAML file (fields: stabledrl.train.TrainConfig)")
    p.add_argument("--model", help="initial policy directory (overrides the config's model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("report", help="plot reward, gradient norm, ratio spread, bypass and drift of runs")
    p.add_argument("runs", nargs="+", help="run directories (several are overlaid)")
    p.add_argument("--out", help="PNG path (default: FIRST_RUN/report.png)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("eval", help="accuracy and mean reward on generated problems")
    _add_model_args(p)
    p.add_argument("--task", default="countdown")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. num_numbers=4")
    p.add_argument("--split", choices=["train", "validation", "test"], default="test")
    p.add_argument("--n", type=int, default=500, help="number of problems")
    p.add_argument("--seed", type=int, default=0, help="selects the problems and the sampling noise")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--sort-by-length", action="store_true",
                   help="batches of problems sorted by prompt length, each without the padding all its prompts have "
                        "(faster where prompt lengths vary, e.g. gsm8k; tokens the same but for rounding)")
    p.add_argument("--out", help="JSON report path (default: MODEL/eval-TASK-SPLIT.json)")
    _add_sampling_args(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("sample", help="print completions for prompts")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt, e.g. 3,5,7=22 (repeatable)")
    p.add_argument("--task", default="countdown", help="sets the default completion length; a prompt of the task "
                   "(e.g. 3,5,7=22 for countdown) gets each completion's reward")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. num_numbers=4")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=0)
    _add_sampling_args(p)
    p.set_defaults(func=_cmd_sample)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, OSError, ValueError) as e:  # bad input: one line that says what to fix, no traceback
        print(f"stabledrl {args.verb}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
