"""MATH: competition problems with LaTeX answers (Hendrycks et al., 2021), and MATH-500.

Rows  ``{"problem", "solution" (ending in \\boxed{...}), "level", "type"}``; an "answer"
column (MATH-500's) is the gold answer when present, else the solution's last box is.
Prompt  the problem in `prompt_template`; Answer  the reference solution.
Local files, Hub names and `validation_size`: as for gsm8k (`stabledrl.tasks.datasets`).

`convention` picks the prompt and reward (docs/recipes.md compares them): simple (default,
ours, neither published setup): the reward below. d1: d1's reasoning/answer format and
its two summed rewards (`stabledrl.tasks.d1`). stabledrl: the StableDRL authors'
(dataloaders/math.py, reward_mixed): +1.0 when math-verify finds the whole completion
equivalent to the whole reference solution, else -1.0, plus their training loop's
`anti_short_boxed_reward` (0 or 1), so rewards in {-1, 0, 1, 2}; the prompt asks for a \\boxed{}.

simple's reward: 1.0 when the completion's final answer is equivalent to the gold answer
per math-verify (`parse` + `verify`), else 0.0. The final answer is the last top-level
\\boxed{...}; without one, the last $...$; without that, the last non-empty line; a closing
full stop is dropped and "1\\,000" read as 1000. Digits parted by a space ("1 000", a number
dump) and answers longer than `max_answer_chars` score 0.0 unread. Hostile completions and
what each convention pays for them: docs/methods.md. Guarding math-verify: `MathVerifier`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Literal

from stabledrl.tasks import d1
from stabledrl.tasks.base import Problem, Score, ScoredTask, Split, register_task
from stabledrl.tasks.datasets import DatasetTask, convention_template, format_prompt, last_boxed

__all__ = ["MathTask", "MathVerifier", "extract_answer", "anti_short_boxed_reward"]

logger = logging.getLogger(__name__)

_DOLLARS = re.compile(r"\$+([^$]+)\$+")


_THIN_SPACE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")  # 1\,000: a thousands separator
_SPACED_DIGITS = re.compile(r"\d\s+\d")  # "1 000" (math-verify reads 1·000 = 0), "1 2 3 ..."
_FULL_STOP = re.compile(r"(?<!\.)\.\s*$")  # "72." but not "1, 2, ..."


def _final_text(completion: str) -> str | None:
    """The last top-level box's content; without one, the last $...$; without that, the last line."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    inline = None
    for inline in _DOLLARS.finditer(completion):
        pass
    if inline is not None:
        return inline.group(1)
    lines = [line for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract_answer(completion: str) -> str | None:
    """The completion's final answer as LaTeX text, or None (see the module docstring)."""
    text = _final_text(completion)
    if text is None:
        return None
    answer = _FULL_STOP.sub("", _THIN_SPACE.sub("", text).strip()).strip()
    return None if _SPACED_DIGITS.search(answer) else answer


# The worker: reads {"gold", "pred", "raw"} JSON lines on stdin, answers "1" or "0" per line.
# raw: parse both texts as they are (math-verify finds the answer in them), as the StableDRL
# authors call it; else each is the content of a box.
_WORKER = r'''
import json, logging, resource, sys
memory_mb, inner_timeout = float(sys.argv[1]), int(sys.argv[2])
if memory_mb > 0:
    resource.setrlimit(resource.RLIMIT_AS, (int(memory_mb * 2**20),) * 2)
logging.disable(logging.WARNING)  # math-verify logs every timeout
from math_verify import parse, verify
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin:
    try:
        req = json.loads(line)
        wrap = (lambda t: t) if req.get("raw") else (lambda t: "\\boxed{" + t + "}")
        gold = parse(wrap(req["gold"]), parsing_timeout=inner_timeout)
        pred = parse(wrap(req["pred"]), parsing_timeout=inner_timeout)
        ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=inner_timeout)
    except BaseException:  # MemoryError, RecursionError, math-verify's TimeoutException ...
        ok = False
    sys.stdout.write("1\n" if ok else "0\n")
    sys.stdout.flush()
'''


class MathVerifier:
    """math-verify equivalence in a killable worker process.

    math-verify's own timeouts use SIGALRM, which works only in the main thread
    and cannot interrupt one long C-level step (a huge power in sympy holds the GIL). So it
    runs in a worker process, in that process's main thread with math-verify's timeouts on
    (`verify_timeout_s`), under an address-space limit, and we wait at most `timeout_s` per
    answer: past that the worker is killed (and restarted on the next call) and the answer
    counts as not equivalent. The reward never raises and works from any thread; calls are serialised.
    Deviation: the worker costs ~1 s to start (sympy import), once per task instance."""

    def __init__(self, *, timeout_s: float = 5.0, verify_timeout_s: int = 2, memory_mb: float = 4096,
                 start_timeout_s: float = 60.0) -> None:
        self.timeout_s, self.verify_timeout_s = timeout_s, verify_timeout_s
        self.memory_mb, self.start_timeout_s = memory_mb, start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._buf = bytearray()
        self.restarts = 0
        """Workers killed for running past `timeout_s` (or dying) so far."""

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _WORKER, str(self.memory_mb), str(self.verify_timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C at the terminal is for us, not the worker
        self._finalizer = weakref.finalize(self, _stop, proc)  # also at interpreter exit
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self._proc, self._buf = proc, bytearray()
        if self._read_line(self.start_timeout_s) != "ready":
            self._kill()
            raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")
        return proc

    def _read_line(self, timeout: float) -> str | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None  # the worker died
                self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line.decode()

    def _kill(self) -> None:
        if self._proc is not None:
            self._stop()
            self.restarts += 1

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop(proc) once
        self._proc = self._finalizer = None

    def equivalent(self, gold: str, pred: str, *, raw: bool = False) -> bool:
        """Whether `pred` is equivalent to `gold` (LaTeX without the box; with `raw`, whole
        texts math-verify finds the answers in); False when the worker cannot tell within `timeout_s`."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"gold": gold, "pred": pred, "raw": raw}).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                self._kill()
                return False
            answer = self._read_line(self.timeout_s)
            if answer is None:
                logger.warning("math-verify gave no verdict within %.1f s; restarting its worker", self.timeout_s)
                self._kill()
                return False
            return answer == "1"

    def close(self) -> None:
        with self._lock:
            self._stop()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


TEMPLATES: dict[str, str] = {
    "simple": "{problem}\nReason step by step and put the final answer in \\boxed{{}}.",
    "d1": d1.MATH_PROMPT,
    # the authors append a request for a boxed answer to the problem (our words)
    "stabledrl": "{problem}\nGive the final answer in \\boxed{{}}, e.g. $\\boxed{{7}}$.",
}
"""Each convention's default `prompt_template`."""


_PURE_BOX = re.compile(r"[\s$]*\\boxed\{[^}]*\}[\s$]*[.?!'\"“”’]*\s*")
_BOX_SPAN = re.compile(r"\\boxed\{.*?\}", re.DOTALL)
_SPACE = re.compile(r"\s+")


def anti_short_boxed_reward(completion: str, *, min_total_chars: int = 200, non_boxed_ratio_threshold: float = 0.85
                            ) -> float:
    """The StableDRL authors' bonus, added to their ±1 reward (their networks/llada_svpo.py,
    `anti_short_boxed_reward`): 0.0 for a completion of fewer than `min_total_chars`
    non-space characters that is only a \\boxed{...} (with $, spaces and a closing
    punctuation mark) or whose characters outside \\boxed{...} spans are under
    `non_boxed_ratio_threshold` of its non-space characters; else 1.0. Their patterns, warts
    included: a span ends at the first "}", so of \\boxed{\\frac{1}{2}} the tail "{2}}" counts
    as text outside it; an empty completion scores 0.0, a short one with no box 1.0."""
    text = completion.strip()
    total = len(_SPACE.sub("", text))
    if total >= min_total_chars:
        return 1.0
    outside = len(_SPACE.sub("", _BOX_SPAN.sub("", text)))
    mainly_boxed = bool(_PURE_BOX.fullmatch(text)) or outside / (total + 1e-6) < non_boxed_ratio_threshold
    return 0.0 if mainly_boxed else 1.0


def _level(level: object) -> int:
    """MATH's "Level 3" -> 3; anything unreadable -> 5 (the authors' try_get_level)."""
    try:
        return int(str(level).split()[-1])
    except (ValueError, IndexError):
        return 5


@dataclass
class MathTask(DatasetTask, ScoredTask):
    """MATH / MATH-500 from local files or the Hub; see the module docstring."""

    completion_length: int = 512
    """Completion slots the sampler fills."""
    convention: Literal["simple", "d1", "stabledrl"] = "simple"
    """The prompt and reward: simple (ours), d1 or stabledrl (the module docstring)."""
    prompt_template: str | None = None
    """A `str.format` template over the row's columns (double the braces of LaTeX); None: the
    convention's (`TEMPLATES`)."""
    max_answer_chars: int = 1000
    """Longer final answers score 0 without being parsed."""
    timeout_s: float = 5.0
    """Wall time per answer before the verifier's worker is killed."""
    verify_timeout_s: int = 2
    """math-verify's own (SIGALRM) timeout for each parse and comparison, whole seconds."""
    memory_mb: float = 4096
    """Address-space limit of the verifier's worker."""
    max_problem_chars: int | None = None
    """Train only on problems shorter than this many characters (the StableDRL authors: 1500); None: all."""
    max_problem_words: int | None = None
    """Train only on problems of at most this many words, split on spaces (the authors: 300); None: all."""
    max_level: int | None = None
    """Train only on problems of this level or lower ("Level 3" -> 3; unreadable: 5, as the authors
    read it; they keep 1-4); None: all."""
    name: str = "math"
    """The registry name."""

    id_column = "problem"

    def __post_init__(self) -> None:
        self.prompt_template = convention_template(TEMPLATES, self.convention, self.prompt_template)
        for name in ("max_problem_chars", "max_problem_words", "max_level"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive whole number or null, got {value!r}")
        super().__post_init__()
        if self.timeout_s <= 0 or self.verify_timeout_s < 1:
            raise ValueError("timeout_s must be positive and verify_timeout_s at least 1 (whole seconds)")
        self.verifier = MathVerifier(timeout_s=self.timeout_s, verify_timeout_s=self.verify_timeout_s,
                                     memory_mb=self.memory_mb)

    def keep_row(self, row: dict) -> bool:
        """The authors' filter of training problems (their dataloaders/math.py,
        `_prepare_math_dataset`): level at most `max_level`, under `max_problem_chars`
        characters, at most `max_problem_words` words; the test split is never filtered."""
        problem = str(row.get("problem", ""))
        return ((self.max_level is None or _level(row.get("level")) <= self.max_level)
                and (self.max_problem_chars is None or len(problem) < self.max_problem_chars)
                and (self.max_problem_words is None or len(problem.split()) <= self.max_problem_words))

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """`n` distinct rows of `split` (without replacement), reproducible from `seed`."""
        problems = []
        for i, row in self.data.sample(n, split, seed, self.name):
            gold = row.get("answer") or last_boxed(str(row.get("solution", "")))
            if not gold:
                raise ValueError(f"row {i} of the {split} split has neither an answer nor a \\boxed{{}} solution")
            meta = {"gold": str(gold).strip(), "index": i, "level": row.get("level"),
                    "type": row.get("type", row.get("subject"))}
            problems.append(Problem(format_prompt(self.prompt_template, row), str(row.get("solution", gold)), meta))
        return problems

    def judge(self, completion: str, problem: Problem) -> float | Score:
        if self.convention == "d1":
            terms = d1.math_terms(completion, problem.answer)
            return Score(sum(terms.values()), correct=terms["correct"] > 0)
        if self.convention == "stabledrl":
            ok = self.verifier.equivalent(problem.answer, completion, raw=True)
            return Score((1.0 if ok else -1.0) + anti_short_boxed_reward(completion), correct=ok)
        answer = extract_answer(completion)
        if not answer or len(answer) > self.max_answer_chars:
            return 0.0
        return 1.0 if self.verifier.equivalent(problem.meta["gold"], answer) else 0.0

    def close(self) -> None:
        """Stop the verifier's worker process (it also stops when the task is collected)."""
        self.verifier.close()


@register_task("math")
def _math(**options: object) -> MathTask:
    return MathTask(**options)  # type: ignore[arg-type]
