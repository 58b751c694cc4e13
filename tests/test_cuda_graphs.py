"""`sampling.cuda_graphs`: a block's later cached calls replayed from a captured graph draw the
tokens of ordinary calls. On the CPU the capture is `tests/cpu_graphs.py`'s emulation of a CUDA
graph (the recorded operations replayed on the tensors they used; a host sync refused), which
fails where a replay would read stale tensors or a branch frozen at capture."""

from __future__ import annotations

import pytest
import torch

import stabledrl.sampling as sampling
from stabledrl.config import ConfigError
from stabledrl.cuda_graphs import CapturedCall
from stabledrl.data import encode_prompts
from stabledrl.models import ModelConfig, load_policy
from stabledrl.sampling import SamplingConfig, generate, row_generators
from tests.conftest import make_tiny_policy
from tests.cpu_graphs import RecordedCall
from tests.models.test_adapters import dirs  # noqa: F401 (the fixture)

PROMPTS = ["3,5,7=22", "12,4,6=9", "1=1", "8,8=16"]


@pytest.fixture
def recorded(monkeypatch):
    """The sampler's captures made by `RecordedCall`; its counters from zero."""
    monkeypatch.setattr(sampling, "CapturedCall", RecordedCall)
    monkeypatch.setattr(RecordedCall, "captures", 0)
    monkeypatch.setattr(RecordedCall, "replays_made", 0)
    return RecordedCall


def _tokens(policy, cfg: SamplingConfig, autocast: bool = False) -> torch.Tensor:
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return generate(policy, ids, mask, cfg, generator=row_generators("g", 0, len(PROMPTS))).completion_ids


def test_the_emulated_capture_fails_where_a_replay_would():
    # the tool first: a replay reruns the recorded operations only, so a Python value read at capture
    # stays frozen, and a host sync is refused, as a CUDA graph's capture refuses it
    static, scale = torch.ones(3), [2.0]
    call = RecordedCall(lambda: static * scale[0], static)
    scale[0] = 5.0
    assert torch.equal(call(torch.ones(3)), torch.full((3,), 2.0))  # an ordinary call would give 5
    assert torch.equal(call(torch.full((3,), 3.0)), torch.full((3,), 6.0))  # the static input is read
    with pytest.raises(RuntimeError, match="host sync"):
        RecordedCall(lambda: static * float(static.sum()), static)
    # the capture computes and writes nothing: its output is garbage until a replay, a cache written in
    # place holds the warm-up's write alone; each replay writes again
    cache = torch.zeros(3)
    call = RecordedCall(lambda: cache.add_(static).mul(2), static)
    assert torch.equal(call.first, torch.full((3,), 6.0)) and bool(call.out.isnan().all())
    assert torch.equal(cache, torch.full((3,), 3.0))
    assert torch.equal(call(torch.ones(3)), torch.full((3,), 8.0)) and torch.equal(cache, torch.full((3,), 4.0))
    # and holds no tensor of the caller's alive
    held = [torch.ones(3)]
    call = RecordedCall(lambda: static + held[0], static)
    held.clear()
    with pytest.raises(RuntimeError, match="freed since the capture"):
        call(torch.ones(3))


def test_a_capture_needs_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs needs the model on a CUDA device"):
        CapturedCall(lambda: torch.ones(1), torch.ones(1))


def test_cuda_graphs_need_an_approximate_cache():
    with pytest.raises(ConfigError, match="cuda_graphs"):
        SamplingConfig(cuda_graphs=True)


CASES = {"dual": dict(approx_cache="dual"), "prefix": dict(approx_cache="prefix"),
         # rows leave a block early (the cache is cut: captured again), and a refresh makes a new cache
         "dual+threshold": dict(approx_cache="dual", threshold=0.3),
         "dual+refresh3": dict(approx_cache="dual", approx_refresh=3)}


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_calls_draw_the_tokens_of_ordinary_ones_tiny(recorded, case):
    policy = make_tiny_policy(seed=7)
    cfg = SamplingConfig(gen_length=16, steps=16, block_length=8, temperature=1.0, **CASES[case])
    eager = _tokens(policy, cfg)
    graphed = _tokens(policy, SamplingConfig(**{**cfg.__dict__, "cuda_graphs": True}))
    assert torch.equal(graphed, eager)
    assert recorded.captures >= 2 and recorded.replays_made >= 4  # two blocks, each captured and replayed


@pytest.mark.parametrize("refresh, captures, replays", [(2, 0, 0), (3, 2, 2), (4, 2, 4)])
def test_no_capture_goes_unreplayed_before_a_refresh(recorded, refresh, captures, replays):
    # 2 blocks of 4 calls; a whole-sequence call (new keys) every `refresh` calls. A block's calls:
    # refresh 2: whole, later, whole, later: no capture (each would be dropped by the next refresh);
    # 3: whole, captured, replayed, whole; 4: whole, captured, replayed, replayed
    policy = make_tiny_policy(seed=7)
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, temperature=1.0, approx_cache="dual",
                         approx_refresh=refresh)
    eager = _tokens(policy, cfg)
    assert torch.equal(_tokens(policy, SamplingConfig(**{**cfg.__dict__, "cuda_graphs": True})), eager)
    assert (recorded.captures, recorded.replays_made) == (captures, replays)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_replayed_calls_draw_the_tokens_of_ordinary_ones_native(dirs, recorded, family):  # noqa: F811
    # the native models' later calls, left-padded rows (the key padding read once, not in the capture),
    # counter noise, bf16 autocast
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, temperature=0.9, noise="counter", approx_cache="dual")
    eager = _tokens(policy, cfg, autocast=True)
    graphed = _tokens(policy, SamplingConfig(**{**cfg.__dict__, "cuda_graphs": True}), autocast=True)
    assert torch.equal(graphed, eager)
    assert recorded.captures >= 2 and recorded.replays_made >= 1  # two blocks of 4 steps: a first call, a captured one


def test_replayed_calls_through_the_short_lora_forward(recorded):
    # LoRA's short forward casts its adapters in a block's first call, before any capture: the replays use them
    from tests.models.test_lora import tiny_with_trained_adapters

    policy = tiny_with_trained_adapters()
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, temperature=1.0, approx_cache="dual")
    eager = _tokens(policy, cfg, autocast=True)
    graphed = _tokens(policy, SamplingConfig(**{**cfg.__dict__, "cuda_graphs": True}), autocast=True)
    assert torch.equal(graphed, eager) and recorded.replays_made > 0


def test_cuda_graphs_refuse_inference_mode(recorded):
    # inference tensors have no version counter, so the native models read a key-padding mask off the
    # device in every call (`native._no_padding`), which a capture refuses
    policy = make_tiny_policy(seed=7)
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, approx_cache="dual", cuda_graphs=True)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        generate(policy, ids, mask, cfg, generator=row_generators("g", 0, len(PROMPTS)))
    assert RecordedCall.captures == 0


def test_cuda_graphs_refuse_a_sharded_model(recorded):
    policy = make_tiny_policy(seed=7)
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, approx_cache="dual", cuda_graphs=True)
    fsdp = type("FSDPModule", (), {})
    policy.model.__class__ = type("Sharded", (type(policy.model), fsdp), {})
    with pytest.raises(ValueError, match="cuda_graphs"):
        _tokens(policy, cfg)
