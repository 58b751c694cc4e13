"""SPG's pieces in stabledrl.likelihood: the block_random plan and the EUBO."""

import itertools
import math

import pytest
import torch

from stabledrl.likelihood import Completions, eubo, estimate, plan_views, score_views
from tests import test_likelihood

setup = test_likelihood.setup  # the fixture: a tiny policy, two prompts and their completions


def _prefix_mask(lengths, L):
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]


def test_block_random_views_have_the_authors_shape():
    # Every view: one block j; 1..m of its m scored slots masked; every slot after those
    # masked (later blocks, the PAD after EOS); earlier slots masked only by the prompt-rate
    # perturbation (none at p = 0); each masked scored slot weighs 1/(K·c).
    L, S, K = 9, 3, 2
    c_mask = _prefix_mask([9, 7, 4, 1], L)
    prompt = torch.full((4, 5), 7)
    plan = plan_views("block_random", Completions(c_mask, prompt_ids=prompt), num_samples=K,
                      generator=torch.Generator().manual_seed(1), block_length=S, p_prompt=0.0)
    assert plan.num_views == 4 * K and not plan.prompt_masked.any()
    for v in range(plan.num_views):
        b = int(plan.seq_index[v])
        n = int(c_mask[b].sum())
        masked = plan.masked[v]
        first = int(masked.nonzero()[0])  # the first masked slot lies in the chosen block
        start = first // S * S
        m = min(S, n - start)
        assert 1 <= int(masked[start : start + m].sum()) <= m
        assert masked[start + m :].all() and not masked[:start].any()
        counted = masked & c_mask[b]
        assert torch.equal(plan.weight[v], counted.double() / int(counted.sum()) / K)
    # the K views of a row fall in different draws of the block order: here all rows with
    # three filled blocks saw two different blocks
    starts = (plan.masked.double().argmax(1) // S).view(4, K)
    assert (starts[0, 0] != starts[0, 1]) and (starts[1, 0] != starts[1, 1])


def _exact_block_random(logp, n, L, S, p):
    """E over the authors' block_random draw (K = 1) of the per-token mean of a context-free
    model's log p over the counted slots, enumerated: the block j = r mod C for r uniform on
    the ⌈L/S⌉ blocks, k uniform on 1..m, a uniform k-subset, each earlier slot with rate p."""
    NB, C = math.ceil(L / S), (n - 1) // S + 1
    total = 0.0
    for r in range(NB):
        start = (r % C) * S
        m = min(S, n - start)
        after = list(range(start + m, n))  # scored slots after the block's: always counted
        earlier = list(range(start))
        for k in range(1, m + 1):
            for drawn in itertools.combinations(range(start, start + m), k):
                for e in range(len(earlier) + 1):
                    for pert in itertools.combinations(earlier, e):
                        prob = (1 / NB) * (1 / m) / math.comb(m, k) * p**e * (1 - p) ** (len(earlier) - e)
                        counted = [*drawn, *after, *pert]
                        total += prob * sum(logp[i] for i in counted) / len(counted)
    return total


@pytest.mark.parametrize("n", [5, 3])  # 3 filled blocks of 3 (uniform), 2 of 3 (the wrap-around favours block 0)
def test_block_random_draws_the_authors_law(n):
    # A context-free model's estimate is a function of the masks alone; the mean of 6,000
    # drawn views equals the enumerated expectation within 5 standard errors (the seed is
    # fixed: the verdict is the same on every machine).
    L, S, p, R = 6, 2, 0.3, 6000
    logp = torch.tensor([-0.5, -1.0, -2.0, -4.0, -8.0, -16.0], dtype=torch.float64)
    c_mask = _prefix_mask([n] * R, L)
    plan = plan_views("block_random", Completions(c_mask, prompt_ids=torch.full((R, 2), 7)), num_samples=1,
                      generator=torch.Generator().manual_seed(3), block_length=S, p_prompt=p)
    values = (plan.weight * logp).sum(1)  # (R,) one view per row
    expected = _exact_block_random(logp.tolist(), n, L, S, p)
    se = float(values.std()) / math.sqrt(R)
    assert abs(float(values.mean()) - expected) < 5 * se, (float(values.mean()), expected, se)
    # and the prompt is masked at rate p, padding never
    assert abs(float(plan.prompt_masked.double().mean()) - p) < 0.02


def test_block_random_and_eubo_equal_a_direct_computation(setup):
    # The same draws redone by hand: one forward per view (prompt tokens masked as drawn),
    # float64 probabilities; ELBO = mean over views of the mean log p over the counted
    # slots; EUBO = (1/β) mean over slots with a_i > 0 of log a_i, a_i = (1/K) Σ_v p^β m/t.
    policy, p_ids, p_mask, c_ids, c_mask = setup
    K, beta = 2, 1.5
    plan = plan_views("block_random", Completions(c_mask, prompt_ids=p_ids, prompt_mask=p_mask), num_samples=K,
                      generator=torch.Generator().manual_seed(8), block_length=3, p_prompt=0.4)
    assert plan.prompt_masked.any() and (plan.masked & ~c_mask[plan.seq_index]).any()  # prompt and PAD masked
    est = score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
    got = eubo(plan, est.views, c_mask, beta=beta)
    B, L = c_ids.shape
    elbo, a = torch.zeros(B, dtype=torch.float64), torch.zeros((B, L), dtype=torch.float64)
    for v in range(plan.num_views):
        b = int(plan.seq_index[v])
        x = torch.cat([p_ids[b].masked_fill(plan.prompt_masked[v], policy.mask_token_id),
                       c_ids[b].masked_fill(plan.masked[v], policy.mask_token_id)])[None]
        attn = torch.cat([p_mask[b], torch.ones(L, dtype=p_mask.dtype)])[None]
        with torch.no_grad():
            lp = policy.logits(x, attn)[0, p_ids.size(1):].double().log_softmax(-1)
        lp = lp.gather(-1, c_ids[b][:, None]).squeeze(-1)  # (L,)
        counted = plan.masked[v] & c_mask[b]
        elbo[b] += float(lp[counted].mean()) / K
        t = int(counted.sum()) / int(c_mask[b].sum())
        a[b] += torch.where(counted, lp.exp() ** beta / t, 0.0) / K
    present = a > 0
    expected = torch.stack([a[b][present[b]].log().mean() / beta for b in range(B)])
    assert torch.allclose(est.sequence.double(), elbo, atol=1e-4)
    assert torch.allclose(got.double(), expected, atol=1e-4)


def test_eubo_of_fully_masked_views_is_the_mean_log_probability(setup):
    # With every slot masked in one view (t = 1, K = 1), a_i = p_i^β and the EUBO is the
    # mean of log p_i over the scored slots: mean_field's estimate divided by n.
    policy, p_ids, p_mask, c_ids, c_mask = setup
    plan = plan_views("mean_field", Completions(c_mask, prompt_ids=p_ids, prompt_mask=p_mask), p_prompt=0.0)
    est = score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
    got = eubo(plan, est.views, c_mask, beta=1.5)
    assert torch.allclose(got, est.sequence / c_mask.sum(1), atol=1e-5)
    assert est.views.shape == (2, c_ids.size(1))  # one view per sequence here
    assert (est.views[~c_mask.bool()] == 0).all() and (est.views[c_mask.bool()] < 0).all()  # 0 off the scored slots


def test_eubo_gradient_flows_and_slots_no_view_masks_do_not_count(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    plan = plan_views("mc", Completions(c_mask), num_samples=1, generator=torch.Generator().manual_seed(2))
    est = score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
    got = eubo(plan, est.views, c_mask, beta=2.0)
    got.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())
    # by hand for K = 1: the mean over the masked slots of log(p^β · n/k) / β
    with torch.no_grad():
        for b in range(2):
            m = plan.masked[b] & c_mask[b]
            n, k = int(c_mask[b].sum()), int(m.sum())
            want = (2.0 * est.views[b][m] + math.log(n / k)).mean() / 2.0
            assert abs(float(got[b]) - float(want)) < 1e-5


def test_block_random_refuses_bad_options(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="at most the 3 blocks"):
        plan_views("block_random", Completions(c_mask, prompt_ids=p_ids), num_samples=4, generator=gen, block_length=3)
    with pytest.raises(ValueError, match="p_prompt"):
        plan_views("block_random", Completions(c_mask, prompt_ids=p_ids), generator=gen, p_prompt=1.0)
    with pytest.raises(ValueError, match="block_length"):
        plan_views("block_random", Completions(c_mask, prompt_ids=p_ids), generator=gen, block_length=0)
    with pytest.raises(ValueError, match="draws random masks"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="block_random",
                 block_length=3)
    plan = plan_views("mc", Completions(c_mask), generator=gen)
    with pytest.raises(ValueError, match="beta must be positive"):
        eubo(plan, torch.zeros(2, 8), c_mask, beta=0.0)
    with pytest.raises(ValueError, match="view_logp must be"):
        eubo(plan, torch.zeros(3, 8), c_mask, beta=1.5)
