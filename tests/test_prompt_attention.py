"""Where a block model's prompt blocks fall (`prompt_attention`), against references written
from the published code, one sequence at a time.

SDAR's and TraDo's own code cuts the whole sequence into blocks of S from its first token
(JetAstra/SDAR ``generate.py``: a ``tril`` over blocks expanded to tokens, the prompt's
whole blocks prefilled, the first decoded block = the prompt's remainder + masks; SDAR's
``modeling_sdar.py`` ``block_diff_mask`` for its SFT loss; dLLM-RL's JetEngine rollouts of
TraDo): the prompt's tail shares a block with the first completion slots. Each test below
recomputes one quantity the way that code does, for each sequence alone and without
padding, and compares it with stabledrl's batched, left-padded computation: the
likelihood's staircase pass (exact ELBO, sampled plans, the sampler's path), the sampler's
logits at every step, and the SFT loss. The SDAR stand-in (tests/models/fake_dllm.py) gives
the references; stabledrl's native SDAR with its weights runs through the sdar adapter; the
tiny model with ``prompt_attention: sequence_blocks`` in its config runs the sampler's cache
path too.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stabledrl.data import completion_mask, encode_completions, encode_prompts
from stabledrl.likelihood import Completions, estimate, plan_views, score_views
from stabledrl.models import HFPolicy
from stabledrl.models.native import SDARConfig, SDARForCausalLM
from stabledrl.sampling import SamplingConfig, generate, row_generators
from stabledrl.sft import diffusion_loss, sample_mask_levels
from tests.conftest import make_tiny_policy
from tests.models.test_adapters import fake_dllm, sdar_tokenizer

S = 4
# Real lengths 5, 8, 3, 6, 7 (SDAR's tokenizer adds no BOS): 1, 0, 3, 2 and 3 tokens of each
# prompt's tail share the first completion block.
PROMPTS = ["12+34", "3,5,7=22", "1=1", "12,4=9", "99-9=90"]
ANSWERS = ["3*5", "12-4", "1", "8/2=4", "6"]


def sdar_policy(seed: int = 0) -> HFPolicy:
    """stabledrl's native SDAR behind the sdar adapter (SDAR's tokenizer: no BOS, PAD = EOS), with
    the weights of the SDAR stand-in kept as `policy.published` for the references."""
    tok = sdar_tokenizer()
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, num_hidden_layers=2, rope_theta=1e6, block_size=S,
                  mask_token_id=tok.mask_token_id,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    published = fake_dllm.SDARForCausalLM(fake_dllm.SDARConfig(**fields))
    for m in published.modules():  # spread logits, so that a wrong mask shows
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.2)
    model = SDARForCausalLM(SDARConfig(**fields))
    model.load_state_dict(published.state_dict())
    policy = HFPolicy(model.eval(), tok, "sdar", tok.mask_token_id, block_size=S)
    policy.published = published.eval()
    return policy


def tiny_sdar_style(seed: int = 5):
    """The tiny block model told to read prompts SDAR's way (it has a KV cache)."""
    return make_tiny_policy(seed=seed, attention_kind="block", block_size=S, prompt_attention="sequence_blocks")


def _batch(policy, L: int):
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)  # left-padded
    c_ids = encode_completions(policy.tokenizer, ANSWERS, L)
    return p_ids, p_mask, c_ids, completion_mask(c_ids, policy.eos_token_id)


def sdar_block_mask(T: int) -> torch.Tensor:
    """(T, T) as SDAR's generate.py builds it: tril over blocks of S, expanded to tokens (1 = may attend)."""
    nb = math.ceil(T / S)
    return torch.tril(torch.ones(nb, nb)).repeat_interleave(S, dim=0).repeat_interleave(S, dim=1)[:T, :T]


@torch.no_grad()
def sdar_forward(policy, seq: torch.Tensor) -> torch.Tensor:
    """(T,) one unpadded sequence, positions 0.. -> (T, V) logits under SDAR's block mask,
    called as SDAR's sampler calls its model (a float 0/1 mask, which SDAR's attention
    reads with .bool())."""
    T = seq.numel()
    mask, pos = sdar_block_mask(T), torch.arange(T)[None]
    if isinstance(policy, HFPolicy):
        return policy.published(input_ids=seq[None], attention_mask=mask[None, None], position_ids=pos,
                                use_cache=False).logits[0]
    return policy.model(input_ids=seq[None], attention_mask=mask.bool()[None], position_ids=pos).logits[0]


def _rows(p_ids, p_mask, c_ids):
    """Each row's real prompt (no padding), its length n and its completion."""
    for b in range(p_ids.size(0)):
        prompt = p_ids[b][p_mask[b].bool()]
        yield b, prompt, prompt.numel(), c_ids[b]


def _blocks_of(n: int, L: int) -> dict[int, list[int]]:
    """SDAR's blocks of the completion slots: slot i is at position n + i, block (n + i) // S."""
    out: dict[int, list[int]] = {}
    for i in range(L):
        out.setdefault((n + i) // S, []).append(i)
    return out


# --- the likelihood -------------------------------------------------------------------------


def test_sdar_exact_blockwise_likelihood_is_sdars_per_block_elbo():
    # Σ over SDAR's blocks β of the exact ELBO of β's scored slots given the clean earlier
    # blocks: every non-empty subset A of β's m scored slots masked, weight
    # (|A|−1)!(m−|A|)!/m! on each of its log-probs, each from its own pass over the
    # sequence up to β's end under SDAR's mask. stabledrl: one staircase pass per view.
    policy = sdar_policy()
    L = 6
    p_ids, p_mask, c_ids, c_mask = _batch(policy, L)
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="blockwise", inner="exact")
    ref = torch.zeros(len(PROMPTS), dtype=torch.float64)
    for b, prompt, n, y in _rows(p_ids, p_mask, c_ids):
        for blk, slots in _blocks_of(n, L).items():
            scored = [i for i in slots if c_mask[b, i]]
            m = len(scored)
            end = min((blk + 1) * S, n + L)
            for k in range(1, m + 1):
                w = math.factorial(k - 1) * math.factorial(m - k) / math.factorial(m)
                for sub in itertools.combinations(scored, k):
                    seq = torch.cat([prompt, y])[:end].clone()
                    seq[[n + i for i in sub]] = policy.mask_token_id
                    logp = sdar_forward(policy, seq).double().log_softmax(-1)
                    ref[b] += w * sum(logp[n + i, y[i]] for i in sub)
    # float32 logits, sums of |ℓ| ≈ 20: relative 1e-5 is far above rounding
    assert torch.allclose(est.sequence.double(), ref, rtol=1e-5, atol=0)


def test_sdar_sampled_plan_terms_are_sdars_per_block_passes():
    # A sampled plan masks some slots of each of SDAR's blocks in every view (the first
    # block is S − r slots long, r the prompt's tail); each weighted term read from the
    # staircase equals the same block's term from its own pass under SDAR's mask.
    policy = sdar_policy()
    L = 7
    p_ids, p_mask, c_ids, c_mask = _batch(policy, L)
    plan = plan_views("blockwise", Completions(c_mask, prompt_mask=p_mask), num_samples=3, block_size=S,
                      prompt_attention=policy.prompt_attention, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        completions = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
        one = score_views(policy, plan, completions).token.double()  # (B, L)
    ref = torch.zeros(c_ids.shape, dtype=torch.float64)
    rows = dict((b, (prompt, n, y)) for b, prompt, n, y in _rows(p_ids, p_mask, c_ids))
    for v in range(plan.num_views):
        b = int(plan.seq_index[v])
        prompt, n, y = rows[b]
        for blk, slots in _blocks_of(n, L).items():
            seq = torch.cat([prompt, y])[: min((blk + 1) * S, n + L)].clone()
            masked = [i for i in slots if plan.masked[v, i]]
            seq[[n + i for i in masked]] = policy.mask_token_id
            logp = sdar_forward(policy, seq).double().log_softmax(-1)
            for i in masked:
                if c_mask[b, i]:
                    ref[b, i] += plan.weight[v, i] * logp[n + i, y[i]]
        # the plan's blocks are SDAR's: a block's slots share one weight n_j / k_j
        for slots in _blocks_of(n, L).values():
            on = [i for i in slots if plan.masked[v, i]]
            assert len({float(plan.weight[v, i]) for i in on}) <= 1
    assert plan.masked.any() and one.abs().sum() > 0
    assert torch.allclose(one, ref, atol=1e-5)


def test_a_plan_drawn_for_other_blocks_is_refused():
    policy = sdar_policy()
    p_ids, p_mask, c_ids, c_mask = _batch(policy, 6)
    plan = plan_views("blockwise", Completions(c_mask), num_samples=1, block_size=S,
                      generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="prompt_attention='sequence_blocks'"):
        score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
    with pytest.raises(ValueError, match="needs the prompt_mask"):
        plan_views("blockwise", Completions(c_mask), block_size=S, prompt_attention="sequence_blocks",
                   generator=torch.Generator().manual_seed(0))


def test_sdar_path_likelihood_replays_each_rows_own_decoding_under_sdars_blocks():
    # path: Σ over a row's steps t of log p(y_i | the completion as it stood before t) for
    # the slots committed at t, under SDAR's blocks (slots committed before t shown, the
    # rest masked; the pass runs to the end of the slot's block).
    policy = sdar_policy()
    L = 7
    p_ids, p_mask, _, _ = _batch(policy, L)
    out = generate(policy, p_ids, p_mask, SamplingConfig(gen_length=L, steps=L, temperature=1.0),
                   generator=row_generators("path", 0, len(PROMPTS)))
    c_ids, c_mask, step = out.completion_ids, out.completion_mask, out.unmask_step
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask,
                                           unmask_step=step), method="path")
    ref = torch.zeros(c_ids.shape, dtype=torch.float64)
    for b, prompt, n, y in _rows(p_ids, p_mask, c_ids):
        for i in range(L):
            if not c_mask[b, i]:
                continue
            t, blk = int(step[b, i]), (n + i) // S
            shown = torch.where(step[b] < t, y, torch.full_like(y, policy.mask_token_id))
            seq = torch.cat([prompt, shown])[: min((blk + 1) * S, n + L)]
            ref[b, i] = sdar_forward(policy, seq).double().log_softmax(-1)[n + i, y[i]]
    assert torch.allclose(est.token.double(), ref, atol=1e-5)


# --- the sampler ----------------------------------------------------------------------------


class Recorder:
    """A policy that records, for every model call that reads logits (not the calls that
    only fill the KV cache), the ids and positions it was given and the logits it returned."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def logits(self, input_ids, attention_mask=None, position_ids=None, **kw):
        out = self.policy.logits(input_ids, attention_mask, position_ids, **kw)
        if not kw.get("extend_cache"):
            self.calls.append((input_ids.clone(), position_ids.clone(), out.detach().clone()))
        return out


def check_sampler_logits(policy, L: int, steps: int, **kw):
    """Generate, then check every recorded call: for each row whose block being denoised
    (its first masked one) the call holds whole, the logits of that block's masked slots
    equal SDAR's forward of that row alone, from scratch, over the sequence as the call saw
    it (its fed columns; the earlier blocks, final by then, from the output). (Blocks are
    decoded for all rows at once over the columns they cover in any row: a call for block
    j also holds part of a row's block j + 1, whose logits the sampler does not read.)
    Returns the output and the number of rows checked whose block held the prompt's tail."""
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)
    rec = Recorder(policy)
    generator = kw.pop("generator", None)
    out = generate(rec, p_ids, p_mask, SamplingConfig(gen_length=L, steps=steps, **kw), generator=generator)
    checked = with_tail = 0
    for ids, pos, logits in rec.calls:
        for b, prompt, n, y in _rows(p_ids, p_mask, out.completion_ids):
            real = ~((ids[b] == policy.pad_token_id) & (pos[b] < n))  # not the prompt's left padding
            state = torch.cat([prompt, y])  # (n + L,) by position
            state[pos[b][real]] = ids[b][real]
            masks = real & (ids[b] == policy.mask_token_id)
            if not masks.any():
                continue
            blk = int(pos[b][masks].min()) // S  # the row's block being denoised
            end = min((blk + 1) * S, n + L)
            if int(pos[b][real].max()) < end - 1:  # a call for other rows' blocks, which cover part of it
                continue
            cur = masks & (pos[b] // S == blk)
            ref = sdar_forward(policy, state[:end])
            assert torch.allclose(logits[b][cur].float(), ref[pos[b][cur]], atol=1e-5), (b, blk)
            checked += 1
            with_tail += blk == n // S and n % S > 0
    assert checked > 0
    return out, with_tail


def test_sdar_sampler_logits_are_sdars_from_scratch_at_every_step():
    # Without its KV cache: a call then also gives the logits of slots it does not decode, which
    # the check reads (the cached path: the same tokens, tests/models/test_adapters.py).
    out, with_tail = check_sampler_logits(sdar_policy(), L=7, steps=7, temperature=1.0, remasking="random",
                                          generator=row_generators("s", 0, len(PROMPTS)), kv_cache=False)
    assert with_tail > 0  # the first block of some rows held their prompt's tail


@pytest.mark.parametrize("kv_cache", [True, False])
def test_sequence_blocks_sampler_logits_from_its_kv_cache_are_from_scratch_ones(kv_cache):
    # The tiny model (the policy with a KV cache): the prompt's whole blocks prefilled, the
    # tail fed again with the first block, each block frozen into the cache after it.
    policy = tiny_sdar_style()
    _, with_tail = check_sampler_logits(policy, L=9, steps=6, temperature=1.0,
                                        generator=row_generators("c", 0, len(PROMPTS)), kv_cache=kv_cache)
    assert with_tail > 0


def test_sequence_blocks_sampler_tokens_do_not_depend_on_the_cache_the_batch_or_synced_calls():
    policy = tiny_sdar_style()
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)
    L, steps = 9, 4  # 9 slots span 3 blocks, after a tail or not: 4 steps, split 2 1 1
    gens = lambda lo, hi: row_generators("t", lo, hi)  # noqa: E731
    runs = [generate(policy, p_ids, p_mask, SamplingConfig(gen_length=L, steps=steps, temperature=1.0, kv_cache=cache),
                     generator=gens(0, 5), synced=synced) for cache in (True, False) for synced in (False, True)]
    for o in runs[1:]:
        assert torch.equal(o.completion_ids, runs[0].completion_ids)
        assert torch.equal(o.unmask_step, runs[0].unmask_step)
    for b, prompt in enumerate(PROMPTS):  # each row alone, unpadded: its own blocks and steps
        one_ids, one_mask = encode_prompts(policy.tokenizer, [prompt])
        alone = generate(policy, one_ids, one_mask, SamplingConfig(gen_length=L, steps=steps, temperature=1.0),
                         generator=gens(b, b + 1))
        assert torch.equal(alone.completion_ids[0], runs[0].completion_ids[b])
        assert torch.equal(alone.unmask_step[0], runs[0].unmask_step[b])
    # A row's steps are counted over its own blocks (the tiny tokenizer adds a BOS; these
    # rows write no EOS): "99-9=90" is 8 tokens, no tail: blocks of 4 4 1 slots, 2 1 1
    # steps; "3,5,7=22" is 9, a tail of 1: 3 4 2 slots; "12,4=9" is 7, a tail of 3: 1 4 4
    # slots (the one slot takes the first of its block's two steps).
    steps_of = lambda b, lo, hi: runs[0].unmask_step[b, lo:hi].unique().tolist()  # noqa: E731
    assert (steps_of(4, 0, 4), steps_of(4, 4, 8), steps_of(4, 8, 9)) == ([0, 1], [2], [3])
    assert (steps_of(1, 0, 3), steps_of(1, 3, 7), steps_of(1, 7, 9)) == ([0, 1], [2], [3])
    assert (steps_of(3, 0, 1), steps_of(3, 1, 5), steps_of(3, 5, 9)) == ([0], [2], [3])


def test_sequence_blocks_need_a_step_for_the_extra_block():
    policy = tiny_sdar_style()
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)
    with pytest.raises(ValueError, match="can span 3 blocks of 4"):  # 8 slots after a tail: ceil((3 + 8) / 4)
        generate(policy, p_ids, p_mask, SamplingConfig(gen_length=8, steps=2))


# --- SFT ------------------------------------------------------------------------------------


def test_sdar_sft_loss_is_the_loss_over_sdars_own_training_layout():
    # SDAR's SFT (modeling_sdar.py, prepare_for_bd_training) runs [x_t ; x_0] of each sample
    # under block_diff_mask: blocks of S from the sample's first token, the prompt never
    # noised. Replaying diffusion_loss's draws (one level per row and SDAR block,
    # stratified; a uniform per slot), its loss equals
    #   (1 / (B L)) Σ_b Σ_{i masked} −log p(y_i | x_t, x_0) / t_{b, block(i)}
    # read from that layout, row by row (normalised as stabledrl's; SDAR divides by the
    # answer length).
    policy = sdar_policy()
    L = 7
    p_ids, p_mask, c_ids, _ = _batch(policy, L)
    B = len(PROMPTS)
    gen = torch.Generator().manual_seed(3)
    replay = torch.Generator().set_state(gen.get_state())
    with torch.no_grad():
        loss, _ = diffusion_loss(policy, p_ids, p_mask, c_ids, generator=gen)
    n = p_mask.sum(1)  # (B,) real prompt lengths
    first = n // S  # SDAR's block of each row's first completion slot
    NB = int(((n + L - 1) // S - first).max()) + 1  # the most blocks a row's completion spans
    t_blocks = sample_mask_levels(B * NB, generator=replay).view(B, NB)
    u = torch.rand((B, L), generator=replay)
    total = 0.0
    for b, prompt, nb, y in _rows(p_ids, p_mask, c_ids):
        t = torch.stack([t_blocks[b, (nb + i) // S - first[b]] for i in range(L)])  # (L,)
        masked = u[b] < t
        x0 = torch.cat([prompt, y])
        xt = torch.cat([prompt, y.masked_fill(masked, policy.mask_token_id)])
        T = x0.numel()
        mask = fake_dllm.block_attn_mask([torch.tensor([T])], S, "cpu")  # (1, 2T, 2T) SDAR's training mask
        pos = torch.arange(T).repeat(2)[None]
        with torch.no_grad():
            logits = policy.model(input_ids=torch.cat([xt, x0])[None], attention_mask=mask[:, None],
                                  position_ids=pos, use_cache=False).logits[0, nb:T]  # x_t's completion
        nll = torch.nn.functional.cross_entropy(logits.double(), y, reduction="none")  # (L,)
        total += float((nll * masked / t.double()).sum())
    assert math.isclose(float(loss), total / (B * L), rel_tol=1e-5)
