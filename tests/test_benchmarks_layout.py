"""benchmarks/ shows what is maintained: every script at its top is listed in benchmarks/README.md
(what it measures, its command, its JSON), every one-off of the lab notebook sits in benchmarks/lab/
and is run by a command in docs/, and every `python benchmarks/...py` command quoted in the READMEs,
docs/ and the scripts' own docstrings names a file that exists.

Text only: no script is imported (no torch)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LAB = BENCH / "lab"
INDEX = BENCH / "README.md"

# `python benchmarks/x.py` or `python benchmarks/lab/x.py`; in Markdown prose a command may wrap
# between `python` and its path.
COMMAND = re.compile(r"\bpython3?\s+(benchmarks/[\w./-]+?\.py)\b")
ROW = re.compile(r"^\|\s*`?([\w-]+\.py)`?\s*\|", re.M)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py"))


def _listed() -> list[str]:
    """The scripts named in the first column of benchmarks/README.md's table."""
    return ROW.findall(_text(INDEX))


def _docs() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): _text(p) for p in sorted((ROOT / "docs").glob("*.md"))}


def test_command_pattern():
    assert COMMAND.findall("run `python\nbenchmarks/lab/x.py --n 3` and python benchmarks/y.py.") == \
        ["benchmarks/lab/x.py", "benchmarks/y.py"]
    assert ROW.findall("| script | what |\n|---|---|\n| a.py | A |\n| `b_c.py` | B |\n") == ["a.py", "b_c.py"]


def test_layout_is_scripts_lab_and_results():
    folders = sorted(p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["lab", "results"], f"benchmarks/ holds scripts, lab/ and results/ only, not {folders}"
    assert not [p for p in LAB.iterdir() if p.is_dir() and p.name != "__pycache__"], "benchmarks/lab/ is flat"


def test_every_maintained_script_is_listed_once():
    listed = _listed()
    scripts = _scripts(BENCH)
    assert scripts, "no scripts found in benchmarks/"
    unlisted = [s for s in scripts if s not in listed]
    assert not unlisted, (f"benchmarks/{unlisted}: neither listed in benchmarks/README.md (a maintained "
                          "benchmark) nor moved to benchmarks/lab/ (a one-off of the lab notebook)")
    missing = [s for s in listed if s not in scripts]
    assert not missing, f"benchmarks/README.md lists {missing}, which are not at the top of benchmarks/"
    doubled = sorted({s for s in listed if listed.count(s) > 1})
    assert not doubled, f"benchmarks/README.md lists {doubled} twice"


def test_every_listed_script_has_a_command_in_the_index():
    commands = set(COMMAND.findall(_text(INDEX)))
    bare = [s for s in _listed() if f"benchmarks/{s}" not in commands]
    assert not bare, f"benchmarks/README.md gives no `python benchmarks/<script>` command for {bare}"


def test_every_lab_script_is_run_by_the_notebook():
    cited = {c for text in _docs().values() for c in COMMAND.findall(text)}
    uncited = [s for s in _scripts(LAB) if f"benchmarks/lab/{s}" not in cited]
    assert not uncited, (f"benchmarks/lab/{uncited}: no `python benchmarks/lab/<script>` command in docs/ "
                         "reproduces what it measured; cite it beside its figure or list it as maintained")


def test_index_names_the_lab():
    assert "benchmarks/lab/" in _text(INDEX)


def test_quoted_commands_name_existing_files():
    sources = {"README.md": _text(ROOT / "README.md"), "benchmarks/README.md": _text(INDEX), **_docs()}
    for script in sorted(BENCH.glob("*.py")) + sorted(LAB.glob("*.py")):
        sources[script.relative_to(ROOT).as_posix()] = _text(script)
    bad = sorted({f"{where}: python {path}" for where, text in sources.items()
                  for path in COMMAND.findall(text) if not (ROOT / path).is_file()})
    assert not bad, "commands that name no file (a script moved or renamed?):\n" + "\n".join(bad)
