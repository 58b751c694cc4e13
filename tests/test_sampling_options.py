"""The sampler's departures from the exact rule: top-k, top-p and EOS damping. Off, they
change no token; on, each does what its docstring says."""

from __future__ import annotations

import math

import pytest
import torch

from stabledrl import sampling
from stabledrl.config import ConfigError
from stabledrl.data import encode_prompts
from stabledrl.sampling import SamplingConfig, generate, restrict_logits, row_generators
from tests.conftest import ScriptedPolicy, make_tiny_policy

PROMPTS = ["3,5,7=22", "12,13,5,6=99", "1=1", "4,4=16"]


def _reference_pick(logits, eligible, steps_left, temperature, remasking, generator, banned, rows, **options):
    """The sampler's step as it was before top-k, top-p and EOS damping, written out again:
    Gumbel-max over the tempered logits (float64 noise from the row's generator), then the
    ceil(masked / steps left) slots of highest score."""
    assert options["top_k"] is None and options["top_p"] is None and options["eos_confidence_scale"] == 1
    logits[..., banned] = -math.inf
    if temperature > 0:
        u = sampling._rand(logits.shape, generator, rows, logits.device, torch.float64)
        x0 = (logits.double() / temperature - torch.log(-torch.log(u.clamp_min(1e-300)))).argmax(-1)
    else:
        x0 = logits.argmax(-1)
    if remasking == "low_confidence":
        score = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
    else:
        score = sampling._rand(x0.shape, generator, rows, logits.device)
    score = score.masked_fill(~eligible, -math.inf)
    k = (eligible.sum(-1) + steps_left - 1) // steps_left
    chosen = sampling._rows_topk(score, k) & eligible
    logq = logits.log_softmax(-1)
    return chosen, x0, -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1)


def _sample(policy, generator=None, prompts=PROMPTS, **kw):
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    return generate(policy, ids, mask, generator=generator, **kw)


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_with_the_options_unset_the_tokens_are_those_of_the_sampler_without_them(monkeypatch, block, remasking):
    kw = dict(attention_kind="block", block_size=block) if block else {}
    policy = make_tiny_policy(seed=31, **kw)
    options = SamplingConfig(temperature=1.0, remasking=remasking).generate_kwargs()  # defaults, as configs pass them
    new = _sample(policy, row_generators("x", 0, 4), gen_length=9, **options)
    monkeypatch.setattr(sampling, "_pick", _reference_pick)
    old = _sample(policy, row_generators("x", 0, 4), gen_length=9, **options)
    for f in ("completion_ids", "completion_mask", "unmask_step", "entropy"):
        assert torch.equal(getattr(new, f), getattr(old, f)), f
    assert len(set(map(tuple, new.completion_ids.tolist()))) == 4  # sampled rows, not one repeated answer


@pytest.mark.parametrize("block", [None, 3])
def test_top_k_1_at_temperature_1_is_greedy(block):
    kw = dict(attention_kind="block", block_size=block) if block else {}
    policy = make_tiny_policy(seed=32, **kw)
    greedy = _sample(policy, gen_length=9)
    top1 = _sample(policy, row_generators("k", 0, 4), gen_length=9, temperature=1.0, top_k=1)
    tiny_nucleus = _sample(policy, row_generators("p", 0, 4), gen_length=9, temperature=1.0, top_p=1e-9)
    for out in (top1, tiny_nucleus):  # a nucleus of mass 1e-9 is the most likely token alone
        assert torch.equal(out.completion_ids, greedy.completion_ids)
        assert torch.equal(out.unmask_step, greedy.unmask_step)
    sampled = _sample(policy, row_generators("k", 0, 4), gen_length=9, temperature=1.0)
    assert not torch.equal(sampled.completion_ids, greedy.completion_ids)  # the noise would change them


def _nucleus(row: list[float], p: float) -> tuple[set[int], float]:
    """The smallest set of most likely entries of softmax(`row`) whose mass reaches p, by
    hand (math.exp, a running sum), and how far the running sums stay from p (margin)."""
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    weights = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(weights)
    kept, mass, margin = set(), 0.0, math.inf
    for i in sorted(range(len(row)), key=lambda j: -weights[j]):
        kept.add(i)
        mass += weights[i] / total
        margin = min(margin, abs(mass - p))
        if mass >= p:
            return kept, margin
    return kept, margin


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("top_k", [None, 5])
def test_top_p_keeps_exactly_the_smallest_set_whose_mass_reaches_p(p, top_k):
    gen = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(6, 4, 24, generator=gen, dtype=torch.float64)  # (A, W, V)
    logits[..., :3] = -math.inf  # banned tokens
    kept = restrict_logits(logits, top_k=top_k, top_p=p).isfinite()  # (A, W, V)
    for row, mask in zip(logits.view(-1, 24).tolist(), kept.view(-1, 24)):
        if top_k is not None:  # top-k first: the nucleus is taken of the k largest, renormalised
            kth = sorted(row, reverse=True)[top_k - 1]
            row = [x if x >= kth else -math.inf for x in row]
        expected, margin = _nucleus(row, p)
        assert margin > 1e-9  # no running sum within rounding of p: the set is well defined here
        assert set(mask.nonzero().flatten().tolist()) == expected
    assert kept.sum(-1).max() < 21 and (p < 0.3 or kept.sum(-1).max() > 1)  # neither all tokens nor always one


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 2.5, -math.inf]])
    assert restrict_logits(logits, top_k=3).isfinite().tolist() == [[False, True, False, True, True, False]]
    assert torch.equal(restrict_logits(logits, top_k=6), logits) and torch.equal(restrict_logits(logits), logits)


def test_top_p_is_taken_of_the_tempered_distribution():
    # Slot i prefers token 5 with a logit margin of 3 over the 19 other allowed tokens:
    # p = e^3 / (e^3 + 19) = 0.514 at temperature 1, so the nucleus of 0.5 is that token alone;
    # at temperature 4 its share is e^0.75 / (e^0.75 + 19) = 0.100 and the nucleus holds others.
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    policy = ScriptedPolicy([5] * 8, [3.0] * 8, prompt_len=ids.size(1))
    cold = generate(policy, ids.repeat(4, 1), mask.repeat(4, 1), gen_length=8, temperature=1.0, top_p=0.5,
                    generator=row_generators("c", 0, 4))
    assert (cold.completion_ids == 5).all()
    hot = generate(policy, ids.repeat(4, 1), mask.repeat(4, 1), gen_length=8, temperature=4.0, top_p=0.5,
                   generator=row_generators("c", 0, 4))
    assert (hot.completion_ids != 5).any()


def test_eos_damping_commits_a_confident_eos_after_the_other_slots():
    tok_a, eos = 5, 3
    # slot: 0     1     2    3      4      5
    script = [tok_a, tok_a, eos, tok_a, tok_a, tok_a]
    conf = [1.0, 2.0, 9.0, 8.0, 3.0, 0.5]
    # p(preferred) = e^c / (e^c + 19) (19 other allowed tokens): 0.125, 0.280, 0.998, 0.994, 0.514, 0.080.
    # Undamped, EOS (0.998) goes first and pads slots 3-5 (tests/test_sampling.py). Scaled by 0.05
    # it scores 0.0499, below every other slot: the order is 3, 4, 1, 0, 5, then EOS at step 5,
    # which still ends the completion (slots 3-5 become PAD but keep the step they were written at).
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    policy = ScriptedPolicy(script, conf, prompt_len=ids.size(1))
    out = generate(policy, ids, mask, gen_length=6, eos_confidence_scale=0.05)
    assert out.unmask_step[0].tolist() == [3, 2, 5, 0, 1, 4]
    assert out.completion_ids[0].tolist() == [tok_a, tok_a, eos, 0, 0, 0]
    assert out.forward_passes == 6
    # Scaled by 0.1 it scores 0.0998, above slot 5 (0.080): EOS at step 4, and slot 5 is never written.
    out = generate(policy, ids, mask, gen_length=6, eos_confidence_scale=0.1)
    assert out.unmask_step[0].tolist() == [3, 2, 4, 0, 1, 4] and out.forward_passes == 5


class _EarlyEos(ScriptedPolicy):
    """Three completion slots. Slot 0 predicts EOS (margin 9) while slot 1 is masked and token
    a (margin 9) once slot 1 is written; slot 1 predicts b (margin 5), slot 2 b (margin 1):
    a model that ends its answer early unless it sees the answer first."""

    A, B = 5, 6

    def logits(self, input_ids, attention_mask=None, position_ids=None):
        out = super().logits(input_ids)  # (1, P+3, V) zeros but slots 1 and 2
        P = self.prompt_len
        first = self.eos_token_id if input_ids[0, P + 1] == self.mask_token_id else self.A
        out[:, P, first] = 9.0
        return out


def test_eos_damping_lets_the_answer_be_written_before_an_early_eos():
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    policy = _EarlyEos([0, _EarlyEos.B, _EarlyEos.B], [0.0, 5.0, 1.0], prompt_len=ids.size(1))
    # Undamped, step 0 commits slot 0's EOS (p = 0.998 against 0.887 and 0.125): the answer is empty.
    plain = generate(policy, ids, mask, gen_length=3)
    assert plain.completion_ids[0].tolist() == [policy.eos_token_id, 0, 0]
    # Damped by 0.05 the EOS scores 0.0499: step 0 writes slot 1, after which slot 0 predicts a.
    damped = generate(policy, ids, mask, gen_length=3, eos_confidence_scale=0.05)
    assert damped.completion_ids[0].tolist() == [_EarlyEos.A, _EarlyEos.B, _EarlyEos.B]
    assert damped.unmask_step[0].tolist() == [1, 0, 2]


@pytest.mark.parametrize("kw, message", [
    (dict(top_k=0, temperature=1.0), "sampling.top_k must be a positive integer or null, got 0"),
    (dict(top_p=0.0, temperature=1.0), "sampling.top_p must be in (0, 1] or null, got 0.0"),
    (dict(top_p=1.5, temperature=1.0), "sampling.top_p must be in (0, 1] or null, got 1.5"),
    (dict(top_k=5), "set sampling.temperature > 0 or leave them null"),
    (dict(top_p=0.9), "set sampling.temperature > 0 or leave them null"),
    (dict(eos_confidence_scale=0.0), "sampling.eos_confidence_scale must be in (0, 1], got 0.0"),
    (dict(eos_confidence_scale=2.0), "sampling.eos_confidence_scale must be in (0, 1], got 2.0"),
])
def test_bad_sampling_options_are_one_line_errors_in_the_config_and_in_generate(kw, message):
    with pytest.raises(ConfigError) as e:
        SamplingConfig(**kw)
    assert str(e.value) == message or message in str(e.value)
    with pytest.raises(ValueError):
        _sample(make_tiny_policy(), row_generators("v", 0, 4), gen_length=4, **kw)
