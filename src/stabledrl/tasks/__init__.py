"""Tasks with verifiers and rewards (docs/methods.md, "Rewards"): offline, procedurally
generated ones (countdown, sudoku) and dataset-backed ones read from local files or the
Hub (gsm8k, math, code; see their modules for the `path` option).

    >>> from stabledrl.tasks import get_task
    >>> task = get_task("countdown")
    >>> problems = task.generate(4, split="test", seed=0)
    >>> task.reward([p.answer for p in problems], problems)
    [1.0, 1.0, 1.0, 1.0]
"""

from stabledrl.tasks.base import (Problem, Score, ScoredTask, Split, Task, available_tasks, get_task, register_task,
                                  score_all)
from stabledrl.tasks.countdown import Countdown
from stabledrl.tasks.sudoku import Sudoku
from stabledrl.tasks.gsm8k import GSM8K
from stabledrl.tasks.math import MathTask
from stabledrl.tasks.code import CodeTask

__all__ = ["Problem", "Score", "ScoredTask", "Split", "Task", "available_tasks", "get_task", "register_task",
           "score_all", "Countdown", "Sudoku", "GSM8K", "MathTask", "CodeTask"]
