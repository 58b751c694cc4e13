import json
import math

import numpy as np
import pytest
import torch

from stabledrl.config import load_config
from stabledrl.diagnostics import CollapseMonitor, drift_from_initial, flat_grad_cosine
from stabledrl.likelihood import Completions, plan_views, score_views
from stabledrl.objectives import group_advantages, stabledrl_loss
from stabledrl.instruments import backward_measuring_agreement, first_half_loss
from stabledrl.objectives import ScoredBatch, objective_for
from stabledrl.rollouts import RolloutBatch
from stabledrl.train import TrainConfig, run_train
from tests.conftest import make_tiny_policy


def test_reward_collapse_is_flagged_on_the_windowed_mean_and_stays_flagged():
    m = CollapseMonitor(window=2, drop=0.5)
    # windows: (0.6+0.6)/2 = 0.6 best; (0.6+0.4)/2 = 0.5 >= 0.3; (0.4+0.1)/2 = 0.25 < 0.3 -> collapse
    for r, expect in [(0.6, []), (0.6, []), (0.4, []), (0.1, ["reward"]), (0.6, [])]:
        assert m.update({"reward_mean": r}) == expect
    assert m.collapsed and m.reasons == ["reward"]  # sticky: the recovery at 0.6 does not clear it


def test_held_out_collapse_compares_with_the_best_evaluation_so_far():
    m = CollapseMonitor(drop=0.5)
    assert m.update({"eval_accuracy": 0.40}) == []
    assert m.update({"eval_accuracy": 0.50}) == []
    assert m.update({"eval_accuracy": 0.26}) == []  # 0.26 >= 0.5 * 0.50
    assert m.update({"eval_accuracy": 0.24}) == ["held_out"]


def test_repeated_gradient_spikes_within_the_window_are_flagged():
    m = CollapseMonitor(window=4, spike_factor=10, spikes=2)
    for g in [1.0, 1.0, 1.0]:
        assert m.update({"reward_mean": 0.5, "grad_norm": g}) == []
    assert m.update({"reward_mean": 0.5, "grad_norm": 50.0}) == []  # one spike (> 10 x median 1)
    for _ in range(4):  # the spike leaves the 4-step window
        assert m.update({"reward_mean": 0.5, "grad_norm": 1.0}) == []
    assert m.update({"reward_mean": 0.5, "grad_norm": 20.0}) == []  # median still 1: one spike in window
    # a NaN norm of a step that ran (DeepSpeed may report none) is no spike ...
    assert m.update({"reward_mean": 0.5, "grad_norm": float("nan"), "skipped_steps": 0}) == []
    # ... a skipped step (the skip counter grew) is: the second spike in the window
    assert m.update({"reward_mean": 0.5, "grad_norm": float("nan"), "skipped_steps": 1}) == ["grad_spikes"]


def test_flat_grad_cosine_by_hand():
    a = [torch.tensor([1.0, 0.0]), None, torch.tensor([[2.0]])]
    b = [torch.tensor([1.0, 1.0]), torch.tensor([5.0]), torch.tensor([[0.0]])]
    # a = (1, 0, 0, 2), b = (1, 1, 5, 0): dot 1, |a| = sqrt 5, |b| = sqrt 27
    assert flat_grad_cosine(a, b) == pytest.approx(1 / math.sqrt(5 * 27), rel=1e-12)
    assert math.isnan(flat_grad_cosine([None], [torch.ones(2)]))


def test_gradient_agreement_equals_the_cosine_of_separately_computed_half_gradients():
    torch.manual_seed(0)
    policy = make_tiny_policy(seed=3)
    params = list(policy.model.parameters())
    G, groups, P, L = 3, 4, 5, 6
    B = G * groups
    batch = RolloutBatch(torch.randint(5, 20, (B, P)), torch.ones(B, P, dtype=torch.long),
                     torch.randint(5, 20, (B, L)), torch.ones(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.long))
    rewards = torch.tensor([1.0, 0, 0, 0.5, 1, 0, 0, 0, 1, 0.2, 0.3, 1])
    adv = group_advantages(rewards, G, "none")
    plan = plan_views("mc", Completions(batch.completion_mask), num_samples=2,
                      generator=torch.Generator().manual_seed(1))
    cfg = load_config(TrainConfig, {"group_size": G, "objective": {"name": "stabledrl"}})

    def ell(rows):  # ℓ of the given rows with a graph, from one forward of those rows only
        est = score_views(policy, plan.rows(rows.start, rows.stop),
                          Completions(batch.completion_mask[rows], prompt_ids=batch.prompt_ids[rows],
                                      completion_ids=batch.completion_ids[rows], prompt_mask=batch.prompt_mask[rows]))
        return est.sequence

    with torch.no_grad():
        old = ell(slice(0, B)) - 0.1 * torch.arange(B)  # ratios away from 1 so the weights are not uniform
    # Independent: each half's loss from its own forward, gradients by autograd.grad, cosine in numpy.
    halves = []
    for lo, hi in [(0, B // 2), (B // 2, B)]:
        loss = stabledrl_loss(cfg.objective, ScoredBatch(ell(slice(lo, hi)), old[lo:hi], adv[lo:hi], G)).loss * 0.5  # 2 of 4 groups
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        halves.append(np.concatenate([np.zeros(p.numel()) if g is None else g.double().flatten().numpy()
                                      for g, p in zip(grads, params)]))
    a, b = halves
    expected = float(a @ b / np.sqrt((a @ a) * (b @ b)))
    # The trainer's way: one forward of all rows, the first half's part, two backward passes.
    full = ell(slice(0, B))
    res = stabledrl_loss(cfg.objective, ScoredBatch(full, old, adv, G))
    part = first_half_loss(objective_for(cfg.objective), ScoredBatch(full, old, adv, G, batch.completion_mask),
                           normaliser="sequences")
    policy.model.zero_grad(set_to_none=True)
    got = backward_measuring_agreement(res.loss, part, params, lambda x, **kw: x.backward(**kw))
    assert -0.99 < expected < 0.99  # a real angle, not a degenerate case
    assert got == pytest.approx(expected, abs=1e-4)
    # and the parameters hold the whole gradient afterwards
    whole = np.concatenate([np.zeros(p.numel()) if p.grad is None else p.grad.double().flatten().numpy()
                            for p in params])
    np.testing.assert_allclose(whole, a + b, rtol=1e-4, atol=1e-6 * np.abs(a + b).max())


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_gradient_agreement_when_asked(init_model, tmp_path):
    cfg = load_config(TrainConfig, {"model": str(init_model), "output_dir": str(tmp_path / "run"),
                                    "task": {"name": "sudoku"}, "steps": 2, "prompts_per_step": 4, "group_size": 4,
                                    "lr": 1e-3, "eval_n": 4, "grad_agreement": True, "zero_variance_groups": "keep",
                                    "estimator": {"method": "mc", "num_samples": 2}})
    run_train(cfg, progress=False)
    steps = [r for r in _rows(tmp_path / "run") if "loss" in r]
    assert len(steps) == 2
    # null where a half's rewards all tie (a zero gradient has no direction); a cosine otherwise
    values = [r["grad_agreement"] for r in steps if r["grad_agreement"] is not None]
    assert values and all(-1 <= v <= 1 and v != 0 for v in values)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_a_diverging_run_is_flagged_as_collapsed(init_model, tmp_path, capsys):
    # SGD at lr 1e5: the first update wrecks the model (reward 0.10 at step 1, 0 after it);
    # once the 10-step reward window has filled and then fallen below half its best, it is a collapse.
    cfg = load_config(TrainConfig, {"model": str(init_model), "output_dir": str(tmp_path / "run"),
                                    "task": {"name": "sudoku"}, "steps": 12, "prompts_per_step": 2, "group_size": 4,
                                    "optimizer": "sgd", "lr": 1e5, "grad_clip": 1e9, "eval_n": 4,
                                    "zero_variance_groups": "keep", "estimator": {"method": "mc", "num_samples": 1}})
    summary = run_train(cfg, progress=False)
    rows = _rows(tmp_path / "run")
    # Which criterion trips first may depend on the wreck (reward, or non-finite gradients
    # counted as spikes); that one does is what the test claims.
    assert summary["collapse"] and set(summary["collapse"]) <= {"reward", "grad_spikes"}
    assert rows[-1]["collapse"] is True and rows[1]["collapse"] is False  # step 1 cannot be judged yet
    assert "looks collapsed" in capsys.readouterr().err


def test_a_quiet_run_is_not_flagged(init_model, tmp_path):
    cfg = load_config(TrainConfig, {"model": str(init_model), "output_dir": str(tmp_path / "run"),
                                    "task": {"name": "sudoku"}, "steps": 3, "prompts_per_step": 2, "group_size": 4,
                                    "lr": 1e-6, "eval_n": 4, "zero_variance_groups": "keep",
                                    "estimator": {"method": "mc", "num_samples": 1}})
    assert run_train(cfg, progress=False)["collapse"] == []
    assert all(r["collapse"] is False for r in _rows(tmp_path / "run"))


def test_drift_from_initial_by_hand():
    # gap = ℓ_old − ℓ_init = (log 2, 0): k1 = log 2 / 2 = 0.34657;
    # k3 terms (r − 1) − log r with r = e^{−gap} = (1/2, 1): (−1/2 + log 2, 0), mean (log 2 − 0.5)/2 = 0.09657
    old, ref = torch.tensor([math.log(2.0), -1.0]), torch.tensor([0.0, -1.0])
    d = drift_from_initial(old, ref)
    assert d["drift_kl"] == pytest.approx(math.log(2) / 2, abs=1e-7)
    assert d["drift_k3"] == pytest.approx((math.log(2) - 0.5) / 2, abs=1e-7)
    # per-token terms (B, L) are summed per row first: the same gaps
    d2 = drift_from_initial(torch.tensor([[math.log(2.0), 0.0], [-0.5, -0.5]]), torch.tensor([[0.0, 0.0], [-0.5, -0.5]]))
    assert d2 == pytest.approx(d, abs=1e-7)
    # one rollout's likelihood noise: gaps (−30, 0.1, 0.2) make k3 terms (e^30 − 31, e^−0.1 − 0.9,
    # e^−0.2 − 0.8) = (1.07e13, 0.0048374, 0.0187308): the mean is 3.6e12, the median 0.0187308
    d3 = drift_from_initial(torch.tensor([-30.0, 0.1, 0.2]), torch.zeros(3))
    assert d3["drift_k3"] == pytest.approx((math.exp(30) - 31 + math.exp(-0.1) - 0.9 + math.exp(-0.2) - 0.8) / 3, rel=1e-6)
    assert d3["drift_k3_median"] == pytest.approx(math.exp(-0.2) - 0.8, rel=1e-5)
