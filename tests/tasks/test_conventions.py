"""The published prompt/reward conventions of GSM8K and MATH (d1's and the StableDRL authors'),
the validation split carved from train, local files and the export command.

Each expected reward is worked out in its comment from the authors' rules: d1's
diffu-grpo/reward_func.py and math500_utils.py, the StableDRL authors' dataloaders/math.py."""

import hashlib
import json

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks import d1
from stabledrl.tasks.datasets import main as datasets_main

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in all?"
SOLUTION = "48/2 = <<48/2=24>>24 in May.\n48+24 = <<48+24=72>>72.\n#### 72"
MATH_SOLUTION = "Half of one is $\\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$."


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def gsm8k_file(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": QUESTION, "answer": SOLUTION}])
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    return str(tmp_path / "gsm8k" / "{split}.jsonl")


@pytest.fixture
def math_file(tmp_path):
    write_jsonl(tmp_path / "math.jsonl", [{"problem": "What is 1/2 of 1?", "solution": MATH_SOLUTION}])
    return str(tmp_path / "math.jsonl")


def one_problem(task):
    return task.generate(1, split="train", seed=0)[0]


STRICT = "<reasoning>\nShe sold 48 + 24.\n</reasoning>\n<answer>\n{}\n</answer>\n"


@pytest.mark.parametrize("completion, expected, correct", [
    # strict layout, right: xml 4 x 0.125 (nothing after "\n</answer>\n"; one "\n" after "\n</answer>",
    # charged len - 1 = 0) + strict 0.5 + digits 0.5 + correct 2.0; soft 0: its '.' stops at the newline
    (STRICT.format("72"), 3.5, True),
    # one line, no newlines: soft 0.5 + digits 0.5 + correct 2.0; no xml tag with its newline, not strict
    ("<reasoning>48+24=72</reasoning> <answer>72</answer>", 3.0, True),
    # wrong: xml 0.5 + strict 0.5 + digits 0.5
    (STRICT.format("73"), 1.5, False),
    # format only: xml 0.5 + strict 0.5; "seventy-two" is not digits nor "72"
    (STRICT.format("seventy-two"), 1.0, False),
    # exact string comparison: "72.0" is neither digits nor "72"
    (STRICT.format("72.0"), 1.0, False),
    # unparseable: no tag; the answer text is the whole text, stripped, not "72"
    ("I think it is seventy-two.", 0.0, False),
    # no tags at all, but the whole text is "72": digits 0.5 + correct 2.0
    ("72", 2.5, True),
    # "Done." after the closing tag: the third xml term loses 5 x 0.001 (after "\n</answer>\n") and the
    # fourth 5 x 0.001 (6 characters after "\n</answer>", less one): xml 0.49; not strict; + 0.5 + 2.0
    (STRICT.format("72")[:-1] + "\nDone.", 2.99, True),
])
def test_d1_gsm8k_reward(gsm8k_file, tmp_path, completion, expected, correct):
    task = get_task("gsm8k", path=gsm8k_file, convention="d1", cache_dir=str(tmp_path / "hf"))
    p = one_problem(task)
    assert task.reward([completion], [p]) == [pytest.approx(expected, abs=1e-12)]
    assert task.is_correct(completion, p) is correct


def test_d1_terms_one_by_one():
    # d1 compares the text after the reference's first "####" as a string: "-2" is right but not digits
    assert d1.gsm8k_terms(STRICT.format("-2"), "-2") == {"xml_count": 0.5, "soft_format": 0.0, "strict_format": 0.5,
                                                          "integer": 0.0, "correct": 2.0}
    assert d1.strict_format(STRICT.format("1") + "\n")            # "$" admits one more newline
    assert not d1.strict_format(STRICT.format("1") + "\n\n")
    assert not d1.strict_format(STRICT.format("1").replace("48 + 24.", "48\n+ 24"))  # reasoning on one line
    assert d1.soft_format("<reasoning>r</reasoning>\n\n<answer>a</answer> and more")  # a prefix match
    assert not d1.soft_format(" <reasoning>r</reasoning><answer>a</answer>")          # anchored at the start
    # xml_count with no "\n</answer>\n": the third term charges the whole text (22 characters)
    text = "\n<answer>\n7\n</answer>x"
    assert d1.xml_count(text) == pytest.approx(0.125 - 22 * 0.001 + 0.125 - 0 * 0.001, abs=1e-12)
    assert d1.answer_text("a <answer> 1 </answer> <answer> 2") == "2"  # after the last tag, to the next close


@pytest.mark.parametrize("completion, expected, correct", [
    # box equivalent after normalising (dfrac -> frac): correct 2.0 + format 0.5 x (1 tag + 0.5)
    ("<reasoning>\nhalf\n</reasoning>\n<answer>\n\\boxed{\\dfrac{1}{2}}\n</answer>", 2.75, True),
    # "0.5" becomes \frac{1}{2}: 2.0 + 0.5 x (0 + 0.5) with no tag
    ("so \\boxed{0.5}", 2.25, True),
    ("so \\boxed{1/2}", 2.25, True),                  # a/b of integers becomes \frac{a}{b}
    ("so \\boxed{\\frac12}", 2.25, True),             # \frac12 becomes \frac{1}{2}
    ("so \\boxed{2}", 0.25, False),                   # wrong: format 0.25 only
    ("I cannot solve it.", 0.25, False),              # no box: the whole text against the gold
    ("<answer>\nno idea\n</answer>", 0.75, False),    # format only
    # the box check of d1 looks for a backspace + "oxed", so a real \boxed in the tag earns 0.5, not 1
    ("<answer>\\boxed{7}</answer>", 0.75, False),
])
def test_d1_math_reward(math_file, tmp_path, completion, expected, correct):
    task = get_task("math", path=math_file, convention="d1", cache_dir=str(tmp_path / "hf"))
    p = one_problem(task)
    assert task.reward([completion], [p]) == [pytest.approx(expected, abs=1e-12)]
    assert task.is_correct(completion, p) is correct
    task.close()


def test_d1_normalisation():
    assert d1.normalise("k = 5") == "5"                 # a left side of at most 2 characters goes
    assert d1.normalise("\\sqrt3 + \\left(1\\right)") == "\\sqrt{3}+(1)"
    assert d1.normalise("10\\%") == "10"
    assert d1.normalise(".5") == "\\frac{1}{2}"         # "0.5" first, then \frac{1}{2}
    assert d1.normalise("5 \\text{ cm}") == "5"         # units after "\text{ "
    assert d1.normalise("90^\\circ") == "90"
    assert d1.last_box_d1("a \\boxed 7$ b") == "7"      # "\boxed " with a space: up to the next "$"
    assert d1.last_box_d1("\\fbox{3}") == "\\fbox{3}"   # found, but only \boxed{...} is unwrapped
    assert d1.last_box_d1("\\boxed{1} then \\boxed{2") == "\\boxed{1} then \\boxed{2"  # unclosed: the text
    # where d1's normalisation raises, is_equiv compares the raw strings
    assert d1.equivalent("x/2", "x/2") and not d1.equivalent("x / 2", "x/2")  # int("x") raises
    assert not d1.equivalent("\\sqrt", "\\sqrt{}")      # an empty piece after \sqrt raises


# math-verify's ±1, then the authors' anti-short-boxed bonus (0 or 1; its cases below). Non-space
# characters: "48+24=72,sotheansweris" 22 outside the box of 33, 0.67 < 0.85: no bonus.
@pytest.mark.parametrize("completion, expected", [
    ("48 + 24 = 72, so the answer is \\boxed{72}.", 1.0 + 0),
    ("48 + 24 = 72 clips in total.", 1.0 + 1),       # no box: math-verify takes the last number; no box, bonus
    ("So the total is 72 clips, not 70.", -1.0 + 1),  # ... which is 70 here
    ("The answer is \\boxed{73}.", -1.0 + 0),         # wrong; 12 of 22 characters outside the box
    ("I do not know.", -1.0 + 1),                     # unparseable
    ("", -1.0 + 0),                                   # empty: 0 / (0 + 1e-6) < 0.85
    (STRICT.replace("She sold 48 + 24.", "I count them.").format("seventy-two"), -1.0 + 1),  # d1's format: nothing
    ("She sold 48 + 24.", 1.0 + 1),                   # math-verify reads the last expression, 48 + 24 = 72
])
def test_stabledrl_gsm8k_reward(gsm8k_file, tmp_path, completion, expected):
    task = get_task("gsm8k", path=gsm8k_file, convention="stabledrl", cache_dir=str(tmp_path / "hf"))
    p = one_problem(task)
    assert p.meta["last"] == "72"  # the gold: the text after the reference's last "####"
    assert task.reward([completion], [p]) == [expected]
    assert task.is_correct(completion, p) is (expected >= 1.0)
    task.close()


LONG = "We add the clips of April and of May, " * 8  # 8 · 29 = 232 non-space characters


@pytest.mark.parametrize("completion, bonus", [
    ("\\boxed{72}", 0.0),                     # a bare box
    ("  $\\boxed{72}$. ", 0.0),               # still bare: $, spaces and a closing mark around it
    ("So \\boxed{72}", 0.0),                  # "So" is 2 of 12 characters: 0.17 < 0.85
    ("The answer is 72.", 1.0),                # short, no box: all 14 characters outside one
    ("", 0.0),                                 # empty
    ("x" * 150 + " \\boxed{7}", 1.0),         # short, but 150 of 159 characters outside the box: 0.94
    ("x" * 40 + " \\boxed{7}", 0.0),          # 40 of 49: 0.82 < 0.85
    ("\\boxed{\\frac{1}{2}}", 0.0),            # not bare to their pattern ([^}]*), "{2}}" 4 of 19 outside
    (LONG + "\\boxed{72}", 1.0),              # 232 + 10 >= 200 non-space characters: always 1
    ("\\boxed{" + "9" * 199 + "}", 1.0),       # 207 characters, all in the box: long enough
])
def test_the_stabledrl_authors_anti_short_boxed_bonus(completion, bonus):
    from stabledrl.tasks.math import anti_short_boxed_reward

    assert anti_short_boxed_reward(completion) == bonus


def test_stabledrl_math_reward(math_file, tmp_path):
    # the gold is the whole reference solution; math-verify finds its boxed 1/2
    task = get_task("math", path=math_file, convention="stabledrl", cache_dir=str(tmp_path / "hf"))
    p = one_problem(task)
    got = task.reward(["Thus \\boxed{0.5}", "Thus \\boxed{1/3}", "no idea", LONG + "Thus \\boxed{0.5}"], [p] * 4)
    # ±1, then the bonus: "Thus" is 4 of 16 characters (a short, mainly boxed answer): 0; "no idea" 1; long: 1
    assert got == [1.0 + 0, -1.0 + 0, -1.0 + 1, 1.0 + 1]
    task.close()


def test_each_convention_has_its_prompt(gsm8k_file, math_file, tmp_path):
    hf = str(tmp_path / "hf")
    prompts = {c: one_problem(get_task("gsm8k", path=gsm8k_file, convention=c, cache_dir=hf)).prompt
               for c in ("simple", "d1", "stabledrl")}
    assert prompts["simple"] == QUESTION + "\nSolve it step by step; end with the final number as: #### <number>"
    assert prompts["d1"].endswith("\n\n" + QUESTION)
    assert "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>" in prompts["d1"]
    assert prompts["stabledrl"].startswith(QUESTION) and "\\boxed{}" in prompts["stabledrl"]
    math_d1 = one_problem(get_task("math", path=math_file, convention="d1", cache_dir=hf)).prompt
    assert "<answer>" in math_d1 and "\\boxed{}" in math_d1 and math_d1.endswith("What is 1/2 of 1?")
    custom = get_task("gsm8k", path=gsm8k_file, convention="d1", prompt_template="Q: {question}", cache_dir=hf)
    assert one_problem(custom).prompt == "Q: " + QUESTION  # a template given wins over the convention's
    with pytest.raises(ValueError, match="convention must be one of"):
        get_task("gsm8k", path=gsm8k_file, convention="r1", cache_dir=hf)


# --- the validation split ------------------------------------------------------------

def rows(n, tag):
    return [{"question": f"{tag} question {i}?", "answer": f"#### {i}"} for i in range(n)]


def test_validation_is_carved_from_train_by_a_hash_of_the_question(tmp_path):
    train, test = rows(40, "train"), rows(10, "test")
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "test.jsonl", test)
    task = get_task("gsm8k", path=str(tmp_path / "{split}.jsonl"), validation_size=8, cache_dir=str(tmp_path / "hf"))
    parts = {s: [r["question"] for r in task.data.rows(s)] for s in ("train", "validation", "test")}
    # the 8 questions with the smallest salted SHA-256, computed here independently
    digest = {q: hashlib.sha256(f"stabledrl-validation:{q}".encode()).digest()[:8] for q in parts["train"] +
              parts["validation"]}
    assert set(parts["validation"]) == set(sorted(digest, key=digest.get)[:8])
    assert len(parts["train"]) == 32 and not set(parts["train"]) & set(parts["validation"])
    assert set(parts["train"]) | set(parts["validation"]) == {r["question"] for r in train}
    assert not set(parts["validation"]) & set(parts["test"])
    drawn = task.generate(8, split="validation", seed=3)
    assert {p.prompt.split("\n")[0] for p in drawn} == set(parts["validation"])
    # the same rows whatever the file's order
    write_jsonl(tmp_path / "train.jsonl", train[::-1])
    again = get_task("gsm8k", path=str(tmp_path / "{split}.jsonl"), validation_size=8, cache_dir=str(tmp_path / "hf2"))
    assert set(r["question"] for r in again.data.rows("validation")) == set(parts["validation"])
    with pytest.raises(ValueError, match="validation_size 40 leaves no training rows"):
        get_task("gsm8k", path=str(tmp_path / "{split}.jsonl"), validation_size=40,
                 cache_dir=str(tmp_path / "hf")).generate(1)


def test_math_validation_hashes_the_problem(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": f"p{i}", "solution": f"\\boxed{{{i}}}"} for i in range(6)])
    one_file = get_task("math", path=str(tmp_path / "train.jsonl"), validation_size=2, cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="serves the test split too"):  # validation rows would be test rows
        one_file.generate(1, split="validation")
    one_file.close()
    task = get_task("math", path=str(tmp_path / "{split}.jsonl"), validation_size=2, cache_dir=str(tmp_path / "hf"))
    digest = {f"p{i}": hashlib.sha256(f"stabledrl-validation:p{i}".encode()).digest()[:8] for i in range(6)}
    assert {r["problem"] for r in task.data.rows("validation")} == set(sorted(digest, key=digest.get)[:2])
    task.close()


# --- local files and the export command ----------------------------------------------

def test_a_parquet_file_loads(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.Table.from_pylist([{"question": QUESTION, "answer": SOLUTION}, {"question": "1+1?", "answer": "#### 2"}])
    pq.write_table(table, tmp_path / "train.parquet")
    task = get_task("gsm8k", path=str(tmp_path / "{split}.parquet"), cache_dir=str(tmp_path / "hf"))
    assert sorted(p.meta["target"] for p in task.generate(2, split="train")) == ["2", "72"]


def test_export_writes_the_files_the_task_reads(tmp_path, monkeypatch, capsys):
    import datasets

    asked = []

    def fake_load(name, config=None, *, split, cache_dir=None):  # the Hub, offline
        asked.append((name, config, split))
        return datasets.Dataset.from_list([{"question": f"{split} q?", "answer": "#### 5"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    datasets_main(["export", "gsm8k", "--out", str(tmp_path / "gsm8k")])
    assert asked == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert capsys.readouterr().out.split() == [str(tmp_path / "gsm8k" / f) for f in ("train.jsonl", "test.jsonl")]
    monkeypatch.undo()
    task = get_task("gsm8k", path=str(tmp_path / "gsm8k" / "{split}.jsonl"), cache_dir=str(tmp_path / "hf"))
    assert task.generate(1, split="test")[0].prompt.startswith("test q?")
    with pytest.raises(ValueError, match="no default dataset for task 'sudoku'"):
        datasets_main(["export", "sudoku", "--out", str(tmp_path / "x")])


def test_problem_built_by_hand_scores_under_d1(gsm8k_file, tmp_path):
    p = Problem("q", "#### 72", {"target": "72", "first": "72", "last": "72"})
    task = get_task("gsm8k", path=gsm8k_file, convention="d1", cache_dir=str(tmp_path / "hf"))
    assert task.reward([STRICT.format("72"), None], [p, p]) == [3.5, 0.0]  # not a string: 0, unread
