"""What every task provides, and the registry that maps names to tasks.

A task is a seeded problem generator with disjoint splits plus a reward. The reward has
one signature for every task (TRL style, a plain function of text):

    reward(completions: Sequence[str], problems: Sequence[Problem]) -> list[float]

It reads text only, never raises on model output, and never evaluates it with `eval`.
A task may also offer ``problem_from_prompt(prompt) -> Problem`` (the problem a prompt
written by hand states; ValueError if none): `stabledrl sample` then shows each
completion's reward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

__all__ = ["Problem", "Task", "Split", "SPLITS", "get_task", "register_task", "available_tasks", "split_of", "check_split"]

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
