"""Atomic checkpoints: a crash mid-save never corrupts the last good one.

A checkpoint is a directory ``checkpoint-{step:07d}/`` holding the policy
(`save_pretrained`: config, safetensors weights, tokenizer; a model directory that
`load_policy` and ``stabledrl eval --model`` read) and ``trainer_state.pt`` (scheduler,
step, counters; the optimizer too when one process trains without accelerate, as `sft`
does). A training run adds ``accelerate/``, written by `accelerate.Accelerator.save_state`
on every process: the optimizer state, which under FSDP or DeepSpeed ZeRO-3 is sharded and
only whole when every process writes its part (accelerate also puts the sharded model's
weights there; with one process or DDP the trainer leaves them out, the policy holds them).
It is written under a temporary name in the same directory, then renamed into place by the
main process once every process has finished: a reader only ever sees complete ones. It
records the size of ``metrics.jsonl`` at that moment (``checkpoint.json``), so a resumed
run rewinds the metrics to exactly the rows written before it.

A run killed at any moment can be run again with the same command: `open_run_dir` removes
the temporary folders of an interrupted save (and puts back a checkpoint caught mid-swap),
and a run directory without a checkpoint starts afresh, its stale metrics removed, with or
without ``--resume``. ``version.json`` records the stabledrl that last wrote the run: an
older one refuses it rather than misread it. Permissions: 0666 / 0777 less the umask.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from stabledrl.config import ConfigError, load_config, to_dict
from stabledrl.metrics import metrics_line, read_metrics

__all__ = ["ACCELERATE_STATE", "open_run_dir", "finished_summary", "check_run_version", "run_dir_of", "save_checkpoint",
           "latest_checkpoint", "load_trainer_state", "write_atomic", "save_final", "rewind_metrics"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoint-(\d+)$")
_TMP = ".tmp-"  # every temporary file or folder of this module starts with it
_OLD = ".old-"  # a checkpoint (or final model) being replaced
ACCELERATE_STATE = "accelerate"
"""The folder of a checkpoint that `accelerate.Accelerator.save_state` writes."""
VERSION_FILE = "version.json"
"""The run directory's record of the stabledrl version that last wrote it: {"stabledrl": "0.1.0"}."""


def _umask() -> int:
    """The process umask, read without setting it (setting it, even briefly, races with
    other threads creating files) where /proc says it; else the set-and-restore way."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mkdtemp(parent: Path, prefix: str) -> Path:
    """A temporary folder with the permissions `mkdir` would give (not mkdtemp's 0o700)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def write_atomic(path: str | Path, text: str) -> None:
    """Write a text file via a temporary file and rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_TMP}{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0o600 would hide the run from its group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: str | Path, step: int, policy: Any, state: dict[str, Any], *, keep: int = 2,
                    accelerator: Any = None) -> Path:
    """Save `policy` (anything with `.save(dir)`) and `state` as checkpoint `step`;
    keep only the newest `keep` checkpoints.

    With `accelerator` (an `accelerate.Accelerator`, or anything with `is_main_process`,
    `wait_for_everyone` and `save_state`) this is a collective: every process calls it, and
    `accelerator.save_state` writes each process's part into ``accelerate/``. Only the main
    process saves `policy` (so it must already hold the full weights, gathered on every
    process beforehand) and `state`, and renames the folder into place once every process is
    done; every process returns once it is in place."""
    run_dir = Path(run_dir)
    main = accelerator is None or accelerator.is_main_process
    final = run_dir / f"checkpoint-{step:07d}"
    tmp = run_dir / f"{_TMP}{final.name}"  # one name that every process knows
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that failed
            _remove(tmp)
        tmp.mkdir()  # 0777 less the umask
    _wait(accelerator)
    try:
        if accelerator is not None:
            accelerator.save_state(str(tmp / ACCELERATE_STATE))
        if main:
            policy.save(tmp)
            torch.save(state, tmp / "trainer_state.pt")
        _wait(accelerator)  # every process's part is written
        if main:
            metrics = run_dir / "metrics.jsonl"  # the rows written so far belong to this checkpoint
            (tmp / "checkpoint.json").write_text(json.dumps(
                {"step": step, "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0}))
            if final.exists():  # re-saving the same step (e.g. after a resume): swap atomically
                old = run_dir / f"{_OLD}{final.name}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main:
        for old in sorted(_checkpoints(run_dir))[:-keep] if keep > 0 else []:
            shutil.rmtree(old[1], ignore_errors=True)
    _wait(accelerator)
    return final


def _wait(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "trainer_state.pt").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory in `run_dir`, or None."""
    found = _checkpoints(Path(run_dir))
    return found[-1][1] if found else None


def load_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    return torch.load(Path(checkpoint_dir) / "trainer_state.pt", weights_only=False)


def save_final(run_dir: str | Path, policy: Any) -> Path:
    """Save the finished model to ``{run_dir}/final`` (written aside, then swapped in)."""
    run_dir = Path(run_dir)
    final = run_dir / "final"
    tmp = _mkdtemp(run_dir, f"{_TMP}final-")
    policy.save(tmp)
    if final.exists():
        old = run_dir / f"{_OLD}final"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def rewind_metrics(path: str | Path, checkpoint: str | Path) -> None:
    """Cut the metrics file back to what it held when `checkpoint` was saved: the rows
    after it (the steps, evaluations and final evaluation of the interrupted run) would
    otherwise be written twice when the resumed run repeats them."""
    path = Path(path)
    if not path.is_file():
        return
    size = json.loads((Path(checkpoint) / "checkpoint.json").read_text())["metrics_bytes"]
    data = path.read_bytes()
    if size <= len(data) and data[size - 1: size] in (b"\n", b""):
        if size < len(data):
            with open(path, "r+b") as f:
                f.truncate(size)
        return
    # The file was edited since (it no longer holds the recorded rows): keep the rows up to its step.
    step = int(_NAME.match(Path(checkpoint).name).group(1))
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    write_atomic(path, "".join(metrics_line(r) for r in rows))


def _clean_leftovers(run_dir: Path) -> None:
    """Remove what an interrupted save left: temporary files and folders; a checkpoint
    (or final model) renamed aside mid-swap goes back in place if nothing replaced it."""
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(_OLD) and not (run_dir / p.name[len(_OLD):]).exists():
            logger.warning("%s: putting back %s, renamed aside by an interrupted save", run_dir, p.name[len(_OLD):])
            os.replace(p, run_dir / p.name[len(_OLD):])
        elif p.name.startswith((_TMP, _OLD)):
            logger.warning("%s: removing %s, left by an interrupted save", run_dir, p.name)
            _remove(p)


def open_run_dir(run_dir: str | Path, config: dict, *, resume: bool) -> Path | None:
    """Create (or reopen) a run directory and write its resolved config.

    Returns the checkpoint to resume from (with `resume`), or None for a fresh run.
    Refuses to start a fresh run over existing checkpoints. A directory without a
    checkpoint (a run killed before its first one) starts afresh either way: its metrics
    and TensorBoard events are removed, not appended to."""
    import yaml

    run_dir = Path(run_dir)
    check_run_version(run_dir)  # before anything in it is touched
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(run_dir)
    except OSError as e:
        raise _unwritable(run_dir, e) from None
    ckpt = latest_checkpoint(run_dir)
    if not resume and ckpt is not None:
        raise FileExistsError(f"{run_dir} already holds checkpoints; pass --resume or choose another output_dir")
    try:
        if ckpt is None:
            stale = [p for p in (run_dir / "metrics.jsonl", run_dir / "tensorboard") if p.exists()]
            if stale or resume:
                logger.warning("%s holds no checkpoint: starting from step 0%s", run_dir,
                               f" (removing the stale {', '.join(p.name for p in stale)})" if stale else "")
            for p in stale:
                _remove(p)
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        write_atomic(run_dir / VERSION_FILE, json.dumps({"stabledrl": _this_version()}) + "\n")
    except OSError as e:
        raise _unwritable(run_dir, e) from None
    return ckpt


def finished_summary(run_dir: str | Path, cfg: Any) -> dict | None:
    """The summary of a finished run made with the config `cfg`, or None if it has not finished.

    For benchmarks that reuse finished runs: a finished run made with another config (the
    same output_dir, a changed setting) is refused rather than passed off as this one. The
    saved config is read through `cfg`'s class, so a field added since takes its default."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        return None
    check_run_version(run_dir)
    saved = to_dict(load_config(type(cfg), run_dir / "config.yaml"))
    wanted = to_dict(cfg)
    if saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        raise ConfigError(f"{run_dir} holds a finished run made with another config (it differs in "
                          f"{', '.join(changed)}); remove it or choose another output directory")
    return json.loads((run_dir / "summary.json").read_text())


def _this_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stabledrl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from stabledrl import __version__

        return __version__


def check_run_version(run_dir: str | Path) -> None:
    """Refuse, in one line, a run directory that a newer stabledrl wrote: its checkpoints and
    config may hold what this version cannot read. A directory without the record (new, or
    written before versions were recorded) passes."""
    from packaging.version import Version

    record = Path(run_dir) / VERSION_FILE
    if not record.is_file():
        return
    try:
        theirs = str(json.loads(record.read_text())["stabledrl"])
        newer = Version(theirs) > Version(_this_version())
    except (ValueError, KeyError, TypeError):  # InvalidVersion is a ValueError
        raise ConfigError(f"{record} is not a version record like {{\"stabledrl\": \"0.1.0\"}}; fix or remove it") from None
    if newer:
        raise ConfigError(f"{run_dir} was written by stabledrl {theirs}, and this is stabledrl {_this_version()}: "
                          f"upgrade stabledrl to {theirs} or later to use it, or start a fresh run in another output_dir")


def run_dir_of(model: str | Path) -> Path | None:
    """The run directory whose checkpoint or final model `model` is, or None (a shipped
    model, a Hub name, any other directory)."""
    model = Path(model)
    is_run_model = model.name == "final" or _NAME.match(model.name)
    if is_run_model and model.is_dir() and (model.parent / "config.yaml").is_file():
        return model.parent
    return None


def _unwritable(run_dir: Path, e: OSError) -> ConfigError:
    where = f": {e.filename}" if e.filename else ""
    return ConfigError(f"output_dir {run_dir} cannot be written ({e.strerror or e}{where}); "
                       "choose another output_dir or fix its permissions")


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()
