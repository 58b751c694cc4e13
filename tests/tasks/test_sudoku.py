import itertools

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.sudoku import all_grids, count_solutions

SOLUTION = "1234341221434321"
PUZZLE = "1.3..4.2.1.3432."  # 7 empty cells: 1, 3, 4, 6, 8, 10, 15 (solution 2,4,3,1,2,4,1)
P = Problem(PUZZLE, SOLUTION, {"puzzle": PUZZLE, "solution": SOLUTION})


def _valid(g: str) -> bool:
    rows = [g[4 * r: 4 * r + 4] for r in range(4)]
    cols = ["".join(g[4 * r + c] for r in range(4)) for c in range(4)]
    boxes = ["".join(g[4 * (br + r) + bc + c] for r in range(2) for c in range(2)) for br in (0, 2) for bc in (0, 2)]
    return all(sorted(u) == list("1234") for u in rows + cols + boxes)


def test_all_grids_by_brute_force():
    # An independent enumeration: every assignment of the first two rows' permutations...
    # simpler: filter all 4^16 is too many, so filter all products of row permutations.
    rows = ["".join(p) for p in itertools.permutations("1234")]
    brute = {"".join(c) for c in itertools.product(rows, repeat=4) if _valid("".join(c))}
    assert set(all_grids()) == brute and len(brute) == 288
    assert _valid(SOLUTION)


def test_count_solutions():
    assert count_solutions("." * 16) == 288
    assert count_solutions(SOLUTION) == 1
    assert count_solutions("11" + "." * 14) == 0
    assert count_solutions(PUZZLE) == 1
    with pytest.raises(ValueError):
        count_solutions("12345")


@pytest.mark.parametrize("text, expected", [
    (SOLUTION, 1.0),
    (SOLUTION + "999", 1.0),              # characters past the 16th are ignored by the reward
    ("1" * 16, 2 / 7),                    # right only where the solution has 1: cells 6 and 15
    ("", 0.0),
    ("garbage", 0.0),
    (SOLUTION[:8], None),                 # half the grid: only the empty cells in it count
    ("x" * 100000, 0.0),
])
def test_reward_table(text, expected):
    task = get_task("sudoku")
    empty = [i for i, c in enumerate(PUZZLE) if c == "."]
    if expected is None:
        expected = sum(1 for i in empty if i < 8) / len(empty)
    assert task.reward([text], [P]) == [pytest.approx(expected)]


def test_reward_counts_only_empty_cells():
    task = get_task("sudoku")
    empty = [i for i, c in enumerate(PUZZLE) if c == "."]
    wrong_one = list(SOLUTION)
    wrong_one[empty[0]] = "4" if SOLUTION[empty[0]] != "4" else "3"
    assert task.reward(["".join(wrong_one)], [P]) == [pytest.approx((len(empty) - 1) / len(empty))]
    given = [i for i, c in enumerate(PUZZLE) if c != "."][0]
    wrong_given = list(SOLUTION)
    wrong_given[given] = "4" if SOLUTION[given] != "4" else "3"
    assert task.reward(["".join(wrong_given)], [P]) == [1.0]  # a given cell does not count ...
    assert not task.is_correct("".join(wrong_given), P)  # ... but accuracy wants the whole grid
    assert task.is_correct(SOLUTION, P) and task.reward([None], [P]) == [0.0]


def test_generated_puzzles_are_unique_reproducible_and_split():
    task = get_task("sudoku")
    train = task.generate(200, split="train", seed=0)
    assert train == task.generate(200, split="train", seed=0)
    test = task.generate(200, split="test", seed=0)
    validation = task.generate(200, split="validation", seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert not {p.prompt for p in validation} & ({p.prompt for p in train} | {p.prompt for p in test})
    for p in train + test:
        assert count_solutions(p.prompt) == 1
        assert task.min_empty <= p.prompt.count(".") <= task.max_empty
        assert all(a == b for a, b in zip(p.prompt, p.answer) if a != ".")
        assert _valid(p.answer)
    assert task.reward([p.answer for p in test], test) == [1.0] * 200


def test_a_written_prompt_becomes_the_problem_it_states():
    task = get_task("sudoku")
    generated = task.generate(3, split="test")[0]
    p = task.problem_from_prompt(generated.prompt)
    assert p.meta == generated.meta and task.score(generated.answer, p) == 1.0
    for bad in ("1234", "1234........12x4", "................"):  # short, a bad cell, many solutions
        with pytest.raises(ValueError, match="not a sudoku prompt|solutions"):
            task.problem_from_prompt(bad)
