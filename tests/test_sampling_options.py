"""The sampler's step against the rule written out again, and bad sampling options as
one-line errors from `SamplingConfig`, the one place they are checked."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from stabledrl import sampling
from stabledrl.config import ConfigError
from stabledrl.data import encode_prompts
from stabledrl.sampling import SamplingConfig, generate, row_generators
from tests.conftest import make_tiny_policy

PROMPTS = ["3,5,7=22", "12,13,5,6=99", "1=1", "4,4=16"]


def _reference_pick(dec, logits, eligible, steps_left, at):
    """The sampler's step with generator noise, written out again: Gumbel-max over the
    tempered logits (float64 noise from the row's generator), then the ceil(masked / steps
    left) slots of highest score."""
    temperature, generator, rows = dec.sampling.temperature, dec.generator, at.rows
    logits[..., dec.banned] = -math.inf
    if temperature > 0:
        u = sampling._rand(logits.shape, generator, rows, logits.device, torch.float64, at.own)
        x0 = (logits.double() / temperature - torch.log(-torch.log(u.clamp_min(1e-300)))).argmax(-1)
    else:
        x0 = logits.argmax(-1)
    if dec.sampling.remasking == "low_confidence":
        score = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
    else:
        score = sampling._rand(x0.shape, generator, rows, logits.device, own=at.own)
    score = score.masked_fill(~eligible, -math.inf)
    k = (eligible.sum(-1) + steps_left - 1) // steps_left
    chosen = sampling._rows_topk(score, k) & eligible
    logq = logits.log_softmax(-1)
    return chosen, x0, -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1)


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_the_sampler_step_is_the_rule_written_out(monkeypatch, block, remasking):
    kw = dict(attention_kind="block", block_size=block) if block else {}
    policy = make_tiny_policy(seed=31, **kw)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    options = SamplingConfig(gen_length=9, temperature=1.0, remasking=remasking)
    new = generate(policy, ids, mask, options, generator=row_generators("x", 0, 4))
    monkeypatch.setattr(sampling, "_pick", _reference_pick)
    old = generate(policy, ids, mask, options, generator=row_generators("x", 0, 4))
    for f in ("completion_ids", "completion_mask", "unmask_step", "entropy"):
        assert torch.equal(getattr(new, f), getattr(old, f)), f
    assert len(set(map(tuple, new.completion_ids.tolist()))) == 4  # sampled rows, not one repeated answer


@pytest.mark.parametrize("kw, message", [
    (dict(steps=0), "sampling.steps must be a positive integer or null, got 0"),
    (dict(micro_batch=0), "sampling.micro_batch must be a positive integer or null, got 0"),
    (dict(temperature=-1.0), "sampling.temperature must be >= 0, got -1.0"),
    (dict(remasking="lowest"), "sampling.remasking must be one of low_confidence, random; got 'lowest'"),
    (dict(noise="cuda"), "sampling.noise must be one of auto, generator, counter; got 'cuda'"),
    (dict(approx_cache="full"), "sampling.approx_cache must be one of none, prefix, dual; got 'full'"),
    (dict(threshold=0.0), "sampling.threshold must be in (0, 1] or null, got 0.0"),
    (dict(threshold=0.9, remasking="random"), "set remasking: low_confidence or threshold: null"),
])
def test_bad_sampling_options_are_one_line_errors(kw, message):
    with pytest.raises(ConfigError) as e:
        SamplingConfig(**kw)
    assert str(e.value) == message or message in str(e.value)


@pytest.mark.parametrize("vocab, chosen", [(None, "generator"), (32_768, "counter")])
def test_auto_noise_is_counter_noise_from_a_vocabulary_of_32k_tokens(vocab, chosen):
    # The character model (a few dozen tokens) keeps the generator stream of every figure; the same
    # model with a 32,768-token output layer gets counter noise. The two streams write other tokens,
    # so each comparison can fail.
    policy = make_tiny_policy(seed=5, **({} if vocab is None else dict(vocab_size=vocab)))
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    out = {}
    for noise in ("auto", "generator", "counter"):
        options = SamplingConfig(gen_length=9, temperature=1.0, noise=noise)
        out[noise] = generate(policy, ids, mask, options, generator=row_generators("auto", 0, 4)).completion_ids
    other = {"generator": "counter", "counter": "generator"}[chosen]
    assert torch.equal(out["auto"], out[chosen])
    assert not torch.equal(out["auto"], out[other])
    assert SamplingConfig().noise == "auto"


def test_auto_noise_reads_the_vocabulary_through_a_ddp_wrapper():
    policy = make_tiny_policy(vocab_size=40_000)
    wrapped = copy.copy(policy)
    wrapped.model = torch.nn.Module()
    wrapped.model.module = policy.model  # what DDP and DeepSpeed's engine hold: no `config` of their own
    assert sampling.resolve_noise(wrapped, SamplingConfig()).noise == "counter"
    assert sampling.resolve_noise(make_tiny_policy(), SamplingConfig()).noise == "generator"
