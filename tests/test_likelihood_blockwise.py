"""The blockwise estimator (block-diffusion models) against separate passes per block."""

import itertools
import math

import pytest
import torch

from stabledrl.data import completion_mask as make_completion_mask
from stabledrl.data import encode_completions, encode_prompts
from stabledrl.likelihood import (Completions, backward_views, block_logprobs_by_separate_passes, estimate, plan_views,
                                  score_views)
from tests.conftest import make_tiny_policy


def _setup(S, L, prompts=("3,5,7=22", "12,4,6=9", "1=1"), answers=("3*5", "12-4+1", "1")):
    policy = make_tiny_policy(seed=41, attention_kind="block", block_size=S)
    p_ids, p_mask = encode_prompts(policy.tokenizer, list(prompts))  # left-padded, unequal lengths
    c_ids = encode_completions(policy.tokenizer, list(answers), L)
    return policy, p_ids, p_mask, c_ids, make_completion_mask(c_ids, policy.eos_token_id)


def _block_pass(policy, p_ids, p_mask, c_ids, b, j, subset) -> dict[int, float]:
    """{i: log p(y_i | q, y_<j, block j with `subset` masked)} for i in subset, from the
    separate pass over [q ; y_<j ; ỹ_j] with the block-causal mask."""
    masked = torch.zeros((1, c_ids.size(1)), dtype=torch.bool)
    masked[0, list(subset)] = True
    with torch.no_grad():
        logp = block_logprobs_by_separate_passes(policy, p_ids[b : b + 1], p_mask[b : b + 1], c_ids[b : b + 1], masked)
    return {i: float(logp[0, i]) for i in subset}


def terms_by_separate_passes(policy, plan, p_ids, p_mask, c_ids, c_mask) -> torch.Tensor:
    """(B, L) the plan's weighted per-slot terms, each view's block terms from its own
    separate pass over [q ; y_<b ; ỹ_b]: what one staircase pass must reproduce."""
    sep = torch.zeros(c_ids.shape, dtype=torch.float64)
    for v in range(plan.num_views):
        b = int(plan.seq_index[v])
        with torch.no_grad():
            logp = block_logprobs_by_separate_passes(policy, p_ids[b : b + 1], p_mask[b : b + 1], c_ids[b : b + 1],
                                                     plan.masked[v : v + 1])[0].double()  # (L,)
        sep[b] += torch.where(plan.masked[v] & c_mask[b], plan.weight[v] * logp, 0.0)
    return sep


def exact_blockwise(policy, p_ids, p_mask, c_ids, c_mask):
    """Σ_j ELBO_j, each by enumerating the block's subsets, one separate pass per subset."""
    S, L = policy.block_size, c_ids.size(1)
    out = []
    for b in range(c_ids.size(0)):
        total = 0.0
        for j in range(math.ceil(L / S)):
            slots = [i for i in range(j * S, min(L, (j + 1) * S)) if c_mask[b, i]]
            n = len(slots)
            for k in range(1, n + 1):
                for sub in itertools.combinations(slots, k):
                    total += (1 / (n * math.comb(n, k))) * (n / k) * sum(_block_pass(policy, p_ids, p_mask, c_ids, b, j, sub).values())
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("S, L", [(2, 8), (3, 8), (4, 7), (8, 8)])  # S divides L or not; one block
def test_one_pass_exact_equals_separate_passes(S, L):
    setup = _setup(S, L)
    policy, p_ids, p_mask, c_ids, c_mask = setup
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="blockwise", inner="exact")
    # float32 sums of |ELBO| ≈ 22 (ulp 1.9e-6): relative 1e-5, far above rounding on any CPU
    assert torch.allclose(est.sequence.double(), exact_blockwise(*setup), rtol=1e-5, atol=0)


def test_one_pass_equals_separate_passes_on_random_masks():
    # A sampled plan (each view masks some slots of every block): every term read from the
    # staircase pass equals the same block's term from its own pass.
    policy, p_ids, p_mask, c_ids, c_mask = _setup(3, 8)
    plan = plan_views("blockwise", Completions(c_mask), num_samples=3, block_size=3,
                      generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
        one = score_views(policy, plan, rows).token.double()  # (B, L)
    sep = terms_by_separate_passes(policy, plan, p_ids, p_mask, c_ids, c_mask)
    assert plan.masked.any()
    assert torch.allclose(one, sep, atol=1e-5)


@pytest.mark.parametrize("options", [dict(), dict(stratified=True, num_samples=4)])
def test_mc_inner_is_unbiased_for_the_blockwise_elbo(options):
    setup = _setup(3, 8)
    exact = exact_blockwise(*setup)
    policy, p_ids, p_mask, c_ids, c_mask = setup
    R = 600
    options = dict(options)
    K = options.pop("num_samples", 1)
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask.repeat(R, 1), prompt_ids=p_ids.repeat(R, 1),
                                           completion_ids=c_ids.repeat(R, 1), prompt_mask=p_mask.repeat(R, 1)),
                       method="blockwise", num_samples=K, generator=torch.Generator().manual_seed(0), **options)
    est = est.sequence.double().view(R, 3)
    mean, se = est.mean(0), est.std(0) / math.sqrt(R)
    assert ((mean - exact).abs() < 4 * se + 1e-9).all(), (mean, exact, se)


def test_sdmc_inner_uses_the_quadrature_counts_and_weights():
    # Block of n = 3 scored slots, N = 2 nodes t = 0.211, 0.789: k = round(0.63) = 1 and
    # round(2.37) = 2 masked slots, weights ½·3/1 and ½·3/2 (divided by K = 1).
    policy, p_ids, p_mask, c_ids, c_mask = _setup(3, 3, prompts=("1=1",), answers=("12",))  # "12" + EOS: n = 3
    assert c_mask.sum().item() == 3
    plan = plan_views("blockwise", Completions(c_mask), num_samples=1, block_size=3, inner="sdmc", num_nodes=2,
                      generator=torch.Generator().manual_seed(0))
    assert plan.masked.sum(1).tolist() == [1, 2]
    assert plan.weight.max(1).values.tolist() == pytest.approx([1.5, 0.75])
    assert (plan.weight[~plan.masked] == 0).all() and (plan.weight[plan.masked] > 0).all()


def test_blocks_after_eos_are_skipped_and_backward_matches_one_graph():
    policy, p_ids, p_mask, c_ids, c_mask = _setup(2, 8)  # "1" + EOS: blocks 2-4 are PAD
    plan = plan_views("blockwise", Completions(c_mask), num_samples=2, block_size=2,
                      generator=torch.Generator().manual_seed(3))
    assert not (plan.masked & ~c_mask[plan.seq_index]).any()  # only scored slots are masked
    g = torch.tensor([0.5, -1.0, 2.0])
    params = list(policy.model.parameters())
    policy.model.zero_grad()
    rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
    (g * score_views(policy, plan, rows).sequence).sum().backward()
    ref = [p.grad.clone() for p in params]
    assert any(r.abs().sum() > 0 for r in ref)
    policy.model.zero_grad()
    backward_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask), g,
                   max_views_per_forward=2)
    for r, p in zip(ref, params):
        assert torch.allclose(r, p.grad, atol=1e-6)
    policy.model.zero_grad()


def test_methods_and_policies_must_match():
    block = _setup(2, 8)
    full = make_tiny_policy(seed=1)
    policy, p_ids, p_mask, c_ids, c_mask = block
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="blockwise"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask), method="mc",
                 generator=gen)
    with pytest.raises(ValueError, match="block policy"):
        estimate(full, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                 method="blockwise", generator=gen)
    with pytest.raises(ValueError, match="block_size"):
        plan_views("mc", Completions(c_mask), generator=gen, block_size=2)
    with pytest.raises(ValueError, match="inner"):
        plan_views("blockwise", Completions(c_mask), generator=gen, block_size=2, inner="mean_field")
    with pytest.raises(ValueError, match="takes the options"):
        plan_views("blockwise", Completions(c_mask), generator=gen, block_size=2, masking="count")
    for inner, option in [("mc", {"num_nodes": 2}), ("sdmc", {"stratified": True}), ("exact", {"num_nodes": 2})]:
        with pytest.raises(ValueError, match=f"inner='{inner}' takes"):  # an option the inner method ignores
            plan_views("blockwise", Completions(c_mask), generator=gen, block_size=2, inner=inner, **option)
