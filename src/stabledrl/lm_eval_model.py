"""`stabledrl` as an lm-evaluation-harness model: any checkpoint the project loads, decoded
by the project's sampler with its own settings (docs/lm-eval.md).

lm-eval finds models only in its own registry (no entry points), so the model is
registered by importing this module; running it runs lm-eval's own command line:

    python -m stabledrl.lm_eval_model --model stabledrl --tasks gsm8k \\
        --model_args pretrained=DIR,gen_length=256,block_length=32,steps=256

`model_args`: ``pretrained`` (the model directory or Hub name), any field of
`ModelConfig` (adapter, dtype, device, chat_template, stop_tokens as ``a|b`` ...) or of
`SamplingConfig` (gen_length, steps, block_length, temperature, remasking ...), and
``seed`` (the sampling noise: request i draws from generator ("eval/seed", i), as
`stabledrl eval --seed` does for problem i), ``batch_size`` (rows per sampler call; or lm-eval's
``--batch_size``: `rows_per_call`), ``estimator`` and ``num_samples`` (log-likelihood requests: a `stabledrl.likelihood`
method and its K views; none given: those requests are refused).

`generate_until` ignores the task's max_gen_toks and sampling flags: the model's decoding
settings are the model_args'. It cuts each completion at the policy's stop tokens, then
at the first of the request's `until` strings.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import lm_eval.models  # noqa: F401  (fills lm-eval's registry first: it loads its own models only when empty)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from stabledrl.config import load_config
from stabledrl.data import decode_policy_completions, encode_policy_prompts
from stabledrl.likelihood import Completions, estimate
from stabledrl.models import load_policy
from stabledrl.sampling import RolloutRequest, generate_micro_batched, row_generators
from stabledrl.seeds import step_seed
from stabledrl.settings import ModelConfig, SamplingConfig

__all__ = ["StableDRLLM", "cut_at", "rows_per_call"]

DEFAULT_ROWS_PER_CALL = 16
"""Rows per sampler call under ``batch_size=auto`` without ``max_batch_size``."""


def cut_at(text: str, until: list[str]) -> str:
    """`text` up to the first occurrence of any of the `until` strings."""
    ends = [i for i in (text.find(u) for u in until if u) if i >= 0]
    return text[: min(ends)] if ends else text


def rows_per_call(batch_size: int | str | None, max_batch_size: int | str | None = None) -> int:
    """Rows per sampler call for lm-eval's batch_size, read as lm-eval's own models read it: an
    integer (lm-eval's command line passes it as text), or "auto" / "auto:N" (N: how often
    lm-eval's models search again). No search is made here: "auto" (and None) takes
    `max_batch_size`, lm-eval's bound on that search, else `DEFAULT_ROWS_PER_CALL`."""
    mode, colon, times = ("auto" if batch_size is None else str(batch_size).strip()).partition(":")
    if mode == "auto" and (not colon or _is_number(times)):
        return DEFAULT_ROWS_PER_CALL if max_batch_size is None else _positive_int("max_batch_size", max_batch_size)
    return _positive_int("batch_size", batch_size)


def _positive_int(name: str, value: int | str) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        choices = ", 'auto' or 'auto:N'" if name == "batch_size" else ""
        raise ValueError(f"stabledrl model_args: {name} must be a positive integer{choices}, got {value!r}")
    return int(text)


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _split_args(args: dict[str, Any]) -> tuple[dict, dict, dict]:
    """model_args into (ModelConfig fields, SamplingConfig fields, this class's own)."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    sampling_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    own_fields = {"seed", "batch_size", "estimator", "num_samples", "max_batch_size"}
    model, sampling, own = {}, {}, {}
    for k, v in args.items():
        if k == "pretrained":
            model["path"] = str(v)
        elif k == "stop_tokens":
            model[k] = [int(t) if t.isdigit() else t for t in str(v).split("|")]
        elif k in model_fields:
            model[k] = v
        elif k in sampling_fields:
            sampling[k] = v
        elif k in own_fields:
            own[k] = v
        else:
            raise ValueError(f"stabledrl model_args: unknown key {k!r}; use pretrained, a ModelConfig field "
                             f"({', '.join(sorted(model_fields))}), a SamplingConfig field "
                             f"({', '.join(sorted(sampling_fields))}) or {', '.join(sorted(own_fields))}")
    if "path" not in model:
        raise ValueError("stabledrl model_args: give pretrained=DIR (a model directory or Hub name)")
    return model, sampling, own


@register_model("stabledrl")
class StableDRLLM(LM):
    """A stabledrl policy behind lm-eval's `LM` interface (see the module docstring)."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        if model_args.get("device") in (None, "cuda") and not torch.cuda.is_available():
            model_args.pop("device", None)  # lm-eval's default device; ModelConfig's auto picks the CPU
        model, sampling, own = _split_args(model_args)
        sampling.setdefault("gen_length", 256)
        self.sampling = load_config(SamplingConfig, sampling)
        self.policy = load_policy(load_config(ModelConfig, model))
        self.seed = int(own.get("seed", 0))
        self.batch_size = rows_per_call(own.get("batch_size"), own.get("max_batch_size"))
        self.estimator = own.get("estimator")
        self.num_samples = int(own.get("num_samples", 1))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "StableDRLLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "StableDRLLM":
        """model_args over lm-eval's own flags (--device, --batch_size), not beside them."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        contexts = [r.args[0] for r in requests]
        policy, s = self.policy, self.sampling
        policy.model.eval()
        ids, mask = encode_policy_prompts(policy, contexts)  # (n, P)
        out = generate_micro_batched(RolloutRequest(
            policy, ids.to(policy.device), mask.to(policy.device), s.gen_length,
            row_generators(f"eval/{self.seed}", 0, len(contexts)), s,
            micro_batch=s.micro_batch or self.batch_size, progress=not disable_tqdm))
        texts = decode_policy_completions(policy, out.completion_ids.cpu())
        return [cut_at(t, list(r.args[1].get("until", []) if len(r.args) > 1 else [])) for t, r in zip(texts, requests)]

    @torch.no_grad()
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log p(continuation | context) estimated by `estimator` with `num_samples` views, one
        request at a time (request i's masks from the generator seeded (seed, i)). is_greedy
        is not computed: always False."""
        if self.estimator is None:
            raise NotImplementedError(
                "stabledrl: a diffusion LM's log-likelihood is an estimate; choose one in model_args, e.g. "
                "estimator=mc,num_samples=64 (any stabledrl.likelihood method), or run generate_until tasks only")
        policy, out = self.policy, []
        for i, r in enumerate(requests):
            context, continuation = r.args
            ids, mask = encode_policy_prompts(policy, [context])  # (1, P)
            cont = policy.tokenizer.encode(continuation, add_special_tokens=False)
            if not cont:
                out.append((0.0, False))
                continue
            comp = torch.tensor([cont], device=policy.device)  # (1, n): every slot scored, no EOS
            rows = Completions(torch.ones_like(comp, dtype=torch.bool), prompt_ids=ids.to(policy.device),
                               completion_ids=comp, prompt_mask=mask.to(policy.device))
            est = estimate(policy, rows, method=self.estimator, num_samples=self.num_samples,
                           generator=torch.Generator().manual_seed(step_seed(self.seed, i, "prompts")))
            out.append((float(est.sequence[0]), False))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("stabledrl: rolling log-likelihood (perplexity tasks) is not supported; a diffusion "
                                  "LM has no left-to-right factorisation to roll over")


def main() -> None:
    """lm-eval's command line with the `stabledrl` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if len(sys.argv) < 2:
        sys.argv.append("--help")
    cli_evaluate()


if __name__ == "__main__":
    main()
