"""Shared fixtures: a tiny randomly initialised model and a scripted fake policy."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stabledrl.models import TinyDiffusionConfig, TinyDiffusionLM, TinyPolicy
from stabledrl.tokenizer import build_char_tokenizer

# The test models are tiny: one thread is as fast, and it avoids the large slow-downs of
# two OpenMP threads fighting another process for two cores.
torch.set_num_threads(1)


def make_tiny_policy(seed: int = 0, **overrides) -> TinyPolicy:
    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=64, mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.update(overrides)
    model = TinyDiffusionLM(TinyDiffusionConfig(**cfg)).eval()
    return TinyPolicy(model, tok)


@pytest.fixture
def tiny_policy() -> TinyPolicy:
    return make_tiny_policy()


class ScriptedPolicy:
    """A fake policy: completion slot i prefers token `script[i]` with confidence
    `confidence[i]` (a logit margin), whatever the input. Counts its calls."""

    def __init__(self, script: list[int], confidence: list[float], prompt_len: int):
        self.tokenizer = build_char_tokenizer()
        self.mask_token_id = self.tokenizer.mask_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        self.eos_token_id = self.tokenizer.eos_token_id
        self.attention_kind = "full"
        self.block_size = None
        self.model = torch.nn.Linear(1, 1)
        self.script, self.confidence, self.prompt_len = script, confidence, prompt_len
        self.calls: list[torch.Tensor] = []

    def logits(self, input_ids, attention_mask=None, position_ids=None):
        self.calls.append(input_ids.clone())
        B, T = input_ids.shape
        V = len(self.tokenizer)
        out = torch.zeros(B, T, V)
        for i, (tok, c) in enumerate(zip(self.script, self.confidence)):
            out[:, self.prompt_len + i, tok] = c
        return out


class CopiedCache:
    """A policy whose cache `_ApproxCache` takes as one no model writes in place
    (``cache_in_place`` False): it copies the kept columns' keys out and joins the fed ones' to
    them, the layout the in-place cache is tested against."""

    cache_in_place = False

    def __init__(self, policy):
        self.policy = policy

    def __getattr__(self, name):
        return getattr(self.policy, name)


def cached_block_inputs(ids: torch.Tensor, mask: torch.Tensor, L: int, high: int, seed: int):
    """[prompt ; L random completion tokens in [4, high)] of left-padded prompts: the inputs,
    their key padding and positions, (B, P + L) each, as `_decode_full` gives `_ApproxCache`."""
    from stabledrl.data import position_ids

    B = ids.size(0)
    comp = torch.randint(4, high, (B, L), generator=torch.Generator().manual_seed(seed))
    attn = torch.cat([mask, torch.ones(B, L, dtype=mask.dtype)], dim=1)
    return torch.cat([ids, comp], dim=1), attn, position_ids(attn)


def metric_rows(run_dir) -> list[dict]:
    """A run's metrics.jsonl without the timings (which differ between identical runs)."""
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time_") or k in ("seconds", "framework_share"))}
            for r in rows]


@pytest.fixture
def prompt_widths(monkeypatch):
    """The prompt columns P of each `generate` call that `generate_micro_batched` makes."""
    import stabledrl.sampling as sampling

    widths, real = [], sampling.generate

    def recorded(policy, prompt_ids, *args, **kwargs):
        widths.append(prompt_ids.size(1))
        return real(policy, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(sampling, "generate", recorded)
    return widths


@pytest.fixture
def objective_registry():
    """The objective registries as they were, once the test is over: an objective it registers is gone."""
    from stabledrl.objectives import OBJECTIVES
    from stabledrl.settings import OBJECTIVE_SECTIONS

    saved = dict(OBJECTIVE_SECTIONS), dict(OBJECTIVES)
    yield
    for registry, before in zip((OBJECTIVE_SECTIONS, OBJECTIVES), saved):
        registry.clear()
        registry.update(before)


def bf16_twin(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s float32 weights rounded to bf16 numbers, in place (master weights FSDP's bf16 gathers
    exactly), and a bf16 copy of it in eval mode: what FSDP's mixed precision should compute."""
    import copy

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return copy.deepcopy(model).to(torch.bfloat16).eval()


class DispatchedOps(TorchDispatchMode):
    """The operations (`OpOverload`s) dispatched while it is on, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fsdp_bf16(tmp_path):
    """FSDP2 with accelerate's bf16 mixed precision (its `MixedPrecisionPolicy`: bf16 parameters,
    reductions and outputs, floating-point inputs cast) over each of a model's layers and the
    whole, in a gloo process group of this one process, ended after the test: `wrap(model, layers)`."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)

    def wrap(model, layers):
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)

    try:
        yield wrap
    finally:
        dist.destroy_process_group()
