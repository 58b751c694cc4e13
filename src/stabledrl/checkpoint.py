"""Atomic checkpoints: a crash mid-save never corrupts the last good one.

A checkpoint is a directory ``checkpoint-{step:07d}/`` holding the policy
(`save_pretrained`: config, safetensors weights, tokenizer) and ``trainer_state.pt``
(optimizer, scheduler, step, RNG states). It is written under a temporary name in the
same directory, then renamed into place, so a reader only ever sees complete ones.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["open_run_dir", "save_checkpoint", "latest_checkpoint", "load_trainer_state", "write_atomic", "save_final",
           "truncate_metrics"]

_NAME = re.compile(r"^checkpoint-(\d+)$")


def write_atomic(path: str | Path, text: str) -> None:
    """Write a text file via a temporary file and rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, policy: Any, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Save `policy` (anything with `.save(dir)`) and `state` as checkpoint `step`;
    keep only the newest `keep` checkpoints."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"checkpoint-{step:07d}"
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".tmp-checkpoint-{step:07d}-"))
    try:
        policy.save(tmp)
        torch.save(state, tmp / "trainer_state.pt")
        if final.exists():  # re-saving the same step (e.g. after a resume): swap atomically
            old = run_dir / f".old-{final.name}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(_checkpoints(run_dir))[:-keep] if keep > 0 else []:
        shutil.rmtree(old[1], ignore_errors=True)
    return final


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
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tmp-final-"))
    policy.save(tmp)
    if final.exists():
        old = run_dir / ".old-final"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def truncate_metrics(path: str | Path, step: int) -> None:
    """Drop JSONL metric lines after `step`: on resume they belong to the replaced run."""
    import json

    path = Path(path)
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in keep))


def open_run_dir(run_dir: str | Path, config: dict, *, resume: bool) -> Path | None:
    """Create (or reopen, with `resume`) a run directory and write its resolved config.

    Returns the checkpoint to resume from, or None for a fresh run. Refuses to start a
    fresh run over existing checkpoints, and to resume without one."""
    import yaml

    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
    if not resume and ckpt is not None:
        raise FileExistsError(f"{run_dir} already holds checkpoints; pass --resume or choose another output_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    return ckpt
