import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.checkpoint import (
    finished_summary,
    latest_checkpoint,
    load_trainer_state,
    open_run_dir,
    rewind_metrics,
    save_checkpoint,
    save_final,
    write_atomic,
)
from stabledrl.metrics import metrics_line, read_metrics


class FakePolicy:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.saves = 0

    def save(self, path):
        self.saves += 1
        (path / "model.bin").write_text("weights")
        if self.fail:
            raise OSError("disk full")


class FakeAccelerator:
    """Process `rank` of a run whose processes are threads; `save_state` writes its part
    (the last rank slowly, so that a main process that did not wait would rename too early)."""

    def __init__(self, rank: int, barrier: threading.Barrier):
        self.rank, self.barrier = rank, barrier
        self.is_main_process = rank == 0

    def wait_for_everyone(self):
        self.barrier.wait(timeout=30)

    def save_state(self, path):
        if self.rank == self.barrier.parties - 1:
            time.sleep(0.3)
        os.makedirs(path, exist_ok=True)
        Path(path, f"part-{self.rank}").write_text(str(self.rank))


def test_save_keeps_the_newest_and_a_crash_mid_save_leaves_the_last_good_one(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, FakePolicy(), {"step": step}, keep=2)
    assert latest_checkpoint(tmp_path).name == "checkpoint-0000030"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000020", "checkpoint-0000030"]
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 40, FakePolicy(fail=True), {"step": 40})
    assert latest_checkpoint(tmp_path).name == "checkpoint-0000030"
    assert load_trainer_state(latest_checkpoint(tmp_path)) == {"step": 30}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000020", "checkpoint-0000030"]


def test_an_incomplete_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint-0000050").mkdir()  # no checkpoint.json: e.g. copied half-way
    save_checkpoint(tmp_path, 40, FakePolicy(), {"step": 40, "t": torch.ones(2)})
    assert latest_checkpoint(tmp_path).name == "checkpoint-0000040"
    assert latest_checkpoint(tmp_path / "missing") is None


def _metrics(run_dir, *rows):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("".join(metrics_line(r) for r in rows))


def test_a_run_dir_without_a_checkpoint_starts_clean_with_or_without_resume(tmp_path):
    # Killed after the step-0 evaluation, before the first checkpoint: the same command again
    # must not append a second step-0 row to the stale metrics.
    for resume in (False, True):
        _metrics(tmp_path, {"step": 0, "eval_accuracy": 0.1})
        (tmp_path / "tensorboard").mkdir(exist_ok=True)
        assert open_run_dir(tmp_path, {"seed": 0}, resume=resume) is None
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
        assert (tmp_path / "config.yaml").read_text() == "seed: 0\n"


def test_leftovers_of_an_interrupted_save_are_cleaned_at_start_and_resume(tmp_path):
    save_checkpoint(tmp_path, 10, FakePolicy(), {"step": 10})
    (tmp_path / ".tmp-checkpoint-0000020-abc").mkdir()  # killed while saving step 20
    (tmp_path / ".tmp-final-xyz").mkdir()  # killed while saving the final model
    (tmp_path / ".tmp-summary.json.q1").write_text("{")  # killed inside write_atomic
    os.replace(tmp_path / "checkpoint-0000010", tmp_path / ".old-checkpoint-0000010")  # killed mid-swap
    assert open_run_dir(tmp_path, {}, resume=True).name == "checkpoint-0000010"  # restored, not lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000010", "config.yaml", "version.json"]


def test_resume_rewinds_the_metrics_to_the_checkpoint(tmp_path):
    # The run saved its last checkpoint (step 2), logged the final evaluation, and was
    # killed while saving the final model: resumed, it evaluates again, so the first
    # final-evaluation row must go (else two rows for the same evaluation).
    _metrics(tmp_path, {"step": 0, "eval_accuracy": 0.1}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4})
    kept = (tmp_path / "metrics.jsonl").read_text()
    ckpt = save_checkpoint(tmp_path, 2, FakePolicy(), {"step": 2})
    _metrics(tmp_path, {"step": 2, "eval_accuracy": 0.2})
    rewind_metrics(tmp_path / "metrics.jsonl", ckpt)
    assert (tmp_path / "metrics.jsonl").read_text() == kept
    # A row cut off mid-write after the checkpoint goes too.
    (tmp_path / "metrics.jsonl").write_text(kept + '{"step": 3, "lo')
    rewind_metrics(tmp_path / "metrics.jsonl", ckpt)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_a_metrics_file_edited_since_the_checkpoint_rewinds_by_step(tmp_path):
    # 94 bytes recorded at the checkpoint; the file rewritten since holds 64: the recorded size
    # no longer marks a row's end, so the rows up to the checkpoint's step are kept.
    _metrics(tmp_path, {"step": 0, "loss": 0.123456789, "grad_norm": 1.0}, {"step": 1, "loss": 0.5, "grad_norm": 2.0})
    ckpt = save_checkpoint(tmp_path, 1, FakePolicy(), {"step": 1})
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": NaN}\n{"step": 2}\n{"step": 3, "lo')
    assert json.loads((ckpt / "checkpoint.json").read_text())["metrics_bytes"] > 64
    rewind_metrics(tmp_path / "metrics.jsonl", ckpt)
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0}, {"step": 1, "loss": None}]


def test_files_and_folders_respect_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "config.yaml", "a: 1\n")
        ckpt = save_checkpoint(tmp_path, 1, FakePolicy(), {"step": 1})
        final = save_final(tmp_path, FakePolicy())
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    # mkstemp / mkdtemp alone would give 0o600 / 0o700 whatever the umask
    assert mode(tmp_path / "config.yaml") == 0o640
    assert mode(ckpt) == mode(final) == 0o750


def test_a_checkpoint_of_several_processes_holds_every_part_once_all_have_written(tmp_path):
    # Three processes save step 10 together: each writes its part of accelerate's state
    # (process 2 last); the main process alone writes the policy and the trainer state, and
    # renames the folder once all parts are there; each returns with the checkpoint in place.
    barrier = threading.Barrier(3)
    policy = FakePolicy()
    returned = {}

    def process(rank):
        path = save_checkpoint(tmp_path, 10, policy, {"step": 10}, accelerator=FakeAccelerator(rank, barrier))
        returned[rank] = (path, path.is_dir())

    threads = [threading.Thread(target=process, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ckpt = tmp_path / "checkpoint-0000010"
    assert returned == {r: (ckpt, True) for r in range(3)}
    assert sorted(p.name for p in (ckpt / "accelerate").iterdir()) == ["part-0", "part-1", "part-2"]
    assert policy.saves == 1 and load_trainer_state(ckpt) == {"step": 10}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000010"]


def test_the_folder_of_a_failed_save_is_replaced_not_reused(tmp_path):
    # Every process must find the folder under the same name, so it is not a random one:
    # what an earlier save of the same step left there goes first.
    stale = tmp_path / ".tmp-checkpoint-0000010"
    stale.mkdir()
    (stale / "half-written").write_text("x")
    ckpt = save_checkpoint(tmp_path, 10, FakePolicy(), {"step": 10})
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint.json", "model.bin", "trainer_state.pt"]


def test_a_run_resumes_exactly_from_its_checkpoint(tmp_path):
    # A training checkpoint is a model directory (load_policy reads it) with the optimizer
    # state in accelerate/, whose copy of the weights is left out; a run resumes from it exactly.
    import stabledrl.train as train_mod
    from stabledrl.config import load_config
    from stabledrl.models.policy import load_policy
    from stabledrl.train import TrainConfig, run_train
    from tests.conftest import make_tiny_policy

    make_tiny_policy(seed=41).save(tmp_path / "init")

    def cfg(out):
        return load_config(TrainConfig, {
            "model": str(tmp_path / "init"), "output_dir": str(out), "task": {"name": "sudoku"}, "steps": 4,
            "prompts_per_step": 2, "group_size": 4, "mu": 1, "lr": 1e-3, "eval_n": 2, "save_every": 2,
            "estimator": {"method": "mc", "num_samples": 1}})

    run_train(cfg(tmp_path / "full"), progress=False)

    class Stop(Exception):
        pass

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise Stop

    real = train_mod.save_checkpoint
    train_mod.save_checkpoint = save_then_stop
    try:
        with pytest.raises(Stop):
            run_train(cfg(tmp_path / "crash"), progress=False)
    finally:
        train_mod.save_checkpoint = real
    ckpt = tmp_path / "crash" / "checkpoint-0000002"
    assert sorted(p.name for p in (ckpt / "accelerate").iterdir()) == ["optimizer.bin", "random_states_0.pkl"]
    assert load_policy(ckpt).model.config.hidden_size == 32
    state = load_trainer_state(ckpt)
    assert "optimizer" not in state
    run_train(cfg(tmp_path / "crash"), resume=True, progress=False)
    rows = [[{k: v for k, v in json.loads(x).items() if not k.startswith(("time_", "seconds", "framework"))}
             for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "full", tmp_path / "crash")]
    assert rows[0] == rows[1]
    a, b = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "full", tmp_path / "crash"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_run_is_reused_only_with_its_own_config(tmp_path):
    from stabledrl.config import ConfigError, load_config, to_dict
    from stabledrl.train import TrainConfig

    cfg = load_config(TrainConfig, None, ["seed=3", "lr=5e-5"])
    saved = to_dict(cfg)
    del saved["model"]["prompt_attention"]  # a run saved before this field existed: its default
    open_run_dir(tmp_path, saved, resume=False)
    assert finished_summary(tmp_path, cfg) is None  # not finished yet
    write_atomic(tmp_path / "summary.json", json.dumps({"eval_final": {"accuracy": 0.5}}))
    assert finished_summary(tmp_path, cfg) == {"eval_final": {"accuracy": 0.5}}
    other = load_config(TrainConfig, None, ["seed=3", "lr=1e-4", "objective.name=grpo"])
    with pytest.raises(ConfigError, match="differs in lr, objective"):
        finished_summary(tmp_path, other)


def test_a_run_dir_records_the_version_that_wrote_it(tmp_path):
    from importlib.metadata import version

    open_run_dir(tmp_path, {"seed": 0}, resume=False)
    assert json.loads((tmp_path / "version.json").read_text()) == {"stabledrl": version("stabledrl")}
    (tmp_path / "version.json").write_text('{"stabledrl": "0.0.1"}')  # an older version's run: taken over
    open_run_dir(tmp_path, {"seed": 0}, resume=True)
    assert json.loads((tmp_path / "version.json").read_text()) == {"stabledrl": version("stabledrl")}


def test_a_run_dir_of_a_newer_version_is_refused_in_one_line_before_anything_is_touched(tmp_path, capsys):
    from importlib.metadata import version

    from stabledrl.cli import main
    from stabledrl.config import ConfigError, load_config
    from stabledrl.train import TrainConfig

    save_checkpoint(tmp_path, 10, FakePolicy(), {"step": 10, "a_newer_field": 1})
    (tmp_path / ".tmp-final-xyz").mkdir()  # a newer version's own temporary folder: not ours to remove
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "version.json").write_text('{"stabledrl": "99.0.0"}')
    before = sorted(p.name for p in tmp_path.iterdir())
    for resume in (True, False):
        with pytest.raises(ConfigError) as e:
            open_run_dir(tmp_path, {"seed": 0}, resume=resume)
        assert str(e.value) == (f"{tmp_path} was written by stabledrl 99.0.0, and this is stabledrl "
                                f"{version('stabledrl')}: upgrade stabledrl to 99.0.0 or later to use it, or start "
                                "a fresh run in another output_dir")
    with pytest.raises(ConfigError, match="written by stabledrl 99.0.0"):
        finished_summary(tmp_path, load_config(TrainConfig, None, []))  # a benchmark reusing the run
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    model = Path(__file__).resolve().parents[1] / "checkpoints" / "countdown-tiny"
    (tmp_path / "cfg.yaml").write_text(f"model: {model}\noutput_dir: {tmp_path}\nsteps: 1\n")
    assert main(["train", "--config", str(tmp_path / "cfg.yaml"), "--resume"]) == 2
    assert capsys.readouterr().err == f"stabledrl train: error: {e.value}\n"


def test_a_version_record_that_is_not_one_is_named(tmp_path):
    from stabledrl.config import ConfigError

    (tmp_path / "version.json").write_text('{"stabledrl": "not a version"}')
    with pytest.raises(ConfigError, match="version.json is not a version record"):
        open_run_dir(tmp_path, {}, resume=False)
