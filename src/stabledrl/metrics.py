"""The ``metrics.jsonl`` of a run: one JSON object per line, one line per logged row.

Non-finite numbers (a skipped step's NaN gradient norm, an infinite ratio) are written as
``null``: bare ``NaN`` / ``Infinity`` are not JSON, and other readers (jq, pandas,
JavaScript) refuse them. `read_metrics` reads them, and the bare tokens of files written
before this rule, as None.

A run killed while writing a row leaves its last line cut short; `read_metrics` drops that
line with a warning (a resumed run rewinds the file to its checkpoint anyway). Any other
line that is not a JSON object is an error naming the file and the line.

Imports nothing heavy: `stabledrl report` reads metrics without torch.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

__all__ = ["metrics_line", "read_metrics"]

logger = logging.getLogger(__name__)


def metrics_line(row: dict[str, Any]) -> str:
    """`row` as one line of strict JSON (non-finite floats as null), newline included."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; see the module docstring for null and cut-off lines."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")  # the last item is "" when the file ends in a newline
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=lambda token: None)  # NaN, Infinity, -Infinity
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line and no newline after it: a write cut short
                logger.warning("%s: dropped line %d, cut short (the run stopped while writing it)", path, number)
                break
            raise ValueError(f"{path}, line {number}: not JSON ({e.msg}); delete or repair that line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}: not a JSON object; delete or repair that line")
        rows.append(row)
    return rows
