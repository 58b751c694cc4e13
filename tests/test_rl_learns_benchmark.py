"""benchmarks/rl_learns.py: the training-reward summaries, the validation curves' best step and
the first step's p(PAD), against hand arithmetic and the sampler."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from stabledrl.data import encode_policy_prompts
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks import get_task
from tests.conftest import ScriptedPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from rl_learns import (  # noqa: E402
    curves_table, eval_curves, greedy_overlap, pad_at_first_step, rollout_ends, summarise_gaps)


def test_summarise_gaps_on_a_line_and_on_hand_arithmetic():
    # gap = 0.001 * step exactly: slope 0.1 per 100 steps, no residual.
    line = summarise_gaps({s: 0.001 * s for s in (1, 11, 21, 31, 41, 51)})
    assert line["slope_per_100_steps"] == pytest.approx(0.1, abs=1e-12)
    assert line["slope_per_100_steps_se"] == pytest.approx(0.0, abs=1e-12)
    assert line["gap_first_sixth"] == pytest.approx(0.001)  # 6 steps: a sixth is one step
    assert line["gap_last_sixth"] == pytest.approx(0.051)
    assert line["gap_second_half"] == pytest.approx((0.031 + 0.041 + 0.051) / 3)
    # steps 0, 1, 2, 3 with gaps 0, 1, 1, 2 (the keys are sorted first):
    # x̄ = 1.5, ȳ = 1, Σ(x−x̄)(y−ȳ) = (−1.5)(−1) + (−0.5)(0) + (0.5)(0) + (1.5)(1) = 3,
    # Σ(x−x̄)² = 5 -> slope 0.6; residuals −0.1, 0.3, −0.3, 0.1 -> Σ r² = 0.2,
    # SE² = 0.2 / (4 − 2) / 5 = 0.02. Second half: 1 and 2 -> mean 1.5, SE = std / √2 = 0.5.
    hand = summarise_gaps({3: 2.0, 0: 0.0, 2: 1.0, 1: 1.0})
    assert hand["slope_per_100_steps"] == pytest.approx(60.0)
    assert hand["slope_per_100_steps_se"] == pytest.approx(100 * 0.02**0.5)
    assert hand["gap_second_half"] == pytest.approx(1.5)
    assert hand["gap_second_half_se"] == pytest.approx(0.5)


def test_pad_at_the_first_step_is_the_softmax_of_the_samplers_first_call():
    """A scripted policy prefers PAD by a logit margin c at slot 2 and another token elsewhere:
    p(PAD) there is e^c / (e^c + V − 1), 1 / V at the other slots; the input is the one the
    sampler's first call gets (the whole completion masked)."""
    problems = get_task("countdown").generate(2, split="test", seed=0)
    L, c = 4, 3.0
    probe = ScriptedPolicy([0] * L, [0.0] * L, prompt_len=0)
    width = encode_policy_prompts(probe, [p.prompt for p in problems])[0].size(1)
    pad, other = probe.pad_token_id, probe.tokenizer.convert_tokens_to_ids("1")
    policy = ScriptedPolicy([other, other, pad, other], [0.0, 0.0, c, 0.0], prompt_len=width)
    V = len(policy.tokenizer)
    got = pad_at_first_step(policy, problems, L)
    want = [1 / V, 1 / V, math.exp(c) / (math.exp(c) + V - 1), 1 / V]
    assert got == pytest.approx(want, rel=1e-5)
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    generate(policy, ids, mask, SamplingConfig(gen_length=L))
    assert torch.equal(policy.calls[0], policy.calls[1])  # calls[1]: the sampler's first


def _write_metrics(run: Path, rows: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _run(tmp_path, name: str, evals: dict[int, float]) -> Path:
    """A run directory whose metrics.jsonl has training rows and the evaluation rows `evals`."""
    rows = []
    for step, acc in evals.items():
        rows.append({"step": step, "eval_accuracy": acc, "eval_reward": 0.5, "collapse": False})
        rows.append({"step": step + 1, "reward_mean": 0.9, "entropy": 0.3,  # a training row: no eval_accuracy
                     "zero_variance_fraction": 0.5})
    return _write_metrics(tmp_path / name, rows)


def test_eval_curves_take_the_step_with_the_best_mean_and_the_earliest_on_a_tie(tmp_path):
    # means by hand: step 0 (0.40 + 0.40) / 2 = 0.40, step 50 (0.50 + 0.44) / 2 = 0.47,
    # step 100 (0.48 + 0.52) / 2 = 0.50: the best; each run alone would pick another step.
    a, b = _run(tmp_path, "a", {0: 0.40, 50: 0.50, 100: 0.48}), _run(tmp_path, "b", {0: 0.40, 50: 0.44, 100: 0.52})
    res = eval_curves([a, b])
    assert res["steps"] == [0, 50, 100]
    assert res["mean"] == {0: pytest.approx(0.40), 50: pytest.approx(0.47), 100: pytest.approx(0.50)}
    assert res["best_step"] == 100
    assert res["runs"][str(a)] == {0: 0.40, 50: 0.50, 100: 0.48}
    table = curves_table(res).splitlines()
    assert table[0] == "| run | step 0 | step 50 | step 100 |"
    assert table[2] == f"| {a} | 40.0% | 50.0% | 48.0% |"
    assert table[-1] == "| mean | 40.0% | 47.0% | **50.0%** |"
    # equal means at steps 50 and 100: the shorter run is chosen
    c, d = _run(tmp_path, "c", {0: 0.4, 50: 0.5, 100: 0.5}), _run(tmp_path, "d", {0: 0.4, 50: 0.5, 100: 0.5})
    assert eval_curves([c, d])["best_step"] == 50


def test_eval_curves_refuse_runs_evaluated_at_different_steps(tmp_path):
    a, b = _run(tmp_path, "a", {0: 0.4, 50: 0.5}), _run(tmp_path, "b", {0: 0.4, 25: 0.5})
    with pytest.raises(SystemExit, match="evaluated at steps \\[0, 25\\]"):
        eval_curves([a, b])


def test_rollout_ends_average_the_first_and_last_training_rows(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.4}]  # an evaluation alone: not a rollout
    for step, (ent, zv, rew) in enumerate([(0.8, 0.5, 0.1), (0.6, 0.3, 0.3), (0.4, 0.7, 0.5), (0.2, 0.9, 0.9)], 1):
        rows.append({"step": step, "entropy": ent, "zero_variance_fraction": zv, "reward_mean": rew})
    ends = rollout_ends(_write_metrics(tmp_path / "r", rows), k=2)
    # by hand: entropy (0.8 + 0.6) / 2 = 0.7 and (0.4 + 0.2) / 2 = 0.3; ties 0.4 and 0.8; reward 0.2 and 0.7
    assert ends["entropy"] == [pytest.approx(0.7), pytest.approx(0.3)]
    assert ends["zero_variance_fraction"] == [pytest.approx(0.4), pytest.approx(0.8)]
    assert ends["reward_mean"] == [pytest.approx(0.2), pytest.approx(0.7)]


def test_greedy_overlap_counts_the_gains_and_losses_against_the_reference():
    # five problems: (start, trained, reference)
    #   0: wrong, right, right  -> gained, the reference has it
    #   1: wrong, right, wrong  -> gained, new
    #   2: right, wrong, right  -> lost, the reference has it
    #   3: right, right, wrong  -> kept
    #   4: wrong, wrong, right  -> neither
    start = [False, False, True, True, False]
    trained = [True, True, False, True, False]
    reference = [True, False, True, False, True]
    assert greedy_overlap(start, trained, reference) == {
        "problems": 5, "start_right": 2, "trained_right": 3, "reference_right": 3, "gained": 2,
        "gained_reference_right": 1, "lost": 1, "lost_reference_right": 1, "start_wrong": 3,
        "start_wrong_reference_right": 2, "trained_right_reference_wrong": 2}
    with pytest.raises(ValueError, match="per problem"):
        greedy_overlap(start, trained, reference[:4])
