"""Code: write a Python function that passes hidden tests (HumanEval and MBPP).

HumanEval rows (Chen et al., 2021)  ``{task_id, prompt, canonical_solution, test, entry_point}``:
the program is prompt + completion + test + ``check(entry_point)``; a completion that
redefines ``def entry_point(`` at the left margin is the whole function (it replaces the
prompt's stub), otherwise it continues the prompt.
MBPP rows (Austin et al., 2021)  ``{task_id, text, code, test_list, test_setup_code?}``
(or the sanitized variant's "prompt" and "test_imports"): the program is the setup code +
completion + the asserts of test_list. `schema="auto"` tells them apart by columns.
The completion's code is its first fenced block (```python ... ```) if it has one, else
the whole text. Local files and Hub names work as for gsm8k (`path` with "{split}").

Reward: 1.0 if the program runs to its end in `stabledrl.sandbox.run_python` (exit status
0 and a random token printed after the last test), else 0.0. The reason ("ok", "timeout",
"assertion failed", "early exit", ...) is each `Score`'s reason, kept in `last_reasons` for
the last batch and logged. Programs of a batch run `workers` at a time. Never raises, and
leaves no processes or files behind. Why the token, the reasons and how they are logged:
docs/methods.md, "Tasks: Countdown and code".
"""

from __future__ import annotations

import logging
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from stabledrl.sandbox import SandboxLimits, SandboxResult, run_python
from stabledrl.tasks.base import Problem, Score, ScoredTask, Split, check_lengths, register_task
from stabledrl.tasks.datasets import DatasetTask, format_prompt

__all__ = ["CodeTask", "build_program", "extract_code"]

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", re.S)
_ALARMING = {"early exit", "timeout", "memory", "cpu time", "output cap", "process limit", "file size",
             "network refused", "write refused", "sandbox error"}
_DEFAULT_TEMPLATES = {
    "humaneval": "{prompt}",
    "mbpp": "{text}\nYour code should pass these tests:\n{tests}\n",
}


def extract_code(completion: str) -> str:
    """The first fenced code block of `completion`, or the whole text without fences."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def build_program(code: str, meta: dict[str, Any]) -> str:
    """The program that runs `code` (a completion's code) against the problem's tests."""
    if meta["schema"] == "humaneval":
        entry = meta["entry_point"]
        if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.M):
            body = meta["prompt_code"] + "\n" + code  # a whole function: it replaces the prompt's stub
        else:
            body = meta["prompt_code"] + code  # the body that continues the prompt
        return f"{body}\n\n{meta['test']}\n\ncheck({entry})\n"
    return f"{meta['setup']}\n{code}\n\n" + "\n".join(meta["tests"]) + "\n"


def _schema_of(row: dict[str, Any]) -> Literal["humaneval", "mbpp"]:
    if {"prompt", "test", "entry_point"} <= row.keys():
        return "humaneval"
    if "test_list" in row:
        return "mbpp"
    raise ValueError(f"cannot tell the schema of a row with columns {sorted(row)}: expected HumanEval "
                     f"(prompt, test, entry_point) or MBPP (text, code, test_list); or set schema=")


@dataclass
class CodeTask(DatasetTask, ScoredTask):
    """HumanEval- or MBPP-style code generation graded by running tests in the sandbox."""

    schema: Literal["auto", "humaneval", "mbpp"] = "auto"
    """Row layout; "auto" decides by each row's columns."""
    completion_length: int = 512
    """Completion slots the sampler fills."""
    prompt_template: str | None = None
    """A `str.format` template over the row's columns (MBPP rows also get {tests}: the
    asserts, one a line); None = "{prompt}" for HumanEval, the text and tests for MBPP."""
    timeout_s: float = 5.0
    """Wall time per program."""
    memory_mb: float = 512
    """Memory of the whole program, its processes and threads together (and the address-space
    limit of each process); `workers` programs run at once, so at most workers × memory_mb in all."""
    max_processes: int = 16
    """Processes and threads a program may run at once."""
    max_output_bytes: int = 1 << 16
    """stdout and stderr a program may write together before it is killed."""
    workers: int = 2
    """Programs of a batch run this many at a time."""
    name: str = "code"
    """The registry name."""
    last_reasons: list[str] = field(default_factory=list, init=False)
    """Why each program of the last `reward` or `scores` call scored what it did ("ok" when it passed)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schema not in ("auto", "humaneval", "mbpp"):
            raise ValueError(f"schema must be 'auto', 'humaneval' or 'mbpp', got {self.schema!r}")
        if self.workers < 1 or self.timeout_s <= 0:
            raise ValueError(f"workers must be >= 1 and timeout_s > 0, got {self.workers} and {self.timeout_s}")
        self._warned_layers = False

    def _prompt(self, row: dict[str, Any], schema: str) -> str:
        template = self.prompt_template or _DEFAULT_TEMPLATES[schema]
        fields = dict(row)
        if schema == "mbpp":
            fields.setdefault("text", row.get("prompt", ""))
            fields["tests"] = "\n".join(row["test_list"])
        return format_prompt(template, fields)

    def prompt_of(self, row: dict[str, Any]) -> str:
        return self._prompt(row, self.schema if self.schema != "auto" else _schema_of(row))

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """`n` distinct rows of `split` (without replacement), reproducible from `seed`."""
        problems = []
        for i, row in self.data.sample(n, split, seed, self.name):
            schema = self.schema if self.schema != "auto" else _schema_of(row)
            meta: dict[str, Any] = {"schema": schema, "task_id": row.get("task_id", i), "index": i}
            if schema == "humaneval":
                meta.update(prompt_code=row["prompt"], test=row["test"], entry_point=row["entry_point"])
                answer = row.get("canonical_solution", "")
            else:
                setup = [row.get("test_setup_code") or "", *(row.get("test_imports") or [])]
                meta.update(setup="\n".join(s for s in setup if s), tests=list(row["test_list"]))
                answer = row.get("code", "")
            problems.append(Problem(self._prompt(row, schema), answer, meta))
        return problems

    def judge(self, completion: str, problem: Problem) -> Score:
        """Run the completion's program with the problem's tests; the reason says why it scored 0."""
        code = extract_code(completion)
        if not code.strip():
            return Score(0.0, reason="empty program")
        token = f"stabledrl-tests-passed-{secrets.token_hex(8)}"
        limits = SandboxLimits(timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_processes=self.max_processes,
                               max_output_bytes=self.max_output_bytes)
        result: SandboxResult = run_python(build_program(code, problem.meta) + f"\nprint({token!r})\n", limits)
        if not self._warned_layers:
            missing = {"net-ns", "pid-ns", "readonly-fs", "rlimits"} - set(result.layers)
            if not {"memory-cgroup", "memory-monitor"} & set(result.layers):
                missing.add("memory-cgroup (or -monitor)")  # each process is bounded, not the program
            if missing:
                logger.warning("the sandbox runs without %s on this machine (layers: %s)",
                               sorted(missing), ",".join(result.layers))
            self._warned_layers = True
        if result.ok and token not in result.stdout:
            return Score(0.0, reason="early exit")
        return Score(1.0 if result.ok else 0.0, reason=result.reason)

    def score_with_reason(self, completion: str, problem: Problem) -> tuple[float, str]:
        """(reward, reason) for one completion; the reason is "ok" when the tests passed."""
        score = self.score(completion, problem)
        self._log(problem, score.reason)
        return float(score), score.reason

    def _log(self, problem: Problem, reason: str) -> None:
        """One line per failed program; a scorer error was logged already, with its traceback (`ScoredTask.score`)."""
        if reason not in ("ok", "scorer error"):
            level = logging.WARNING if reason in _ALARMING else logging.INFO
            logger.log(level, "code %s: reward 0 (%s)", problem.meta.get("task_id"), reason)

    def scores(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[Score]:
        """`score` of each completion, `workers` programs at a time; logs each reason and
        keeps them in `last_reasons`. (`reward` reads these scores.)"""
        check_lengths(completions, problems)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            results = list(pool.map(self.score, completions, problems))
        for p, score in zip(problems, results):
            self._log(p, score.reason)
        self.last_reasons = [score.reason for score in results]
        return results


@register_task("code")
def _code(**options: object) -> CodeTask:
    return CodeTask(**options)  # type: ignore[arg-type]
