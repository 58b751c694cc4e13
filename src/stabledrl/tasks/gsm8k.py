"""GSM8K: grade-school word problems whose answer is one number (Cobbe et al., 2021).

Rows  ``{"question": str, "answer": "...reasoning...\\n#### 72"}`` (the Hub's ``openai/gsm8k``,
config ``main``, or local files in that schema; `path`, `validation_size`: `stabledrl.tasks.datasets`).
Prompt  the question in `prompt_template`; Answer  the reference solution text.
`convention` picks the prompt and reward (docs/recipes.md compares them): simple (default,
ours, neither published setup): the reward below. d1: d1's reasoning/answer format and its
five summed rewards (`stabledrl.tasks.d1`), up to 4. stabledrl: the StableDRL authors'
(dataloaders/math.py, reward_gsm8k): ±1.0 as math-verify finds the whole completion equivalent
to the text after the reference's last "####" or not (or fails), plus their loop's bonus
(`stabledrl.tasks.math.anti_short_boxed_reward`); the prompt asks for a \\boxed{} answer.

simple's reward: 1.0 when the completion's final number equals the reference number after
"####", else 0.0. The final number is the number of the last answer marker ("#### N" to the
line's end, "\\boxed{N}", "answer is N" / "answer: N" to the sentence's end; the one written
last wins, wherever it stands), or, without a marker, the last number in the text. It must be
one plain number: none, several ("72 or 71", "1 000"), an operand ("144/2", "\\pm 72", a
\\frac) or a number glued to a letter ("7.2e1", "72k") scores 0.0 (docs/methods.md, Hostile
completions). Numbers are ASCII digits with an optional sign, thousands commas and decimals;
"$", "%" and LaTeX spacing are ignored; values compare exactly (72 == 72.0 == 72.00). Never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

from stabledrl.tasks import d1
from stabledrl.tasks.base import Problem, Score, ScoredTask, Split, register_task
from stabledrl.tasks.datasets import DatasetTask, _last_boxed_span, convention_template, format_prompt
from stabledrl.tasks.math import MathVerifier, anti_short_boxed_reward

__all__ = ["GSM8K", "answer_number", "extract_number", "parse_number", "reference_number"]

_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")
_MARKERS = re.compile(r"####(?P<hash>(?:(?!####)[^\n])*)|(?i:\banswer\s*(?:is|:))(?P<said>[^\n]*)")
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)")
_LATEX_NOISE = (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\$", "$"), ("\\%", "%"), ("\u2212", "-"))
# An operator beside a number makes it an operand: 144/2, 2*36, 10^3, \pm 72, \frac{144}{2}; one
# after it only when an operand follows ("72 -->" closes an HTML comment). Spaces, not newlines.
_OPERATOR = r"[-+*/^\u00d7\u00f7\u00b7\u00b1\u2213]|\\(?:times|cdot|div|pm|mp)(?![a-zA-Z])|\}[ \t]*\{"
_OPERATOR_BEFORE = re.compile(rf"(?:{_OPERATOR}|\\[dt]?frac[ \t]*\{{)[ \t]*$")
_OPERATOR_AFTER = re.compile(rf"[ \t]*(?:{_OPERATOR})[ \t]*[\w(\[{{\\.]")


def _plain(text: str) -> str:
    """`text` without LaTeX spacing and escapes, and without "$"."""
    for old, new in _LATEX_NOISE:
        text = text.replace(old, new)
    return text.replace("$", "")


def _value(number: str) -> Decimal | None:
    try:
        return Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None


def parse_number(text: str) -> Decimal | None:
    """The first number in `text` (see the module docstring), or None; for trusted text (the reference)."""
    m = _NUMBER.search(_plain(text))
    return None if m is None else _value(m.group(0))


def _stands_alone(text: str, m: re.Match) -> bool:
    """Whether the number `m` of `text` is neither glued to a letter (7.2e1, 72k, 0x48, x2)
    nor an operand (an operator beside it, `_OPERATOR`)."""
    lo, hi = m.start(), m.end()
    if (lo > 0 and text[lo - 1].isalpha()) or (hi < len(text) and text[hi].isalpha()):
        return False
    before = text[max(0, lo - 40):lo]  # the operators are short; a window keeps long texts linear
    return _OPERATOR_BEFORE.search(before) is None and _OPERATOR_AFTER.match(text, hi) is None


def answer_number(span: str) -> Decimal | None:
    """The one plain number an answer span holds; None when it holds none, several
    ("72 or 71", "1 000", "2,00") or one that is an operand or glued to a letter."""
    text = _plain(span)
    found = _NUMBER.finditer(text)
    first, second = next(found, None), next(found, None)
    if first is None or second is not None or not _stands_alone(text, first):
        return None
    return _value(first.group(0))


def extract_number(completion: str) -> Decimal | None:
    """The completion's final answer as a number, or None (see the module docstring)."""
    spans: list[tuple[int, str]] = []  # (position, text holding the answer)
    for m in _MARKERS.finditer(completion):
        said = m.group("said")
        spans.append((m.start(), m.group("hash") if said is None else _SENTENCE_END.split(said, 1)[0]))
    box = _last_boxed_span(completion)
    if box is not None:
        spans.append(box)
    if spans:
        return answer_number(max(spans, key=lambda s: s[0])[1])
    text = _plain(completion)
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return _value(last.group(0)) if last is not None and _stands_alone(text, last) else None


def reference_number(answer: str) -> Decimal | None:
    """The number after the last "####" of a GSM8K reference solution."""
    return parse_number(answer.rsplit("####", 1)[1]) if "####" in answer else None


Convention = Literal["simple", "d1", "stabledrl"]

TEMPLATES: dict[str, str] = {
    "simple": "{question}\nSolve it step by step; end with the final number as: #### <number>",
    "d1": d1.GSM8K_PROMPT,
    # the authors append a request for a boxed answer to the question (our words)
    "stabledrl": "{question}\nGive the final answer in \\boxed{{}}, e.g. $\\boxed{{7}}$.",
}
"""Each convention's default `prompt_template`."""


@dataclass
class GSM8K(DatasetTask, ScoredTask):
    """GSM8K from local files or the Hub; see the module docstring for `path` and `convention`."""

    completion_length: int = 256
    """Completion slots the sampler fills (reasoning plus the final answer)."""
    convention: Convention = "simple"
    """The prompt and reward: simple (ours), d1 or stabledrl (the module docstring)."""
    prompt_template: str | None = None
    """A `str.format` template over the row's columns; None: the convention's (`TEMPLATES`)."""
    name: str = "gsm8k"
    """The registry name."""

    id_column = "question"

    def __post_init__(self) -> None:
        self.prompt_template = convention_template(TEMPLATES, self.convention, self.prompt_template)
        super().__post_init__()
        if self.completion_length < 1:
            raise ValueError(f"completion_length must be positive, got {self.completion_length}")
        # the authors' math-verify call: 5 s for each parse and the comparison
        self.verifier = MathVerifier(timeout_s=20.0, verify_timeout_s=5) if self.convention == "stabledrl" else None

    def check_row(self, row: dict) -> str | None:
        why = super().check_row(row)
        if why is not None:
            return why
        answer = row.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            return "no answer"
        return None if reference_number(answer) is not None else "no number after '####' in its answer"

    def generate(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """`n` distinct rows of `split` (without replacement), reproducible from `seed`."""
        problems = []
        for i, row in self.data.sample(n, split, seed, self.name):
            answer = row["answer"]
            target = reference_number(str(answer))
            if target is None:
                raise ValueError(f"row {i} of the {split} split has no number after '####' in its answer")
            meta = {"target": str(target), "index": i,
                    "first": answer.split("####")[1].strip(), "last": answer.split("####")[-1].strip()}
            problems.append(Problem(format_prompt(self.prompt_template, row), answer, meta))
        return problems

    def judge(self, completion: str, problem: Problem) -> float | Score:
        if self.convention == "d1":
            terms = d1.gsm8k_terms(completion, problem.meta["first"])
            return Score(sum(terms.values()), correct=terms["correct"] > 0)
        if self.convention == "stabledrl":
            assert self.verifier is not None
            ok = self.verifier.equivalent(problem.meta["last"], completion, raw=True)
            return Score((1.0 if ok else -1.0) + anti_short_boxed_reward(completion), correct=ok)
        value = extract_number(completion)
        return 1.0 if value is not None and value == Decimal(problem.meta["target"]) else 0.0

    def close(self) -> None:
        """Stop the verifier's worker process, if any (it also stops when the task is collected)."""
        if self.verifier is not None:
            self.verifier.close()


@register_task("gsm8k")
def _gsm8k(**options: object) -> GSM8K:
    return GSM8K(**options)  # type: ignore[arg-type]
