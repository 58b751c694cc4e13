"""What every task provides, and the registry that maps names to tasks.

A task is a seeded problem generator with disjoint splits plus a reward. The reward has
one signature for every task (TRL style, a plain function of text):

    reward(completions: Sequence[str], problems: Sequence[Problem]) -> list[float]

It reads text only, never raises on model output, and never evaluates it with `eval`.
A task may also offer ``problem_from_prompt(prompt) -> Problem`` (the problem a prompt
written by hand states; ValueError if none): `stabledrl sample` then shows each
completion's reward.

The built-in tasks share one scoring path (`ScoredTask`): a task writes ``judge``, the
verdict on one completion; `ScoredTask.score` wraps it in the never-raise guard (a
completion that is not a string scores 0 unread, an exception in the judge scores 0 and
is logged), and `reward` and `is_correct` both read that `Score`. `score_all` scores a
batch once for both (what evaluation needs), also for a task written to the bare protocol.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

__all__ = ["Problem", "Task", "Score", "ScoredTask", "Split", "SPLITS", "get_task", "register_task", "available_tasks",
           "split_of", "check_split", "check_lengths", "score_all"]

Split = Literal["train", "validation", "test"]
SPLITS: tuple[str, ...] = ("train", "validation", "test")


@dataclass(frozen=True)
class Problem:
    """One task instance."""

    prompt: str
    """Text the model is conditioned on."""
    answer: str
    """A reference solution (used as the SFT target; rewards do not need it to match)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Task-specific data the verifier needs (numbers and target, the puzzle, ...)."""


class Task(Protocol):
    name: str
    completion_length: int
    """Completion slots the sampler should fill (longest answer + EOS, rounded up)."""
    prompt_length: int
    """Longest prompt in characters."""

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]: ...

    def reward(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[float]: ...

    def is_correct(self, completion: str, problem: Problem) -> bool: ...


class Score(float):
    """One completion's reward (the float itself) with its verdict.

    A float, so a score is the reward it always was (``task.score(c, p) == 1.0``, sums,
    formatting); `ScoredTask.reward` hands out plain floats all the same."""

    __slots__ = ("correct", "reason")
    correct: bool
    """Whether accuracy counts the completion; by default, whether the reward is 1.0 (sudoku asks more)."""
    reason: str
    """"ok", or why not: "wrong", "not a string", "scorer error", or the task's own (the code task's
    sandbox reasons: "timeout", "assertion failed" ...)."""

    def __new__(cls, reward: float, correct: bool | None = None, reason: str | None = None) -> Score:
        self = super().__new__(cls, reward)
        self.correct = reward == 1.0 if correct is None else bool(correct)
        self.reason = reason if reason is not None else ("ok" if self.correct else "wrong")
        return self

    def __repr__(self) -> str:
        return f"Score({float(self)!r}, correct={self.correct}, reason={self.reason!r})"


class ScoredTask:
    """`reward` and `is_correct` from one `score`: a task only writes `judge`.

    `score` holds the guard every reward needs (never raise on model output), written once
    here: a completion that is not a string scores 0 with reason "not a string" and is not
    judged; an exception in `judge` scores 0 with reason "scorer error" and is logged, with
    its traceback, on the task module's logger."""

    def judge(self, completion: str, problem: Problem) -> float | Score:
        """The verdict on one completion (a string): its reward, or a `Score` where
        correctness is not "reward == 1.0" or a reason is worth keeping. May raise."""
        raise NotImplementedError

    def score(self, completion: str, problem: Problem) -> Score:
        """`judge`'s verdict; never raises because of the completion (see the class docstring)."""
        if not isinstance(completion, str):
            return Score(0.0, correct=False, reason="not a string")
        try:
            verdict = self.judge(completion, problem)
        except Exception:  # a reward never raises on model output
            logging.getLogger(type(self).__module__).exception(
                "%s: could not score a completion; reward 0", getattr(self, "name", type(self).__name__))
            return Score(0.0, correct=False, reason="scorer error")
        return verdict if isinstance(verdict, Score) else Score(verdict)

    def scores(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[Score]:
        """`score` of each completion against its problem."""
        check_lengths(completions, problems)
        return [self.score(c, p) for c, p in zip(completions, problems)]

    def reward(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """The reward of each completion, as plain floats."""
        return [float(s) for s in self.scores(completions, problems)]

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """Whether accuracy counts the completion (`Score.correct`)."""
        return self.score(completion, problem).correct


def score_all(task: Task, completions: Sequence[str], problems: Sequence[Problem]) -> list[Score]:
    """Each completion's reward and correctness, each completion scored once: with
    `ScoredTask.scores`, or for a task written to the bare protocol, from its `reward` and
    `is_correct` (as that task defines them)."""
    if isinstance(task, ScoredTask):
        return task.scores(completions, problems)
    rewards = task.reward(completions, problems)
    return [Score(r, correct=task.is_correct(c, p)) for c, p, r in zip(completions, problems, rewards)]


def check_lengths(completions: Sequence[object], problems: Sequence[Problem]) -> None:
    """A ValueError unless there is one completion per problem."""
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: make a task factory available to `get_task(name)` and the configs."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered under `name` (e.g. "countdown", "sudoku")."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {available_tasks()}") from None
    return factory(**options)


def split_of(key: str, test_fraction: float, validation_fraction: float = 0.0) -> Split:
    """Deterministic split assignment from a stable hash of `key` (not Python's hash()).

    The hash, read as u in [0, 1): test if u < test_fraction, validation if u <
    test_fraction + validation_fraction, train otherwise. The test split does not depend on
    `validation_fraction`; the validation split is carved out of what was train."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    return "validation" if u < test_fraction + validation_fraction else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
