"""4x4 Sudoku with a unique solution.

Prompt  ``"1.3..4.2...13..4"``: the 16 cells row by row, '.' for an empty cell.
Answer  ``"1234342121434312"``: the 16 digits of the solved grid.

Rows, columns and the four 2x2 boxes each hold 1-4 once. Puzzles are made by removing
cells of a random solved grid while the solution stays unique. The split is by puzzle
text (a stable hash), so no test puzzle appears in training.

Reward (docs/methods.md, "Rewards"): the fraction of the originally empty cells whose
digit in the completion equals the solution's; characters beyond the 16th are ignored,
a missing or non-digit character counts as wrong. Never raises. `is_correct` (accuracy)
asks more: the completion is exactly the solved grid.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stabledrl.tasks.base import Problem, Score, ScoredTask, Split, check_split, register_task, split_of

__all__ = ["Sudoku", "count_solutions", "all_grids"]

_UNITS = (
    [[4 * r + c for c in range(4)] for r in range(4)]
    + [[4 * r + c for r in range(4)] for c in range(4)]
    + [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
)


@lru_cache(maxsize=1)
def all_grids() -> tuple[str, ...]:
    """Every solved 4x4 grid (there are 288)."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    grids = []
    for combo in itertools.product(rows, repeat=4):
        g = "".join(combo)
        if all(len({g[i] for i in u}) == 4 for u in _UNITS):
            grids.append(g)
    return tuple(grids)


@lru_cache(maxsize=1)
def _grid_array() -> np.ndarray:
    return np.array([[int(c) for c in g] for g in all_grids()], dtype=np.int8)  # (288, 16)


def count_solutions(puzzle: str) -> int:
    """Number of solved grids that agree with every given digit of `puzzle` ('.' = empty)."""
    if len(puzzle) != 16 or any(c not in "1234." for c in puzzle):
        raise ValueError(f"a puzzle is 16 characters of 1-4 and '.', got {puzzle!r}")
    given = np.array([c != "." for c in puzzle])  # (16,)
    digits = np.array([int(c) if c != "." else 0 for c in puzzle], dtype=np.int8)  # (16,)
    grids = _grid_array()
    return int((grids[:, given] == digits[given]).all(axis=1).sum())


@dataclass
class Sudoku(ScoredTask):
    """4x4 Sudoku; each puzzle has between `min_empty` and `max_empty` empty cells."""

    min_empty: int = 4
    max_empty: int = 10
    test_fraction: float = 0.1
    validation_fraction: float = 0.1
    """Share of the puzzles held out for choosing settings (carved out of train)."""
    name: str = "sudoku"
    prompt_length: int = 16
    completion_length: int = 17  # 16 digits + EOS

    def __post_init__(self) -> None:
        # A 4x4 puzzle with a unique solution keeps at least 4 givens.
        if not 1 <= self.min_empty <= self.max_empty <= 12:
            raise ValueError(
                f"need 1 <= min_empty <= max_empty <= 12, got {self.min_empty}, {self.max_empty}"
            )
        if not (0 < self.test_fraction < 1 and 0 <= self.validation_fraction < 1 - self.test_fraction):
            raise ValueError("need 0 < test_fraction < 1 and 0 <= validation_fraction < 1 - test_fraction, got "
                             f"{self.test_fraction}, {self.validation_fraction}")

    def _make(self, rng: random.Random) -> tuple[str, str] | None:
        solution = rng.choice(all_grids())
        want = rng.randint(self.min_empty, self.max_empty)
        cells = list(solution)
        order = list(range(16))
        rng.shuffle(order)
        empty = 0
        for i in order:
            if empty == want:
                break
            keep = cells[i]
            cells[i] = "."
            if count_solutions("".join(cells)) == 1:
                empty += 1
            else:
                cells[i] = keep
        if empty < self.min_empty:
            return None
        return "".join(cells), solution

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """`n` distinct puzzles of `split`, reproducible from `seed`."""
        check_split(split)
        rng = random.Random(f"sudoku-{split}-{seed}")
        seen: set[str] = set()
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise ValueError(f"the {split} split has too few distinct puzzles for n={n}")
            made = self._make(rng)
            if made is None:
                continue
            puzzle, solution = made
            if puzzle in seen or split_of(puzzle, self.test_fraction, self.validation_fraction) != split:
                continue
            seen.add(puzzle)
            problems.append(Problem(puzzle, solution, {"puzzle": puzzle, "solution": solution}))
        return problems

    def problem_from_prompt(self, prompt: str) -> Problem:
        """The puzzle a prompt states, with its solution (to score completions of a prompt
        written by hand); a ValueError if it is not a puzzle with one solution."""
        puzzle = prompt.strip()
        if len(puzzle) != 16 or any(c not in "1234." for c in puzzle):
            raise ValueError(f"{prompt!r} is not a sudoku prompt (16 cells of 1-4 or '.', row by row)")
        fits = [g for g in all_grids() if all(c in (".", d) for c, d in zip(puzzle, g))]
        if len(fits) != 1:
            raise ValueError(f"sudoku prompt {prompt!r} has {len(fits)} solutions, not one")
        return Problem(puzzle, fits[0], {"puzzle": puzzle, "solution": fits[0]})

    def judge(self, completion: str, problem: Problem) -> Score:
        """Reward: the share of the empty cells filled right; correct: the whole grid, givens
        included, exactly (the reward counts empty cells only)."""
        puzzle, solution = problem.meta["puzzle"], problem.meta["solution"]
        text = completion.strip()
        empty = [i for i, c in enumerate(puzzle) if c == "."]
        right = sum(1 for i in empty if i < len(text) and text[i] == solution[i])
        return Score(right / len(empty) if empty else 1.0, correct=text == solution)


@register_task("sudoku")
def _sudoku(**options: object) -> Sudoku:
    return Sudoku(**options)  # type: ignore[arg-type]
