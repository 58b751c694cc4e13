"""Countdown: combine the given numbers with + - * / to reach the target.

Prompt  ``"3,5,7=22"`` (the numbers in ascending order, then the target).
Answer  ``"3*5+7"``: an arithmetic expression using every given number exactly once.

Arithmetic is exact (`fractions.Fraction`); the target is an integer in [1, max_target].
The splits (train, validation, test) are by number multiset. A problem's `answer` (the SFT
target) is the canonical solution with ``answers="canonical"``, or one of all the distinct
solutions, drawn afresh, with ``answers="random"``.

Reward: 1.0 for a correct expression; 0.1 for a well-formed expression that is wrong;
0.0 for anything that does not parse. Model text is parsed by a small recursive-descent
parser, never evaluated by Python. The details (what "canonical" means, what parses):
docs/methods.md, "Tasks: Countdown and code".
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Literal

from stabledrl.tasks.base import Problem, ScoredTask, Split, check_split, register_task, split_of

__all__ = ["Countdown", "all_solutions", "parse_expression", "solve"]

MAX_EXPRESSION_CHARS = 64
MAX_LITERAL_DIGITS = 6
_TOKEN = re.compile(r"[0-9]+|\S")
_PROMPT = re.compile(r"([0-9]+(?:,[0-9]+)+)=([0-9]+)")


class _ParseError(ValueError):
    pass


def parse_expression(text: str) -> tuple[Fraction | None, list[int]]:
    """Parse an arithmetic expression of non-negative integers, + - * / and parentheses.

    Whitespace may separate tokens (it never joins digits: "2 3" is not 23).
    Returns (value, literals): value is None when the expression divides by zero.
    Raises ValueError when `text` is not such an expression.
    """
    s = text.strip()
    if not s:
        raise _ParseError("empty expression")
    if len(s) > MAX_EXPRESSION_CHARS:
        raise _ParseError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_TOKEN.findall(s))  # numbers, and every other non-space character alone
    value = parser.expr()
    if parser.pos != len(parser.tokens):
        raise _ParseError(f"unexpected {parser.tokens[parser.pos]!r} at token {parser.pos}")
    return (None if parser.zero_division else value), parser.literals


class _Parser:
    """Recursive descent over the tokens; one method per grammar rule."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.literals: list[int] = []
        self.zero_division = False

    def peek(self) -> str:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ""

    def expr(self) -> Fraction:  # expr := term (('+' | '-') term)*
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:  # term := factor (('*' | '/') factor)*
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                self.zero_division = True
                value = Fraction(0)  # keep parsing to decide well-formedness
            else:
                value = value / rhs
        return value

    def factor(self) -> Fraction:  # factor := NUMBER | '(' expr ')'
        tok = self.peek()
        if tok == "(":
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise _ParseError(f"expected ')' at token {self.pos}")
            self.pos += 1
            return value
        if not (tok and tok[0] in "0123456789"):
            raise _ParseError(f"expected a number at token {self.pos}, got {tok!r}")
        if len(tok) > MAX_LITERAL_DIGITS:
            raise _ParseError("number literal too long")
        if len(tok) > 1 and tok[0] == "0":
            raise _ParseError(f"leading zero in {tok!r}")
        self.pos += 1
        self.literals.append(int(tok))
        return Fraction(int(tok))


# --- solver -------------------------------------------------------------------------
# An item is (text, value, precedence): 3 for a number, 2 for * and /, 1 for + and -.
_Item = tuple[str, Fraction, int]


def _combine(a: _Item, b: _Item, op: str) -> _Item | None:
    (sa, va, pa), (sb, vb, pb) = a, b
    if op == "+":
        return f"{sa}+{sb}", va + vb, 1
    if op == "-":
        return f"{sa}-{sb if pb > 1 else f'({sb})'}", va - vb, 1
    left = sa if pa > 1 else f"({sa})"
    if op == "*":
        return f"{left}*{sb if pb > 1 else f'({sb})'}", va * vb, 2
    if vb == 0:
        return None
    return f"{left}/{sb if pb > 2 else f'({sb})'}", va / vb, 2


def _all_expressions(items: tuple[_Item, ...]) -> list[_Item]:
    if len(items) == 1:
        return list(items)
    out: list[_Item] = []
    for i, j in itertools.permutations(range(len(items)), 2):
        rest = tuple(x for k, x in enumerate(items) if k not in (i, j))
        for op in "+-*/":
            c = _combine(items[i], items[j], op)
            if c is not None:
                out.extend(_all_expressions(rest + (c,)))
    return out


@lru_cache(maxsize=None)
def solve(numbers: tuple[int, ...], max_target: int = 100) -> dict[int, str]:
    """Every integer target in [1, max_target] reachable from `numbers`, with one
    canonical solution each: fewest parentheses, then the lexicographically smallest text."""
    best: dict[int, str] = {}
    for text, value, _ in _all_expressions(tuple((str(n), Fraction(n), 3) for n in numbers)):
        if value.denominator != 1 or not 1 <= value <= max_target:
            continue
        t = int(value)
        key = (text.count("("), text)
        if t not in best or key < (best[t].count("("), best[t]):
            best[t] = text
    return best


@lru_cache(maxsize=4096)
def all_solutions(numbers: tuple[int, ...], max_target: int = 100) -> dict[int, tuple[str, ...]]:
    """Every integer target in [1, max_target] reachable from `numbers`, with every distinct
    solution text (sorted), each written with the fewest parentheses its tree needs."""
    found: dict[int, set[str]] = {}
    for text, value, _ in _all_expressions(tuple((str(n), Fraction(n), 3) for n in numbers)):
        if value.denominator == 1 and 1 <= value <= max_target:
            found.setdefault(int(value), set()).add(text)
    return {t: tuple(sorted(texts)) for t, texts in sorted(found.items())}


@dataclass
class Countdown(ScoredTask):
    """Countdown with `num_numbers` numbers drawn from [1, max_number]."""

    num_numbers: int = 3
    max_number: int = 20
    max_target: int = 100
    test_fraction: float = 0.1
    validation_fraction: float = 0.1
    """Share of the number multisets held out for choosing settings (carved out of train)."""
    answers: Literal["canonical", "random"] = "canonical"
    """The SFT target: the canonical solution, or a random one of all solutions per draw."""
    canonical_share: float = 0.0
    """With answers="random": the chance that a draw keeps the canonical solution instead
    (a mix of the two modes; 0 is plain random)."""
    name: str = "countdown"

    def __post_init__(self) -> None:
        if self.num_numbers not in (3, 4):
            raise ValueError(f"num_numbers must be 3 or 4, got {self.num_numbers}")
        if not 1 <= self.max_number <= 99:
            raise ValueError(f"max_number must be in [1, 99], got {self.max_number}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0 <= self.validation_fraction < 1 - self.test_fraction:
            raise ValueError(f"validation_fraction must be in [0, 1 - test_fraction), got {self.validation_fraction}")
        if self.answers not in ("canonical", "random"):
            raise ValueError(f"answers must be 'canonical' or 'random', got {self.answers!r}")
        if not 0 <= self.canonical_share <= 1:
            raise ValueError(f"canonical_share must be in [0, 1], got {self.canonical_share}")
        if self.canonical_share > 0 and self.answers != "random":
            raise ValueError("canonical_share mixes canonical into random answers: set answers='random' with it")

    @property
    def prompt_length(self) -> int:
        return len(",".join([str(self.max_number)] * self.num_numbers)) + 1 + len(str(self.max_target))

    @property
    def completion_length(self) -> int:
        # Longest canonical answer: every number two digits, three ops, two pairs of
        # parentheses for four numbers ((a-b)*(c-d)), one pair for three; plus EOS.
        digits = len(str(self.max_number)) * self.num_numbers
        longest = digits + (self.num_numbers - 1) + 2 * (self.num_numbers - 2)
        return longest + 1

    def _multisets(self, split: Split) -> list[tuple[int, ...]]:
        all_sets = itertools.combinations_with_replacement(range(1, self.max_number + 1), self.num_numbers)
        return [m for m in all_sets
                if split_of(",".join(map(str, m)), self.test_fraction, self.validation_fraction) == split]

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """`n` distinct problems of `split`, reproducible from `seed`."""
        check_split(split)
        rng = random.Random(f"countdown-{split}-{seed}")
        answer_rng = random.Random(f"countdown-answers-{split}-{seed}")  # its own stream: same problems in either mode
        pool = self._multisets(split)
        if not pool:
            raise ValueError(f"the {split} split of countdown is empty: set validation_fraction > 0 to have one")
        seen: set[tuple[tuple[int, ...], int]] = set()
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise ValueError(f"the {split} split has too few distinct problems for n={n}")
            numbers = rng.choice(pool)
            solutions = solve(numbers, self.max_target)
            if not solutions:
                continue
            target = rng.choice(sorted(solutions))
            if (numbers, target) in seen:
                continue
            seen.add((numbers, target))
            prompt = ",".join(map(str, numbers)) + f"={target}"
            answer = solutions[target]
            # The share is drawn only when set, so that plain random mode keeps its stream.
            keep = self.canonical_share > 0 and answer_rng.random() < self.canonical_share
            if self.answers == "random" and not keep:
                answer = answer_rng.choice(all_solutions(numbers, self.max_target)[target])
            problems.append(Problem(prompt, answer, {"numbers": numbers, "target": target}))
        return problems

    def problem_from_prompt(self, prompt: str) -> Problem:
        """The problem a prompt such as "3,5,7=22" states (to score completions of a prompt
        written by hand); a ValueError if it is not a Countdown prompt."""
        m = _PROMPT.fullmatch(prompt.strip())
        if m is None:
            raise ValueError(f"{prompt!r} is not a countdown prompt (numbers, '=', the target: e.g. 3,5,7=22)")
        numbers = tuple(sorted(int(x) for x in m.group(1).split(",")))
        target = int(m.group(2))
        answer = solve(numbers, self.max_target).get(target, "") if len(numbers) == self.num_numbers else ""
        return Problem(",".join(map(str, numbers)) + f"={target}", answer, {"numbers": numbers, "target": target})

    def judge(self, completion: str, problem: Problem) -> float:
        try:
            value, literals = parse_expression(completion)
        except (ValueError, RecursionError):  # does not parse
            return 0.0
        ok = (
            value is not None
            and value == problem.meta["target"]
            and sorted(literals) == sorted(problem.meta["numbers"])
        )
        return 1.0 if ok else 0.1


@register_task("countdown")
def _countdown(**options: object) -> Countdown:
    return Countdown(**options)  # type: ignore[arg-type]
