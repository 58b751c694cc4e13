"""The path estimator against the sampler's own log-probabilities, recorded while it decoded."""

import pytest
import torch

from stabledrl.data import encode_prompts
from stabledrl.likelihood import Completions, backward_views, estimate, plan_views, score_views
from stabledrl.sampling import SamplingConfig, generate
from tests.conftest import make_tiny_policy

PROMPTS = ("3,5,7=22", "12,4,6=9", "1=1", "20,2=10")


class EosLeaning:
    """The policy with its EOS logit raised, so that random rollouts end early (and the
    masked PAD after an EOS is exercised)."""

    def __init__(self, policy, bias: float = 1.0):
        self.policy, self.bias = policy, bias

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def logits(self, input_ids, attention_mask=None, position_ids=None, **kw):
        out = self.policy.logits(input_ids, attention_mask, position_ids, **kw).clone()
        out[..., self.policy.eos_token_id] += self.bias
        return out


class RecordingPolicy:
    """The policy, with every model call's input and (cloned) log-softmax kept: what the
    sampler saw when it committed each token."""

    def __init__(self, policy):
        self.policy = policy
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def logits(self, input_ids, attention_mask=None, position_ids=None, **kw):
        out = self.policy.logits(input_ids, attention_mask, position_ids, **kw)
        self.calls.append((input_ids.clone(), out.float().log_softmax(-1).clone()))
        return out


def sampler_path_logprob(policy, prompt, L, seed, record_logprob=False, **gen_kw):
    """One rollout of one prompt; Σ over its scored slots of log p(y_i) in the model call
    where the sampler committed slot i (the last call whose input still had it masked).
    Also whether an EOS turned an already committed slot into PAD (the approximation)."""
    rec = RecordingPolicy(policy)
    ids, mask = encode_prompts(policy.tokenizer, [prompt])
    P = ids.size(1)
    out = generate(rec, ids, mask, SamplingConfig(gen_length=L, temperature=1.0, kv_cache=False, **gen_kw),
                   generator=torch.Generator().manual_seed(seed), record_logprob=record_logprob)
    comp, scored, step = out.completion_ids[0], out.completion_mask[0], out.unmask_step[0]
    total = 0.0
    for i in scored.nonzero().flatten().tolist():
        calls = [c for c, (x, _) in enumerate(rec.calls) if x.size(1) > P + i and x[0, P + i] == policy.mask_token_id]
        total += float(rec.calls[calls[-1]][1][0, P + i, comp[i]])
    eos_step = int(step[int(scored.sum()) - 1])  # the last scored slot is the EOS, if there is one
    approximated = bool(((~scored) & (step < eos_step)).any())
    return out, ids, mask, total, approximated


@pytest.mark.parametrize("kind,gen_kw", [("full", {}), ("full", {"block_length": 4}), ("block", {})])
def test_path_equals_the_samplers_own_log_probabilities(kind, gen_kw):
    L = 7
    policy = EosLeaning(make_tiny_policy(seed=5, **({"attention_kind": "block", "block_size": 3}
                                                     if kind == "block" else {})))
    checked = ended = 0
    for seed in range(24):
        prompt = PROMPTS[seed % len(PROMPTS)]
        out, ids, mask, want, approximated = sampler_path_logprob(policy, prompt, L, seed, **gen_kw)
        if approximated:
            continue
        with torch.no_grad():
            got = estimate(policy, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                               prompt_mask=mask, unmask_step=out.unmask_step), method="path")
        assert float(got.sequence[0]) == pytest.approx(want, rel=1e-5, abs=1e-5)  # float32 sums up to ≈ 22
        checked += 1
        ended += int(out.completion_mask.sum()) < L
    assert checked >= 6 and ended >= 3  # enough rollouts without the approximation, some ending early


def test_path_of_a_batch_equals_its_rows_and_counts_one_view_per_step():
    policy = make_tiny_policy(seed=6, attention_kind="block", block_size=3)
    ids, mask = encode_prompts(policy.tokenizer, list(PROMPTS))  # left-padded
    out = generate(policy, ids, mask, SamplingConfig(gen_length=8, temperature=1.0),
                   generator=[torch.Generator().manual_seed(s) for s in range(len(PROMPTS))])
    with torch.no_grad():
        whole = estimate(policy, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                             prompt_mask=mask, unmask_step=out.unmask_step), method="path")
        for b in range(len(PROMPTS)):
            one = estimate(policy, Completions(out.completion_mask[b : b + 1], prompt_ids=ids[b : b + 1],
                                               completion_ids=out.completion_ids[b : b + 1],
                                               prompt_mask=mask[b : b + 1], unmask_step=out.unmask_step[b : b + 1]),
                           method="path")
            assert torch.allclose(whole.token[b], one.token[0], atol=1e-5)
    plan = plan_views("path", Completions(out.completion_mask, unmask_step=out.unmask_step), block_size=3)
    # Every scored slot counts exactly once, with weight 1, and is masked in its own view.
    counted = torch.zeros(out.completion_ids.shape, dtype=torch.float64)
    counted.index_add_(0, plan.seq_index, plan.weight * plan.masked)
    assert torch.equal(counted, out.completion_mask.double())
    # A block model's views are the steps within a block: at most the block size per row.
    assert torch.bincount(plan.seq_index).max() <= 3


def test_path_gradient_matches_backward_views():
    policy = make_tiny_policy(seed=7)
    ids, mask = encode_prompts(policy.tokenizer, list(PROMPTS))
    out = generate(policy, ids, mask, SamplingConfig(gen_length=6, temperature=1.0),
                   generator=[torch.Generator().manual_seed(s) for s in range(len(PROMPTS))])
    plan = plan_views("path", Completions(out.completion_mask, unmask_step=out.unmask_step))
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    params = list(policy.model.parameters())
    policy.model.zero_grad()
    (g * score_views(policy, plan, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                               prompt_mask=mask)).sequence).sum().backward()
    want = [p.grad.clone() for p in params]
    policy.model.zero_grad()
    backward_views(policy, plan, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                             prompt_mask=mask), g, max_views_per_forward=3)
    for p, w in zip(params, want):
        assert torch.allclose(p.grad, w, atol=1e-5)


def test_path_needs_the_unmask_order_and_refuses_samples():
    c_mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="unmask_step"):
        plan_views("path", Completions(c_mask))
    with pytest.raises(ValueError, match="only it takes"):
        plan_views("mc", Completions(c_mask, unmask_step=torch.zeros(1, 4, dtype=torch.long)),
                   generator=torch.Generator())
    with pytest.raises(ValueError, match="num_samples"):
        plan_views("path", Completions(c_mask, unmask_step=torch.zeros(1, 4, dtype=torch.long)), num_samples=2)
    with pytest.raises(ValueError, match="never committed"):
        plan_views("path", Completions(c_mask, unmask_step=torch.tensor([[0, 1, -1, 2]])))
