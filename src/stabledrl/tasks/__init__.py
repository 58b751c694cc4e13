"""Offline, procedurally generated tasks with verifiers and rewards (SPEC §7).

    >>> from stabledrl.tasks import get_task
    >>> task = get_task("countdown")
    >>> problems = task.generate(4, split="test", seed=0)
    >>> task.reward([p.answer for p in problems], problems)
    [1.0, 1.0, 1.0, 1.0]
"""

from stabledrl.tasks.base import Problem, Split, Task, available_tasks, get_task, register_task
from stabledrl.tasks.countdown import Countdown
from stabledrl.tasks.sudoku import Sudoku

__all__ = ["Problem", "Split", "Task", "available_tasks", "get_task", "register_task", "Countdown", "Sudoku"]
