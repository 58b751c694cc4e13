import json
import threading
import time

import psutil
import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.math import MathVerifier, extract_answer

# Rows in the MATH schema (the gold answer is the solution's last box) ...
MATH = [
    {"problem": "What is $\\frac{3}{6}$ in lowest terms?", "solution": "Divide by 3: $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.",
     "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Simplify $\\sqrt{12}$.", "solution": "$\\sqrt{12} = \\sqrt{4 \\cdot 3} = \\boxed{2\\sqrt{3}}$.",
     "level": "Level 2", "type": "Algebra"},
    {"problem": "Solve $x^2 = 9$ for $x > 0$.", "solution": "Taking roots, $x = \\boxed{3}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Find the interval where $x^2 < 1$.", "solution": "It is $\\boxed{(-1, 1)}$.", "level": "Level 3", "type": "Algebra"},
]
# ... and in the MATH-500 schema (an "answer" column, which wins over the solution's box).
MATH500 = [
    {"problem": "Compute $1+1$.", "solution": "We get $\\boxed{2}$.", "answer": "2", "subject": "Prealgebra", "level": 1,
     "unique_id": "test/prealgebra/1.json"},
    {"problem": "What is $\\pi$ to the nearest tenth?", "solution": "No box here.", "answer": "3.1", "subject": "Geometry",
     "level": 2, "unique_id": "test/geometry/2.json"},
]

HALF = Problem("q", "s", {"gold": "\\frac{1}{2}"})
ROOT = Problem("q", "s", {"gold": "2\\sqrt{3}"})
INTERVAL = Problem("q", "s", {"gold": "(-1, 1)"})


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("math")
    write_jsonl(d / "math-train.jsonl", MATH)
    write_jsonl(d / "math-test.jsonl", MATH500)
    t = get_task("math", path=str(d / "math-{split}.jsonl"), cache_dir=str(d / "hf"), timeout_s=5, verify_timeout_s=1)
    yield t
    t.close()


@pytest.mark.parametrize("completion, problem, expected", [
    # equivalent answers
    ("so the answer is \\boxed{\\frac{1}{2}}", HALF, 1.0),
    ("\\boxed{0.5}", HALF, 1.0),
    ("\\boxed{\\dfrac12}", HALF, 1.0),
    ("\\boxed{2/4}", HALF, 1.0),
    ("\\boxed{\\boxed{\\frac{1}{2}}}", HALF, 1.0),          # nested boxes
    ("we get $\\frac{1}{2}$", HALF, 1.0),                   # no box: the last $...$
    ("first $3$ then $\\frac{1}{2}$", HALF, 1.0),
    ("Reasoning...\n1/2\n", HALF, 1.0),                      # no box, no $: the last line
    ("\\boxed{\\sqrt{12}}", ROOT, 1.0),
    ("\\boxed{2 \\sqrt 3}", ROOT, 1.0),
    ("\\boxed{(-1,1)}", INTERVAL, 1.0),
    ("x " * 50_000 + "\\boxed{1/2}", HALF, 1.0),            # 100k characters of preamble
    # not equivalent
    ("\\boxed{\\frac{1}{3}}", HALF, 0.0),
    ("\\boxed{1/2} at first, but \\boxed{2}", HALF, 0.0),   # the last box counts
    ("\\boxed{3}", ROOT, 0.0),
    ("\\boxed{[-1,1]}", INTERVAL, 0.0),                      # closed is not open
    ("\\boxed{\\text{one half}}", HALF, 0.0),
    ("\\boxed{x}", HALF, 0.0),
    # hostile or empty
    ("", HALF, 0.0),
    ("  \n\n ", HALF, 0.0),
    ("\\boxed{}", HALF, 0.0),
    ("\\boxed{" * 1000, HALF, 0.0),
    ("}" * 1000 + "{", HALF, 0.0),
    ("\\boxed{" + "1+" * 600 + "1}", HALF, 0.0),            # over max_answer_chars: not parsed
    ("\\boxed{\\frac{\\frac{\\frac{\\frac{1}{2}}{3}}{4}}{5}}", HALF, 0.0),
    ("\\boxed{\u00bd}", HALF, 0.0),                          # the vulgar-fraction sign is not parsed
    ("\\boxed{\ud800}", HALF, 0.0),                          # a lone surrogate
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", HALF, 0.0),
    (None, HALF, 0.0),
    (0.5, HALF, 0.0),                                        # not a string
])
def test_reward_table(task, completion, problem, expected):
    assert task.reward([completion], [problem]) == [expected]


def test_problems_come_from_the_rows(task):
    problems = task.generate(4, split="train", seed=0)
    assert sorted(p.meta["gold"] for p in problems) == sorted(["\\frac{1}{2}", "2\\sqrt{3}", "3", "(-1, 1)"])
    for p in problems:
        row = MATH[p.meta["index"]]
        assert p.answer == row["solution"] and p.prompt.startswith(row["problem"] + "\n")
        assert (p.meta["level"], p.meta["type"]) == (row["level"], row["type"])
        assert "\\boxed{}" in p.prompt  # the template's doubled braces
    assert task.reward([p.answer for p in problems], problems) == [1.0] * 4


def test_the_answer_column_wins(task):
    problems = task.generate(2, split="test", seed=0)
    assert sorted(p.meta["gold"] for p in problems) == ["2", "3.1"]
    assert task.reward(["\\boxed{3.1}", "\\boxed{3.1}"], problems) == [1.0 if p.meta["gold"] == "3.1" else 0.0 for p in problems]


def test_generation_is_reproducible_and_bounded(task):
    assert task.generate(3, seed=5) == task.generate(3, seed=5)
    with pytest.raises(ValueError, match="asked for 5 problems"):
        task.generate(5, split="train")


def test_extract_answer():
    assert extract_answer("a \\boxed{1} b \\boxed{2} c") == "2"
    assert extract_answer("$a$ and $$b$$") == "b"
    assert extract_answer("no math\nlast line  \n\n") == "last line"
    assert extract_answer("") is None


def test_works_off_the_main_thread(task):
    # math-verify's SIGALRM timeouts cannot run off the main thread; its worker's main thread can.
    out = []
    t = threading.Thread(target=lambda: out.append(task.reward(["\\boxed{0.5}", "\\boxed{7}"], [HALF, HALF])))
    t.start()
    t.join(30)
    assert out == [[1.0, 0.0]]


def test_a_hanging_comparison_times_out_and_the_next_answer_still_scores():
    # 9^(9^9) has ~370 million digits: math-verify's own 1 s alarm gives up on it.
    v = MathVerifier(timeout_s=10, verify_timeout_s=1)
    try:
        t0 = time.perf_counter()
        assert not v.equivalent("1", "9^{9^{9}}")
        assert time.perf_counter() - t0 < 5
        assert v.equivalent("\\frac{1}{2}", "0.5") and v.restarts == 0
    finally:
        v.close()


def test_a_worker_past_the_wall_time_is_killed_and_replaced():
    # Inner timeout 5 s, outer 0.5 s: the outer limit fires first and kills the worker.
    v = MathVerifier(timeout_s=0.5, verify_timeout_s=5)
    try:
        assert v.equivalent("1", "1.0")  # starts the worker
        first = v._proc.pid
        t0 = time.perf_counter()
        assert not v.equivalent("1", "9^{9^{9}}")
        assert time.perf_counter() - t0 < 2
        assert v.restarts == 1 and not psutil.pid_exists(first)
        assert v.equivalent("2\\sqrt{3}", "\\sqrt{12}")  # a fresh worker
    finally:
        v.close()


def test_close_stops_the_worker(tmp_path):
    write_jsonl(tmp_path / "m.jsonl", MATH)
    t = get_task("math", path=str(tmp_path / "m.jsonl"), cache_dir=str(tmp_path / "hf"))
    p = t.generate(1)[0]
    assert t.reward([p.answer], [p]) == [1.0]
    pid = t.verifier._proc.pid
    assert psutil.pid_exists(pid)
    t.close()
    assert not psutil.pid_exists(pid)


def test_bad_options():
    with pytest.raises(ValueError, match="path="):
        get_task("math")
    with pytest.raises(ValueError, match="verify_timeout_s"):
        get_task("math", path="x.jsonl", verify_timeout_s=0)


def test_is_correct_judges_afresh(task, monkeypatch):
    # No verdict of an earlier batch is kept (evaluation scores each completion once through
    # `score` instead, tests/test_evaluate.py): is_correct asks the verifier every time.
    assert task.reward(["\\boxed{0.5}", "\\boxed{7}"], [HALF, HALF]) == [1.0, 0.0]
    calls = []
    monkeypatch.setattr(task.verifier, "equivalent", lambda g, p: calls.append(p) or False)
    assert not task.is_correct("\\boxed{0.5}", HALF) and calls == ["0.5"]


def test_the_authors_filter_keeps_short_low_level_training_problems_only(tmp_path):
    # max_problem_chars: shorter than N characters; max_problem_words: at most N words (split on spaces)
    rows = [{"problem": p, "solution": "\\boxed{1}", "level": level} for p, level in (
        ("one two", "Level 4"),               # 7 characters, 2 words: kept
        ("one two three four", "Level 1"),    # 18 characters, 4 words: too many words (> 3)
        ("x" * 20, "Level 2"),                # 20 characters: not under 20
        ("abc def ghi", "Level ?"),           # 11 characters, 3 words; an unreadable level counts as 5
        ("uvw xyz", "Level 2"),               # kept
    )]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", rows)
    t = get_task("math", path=str(tmp_path / "{split}.jsonl"), cache_dir=str(tmp_path / "hf"),
                 max_problem_chars=20, max_problem_words=3)
    train = {p.prompt.split("\n")[0] for p in t.generate(3, split="train")}
    assert train == {"one two", "abc def ghi", "uvw xyz"}
    with pytest.raises(ValueError, match="has 3 rows"):  # only the kept ones are drawn
        t.generate(4, split="train")
    assert len(t.generate(5, split="test")) == 5  # the test split is never filtered
    t.close()
    t = get_task("math", path=str(tmp_path / "{split}.jsonl"), cache_dir=str(tmp_path / "hf"),
                 max_problem_chars=20, max_problem_words=3, max_level=4)  # "Level ?" reads as 5: out
    assert {p.prompt.split("\n")[0] for p in t.generate(2, split="train")} == {"one two", "uvw xyz"}
    t.close()
    with pytest.raises(ValueError, match="max_problem_words must be a positive whole number"):
        get_task("math", path=str(tmp_path / "{split}.jsonl"), max_problem_words=0)
