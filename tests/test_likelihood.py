"""Estimators against exact values computed independently, by enumerating masks."""

import dataclasses
import itertools
import math

import pytest
import torch

from stabledrl.data import completion_mask as make_completion_mask
from stabledrl.data import encode_completions, encode_prompts
from stabledrl.likelihood import (PLANNERS, Completions, backward_views, estimate, gauss_legendre, plan_views,
                                  planner_options, score_views)
from stabledrl.models import TinyPolicy
from stabledrl.settings import METHODS
from tests.conftest import ScriptedPolicy, make_tiny_policy


@pytest.fixture(scope="module")
def setup():
    policy = make_tiny_policy(seed=31)
    # Two completions of 4 and 6 scored slots (answer + EOS), PAD after; prompts of unequal length.
    p_ids, p_mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "12,4,6=9"])
    c_ids = encode_completions(policy.tokenizer, ["3*5", "12-4+1"], 8)
    c_mask = make_completion_mask(c_ids, policy.eos_token_id)
    assert c_mask.sum(1).tolist() == [4, 7]
    return policy, p_ids, p_mask, c_ids, c_mask


def _logp_masked(policy, p_ids, p_mask, c_ids, b, subset):
    """log p(y_i | y with `subset` masked) for i in subset: one direct forward."""
    comp = c_ids[b].clone()
    comp[list(subset)] = policy.mask_token_id
    x = torch.cat([p_ids[b], comp])[None]
    attn = torch.cat([p_mask[b], torch.ones_like(comp)])[None]
    with torch.no_grad():
        logp = policy.logits(x, attn)[0, p_ids.size(1):].double().log_softmax(-1)
    return sum(float(logp[i, c_ids[b, i]]) for i in subset)


def exact_elbo(policy, p_ids, p_mask, c_ids, c_mask):
    """Σ over every non-empty subset S of the scored slots of P(S) · (n/|S|) · Σ_{i∈S} log p,
    with P(S) = 1/(n C(n,|S|)): the ELBO in its exact-count form, enumerated."""
    out = []
    for b in range(c_ids.size(0)):
        slots = c_mask[b].nonzero().flatten().tolist()
        n = len(slots)
        total = 0.0
        for k in range(1, n + 1):
            for S in itertools.combinations(slots, k):
                total += (1 / (n * math.comb(n, k))) * (n / k) * _logp_masked(policy, p_ids, p_mask, c_ids, b, S)
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def exact_sdmc(policy, p_ids, p_mask, c_ids, c_mask, num_nodes, weight="count"):
    """Σ_j w_j c_j mean over every k_j-subset, c_j = n/k_j (count) or 1/t_j (time)."""
    nodes, weights = gauss_legendre(num_nodes)
    out = []
    for b in range(c_ids.size(0)):
        slots = c_mask[b].nonzero().flatten().tolist()
        n = len(slots)
        total = 0.0
        for t, w in zip(nodes, weights):
            k = min(n, max(1, round(t * n)))
            subsets = list(itertools.combinations(slots, k))
            c = n / k if weight == "count" else 1 / t
            total += w * c * sum(_logp_masked(policy, p_ids, p_mask, c_ids, b, S) for S in subsets) / len(subsets)
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def _repeat(setup, R):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    return policy, p_ids.repeat(R, 1), p_mask.repeat(R, 1), c_ids.repeat(R, 1), c_mask.repeat(R, 1)


def test_exact_method_equals_the_independent_enumeration(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="exact", max_views_per_forward=50)
    assert est.num_views == (2**4 - 1) + (2**7 - 1)
    # float32 sums of up to 127 views of |ELBO| ≈ 22 (ulp 1.9e-6): relative 1e-5 (2e-4 here) is
    # far above rounding on any CPU, far below a wrong weight or a missing subset
    assert torch.allclose(est.sequence.double(), exact_elbo(*setup), rtol=1e-5, atol=0)


def test_gauss_legendre_nodes_match_the_spec():
    t, w = gauss_legendre(2)
    assert t.tolist() == pytest.approx([0.5 - 0.5 / math.sqrt(3), 0.5 + 0.5 / math.sqrt(3)])  # 0.2113, 0.7887
    assert w.tolist() == pytest.approx([0.5, 0.5])
    t, w = gauss_legendre(3)
    assert t.tolist() == pytest.approx([0.5 - 0.5 * math.sqrt(0.6), 0.5, 0.5 + 0.5 * math.sqrt(0.6)])
    assert w.tolist() == pytest.approx([5 / 18, 8 / 18, 5 / 18])
    # exact for polynomials of degree 2N-1: ∫_0^1 t^5 dt = 1/6 with N = 3
    assert float((w * t**5).sum()) == pytest.approx(1 / 6)


@pytest.mark.parametrize("options", [
    dict(masking="count"),
    dict(masking="count", stratified=True, num_samples=4),
    dict(masking="bernoulli", num_samples=2),
    dict(masking="bernoulli", antithetic=True, num_samples=2),
    dict(masking="bernoulli", stratified=True, antithetic=True, num_samples=4),
])
def test_mc_is_unbiased_for_the_exact_elbo(setup, options):
    exact = exact_elbo(*setup)
    R = 1500
    policy, p_ids, p_mask, c_ids, c_mask = _repeat(setup, R)
    options = dict(options)
    K = options.pop("num_samples", 1)
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="mc", num_samples=K, generator=torch.Generator().manual_seed(0),
                       **options).sequence.double().view(R, 2)
    mean, se = est.mean(0), est.std(0) / math.sqrt(R)
    assert ((mean - exact).abs() < 4 * se).all(), (mean, exact, se)


def test_sdmc_large_k_equals_its_quadrature_by_enumeration(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    for N in (1, 2, 3, 5):
        quad = exact_sdmc(*setup, num_nodes=N)
        with torch.no_grad():
            est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                           method="sdmc", num_samples=10**6, num_nodes=N, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(est.sequence.double(), quad, rtol=1e-5, atol=0), (N, est.sequence, quad)


def test_sdmc_time_weight_equals_its_quadrature_by_enumeration(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    quad = exact_sdmc(*setup, num_nodes=2, weight="time")
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="sdmc", num_samples=10**6, num_nodes=2, weight="time",
                       generator=torch.Generator().manual_seed(0))
    assert torch.allclose(est.sequence.double(), quad, rtol=1e-5, atol=0), (est.sequence, quad)
    # n = 4 and 7 are short enough for the two weights to differ by far more than rounding
    assert not torch.allclose(quad, exact_sdmc(*setup, num_nodes=2), rtol=1e-3, atol=0)


def test_sdmc_node_weights_by_hand_at_n3():
    # n = 3 scored slots, 2 Gauss–Legendre nodes t = (3 ∓ √3)/6 = 0.211325, 0.788675, w = 0.5 each;
    # k = max(1, ⌊3t + ½⌋) = 1 and 2; K = 3 ≥ C(3, 1) = C(3, 2) = 3: each node's 3 subsets once.
    tok = ScriptedPolicy([8, 15, 3], [2.0, 1.0, 3.0], prompt_len=6)
    p_ids, p_mask = encode_prompts(tok.tokenizer, ["3,5=8"])  # (1, 6)
    c_ids = encode_completions(tok.tokenizer, ["3+"], 4)  # "3", "+", EOS, PAD
    c_mask = make_completion_mask(c_ids, tok.eos_token_id)
    assert c_mask.sum().item() == 3
    t1, t2 = (3 - math.sqrt(3)) / 6, (3 + math.sqrt(3)) / 6
    # count: per view w·(n/k)/3 = 0.5·3/3 = 0.5 (k = 1) and 0.5·1.5/3 = 0.25 (k = 2)
    # time:  per view w·(1/t)/3 = 1/(6 t1) = 0.788675 (= t2) and 1/(6 t2) = 0.211325 (= t1)
    for weight, per_view in [("count", [0.5, 0.25]), ("time", [t2, t1])]:
        plan = plan_views("sdmc", Completions(c_mask), num_samples=3, num_nodes=2, weight=weight,
                          generator=torch.Generator().manual_seed(0))
        k = plan.masked.sum(1).tolist()
        assert k == [1, 1, 1, 2, 2, 2]
        assert plan.weight.max(1).values.tolist() == pytest.approx([per_view[0]] * 3 + [per_view[1]] * 3, rel=1e-12)
        assert (plan.weight[~plan.masked] == 0).all() and (plan.weight[plan.masked] > 0).all()
    # The scripted policy is context-free: slot i's log-prob is c_i − log(e^c_i + V − 1) however the
    # rest is masked. Each slot is in 1 of the 3 one-subsets and 2 of the 3 two-subsets, so
    # count: ℓ = (0.5·1 + 0.25·2)·Σ log p = Σ log p (exact at every n);
    # time:  ℓ = (t2·1 + t1·2)·Σ log p = (0.788675 + 0.422650)·Σ log p = 1.211325·Σ log p.
    V = len(tok.tokenizer)
    total = sum(c - math.log(math.exp(c) + V - 1) for c in [2.0, 1.0, 3.0])
    for weight, factor in [("count", 1.0), ("time", t2 + 2 * t1)]:
        est = estimate(tok, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="sdmc", num_samples=3, num_nodes=2, weight=weight,
                       generator=torch.Generator().manual_seed(0))
        # float32 log-softmax of logits ≤ 3: rounding ~1e-6 against a 21% difference between the weights
        assert est.sequence.item() == pytest.approx(factor * total, rel=1e-5)
    with pytest.raises(ValueError, match="'count'"):
        plan_views("sdmc", Completions(c_mask), num_samples=3, weight="inverse_t", generator=torch.Generator())


def test_sdmc_sampled_is_unbiased_for_its_quadrature_and_lands_near_the_elbo(setup):
    quad = exact_sdmc(*setup, num_nodes=2)
    R = 800
    policy, p_ids, p_mask, c_ids, c_mask = _repeat(setup, R)
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="sdmc", num_samples=1, num_nodes=2,
                       generator=torch.Generator().manual_seed(1)).sequence.double().view(R, 2)
    mean, se = est.mean(0), est.std(0) / math.sqrt(R)
    assert ((mean - quad).abs() < 4 * se).all()
    # The quadrature is biased for the ELBO (integrand not polynomial in t); for this
    # random model the bias is a small fraction of |ELBO|.
    elbo = exact_elbo(*setup)
    assert ((quad - elbo).abs() < 0.1 * elbo.abs()).all(), (quad, elbo)


def test_mean_field_equals_a_direct_computation(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    gen = torch.Generator().manual_seed(4)
    state = gen.get_state()
    est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                   method="mean_field", p_prompt=0.5, generator=gen)
    # Redo it by hand: the same prompt mask draw, the whole completion masked, one forward.
    gen.set_state(state)
    drop = (torch.rand(p_ids.shape, generator=gen) < 0.5) & p_mask.bool() & (p_ids != policy.tokenizer.bos_token_id)
    x = torch.cat([p_ids.masked_fill(drop, policy.mask_token_id), torch.full_like(c_ids, policy.mask_token_id)], 1)
    attn = torch.cat([p_mask, torch.ones_like(c_ids)], 1)
    with torch.no_grad():
        logp = policy.logits(x, attn)[:, p_ids.size(1):].log_softmax(-1).gather(-1, c_ids[..., None]).squeeze(-1)
    expected = (logp * c_mask).sum(1)
    assert torch.allclose(est.sequence.detach(), expected, atol=1e-5)
    assert torch.allclose(est.token.detach(), logp * c_mask, atol=1e-5)
    assert est.num_views == 2
    assert drop.any()  # the check above exercised prompt masking


def test_coupled_equals_a_direct_computation(setup):
    # DiffuCoder's per-token surrogate, redone by hand from the same draws (t per row, then
    # u per slot): ½·log p(y_i | whole completion masked) + log p(y_i | its view) / (2t) for
    # u_i < t, / (2(1 − t)) otherwise; the PAD after EOS is masked in the first view only.
    policy, p_ids, p_mask, c_ids, c_mask = setup
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                   method="coupled", generator=gen)
    gen.set_state(state)
    B, L = c_ids.shape
    t = 0.2 + 0.6 * torch.rand((B, 1, 1), generator=gen, dtype=torch.float64)[:, 0, 0]  # (B,)
    low = c_mask & (torch.rand((B, 1, L), generator=gen, dtype=torch.float64)[:, 0] < t[:, None])  # (B, L)

    def logp(noised):  # (B, L) log p(y_i | y with `noised` slots masked), one forward
        x = torch.cat([p_ids, c_ids.masked_fill(noised, policy.mask_token_id)], 1)
        attn = torch.cat([p_mask, torch.ones_like(c_ids)], 1)
        with torch.no_grad():
            out = policy.logits(x, attn)[:, p_ids.size(1):].double().log_softmax(-1)
        return out.gather(-1, c_ids[..., None]).squeeze(-1)

    high = c_mask & ~low
    coupled = torch.where(low, logp(low) / t[:, None], logp(high) / (1 - t[:, None]))
    expected = torch.where(c_mask, 0.5 * logp(torch.ones_like(c_mask)) + 0.5 * coupled, 0.0)  # (B, L)
    assert low.any() and high.any() and est.num_views == 3 * B
    assert torch.allclose(est.token.double(), expected, atol=1e-5)
    assert torch.allclose(est.sequence.double(), expected.sum(1), atol=1e-4)
    with pytest.raises(ValueError, match="t_min"):
        plan_views("coupled", Completions(c_mask), generator=gen, t_min=0.9, t_max=0.5)


def test_coupled_is_one_and_a_half_log_likelihoods_for_a_context_free_model():
    # A context-free model gives slot i the same log p_i in every view, so a draw's term is
    # ½ log p_i (1 + 1/t) with probability t and ½ log p_i (1 + 1/(1 − t)) otherwise, whose
    # expectation is ½ log p_i + log p_i = 1.5 log p_i at every t: not the log-likelihood.
    tok = ScriptedPolicy([8, 15, 3], [2.0, 1.0, 3.0], prompt_len=6)
    p_ids, p_mask = encode_prompts(tok.tokenizer, ["3,5=8"])
    c_ids = encode_completions(tok.tokenizer, ["3+"], 4)  # "3", "+", EOS, PAD
    c_mask = make_completion_mask(c_ids, tok.eos_token_id)
    V = len(tok.tokenizer)
    logp = sum(c - math.log(math.exp(c) + V - 1) for c in (2.0, 1.0, 3.0))  # the scripted log-likelihood
    means = torch.tensor([float(estimate(tok, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids,
                                                          prompt_mask=p_mask), method="coupled", num_samples=200,
                                         generator=torch.Generator().manual_seed(r)).sequence)
                          for r in range(20)], dtype=torch.float64)
    se = float(means.std() / math.sqrt(len(means)))
    assert 0 < se < 0.05 * abs(logp)
    assert abs(float(means.mean()) - 1.5 * logp) < 5 * se


def test_antithetic_pairs_cover_every_scored_position_exactly_once(setup):
    *_, c_mask = setup
    plan = plan_views("mc", Completions(c_mask), num_samples=6, masking="bernoulli", antithetic=True,
                      generator=torch.Generator().manual_seed(2))
    D = plan.num_views // 2
    first, second = plan.masked[:D], plan.masked[D:]
    assert torch.equal(plan.seq_index[:D], plan.seq_index[D:])
    assert not (first & second).any()
    assert torch.equal(first | second, c_mask.bool()[plan.seq_index[:D]])


def test_same_generator_state_gives_the_same_masks_and_values(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    other = make_tiny_policy(seed=32)
    for method, opts in [("mc", {}), ("sdmc", {"num_nodes": 3}), ("mean_field", {})]:
        k = 1 if method == "mean_field" else 3
        a = plan_views(method, Completions(c_mask, prompt_ids=p_ids), num_samples=k,
                       generator=torch.Generator().manual_seed(9), **opts)
        b = plan_views(method, Completions(c_mask, prompt_ids=p_ids), num_samples=k,
                       generator=torch.Generator().manual_seed(9), **opts)
        assert torch.equal(a.masked, b.masked) and torch.equal(a.weight, b.weight)
        # Scoring one plan under two models: the difference is the models', not the masks'.
        with torch.no_grad():
            ea = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                          method=method, num_samples=k, generator=torch.Generator().manual_seed(9), **opts)
            eb = score_views(policy, b, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
            eo = score_views(other, b, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask))
        assert torch.equal(ea.sequence, eb.sequence)
        assert not torch.allclose(eo.sequence, eb.sequence)
    state_before = torch.random.get_rng_state()
    plan_views("mc", Completions(c_mask), num_samples=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.random.get_rng_state(), state_before)  # the global RNG is untouched


def test_micro_batches_and_backward_match_one_batch(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    plan = plan_views("sdmc", Completions(c_mask), num_samples=3, num_nodes=2,
                      generator=torch.Generator().manual_seed(5))
    whole = score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                        reduction="mean")
    chunked = score_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                          reduction="mean", max_views_per_forward=2)
    assert torch.allclose(whole.sequence, chunked.sequence, atol=1e-6)
    assert torch.allclose(whole.sequence, whole.token.sum(1) / c_mask.sum(1), atol=1e-6)
    # Gradients: backward per micro-batch equals backward of the full graph.
    g = torch.tensor([0.7, -1.3])
    params = list(policy.model.parameters())
    policy.model.zero_grad()
    (g * whole.sequence).sum().backward()
    ref = [p.grad.clone() for p in params]
    assert any(r.abs().sum() > 0 for r in ref)  # gradients reach the model
    policy.model.zero_grad()
    backward_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask), g,
                   reduction="mean", max_views_per_forward=2)
    for r, p in zip(ref, params):
        assert torch.allclose(r, p.grad, atol=1e-6)
    # Per-token gradients (token-level ratios): the same identity on est.token.
    G = torch.randn(c_ids.shape)
    policy.model.zero_grad()
    rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
    (G * score_views(policy, plan, rows).token).sum().backward()
    ref = [p.grad.clone() for p in params]
    policy.model.zero_grad()
    backward_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask), G,
                   max_views_per_forward=3)
    for r, p in zip(ref, params):
        assert torch.allclose(r, p.grad, atol=1e-6)
    policy.model.zero_grad()


def test_a_tokenizer_that_pads_with_eos_is_accepted(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup

    class PadIsEos:
        def __init__(self, inner):
            self.inner = inner
            self.mask_token_id, self.tokenizer = inner.mask_token_id, inner.tokenizer
            self.pad_token_id = self.eos_token_id = inner.eos_token_id

        def logits(self, *args):
            return self.inner.logits(*args)

    ids = c_ids.masked_fill(c_ids == policy.pad_token_id, policy.eos_token_id)  # pad with EOS
    with torch.no_grad():
        a = estimate(PadIsEos(policy), Completions(c_mask, prompt_ids=p_ids, completion_ids=ids, prompt_mask=p_mask),
                     method="mean_field", p_prompt=0.0)
    assert torch.isfinite(a.sequence).all()


def test_no_grad_gives_a_detached_estimate(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    with torch.no_grad():
        est = estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask),
                       method="mc", num_samples=2, generator=torch.Generator().manual_seed(0))
    assert not est.sequence.requires_grad and torch.isfinite(est.sequence).all()


def test_loud_errors(setup):
    policy, p_ids, p_mask, c_ids, c_mask = setup
    gen = torch.Generator().manual_seed(0)
    empty = c_mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match="empty completions"):
        estimate(policy, Completions(empty, prompt_ids=p_ids, completion_ids=c_ids), method="mc", generator=gen)
    with pytest.raises(ValueError, match="does not match"):
        estimate(policy, Completions(c_mask[:, :5], prompt_ids=p_ids, completion_ids=c_ids), method="mc", generator=gen)
    with pytest.raises(ValueError, match="stop token before the last scored slot"):  # EOS, PAD scored mid-row
        estimate(policy, Completions(torch.ones_like(c_mask), prompt_ids=p_ids, completion_ids=c_ids), method="mc",
                 generator=gen)
    masked = c_ids.clone()
    masked[0, 0] = policy.mask_token_id
    with pytest.raises(ValueError, match="never draws"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=masked), method="mc", generator=gen)
    after = c_ids.clone()
    after[~c_mask] = policy.eos_token_id
    with pytest.raises(ValueError, match="not PAD"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=after), method="mc", generator=gen)
    with pytest.raises(ValueError, match="generator"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="sdmc")
    with pytest.raises(ValueError, match="bernoulli"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="mc", antithetic=True,
                 num_samples=2, generator=gen)
    with pytest.raises(ValueError, match="even"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="mc", antithetic=True,
                 masking="bernoulli", num_samples=3, generator=gen)
    with pytest.raises(ValueError, match="unknown method"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="exhaustive",
                 generator=gen)

    plan = plan_views("mc", Completions(c_mask), num_samples=2, generator=gen)
    with pytest.raises(ValueError, match="grad must have shape"):
        backward_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), torch.ones(2, 1))
    with pytest.raises(ValueError, match="reduction"):
        backward_views(policy, plan, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), torch.ones(2),
                       reduction="avg")
    with pytest.raises(ValueError, match="plan is for 2"):
        score_views(policy, plan, Completions(c_mask[:1], prompt_ids=p_ids[:1], completion_ids=c_ids[:1]))
    with pytest.raises(ValueError, match="takes the options"):
        estimate(policy, Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="sdmc",
                 masking="bernoulli", generator=gen)

    class NoMask:
        mask_token_id = None
        pad_token_id = 0

    with pytest.raises(ValueError, match="mask_token_id"):
        estimate(NoMask(), Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids), method="mc", generator=gen)


def test_one_planner_per_method_and_one_plan_shape():
    # The config's list of methods is the registry's; every plan's weight is (Nv, L),
    # zero wherever the view counts nothing; mean_field masks all L slots and counts the
    # scored ones (2 of 4 here: the PAD after EOS is masked but not counted).
    assert sorted(PLANNERS) == sorted(METHODS)
    assert planner_options("sdmc") == {"num_nodes": 2, "weight": "count"}
    c_mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    gen = torch.Generator().manual_seed(0)
    rows = Completions(c_mask, prompt_ids=torch.full((2, 3), 7))
    for method, kw in [("mc", {}), ("sdmc", {}), ("exact", {}), ("blockwise", {"block_size": 2}),
                       ("mean_field", {"p_prompt": 0.0})]:
        plan = plan_views(method, rows, num_samples=1, generator=gen, **kw)
        assert plan.weight.shape == plan.masked.shape == (plan.num_views, 4) and plan.weight.dtype == torch.float64
        assert (plan.weight[~plan.masked] == 0).all()
        assert not (plan.weight.bool() & ~c_mask[plan.seq_index]).any()  # never an unscored slot
    assert plan.masked.all() and plan.weight.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="float64 of the masks' shape"):
        dataclasses.replace(plan, weight=torch.ones(2))
    with pytest.raises(ValueError, match="leaves clean"):
        dataclasses.replace(plan, masked=torch.zeros_like(plan.masked))


def test_mean_field_prompt_columns_all_masks_bos_and_padding_as_d1(setup):
    # "tokens" (default) never masks BOS or the left padding; "all" (d1's) may mask every column.
    policy, p_ids, p_mask, c_ids, c_mask = setup
    bos = policy.tokenizer.bos_token_id
    R = 50
    ids, mask, cm = p_ids.repeat(R, 1), p_mask.repeat(R, 1), c_mask.repeat(R, 1)
    special = (~mask.bool()) | (ids == bos)  # (2R, P) padding and BOS columns
    assert special.any() and bos is not None
    for columns, expect_special in [("tokens", False), ("all", True)]:
        plan = plan_views("mean_field", Completions(cm, prompt_ids=ids, prompt_mask=mask), bos_token_id=bos,
                          p_prompt=0.5, prompt_columns=columns, generator=torch.Generator().manual_seed(6))
        assert bool((plan.prompt_masked & special).any()) == expect_special, columns
        assert (plan.prompt_masked & ~special).any()
    with pytest.raises(ValueError, match="prompt_columns"):
        plan_views("mean_field", Completions(c_mask, prompt_ids=p_ids), prompt_columns="bos",
                   generator=torch.Generator())


def test_a_pad_that_ends_a_completion_is_scored_like_eos(setup):
    """PAD is a stop token of every policy (`stabledrl.data.completion_stop_ids`): a completion
    may end at a PAD instead of EOS, and that PAD is scored as EOS would be; a PAD after it is not."""
    policy, p_ids, p_mask, c_ids, _ = setup
    assert policy.stop_token_ids == (policy.eos_token_id, policy.pad_token_id)
    ids = c_ids.masked_fill(c_ids == policy.eos_token_id, policy.pad_token_id)  # "3*5" then PAD only
    mask = make_completion_mask(ids, policy.stop_token_ids)
    assert mask.sum(1).tolist() == [4, 7] and (ids[mask] == policy.pad_token_id).sum() == 2
    est = estimate(policy, Completions(mask, prompt_ids=p_ids, completion_ids=ids, prompt_mask=p_mask), method="mc",
                   num_samples=2, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(est.sequence).all()
    longer = mask.clone()
    longer[0, 4] = True  # the PAD after the one that ended row 0
    with pytest.raises(ValueError, match="stop token before the last scored slot"):
        estimate(policy, Completions(longer, prompt_ids=p_ids, completion_ids=ids, prompt_mask=p_mask), method="mc",
                 generator=torch.Generator())