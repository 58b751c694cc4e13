import pytest
import torch

from stabledrl.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint


class FakePolicy:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save(self, path):
        (path / "model.bin").write_text("weights")
        if self.fail:
            raise OSError("disk full")


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
    (tmp_path / "checkpoint-0000050").mkdir()  # no trainer_state.pt: e.g. copied half-way
    save_checkpoint(tmp_path, 40, FakePolicy(), {"step": 40, "t": torch.ones(2)})
    assert latest_checkpoint(tmp_path).name == "checkpoint-0000040"
    assert latest_checkpoint(tmp_path / "missing") is None
