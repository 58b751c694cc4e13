import json
import logging

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.code import build_program, extract_code

HUMANEVAL = [
    {"task_id": "HumanEval/0", "entry_point": "add",
     "prompt": 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """Return a + b.\n    >>> add(2, 3)\n    5\n    """\n',
     "canonical_solution": "    return a + b\n",
     "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"},
    {"task_id": "HumanEval/1", "entry_point": "total",
     "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n',
     "canonical_solution": "    return sum(xs)\n",
     "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"},
    {"task_id": "HumanEval/2", "entry_point": "shout",
     "prompt": 'def shout(s: str) -> str:\n    """Upper-case s and add "!"."""\n',
     "canonical_solution": "    return s.upper() + '!'\n",
     "test": "def check(candidate):\n    assert candidate('hé') == 'HÉ!'\n"},
]
MBPP = [
    {"task_id": 11, "text": "Write a function to remove the first and last occurrence of a given character from the string.",
     "code": "def remove_Occ(s, ch):\n    i = s.find(ch)\n    if i >= 0:\n        s = s[:i] + s[i + 1:]\n    j = s.rfind(ch)\n    if j >= 0:\n        s = s[:j] + s[j + 1:]\n    return s",
     "test_list": ['assert remove_Occ("hello","l") == "heo"', 'assert remove_Occ("abcda","a") == "bcd"'],
     "test_setup_code": ""},
    {"task_id": 12, "text": "Write a function to find the square of the greatest common divisor.",
     "code": "def gcd_sq(a, b):\n    return math.gcd(a, b) ** 2",
     "test_list": ["assert gcd_sq(12, 18) == 36", "assert gcd_sq(7, 5) == 1"],
     "test_setup_code": "import math"},
]

FAST = dict(timeout_s=1.5, memory_mb=256, workers=2)


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture
def humaneval(tmp_path):
    write_jsonl(tmp_path / "he-test.jsonl", HUMANEVAL)
    write_jsonl(tmp_path / "he-train.jsonl", HUMANEVAL[:2])
    return get_task("code", path=str(tmp_path / "he-{split}.jsonl"), cache_dir=str(tmp_path / "hf"), **FAST)


@pytest.fixture
def mbpp(tmp_path):
    write_jsonl(tmp_path / "mbpp.jsonl", MBPP)
    return get_task("code", path=str(tmp_path / "mbpp.jsonl"), cache_dir=str(tmp_path / "hf"), **FAST)


def add_problem(task):
    return next(p for p in task.generate(3, split="test") if p.meta["entry_point"] == "add")


def test_canonical_solutions_pass(humaneval, mbpp):
    for task in (humaneval, mbpp):
        problems = task.generate(2, split="test", seed=0)
        assert task.reward([p.answer for p in problems], problems) == [1.0, 1.0]
        assert task.last_reasons == ["ok", "ok"]


def test_schema_detection_and_prompts(humaneval, mbpp):
    p = add_problem(humaneval)
    assert p.meta["schema"] == "humaneval" and p.prompt == HUMANEVAL[0]["prompt"]
    q = next(q for q in mbpp.generate(2, split="train") if q.meta["task_id"] == 12)
    assert q.meta["schema"] == "mbpp" and q.meta["setup"] == "import math"
    assert q.prompt == MBPP[1]["text"] + "\nYour code should pass these tests:\n" + "\n".join(MBPP[1]["test_list"]) + "\n"


@pytest.mark.parametrize("completion, expected", [
    ("    return a + b\n", 1.0),                                   # continues the prompt
    ("def add(a, b):\n    return b + a\n", 1.0),                   # a whole function replaces the stub
    ("Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.", 1.0),
    ("```\n    return a + b\n```", 1.0),                            # fenced continuation
    ("```python\ndef add(a, b):\n    return a + b\n", 1.0),        # unclosed fence: the rest is code
    ("def add(a, b):\n    résultat = a + b\n    return résultat\n", 1.0),  # unicode identifiers
    ("    return a - b\n", 0.0),                                   # wrong
    ("def add(a, b):\n    return a * b\n", 0.0),
    ("return a + b", 0.0),                                          # not indented: syntax error
    ("    return a +\n", 0.0),
    ("", 0.0),
    ("```python\n```", 0.0),
    (None, 0.0),
    (42, 0.0),
    ("#" * 100_000, 0.0),                                           # 100k characters of comment: stub returns None
    ("    return a + b\n" + "# pad\n" * 20_000, 1.0),              # long but correct
    ("    return '\ud800'\n", 0.0),                                # a lone surrogate
])
def test_reward_table(humaneval, completion, expected):
    p = add_problem(humaneval)
    assert humaneval.reward([completion], [p]) == [expected]


@pytest.mark.parametrize("body", ["    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n",
                                  "    raise SystemExit\n", "    raise SystemExit(0)\n"])
def test_exiting_with_status_0_from_inside_the_function_is_not_a_pass(humaneval, body):
    # check() calls the function, which exits 0 before any assert fails: exit status alone
    # would call that a pass; the token printed after the tests does not appear.
    p = add_problem(humaneval)
    assert humaneval.score_with_reason(body, p) == (0.0, "early exit")


def test_mbpp_table(mbpp):
    p = next(q for q in mbpp.generate(2, split="test") if q.meta["task_id"] == 12)
    good = "def gcd_sq(a, b):\n    return math.gcd(a, b) ** 2\n"
    assert mbpp.reward([good, "def gcd_sq(a, b):\n    return a * b\n", "```python\n" + good + "```"], [p] * 3) == [1.0, 0.0, 1.0]
    assert mbpp.last_reasons == ["ok", "assertion failed", "ok"]


HOSTILE = [
    ("    while True:\n        pass\n", "timeout"),
    ("    x = bytearray(8 * 2**30)\n    return a + b\n", "memory"),
    ("    import os\n    while True:\n        os.fork()\n", "process limit"),
    ("    open('/tmp/stabledrl-code-escape', 'w').write('x')\n    return a + b\n", "write refused"),
    ("    import socket\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    return a + b\n", "network refused"),
    ("    print('x' * 10**8)\n", "output cap"),
    ("    return (a + b\n", "syntax error"),
]


def test_hostile_programs_score_zero_and_the_next_one_still_scores_one(humaneval, caplog):
    p = add_problem(humaneval)
    completions = []
    for bad, _ in HOSTILE:
        completions += [bad, "    return a + b\n"]
    with caplog.at_level(logging.INFO, logger="stabledrl.tasks.code"):
        rewards = humaneval.reward(completions, [p] * len(completions))
    assert rewards == [0.0, 1.0] * len(HOSTILE)
    assert humaneval.last_reasons == [r for _, reason in HOSTILE for r in (reason, "ok")]
    logged = [rec.getMessage() for rec in caplog.records]
    for _, reason in HOSTILE:
        assert f"code HumanEval/0: reward 0 ({reason})" in logged
    assert {rec.levelname for rec in caplog.records if "(syntax error)" in rec.getMessage()} == {"INFO"}
    assert {rec.levelname for rec in caplog.records if "(network refused)" in rec.getMessage()} == {"WARNING"}


def test_score_with_reason(humaneval):
    p = add_problem(humaneval)
    assert humaneval.score_with_reason("    return a + b\n", p) == (1.0, "ok")
    assert humaneval.score_with_reason("    return 0\n", p) == (0.0, "assertion failed")
    assert humaneval.score_with_reason(None, p) == (0.0, "not a string")
    assert humaneval.is_correct("    return a + b\n", p) and not humaneval.is_correct("", p)


def test_extract_code_and_build_program():
    assert extract_code("text\n```python\nx = 1\n```\nmore ```y```") == "x = 1\n"
    assert extract_code("no fences") == "no fences"
    meta = {"schema": "mbpp", "setup": "import math", "tests": ["assert f() == 1"]}
    assert build_program("def f():\n    return 1", meta) == "import math\ndef f():\n    return 1\n\nassert f() == 1\n"
    he = {"schema": "humaneval", "prompt_code": "def f():\n", "test": "def check(c):\n    assert c() == 1", "entry_point": "f"}
    assert build_program("    return 1\n", he) == "def f():\n    return 1\n\n\ndef check(c):\n    assert c() == 1\n\ncheck(f)\n"
    assert build_program("def f():\n    return 1\n", he).startswith("def f():\n\ndef f():\n    return 1\n")


def test_generation_is_reproducible_and_draws_without_replacement(humaneval):
    a = humaneval.generate(3, split="test", seed=1)
    assert a == humaneval.generate(3, split="test", seed=1)
    assert len({p.meta["task_id"] for p in a}) == 3
    assert {p.meta["task_id"] for p in humaneval.generate(2, split="train", seed=0)} == {"HumanEval/0", "HumanEval/1"}
    with pytest.raises(ValueError, match="asked for 4 problems"):
        humaneval.generate(4, split="test")


def test_options_and_schema_errors(tmp_path):
    with pytest.raises(ValueError, match="path="):
        get_task("code")
    write_jsonl(tmp_path / "odd.jsonl", [{"question": "?", "answer": "#### 1"}])
    task = get_task("code", path=str(tmp_path / "odd.jsonl"), cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="cannot tell the schema"):
        task.generate(1)
    with pytest.raises(ValueError, match="schema"):
        get_task("code", path="x.jsonl", schema="apps")
    with pytest.raises(ValueError, match="completions"):
        task.reward(["x"], [])


def test_prompt_length(humaneval):
    assert humaneval.prompt_length == max(len(r["prompt"]) for r in HUMANEVAL)


def test_problem_built_by_hand():
    task = get_task("code", path="unused.jsonl", **FAST)
    p = Problem("", "", {"schema": "mbpp", "setup": "", "tests": ["assert double(4) == 8"], "task_id": "hand"})
    assert task.reward(["def double(x):\n    return 2 * x", "def double(x):\n    return x"], [p, p]) == [1.0, 0.0]


def test_is_correct_runs_the_program_afresh(humaneval, monkeypatch):
    # No verdict of an earlier batch is kept (evaluation scores each completion once through
    # `scores` instead, tests/test_evaluate.py): is_correct runs the program every time.
    import stabledrl.tasks.code as code_module

    p = add_problem(humaneval)
    assert humaneval.reward(["    return a + b\n", "    return 0\n"], [p, p]) == [1.0, 0.0]
    calls = []
    monkeypatch.setattr(code_module, "run_python", lambda *a, **k: calls.append(a) or code_module.SandboxResult(
        False, 1, "nonzero exit", "", "", 0.0))
    assert not humaneval.is_correct("    return a + b\n", p)  # the stub's verdict, not the batch's
    assert len(calls) == 1
