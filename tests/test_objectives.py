import dataclasses
import math

import pytest
import torch

from stabledrl.instruments import first_half_loss
from stabledrl.objectives import (ScoredBatch, aggregate_tokens, grpo_loss, group_advantages, kl_k3, log_ratios,
                                  objective_for, ratio_diagnostics, share_of_loss, spg_likelihood, spg_loss,
                                  stabledrl_loss, wd1_loss)
from stabledrl.settings import OBJECTIVE_SECTIONS, GRPOConfig, SPGConfig, StableDRLConfig, WD1Config


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    # group 1 mean 0.5 -> ±0.5; group 2 all equal -> 0
    assert group_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    # unbiased std of (1,0,0,1) = sqrt(1/3) = 0.57735; 0.5 / (0.57735 + 1e-4) = 0.86588
    a = group_advantages(r, 4, scale="std")
    assert a[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), rel=1e-6)
    assert a[4:].abs().max() == 0
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)
    # leave-one-out: r_0 − mean(0, 0, 1) = 1 − 1/3 = 2/3 = (4/3)·0.5; r_1 − mean(1, 0, 1) = −2/3
    loo = group_advantages(r, 4, scale="leave_one_out")
    assert loo[:4].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3]) and loo[4:].abs().max() == 0


def test_grpo_with_g1_and_no_clipping_is_reinforce():
    # At θ = θ_old, ρ = 1 and ∇ρ = ∇ℓ: the GRPO gradient is −(1/B) Σ A_i ∇ℓ_i (ρ = 1 lies inside
    # the clip band, whose bounds never bind: no clipping).
    logp = torch.tensor([-3.0, -1.5, -7.0], requires_grad=True)
    adv = torch.tensor([0.7, -0.2, 1.3])
    grpo_loss(GRPOConfig(clip_eps=0.99), ScoredBatch(logp, logp.detach().clone(), adv, 1)).loss.backward()
    ref = logp.detach().clone().requires_grad_()
    (-(adv * ref).mean()).backward()
    assert torch.allclose(logp.grad, ref.grad)


def test_grpo_arithmetic_and_the_bypass():
    eps = 0.2
    # log ρ = (0, log 1.5, log 10, log 0.5); A = (+1, +1, −1, −1), one group of 4
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.0, 1.5, 10.0, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = grpo_loss(GRPOConfig(clip_eps=eps), ScoredBatch(logp, old, adv, 4))
    # per-sample min(ρA, clip(ρ)A): 1, min(1.5, 1.2) = 1.2, min(−10, −1.2) = −10 (bypass), min(−0.5, −0.8) = −0.8
    assert out.loss.item() == pytest.approx(-(1 + 1.2 - 10 - 0.8) / 4)
    out.loss.backward()
    # d/dℓ of −(1/4)·ρA where unclipped (sample 0 and the bypassed 2); 0 where the clip binds (1, 3)
    assert logp.grad.tolist() == pytest.approx([-0.25, 0.0, 10 / 4, 0.0])
    assert out.metrics["bypass_fraction"] == 0.25  # sample 2: A < 0 and ρ > 1.2
    assert out.metrics["clip_fraction"] == 0.75  # 1.5, 10 and 0.5 lie outside [0.8, 1.2]
    assert out.metrics["ratio_max"] == pytest.approx(10.0)


@pytest.mark.parametrize("rho", [10.0, 100.0, 1e4])
def test_grpo_gradient_grows_with_rho_while_stabledrl_stays_bounded(rho):
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    log_rho = torch.tensor([0.0, 0.0, math.log(rho), 0.0])
    g = log_rho.clone().requires_grad_()
    grpo_loss(GRPOConfig(), ScoredBatch(g, old, adv, 4)).loss.backward()
    assert g.grad[2].item() == pytest.approx(rho / 4, rel=1e-5)  # grows linearly with ρ
    s = log_rho.clone().requires_grad_()
    stabledrl_loss(StableDRLConfig(), ScoredBatch(s, old, adv, 4)).loss.backward()
    # |∂loss/∂ℓ_i| = w_i |A_i| ≤ max |A| = 1, whatever ρ is
    assert s.grad.abs().max() <= 1.0
    # upper clip c = 5: ρ̃ = (1, 1, 5, 1), w = ρ̃/8; the bypassed sample's weight is 5/8
    assert s.grad.tolist() == pytest.approx([-1 / 8, -1 / 8, 5 / 8, 1 / 8], abs=1e-6)  # float32 exp/log


def test_stabledrl_weights_are_a_softmax_of_clipped_log_ratios_summing_to_one():
    torch.manual_seed(0)
    G = 5
    logp = torch.randn(3 * G, requires_grad=True)
    old = logp.detach() + torch.randn(3 * G)
    ones = torch.ones(3 * G)  # with A = 1 the gradient is −w / num_groups
    stabledrl_loss(StableDRLConfig(clip="two_sided", clip_eps=0.2), ScoredBatch(logp, old, ones, G)).loss.backward()
    w = -logp.grad.view(3, G) * 3
    assert torch.allclose(w.sum(1), torch.ones(3))
    rho = (logp.detach() - old).exp().clamp(0.8, 1.2).view(3, G)
    assert torch.allclose(w, rho / rho.sum(1, keepdim=True), atol=1e-6)


def test_stabledrl_gradient_equals_the_weighted_sum_of_per_sample_gradients():
    # ℓ_i = θ · x_i (a linear "model"): ∇ℓ_i = x_i, so the gradient must be −Σ w_i A_i x_i / groups.
    torch.manual_seed(1)
    G, D = 4, 3
    x = torch.randn(2 * G, D)
    theta = torch.randn(D, requires_grad=True)
    old = (x @ theta).detach() + 0.3 * torch.randn(2 * G)
    adv = group_advantages(torch.rand(2 * G), G)
    stabledrl_loss(StableDRLConfig(clip="upper", clip_max=1.1), ScoredBatch(x @ theta, old, adv, G)).loss.backward()
    rho = ((x @ theta).detach() - old).exp().clamp(max=1.1).view(2, G)
    w = (rho / rho.sum(1, keepdim=True)).flatten()
    expected = -(w[:, None] * adv[:, None] * x).sum(0) / 2
    assert torch.allclose(theta.grad, expected, atol=1e-6)


def test_separate_weight_draw_changes_only_the_weights():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.0])
    adv = torch.tensor([1.0, -1.0])
    # weights from another draw: log ρ = (log 3, 0) -> w = (3/4, 1/4)
    out = stabledrl_loss(StableDRLConfig(), ScoredBatch(logp, old, adv, 2, weight_logp=torch.tensor([math.log(3), 0.0]),
                                                       weight_old_logp=torch.zeros(2)))
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-3 / 4, 1 / 4], abs=1e-6)  # float32 exp(log 3)
    assert out.metrics["ess"] == pytest.approx(1 / (9 / 16 + 1 / 16), rel=1e-5)


def test_ratio_levels_and_overflow():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # sequence_normalized: (ℓ − ℓ_old) / |y| = 3/3 and 4/2
    assert log_ratios(torch.tensor([3.0, 4.0]), torch.zeros(2), "sequence_normalized", mask).tolist() == [1.0, 2.0]
    # log_ratios does not clamp; GRPO clamps a log-ratio of ±1000 to ±80 so exp() stays finite in float32
    assert log_ratios(torch.tensor([1000.0, -1000.0]), torch.zeros(2), "sequence").tolist() == [1000.0, -1000.0]
    big = torch.tensor([1000.0, -1000.0], requires_grad=True)
    out = grpo_loss(GRPOConfig(clip_eps=0.2), ScoredBatch(big, torch.zeros(2), torch.tensor([1.0, -1.0]), 2))
    # min(e^80, 1.2)·1 = 1.2 and min(−e^−80, −0.8) = −0.8: loss −(1.2 − 0.8)/2 = −0.2, all finite
    assert out.loss.item() == pytest.approx(-0.2, rel=1e-6)
    assert math.isfinite(out.metrics["ratio_max"])
    out.loss.backward()
    assert torch.isfinite(big.grad).all()
    # token level: per-token ratios, min/clip per token, averaged over each sequence's scored tokens
    logp = torch.log(torch.tensor([[2.0, 1.0, 1.0, 9.0], [1.0, 1.0, 9.0, 9.0]]))
    out = grpo_loss(GRPOConfig(ratio_level="token", clip_eps=0.2),
                    ScoredBatch(logp, torch.zeros(2, 4), torch.tensor([1.0, -1.0]), 2, mask))
    # row 0 (A=+1): min(2, 1.2), 1, 1 -> mean 3.2/3; row 1 (A=−1): −1, −1 -> −1; loss = −(3.2/3 − 1)/2
    # = −0.0333: float32 terms of size 1 leave ~3e-8 of rounding, at the edge of the default rel 1e-6
    assert out.loss.item() == pytest.approx(-(3.2 / 3 - 1) / 2, abs=1e-6)


def test_kl_k3_by_hand():
    # d = ref − θ; k3 = e^d − d − 1: 0 at d = 0; at d = log 2: 2 − 0.6931 − 1 = 0.3069
    v = kl_k3(torch.tensor([0.0, 0.0]), torch.tensor([0.0, math.log(2)]))
    assert v.tolist() == pytest.approx([0.0, 1 - math.log(2)])
    out = grpo_loss(GRPOConfig(beta=0.04),
                    ScoredBatch(torch.zeros(2), torch.zeros(2), torch.zeros(2), 2, ref_logp=torch.tensor([0.0, math.log(2)])))
    assert out.loss.item() == pytest.approx(0.04 * (1 - math.log(2)) / 2)


def _float64_softmax(x: list[float]) -> list[float]:
    """An independent softmax in float64: e^(x_i − max) / Σ_j e^(x_j − max)."""
    m = max(x)
    e = [math.exp(v - m) for v in x]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("log_rho, top", [
    # issue 14: with a ±80 clamp the first group became (−79, −80, −80, ...): top weight
    # e/(e + 7) = 0.28, ESS 6.56; the second (−85 → −80, all −80): uniform 1/8. Unclamped:
    ([-79.0, -90.0, -100.0, -120.0, -130.0, -140.0, -150.0, -160.0], 1.0),  # 1/(1 + e^−11 + ...) = 0.99998
    ([-85.0, -90.0, -100.0, -120.0, -130.0, -140.0, -150.0, -160.0], 0.9933),  # 1/(1 + e^−5 + ...) = 0.99331
])
def test_stabledrl_weights_are_not_changed_by_a_clamp_of_very_negative_log_ratios(log_rho, top):
    G = len(log_rho)
    logp = torch.tensor(log_rho, requires_grad=True)  # old log-probs 0: log ρ = ℓ_θ
    ones = torch.ones(G)  # with A = 1 (one group) the gradient is −w
    out = stabledrl_loss(StableDRLConfig(), ScoredBatch(logp, torch.zeros(G), ones, G))
    out.loss.backward()
    w = (-logp.grad).tolist()
    expected = _float64_softmax(log_rho)
    # float32 softmax of exact inputs: rounding ~1e-7, far below the clamp's 0.28 vs 1.0
    assert w == pytest.approx(expected, abs=1e-6)
    assert w[0] == pytest.approx(top, abs=1e-4)
    assert out.metrics["ess"] == pytest.approx(1 / sum(v * v for v in expected), abs=1e-4)
    assert out.metrics["ess"] < 1.02  # the clamped weights gave 6.56 and 8


def test_token_aggregation_by_hand_with_unequal_lengths():
    # per-token terms; row 0 scores 3 tokens (1, 2, 3), row 1 one token (10)
    x = torch.tensor([[1.0, 2.0, 3.0, 7.0], [10.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # sequence_mean: (mean(1, 2, 3) + mean(10)) / 2 = (2 + 10) / 2 = 6
    assert aggregate_tokens(x, mask, "sequence_mean").item() == 6.0
    # batch_token_mean: (1 + 2 + 3 + 10) / 4 = 4
    assert aggregate_tokens(x, mask, "batch_token_mean").item() == 4.0
    # constant: (1 + 2 + 3 + 10) / (B·L) = 16 / 8 = 2; with the step's 8 rows, 16 / 32 = 0.5
    assert aggregate_tokens(x, mask, "constant").item() == 2.0
    assert aggregate_tokens(x, mask, "constant", step_rows=8).item() == 0.5
    # group_token_mean, two groups of 2: rows 2, 3 score (4, 4) and (0): group 1 (1 + 2 + 3 + 10) / 4 = 4,
    # group 2 (4 + 4 + 0) / 3 = 8/3; their mean 10/3 (batch_token_mean: 24 / 7)
    x4 = torch.cat([x, torch.tensor([[4.0, 4.0, 7.0, 7.0], [0.0, 7.0, 7.0, 7.0]])])
    mask4 = torch.cat([mask, torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])])
    assert aggregate_tokens(x4, mask4, "group_token_mean", group_size=2).item() == pytest.approx(10 / 3, rel=1e-6)
    assert aggregate_tokens(x4, mask4, "batch_token_mean").item() == pytest.approx(24 / 7, rel=1e-6)
    with pytest.raises(ValueError, match="sequence_mean"):
        aggregate_tokens(x, mask, "mean")


def test_the_aggregations_of_grpo_dapo_and_dr_grpo_by_hand():
    # Two groups of G = 2, token ratios all 1 (ℓ = ℓ_old), so each scored token's term min(ρA, clip(ρ)A)
    # is A_b and ∂term/∂ℓ_bi = A_b. Lengths n = (3, 1 | 2, 1), L = 4; A = (1, −1 | 0.5, −0.5);
    # the step was set to 4 groups (P·G = 8 rows), two of which were dropped.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cases = {
        # GRPO: the rows' token means (1, −1, 0.5, −0.5), their mean 0; ∂/∂ℓ_bi = −A_b / (n_b·B)
        "sequence_mean": ("sequences", 0.0, [-1 / 12, 1 / 4, -1 / 16, 1 / 8]),
        # DAPO: each group's token mean, (3 − 1)/4 = 0.5 and (1 − 0.5)/3 = 1/6, their mean 1/3;
        # ∂/∂ℓ_bi = −A_b / (N_g · 2 groups), N = (4, 3)
        "group_token_mean": ("sequences", -1 / 3, [-1 / 8, 1 / 8, -1 / 12, 1 / 12]),
        # Dr. GRPO: the sum over tokens, 3 − 1 + 1 − 0.5 = 2.5, over P·G·L = 8·4 = 32; ∂/∂ℓ_bi = −A_b / 32
        "constant": ("constant", -2.5 / 32, [-1 / 32, 1 / 32, -1 / 64, 1 / 64]),
        # d1's: the batch's token mean, 2.5 / 7
        "batch_token_mean": ("tokens", -2.5 / 7, [-1 / 7, 1 / 7, -0.5 / 7, 0.5 / 7]),
    }
    for how, (normaliser, loss, grad) in cases.items():
        opts = GRPOConfig(ratio_level="token", token_aggregation=how)
        assert opts.normaliser == normaliser and opts.advantage_scale == "none"  # Dr. GRPO: no std scaling
        logp = torch.zeros(4, 4, requires_grad=True)
        out = grpo_loss(opts, ScoredBatch(logp, torch.zeros(4, 4), adv, 2, mask, step_rows=8))
        assert out.loss.item() == pytest.approx(loss, abs=1e-7), how
        out.loss.backward()
        first = [logp.grad[b, 0].item() for b in range(4)]  # each row's first token (scored in every row)
        assert first == pytest.approx(grad, abs=1e-7), how
        assert (logp.grad[mask == 0] == 0).all()  # padding slots get nothing


def test_ratio_diagnostics_by_hand_for_any_objective():
    # One group of 2: log ρ = (log 3, 0), A = (−1, +1), ε = 0.2. ρ = (3, 1): mean 2, max 3, std √2;
    # std of log ρ = log 3 / √2; outside [0.8, 1.2]: 1 of 2; bypass (A < 0, ρ > 1.2): row 0, 1 of 2;
    # self-normalised ratios w = (3/4, 1/4): ESS = 1 / (9/16 + 1/16) = 1.6.
    batch = ScoredBatch(torch.tensor([math.log(3), 0.0]), torch.zeros(2), torch.tensor([-1.0, 1.0]), 2)
    d = ratio_diagnostics(batch)
    assert d == pytest.approx({"ratio_mean": 2.0, "ratio_std": math.sqrt(2), "ratio_max": 3.0,
                               "log_ratio_std": math.log(3) / math.sqrt(2), "clip_fraction": 0.5,
                               "bypass_fraction": 0.5, "ess": 1.6}, rel=1e-6)
    # an objective's own weights give its ESS; token ratios have no sequence weights, hence no ESS
    assert ratio_diagnostics(batch, weights=torch.tensor([[0.5, 0.5]]))["ess"] == 2.0
    mask = torch.tensor([[1, 1], [1, 0]])
    tokens = ratio_diagnostics(ScoredBatch(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2), 2, mask), level="token")
    assert tokens["ratio_max"] == 1.0 and "ess" not in tokens


def _cut(batch: ScoredBatch, lo: int, hi: int) -> ScoredBatch:
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[lo:hi] for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def _batch_asked_for(opts, G: int = 2) -> ScoredBatch:
    """A batch of 4 groups with what `opts` reads: unequal lengths (11 scored tokens in the first two
    groups, 5 in the last two), ratios away from 1, advantages of both signs, a graph on ℓ (and the EUBO)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 2, 1, 1, 2, 1])
    B, L = len(lengths), 5
    mask = torch.arange(L)[None, :] < lengths[:, None]  # (B, L)
    shape = (B, L) if opts.token_terms else (B,)
    logp = -3 * torch.rand(shape, generator=g)
    extra = {}
    if opts.eubo_beta is not None:
        extra["eubo"] = (logp + torch.rand(B, generator=g)).requires_grad_()
    if opts.needs_reference:
        extra["ref_logp"] = logp + 0.2 * torch.randn(shape, generator=g)
    if opts.weight_masks:
        extra["weight_logp"], extra["weight_old_logp"] = logp + 0.3 * torch.randn(B, generator=g), logp
    old = logp + 0.3 * torch.randn(shape, generator=g)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.2, 0.9, 0.0, 1.0, 0.5, 0.1]), G)
    return ScoredBatch(logp.requires_grad_(), old, adv, G, mask, step_rows=B, **extra)


def _options():
    """Every registered objective with its defaults, and the options that change what its loss is divided by."""
    yield from (OBJECTIVE_SECTIONS[name]() for name in OBJECTIVE_SECTIONS)
    yield from (GRPOConfig(ratio_level="token", beta=0.04, token_aggregation=how)
                for how in ("sequence_mean", "group_token_mean", "batch_token_mean", "constant"))
    yield StableDRLConfig(likelihood="spg")
    yield StableDRLConfig(separate_weight_masks=True, clip="two_sided")


@pytest.mark.parametrize("opts", list(_options()), ids=lambda o: ",".join(
    [o.name] + [f"{f.name}={getattr(o, f.name)}" for f in dataclasses.fields(o) if getattr(o, f.name) != f.default]))
def test_every_objective_splits_into_its_groups_as_its_normaliser_declares(opts):
    # Whatever an objective computes, the loss of a batch must be the sum of the losses of its
    # parts (whole groups), each weighted as its declared normaliser says: that is how the
    # accumulation rounds and grad_agreement's halves weigh them. Loss and gradient alike.
    batch = _batch_asked_for(opts)
    objective = objective_for(opts)
    out = objective(batch)
    assert out.loss.dim() == 0 and math.isfinite(out.loss.item())
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values()), out.metrics
    leaves = [t for t in (batch.logp, batch.eubo) if t is not None]
    whole = torch.autograd.grad(out.loss, leaves)
    assert whole[0].abs().sum() > 0
    parts = [(lo, hi, objective(_cut(batch, lo, hi)).loss) for lo, hi in ((0, 4), (4, 8))]
    for normaliser in ("sequences", "tokens", "constant"):
        summed = sum(share_of_loss(normaliser, batch.completion_mask, lo, hi) * loss for lo, hi, loss in parts)
        if normaliser == opts.normaliser:
            assert summed.item() == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-7)
            for got, want in zip(torch.autograd.grad(summed, leaves), whole):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
            # grad_agreement's first half is the first part, weighted the same way
            first = first_half_loss(objective, batch, normaliser=opts.normaliser)
            assert first.item() == pytest.approx((share_of_loss(normaliser, batch.completion_mask, 0, 4)
                                                  * parts[0][2]).item(), rel=1e-6)
        else:  # another declaration would weigh the parts wrong: the test can fail
            assert summed.item() != pytest.approx(out.loss.item(), rel=1e-3, abs=1e-5)


def test_grpo_token_aggregation_by_hand_with_unequal_lengths():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token ratios (2, 1, 0.25 | 3); A = (+1, −1); ε = 0.5: clip to [0.5, 1.5]
    # row 0 (A=+1): min(2, 1.5) = 1.5 (clipped), 1, min(0.25, 0.5) = 0.25; row 1 (A=−1): min(−3, −1.5) = −3 (bypass)
    rho = torch.tensor([[2.0, 1.0, 0.25, 1.0], [3.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    grads = {}
    for how, expected in [("sequence_mean", -((1.5 + 1 + 0.25) / 3 + (-3)) / 2),  # −(0.91667 − 3)/2 = 1.04167
                          ("batch_token_mean", -(1.5 + 1 + 0.25 - 3) / 4)]:  # −(−0.25)/4 = 0.0625
        logp = rho.log().requires_grad_()
        out = grpo_loss(GRPOConfig(ratio_level="token", clip_eps=0.5, token_aggregation=how),
                        ScoredBatch(logp, torch.zeros(2, 4), adv, 2, mask))
        assert out.loss.item() == pytest.approx(expected, abs=1e-6)
        out.loss.backward()
        grads[how] = logp.grad
    # sequence_mean: ∂loss/∂ℓ_bi = −ρ_bi A_b / (n_b · B) where unclipped; the clipped (0, 0) gets 0
    assert grads["sequence_mean"][0, :3].tolist() == pytest.approx([0.0, -1 / 6, -0.25 / 6], abs=1e-6)
    assert grads["sequence_mean"][1, 0].item() == pytest.approx(3 / 2, abs=1e-6)
    # batch_token_mean: ∂loss/∂ℓ_bi = −ρ_bi A_b / N, N = 4 scored tokens
    assert grads["batch_token_mean"][0, :3].tolist() == pytest.approx([0.0, -1 / 4, -0.25 / 4], abs=1e-6)
    assert grads["batch_token_mean"][1, 0].item() == pytest.approx(3 / 4, abs=1e-6)
    # the KL term follows the same aggregation: k3 per token (0 | log 2 -> 1 − log 2 on row 1's token)
    ref = torch.zeros(2, 4)
    ref[1, 0] = math.log(2)
    for how, kl in [("sequence_mean", (0 + (1 - math.log(2))) / 2), ("batch_token_mean", (1 - math.log(2)) / 4)]:
        out = grpo_loss(GRPOConfig(ratio_level="token", beta=0.04, token_aggregation=how),
                        ScoredBatch(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), 2, mask, ref_logp=ref))
        assert out.loss.item() == pytest.approx(0.04 * kl, rel=1e-6)
        assert out.metrics["kl_ref"] == pytest.approx(kl, rel=1e-6)
    opts = GRPOConfig()
    opts.token_aggregation = "batch_token_mean"  # changed after the section's checks, which refuse it
    with pytest.raises(ValueError, match="token ratios"):
        grpo_loss(opts, ScoredBatch(torch.zeros(2), torch.zeros(2), adv, 2))


def test_wd1_arithmetic_by_hand():
    # Group 1: G = 2, A = (a, −a) with a = 0.5. softmax(ψA) = (σ(2a), σ(−2a)), so
    # w⁻_1 − w⁺_1 = σ(−1) − σ(1) = −tanh(0.5) = −0.4621172 and w⁻_2 − w⁺_2 = +0.4621172;
    # with ℓ = (−2, −3) the group's term is −0.4621172·(−2) + 0.4621172·(−3) = −0.4621172.
    # Group 2 ties (A = 0): w⁺ = w⁻ = ½, its term is 0 whatever ℓ. Loss: the mean, −0.2310586.
    logp = torch.tensor([-2.0, -3.0, -1.0, -7.0], requires_grad=True)
    adv = torch.tensor([0.5, -0.5, 0.0, 0.0])
    out = wd1_loss(WD1Config(), ScoredBatch(logp, torch.zeros(4), adv, 2))
    assert out.loss.item() == pytest.approx(-0.5 * math.tanh(0.5), rel=1e-6)
    out.loss.backward()
    t = math.tanh(0.5) / 2  # ∂loss/∂ℓ = (w⁻ − w⁺) / number of groups
    assert logp.grad.tolist() == pytest.approx([-t, t, 0.0, 0.0], rel=1e-6, abs=1e-7)
    # ψ = 2 doubles the argument of tanh; no old policy enters the loss, only the diagnostics.
    two = wd1_loss(WD1Config(psi=2.0), ScoredBatch(logp.detach(), torch.full((4,), -50.0), adv, 2))
    assert two.loss.item() == pytest.approx(-0.5 * math.tanh(1.0), rel=1e-6)
    assert two.metrics["ratio_max"] > 1e10  # log ρ = ℓ + 50, reported


def test_spg_loss_arithmetic_by_hand():
    # Group 1: A = (1, −1), lengths (2, 6): shares (1/4, 3/4). ℓ̃_1 = ELBO_1 = −2 (A > 0);
    # ℓ̃_2 = 0.5·EUBO_2 + 0.5·ELBO_2 = 0.5·(−1) + 0.5·(−3) = −2 (A ≤ 0). Term:
    # −(1/4·1·(−2) + 3/4·(−1)·(−2)) = −(−0.5 + 1.5) = −1. Group 2: A = (0, 0), term 0.
    # Loss: the mean over groups, −0.5. Gradient: ∂/∂ELBO_1 = −(1/4)(1)/2 = −0.125,
    # ∂/∂ELBO_2 = −(3/4)(−1)(0.5)/2 = 0.1875, ∂/∂EUBO_2 = 0.1875, ∂/∂EUBO_1 = 0; group 2's
    # ELBO and EUBO: A = 0 is "A ≤ 0", so each gets −(1/2)(0)(...) = 0.
    elbo = torch.tensor([-2.0, -3.0, -1.0, -1.0], requires_grad=True)
    eubo_ = torch.tensor([-9.0, -1.0, -1.0, -1.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6, [1] * 6, [1] * 6]).bool()
    out = spg_loss(SPGConfig(), ScoredBatch(elbo, torch.zeros(4), adv, 2, mask, eubo=eubo_))
    assert out.loss.item() == pytest.approx(-0.5, abs=1e-7)
    out.loss.backward()
    assert elbo.grad.tolist() == pytest.approx([-0.125, 0.1875, 0.0, 0.0], abs=1e-7)
    assert eubo_.grad.tolist() == pytest.approx([0.0, 0.1875, 0.0, 0.0], abs=1e-7)
    # the sandwich itself, and ω = 1 (pure EUBO where A ≤ 0)
    sandwich = spg_likelihood(elbo.detach(), eubo_.detach(), adv, omega=1.0)
    assert sandwich.tolist() == [-2.0, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="omega"):
        spg_likelihood(elbo, eubo_, adv, omega=1.5)


def test_stabledrl_on_spg_weights_come_from_the_elbo_and_the_gradient_from_the_sandwich():
    # The authors' StableDRL: stabledrl_loss with ℓ̃ in the gradient and the ELBO in the
    # weights. One group of 2, ELBO log-ratios (log 2, 0): weights (2/3, 1/3); A = (1, −1);
    # ℓ̃ = (ELBO_1, 0.5·EUBO_2 + 0.5·ELBO_2) = (−1, −2): loss = −(2/3·(−1) − 1/3·(−2)) = 0.
    elbo, old = torch.tensor([-1.0, -3.0]), torch.tensor([-1.0 - math.log(2), -3.0])
    eubo_ = torch.tensor([5.0, -1.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    # through the registry, as the loop calls it (`likelihood: spg`, ω = 0.5)
    out = objective_for(StableDRLConfig(likelihood="spg"))(ScoredBatch(elbo, old, adv, 2, eubo=eubo_))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    assert out.metrics["ess"] == pytest.approx(1 / (4 / 9 + 1 / 9), rel=1e-6)
    out.loss.backward()  # only EUBO_2 (A ≤ 0) reaches the gradient: −w_2·A_2·0.5 = 1/6
    assert eubo_.grad.tolist() == pytest.approx([0.0, 1 / 6], abs=1e-7)
