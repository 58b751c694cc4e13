"""README.md stays short and true: its links resolve, its commands name files, configs and CLI
verbs that exist, and every figure it quotes is also in docs/ (where its command is).

Text only, no torch: the CLI parser and the settings import without it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stabledrl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOTEBOOK = ROOT / "docs" / "experiments.md"
MAX_LINES = 300

# Numbers in README prose that are not measurements.
NOT_FIGURES = {"3.10"}  # the Python version

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
FIGURE = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(%|×|x\b)?(?![\w.]*\d)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(md: str) -> str:
    """The Markdown without its fenced blocks and inline code."""
    return CODE_SPAN.sub(" ", FENCE.sub("\n", md))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("\n", md)):
        s = _slug(title)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _exists(rel: str) -> bool:
    return (ROOT / rel).exists()


def test_slug_matches_github():
    # GitHub: "## Measured on this machine (2 CPU cores, fp32)" -> #measured-on-this-machine-2-cpu-cores-fp32
    assert _slug("Measured on this machine (2 CPU cores, fp32)") == "measured-on-this-machine-2-cpu-cores-fp32"
    assert _slug("What the Countdown gain is made of: the default decoder") == \
        "what-the-countdown-gain-is-made-of-the-default-decoder"
    assert _slug("`sdmc` and μ") == "sdmc-and-μ"
    assert _anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_readme_is_short():
    n = len(_text(README).splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; move detail to docs/ (at most {MAX_LINES})"


@pytest.mark.parametrize("doc", [README, NOTEBOOK], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    md = _text(doc)
    bad = []
    for target in LINK.findall(_prose(md).replace("\n", " ")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if not file.exists():
            bad.append(f"{target}: no file {rel}")
            continue
        if anchor and file.suffix == ".md" and anchor not in _anchors(_text(file)):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    assert not bad, f"broken links in {doc.name}:\n" + "\n".join(bad)


def _cells(row: str) -> int:
    """The number of cells of a Markdown table row (escaped pipes and pipes in code do not split)."""
    return CODE_SPAN.sub("code", row.replace("\\|", "")).strip().strip("|").count("|") + 1


@pytest.mark.parametrize("doc", [README, NOTEBOOK], ids=lambda p: p.name)
def test_tables_are_rectangular(doc):
    bad = []
    for table in re.findall(r"(?:^\|.*\n)+", FENCE.sub("\n", _text(doc)), re.M):
        rows = table.splitlines()
        if len(rows) < 2 or not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rows[1].strip()):
            bad.append(f"a table without a header separator: {rows[0][:60]}")
            continue
        bad += [f"{len(rows)} rows, {_cells(r)} cells, not {_cells(rows[0])}: {r[:60]}"
                for r in rows if _cells(r) != _cells(rows[0])]
    assert not bad, "\n".join(bad)


def _shell_commands(md: str) -> list[list[str]]:
    """Each simple command of the README's bash blocks, as argv (comments and continuations handled)."""
    cmds = []
    for lang, body in FENCE.findall(md):
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            cmd: list[str] = []
            for w in words + ["&&"]:
                if w in ("&&", "||", ";", "|"):
                    if cmd:
                        cmds.append(cmd)
                    cmd = []
                else:
                    cmd.append(w)
    return cmds


def _check_stabledrl(argv: list[str]) -> list[str]:
    """Parse `stabledrl VERB ...` with the real parser; the files it names must exist."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return [f"stabledrl {' '.join(argv)}: the CLI does not accept it"]
    bad = []
    for name in ("config", "model"):
        value = getattr(args, name, None)
        if value and not value.startswith("runs/") and not _exists(value):
            bad.append(f"stabledrl {argv[0]}: --{name} {value} does not exist")
    return bad


def _check_command(argv: list[str]) -> list[str]:
    head = argv[0]
    if head == "stabledrl":
        return _check_stabledrl(argv[1:])
    if head == "accelerate":
        bad = []
        if "--config_file" in argv and not _exists(argv[argv.index("--config_file") + 1]):
            bad.append(f"accelerate: no {argv[argv.index('--config_file') + 1]}")
        if "-m" not in argv or argv[argv.index("-m") + 1] != "stabledrl":
            return bad + [f"{' '.join(argv)}: launches something other than -m stabledrl"]
        return bad + _check_stabledrl(argv[argv.index("-m") + 2:])
    if head == "python":
        if argv[1] == "-m":
            return [] if argv[2] in ("pytest", "stabledrl") else [f"python -m {argv[2]}: not expected"]
        return [] if _exists(argv[1]) else [f"python {argv[1]}: no such file"]
    if head == "pip":
        return []
    return [f"{head}: a command the README test does not know; teach tests/test_readme.py"]


def test_code_block_commands_exist():
    cmds = _shell_commands(_text(README))
    assert len(cmds) >= 8  # the two commands (six steps) and the real-model launch
    bad = [msg for argv in cmds for msg in _check_command(argv)]
    assert not bad, "\n".join(bad)


def test_inline_commands_and_paths_exist():
    verbs = next(a.choices for a in build_parser()._actions if a.dest == "verb")
    bad = []
    for span in CODE_SPAN.findall(FENCE.sub("\n", _text(README))):
        words = span.split()
        if words[0] == "stabledrl" and len(words) > 1 and words[1] not in verbs:
            bad.append(f"`{span}`: no verb {words[1]!r} (verbs: {sorted(verbs)})")
        elif re.fullmatch(r"[\w.-]+(/[\w.-]+)+/?", span) and not span.startswith("runs/"):
            if not (_exists(span) or (ROOT / "src" / span).exists()):
                bad.append(f"`{span}`: no such path")
        elif re.fullmatch(r"(countdown|sudoku|sft)-[\w-]+", span):
            if not (_exists(f"configs/{span}.yaml") or (ROOT / "checkpoints" / span).is_dir()):
                bad.append(f"`{span}`: neither configs/{span}.yaml nor checkpoints/{span}")
    assert not bad, "\n".join(bad)


def test_readme_runs_the_ci_test_command():
    ci = _text(ROOT / ".ci" / "run").splitlines()
    command = ci[ci.index("# The README's test command:") + 1]
    assert command in _text(README).splitlines(), "README's test command and .ci/run differ"


def test_extras_named_by_the_readme_exist():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads(_text(ROOT / "pyproject.toml"))["project"]["optional-dependencies"]
    for extra in re.findall(r'pip install -e "\.\[([\w,-]+)\]"', _text(README)):
        assert set(extra.split(",")) <= set(extras), extra


def test_methods_table_names_every_objective_and_estimator():
    # the registries are the lists: every objective a config can name is in the table's `objective`
    # column, every estimator somewhere in the README
    from typing import get_args

    from stabledrl.settings import OBJECTIVE_SECTIONS, Method

    md = _text(README)
    table = re.search(r"^\| method \| `objective` \|.*?\n(?=[^|])", md, re.S | re.M).group(0)
    column = {span for row in table.splitlines()[2:] for span in CODE_SPAN.findall(row.split("|")[2])}
    missing = [x for x in OBJECTIVE_SECTIONS if x not in column]
    missing += [x for x in get_args(Method) if x not in set(CODE_SPAN.findall(md))]
    assert not missing, f"README does not name {missing}"


def test_every_figure_is_in_docs():
    """Each number in README prose with a decimal point, a % or a speed-up factor (× or x) also
    appears, with the same unit, in some docs/*.md: a figure changed or invented in the README alone
    fails. A token check, not a proof that the docs give the same figure for the same thing."""
    docs = "\n".join(_text(p) for p in sorted((ROOT / "docs").glob("*.md")))
    md = _text(README)
    prose = CODE_SPAN.sub(" ", FENCE.sub(lambda m: m.group(0) if m.group(1) == "" else "\n", md))
    missing = set()
    for number, unit in FIGURE.findall(prose):
        if ("." not in number and not unit) or number in NOT_FIGURES:
            continue
        unit_pattern = {"": r"(?![\d.]?\d)", "%": "%", "×": "[×x]", "x": "[×x]"}[unit]
        if not re.search(rf"(?<![\d.]){re.escape(number)}{unit_pattern}", docs):
            missing.add(number + unit)
    assert not missing, f"figures in README.md found nowhere in docs/: {sorted(missing)}"
