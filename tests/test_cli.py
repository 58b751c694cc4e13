import json

import pytest

from stabledrl.cli import main
from tests.conftest import make_tiny_policy


@pytest.fixture
def saved_model(tmp_path):
    path = tmp_path / "model"
    make_tiny_policy(seed=21).save(path)
    return path


def test_eval_prints_and_writes_json(saved_model, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(saved_model), "--task", "countdown", "--n", "12", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "mean reward" in printed
    report = json.loads(out.read_text())
    assert report["n"] == 12 and len(report["samples"]) == 12
    assert report["accuracy"] <= report["mean_reward"] + 1e-12  # a correct answer scores 1.0
    # The reported figures are those of the samples written beside them.
    assert report["accuracy"] == sum(s["correct"] for s in report["samples"]) / 12
    assert report["mean_reward"] == pytest.approx(sum(s["reward"] for s in report["samples"]) / 12)


def test_sample_prints_one_line_per_completion(saved_model, capsys):
    args = ["sample", "--model", str(saved_model), "--prompt", "3,5,7=22", "--prompt", "1,2,3=6",
            "--num-samples", "2", "--temperature", "1.0", "--seed", "3"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["3,5,7=22"] * 2 + ["1,2,3=6"] * 2


def test_sft_then_eval_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        f"output_dir: {run}\nsteps: 4\nbatch_size: 8\nwarmup_steps: 1\nlog_every: 2\neval_n: 4\nsave_every: 2\n"
        "model: {hidden_size: 16, num_layers: 1, num_heads: 2}\ntask: {name: sudoku}\n"
    )
    assert main(["sft", "--config", str(cfg), "--set", "seed=1"]) == 0
    assert (run / "final" / "model.safetensors").is_file()
    assert main(["eval", "--model", str(run / "final"), "--task", "sudoku", "--n", "4"]) == 0
    assert (run / "final" / "eval-sudoku-test.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "/nonexistent/model"], "no config.json"),
    (["eval", "--model", "MODEL", "--task", "chess"], "unknown task"),
    (["eval", "--model", "MODEL", "--temperature", "-1"], "temperature"),
    (["eval", "--model", "MODEL", "--task-option", "num_numbers=7"], "num_numbers"),
    (["sft", "--config", "CFG"], "unknown config key"),
    (["sft", "--config", "/nonexistent.yaml"], "does not exist"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(argv, message, saved_model, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("learning_rate: 1e-3\n")
    argv = [str(saved_model) if a == "MODEL" else str(cfg) if a == "CFG" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
