"""What the dataset-backed tasks (gsm8k, math, code) share: `DatasetSplits` (the rows of a
local file or a Hub dataset, drawn reproducibly with `datasets`), prompt templates, and
`last_boxed` (the content of the last \\boxed{...}).

Data files: `path` is a Hub dataset name or a local .json/.jsonl/.parquet/.csv file. In a
local path, "{split}" is replaced by the split's name (`train_split` / `test_split`), e.g.
``path="data/gsm8k/{split}.jsonl"``; a local path without "{split}" serves every split
(for evaluation-only files; do not train on it too). Nothing is downloaded unless `path`
is a Hub name.
"""

from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

from stabledrl.tasks.base import Split

__all__ = ["DatasetSplits", "DatasetTask", "format_prompt", "last_boxed", "require_path"]

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
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def split_name(self, split: Split) -> str:
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

        if self.is_local():
            file = self.path.replace("{split}", name)
            builder = _LOCAL_BUILDERS.get(os.path.splitext(file)[1].lower())
            if builder is None:
                raise ValueError(f"path {file!r}: use a .json, .jsonl, .parquet or .csv file")
            if not os.path.isfile(file):
                raise FileNotFoundError(f"no data file {file!r} for split {name!r} (path={self.path!r})")
            ds = datasets.load_dataset(builder, data_files=file, split="train", cache_dir=self.cache_dir)
        else:
            ds = datasets.load_dataset(self.path, self.hub_config, split=name, cache_dir=self.cache_dir)
        return ds.to_list()

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
                                  self.test_split, self.cache_dir)

    def prompt_of(self, row: dict[str, Any]) -> str:
        return format_prompt(self.prompt_template, row)

    @property
    def prompt_length(self) -> int:
        """Longest prompt of both splits in characters (loads them: a Hub dataset downloads)."""
        return max((len(self.prompt_of(r)) for r in self.data.loaded_rows()), default=0)
