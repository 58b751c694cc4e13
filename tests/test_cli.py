import dataclasses
import json
import os
from pathlib import Path

import pytest

from stabledrl.cli import _eval_out, _sampling, build_parser, main
from stabledrl.config import field_docs
from stabledrl.settings import SamplingConfig
from stabledrl.tasks import get_task
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


def _sampling_of(*argv: str) -> SamplingConfig:
    return _sampling(build_parser().parse_args(["eval", "--model", "M", *argv]))


def test_the_sampling_flags_are_the_fields_of_sampling_config_under_the_documented_names():
    # The names README.md and docs/ use, each setting its field; left out, every field keeps its default.
    assert _sampling_of() == SamplingConfig()
    got = _sampling_of("--gen-length", "12", "--steps", "6", "--block-length", "4", "--temperature", "0.5",
                       "--no-kv-cache", "--sort-by-length", "--noise", "counter", "--threshold", "0.8",
                       "--approx-cache", "dual")
    assert got == SamplingConfig(gen_length=12, steps=6, block_length=4, temperature=0.5, kv_cache=False,
                                 sort_by_length=True, noise="counter", threshold=0.8, approx_cache="dual")
    assert _sampling_of("--remasking", "random").remasking == "random"
    flags = {a.dest.removeprefix("sampling_"): a for a in build_parser()._subparsers._group_actions[0]
             .choices["eval"]._actions if a.dest.startswith("sampling_")}
    named = {f.name for f in dataclasses.fields(SamplingConfig)} - {"micro_batch", "engine", "engine_options"}
    assert set(flags) == named  # one flag per field: a new field gets its flag
    assert flags["threshold"].help.startswith(field_docs(SamplingConfig)["threshold"])
    assert flags["noise"].choices == ("auto", "generator", "counter")


def test_eval_sorts_batches_by_prompt_length_when_asked(saved_model, tmp_path, monkeypatch):
    import stabledrl.evaluate as evaluate_mod

    seen, real = [], evaluate_mod.evaluate

    def spy(policy, task, problems, sampling, **kw):
        seen.append((sampling.sort_by_length, sampling.micro_batch))
        return real(policy, task, problems, sampling, **kw)

    monkeypatch.setattr(evaluate_mod, "evaluate", spy)
    common = ["eval", "--model", str(saved_model), "--n", "4", "--batch-size", "2", "--out", str(tmp_path / "e.json")]
    assert main(common + ["--sort-by-length"]) == 0 and main(common) == 0
    assert seen == [(True, 2), (False, 2)]  # --batch-size is the evaluation's micro-batch


def test_sample_prints_one_line_per_completion(saved_model, capsys):
    args = ["sample", "--model", str(saved_model), "--prompt", "3,5,7=22", "--prompt", "1,2,3=6",
            "--num-samples", "2", "--temperature", "1.0", "--seed", "3"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["3,5,7=22"] * 2 + ["1,2,3=6"] * 2


def test_sample_prints_the_reward_of_each_completion_of_a_task_prompt(saved_model, capsys):
    task = get_task("countdown")
    args = ["sample", "--model", str(saved_model), "--prompt", "3,5,7=22", "--prompt", "1+2",
            "--num-samples", "3", "--temperature", "1.0"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    lines = [line.split("\t") for line in out.strip().splitlines()]
    for prompt, text, reward in lines[:3]:  # a countdown prompt: its reward, recomputed here
        r = task.score(text, task.problem_from_prompt(prompt))
        assert reward == f"reward {r:.3g} ({'correct' if r == 1.0 else 'wrong'})"
    assert [len(fields) for fields in lines[3:]] == [2] * 3  # not a countdown prompt: no reward
    assert "'1+2' is not a countdown prompt" in err


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
    assert (run / "evals" / "final-sudoku-test.json").is_file()  # beside the run, not inside its model
    assert not [p.name for p in (run / "final").iterdir() if p.name.startswith("eval")]


def test_eval_writes_beside_a_run_else_under_evals_never_into_the_model(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-0000010").mkdir(parents=True)
    (run / "final").mkdir()
    (run / "config.yaml").write_text("seed: 0\n")  # what open_run_dir writes first
    shipped = tmp_path / "shipped" / "countdown-tiny"
    shipped.mkdir(parents=True)
    assert _eval_out(str(run / "checkpoint-0000010"), "countdown", "test", None) == \
        run / "evals" / "checkpoint-0000010-countdown-test.json"
    assert _eval_out(str(run / "final"), "sudoku", "validation", None) == run / "evals" / "final-sudoku-validation.json"
    # A directory named final/ outside a run (no config.yaml beside it) is any other model.
    (tmp_path / "shipped" / "final").mkdir()
    assert _eval_out(str(tmp_path / "shipped" / "final"), "countdown", "test", None) == \
        Path("evals/final-countdown-test.json")
    assert _eval_out(str(shipped) + "/", "countdown", "test", None) == Path("evals/countdown-tiny-countdown-test.json")
    assert _eval_out("GSAI-ML/LLaDA-8B-Instruct", "gsm8k", "test", None) == \
        Path("evals/GSAI-ML--LLaDA-8B-Instruct-gsm8k-test.json")  # a Hub name, not a local directory
    assert _eval_out(str(run / "final"), "countdown", "test", "x/y.json") == Path("x/y.json")  # --out wins


def test_eval_of_a_read_only_model_writes_under_evals_and_leaves_the_model_alone(saved_model, tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in saved_model.iterdir())
    saved_model.chmod(0o555)  # a shipped model on a read-only mount
    try:
        if os.geteuid() != 0:  # root writes anyway; then the listing below is what catches a write
            with pytest.raises(PermissionError):
                (saved_model / "probe").write_text("")
        assert main(["eval", "--model", str(saved_model), "--n", "3"]) == 0
    finally:
        saved_model.chmod(0o755)
    out = tmp_path / "evals" / "model-countdown-test.json"
    assert json.loads(out.read_text())["n"] == 3
    assert f"wrote {Path('evals/model-countdown-test.json')}" in capsys.readouterr().out
    assert sorted(p.name for p in saved_model.iterdir()) == before


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


@pytest.fixture
def bad_inputs(saved_model, tmp_path):
    """Paths the argv placeholders below stand for."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in saved_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # cut off mid-download
    (tmp_path / "malformed.yaml").write_text("steps: 4\nestimator: {method: mc\n")
    (tmp_path / "ok.yaml").write_text(f"model: {saved_model}\nsteps: 1\n")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "unwritable.yaml").write_text(f"model: {saved_model}\noutput_dir: {tmp_path / 'a-file' / 'run'}\n"
                                              "steps: 1\ntask: {name: sudoku}\n")
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "r", "ans\n')
    return {"MODEL": saved_model, "BROKEN": broken, **{k.upper(): tmp_path / v for k, v in [
        ("malformed", "malformed.yaml"), ("ok", "ok.yaml"), ("unwritable", "unwritable.yaml"),
        ("gsm8k", "gsm8k.jsonl")]}}


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "MALFORMED"], "malformed.yaml: not valid YAML: "),
    (["train", "--config", "OK", "--set", "lr=[1,"], "--set lr=[1,: the value is not valid YAML"),
    (["train", "--config", "OK", "--set", "steps=true"], "config field 'steps': expected int, got True"),
    (["train", "--config", "UNWRITABLE"], "a-file/run cannot be written"),
    (["eval", "--model", "BROKEN"], "broken/model.safetensors cannot be read"),
    (["eval", "--model", "MODEL", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["eval", "--model", "MODEL", "--task", "gsm8k", "--task-option", "path=GSM8K"], "gsm8k.jsonl, line 2: not JSON"),
    (["sample", "--model", "MODEL", "--prompt", "h\u00e9llo"], "characters the tokenizer does not know: 'h', '\u00e9'"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(argv, message, bad_inputs, capsys):
    argv = [str(bad_inputs.get(a, a)) if a in bad_inputs else a.replace("GSM8K", str(bad_inputs["GSM8K"]))
            for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err



def test_a_bad_config_is_reported_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    (tmp_path / "bad.yaml").write_text("steps: -1\n")
    code = ("import sys; from stabledrl.cli import main; "
            f"assert main(['train', '--config', {str(tmp_path / 'bad.yaml')!r}]) == 2; "
            "heavy = sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules)); assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.strip() == "stabledrl train: error: steps must be >= 1, got -1"
