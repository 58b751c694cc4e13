"""One scoring path for every task: `reward` and `is_correct` read `score`, whose guard
turns a non-string or a judge that raises into reward 0, incorrect (tasks/base.py)."""

import json
import logging

import pytest

import stabledrl.tasks.code as code_module
import stabledrl.tasks.gsm8k as gsm8k_module
from stabledrl.tasks import Problem, Score, get_task, score_all

SOLUTION = "1234341221434321"
PUZZLE = "1.3..4.2.1.3432."
HE_ADD = {"task_id": "HumanEval/0", "entry_point": "add", "prompt": "def add(a, b):\n",
          "canonical_solution": "    return a + b\n",
          "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def countdown(tmp_path):
    p = Problem("3,5,7=22", "3*5+7", {"numbers": (3, 5, 7), "target": 22})
    # (completion, reward, correct): right; well-formed but 6; does not parse; not a string
    return get_task("countdown"), p, [("3*5+7", 1.0, True), ("(7-5)*3", 0.1, False), ("3+", 0.0, False),
                                      (None, 0.0, False)]


def sudoku(tmp_path):
    p = Problem(PUZZLE, SOLUTION, {"puzzle": PUZZLE, "solution": SOLUTION})
    # every empty cell right but trailing text: reward 1, yet not the grid exactly (incorrect)
    return get_task("sudoku"), p, [(SOLUTION, 1.0, True), (SOLUTION + "999", 1.0, False), ("1" * 16, 2 / 7, False),
                                   (42, 0.0, False)]


def gsm8k(tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    task = get_task("gsm8k", path=str(tmp_path / "g.jsonl"), cache_dir=str(tmp_path / "hf"))
    return task, Problem("q", "#### 72", {"target": "72"}), [("so #### 72", 1.0, True), ("#### 71", 0.0, False),
                                                              (b"#### 72", 0.0, False)]


def math(tmp_path):
    write_jsonl(tmp_path / "m.jsonl", [{"problem": "1/2?", "solution": "\\boxed{\\frac{1}{2}}"}])
    task = get_task("math", path=str(tmp_path / "m.jsonl"), cache_dir=str(tmp_path / "hf"), verify_timeout_s=1)
    return task, Problem("q", "s", {"gold": "\\frac{1}{2}"}), [("\\boxed{0.5}", 1.0, True), ("\\boxed{7}", 0.0, False),
                                                               (None, 0.0, False)]


def code(tmp_path):
    write_jsonl(tmp_path / "he.jsonl", [HE_ADD])
    task = get_task("code", path=str(tmp_path / "he.jsonl"), cache_dir=str(tmp_path / "hf"), timeout_s=2,
                    memory_mb=256)
    return task, task.generate(1, split="test")[0], [("    return a + b\n", 1.0, True), ("    return 0\n", 0.0, False),
                                                     ("", 0.0, False), (None, 0.0, False)]


@pytest.mark.parametrize("make", [countdown, sudoku, gsm8k, math, code])
def test_reward_and_is_correct_agree_with_score(make, tmp_path):
    task, p, table = make(tmp_path)
    try:
        completions = [c for c, _, _ in table]
        scores = [task.score(c, p) for c in completions]
        assert [(float(s), s.correct) for s in scores] == [(pytest.approx(r), ok) for _, r, ok in table]
        rewards = task.reward(completions, [p] * len(table))
        assert rewards == [float(s) for s in scores] and {type(r) for r in rewards} == {float}  # plain floats
        assert [task.is_correct(c, p) for c in completions] == [s.correct for s in scores]
        batch = score_all(task, completions, [p] * len(table))  # what evaluation reads
        assert [(float(s), s.correct, s.reason) for s in batch] == [(float(s), s.correct, s.reason) for s in scores]
        assert scores[-1].reason == "not a string"
    finally:
        getattr(task, "close", lambda: None)()


def test_a_judge_that_raises_scores_zero_and_is_logged(tmp_path, monkeypatch, caplog):
    task, p, _ = gsm8k(tmp_path)

    def boom(text):
        raise RuntimeError("boom")

    monkeypatch.setattr(gsm8k_module, "extract_number", boom)
    with caplog.at_level(logging.ERROR, logger="stabledrl.tasks.gsm8k"):
        assert task.reward(["#### 72"], [p]) == [0.0]
        assert task.is_correct("#### 72", p) is False
        s = task.score("#### 72", p)
    assert (float(s), s.correct, s.reason) == (0.0, False, "scorer error")
    errors = [r for r in caplog.records if r.name == "stabledrl.tasks.gsm8k"]
    assert len(errors) == 3 and all(r.exc_info and r.exc_info[0] is RuntimeError for r in errors)


def test_a_problem_the_judge_cannot_read_scores_zero():
    # A hand-built problem without its solution: the judge's KeyError, caught once in score.
    task = get_task("sudoku")
    p = Problem(PUZZLE, SOLUTION, {"puzzle": PUZZLE})
    assert task.reward([SOLUTION], [p]) == [0.0] and not task.is_correct(SOLUTION, p)


def test_a_code_task_whose_sandbox_call_raises_scores_zero_with_a_reason(tmp_path, monkeypatch, caplog):
    task, p, _ = code(tmp_path)

    def boom(*args, **kwargs):
        raise TypeError("no")

    monkeypatch.setattr(code_module, "run_python", boom)
    with caplog.at_level(logging.INFO, logger=code_module.__name__):
        assert task.reward(["    return a + b\n", ""], [p, p]) == [0.0, 0.0]
    assert task.last_reasons == ["scorer error", "empty program"]
    # the error is logged once, with its traceback; the empty program once, as a reason
    assert [(r.levelname, r.exc_info is not None) for r in caplog.records] == [("ERROR", True), ("INFO", False)]
    assert task.score_with_reason("    return a + b\n", p) == (0.0, "scorer error")


def test_score_defaults_and_lengths():
    # correct defaults to reward == 1.0, reason to "ok" / "wrong"
    assert (Score(1.0).correct, Score(1.0).reason) == (True, "ok")
    assert (Score(0.1).correct, Score(0.1).reason) == (False, "wrong")
    assert Score(1.0, correct=False) == 1.0 and f"{Score(0.25):.3g}" == "0.25"
    with pytest.raises(ValueError, match="2 completions for 1 problems"):
        get_task("countdown").reward(["1", "2"], [Problem("1,2,3=6", "1+2+3", {"numbers": (1, 2, 3), "target": 6})])


def test_score_all_reads_a_bare_protocol_task_through_its_own_reward_and_is_correct():
    class Bare:  # the protocol only: reward and is_correct, no score
        def reward(self, completions, problems):
            return [0.5 for _ in completions]

        def is_correct(self, completion, problem):
            return completion == "yes"

    p = Problem("q", "a")
    assert [(float(s), s.correct) for s in score_all(Bare(), ["yes", "no"], [p, p])] == [(0.5, True), (0.5, False)]
