"""Atomic checkpoints: a crash or a lost process mid-save never corrupts the last good one.

A checkpoint is a directory ``checkpoint-{step:07d}/`` holding the policy
(`save_pretrained`: a model directory that `load_policy` and ``stabledrl eval --model`` read),
``trainer_state.pt`` (scheduler, step, counters; the optimizer too when one process trains
without accelerate, as `sft` does), in a training run ``accelerate/`` (`Accelerator.save_state`
on every process: the optimizer state, sharded under FSDP or ZeRO-3, with its RNG states), and
last ``checkpoint.json``, its commit record (the step; the size of ``metrics.jsonl`` then, to
which a resumed run rewinds the metrics). It is written as ``.tmp-checkpoint-{step}``; once every
process has written its part, the main process fsyncs every file, writes and fsyncs the record,
and renames the folder into place. A checkpoint is complete when ``checkpoint-{step}/`` holds
``checkpoint.json``: only complete ones are resumed from or counted by ``keep``.

A run killed at any moment (any process, any stage of a save) can be run again with the same
command and ``--resume``: `open_run_dir` removes the temporary folders of an interrupted save
(and puts back a checkpoint caught mid-swap). A save the storage refuses stops in one line naming
the path and the space needed. ``version.json`` records the stabledrl that last wrote the run:
an older one refuses it. Permissions: 0666 / 0777 less the umask.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import resource
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
COMMIT = "checkpoint.json"
"""A checkpoint's commit record, written last: a checkpoint directory without it is incomplete."""
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
    """Write a text file via a temporary file and rename (both made durable)."""
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
    _sync_dir(path.parent)


def _stage(name: str) -> None:
    """A point of a save, by name: "begin" (every process, its folder made), "state" (every process,
    its part of accelerate's state written), "written" (main: every part written), "recorded" (main:
    the commit record written, not yet renamed), "committed" (main: in place, old ones not yet
    pruned), "final" (main: final/ written aside, not yet swapped in). Nothing happens here: the
    tests stop a process at each (tests/test_distributed.py, tests/test_save_faults.py)."""


def save_checkpoint(run_dir: str | Path, step: int, policy: Any, state: dict[str, Any], *, keep: int = 2,
                    accelerator: Any = None) -> Path:
    """Save `policy` (anything with `.save(dir)`) and `state` as checkpoint `step`;
    keep only the newest `keep` complete checkpoints (0: all), the new one always among them.

    With `accelerator` (an `accelerate.Accelerator`, or anything with `is_main_process`,
    `wait_for_everyone` and `save_state`) this is a collective: every process calls it, and
    `accelerator.save_state` writes each process's part into ``accelerate/``. Only the main
    process saves `policy` (so it must already hold the full weights, gathered on every
    process beforehand) and `state`, and commits the folder once every process is done;
    every process returns once it is in place. A write the storage refuses raises an OSError
    of one line: the path, the space the checkpoint needs, the last complete one intact."""
    run_dir = Path(run_dir)
    main = accelerator is None or accelerator.is_main_process
    final = run_dir / f"checkpoint-{step:07d}"
    tmp = run_dir / f"{_TMP}{final.name}"  # one name that every process knows
    previous = latest_checkpoint(run_dir)
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that failed
                _remove(tmp)
            tmp.mkdir()  # 0777 less the umask
        _wait(accelerator)
        _stage("begin")
        if accelerator is not None:
            accelerator.save_state(str(tmp / ACCELERATE_STATE))
        _stage("state")
        if main:
            policy.save(tmp)
            torch.save(state, tmp / "trainer_state.pt")
        _wait(accelerator)  # every process's part is written
        if main:
            _commit(run_dir, tmp, final, step)
    except BaseException as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        fault = _storage_fault(e)
        if fault is None:
            raise
        need = _tree_bytes(previous) if previous is not None else _estimate_bytes(policy, optimizer=True)
        raise _save_failed(final.name, run_dir, fault, need, previous) from e
    if main:
        _stage("committed")
        for _, old in sorted(_checkpoints(run_dir))[:-keep] if keep > 0 else []:
            if old != final:
                _discard(old)
    _wait(accelerator)
    return final


def _commit(run_dir: Path, tmp: Path, final: Path, step: int) -> None:
    """Make every file in `tmp` durable, write the commit record last, and rename it into place."""
    _stage("written")
    _sync_tree(tmp)
    metrics = run_dir / "metrics.jsonl"  # the rows written so far belong to this checkpoint
    record = {"step": step, "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0}
    with open(tmp / COMMIT, "w", encoding="utf-8") as f:
        f.write(json.dumps(record))
        f.flush()
        os.fsync(f.fileno())
    _sync_dir(tmp)
    _stage("recorded")
    _swap_in(tmp, final)


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (a step saved again after a resume, or final/)
    is renamed aside first and removed after, so a crash leaves one or the other in place."""
    if final.exists():
        old = final.parent / f"{_OLD}{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _sync_dir(final.parent)


def _discard(checkpoint: Path) -> None:
    """Remove a checkpoint: renamed out of the checkpoints' names first, so a crash mid-removal
    leaves a temporary folder (removed at the next start), never a checkpoint missing files."""
    doomed = checkpoint.parent / f"{_TMP}removed-{checkpoint.name}"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _wait(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _sync_dir(path: Path) -> None:
    """fsync a directory, so the names created or renamed in it survive a crash of the machine."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # file systems that cannot sync a directory (some network ones) say EINVAL
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _sync_tree(path: Path) -> None:
    """fsync every file and folder under `path`, whichever process wrote it (one machine, or a
    file system shared by the nodes)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(folder))


# An I/O error as the writers report it: Python's OSError (torch.distributed.checkpoint wraps it in
# a CheckpointException that quotes it), safetensors' "(os error 27)" (0.4's "Os { code: 27"),
# torch.save's short write.
_IO_ERROR = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)|Os \{ code: (\d+)|unexpected pos \d+ vs \d+|file write failed")


def _storage_fault(e: BaseException) -> str | None:
    """What the storage refused in the failed save `e` ("File too large: PATH"), or None when
    the failure is not a storage one (an interrupt, a bug: raised as it is)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen and not isinstance(e, (KeyboardInterrupt, SystemExit)):
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return f"{e.strerror or os.strerror(e.errno)}" + (f": {e.filename}" if e.filename else "")
        m = _IO_ERROR.search(str(e))
        if m:
            code = m.group(1) or m.group(2) or m.group(3)
            return os.strerror(int(code)) if code else f"a short write: {m.group(0)}"
        e = e.__cause__ or e.__context__
    return None


def _save_failed(what: str, run_dir: Path, fault: str, need: int, previous: Path | None) -> OSError:
    """The one-line error of a save the storage refused."""
    where = run_dir if run_dir.is_dir() else next(p for p in run_dir.parents if p.is_dir())
    free = shutil.disk_usage(where).free
    kept = f"the last complete checkpoint, {previous.name}, is intact" if previous else "no checkpoint was lost"
    needs = f"it needs about {_gb(need)} free there" if need else "it needs free space there"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # `ulimit -f`: EFBIG however much is free
    limited = f" and files may not exceed {_gb(limit)} (ulimit -f)" if limit != resource.RLIM_INFINITY else ""
    return OSError(f"could not save {what} in {run_dir} ({fault}): {needs}, {_gb(free)} is free now{limited}; "
                   f"{kept}. Make room there (or make it writable), then run again with --resume")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.3f} MB"


def _tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _estimate_bytes(policy: Any, *, optimizer: bool) -> int:
    """The size of a save of `policy` before one was made: the weights it saves, when it holds
    them gathered (`state_dict`, in the dtype they are written in: bf16 for a bf16 final/), else
    4 bytes per trainable parameter of `policy.model`; with `optimizer`, 8 more per parameter
    for AdamW's m and v. 0 without a model."""
    state = getattr(policy, "state_dict", None)
    if not optimizer and isinstance(state, dict):
        return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    model = getattr(policy, "model", None)
    if not isinstance(model, torch.nn.Module):
        return 0
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)  # ZeRO-3: ds_numel
    return n * (12 if optimizer else 4)


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of `run_dir` (those holding their commit record), by step."""
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (p / COMMIT).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory in `run_dir` (one holding ``checkpoint.json``), or None."""
    found = _checkpoints(Path(run_dir))
    return found[-1][1] if found else None


def load_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    return torch.load(Path(checkpoint_dir) / "trainer_state.pt", weights_only=False)


def save_final(run_dir: str | Path, policy: Any) -> Path:
    """Save the finished model to ``{run_dir}/final`` (written aside, made durable, then swapped
    in). A write the storage refuses raises an OSError of one line, as `save_checkpoint` does."""
    run_dir = Path(run_dir)
    final = run_dir / "final"
    tmp = None
    try:
        tmp = _mkdtemp(run_dir, f"{_TMP}final-")
        policy.save(tmp)
        _sync_tree(tmp)
        _stage("final")
        _swap_in(tmp, final)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        fault = _storage_fault(e)
        if fault is None:
            raise
        raise _save_failed("final/", run_dir, fault, _estimate_bytes(policy, optimizer=False),
                           latest_checkpoint(run_dir)) from e
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
    from stabledrl import __version__  # the one place the version is written (pyproject reads it too)

    return __version__


def check_run_version(run_dir: str | Path) -> None:
    """Refuse, in one line, a run directory that a newer stabledrl wrote: its checkpoints and
    config may hold what this version cannot read. A directory without the record (new, or
    written before versions were recorded) passes."""
    from packaging.version import Version

    record = Path(run_dir) / VERSION_FILE
    if not record.is_file():
        return
    ours = _this_version()
    try:
        theirs = str(json.loads(record.read_text())["stabledrl"])
        newer = Version(theirs) > Version(ours)
    except (ValueError, KeyError, TypeError):  # InvalidVersion is a ValueError
        raise ConfigError(f"{record} is not a version record like {{\"stabledrl\": \"0.1.0\"}}; fix or remove it") from None
    if newer:
        raise ConfigError(f"{run_dir} was written by stabledrl {theirs}, and this is stabledrl {ours}: "
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
