import itertools
import math
from fractions import Fraction

import pytest
import torch

import stabledrl.evaluate as evaluate_mod
from stabledrl.evaluate import EvalShare, evaluate, pass_at_k
from stabledrl.sampling import SamplingConfig
from stabledrl.tasks import get_task
from tests.conftest import make_tiny_policy


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_do_not_depend_on_the_micro_batch_or_the_split(temperature):
    # Problem i draws from its own generator (seed, i): micro-batches of 1, 3 or all 9
    # decode the same completions, and so does a process that evaluates problems 4..8
    # and passes EvalShare(first_index=4) (the split of a multi-process evaluation).
    policy = make_tiny_policy(seed=5)
    task = get_task("countdown")
    problems = task.generate(9, split="test", seed=0)
    sampling = SamplingConfig(temperature=temperature)
    texts = lambda res: [s["completion"] for s in res.samples]  # noqa: E731
    whole = texts(evaluate(policy, task, problems, sampling, progress=False))
    assert len(set(whole)) > 1
    for mb in (1, 3):
        assert texts(evaluate(policy, task, problems, SamplingConfig(temperature=temperature, micro_batch=mb),
                              progress=False)) == whole
    share = EvalShare(first_index=4)
    assert texts(evaluate(policy, task, problems[4:], sampling, share=share, progress=False)) == whole[4:]
    if temperature > 0:
        assert texts(evaluate(policy, task, problems, sampling, seed=1, progress=False)) != whole


def _sampler_calls(monkeypatch) -> list:
    """The request of every `generate_micro_batched` call `evaluate` makes."""
    seen = []
    real = evaluate_mod.generate_micro_batched

    def spy(request, **kw):
        seen.append(request)
        return real(request, **kw)

    monkeypatch.setattr(evaluate_mod, "generate_micro_batched", spy)
    return seen


def test_the_micro_batch_comes_from_the_sampling_settings_then_256(monkeypatch):
    seen = _sampler_calls(monkeypatch)
    policy, task = make_tiny_policy(seed=5), get_task("countdown")
    problems = task.generate(3, split="test", seed=0)
    evaluate(policy, task, problems, SamplingConfig(micro_batch=1), progress=False)
    evaluate(policy, task, problems, SamplingConfig(micro_batch=2), progress=False)
    evaluate(policy, task, problems, SamplingConfig(), progress=False)
    assert [request.micro_batch for request in seen] == [1, 2, 256]


def test_sort_by_length_reaches_the_sampler(monkeypatch):
    seen = _sampler_calls(monkeypatch)
    policy, task = make_tiny_policy(seed=5), get_task("countdown")
    problems = task.generate(3, split="test", seed=0)
    for sort in (True, False):
        evaluate(policy, task, problems, SamplingConfig(micro_batch=2, sort_by_length=sort), progress=False)
    assert [request.sampling.sort_by_length for request in seen] == [True, False]


def test_each_completion_is_scored_once_and_the_figures_are_the_tasks():
    # One `score` per completion gives both its reward and its correctness (no second pass
    # for is_correct); the figures are those reward and is_correct give.
    from stabledrl.tasks.countdown import Countdown

    class Counting(Countdown):
        calls = 0

        def judge(self, completion, problem):
            Counting.calls += 1
            return super().judge(completion, problem)

    policy, task = make_tiny_policy(seed=5), Counting()
    problems = task.generate(6, split="test", seed=0)
    res = evaluate(policy, task, problems, SamplingConfig(temperature=1.0), progress=False)
    assert Counting.calls == 6
    texts = [s["completion"] for s in res.samples]
    rewards = task.reward(texts, problems)
    correct = [task.is_correct(t, p) for t, p in zip(texts, problems)]
    assert [s["reward"] for s in res.samples] == rewards and [s["correct"] for s in res.samples] == correct
    assert res.mean_reward == sum(rewards) / 6 and res.accuracy == sum(correct) / 6


def test_a_task_written_to_the_bare_protocol_is_evaluated_by_its_own_reward_and_is_correct():
    class Bare:  # reward and is_correct only (no `score`): the README's minimal task
        def __init__(self):
            self.inner = get_task("countdown")
            self.completion_length = self.inner.completion_length

        def reward(self, completions, problems):
            return [0.5] * len(completions)

        def is_correct(self, completion, problem):
            return True

    task = Bare()
    problems = task.inner.generate(3, split="test", seed=0)
    res = evaluate(make_tiny_policy(seed=5), task, problems, progress=False)
    assert (res.mean_reward, res.accuracy) == (0.5, 1.0)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_answer():
    # Enumeration: for each problem, the fraction of the C(n, k) ways to pick k of its n
    # samples that hold at least one right one, averaged over problems.
    correct = torch.tensor([[1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1],
                            [0, 0, 1, 0, 0, 0], [0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    n = correct.shape[1]
    for k in range(1, n + 1):
        shares = [Fraction(sum(bool(row[list(c)].any()) for c in itertools.combinations(range(n), k)), math.comb(n, k))
                  for row in correct]
        assert pass_at_k(correct, k) == pytest.approx(float(sum(shares) / len(shares)), rel=1e-12)
    # pass@1 is the mean; pass@n is "any of the n"; by hand for k = 2: problem 0 misses with
    # C(4,2)/C(6,2) = 6/15, problem 3 with C(5,2)/C(6,2) = 10/15, problem 4 with 3/15.
    assert pass_at_k(correct, 1) == pytest.approx(12 / 30, rel=1e-12)
    assert pass_at_k(correct, n) == pytest.approx(4 / 5, rel=1e-12)
    assert pass_at_k(correct, 2) == pytest.approx((9 / 15 + 0 + 1 + 5 / 15 + 12 / 15) / 5, rel=1e-12)
    with pytest.raises(ValueError, match="pass@7"):
        pass_at_k(correct, 7)
