"""What the dataset-backed tasks (gsm8k, math, code) share: `DatasetSplits` (the rows of a
local file or a Hub dataset, drawn reproducibly with `datasets`), prompt templates, and
`last_boxed` (the content of the last \\boxed{...}).

Data files: `path` is a Hub dataset name or a local .json/.jsonl/.parquet/.csv file. In a
local path, "{split}" is replaced by the split's name (`train_split` / `test_split`), e.g.
``path="data/gsm8k/{split}.jsonl"``; a local path without "{split}" serves every split
(for evaluation-only files; do not train on it too). Nothing is downloaded unless `path`
is a Hub name. On a machine with network, ``python -m stabledrl.tasks.datasets export
gsm8k --out data/gsm8k`` writes data/gsm8k/train.jsonl and test.jsonl (`export`).

Validation: `validation_size` rows of the train split, those whose problem (`id_of`) has
the smallest salted SHA-256, leave train and form split="validation": the same rows
whatever the file's order or the machine, disjoint from train, and from test as far as the
files are.

Local files are read, and every row checked (`DatasetTask.check_row`), when the task is
built: an empty file, a line that is not a JSON object, or rows a problem cannot be made
from are a ValueError that names the file and the lines, at start-up rather than at the
training step that first draws a bad row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from stabledrl.tasks.base import Split

__all__ = ["DatasetSplits", "DatasetTask", "EXPORTS", "export", "format_prompt", "last_boxed", "problem_hash",
           "require_path", "template_columns"]

logger = logging.getLogger(__name__)

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def convention_template(templates: dict[str, str], convention: str, given: str | None) -> str:
    """A task's prompt template: `given`, else its convention's; an unknown convention is refused."""
    if convention not in templates:
        raise ValueError(f"convention must be one of {sorted(templates)}, got {convention!r}")
    return templates[convention] if given is None else given


@dataclass
class DatasetSplits:
    """The rows of a dataset's train, validation and test splits, loaded lazily with `datasets`."""

    path: str
    """Hub dataset name, or a local file whose "{split}" is replaced by the split name."""
    hub_config: str | None = None
    """Hub configuration (e.g. "main" for openai/gsm8k); unused for local files."""
    train_split: str = "train"
    """Split name behind split="train" (and the rows validation is carved from)."""
    test_split: str = "test"
    """Split name behind split="test"."""
    cache_dir: str | None = None
    """`datasets` cache directory; None = its default (~/.cache/huggingface/datasets)."""
    check_row: Callable[[dict[str, Any]], str | None] | None = None
    """Why a row cannot become a problem (None if it can); every row is checked as it loads."""
    keep_row: Callable[[dict[str, Any]], bool] | None = None
    """Which rows the train split keeps (validation is carved from those); the test split keeps all.
    None: every row (a length filter, for example)."""
    validation_size: int = 0
    """Rows of the train split that form split="validation" instead (module docstring); 0: none."""
    id_of: Callable[[dict[str, Any]], str] | None = None
    """A row's problem, hashed to choose the validation rows; None: the whole row."""
    task: str | None = None
    """The task's name, for the `export` command a missing file's error gives."""
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)
    _parts: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)  # train, validation
    _kept_rows: list[dict[str, Any]] | None = field(default=None, init=False, repr=False)  # the filter's, once

    def __post_init__(self) -> None:
        size = self.validation_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"validation_size must be a whole number >= 0, got {self.validation_size!r}")

    def split_name(self, split: Split) -> str:
        """The file split (the "{split}" of a local path) that `split`'s rows come from."""
        if split not in ("train", "validation", "test"):
            raise ValueError(f"split must be 'train', 'validation' or 'test', got {split!r}")
        return self.test_split if split == "test" else self.train_split

    def is_local(self) -> bool:
        return os.path.splitext(self.path)[1].lower() in _LOCAL_BUILDERS or os.path.exists(self.path)

    def rows(self, split: Split) -> list[dict[str, Any]]:
        """The rows of `split`, in file order."""
        name = self.split_name(split)
        if split == "validation" and self.validation_size == 0:
            raise ValueError(f"task {self.task or self.path!r} has no validation split: set its option "
                             f"validation_size (e.g. 500 rows carved from the {name!r} split), or eval_split: test")
        if split == "test":
            return self._file_rows(name)
        if self.validation_size == 0:
            return self._kept(name)
        if self.is_local() and "{split}" not in self.path:
            raise ValueError(f"validation_size: {self.path!r} serves the test split too, so validation rows would be "
                             "test rows; use separate files (a path with {split})")
        if not self._parts:
            self._parts = self._carve(self._kept(name))
        return self._parts[split]

    def _kept(self, name: str) -> list[dict[str, Any]]:
        """The rows of file split `name` that `keep_row` keeps (all without one)."""
        if self.keep_row is None:
            return self._file_rows(name)
        if self._kept_rows is None:
            rows = self._file_rows(name)
            kept = [r for r in rows if self.keep_row(r)]
            if not kept:
                raise ValueError(f"the {name!r} split of {self.path!r}: none of its {len(rows)} rows passes the task's "
                                 "filter of training rows (math: max_level, max_problem_chars, max_problem_words)")
            logger.info("%s: %d of %d training rows kept by the task's filter", self.path, len(kept), len(rows))
            self._kept_rows = kept
        return self._kept_rows

    def _file_rows(self, name: str) -> list[dict[str, Any]]:
        if name not in self._rows:
            self._rows[name] = self._load(name)
        return self._rows[name]

    def _carve(self, rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """{"train": ..., "validation": ...}: the `validation_size` rows whose problem hashes lowest."""
        if self.validation_size >= len(rows):
            raise ValueError(f"validation_size {self.validation_size} leaves no training rows: the "
                             f"{self.train_split!r} split of {self.path!r} has {len(rows)}")
        key = self.id_of or (lambda row: json.dumps(row, sort_keys=True, default=str))
        order = sorted(range(len(rows)), key=lambda i: (problem_hash(key(rows[i])), i))
        chosen = set(order[:self.validation_size])
        return {"train": [r for i, r in enumerate(rows) if i not in chosen],
                "validation": [r for i, r in enumerate(rows) if i in chosen]}

    def _missing(self, file: str, name: str) -> FileNotFoundError:
        hint = ""
        if self.task in EXPORTS:
            out = os.path.dirname(self.path) or "."
            command = f"python -m stabledrl.tasks.datasets export {self.task} --out {out}"
            hint = (f"; on a machine with network, write them with: {command}" if os.path.basename(self.path) ==
                    "{split}.jsonl" else f"; on a machine with network, run: {command} (it writes train.jsonl "
                    f"and test.jsonl) and set path: {os.path.join(out, '{split}.jsonl')}")
        return FileNotFoundError(f"no data file {file!r} for split {name!r} (path={self.path!r}){hint}")

    def _load(self, name: str) -> list[dict[str, Any]]:
        import datasets  # slow to import; only the dataset-backed tasks need it

        lines = None  # the line of each row, where the file is JSON lines
        if self.is_local():
            file = self.path.replace("{split}", name)
            builder = _LOCAL_BUILDERS.get(os.path.splitext(file)[1].lower())
            if builder is None:
                raise ValueError(f"path {file!r}: use a .json, .jsonl, .parquet or .csv file")
            if not os.path.isfile(file):
                raise self._missing(file, name)
            if builder == "json":
                lines = _json_rows(file)  # what datasets would fail on, named by line
            try:
                ds = datasets.load_dataset(builder, data_files=file, split="train", cache_dir=self.cache_dir)
            except Exception as e:  # e.g. a bare StopIteration from an empty csv
                raise ValueError(f"{file}: cannot read the rows ({type(e).__name__}: {e}); check the file") from None
            if len(ds) == 0:
                raise ValueError(f"{file} is empty: it holds no rows")
            source = file
        else:
            ds = datasets.load_dataset(self.path, self.hub_config, split=name, cache_dir=self.cache_dir)
            source = f"{self.path} ({name} split)"
        rows = ds.to_list()
        if self.check_row is not None:
            _check_rows(rows, self.check_row, source, lines)
        return rows

    def sample(self, n: int, split: Split, seed: int, salt: str) -> list[tuple[int, dict[str, Any]]]:
        """`n` distinct rows of `split` as (index in the split, row), reproducible from (`salt`, `seed`).

        Draws without replacement; asking for more rows than the split holds is an error
        (a silent cycle would repeat problems within one batch).
        """
        rows = self.rows(split)
        if not 0 <= n <= len(rows):
            raise ValueError(f"asked for {n} problems but the {split} split ({self.split_name(split)!r} of "
                             f"{self.path!r}) has {len(rows)} rows")
        rng = random.Random(f"{salt}-{split}-{seed}")
        return [(i, rows[i]) for i in rng.sample(range(len(rows)), n)]

    def loaded_rows(self) -> list[dict[str, Any]]:
        """Rows of every file split that loads (a missing local split file is skipped: its
        error, with the command that makes it, comes when a split is drawn from)."""
        out: list[dict[str, Any]] = []
        for name in dict.fromkeys((self.train_split, self.test_split)):
            try:
                out += self._file_rows(name)
            except FileNotFoundError:
                pass
        return out


def problem_hash(key: str) -> int:
    """A stable 64-bit hash of a problem's text (salted SHA-256; not Python's hash())."""
    return int.from_bytes(hashlib.sha256(f"stabledrl-validation:{key}".encode()).digest()[:8], "big")


def _json_rows(file: str) -> list[int] | None:
    """The line of each row of a JSON-lines file (None for a file holding one JSON document).
    Raises a ValueError naming the file and line where a row is not a JSON object, or if
    there is no row at all."""
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    if file.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # JSON lines under a .json name
        if doc == []:
            raise ValueError(f"{file} is empty: it holds no rows")
        if doc is not None:
            return None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}, line {number}: not JSON ({e.msg}); repair or remove that line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{file}, line {number}: not a JSON object; each line must be one row {{...}}")
        lines.append(number)
    if not lines:
        raise ValueError(f"{file} is empty: it holds no rows")
    return lines


def _check_rows(rows: list[dict[str, Any]], check: Callable[[dict[str, Any]], str | None], source: str,
                lines: list[int] | None) -> None:
    """A ValueError naming the first few rows `check` rejects (by line in JSON lines, else by row number)."""
    bad = [(i, why) for i, row in enumerate(rows) if (why := check(row)) is not None]
    if not bad:
        return
    where = (lambda i: f"line {lines[i]}") if lines is not None and len(lines) == len(rows) else (lambda i: f"row {i + 1}")
    shown = "; ".join(f"{where(i)}: {why}" for i, why in bad[:5]) + ("; ..." if len(bad) > 5 else "")
    raise ValueError(f"{source}: {len(bad)} of {len(rows)} rows cannot be used ({shown}); fix or remove them")


def template_columns(template: str) -> list[str]:
    """The row columns a `str.format` template reads ("{question}" -> ["question"])."""
    names = (f for _, f, _, _ in string.Formatter().parse(template) if f)
    return list(dict.fromkeys(re.split(r"[.\[]", f, maxsplit=1)[0] for f in names))


def format_prompt(template: str, row: dict[str, Any]) -> str:
    """`template` filled from the row's columns; a ValueError names the template if it does not fit."""
    try:
        return template.format_map(row)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompt_template {template!r} does not fit a row with columns {sorted(row)}: {e!r}") from None


def require_path(path: str | None, task: str) -> str:
    """`path`, or a ValueError that names the missing option."""
    if not path:
        raise ValueError(f"task {task!r} needs the option path= (a local data file, with {{split}} for the "
                         f"split name, or a Hub dataset name)")
    return path


# --- answers ------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last top-level \\boxed{...} (or \\fbox{...}) in `text`, unwrapping a box
    that holds nothing but another box; None without a complete one. Linear time."""
    span = _last_boxed_span(text)
    return None if span is None else span[1]


_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_BARE = re.compile(r"[^\s$]+")  # "\boxed 5": up to the next space or "$"


def _last_boxed_span(text: str) -> tuple[int, str] | None:
    """(position, content) of the last top-level box; see `last_boxed`."""
    closing: dict[int, int] = {}  # index of "{" -> index of its "}"
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    found: tuple[int, int, int] | None = None  # (position, start, end) of the content
    end = -1
    for m in _BOX.finditer(text):
        if m.start() < end:
            continue  # inside the previous box
        if m.group(1) is None:
            bare = _BARE.match(text, m.end())
            if bare:
                found, end = (m.start(), bare.start(), bare.end()), bare.end()
        elif m.end() - 1 in closing:
            found, end = (m.start(), m.end(), closing[m.end() - 1]), closing[m.end() - 1]
    if found is None:
        return None
    pos, lo, hi = found
    while True:  # \boxed{\boxed{72}} -> 72: unwrap a box holding only a box
        inner = _BOX.match(text, lo + len(text[lo:hi]) - len(text[lo:hi].lstrip()))
        if inner is None or inner.group(1) is None or inner.end() - 1 not in closing:
            break
        close = closing[inner.end() - 1]
        if text[close + 1: hi].strip():
            break
        lo, hi = inner.end(), close
    return pos, text[lo:hi]


@dataclass
class DatasetTask:
    """Fields and behaviour the dataset-backed tasks share: where their rows come from
    (`self.data`, built in `__post_init__`) and the longest prompt. A subclass sets `name`,
    `prompt_template` and `id_column`, and overrides `prompt_of` if a row's prompt needs more."""

    path: str | None = None
    """Required: a local file ("data/NAME/{split}.jsonl") or a Hub dataset name."""
    hub_config: str | None = None
    """Hub configuration (e.g. "main" for openai/gsm8k); unused for local files."""
    train_split: str = "train"
    """Split name for split="train" (the "{split}" of a local path)."""
    test_split: str = "test"
    """Split name for split="test"."""
    cache_dir: str | None = None
    """Where `datasets` caches what it loads; None = its default."""
    validation_size: int = 0
    """Rows carved out of the train split as split="validation" (chosen by a hash of the
    problem's text, `stabledrl.tasks.datasets`); 0: no validation split."""

    id_column: ClassVar[str | None] = None
    """The column holding a row's problem text (what the validation carve hashes)."""

    def __post_init__(self) -> None:
        column = self.id_column
        id_of = None if column is None else (lambda row: str(row.get(column)))
        self.data = DatasetSplits(require_path(self.path, self.name), self.hub_config, self.train_split,
                                  self.test_split, self.cache_dir, check_row=self.check_row, keep_row=self.keep_row,
                                  validation_size=self.validation_size, id_of=id_of, task=self.name)
        if self.data.is_local():
            self.data.loaded_rows()  # read and check every row now, not when a step first draws it

    def prompt_of(self, row: dict[str, Any]) -> str:
        return format_prompt(self.prompt_template, row)

    keep_row: ClassVar[Callable[[dict[str, Any]], bool] | None] = None
    """Which training rows to keep (`DatasetSplits.keep_row`); a subclass may define one."""

    def check_row(self, row: dict[str, Any]) -> str | None:
        """Why `row` cannot become a problem, or None; a subclass adds its own checks."""
        template = getattr(self, "prompt_template", None)  # a subclass may build prompts otherwise
        missing = [c for c in template_columns(template) if row.get(c) is None] if isinstance(template, str) else []
        return f"no {' or '.join(map(repr, missing))} (prompt_template reads it)" if missing else None

    @property
    def prompt_length(self) -> int:
        """Longest prompt of both splits in characters (loads them: a Hub dataset downloads)."""
        return max((len(self.prompt_of(r)) for r in self.data.loaded_rows()), default=0)


# --- getting the data onto an offline machine ----------------------------------------

EXPORTS: dict[str, tuple[str, str | None]] = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math": ("ankner/math-500", None),  # d1's: MATH's train split less MATH-500, and MATH-500 as test
}
"""Task -> (Hub dataset, configuration) that `export` reads by default."""


def export(task: str, out: str, *, hub: str | None = None, config: str | None = None,
           cache_dir: str | None = None) -> list[str]:
    """Write the train and test splits of `task`'s Hub dataset (or `hub`) to OUT/train.jsonl
    and OUT/test.jsonl, one JSON object a line, for ``path: OUT/{split}.jsonl``. Needs network."""
    import datasets

    if hub is None:
        if task not in EXPORTS:
            raise ValueError(f"no default dataset for task {task!r}: name one with --hub (known: {sorted(EXPORTS)})")
        hub, config = EXPORTS[task][0], config or EXPORTS[task][1]
    os.makedirs(out, exist_ok=True)
    written = []
    for split in ("train", "test"):
        file = os.path.join(out, f"{split}.jsonl")
        ds = datasets.load_dataset(hub, config, split=split, cache_dir=cache_dir)
        with open(file, "w", encoding="utf-8") as f:
            for row in ds:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        written.append(file)
    return written


def main(argv: list[str] | None = None) -> None:
    """``python -m stabledrl.tasks.datasets export TASK --out DIR [--hub NAME] [--config C]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stabledrl.tasks.datasets")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a task's train/test splits as JSON lines (needs network)")
    ex.add_argument("task", help=f"one of {sorted(EXPORTS)}, or any name with --hub")
    ex.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    ex.add_argument("--hub", help="Hub dataset to read instead of the task's default")
    ex.add_argument("--config", help="its configuration")
    ex.add_argument("--cache-dir", help="the datasets cache directory")
    args = parser.parse_args(argv)
    for file in export(args.task, args.out, hub=args.hub, config=args.config, cache_dir=args.cache_dir):
        print(file)


if __name__ == "__main__":
    main()
