import json
from decimal import Decimal

import pytest

from stabledrl.tasks import Problem, get_task
from stabledrl.tasks.datasets import last_boxed
from stabledrl.tasks.gsm8k import extract_number, parse_number

# Rows in the GSM8K schema (the reference's last line is "#### <number>").
TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day. How many pens in 2 days?", "answer": "1000*2=2000\n#### 2,000"},
    {"question": "It is 3 degrees and drops by 5. What is the temperature?", "answer": "3-5=-2\n#### -2"},
    {"question": "Half of 5?", "answer": "5/2=2.5\n#### 2.5"},
    {"question": "How many legs do 3 cats have?", "answer": "3*4=12\n#### 12"},
]
TEST = [
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting. How much did she earn?",
     "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n50 * 0.2 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "2+2?", "answer": "#### 4"},
]

P72 = Problem("q", "#### 72", {"target": "72"})
P2000 = Problem("q", "#### 2,000", {"target": "2000"})
PNEG = Problem("q", "#### -2", {"target": "-2"})
PHALF = Problem("q", "#### 2.5", {"target": "2.5"})


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture
def task(tmp_path):
    write_jsonl(tmp_path / "gsm8k-train.jsonl", TRAIN)
    write_jsonl(tmp_path / "gsm8k-test.jsonl", TEST)
    return get_task("gsm8k", path=str(tmp_path / "gsm8k-{split}.jsonl"), cache_dir=str(tmp_path / "hf"))


@pytest.mark.parametrize("completion, problem, expected", [
    # right
    ("48/2 = 24, 48 + 24 = 72\n#### 72", P72, 1.0),
    ("####72", P72, 1.0),
    ("#### 72 clips", P72, 1.0),
    ("#### $72.00", P72, 1.0),                      # "$" and a zero fraction
    ("#### 72.", P72, 1.0),                         # sentence full stop
    ("So the answer is 72.", P72, 1.0),
    ("The final answer: 72", P72, 1.0),
    ("The Answer Is $72$", P72, 1.0),
    ("so \\boxed{72}", P72, 1.0),
    ("\\boxed{\\boxed{72}}", P72, 1.0),             # nested boxes
    ("\\boxed{72 \\text{ clips}}", P72, 1.0),
    ("She sold 24 in May, 72 in total", P72, 1.0),  # no marker: the last number
    ("72%", P72, 1.0),
    ("#### 2,000", P2000, 1.0),
    ("#### 2000", P2000, 1.0),
    ("\\boxed{2{,}000}", P2000, 1.0),               # LaTeX thousands separator
    ("#### -2", PNEG, 1.0),
    ("#### \u22122", PNEG, 1.0),                    # unicode minus sign
    ("It is 2.50 degrees... #### 2.5", PHALF, 1.0),
    ("#### 5\n(first try)\nThe answer is 72", P72, 1.0),  # the marker written last wins
    ("The answer is 5. Actually \\boxed{72}", P72, 1.0),
    ("x " * 50_000 + "#### 72", P72, 1.0),          # 100k characters before the answer
    # wrong
    ("#### 73", P72, 0.0),
    ("#### 72\nThe answer is 73", P72, 0.0),
    ("\\boxed{72} is wrong, #### 71", P72, 0.0),
    ("#### -72", P72, 0.0),
    ("#### 2", PNEG, 0.0),                          # sign matters
    ("5-2", PNEG, 0.0),                             # a minus between numbers is not a sign
    ("#### 2,00", P2000, 0.0),                      # not a thousands group: 2
    ("#### 7 2", P72, 0.0),
    ("#### 7.2", P72, 0.0),
    ("#### 720", P72, 0.0),
    # no readable answer
    ("#### seventy-two", P72, 0.0),                 # a marker with junk after it is not rescued
    ("####\n72", P72, 0.0),                         # the marker's line is empty
    ("#### \u0667\u0662", P72, 0.0),                # Arabic-Indic digits are not ASCII
    ("#### \uff17\uff12", P72, 0.0),                # full-width digits
    ("\\boxed{", P72, 0.0),
    ("\\boxed{" * 20_000, P72, 0.0),
    ("9" * 100_000, P72, 0.0),
    ("", P72, 0.0),
    ("   \n ", P72, 0.0),
    ("no numbers here", P72, 0.0),
    ("\ud800 #### 72", P72, 1.0),                   # a lone surrogate does not break parsing
    (None, P72, 0.0),
    (72, P72, 0.0),                                 # not a string
    (b"#### 72", P72, 0.0),
])
def test_reward_table(task, completion, problem, expected):
    assert task.reward([completion], [problem]) == [expected]
    assert task.is_correct(completion, problem) == (expected == 1.0)


def test_number_parsing():
    assert parse_number("about $1,234.50 total") == Decimal("1234.50")
    assert parse_number("x-3") == Decimal("3")         # "-" after a letter is not a sign
    assert parse_number("= -3") == Decimal("-3")
    assert parse_number("1,2,3") == Decimal("1")       # a list, not 123
    assert parse_number("none") is None
    assert extract_number("first 1 then 2 then 3") == Decimal("3")
    assert extract_number("#### 4 and more #### 5") == Decimal("5")
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{\\boxed{1} + 2}") == "\\boxed{1} + 2"  # only a box holding only a box unwraps
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"  # the unclosed one does not count
    assert last_boxed("\\boxed 7$") == "7"
    assert last_boxed("no box") is None


def test_problems_come_from_the_rows(task):
    problems = task.generate(5, split="train", seed=0)
    assert sorted(p.meta["index"] for p in problems) == [0, 1, 2, 3, 4]  # all rows, each once
    for p in problems:
        row = TRAIN[p.meta["index"]]
        assert p.answer == row["answer"]
        assert p.prompt.startswith(row["question"] + "\n")
    assert {p.meta["target"] for p in problems} == {"72", "2000", "-2", "2.5", "12"}
    assert task.reward([p.answer for p in problems], problems) == [1.0] * 5  # references score 1


def test_generation_is_reproducible_and_the_splits_come_from_their_files(task):
    a = task.generate(3, split="train", seed=1)
    assert a == task.generate(3, split="train", seed=1)
    draws = {tuple(p.meta["index"] for p in task.generate(3, split="train", seed=s)) for s in range(5)}
    assert len(draws) > 1  # the seed matters
    test = task.generate(2, split="test", seed=0)
    assert {p.answer for p in test} == {r["answer"] for r in TEST}
    with pytest.raises(ValueError, match="asked for 3 problems but the test split"):
        task.generate(3, split="test")
    with pytest.raises(ValueError, match="no validation split.*eval_split: test"):
        task.generate(1, split="validation")
    with pytest.raises(ValueError, match="split"):
        task.generate(1, split="dev")


def test_prompt_template_and_length(tmp_path, task):
    assert task.prompt_length == max(len(task.prompt_template.format(**r)) for r in TRAIN + TEST)
    write_jsonl(tmp_path / "one.jsonl", TEST)
    plain = get_task("gsm8k", path=str(tmp_path / "one.jsonl"), cache_dir=str(tmp_path / "hf"),
                     prompt_template="Q: {question}\nA:")
    assert plain.generate(1, split="test", seed=0)[0].prompt.startswith("Q: ")
    assert len(plain.generate(2, split="train")) == 2  # a file without {split} serves every split
    with pytest.raises(ValueError, match=r"line 1: no 'query' \(prompt_template reads it\)"):
        get_task("gsm8k", path=str(tmp_path / "one.jsonl"), cache_dir=str(tmp_path / "hf"), prompt_template="{query}")


def test_parquet_files_load(tmp_path):
    import datasets

    datasets.Dataset.from_list(TRAIN).to_parquet(str(tmp_path / "train.parquet"))
    task = get_task("gsm8k", path=str(tmp_path / "{split}.parquet"), cache_dir=str(tmp_path / "hf"))
    problems = task.generate(5)
    assert task.reward([p.answer for p in problems], problems) == [1.0] * 5


def test_bad_options_and_files(tmp_path):
    with pytest.raises(ValueError, match="path="):
        get_task("gsm8k")
    task = get_task("gsm8k", path=str(tmp_path / "missing-{split}.jsonl"), cache_dir=str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="missing-train.jsonl.*run: python -m stabledrl.tasks.datasets export "
                       r"gsm8k --out .* and set path: .*/\{split\}.jsonl"):
        task.generate(1)
    task = get_task("gsm8k", path="data/gsm8k/{split}.jsonl", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match=r"data/gsm8k/test.jsonl.*write them with: "
                       r"python -m stabledrl.tasks.datasets export gsm8k --out data/gsm8k$"):
        task.generate(1, split="test")
    write_jsonl(tmp_path / "only-train.jsonl", TRAIN)  # a missing test file is met when evaluation reads it
    task = get_task("gsm8k", path=str(tmp_path / "only-{split}.jsonl"), cache_dir=str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="only-test.jsonl"):
        task.generate(1, split="test")
    write_jsonl(tmp_path / "noref.jsonl", [{"question": "?", "answer": "no marker"}])
    with pytest.raises(ValueError, match="no number after '####'"):
        get_task("gsm8k", path=str(tmp_path / "noref.jsonl"), cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="completions"):
        task.reward(["1"], [])


def test_every_row_is_checked_when_the_task_is_built_and_the_bad_ones_are_named(tmp_path):
    # Not when a training step first draws row 4, hours in: at start-up, every row.
    rows = TRAIN[:2] + [{"question": "No answer?"}, TRAIN[2], {"answer": "#### 3"},
                        {"question": "q", "answer": "three"}] + TRAIN[3:]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", TEST)
    with pytest.raises(ValueError) as e:
        get_task("gsm8k", path=str(tmp_path / "{split}.jsonl"), cache_dir=str(tmp_path / "hf"))
    msg = str(e.value)
    assert "train.jsonl: 3 of 8 rows cannot be used" in msg
    assert "line 3: no answer" in msg and "line 5: no 'question' (prompt_template reads it)" in msg
    assert "line 6: no number after '####' in its answer" in msg and "\n" not in msg


@pytest.mark.parametrize("text, message", [
    ("", r"empty\.jsonl is empty"),
    ("\n\n", r"empty\.jsonl is empty"),
    ('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": \n', r"empty\.jsonl, line 2: not JSON"),
    ('{"question": "a", "answer": "#### 1"}\n["b", "#### 2"]\n', r"empty\.jsonl, line 2: not a JSON object"),
])
def test_an_empty_or_malformed_data_file_is_an_error_naming_it(tmp_path, text, message):
    (tmp_path / "empty.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        get_task("gsm8k", path=str(tmp_path / "empty.jsonl"), cache_dir=str(tmp_path / "hf")).generate(1)
    assert "\n" not in str(e.value)
