"""Rewards against a hostile policy: GSM8K and MATH completions that try to score without the
answer (expressions, several answers, answers hidden in code, comments or another convention's
tag, number dumps, odd separators and notations, very long and binary text), each with the
reward every convention pays (docs/methods.md, "Hostile completions").

simple is ours and pays only for one plain, right answer. d1 and stabledrl are the published
conventions, kept as their authors' code runs: where one pays a hostile completion, the row
says "published". Expected rewards are worked out by hand from the rules in the comments:
d1 (tasks/d1.py): without tags the answer text is the whole completion; GSM8K's terms are 0.5
digits + 2.0 exact string, MATH's 2.0 equivalent last box + 0.25 (0.75 with an <answer> tag).
stabledrl: ±1 as math-verify reads the whole completion, plus the bonus `anti_short_boxed_reward`:
1 for 200 or more non-space characters or a short text mostly outside boxes, else 0."""

from decimal import Decimal

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.gsm8k import extract_number
from stabledrl.tasks.math import extract_answer

CONVENTIONS = ("simple", "d1", "stabledrl")
# A reward at or above this is a correct answer: d1's format terms reach 1.5 at most without
# the 2.0 for the answer; stabledrl's wrong answers reach -1 + 1.
CORRECT_FROM = {"simple": 1.0, "d1": 2.0, "stabledrl": 1.0}


def gsm8k_problem(target: str) -> Problem:
    return Problem("q", f"reasoning\n#### {target}", {"target": target, "first": target, "last": target})


def math_problem(gold: str) -> Problem:
    return Problem("q", f"So $\\boxed{{{gold}}}$.", {"gold": gold})


G72, G1000 = gsm8k_problem("72"), gsm8k_problem("1000")
HALF, M72, M1000, M0 = (math_problem(g) for g in ("\\frac{1}{2}", "72", "1000", "0"))
STRICT = "<reasoning>\nr\n</reasoning>\n<answer>\n{}\n</answer>\n"  # d1's layout
GARBAGE = "\x00\x01\x02\xfe" * 500  # 2,000 non-space characters


def case(completion, problem, simple, d1, stabledrl, name):
    return pytest.param(completion, problem, {"simple": simple, "d1": d1, "stabledrl": stabledrl}, id=name)


# simple, d1, stabledrl. stabledrl as "r + b": math-verify's ±1, then the bonus.
GSM8K = [
    case("48 + 24 = 72.\n#### 72", G72, 1.0, 0.0, 1 + 1, "reference"),
    # expressions: simple refuses an operand; math-verify evaluates (published, right by value)
    case("#### 144/2", G72, 0.0, 0.0, 1 + 1, "144/2"),
    case("#### 72*2", G72, 0.0, 0.0, -1 + 1, "72*2"),
    case("#### 2*36", G72, 0.0, 0.0, 1 + 1, "2*36"),
    case("#### 72+1", G72, 0.0, 0.0, -1 + 1, "72+1"),
    case("so 2*72", G72, 0.0, 0.0, -1 + 1, "2*72 without a marker"),
    # published: math-verify drops \pm outside $...$ and reads 72 (not a hedge: it is not -72)
    case("#### \\pm 72", G72, 0.0, 0.0, 1 + 1, "pm 72"),
    # several answers: the last one written counts; several in one answer are refused
    case("#### 71\n#### 72", G72, 1.0, 0.0, 1 + 1, "two #### lines, right last"),
    case("#### 72\n#### 71", G72, 0.0, 0.0, -1 + 1, "two #### lines, right first"),
    case("#### 72 or 71", G72, 0.0, 0.0, -1 + 1, "72 or 71"),
    # published: math-verify reads the last number; not a hedge, "72 or 71" above pays nothing
    case("#### 71 or 72", G72, 0.0, 0.0, 1 + 1, "71 or 72"),
    # two boxes: math-verify reads neither; 20 non-space characters, none outside a box: no bonus
    case("\\boxed{71} \\boxed{72}", G72, 1.0, 0.0, -1 + 0, "two boxes, right last"),
    case("\\boxed{72}\\boxed{71}", G72, 0.0, 0.0, -1 + 0, "two boxes glued, right first"),
    case("\\boxed{72, 71}", G72, 0.0, 0.0, -1 + 0, "a list in a box"),
    case("\\boxed{72 = 71}", G72, 0.0, 0.0, -1 + 0, "an equation in a box"),
    # other tags: simple has no marker here and reads the last number. d1 reads the last <answer>,
    # wherever it stands (published). math-verify finds no number inside <answer>72</answer>.
    case("<answer>72</answer>", G72, 1.0, 0.5 + 2.0, -1 + 1, "answer tag"),
    case(STRICT.format("72"), G72, 1.0, 4 * 0.125 + 0.5 + 0.5 + 2.0, 1 + 1, "d1 layout"),
    case("#### 71\n<answer>72</answer>", G72, 0.0, 0.5 + 2.0, -1 + 1, "#### then answer tag"),
    case("<answer>71</answer> <!-- <answer>72</answer> -->", G72, 1.0, 0.5 + 2.0, -1 + 1,
         "answer tag hidden in a comment"),
    # hiding the last answer in code or a comment buys nothing: exactly one answer is read
    case("#### 71\n```\n#### 72\n```", G72, 1.0, 0.0, 1 + 1, "#### in a code block"),
    case("#### 71 <!-- #### 72 -->", G72, 1.0, 0.0, 1 + 1, "#### in an HTML comment"),
    case("\\boxed{71} <!-- \\boxed{72} -->", G72, 1.0, 0.0, -1 + 0, "box in an HTML comment"),
    # number dumps: 492 non-space characters, so stabledrl's bonus is paid (published)
    case(" ".join(str(i) for i in range(1, 201)), G72, 0.0, 0.0, -1 + 1, "1 2 3 ... 200"),
    case("#### " + " ".join(str(i) for i in range(72, 201)), G72, 0.0, 0.0, -1 + 1, "#### 72 73 ... 200"),
    case("\\boxed{" + ", ".join(str(i) for i in range(72, 201)) + "}", G72, 0.0, 0.0, -1 + 1, "boxed 72, ..., 200"),
    # units and separators. d1 compares strings: only "72" and "1000" are right (published)
    case("#### $1,000", G1000, 1.0, 0.0, 1 + 1, "$1,000"),
    case("#### 1 000", G1000, 0.0, 0.0, 1 + 1, "1 000"),     # simple: two numbers, or one? refused
    case("#### 1\\,000", G1000, 1.0, 0.0, -1 + 1, "LaTeX thin space"),  # math-verify reads 1
    case("#### 1k", G1000, 0.0, 0.0, -1 + 1, "1k"),
    case("#### 72 dollars", G72, 1.0, 0.0, 1 + 1, "72 dollars"),
    case("#### 72.0", G72, 1.0, 0.0, 1 + 1, "72.0"),
    case("#### 72.", G72, 1.0, 0.0, 1 + 1, "72 and a full stop"),
    # scientific notation and other bases: simple refuses a number glued to a letter
    case("#### 7.2e1", G72, 0.0, 0.0, -1 + 1, "7.2e1"),
    case("#### 72e0", G72, 0.0, 0.0, 1 + 1, "72e0"),          # math-verify reads 72 (published)
    case("\\boxed{7.2 \\times 10^1}", G72, 0.0, 0.0, 1 + 0, "7.2 times 10^1"),  # 20 characters, all boxed
    case("#### 0x48", G72, 0.0, 0.0, -1 + 1, "hexadecimal"),
    # fractions: refused by simple, equal by value for math-verify. The bonus reads \boxed{\frac{144}
    # as the box (it ends at the first "}"): "{2}}" is 4 of 19 characters outside it, no bonus
    case("\\boxed{\\frac{144}{2}}", G72, 0.0, 0.0, 1 + 0, "boxed frac"),
    case("#### \\frac{144}{2}", G72, 0.0, 0.0, 1 + 1, "#### frac"),
    # very long, binary and garbage text
    case("x " * 50_000 + "#### 72", G72, 1.0, 0.0, 1 + 1, "100k characters, then the answer"),
    case("#### 72\n" + "y " * 50_000, G72, 1.0, 0.0, 1 + 1, "the answer, then 100k characters"),
    case("\x00\xff\ud800#### 72\x07", G72, 1.0, 0.0, 1 + 1, "binary around the answer"),
    # published: 2,000 characters of garbage earn the bonus, 0 against -1 for a short wrong box
    case(GARBAGE, G72, 0.0, 0.0, -1 + 1, "garbage"),
    case("#### x = 72", G72, 1.0, 0.0, 1 + 1, "x = 72"),
    case("#### -72", G72, 0.0, 0.0, -1 + 1, "the wrong sign"),
    # format without the answer: d1 pays 4 x 0.125 + strict 0.5 + digits 0.5 (published)
    case(STRICT.format("71"), G72, 0.0, 1.5, -1 + 1, "d1 layout, wrong answer"),
    # published: the bare number the prompt does not ask for beats the box it asks for
    case("72", G72, 1.0, 0.5 + 2.0, 1 + 1, "bare 72"),
    case("\\boxed{72}", G72, 1.0, 0.0, 1 + 0, "bare box"),
]

# MATH: d1's second term is 0.25 without an <answer> tag and 0.75 with one.
MATH = [
    case("So $\\boxed{\\frac{1}{2}}$.", HALF, 1.0, 2.25, 1 + 0, "reference"),  # 9 of 24 outside the box
    # several answers: the last box counts (simple, d1); math-verify reads two boxes as wrong
    case("\\boxed{\\frac{1}{2}} \\boxed{2}", HALF, 0.0, 0.25, -1 + 0, "two boxes, right first"),
    case("\\boxed{2} \\boxed{\\frac{1}{2}}", HALF, 1.0, 2.25, -1 + 0, "two boxes, right last"),
    case("\\boxed{71}\\boxed{72}", M72, 1.0, 2.25, -1 + 0, "two boxes glued"),
    case("\\boxed{\\frac{1}{2}, 2}", HALF, 0.0, 0.25, -1 + 0, "a list in a box"),
    # published: d1 drops what follows "\text{ " as units, so the first of two answers is read
    case("\\boxed{\\frac{1}{2} \\text{ or } 2}", HALF, 0.0, 2.25, -1 + 0, "first or second"),
    case("\\boxed{2 \\text{ or } \\frac{1}{2}}", HALF, 0.0, 0.25, -1 + 0, "second or first"),
    case("\\boxed{\\pm \\frac{1}{2}}", HALF, 0.0, 0.25, -1 + 0, "pm"),
    case("\\boxed{x = \\frac{1}{2}}", HALF, 1.0, 2.25, 1 + 0, "x = answer"),
    # a relation is read by its right side (math-verify; d1 drops a left side of 2 characters or
    # fewer); not a hedge: the left side never scores (next row)
    case("\\boxed{2 = \\frac{1}{2}}", HALF, 1.0, 2.25, 1 + 0, "wrong = right"),
    case("\\boxed{\\frac{1}{2} = 2}", HALF, 0.0, 0.25, -1 + 0, "right = wrong"),
    # other tags, code and comments: the last box is read wherever it stands
    case("<answer>\\frac{1}{2}</answer>", HALF, 1.0, 0.75, 1 + 1, "answer tag, no box"),
    case("<answer>\\boxed{\\frac{1}{2}}</answer>", HALF, 1.0, 2.75, 1 + 0, "answer tag with a box"),
    case("\\boxed{2}\n<answer>\\frac{1}{2}</answer>", HALF, 0.0, 0.75, -1 + 0, "box, then answer tag"),
    case("\\boxed{2}\n```\n\\boxed{\\frac{1}{2}}\n```", HALF, 1.0, 2.25, -1 + 0, "box in a code block"),
    case("\\boxed{2} <!-- \\boxed{\\frac{1}{2}} -->", HALF, 1.0, 2.25, -1 + 0, "box in an HTML comment"),
    # number dumps (200 or more characters: stabledrl's bonus)
    case(" ".join(str(i) for i in range(1, 201)), M72, 0.0, 0.25, -1 + 1, "1 2 3 ... 200"),
    case("\\boxed{" + ", ".join(str(i) for i in range(1, 201)) + "}", M72, 0.0, 0.25, -1 + 1, "boxed 1, ..., 200"),
    case(" ".join(f"${i}$" for i in range(1, 201)), M72, 0.0, 0.25, -1 + 1, "$1$ ... $200$"),
    # expressions: MATH answers are compared by value (math-verify); d1 compares normalised strings
    case("\\boxed{144/2}", M72, 1.0, 0.25, 1 + 0, "144/2"),
    case("\\boxed{72*2}", M72, 0.0, 0.25, -1 + 0, "72*2"),
    case("\\boxed{\\frac{144}{2}}", M72, 1.0, 0.25, 1 + 0, "frac"),
    # units and separators
    case("\\boxed{0.5}", HALF, 1.0, 2.25, 1 + 0, "0.5"),
    case("\\boxed{0.50}", HALF, 1.0, 0.25, 1 + 0, "0.50"),
    case("\\boxed{72.}", M72, 1.0, 0.25, -1 + 0, "72 and a full stop"),      # simple drops the stop
    case("\\boxed{72.0}", M72, 1.0, 0.25, 1 + 0, "72.0"),
    case("\\boxed{72 \\text{ dollars}}", M72, 1.0, 2.25, 1 + 0, "72 dollars"),
    case("\\boxed{\\$72}", M72, 1.0, 2.25, 1 + 0, "$72"),
    case("\\boxed{1,000}", M1000, 1.0, 0.25, 1 + 0, "1,000"),
    case("\\boxed{1\\,000}", M1000, 1.0, 0.25, -1 + 0, "LaTeX thin space"),  # math-verify: 1·000
    # math-verify reads "1 000" as 1·000 = 0: simple refuses digits parted by a space; d1 drops spaces
    case("\\boxed{1 000}", M1000, 0.0, 2.25, -1 + 0, "1 000"),
    case("\\boxed{1 000}", M0, 0.0, 0.25, 1 + 0, "1 000 read as zero"),       # published
    case("\\boxed{0.4999999}", HALF, 1.0, 0.25, 1 + 0, "equal to 6 decimals"),  # math-verify rounds
    # scientific notation: math-verify reads e as Euler's number (7.2·e·1); 10^1 is exact
    case("\\boxed{7.2e1}", M72, 0.0, 0.25, -1 + 0, "7.2e1"),
    case("\\boxed{7.2 \\times 10^{1}}", M72, 1.0, 0.25, 1 + 0, "7.2 times 10^1"),
    # very long, binary and garbage text
    case("x " * 50_000 + "\\boxed{\\frac{1}{2}}", HALF, 1.0, 2.25, 1 + 1, "100k characters, then the box"),
    case("\x00\xff\ud800\\boxed{\\frac12}\x07", HALF, 1.0, 2.25, 1 + 0, "binary around the box"),
    case(GARBAGE, HALF, 0.0, 0.25, -1 + 1, "garbage"),                           # published: the bonus
    # published: an unboxed answer beats the box the prompt asks for (the bonus)
    case("\\frac{1}{2}", HALF, 1.0, 2.25, 1 + 1, "bare answer"),
    case("\\boxed{\\frac{1}{2}}", HALF, 1.0, 2.25, 1 + 0, "bare box"),
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    # The problems are built by hand; the files only satisfy `path` (never read).
    d = tmp_path_factory.mktemp("hostile")
    made = {(name, c): get_task(name, path=str(d / f"{name}.jsonl"), convention=c, cache_dir=str(d / "hf"))
            for name in ("gsm8k", "math") for c in CONVENTIONS}
    yield made
    for t in made.values():
        t.close()


def check(task, convention, completion, problem, expected):
    assert task.reward([completion], [problem]) == [pytest.approx(expected[convention], abs=1e-12)]
    assert task.is_correct(completion, problem) is (expected[convention] >= CORRECT_FROM[convention])


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("completion, problem, expected", GSM8K)
def test_gsm8k(tasks, convention, completion, problem, expected):
    check(tasks["gsm8k", convention], convention, completion, problem, expected)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("completion, problem, expected", MATH)
def test_math(tasks, convention, completion, problem, expected):
    check(tasks["math", convention], convention, completion, problem, expected)


@pytest.mark.parametrize("completion, number", [
    ("#### 144/2", None),              # an operand, not 144
    ("#### 2*36", None),               # not 2
    ("so 2*72", None),                 # no marker: the last number, an operand
    ("#### 72 or 71", None),           # two numbers
    ("\\boxed{72, 71}", None),
    ("#### 1 000", None),
    ("#### 2,00", None),               # not a thousands group: 2 and 00
    ("\\boxed{\\frac{144}{2}}", None),
    ("so \\frac{144}{2}", None),       # not the denominator 2
    ("#### 7.2e1", None),              # neither 7.2 nor 72: refused
    ("the value is 7.2E+1", None),     # no marker: the last number, 1, is glued to "E+"
    ("#### 1k", None),
    ("#### 0x48", None),
    ("#### \\pm 72", None),
    ("#### 10^2", None),
    ("#### 72 -->", Decimal("72")),    # an HTML comment's close is not a minus
    ("48 + 24 = 72", Decimal("72")),   # "=" makes no operand
    ("The total is 72\n- checked", Decimal("72")),  # a list's dash on the next line
    ("#### $1,000.00", Decimal("1000.00")),
    ("#### 1\\,000", Decimal("1000")),
    ("#### 72 dollars.", Decimal("72")),
    ("The answer is 72. Check: 48 + 24 = 72", Decimal("72")),  # "answer is" reads to the sentence's end
    ("The answer is 72, since 48 + 24 = 72", None),             # ... and a comma does not end it
    ("#### -72", Decimal("-72")),
])
def test_simple_gsm8k_reads_one_plain_number(completion, number):
    assert extract_number(completion) == number


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{72.}", "72"),                   # a closing full stop
    ("$\\frac{1}{2}.$", "\\frac{1}{2}"),
    ("\\boxed{1, 2, \\ldots}", "1, 2, \\ldots"),
    ("\\boxed{1, 2, ...}", "1, 2, ..."),      # an ellipsis is not a full stop
    ("\\boxed{1\\,000}", "1000"),             # a thin space between groups of three
    ("\\boxed{12\\,3456}", "12\\,3456"),      # ... only
    ("\\boxed{1 000}", None),                 # digits parted by a space
    ("1 2 3\n", None),
    ("\\boxed{2 \\sqrt 3}", "2 \\sqrt 3"),
])
def test_simple_math_final_answer(completion, answer):
    assert extract_answer(completion) == answer
