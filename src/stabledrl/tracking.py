"""Where a run's numbers go: ``metrics.jsonl`` always, and TensorBoard, wandb or trackio.

`Tracker` is the one object a loop logs through: `Tracker(run_dir, report_to, config=...)`
at the start (logs the resolved config and the package version once), `log(row)` per
metrics row, `log_samples(samples, step)` at each evaluation (a table of prompt,
completion, reward, correct per backend, and every sample in ``samples.jsonl``), `close()`.

Backends (`report_to`, any subset; TensorBoard needs nothing beyond the base install):

- ``tensorboard``: ``RUN/tensorboard``; the samples as a markdown text summary.
- ``wandb`` (``pip install 'stabledrl[wandb]'``): ``RUN/wandb``; without network set
  ``WANDB_MODE=offline`` and upload later with ``wandb sync RUN/wandb/offline-run-*``.
  ``WANDB_PROJECT`` names the project (default ``stabledrl``).
- ``trackio`` (``pip install 'stabledrl[trackio]'``, versions: docs/logging.md): local first, a
  SQLite file per project under ``TRACKIO_DIR`` (default: ``RUN/trackio`` when unset
  before trackio is first imported); ``TRACKIO_PROJECT`` names the project.

Non-finite numbers are left out of the backends (JSONL writes them as null, `metrics`).
A resumed run (`start_step` > 0) keeps ``samples.jsonl`` up to its checkpoint and continues
the same wandb run; a fresh one starts the file afresh.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, Iterable, Sequence

from stabledrl.metrics import metrics_line

__all__ = ["BACKENDS", "SAMPLE_COLUMNS", "Tracker", "samples_markdown"]

BACKENDS = ("tensorboard", "wandb", "trackio")
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "correct")
_EXTRA = {"wandb": "pip install 'stabledrl[wandb]'", "trackio": "pip install 'stabledrl[trackio]'"}


def _version() -> str:
    from stabledrl import __version__

    return __version__


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1), step left out."""
    out = {}
    for k, v in row.items():
        if k != "step" and isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v) if isinstance(v, bool) else v
    return out


def samples_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of sample rows (TensorBoard's text plugin renders it)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r[c]) for c in SAMPLE_COLUMNS) + " |\n" for r in rows)


def _keep_samples_up_to(path: Path, step: int) -> None:
    """Drop the sample rows logged after `step` (a resumed run logs them again)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    kept = []
    for ln in lines:
        try:
            if json.loads(ln)["step"] <= step:
                kept.append(ln + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a line cut short by a killed run: the rows after it are not trusted
    path.write_text("".join(kept), encoding="utf-8")


class Tracker:
    """The logs of one run (see the module docstring). `enabled=False` (a process other
    than the main one) makes every call a no-op and opens nothing."""

    def __init__(self, run_dir: str | Path, report_to: Iterable[str] = ("tensorboard",), *,
                 config: dict[str, Any] | None = None, start_step: int = 0, enabled: bool = True,
                 max_table_rows: int = 64) -> None:
        self.report_to = tuple(dict.fromkeys(report_to))
        unknown = [b for b in self.report_to if b not in BACKENDS]
        if unknown:
            raise ValueError(f"report_to: unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
        self.run_dir, self.enabled, self.max_table_rows = Path(run_dir), enabled, max_table_rows
        self._tb = self._wandb = self._trackio = self._metrics = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = {**(config or {}), "stabledrl_version": _version()}
        samples = self.run_dir / "samples.jsonl"
        if start_step > 0:
            _keep_samples_up_to(samples, start_step)
        else:
            samples.write_text("", encoding="utf-8")
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = open(samples, "a", encoding="utf-8")
        if "tensorboard" in self.report_to:
            self._open_tensorboard(config, start_step)
        if "wandb" in self.report_to:
            self._open_wandb(config, resume=start_step > 0)
        if "trackio" in self.report_to:
            self._open_trackio(config, resume=start_step > 0)

    def _open_tensorboard(self, config: dict[str, Any], step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._tb.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", step)

    def _open_wandb(self, config: dict[str, Any], *, resume: bool) -> None:
        wandb = _import("wandb")
        id_file = self.run_dir / "wandb-run-id"  # one wandb run across resumes
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "stabledrl"), name=self.run_dir.name,
                                 dir=str(self.run_dir), id=run_id, resume="allow", config=config)

    def _open_trackio(self, config: dict[str, Any], *, resume: bool) -> None:
        os.environ.setdefault("TRACKIO_DIR", str(self.run_dir / "trackio"))  # read when trackio is imported
        trackio = _import("trackio")
        self._trackio = trackio
        takes = inspect.signature(trackio.init).parameters
        quiet = {k: False for k in ("auto_log_cpu", "auto_log_gpu") if k in takes}  # no system metrics (newer trackio)
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "stabledrl"), name=self.run_dir.name, config=config,
                     resume="allow" if resume else "never", **quiet)

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (it holds its "step"): a line of metrics.jsonl, its finite numbers to each backend."""
        if not self.enabled:
            return
        self._metrics.write(metrics_line(row))
        self._metrics.flush()
        step, scalars = int(row["step"]), _scalars(row)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._trackio is not None:
            self._trackio.log(scalars, step=step)

    def log_samples(self, samples: Sequence[dict[str, Any]], step: int) -> None:
        """An evaluation's samples (dicts with prompt, completion, reward, correct): every one
        to samples.jsonl, the first `max_table_rows` as a table to each backend."""
        if not self.enabled:
            return
        rows = [{"step": step, **{c: s[c] for c in SAMPLE_COLUMNS[1:]}} for s in samples]
        self._samples.write("".join(json.dumps(r) + "\n" for r in rows))
        self._samples.flush()
        table = rows[: self.max_table_rows]
        data = [[r[c] for c in SAMPLE_COLUMNS] for r in table]
        if self._tb is not None:
            self._tb.add_text("eval/samples", samples_markdown(table), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({"eval/samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=data)}, step=step)
        if self._trackio is not None:
            import pandas  # trackio's own dependency; older trackio reads column names from a DataFrame only

            frame = pandas.DataFrame(data, columns=list(SAMPLE_COLUMNS))
            self._trackio.log({"eval/samples": self._trackio.Table(dataframe=frame)}, step=step)

    def close(self) -> None:
        """Flush and close every backend (the wandb and trackio runs are finished)."""
        if not self.enabled or self._metrics is None:
            return
        self._metrics.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # finish() may return before the run's .wandb log is written; teardown waits for it
        if self._trackio is not None:
            self._trackio.finish()
        self._metrics = None


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"report_to: {name} is not installed ({e}); {_EXTRA[name]}, or drop it from "
                          "report_to") from None
