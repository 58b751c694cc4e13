"""A save killed at any stage, or refused by the storage, never costs the last complete checkpoint
(stabledrl.checkpoint; docs/scale-out.md "Checkpoints").

A kill is a forked process dying with os._exit at a stage of a save (`checkpoint._stage`): no
exception, no clean-up, as under SIGKILL. A full disk is a file-size limit (RLIMIT_FSIZE, with
SIGXFSZ ignored so that a write fails with EFBIG instead of killing the process): the tests run
as root here, which a read-only folder does not stop. The two-process version, under FSDP, is
tests/test_distributed.py's `test_a_process_killed_mid_save_...`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import stabledrl.checkpoint as checkpoint
from stabledrl.checkpoint import latest_checkpoint, load_trainer_state, open_run_dir, save_checkpoint, save_final


class Policy:
    """Writes `nbytes` of weights with safetensors, as `save_pretrained` does (or with plain `open`)."""

    def __init__(self, nbytes: int = 4000, plain: bool = False, model: torch.nn.Module | None = None):
        self.nbytes, self.plain, self.model = nbytes, plain, model

    def save(self, path):
        if self.plain:
            Path(path, "model.bin").write_bytes(b"w" * self.nbytes)
        else:
            save_file({"w": torch.ones(self.nbytes // 4)}, str(Path(path, "model.safetensors")))


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes of this process beyond `nbytes` fail with EFBIG (the soft limit, restored after)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def _dies_at(stage: str, save) -> None:
    """Run `save` in a forked process that dies (exit status 9) when it reaches `stage`."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        def die(name):
            if name == stage:
                os._exit(9)

        checkpoint._stage = die
        try:
            save()
        finally:
            os._exit(0)  # did not reach the stage
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, f"the save never reached {stage}"


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("stage, survivor", [
    ("begin", 10), ("state", 10),  # the folder made; the (here absent) accelerate state written
    ("written", 10),  # every part written, no commit record
    ("recorded", 10),  # the commit record written, not yet renamed into place
    ("committed", 20),  # in place: the new one is complete, the old one not yet pruned
])
def test_a_save_killed_at_any_stage_leaves_a_complete_checkpoint_to_resume(tmp_path, stage, survivor):
    save_checkpoint(tmp_path, 10, Policy(), {"step": 10}, keep=1)
    before = _files(tmp_path / "checkpoint-0000010")
    _dies_at(stage, lambda: save_checkpoint(tmp_path, 20, Policy(8000), {"step": 20}, keep=1))
    assert latest_checkpoint(tmp_path).name == f"checkpoint-{survivor:07d}"
    if stage == "recorded":  # complete but for its name: not a checkpoint
        assert json.loads((tmp_path / ".tmp-checkpoint-0000020" / "checkpoint.json").read_text())["step"] == 20
    ckpt = open_run_dir(tmp_path, {}, resume=True)  # what --resume does: leftovers removed, the last complete taken
    assert ckpt.name == f"checkpoint-{survivor:07d}" and load_trainer_state(ckpt) == {"step": survivor}
    assert _files(tmp_path / "checkpoint-0000010") == before  # untouched, even where superseded
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_final_killed_mid_save_leaves_the_previous_final_model(tmp_path):
    save_final(tmp_path, Policy(plain=True))
    _dies_at("final", lambda: save_final(tmp_path, Policy(8000, plain=True)))
    assert (tmp_path / "final" / "model.bin").read_bytes() == b"w" * 4000
    open_run_dir(tmp_path, {}, resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "final", "version.json"]


def test_a_checkpoint_counts_only_with_its_commit_record(tmp_path):
    save_checkpoint(tmp_path, 10, Policy(), {"step": 10})
    ckpt = save_checkpoint(tmp_path, 20, Policy(), {"step": 20})
    (ckpt / "checkpoint.json").unlink()  # everything else there, e.g. an interrupted copy of the folder
    assert latest_checkpoint(tmp_path).name == "checkpoint-0000010"
    assert open_run_dir(tmp_path, {}, resume=True).name == "checkpoint-0000010"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads the synced files' names from /proc")
def test_every_file_is_durable_before_the_commit_record_and_the_record_before_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    ckpt = save_checkpoint(tmp_path, 10, Policy(), {"step": 10})
    tmp = str(tmp_path / ".tmp-checkpoint-0000010")
    files = [f"{tmp}/{name}" for name in ("model.safetensors", "trainer_state.pt")]
    record = synced.index(f"{tmp}/checkpoint.json")
    assert all(synced.index(f) < record for f in files)
    assert synced[record + 1:] == [tmp, str(tmp_path)]  # the record's folder, then the rename
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint.json", "model.safetensors", "trainer_state.pt"]


def test_pruning_never_leaves_a_half_removed_checkpoint_that_counts(tmp_path, monkeypatch):
    # keep=1: saving step 20 removes step 10. Killed half-way through that removal, the
    # remains must not pass for a checkpoint (they hold checkpoint.json but lack their weights).
    save_checkpoint(tmp_path, 10, Policy(), {"step": 10}, keep=1)
    real = checkpoint.shutil.rmtree

    class Killed(BaseException):
        pass

    def dies_removing(path, ignore_errors=False):
        if Path(path).is_dir() and "0000010" in Path(path).name:
            (Path(path) / "model.safetensors").unlink()
            raise Killed
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dies_removing)
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, 20, Policy(), {"step": 20}, keep=1)
    monkeypatch.undo()
    assert [p.name for _, p in checkpoint._checkpoints(tmp_path)] == ["checkpoint-0000020"]
    assert open_run_dir(tmp_path, {}, resume=True).name == "checkpoint-0000020"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000020", "config.yaml", "version.json"]


@pytest.mark.parametrize("policy, state, fault", [
    (Policy(100_000), {"step": 20}, "File too large)"),  # safetensors: "(os error 27)"
    (Policy(100_000, plain=True), {"step": 20}, "File too large)"),  # Python's OSError
    (Policy(), {"step": 20, "m": torch.ones(50_000)}, "a short write: unexpected pos"),  # torch.save to a path
])
def test_a_save_the_storage_refuses_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path, policy, state, fault):
    save_checkpoint(tmp_path, 10, Policy(), {"step": 10}, keep=1)
    before = _files(tmp_path / "checkpoint-0000010")
    size = sum(len(b) for b in before.values())  # the size of a checkpoint, known from the last one
    with file_size_limit(64_000), pytest.raises(OSError) as e:
        save_checkpoint(tmp_path, 20, policy, state, keep=1)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"could not save checkpoint-0000020 in {tmp_path} ({fault}")
    assert f"it needs about {size / 1e6:.3f} MB free there" in line and "may not exceed 0.064 MB (ulimit -f)" in line
    assert "the last complete checkpoint, checkpoint-0000010, is intact" in line
    assert _files(tmp_path / "checkpoint-0000010") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000010"]  # the failed one removed


@pytest.mark.parametrize("message", [
    "Error while serializing: I/O error: File too large (os error 27)",  # safetensors 0.8
    'Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, message: "File too large" })',  # 0.4
])
def test_each_safetensors_release_words_a_refused_write_so_that_it_is_read(message):
    assert checkpoint._storage_fault(RuntimeError(message)) == os.strerror(27)


def test_the_first_save_refused_estimates_its_size_from_the_parameters(tmp_path):
    # no checkpoint yet: 4 bytes of weights and 8 of AdamW's m and v per trainable parameter
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))  # 10,100 + 1,010
    model[1].requires_grad_(False)
    with file_size_limit(10_000), pytest.raises(OSError) as e:
        save_checkpoint(tmp_path, 10, Policy(40_000, model=model), {"step": 10})
    assert f"it needs about {12 * 10_100 / 1e6:.3f} MB free there" in str(e.value)
    assert "no checkpoint was lost" in str(e.value)
    with file_size_limit(10_000), pytest.raises(OSError, match=r"^could not save final/ in .*about 0\.040 MB free"):
        save_final(tmp_path, Policy(40_000, model=model))  # the weights only
    assert not list(tmp_path.iterdir())


def test_a_refused_final_save_of_gathered_bf16_weights_estimates_2_bytes_a_weight(tmp_path):
    # what training_run hands save_final: the gathered weights, cast to bf16 (10,100 + 1,010 weights)
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    gathered = Policy(40_000, model=model)
    gathered.state_dict = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    with file_size_limit(10_000), pytest.raises(OSError, match=r"^could not save final/ in .*about 0\.022 MB free"):
        save_final(tmp_path, gathered)  # 2 × 11,110 bytes = 0.022 MB, not the float32 0.044


def _save_without_root(run_dir: Path, step: int) -> str:
    """`save_checkpoint` in a forked child that has given up root's rights (uid/gid 65534, where
    root would write into a read-only folder anyway); the OSError's line it raised, or ""."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        line = ""
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            save_checkpoint(run_dir, step, Policy(), {"step": step})
        except OSError as e:
            line = str(e)
        finally:
            os.write(write, line.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        line = f.read()
    os.waitpid(pid, 0)
    return line


def test_a_read_only_run_dir_stops_in_one_line(tmp_path):
    # As root (CI's user) the save runs in a child without root's rights, in a folder others may enter
    run_dir = Path(tempfile.mkdtemp(prefix="read-only-")) if os.geteuid() == 0 else tmp_path
    try:
        save_checkpoint(run_dir, 10, Policy(), {"step": 10})
        run_dir.chmod(0o555)
        if os.geteuid() == 0:
            line = _save_without_root(run_dir, 20)
        else:
            with pytest.raises(OSError) as e:
                save_checkpoint(run_dir, 20, Policy(), {"step": 20})
            line = str(e.value)
        assert re.match(rf"^could not save checkpoint-0000020 in {run_dir} \(Permission denied: "
                        rf"{run_dir}/.tmp-checkpoint-0000020\).* make it writable", line), line
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-0000010"]
    finally:
        run_dir.chmod(0o755)
        if run_dir != tmp_path:
            shutil.rmtree(run_dir)


def test_a_training_run_whose_save_fails_stops_in_one_line_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    # One process: the step-2 checkpoint hits the file-size limit. `stabledrl train` stops with
    # one line; checkpoint-1 is intact, and --resume from it ends as the run that never failed.
    from stabledrl.cli import main
    from tests.conftest import make_tiny_policy, metric_rows

    make_tiny_policy(seed=41).save(tmp_path / "init")
    (tmp_path / "empty.yaml").write_text("{}\n")

    def train(out, *extra):
        sets = {"model": tmp_path / "init", "output_dir": out, "task.name": "sudoku", "steps": 2, "save_every": 1,
                "prompts_per_step": 2, "group_size": 4, "mu": 2, "lr": 1e-3, "eval_n": 2, "threads": 1,
                "estimator.method": "mc", "estimator.num_samples": 1}
        return main(["train", "--config", str(tmp_path / "empty.yaml"), *extra,
                     *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))])

    assert train(tmp_path / "full") == 0
    saves, limit = [], contextlib.ExitStack()

    def full_disk_at_the_second(name):
        if name == "begin" and len(saves) == 1:
            limit.enter_context(file_size_limit(64_000))  # the weights are 139 kB
        saves.extend([name] if name == "begin" else [])

    monkeypatch.setattr(checkpoint, "_stage", full_disk_at_the_second)
    capsys.readouterr()
    with limit:
        assert train(tmp_path / "crash") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"stabledrl train: error: could not save checkpoint-0000002 in {tmp_path / 'crash'} (")
    assert "the last complete checkpoint, checkpoint-0000001, is intact. Make room" in err
    assert [p.name for _, p in checkpoint._checkpoints(tmp_path / "crash")] == ["checkpoint-0000001"]
    monkeypatch.undo()
    assert train(tmp_path / "crash", "--resume") == 0
    assert metric_rows(tmp_path / "crash") == metric_rows(tmp_path / "full")
    a, b = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "full", tmp_path / "crash"))
    assert all(torch.equal(a[k], b[k]) for k in a)
