import hashlib
from fractions import Fraction

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.countdown import all_solutions, parse_expression, solve

P = Problem("3,5,7=22", "3*5+7", {"numbers": (3, 5, 7), "target": 22})
Q = Problem("2,3,12=8", "12/3*2", {"numbers": (2, 3, 12), "target": 8})


@pytest.mark.parametrize("text, problem, expected", [
    # right: 3*5+7 = 22, every number once, in any order and bracketing
    ("3*5+7", P, 1.0),
    ("7+5*3", P, 1.0),
    (" (5*3) + 7 ", P, 1.0),
    ("12/3*2", Q, 1.0),          # 4*2 = 8
    ("2/3*12", Q, 1.0),          # exact: 2/3 * 12 = 8, no float rounding
    ("12/(3/2)", Q, 1.0),        # 12 / 1.5 = 8
    # wrong but well-formed: 0.1
    ("3*5-7", P, 0.1),           # 8, not 22
    ("3*7+5", P, 0.1),           # 26
    ("3*5+7+0", P, 0.1),         # an unknown number (0)
    ("3*5+7*1", P, 0.1),         # value 22 but uses an extra number
    ("5*5-3", P, 0.1),           # 5 reused, 7 unused
    ("22", P, 0.1),              # the target alone
    ("3*5", P, 0.1),             # a number missing
    ("12/(3-3)*2", Q, 0.1),      # division by zero
    ("999999*5+7", P, 0.1),      # large literal
    # not an expression: 0
    ("", P, 0.0),
    ("   ", P, 0.0),
    ("3*5+", P, 0.0),
    ("-3+5*7", P, 0.0),          # unary minus is not allowed
    ("3**5+7", P, 0.0),
    ("(3*5+7", P, 0.0),
    ("3*5+7)", P, 0.0),
    ("3*5+7=22", P, 0.0),
    ("3,5,7", P, 0.0),
    ("__import__('os').system('ls')", P, 0.0),
    ("3*5+7; print(1)", P, 0.0),
    ("3 * 5 + 7", P, 1.0),
    ("3*5+2 2", P, 0.0),         # not 3*5+22 - 15
    ("1234567*5+7", P, 0.0),     # literal over 6 digits
    ("(" * 40 + "3" + ")" * 40, P, 0.0),  # over 64 characters
    ("(" * 30 + "3*5+7" + ")" * 29, P, 0.0),  # deep and unbalanced
    ("3٣*5+7", P, 0.0),          # a non-ASCII digit
    ("1e3", P, 0.0),
    ("3.0*5+7", P, 0.0),
    ("03*5+7", P, 0.0),          # leading zero
    (None, P, 0.0),              # not a string at all
])
def test_reward_table(text, problem, expected):
    task = get_task("countdown")
    assert task.reward([text], [problem]) == [expected]
    assert task.is_correct(text, problem) == (expected == 1.0)


def test_parser_is_exact_and_respects_precedence():
    assert parse_expression("1/3+1/3+1/3") == (Fraction(1), [1, 3, 1, 3, 1, 3])
    assert parse_expression("2+3*4")[0] == 14
    assert parse_expression("(2+3)*4")[0] == 20
    assert parse_expression("8/4/2")[0] == 1   # left associative
    assert parse_expression("8-4-2")[0] == 2
    assert parse_expression("5/(2-2)")[0] is None
    assert parse_expression(" 12 * ( 3 + 4 ) ") == (Fraction(84), [12, 3, 4])
    with pytest.raises(ValueError):
        parse_expression("2 3")  # whitespace never joins digits into 23


@pytest.mark.parametrize("text, reason", [
    ("  ", "empty expression"),
    ("1+" * 32 + "1", "expression longer than 64 characters"),       # 65 characters
    ("-3+5", "expected a number at token 0, got '-'"),               # no unary minus
    ("2**3", "expected a number at token 2, got '*'"),
    ("(1+2", "expected ')' at token 4"),                             # tokens ( 1 + 2, then nothing
    ("1234567+1", "number literal too long"),                        # 7 digits > 6
    ("03+4", "leading zero in '03'"),
    ("2 3", "unexpected '3' at token 1"),
    ("(1))", "unexpected ')' at token 3"),
])
def test_parser_rejects_with_a_reason(text, reason):
    with pytest.raises(ValueError) as err:
        parse_expression(text)
    assert str(err.value) == reason


def test_canonical_solutions_are_correct_for_every_three_number_problem():
    task = get_task("countdown")
    pairs = 0
    for numbers in task._multisets("train")[:300] + task._multisets("test"):
        for target, text in solve(numbers).items():
            value, literals = parse_expression(text)
            assert value == target and sorted(literals) == sorted(numbers), (numbers, target, text)
            assert len(text) + 1 <= task.completion_length
            pairs += 1
    assert pairs > 3000


def test_known_solution_counts():
    # 1,1,1 reaches 1 (1*1*1), 2 (1+1*1), 3 (1+1+1); nothing else in [1, 100].
    assert sorted(solve((1, 1, 1))) == [1, 2, 3]
    # 2,3,4: 2*3*4 = 24 is the largest; (2+3)*4 = 20 needs parentheses, 4*5 cannot be avoided.
    assert max(solve((2, 3, 4))) == 24
    assert solve((2, 3, 4))[20] == "(2+3)*4"


def test_generation_is_reproducible_and_the_splits_are_disjoint():
    task = get_task("countdown")
    a = task.generate(300, split="train", seed=1)
    assert a == task.generate(300, split="train", seed=1)
    assert a != task.generate(300, split="train", seed=2)
    test = task.generate(300, split="test", seed=1)
    assert len({p.prompt for p in a}) == 300  # distinct within a call
    assert not {p.meta["numbers"] for p in a} & {p.meta["numbers"] for p in test}
    assert task.reward([p.answer for p in a + test], a + test) == [1.0] * 600
    for p in a:
        assert p.prompt == ",".join(map(str, p.meta["numbers"])) + f"={p.meta['target']}"


def test_the_validation_split_is_disjoint_from_train_and_test_by_multiset():
    task = get_task("countdown")
    sets = {s: set(task._multisets(s)) for s in ("train", "validation", "test")}
    # Every multiset of numbers 1..20 (C(22, 3) = 1540 of them) is in exactly one split.
    assert sum(map(len, sets.values())) == len(set().union(*sets.values())) == 1540
    assert 0.05 < len(sets["validation"]) / 1540 < 0.15
    # The test split is the one of a task without a validation split: unchanged by it.
    assert set(get_task("countdown", validation_fraction=0.0)._multisets("test")) == sets["test"]
    with pytest.raises(ValueError, match="validation split of countdown is empty: set validation_fraction"):
        get_task("countdown", validation_fraction=0.0).generate(1, split="validation")
    drawn = {s: task.generate(300, split=s, seed=0) for s in sets}
    for s, problems in drawn.items():
        assert {p.meta["numbers"] for p in problems} <= sets[s]
        assert task.reward([p.answer for p in problems], problems) == [1.0] * 300


def test_random_answers_are_every_solution_drawn_afresh():
    task = get_task("countdown", answers="random")
    a, b = task.generate(400, seed=0), task.generate(400, seed=1)
    assert task.reward([p.answer for p in a], a) == [1.0] * 400
    # 3,5,7=22: 3·5 + 7 is the only way (by hand), written in each order of its operands, once each
    assert all_solutions((3, 5, 7))[22] == ("3*5+7", "5*3+7", "7+3*5", "7+5*3")
    # Most answers differ from the canonical one; a problem drawn again may get another.
    assert sum(p.answer != solve(p.meta["numbers"])[p.meta["target"]] for p in a) > 200
    first = {p.prompt: p.answer for p in a}
    assert any(first[p.prompt] != p.answer for p in b if p.prompt in first)
    # The answers have their own random stream: the same problems as in canonical mode, in order.
    canonical = get_task("countdown").generate(400, seed=0)
    assert [p.prompt for p in a] == [p.prompt for p in canonical]


def test_a_canonical_share_mixes_the_two_modes():
    def canonical_count(problems):
        return sum(p.answer == solve(p.meta["numbers"])[p.meta["target"]] for p in problems)

    plain = get_task("countdown", answers="random").generate(400, seed=0)
    half = get_task("countdown", answers="random", canonical_share=0.5).generate(400, seed=0)
    every = get_task("countdown", answers="random", canonical_share=1.0).generate(400, seed=0)
    assert [p.prompt for p in half] == [p.prompt for p in plain]  # the same problems
    assert get_task("countdown").reward([p.answer for p in half], half) == [1.0] * 400
    assert canonical_count(every) == 400
    # Half the draws keep the canonical answer and the rest are random (which is canonical
    # 145 times in 400 here): about 200 + 145 / 2; these draws give 272.
    assert canonical_count(plain) == 145 and 240 < canonical_count(half) < 310
    # Plain random mode draws nothing for the share: its answers are those it drew before
    # the option existed (sha256 of seed 0's 400 answers, computed on the earlier code).
    digest = hashlib.sha256("|".join(p.answer for p in plain).encode()).hexdigest()
    assert digest.startswith("7df02b4b7a526e50")
    with pytest.raises(ValueError, match="canonical_share"):
        get_task("countdown", answers="random", canonical_share=1.5)
    with pytest.raises(ValueError, match="canonical_share"):
        get_task("countdown", canonical_share=0.5)  # canonical answers: nothing to mix


def test_four_numbers():
    task = get_task("countdown", num_numbers=4)
    problems = task.generate(20, split="test", seed=0)
    assert all(len(p.meta["numbers"]) == 4 for p in problems)
    assert task.reward([p.answer for p in problems], problems) == [1.0] * 20
    assert max(len(p.answer) for p in problems) < task.completion_length
    assert task.completion_length == 16  # "(20-19)*(18-17)" + EOS


def test_bad_options_and_inputs():
    with pytest.raises(ValueError, match="num_numbers"):
        get_task("countdown", num_numbers=5)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("chess")
    task = get_task("countdown")
    with pytest.raises(ValueError, match="split"):
        task.generate(3, split="dev")
    with pytest.raises(ValueError, match="answers"):
        get_task("countdown", answers="all")
    with pytest.raises(ValueError, match="completions"):
        task.reward(["1"], [])


def test_a_written_prompt_becomes_the_problem_it_states():
    task = get_task("countdown")
    p = task.problem_from_prompt("3,5,7=22")
    assert p.prompt == "3,5,7=22" and sorted(p.meta["numbers"]) == [3, 5, 7] and p.meta["target"] == 22
    assert task.score("3*5+7", p) == 1.0 and task.score("(7-5)*3", p) == 0.1  # README's sample: 6, not 22
    generated = task.generate(3, split="test")[0]
    assert task.problem_from_prompt(generated.prompt).meta == generated.meta
    for bad in ("3,5,7", "3,5,x=22", "=22", "hello"):
        with pytest.raises(ValueError, match="not a countdown prompt"):
            task.problem_from_prompt(bad)
