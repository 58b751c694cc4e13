"""Fast decoding: counter noise, threshold parallel decoding, the approximate
caches of full-attention models, and the sampler's own log-probabilities."""

import math
import random

import pytest
import torch

from stabledrl.data import encode_prompts
from stabledrl.likelihood import Completions, estimate
from stabledrl.sampling import (
    RolloutRequest,
    SamplingConfig,
    _ApproxCache,
    _mix32,
    categorical,
    counter_uniform,
    generate,
    generate_micro_batched,
    row_generators,
    row_keys,
)
from tests.conftest import CopiedCache, ScriptedPolicy, cached_block_inputs, make_tiny_policy
from tests.test_likelihood_path import EosLeaning, sampler_path_logprob

PROMPTS = ["3,5,7=22", "12,13,5,6=99", "1=1", "20,2=10", "7,7=49"]
BLOCK = dict(attention_kind="block", block_size=3)


class Sharpened:
    """The policy with its logits scaled: an untrained tiny model made confident enough for
    a threshold to commit several slots in a step."""

    def __init__(self, policy, scale: float = 40.0):
        self.policy, self.scale = policy, scale

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def logits(self, input_ids, attention_mask=None, position_ids=None, **kw):
        return self.policy.logits(input_ids, attention_mask, position_ids, **kw) * self.scale


def _run(policy, prompts=PROMPTS, *, generator=None, record_logprob=False, **options):
    """`generate` on the prompts, sampled as `options` say (`SamplingConfig`)."""
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    return generate(policy, ids, mask, SamplingConfig(**options), generator=generator, record_logprob=record_logprob)


# ---------------------------------------------------------------- counter noise


def _mix32_python(x: int) -> int:
    """`_mix32` written out on Python integers (unbounded: no overflow to worry about)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
    return (x >> 16) ^ x


def test_mix32_is_the_integer_hash_written_out_including_the_extremes():
    rng = random.Random(0)
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    got = _mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [_mix32_python(x) for x in xs]
    assert all(0 <= g < 2**32 for g in got)


def test_counter_uniforms_are_uniform_and_a_pure_function_of_key_step_column_purpose():
    keys = row_keys([torch.Generator().manual_seed(s) for s in range(64)], 64, "cpu")  # (64, 2)
    cols = torch.arange(256)
    u = torch.cat([counter_uniform(keys, step, cols, 0) for step in range(8)]).flatten()  # 131,072 draws
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    # Chi-square over 64 equal bins: 63 degrees of freedom, mean 63, sd 11.2; the seeds are fixed,
    # so the verdict is deterministic, and 150 is 7.7 sd away (p < 1e-12 for a uniform stream).
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 150
    # Kolmogorov-Smirnov: sup |F_n - F| for n = 131,072 is about 0.0024 at p = 0.05; 0.01 is far out.
    srt = u.sort().values
    n = u.numel()
    assert float((srt - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()) < 0.01
    # Neighbouring columns, steps and purposes are uncorrelated (sd of a correlation on 16k pairs: 0.008).
    a = counter_uniform(keys, 3, cols, 0)
    for b in (counter_uniform(keys, 3, cols + 1, 0), counter_uniform(keys, 4, cols, 0), counter_uniform(keys, 3, cols, 1)):
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.05
    # A pure function: the same arguments give the same bits, one row alone as in the batch.
    assert torch.equal(counter_uniform(keys, 3, cols, 0), a)
    assert torch.equal(counter_uniform(keys[5:6], 3, cols[7:9], 0), a[5:6, 7:9])


def test_row_keys_come_from_the_rows_generators():
    gens = row_generators("k", 0, 3)
    keys = row_keys(gens, 3, "cpu")
    assert torch.equal(keys[1], row_keys(row_generators("k", 1, 2), 1, "cpu")[0])  # a row's key is its own
    assert not torch.equal(row_keys(gens, 3, "cpu"), keys)  # drawing advanced them: a reused generator moves on
    assert row_keys(None, 3, "cpu") is None


def test_categorical_equals_a_plain_float64_inverse_cdf():
    g = torch.Generator().manual_seed(0)
    V = 1300  # not a multiple of the chunk: the ragged last chunk is exercised
    logits = torch.randn(400, V, generator=g) * 3
    logits[:, ::7] = -math.inf  # zero-probability tokens
    probs = logits.softmax(-1)
    u = torch.rand(400, generator=g, dtype=torch.float64)
    got = categorical(probs, u, chunk=128)
    cdf = probs.double().cumsum(-1)  # the independent computation: one cumulative sum
    target = u * cdf[:, -1]
    want = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # Chunk sums are float32: a target within 1e-5 of a chunk's edge may fall on either side.
    edges = cdf[:, 127::128]  # (400, chunks) the cumulative mass at each chunk's end
    clear = ((edges - target[:, None]).abs() > 1e-5).all(-1)
    assert clear.sum() > 390 and torch.equal(got[clear], want[clear])
    assert not (got % 7 == 0).any()  # never a zero-probability token
    # The extremes of u stay in range and on tokens of positive mass.
    ends = categorical(probs[:2], torch.tensor([1e-12, 1 - 1e-12], dtype=torch.float64), chunk=128)
    assert ends[0] == 1 and ends[1] == V - 1 - ((V - 1) % 7 == 0)


def test_counter_noise_samples_the_same_distribution():
    # One slot (L = 1): its token is a draw from softmax(logits / T) of the first step. 3,000
    # rows of one prompt under each noise: both frequencies match the model's probabilities
    # (chi-square over the tokens of expected count >= 5; fixed seeds, deterministic verdict).
    policy = make_tiny_policy(seed=11)
    n, T = 3000, 1.5
    ids, mask = encode_prompts(policy.tokenizer, ["3,5,7=22"] * n)
    with torch.no_grad():
        x = torch.cat([ids[:1], torch.tensor([[policy.mask_token_id]])], dim=1)
        logits = policy.logits(x, torch.ones_like(x))[0, -1]
    banned = [policy.mask_token_id, policy.tokenizer.bos_token_id, policy.tokenizer.unk_token_id]  # EOS and PAD end it
    logits[banned] = -math.inf
    p = (logits.double() / T).softmax(-1)
    for noise in ("generator", "counter"):
        out = generate(policy, ids, mask, SamplingConfig(gen_length=1, temperature=T, noise=noise),
                       generator=row_generators(f"dist/{noise}", 0, n))
        counts = torch.bincount(out.completion_ids[:, 0], minlength=p.numel()).double()
        keep = p * n >= 5
        stat = float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
        dof = int(keep.sum()) - 1
        assert stat < dof + 8 * math.sqrt(2 * dof)  # 8 sd above the mean of a chi-square
        assert counts[~keep].sum() < 5 * max(1, int((~keep).sum()))


@pytest.mark.parametrize("kind,kw", [("full", {}), ("full", {"block_length": 3}), ("block", {})])
def test_counter_noise_a_row_samples_the_same_alone_in_a_batch_and_in_micro_batches(kind, kw):
    policy = make_tiny_policy(seed=21, **(BLOCK if kind == "block" else {}))
    common = dict(gen_length=9, temperature=1.0, noise="counter", **kw)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    batched = _run(policy, generator=row_generators("r", 0, 5), **common)
    for i, p in enumerate(PROMPTS):  # a batch of 1 (its own padding) against the batch of 5
        alone = _run(policy, prompts=[p], generator=row_generators("r", i, i + 1), **common)
        assert torch.equal(alone.completion_ids[0], batched.completion_ids[i])
        assert torch.equal(alone.unmask_step[0], batched.unmask_step[i])
    # Another batch composition: rows 1 and 3 beside other prompts and other rows' keys.
    gens = row_generators("r", 1, 2) + row_generators("other", 0, 1) + row_generators("r", 3, 4)
    mixed = _run(policy, prompts=[PROMPTS[1], "99,1=100", PROMPTS[3]], generator=gens, **common)
    assert torch.equal(mixed.completion_ids[[0, 2]], batched.completion_ids[[1, 3]])
    sampling = SamplingConfig(**common)
    request = RolloutRequest(policy, ids, mask, 9, row_generators("r", 0, 5), sampling, micro_batch=2)
    micro = generate_micro_batched(request)
    assert torch.equal(micro.completion_ids, batched.completion_ids)
    again = _run(policy, generator=row_generators("s", 0, 5), **common)
    assert not torch.equal(again.completion_ids, batched.completion_ids)  # the noise does matter


@pytest.mark.parametrize("kind,kw", [("full", {}), ("full", {"block_length": 4}), ("block", {})])
def test_counter_noise_leaves_greedy_decoding_unchanged(kind, kw):
    policy = make_tiny_policy(seed=8, **(BLOCK if kind == "block" else {}))
    want = _run(policy, gen_length=10, steps=6, record_logprob=True, **kw)
    got = _run(policy, gen_length=10, steps=6, noise="counter", record_logprob=True, **kw)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)
    assert torch.equal(got.token_logprob, want.token_logprob)
    # The counter path takes the entropy at the chosen slots only: the same values.
    assert torch.allclose(got.entropy, want.entropy, rtol=1e-4, atol=1e-6) and want.entropy.gt(0).all()


def test_counter_noise_random_remasking_reproducible_per_row():
    policy = make_tiny_policy(seed=3)
    common = dict(gen_length=8, temperature=0.0, remasking="random", noise="counter")
    batched = _run(policy, generator=row_generators("rr", 0, 5), **common)
    alone = _run(policy, prompts=PROMPTS[2:3], generator=row_generators("rr", 2, 3), **common)
    assert torch.equal(alone.unmask_step[0], batched.unmask_step[2])


# ---------------------------------------------------------------- threshold


def test_threshold_commits_every_slot_above_it_and_at_least_the_schedule():
    tok = 5
    # margin c over 19 other allowed tokens: p = e^c / (e^c + 19)
    conf = [9.0, 8.0, 3.0, 2.0, 1.0, 0.5]  # p = 0.998, 0.994, 0.514, 0.280, 0.125, 0.080
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    cases = [  # (threshold, steps) -> each slot's commit step, model calls
        ((None, 6), [0, 1, 2, 3, 4, 5], 6),
        ((1.0, 6), [0, 1, 2, 3, 4, 5], 6),
        ((0.9, 6), [0, 0, 1, 2, 3, 4], 5),  # slots 0 and 1 together, then one a step
        ((0.5, 6), [0, 0, 0, 1, 2, 3], 4),
        ((0.9, 2), [0, 0, 0, 1, 1, 1], 2),  # the schedule's ceil(6 / 2) = 3 exceeds the 2 above 0.9
        ((0.05, 6), [0, 0, 0, 0, 0, 0], 1),
    ]
    for (tau, steps), want, calls in cases:
        policy = ScriptedPolicy([tok] * 6, conf, prompt_len=ids.size(1))
        out = generate(policy, ids, mask, SamplingConfig(gen_length=6, steps=steps, threshold=tau))
        assert out.unmask_step[0].tolist() == want, tau
        assert out.forward_passes == calls == len(policy.calls)


@pytest.mark.parametrize("kind,kw", [
    ("full", dict(temperature=0.0)), ("full", dict(temperature=1.0, block_length=4)),
    ("full", dict(temperature=1.0, noise="counter")), ("block", dict(temperature=1.0)),
    ("block", dict(temperature=1.0, noise="counter")),
])
def test_threshold_one_gives_the_exact_samplers_tokens_bit_for_bit(kind, kw):
    policy = Sharpened(make_tiny_policy(seed=12, **(BLOCK if kind == "block" else {})))
    outs = [_run(policy, gen_length=10, steps=7, generator=row_generators("th", 0, 5), threshold=tau,
                 record_logprob=True, **kw) for tau in (None, 1.0)]
    for f in ("completion_ids", "unmask_step", "entropy", "token_logprob"):
        assert torch.equal(getattr(outs[0], f), getattr(outs[1], f)), f
    assert outs[0].forward_passes == outs[1].forward_passes
    low = _run(policy, gen_length=10, steps=10, generator=row_generators("th", 0, 5), threshold=0.7, **kw)
    full = _run(policy, gen_length=10, steps=10, generator=row_generators("th", 0, 5), **kw)
    assert low.forward_passes < full.forward_passes


def test_threshold_needs_low_confidence_and_a_value_in_range():
    policy = make_tiny_policy()
    with pytest.raises(ValueError, match="low_confidence"):
        _run(policy, gen_length=4, remasking="random", generator=torch.Generator(), threshold=0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        _run(policy, gen_length=4, threshold=1.5)
    with pytest.raises(ValueError, match="noise"):
        _run(policy, gen_length=4, noise="cuda")


# ---------------------------------------------------------------- the path estimator on parallel decoding


@pytest.mark.parametrize("kind,gen_kw", [
    ("full", dict(threshold=0.7)), ("full", dict(threshold=0.5, block_length=4, noise="counter")),
    ("full", dict(threshold=0.9, steps=4)), ("block", dict(threshold=0.7)), ("block", dict(threshold=0.5, noise="counter")),
])
def test_path_scores_a_parallel_decoded_trajectory_exactly(kind, gen_kw):
    # Three computations of Σ log p(y_i) at the step that committed y_i: the replay of the sampler's
    # own model calls (tests/test_likelihood_path.py), the sampler's record (token_logprob) and the
    # path estimator, which rebuilds each step's input from unmask_step alone.
    L = 7
    policy = EosLeaning(Sharpened(make_tiny_policy(seed=5, **(BLOCK if kind == "block" else {}))), bias=12.0)
    checked = parallel = 0
    for seed in range(24):
        out, ids, mask, want, approximated = sampler_path_logprob(policy, PROMPTS[seed % 4], L, seed,
                                                                  record_logprob=True, **gen_kw)
        if approximated:  # an EOS turned an earlier committed slot into PAD: path's known approximation
            continue
        recorded = float(out.token_logprob[0].sum())
        assert recorded == pytest.approx(want, rel=1e-6, abs=1e-6)
        with torch.no_grad():
            got = estimate(policy, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                               prompt_mask=mask, unmask_step=out.unmask_step), method="path")
        assert float(got.sequence[0]) == pytest.approx(recorded, rel=1e-5, abs=1e-5)
        checked += 1
        steps = out.unmask_step[0][out.completion_mask[0]]
        parallel += int(steps.unique().numel() < steps.numel())  # some slots were committed together
    assert checked >= 6 and parallel >= 3


@pytest.mark.parametrize("kind,kw", [("full", {}), ("full", {"noise": "counter", "block_length": 4}),
                                     ("block", {}), ("block", {"noise": "counter"})])
def test_token_logprob_is_recorded_only_when_asked_and_changes_no_token(kind, kw):
    # The record costs a logsumexp over the vocabulary per eligible slot and step; the trainer
    # does not read it, so it is off by default, and asking for it changes no draw.
    policy = make_tiny_policy(seed=14, **(BLOCK if kind == "block" else {}))
    common = dict(gen_length=8, temperature=1.0, **kw)
    plain = _run(policy, generator=row_generators("lp", 0, 5), **common)
    recorded = _run(policy, generator=row_generators("lp", 0, 5), record_logprob=True, **common)
    assert plain.token_logprob is None
    for f in ("completion_ids", "unmask_step", "entropy"):
        assert torch.equal(getattr(plain, f), getattr(recorded, f)), f
    lp = recorded.token_logprob  # (5, 8): log p of each scored token, 0 elsewhere
    assert (lp[recorded.completion_mask] < 0).all() and (lp[~recorded.completion_mask] == 0).all()


# ---------------------------------------------------------------- approximate caches


class _Recording:
    """The policy, with each call's arguments and logits kept."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def logits(self, input_ids, attention_mask=None, position_ids=None, **kw):
        out = self.policy.logits(input_ids, attention_mask, position_ids, **kw)
        self.calls.append((input_ids.clone(), attention_mask, position_ids, kw.get("extend_cache", False), out.clone()))
        return out


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_a_blocks_first_step_is_the_uncached_samplers(approx_cache):
    policy = _Recording(make_tiny_policy(seed=13))
    out = _run(policy, gen_length=12, steps=8, block_length=4, temperature=1.0, approx_cache=approx_cache,
               generator=row_generators("c", 0, 5))
    firsts = [c for c in policy.calls if c[3]]
    assert len(firsts) == 3  # one whole-sequence call per block, the others fed less
    assert all(c[0].size(1) < firsts[0][0].size(1) for c in policy.calls if not c[3])
    for x, attn, pos, _, logits in firsts:  # same input, no cache: the same logits, bit for bit
        assert torch.equal(policy.policy.logits(x, attn, pos), logits)
    assert out.forward_passes == len(policy.calls)


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_cached_logits_equal_uncached_while_the_sequence_is_unchanged(approx_cache):
    # The cache's mechanics (kept keys, positions, key padding of left-padded prompts, rows leaving
    # the cache): fed the same tokens it was built from, a cached call gives the uncached logits.
    policy = make_tiny_policy(seed=14)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)  # left-padded
    B, P = ids.shape
    L, lo, hi = 12, 4, 8
    x, attn, pos = cached_block_inputs(ids, mask, L, 24, seed=0)
    with torch.no_grad():
        want = policy.logits(x, attn, pos)[:, P + lo : P + hi]
        cache = _ApproxCache(policy, SamplingConfig(approx_cache=approx_cache), P, lo, hi, attn, pos)
        rows = torch.arange(B)
        assert torch.equal(cache.logits(x, rows), want)  # the first call is the uncached one
        got = cache.logits(x, rows)  # a cached call
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        some = torch.tensor([0, 2, 4])  # rows 1 and 3 finished the block: the cache keeps the others alone
        assert torch.allclose(cache.logits(x[some], some), want[some], atol=1e-4, rtol=1e-4)
        assert all(k.size(0) == 3 for k, _ in cache.kv.layers)
        x2 = x.clone()
        x2[:, P + lo] = policy.mask_token_id  # a change in the block: the cached prefix keys go stale
        stale = cache.logits(x2[some], some)
        assert not torch.allclose(stale, policy.logits(x2, attn, pos)[some, P + lo : P + hi], atol=1e-6)
        fewer = torch.tensor([2])
        assert torch.allclose(cache.logits(x[fewer], fewer), want[fewer], atol=1e-4, rtol=1e-4)
        with pytest.raises(RuntimeError, match="came back"):  # finished rows never return to a block
            cache.logits(x[some], some)


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_with_one_step_per_block_the_cached_sampler_is_the_exact_one(approx_cache):
    # Every step is then a block's first step, the whole-sequence call: the same tokens as without a cache.
    policy = make_tiny_policy(seed=15)
    common = dict(gen_length=12, steps=3, block_length=4, temperature=1.0, noise="counter")
    want = _run(policy, generator=row_generators("o", 0, 5), **common)
    got = _run(policy, generator=row_generators("o", 0, 5), approx_cache=approx_cache, **common)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_refreshing_the_cache_every_call_is_the_exact_sampler_and_every_second_call_half_the_time(approx_cache):
    policy = make_tiny_policy(seed=17)
    common = dict(gen_length=12, steps=12, block_length=4, temperature=1.0, noise="counter")
    want = _run(policy, generator=row_generators("f", 0, 5), **common)
    got = _run(policy, generator=row_generators("f", 0, 5), approx_cache=approx_cache, approx_refresh=1, **common)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)
    # every second call: 4 calls a block (12 steps over 3 blocks), whole-sequence at its 1st and 3rd
    rec = _Recording(make_tiny_policy(seed=17))
    out = _run(rec, generator=row_generators("f", 0, 5), approx_cache=approx_cache, approx_refresh=2, **common)
    assert out.forward_passes == 12 and [c[3] for c in rec.calls] == [True, False] * 6


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_cached_sampler_a_row_samples_the_same_alone_and_in_a_batch(approx_cache):
    policy = EosLeaning(make_tiny_policy(seed=16), bias=1.5)  # rows end early and leave the cache
    common = dict(gen_length=12, steps=12, block_length=4, temperature=1.0, noise="counter",
                  approx_cache=approx_cache)
    batched = _run(policy, generator=row_generators("a", 0, 5), **common)
    assert (batched.completion_mask.sum(1) < 12).any()
    for i, p in enumerate(PROMPTS):
        alone = _run(policy, prompts=[p], generator=row_generators("a", i, i + 1), **common)
        assert torch.equal(alone.completion_ids[0], batched.completion_ids[i])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_the_counter_draw_is_its_formula_from_any_layout_of_the_logits(temperature, remasking):
    # The draw tempers its own copy of the eligible slots' logits in place: the tokens and scores
    # of the formula written out, bit for bit, from contiguous logits and from a strided view of
    # the same values, and the logits left as they were.
    from stabledrl.sampling import _At, _Decoding, _draw_counter

    policy = make_tiny_policy(seed=21)
    sampling = SamplingConfig(gen_length=8, temperature=temperature, noise="counter", remasking=remasking)
    dec = _Decoding(policy, sampling, 3, torch.device("cpu"), row_generators("t", 0, 3), False, False)
    V = len(policy.tokenizer)
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(4)) * 4
    eligible = torch.rand(3, 5, generator=torch.Generator().manual_seed(5)) < 0.6
    at = _At(torch.arange(3), 2, torch.arange(5))
    a, w = eligible.nonzero(as_tuple=True)
    lg = logits[a, w]
    weights = (lg - lg.amax(-1, keepdim=True)).div_(temperature).exp_()
    x0 = categorical(weights, counter_uniform(dec.keys, 2, at.cols, 0)[a, w])
    if remasking == "low_confidence":
        p1 = (lg - lg.amax(-1, keepdim=True)).exp_()
        score = p1.gather(-1, x0[:, None]).squeeze(-1) / p1.sum(-1)
    else:
        score = counter_uniform(dec.keys, 2, at.cols, 1)[a, w].float()
    strided = torch.empty(3, 7, V).copy_(torch.cat([logits, logits[:, :2]], 1))[:, :5]
    assert not strided.is_contiguous()
    for given in (logits.clone(), strided):
        got_x0, got_score = _draw_counter(dec, given, eligible, at)
        assert torch.equal(got_x0[a, w], x0) and torch.equal(got_score[a, w], score)
        assert not got_x0[~eligible].any() and not got_score[~eligible].any()
        assert torch.equal(given, logits)


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_the_cache_written_in_place_gives_the_copied_caches_logits(approx_cache):
    # The same kept keys, laid out otherwise: left-padded prompts, a block (and, under prefix, a
    # suffix) changed since the first call (the kept keys stale), rows leaving the block (for good).
    policy = make_tiny_policy(seed=19)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    B, P = ids.shape
    L, lo, hi = 12, 4, 8
    x, attn, pos = cached_block_inputs(ids, mask, L, 24, seed=1)
    caches = [_ApproxCache(p, SamplingConfig(approx_cache=approx_cache), P, lo, hi, attn, pos) for p in (policy, CopiedCache(policy))]
    assert caches[0].in_place and not caches[1].in_place
    x2 = x.clone()
    x2[:, P + lo] = policy.mask_token_id
    x3 = x2.clone()
    x3[:, P + hi + 1] = policy.mask_token_id
    rows, some, fewer = torch.arange(B), torch.tensor([0, 2, 4]), torch.tensor([0, 4])
    with torch.no_grad():
        for inputs, active in ((x, rows), (x2, rows), (x3, rows), (x3[some], some), (x2[some], some),
                               (x2[fewer], fewer)):
            got, want = (c.logits(inputs, active) for c in caches)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
@pytest.mark.parametrize("refresh", [None, 2])
def test_the_cache_written_in_place_samples_the_copied_caches_tokens(approx_cache, refresh):
    # In float64 the two layouts' rounding differs by about 1e-16, far from moving a draw: the same
    # tokens, rows ending early (EOS) and leaving the cache, with and without refreshes. Sharpened:
    # near-uniform logits would hide a wrong key from the draws.
    tiny = make_tiny_policy(seed=18)
    tiny.model.double()
    policy = EosLeaning(Sharpened(tiny, 20.0), bias=1.5)
    common = dict(gen_length=12, steps=12, block_length=4, temperature=1.0, noise="counter",
                  approx_cache=approx_cache, approx_refresh=refresh)
    want = _run(CopiedCache(policy), generator=row_generators("w", 0, 5), **common)
    got = _run(policy, generator=row_generators("w", 0, 5), **common)
    assert (want.completion_mask.sum(1) < 12).any()
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)


def test_approx_cache_is_refused_where_there_is_no_cache_or_an_exact_one():
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    with pytest.raises(ValueError, match="new_cache"):
        generate(ScriptedPolicy([5] * 4, [1.0] * 4, ids.size(1)), ids, mask,
                 SamplingConfig(gen_length=4, approx_cache="prefix"))
    with pytest.raises(ValueError, match="full-attention"):
        _run(make_tiny_policy(**BLOCK), gen_length=6, approx_cache="dual")


def test_a_tiny_policy_under_lora_keeps_the_cache_written_in_place():
    # peft passes the cache through to the tiny model, which writes it in place: the copied layout's logits
    from stabledrl.models import add_lora
    from stabledrl.settings import LoraSettings

    policy = add_lora(make_tiny_policy(seed=21), LoraSettings(r=2, alpha=4.0, dropout=0.0), seed=0)
    with torch.no_grad():  # B away from zero: the adapters change the logits
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    assert policy.cache_in_place and not CopiedCache(policy).cache_in_place
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    B, P = ids.shape
    lo, hi = 4, 8
    x, attn, pos = cached_block_inputs(ids, mask, 12, 24, seed=2)
    caches = [_ApproxCache(p, SamplingConfig(approx_cache="dual"), P, lo, hi, attn, pos) for p in (policy, CopiedCache(policy))]
    assert caches[0].in_place and not caches[1].in_place
    x2 = x.clone()
    x2[:, P + lo] = policy.mask_token_id
    with torch.no_grad():
        for inputs in (x, x2):
            got, want = (c.logits(inputs, torch.arange(B)) for c in caches)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
