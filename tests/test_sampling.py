import math

import pytest
import torch

from stabledrl.data import decode_completions, encode_prompts
from stabledrl.sampling import (
    RolloutRequest,
    SamplingConfig,
    generate,
    generate_micro_batched,
    micro_batch_calls,
    row_generators,
)
from tests.conftest import ScriptedPolicy, make_tiny_policy

PROMPTS = ["3,5,7=22", "12,13,5,6=99", "1=1"]


def _run(policy, prompts=PROMPTS, *, generator=None, synced=False, **options):
    """The prompts, and `generate` on them sampled as `options` say (`SamplingConfig`)."""
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    return ids, generate(policy, ids, mask, SamplingConfig(**options), generator=generator, synced=synced)


def _micro(policy, ids, mask, generator, *, micro_batch=None, record_logprob=False, **options):
    """`generate_micro_batched` on these rows in micro-batches of `micro_batch`, sampled as `options` say."""
    sampling = SamplingConfig(**options)
    request = RolloutRequest(policy, ids, mask, sampling.gen_length, generator, sampling, micro_batch=micro_batch)
    return generate_micro_batched(request, record_logprob=record_logprob)


@pytest.mark.parametrize("kw", [
    dict(gen_length=11),
    dict(gen_length=11, steps=4, temperature=0.8, generator=torch.Generator().manual_seed(1)),
    dict(gen_length=10, steps=6, block_length=4, remasking="random", generator=torch.Generator().manual_seed(2)),
])
def test_fills_every_mask_keeps_prompt_and_pads_after_eos(kw):
    policy = make_tiny_policy(seed=5)
    ids, out = _run(policy, **kw)
    L = kw["gen_length"]
    comp = out.completion_ids
    assert comp.shape == (len(PROMPTS), L)
    assert not (comp == policy.mask_token_id).any()
    assert torch.equal(out.sequences[:, : ids.size(1)], ids)  # the prompt is never altered
    assert torch.equal(out.sequences[:, ids.size(1):], comp)
    for row, m in zip(comp, out.completion_mask):
        eos = ((row == policy.eos_token_id) | (row == policy.pad_token_id)).nonzero()  # both end a completion
        if len(eos):
            first = int(eos[0])
            assert (row[first + 1:] == policy.pad_token_id).all()
            assert m[: first + 1].all() and not m[first + 1:].any()
        else:
            assert m.all()
        banned = {policy.mask_token_id, policy.tokenizer.bos_token_id, policy.tokenizer.unk_token_id}
        assert not set(row[m].tolist()) & banned
    assert (out.unmask_step >= 0).all() and (out.unmask_step < (kw.get("steps") or L)).all()


@pytest.mark.parametrize("kind", ["full", "block"])
def test_sampling_builds_no_graph(kind):
    # Rollouts are data: with grad enabled around it (as in the trainer), no output of the
    # sampler may carry a graph, which would keep every pass's activations alive for the step.
    policy = make_tiny_policy(seed=5, **({"attention_kind": "block", "block_size": 4} if kind == "block" else {}))
    assert torch.is_grad_enabled()
    _, out = _run(policy, gen_length=8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    tensors = [v for v in vars(out).values() if isinstance(v, torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)


def test_deterministic_for_a_fixed_generator_and_different_for_another():
    policy = make_tiny_policy(seed=6)
    kw = dict(gen_length=11, temperature=1.0)
    a = _run(policy, generator=torch.Generator().manual_seed(7), **kw)[1].completion_ids
    b = _run(policy, generator=torch.Generator().manual_seed(7), **kw)[1].completion_ids
    c = _run(policy, generator=torch.Generator().manual_seed(8), **kw)[1].completion_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_unequal_prompt_lengths_give_the_same_completion_as_alone():
    # Greedy decoding: each prompt in a left-padded batch decodes exactly as on its own.
    policy = make_tiny_policy(seed=7)
    _, batched = _run(policy, gen_length=9)
    for i, p in enumerate(PROMPTS):
        _, alone = _run(policy, prompts=[p], gen_length=9)
        assert torch.equal(batched.completion_ids[i], alone.completion_ids[0])


def test_low_confidence_commits_the_most_confident_slot_first_and_eos_pads_the_rest():
    tok_a = 5  # '0'
    eos = 3
    # slot: 0     1     2     3     4     5
    script = [tok_a, tok_a, eos, tok_a, tok_a, tok_a]
    conf = [1.0, 2.0, 9.0, 8.0, 3.0, 0.5]  # EOS at slot 2 is the most confident
    ids, mask = encode_prompts(ScriptedPolicy([], [], 0).tokenizer, ["12"])
    policy = ScriptedPolicy(script, conf, prompt_len=ids.size(1))
    out = generate(policy, ids, mask, SamplingConfig(gen_length=6))
    # step 0 commits EOS at slot 2, which turns slots 3-5 into PAD at once; the two
    # remaining slots take one step each in order of confidence (slot 1, then slot 0).
    assert out.completion_ids[0].tolist() == [tok_a, tok_a, eos, 0, 0, 0]
    assert out.unmask_step[0].tolist()[:3] == [2, 1, 0]
    assert out.unmask_step[0].tolist()[3:] == [0, 0, 0]
    assert out.completion_mask[0].tolist() == [True, True, True, False, False, False]
    # Slots were filled early, so the remaining steps did not call the model.
    assert out.forward_passes == 3 == len(policy.calls)
    # Entropy: a slot with margin c over 20 other allowed tokens (24 − MASK, BOS, UNK; PAD
    # ends a completion, so it is allowed) has H(c) = −p log p − 20 q log q, p = e^c/(e^c+20),
    # q = 1/(e^c+20); the three committed slots had c = 9, 2, 1 (the PAD fills are not commitments).
    def H(c):
        z = math.exp(c) + 20
        return -(math.exp(c) / z) * math.log(math.exp(c) / z) - 20 * (1 / z) * math.log(1 / z)

    assert out.entropy[0].item() == pytest.approx((H(9) + H(2) + H(1)) / 3, rel=1e-5)
    # The model was shown the PAD after EOS from the second call on.
    assert (policy.calls[1][0, ids.size(1) + 3:] == 0).all()


def test_semi_autoregressive_blocks_decode_left_to_right():
    policy = make_tiny_policy(seed=8)
    _, out = _run(policy, gen_length=12, steps=6, block_length=4)
    steps = out.unmask_step
    decoded = out.completion_ids != policy.pad_token_id  # PAD fill after EOS may happen any time
    for b in range(1, 3):
        prev = steps[:, (b - 1) * 4: b * 4].masked_fill(~decoded[:, (b - 1) * 4: b * 4], -1)
        cur = steps[:, b * 4: (b + 1) * 4].masked_fill(~decoded[:, b * 4: (b + 1) * 4], 10**6)
        assert (prev.max(1).values < cur.min(1).values).all()


def test_random_sampling_without_generator_is_an_error():
    policy = make_tiny_policy()
    with pytest.raises(ValueError, match="generator"):
        _run(policy, gen_length=5, temperature=0.5)
    with pytest.raises(ValueError, match="steps"):
        _run(policy, gen_length=8, steps=1, block_length=2)


def test_decode_stops_at_first_eos():
    policy = make_tiny_policy()
    tok = policy.tokenizer
    row = tok.encode("1+2", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
    assert decode_completions(tok, torch.tensor([row])) == ["1+2"]


# --- block models ---------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    dict(gen_length=11),  # S = 4 does not divide 11: blocks 4, 4, 3
    dict(gen_length=8, steps=4),  # two slots per step
    dict(gen_length=11, steps=6, temperature=1.0, generator=torch.Generator().manual_seed(3)),
    dict(gen_length=9, remasking="random", generator=torch.Generator().manual_seed(4)),
])
def test_block_sampler_cached_equals_uncached(kw):
    policy = make_tiny_policy(seed=11, attention_kind="block", block_size=4)
    seed = kw["generator"].initial_seed() if "generator" in kw else None
    outs = []
    for cache in (True, False):
        if seed is not None:
            kw["generator"] = torch.Generator().manual_seed(seed)
        outs.append(_run(policy, kv_cache=cache, **kw)[1])
    cached, uncached = outs
    assert torch.equal(cached.completion_ids, uncached.completion_ids)
    assert torch.equal(cached.unmask_step, uncached.unmask_step)
    assert not (cached.completion_ids == policy.mask_token_id).any()


def test_block_sampler_decodes_blocks_in_order_and_counts_its_passes():
    policy = make_tiny_policy(seed=12, attention_kind="block", block_size=3)
    ids, out = _run(policy, gen_length=9, steps=9)
    assert torch.equal(out.sequences[:, : ids.size(1)], ids)
    done = out.unmask_step
    for b in range(2):  # every slot of block b is committed before any of block b+1 is decoded
        written = done[:, 3 * (b + 1):] >= 0
        assert (done[:, 3 * b: 3 * (b + 1)].amax(1)[:, None] <= torch.where(written, done[:, 3 * (b + 1):], 99)).all()
    _, uncached = _run(policy, gen_length=9, steps=9, kv_cache=False)
    # cached: the prompt once, 9 steps, then each of the first two blocks frozen once;
    # uncached: the 9 steps only (no row of this batch ends before its last block).
    assert (done >= 0).all()
    assert uncached.forward_passes == 9 and out.forward_passes == 1 + 9 + 2


def test_block_sampler_rejects_another_block_length():
    policy = make_tiny_policy(seed=13, attention_kind="block", block_size=4)
    with pytest.raises(ValueError, match="block_length"):
        _run(policy, gen_length=8, block_length=2)


def test_block_sampler_prompt_alone_equals_batched():
    # Left padding must not change a block model's completion either (cache masks padding keys).
    policy = make_tiny_policy(seed=14, attention_kind="block", block_size=2)
    _, batched = _run(policy, gen_length=7)
    for i, p in enumerate(PROMPTS):
        _, alone = _run(policy, prompts=[p], gen_length=7)
        assert torch.equal(alone.completion_ids[0], batched.completion_ids[i])


def _row_gens(seed, rows):
    return [torch.Generator().manual_seed(seed * 100 + r) for r in rows]


@pytest.mark.parametrize("block", [None, 3])
def test_with_one_generator_per_row_a_row_samples_the_same_in_any_batch(block):
    # Temperature 1 and random remasking: all the noise comes from the row's own generator,
    # so row i alone (with generator i) writes what it writes in the batch, whichever rows
    # finish early around it (the full sampler only runs the rows with work left).
    kw = dict(attention_kind="block", block_size=block) if block else {}
    policy = make_tiny_policy(seed=21, **kw)
    common = dict(gen_length=9, temperature=1.0, remasking="random")
    _, batched = _run(policy, generator=_row_gens(7, range(3)), **common)
    for i, p in enumerate(PROMPTS):
        _, alone = _run(policy, prompts=[p], generator=_row_gens(7, [i]), **common)
        assert torch.equal(alone.completion_ids[0], batched.completion_ids[i])
    _, other = _run(policy, generator=_row_gens(8, range(3)), **common)
    assert not torch.equal(other.completion_ids, batched.completion_ids)  # the noise does matter
    with pytest.raises(ValueError, match="one generator per row"):
        _run(policy, generator=_row_gens(7, range(2)), **common)


class _EosEager:
    """A tiny policy whose EOS logit is raised by `boost` (3), so completions end early."""

    def __init__(self, policy, boost: float = 3.0):
        self._policy, self._boost = policy, boost

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def logits(self, *args, **kwargs):
        out = self._policy.logits(*args, **kwargs).clone()
        out[..., self._policy.eos_token_id] += self._boost
        return out


@pytest.mark.parametrize("kw", [dict(), dict(attention_kind="block", block_size=3)])
def test_synced_sampling_makes_every_call_of_the_schedule_and_the_same_tokens(kw):
    # Once a row writes EOS every later slot is PAD, so unsynced decoding stops early;
    # synced decoding makes all 9 step calls (+ the cache's prompt call and 2 block
    # freezes for block models) and writes the same tokens.
    policy = _EosEager(make_tiny_policy(seed=22, **kw))
    _, free = _run(policy, gen_length=9)
    _, synced = _run(policy, gen_length=9, synced=True)
    assert torch.equal(free.completion_ids, synced.completion_ids)
    expected = 9 + (3 if kw else 0)
    assert free.forward_passes < expected  # this batch does end early: the synced path is exercised
    assert synced.forward_passes == expected


PROMPTS_7 = PROMPTS + ["4,4=16", "9,2,3=7", "100,1=99", "2,2,2,2=8"]


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_micro_batches_write_the_same_tokens_as_one_call(block, temperature):
    # 7 rows in micro-batches of 1, 2 and 3 (the last one short): row i draws from its own
    # generator, so every row writes what it writes in one call of all 7, token for token.
    kw = dict(attention_kind="block", block_size=block) if block else {}
    policy = make_tiny_policy(seed=23, **kw)
    if temperature > 0:  # EOS raised by 2: the sampled rows end at different steps
        policy = _EosEager(policy, boost=2.0)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS_7)
    common = dict(gen_length=9, temperature=temperature)
    whole = _micro(policy, ids, mask, micro_batch=None, generator=row_generators("t", 0, 7), **common)
    if temperature > 0:
        assert len(set(whole.completion_mask.sum(1).tolist())) > 1
    for mb in (1, 2, 3):
        part = _micro(policy, ids, mask, micro_batch=mb, generator=row_generators("t", 0, 7), **common)
        for f in ("sequences", "completion_ids", "completion_mask", "unmask_step"):
            assert torch.equal(getattr(part, f), getattr(whole, f)), (mb, f)
        torch.testing.assert_close(part.entropy, whole.entropy, rtol=0, atol=1e-5)
        assert part.forward_passes > whole.forward_passes  # it did make several calls
    if temperature > 0:
        other = _micro(policy, ids, mask, micro_batch=2, generator=row_generators("u", 0, 7), **common)
        assert not torch.equal(other.completion_ids, whole.completion_ids)  # the noise does matter
        with pytest.raises(ValueError, match="one generator per row"):
            _micro(policy, ids, mask, micro_batch=2, generator=torch.Generator().manual_seed(0),
                                   **common)


def _digits(n: int, seed: int) -> str:
    """A prompt of n characters the char tokenizer knows."""
    rng = torch.Generator().manual_seed(seed)
    return "".join("0123456789,+="[int(i)] for i in torch.randint(0, 13, (n,), generator=rng))


# prompt lengths 2 .. 60 characters, in no order: sorted, micro-batches of 3 hold 2-9, 14-30, 41-60
UNEVEN = [_digits(n, i) for i, n in enumerate((41, 3, 60, 9, 14, 2, 30, 52, 21))]


@pytest.mark.parametrize("kind,kw", [("full", {}), ("full", {"block_length": 4}), ("full", {"noise": "counter"}),
                                     ("block", {}), ("block", {"kv_cache": False})])
def test_sorted_micro_batches_drop_padding_and_write_the_tokens_of_one_call(kind, kw, prompt_widths):
    # Sorted by prompt length, each micro-batch of 3 runs without the padding columns all
    # its rows have (short prompts on short sequences); each row keeps its own generator, so
    # it writes what it writes in one call of all 9 rows over the whole P columns. Only the
    # number of hidden padding keys differs, so the model runs in float64: a rounding
    # difference of 1e-16 cannot flip a token.
    block = dict(attention_kind="block", block_size=3) if kind == "block" else {}
    policy = _EosEager(make_tiny_policy(seed=31, max_position_embeddings=128, **block), boost=1.0)
    policy.model.double()
    ids, mask = encode_prompts(policy.tokenizer, UNEVEN)  # (9, 61): BOS and up to 60 characters
    common = dict(gen_length=9, temperature=1.0, record_logprob=True, **kw)
    whole = _micro(policy, ids, mask, micro_batch=None, generator=row_generators("s", 0, 9), **common)
    part = _micro(policy, ids, mask, micro_batch=3, generator=row_generators("s", 0, 9),
                                  sort_by_length=True, **common)
    assert prompt_widths == [61, 1 + 9, 1 + 30, 1 + 60]  # one call over all columns; then each micro-batch's
    for f in ("sequences", "completion_ids", "completion_mask", "unmask_step"):
        assert torch.equal(getattr(part, f), getattr(whole, f)), f
    assert len(set(whole.completion_mask.sum(1).tolist())) > 1  # rows end at different slots
    torch.testing.assert_close(part.entropy, whole.entropy, rtol=0, atol=1e-6)
    torch.testing.assert_close(part.token_logprob, whole.token_logprob, rtol=0, atol=1e-6)
    assert part.forward_passes > whole.forward_passes  # summed over the 3 calls
    other = _micro(policy, ids, mask, micro_batch=3, generator=row_generators("t", 0, 9),
                                   sort_by_length=True, **common)
    assert not torch.equal(other.completion_ids, whole.completion_ids)  # the noise does matter


def test_sorting_prompts_of_one_length_changes_nothing(prompt_widths):
    # Equal lengths: the stable sort keeps the order and no column is padding in every row, so
    # the calls and the output are those without the option, bit for bit (in float32).
    policy = make_tiny_policy(seed=32)
    prompts = ["3,5,7=22", "12,13=99", "1,2,3=45", "20,2=100", "7,7,7=49"]
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    assert mask.all()
    common = dict(gen_length=8, temperature=1.0, micro_batch=2, record_logprob=True)
    plain = _micro(policy, ids, mask, generator=row_generators("e", 0, 5), **common)
    ordered = _micro(policy, ids, mask, generator=row_generators("e", 0, 5), sort_by_length=True,
                                     **common)
    assert prompt_widths == [9] * 6
    for f in ("sequences", "completion_ids", "completion_mask", "unmask_step", "entropy", "token_logprob"):
        assert torch.equal(getattr(ordered, f), getattr(plain, f)), f
    assert ordered.forward_passes == plain.forward_passes


class _Counting:
    """A policy that counts its model calls."""

    def __init__(self, policy):
        self._policy, self.calls = policy, 0

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def logits(self, *args, **kwargs):
        self.calls += 1
        return self._policy.logits(*args, **kwargs)


def test_synced_micro_batches_make_the_calls_of_the_largest_share():
    # 3 rows in micro-batches of 2 make 2 generate calls; a process whose share needs 3
    # (micro_batch_calls(5, 2) = 3) makes every process make 3, of 9 model calls each
    # (synced: one per step), and the spare call changes no token.
    policy = _Counting(_EosEager(make_tiny_policy(seed=22)))
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    sampling = SamplingConfig(gen_length=9)
    alone = generate_micro_batched(RolloutRequest(policy, ids, mask, 9, None, sampling, micro_batch=2, synced=True))
    assert policy.calls == 2 * 9
    policy.calls = 0
    assert micro_batch_calls(5, 2) == 3 and micro_batch_calls(5, None) == 1
    padded = generate_micro_batched(RolloutRequest(policy, ids, mask, 9, None, sampling, micro_batch=2, synced=True,
                                                   num_calls=micro_batch_calls(5, 2)))
    assert policy.calls == 3 * 9
    assert torch.equal(padded.completion_ids, alone.completion_ids)


@pytest.mark.parametrize("kind", ["tiny", "sdar"])
def test_a_block_model_decodes_in_its_own_blocks_by_default(kind, tmp_path):
    # Evaluation's default sampling (block_length unset) on a block model: the tokens of its
    # blocks of 4 named (and, for the tiny model, whose blocks start at the completion, in order).
    if kind == "tiny":
        policy = make_tiny_policy(seed=15, attention_kind="block", block_size=4)
    else:  # the decoder adapter, its block size read from the SDAR stand-in's config
        from stabledrl.settings import ModelConfig
        from stabledrl.models.policy import load_policy
        from tests.models.test_adapters import save_stand_ins

        policy = load_policy(ModelConfig(path=str(save_stand_ins(tmp_path)["sdar"])))
    assert policy.attention_kind == "block" and policy.block_size == 4
    _, default = _run(policy, gen_length=8, steps=8, temperature=1.0, generator=row_generators("blk", 0, len(PROMPTS)))
    _, named = _run(policy, gen_length=8, steps=8, temperature=1.0, block_length=4,
                    generator=row_generators("blk", 0, len(PROMPTS)))
    assert torch.equal(default.completion_ids, named.completion_ids)
    assert torch.equal(default.unmask_step, named.unmask_step)
    if kind == "sdar":  # its blocks count from the sequence's first token (prompt_attention sequence_blocks)
        return
    done = default.unmask_step  # (B, 8): every slot of block 0 committed before any of block 1
    assert (done[:, :4] >= 0).all() and (done[:, :4].amax(1)[:, None] <= torch.where(done[:, 4:] >= 0, done[:, 4:], 99)).all()
