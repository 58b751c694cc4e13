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
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Sequence

import yaml

from stabledrl.config import ConfigError, check, field_docs, load_config
from stabledrl.settings import OBJECTIVE_SECTIONS, SamplingConfig  # no torch

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


_NOT_FLAGS = ("micro_batch", "engine", "engine_options")
"""Sampling fields without a flag: eval's --batch-size sets its micro-batches; engines are the trainer's."""


def _add_sampling_args(p: argparse.ArgumentParser, leave_out: Sequence[str] = ()) -> None:
    """A flag for each field of `SamplingConfig` (``gen_length`` -> ``--gen-length``), its help
    the field's docstring; a bool field gets ``--x`` and ``--no-x``."""
    g = p.add_argument_group("sampling", "the fields of a config's sampling section (SamplingConfig)")
    docs, hints = field_docs(SamplingConfig), typing.get_type_hints(SamplingConfig)
    for f in dataclasses.fields(SamplingConfig):
        if f.name in _NOT_FLAGS or f.name in leave_out:
            continue
        kind = _flag_kind(hints[f.name])
        if "type" in kind:
            kind["metavar"] = f.name.upper()
        default = "null" if f.default is None else f.default
        g.add_argument("--" + f.name.replace("_", "-"), dest=f"sampling_{f.name}", default=None,
                       help=f"{docs[f.name]} (default: {default})".replace("%", "%%"), **kind)


def _flag_kind(t) -> dict:
    """The argparse keywords that read a value of type `t` (bool, a Literal, or a number, maybe None)."""
    if t is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(t) is typing.Literal:
        return {"choices": typing.get_args(t)}
    kinds = [a for a in typing.get_args(t) if a is not type(None)] or [t]
    return {"type": kinds[0]}


def _sampling(args: argparse.Namespace) -> SamplingConfig:
    """The sampling settings the flags give; a field without its flag keeps its default."""
    given = {k.removeprefix("sampling_"): v for k, v in vars(args).items()
             if k.startswith("sampling_") and v is not None}
    return load_config(SamplingConfig, given)


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
    _quiet_transformers()
    from stabledrl.evaluate import evaluate
    from stabledrl.models import load_policy
    from stabledrl.tasks import get_task

    task = get_task(args.task, **options)
    out = _eval_out(args.model, args.task, args.split, args.out)
    policy = load_policy(_model_config(args))
    problems = task.generate(args.n, split=args.split, seed=args.seed)
    sampling = dataclasses.replace(sampling, micro_batch=args.batch_size)
    res = evaluate(policy, task, problems, sampling, seed=args.seed)
    report = {"model": str(args.model), "task": args.task, "split": args.split, "seed": args.seed, **res.summary()}
    print(f"{args.task} {args.split} n={res.n}: accuracy {res.accuracy:.4f}, mean reward {res.mean_reward:.4f} "
          f"({res.tokens_per_second:.0f} tokens/s)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "samples": res.samples}, indent=2))
        print(f"wrote {out}")
    except OSError as e:
        print(f"could not write {out}: {e}; name another path with --out", file=sys.stderr)
        return 1
    return 0


def _eval_out(model: str, task: str, split: str, out: str | None) -> Path:
    """Where `eval` writes its JSON: `out` if given; for a run's checkpoint or final model,
    RUN/evals/NAME-TASK-SPLIT.json, beside the run's metrics; for any other model (a shipped
    one, a Hub name), ./evals/NAME-TASK-SPLIT.json, as runs go to ./runs/. Never the model
    directory: a shipped model, a Hub cache or a mount may be read-only or another's."""
    from stabledrl.checkpoint import run_dir_of

    if out:
        return Path(out)
    path = Path(model)
    run = run_dir_of(path)
    if run is not None:
        return run / "evals" / f"{path.name}-{task}-{split}.json"
    name = path.resolve().name if path.is_dir() else model.strip("/").replace("/", "--")  # org/name -> org--name
    return Path("evals") / f"{name}-{task}-{split}.json"


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
    out = generate(policy, ids, mask, dataclasses.replace(sampling, gen_length=gen_length),
                   generator=torch.Generator().manual_seed(args.seed))
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
    p.add_argument("--adapter", default="auto",
                   choices=["auto", "tiny", "llada", "dream", "sdar", "masked_lm", "decoder"],
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

    objectives = ", ".join(OBJECTIVE_SECTIONS)
    p = sub.add_parser("train", help=f"RL post-training (objectives: {objectives}; presets in configs/)")
    p.add_argument("--config", required=True, help=f"YAML file (fields: stabledrl.train.TrainConfig; objective.name: "
                                                   f"{objectives})")
    p.add_argument("--model", help="initial policy directory (overrides the config's model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("report", help="plot reward, gradient norm, ratio spread, bypass and drift of runs")
    p.add_argument("runs", nargs="+", help="run directories (several are overlaid)")
    p.add_argument("--out", help="PNG path (default: FIRST_RUN/report.png, inside that run directory)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("eval", help="accuracy and mean reward on generated problems")
    _add_model_args(p)
    p.add_argument("--task", default="countdown")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. num_numbers=4")
    p.add_argument("--split", choices=["train", "validation", "test"], default="test")
    p.add_argument("--n", type=int, default=500, help="number of problems")
    p.add_argument("--seed", type=int, default=0, help="selects the problems and the sampling noise")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", help="JSON report path (default: RUN/evals/NAME-TASK-SPLIT.json for a run's checkpoint or "
                   "final model NAME; else evals/NAME-TASK-SPLIT.json in the current directory, as runs go to runs/, "
                   "NAME the model directory's name or the Hub name with / as --; never inside the model directory, "
                   "which may be read-only or shared)")
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
    _add_sampling_args(p, leave_out=("sort_by_length",))  # one call: nothing to sort
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
