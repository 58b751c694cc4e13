"""What the dataset-backed tasks (gsm8k, math, code) share: `DatasetSplits` (the rows of a
local file or a Hub dataset, drawn reproducibly with `datasets`), prompt templates, and
`last_boxed` (the content of the last \\boxed{...}).

Data files: `path` is a Hub dataset name or a local .json/.jsonl/.parquet/.csv file. In a
local path, "{split}" is replaced by the split's name (`train_split` / `test_split`), e.g.
``path="data/gsm8k/{split}.jsonl"``; a local path without "{split}" serves every split
(for evaluation-only files; do not train on it too). Nothing is downloaded unless `path`
is a Hub name.

Local files are read, and every row checked (`DatasetTask.check_row`), when the task is
built: an empty file, a line that is not a JSON object, or rows a problem cannot be made
from are a ValueError that names the file and the lines, at start-up rather than at the
training step that first draws a bad row.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from stabledrl.tasks.base import Split

__all__ = ["DatasetSplits", "DatasetTask", "format_prompt", "last_boxed", "require_path", "template_columns"]

logger = logging.getLogger(__name__)

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class DatasetSplits:
    """The rows of a dataset's train and test splits, loaded lazily with `datasets`."""

    path: str
    """Hub dataset name, or a local file whose "{split}" is replaced by the split name."""
    hub_config: str | None = None
    """Hub configuration (e.g. "main" for openai/gsm8k); unused for local files."""
    train_split: str = "train"
    """Split name behind split="train"."""
    test_split: str = "test"
    """Split name behind split="test"."""
    cache_dir: str | None = None
    """`datasets` cache directory; None = its default (~/.cache/huggingface/datasets)."""
    check_row: Callable[[dict[str, Any]], str | None] | None = None
    """Why a row cannot become a problem (None if it can); every row is checked as it loads."""
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def split_name(self, split: Split) -> str:
        if split == "validation":
            raise ValueError("a task read from data has no validation split (only train and test): "
                             "set eval_split: test, or hold out rows of the train file in a file of their own")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return self.train_split if split == "train" else self.test_split

    def is_local(self) -> bool:
        return os.path.splitext(self.path)[1].lower() in _LOCAL_BUILDERS or os.path.exists(self.path)

    def rows(self, split: Split) -> list[dict[str, Any]]:
        name = self.split_name(split)
        if name not in self._rows:
            self._rows[name] = self._load(name)
        return self._rows[name]

    def _load(self, name: str) -> list[dict[str, Any]]:
        import datasets  # slow to import; only the dataset-backed tasks need it

        lines = None  # the line of each row, where the file is JSON lines
        if self.is_local():
            file = self.path.replace("{split}", name)
            builder = _LOCAL_BUILDERS.get(os.path.splitext(file)[1].lower())
            if builder is None:
                raise ValueError(f"path {file!r}: use a .json, .jsonl, .parquet or .csv file")
            if not os.path.isfile(file):
                raise FileNotFoundError(f"no data file {file!r} for split {name!r} (path={self.path!r})")
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
        """`n` distinct rows of `split` as (index, row), reproducible from (`salt`, `seed`).

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
        """Rows of every split that loads (a missing local split file is skipped)."""
        out: list[dict[str, Any]] = []
        for split in ("train", "test"):
            try:
                out += self.rows(split)  # type: ignore[arg-type]
            except FileNotFoundError:
                pass
        return out


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
    (`self.data`, built in `__post_init__`) and the longest prompt. A subclass sets `name`
    and `prompt_template`, and overrides `prompt_of` if a row's prompt needs more."""

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

    def __post_init__(self) -> None:
        self.data = DatasetSplits(require_path(self.path, self.name), self.hub_config, self.train_split,
                                  self.test_split, self.cache_dir, check_row=self.check_row)
        if self.data.is_local():
            self.data.loaded_rows()  # read and check every row now, not when a step first draws it

    def prompt_of(self, row: dict[str, Any]) -> str:
        return format_prompt(self.prompt_template, row)

    def check_row(self, row: dict[str, Any]) -> str | None:
        """Why `row` cannot become a problem, or None; a subclass adds its own checks."""
        template = getattr(self, "prompt_template", None)  # a subclass may build prompts otherwise
        missing = [c for c in template_columns(template) if row.get(c) is None] if isinstance(template, str) else []
        return f"no {' or '.join(map(repr, missing))} (prompt_template reads it)" if missing else None

    @property
    def prompt_length(self) -> int:
        """Longest prompt of both splits in characters (loads them: a Hub dataset downloads)."""
        return max((len(self.prompt_of(r)) for r in self.data.loaded_rows()), default=0)
