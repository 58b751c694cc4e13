"""The preflight check (`stabledrl.preflight`) and the memory model's terms it added
(`stabledrl.memory`): shapes read from config.json against the models' own parameter counts, the
refusals before any weight loads, the printed prediction of the shipped recipes."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

import stabledrl.preflight as preflight
import stabledrl.training_run as training_run
from stabledrl.config import ConfigError, load_config
from stabledrl.memory import (NCCL_BYTES, Footprint, Shape, checkpoint_bytes, param_count, predict_memory,
                              with_eval)
from stabledrl.models import ModelConfig, load_policy
from stabledrl.settings import TrainConfig
from stabledrl.tasks import get_task
from stabledrl.tokenizer import build_char_tokenizer
from stabledrl.train import train
from tests.conftest import make_tiny_policy
from tests.models.test_adapters import dirs  # noqa: F401 (the fixture)
from tests.test_recipes import RECIPES, load

TINY = Shape(256, 32, 2, 2, 96, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pre") / "model"
    make_tiny_policy(seed=3).save(path)
    return path


def _cfg(model, out, **kw) -> TrainConfig:
    base = {"model": str(model), "output_dir": str(out), "task": {"name": "sudoku"}, "steps": 1,
            "prompts_per_step": 2, "group_size": 2, "eval_n": 2}
    return load_config(TrainConfig, {**base, **kw})


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "tiny"])
def test_the_shape_read_from_config_json_counts_the_models_own_parameters(dirs, tiny_dir, family):  # noqa: F811
    path = tiny_dir if family == "tiny" else dirs[family]
    shape = Shape.from_config(json.loads((path / "config.json").read_text()))
    model = load_policy(ModelConfig(path=str(path))).model
    assert param_count(shape) == sum(p.numel() for p in model.parameters())


def test_the_new_terms_by_hand():
    f = Footprint(prompt_length=10, gen_length=6, rows_per_call=4, views_per_forward=8)
    base = predict_memory(TINY, f)
    N = param_count(TINY)  # 2·(2·32² + 2·32² + 3·32·96 + 2·32) + 2·256·32 + 32 = 2·13,376 + 16,416
    assert N == 43_168
    # R > 1: the float32 gradients of the earlier rounds are held through a round's update
    rounds = predict_memory(TINY, dataclasses.replace(f, accumulation_rounds=4))
    assert rounds["terms"]["gradients_between_rounds"] == 4 * N
    assert rounds["phases"]["update"] - base["phases"]["update"] == 4 * N
    # evaluation: the sampler's bytes at its own rows and lengths; the rollout's when they are the same
    same = predict_memory(TINY, with_eval(f, 4, 10, 6))
    assert same["terms"]["evaluation_transient"] == same["terms"]["rollout_transient"]
    assert same["phases"]["evaluation"] == same["phases"]["rollout"]
    assert "evaluation" not in base["phases"]
    # the head on the block: counter noise over blocks of 2; held float32 logits (A, W, V) instead of
    # (A, T, V), the draw's 7 (A·W, V) float32 arrays: 4·2·256·4 + 28·4·2·256 = 8,192 + 57,344
    c = dataclasses.replace(f, noise="counter", block_length=2)
    narrow = predict_memory(TINY, dataclasses.replace(c, head_on_block=True))["terms"]["rollout_transient"]
    wide = predict_memory(TINY, c)["terms"]["rollout_transient"]
    assert narrow < wide
    # forward beside the held logits: rows·max(T·(4I + 3d)·4, T·3d·4 + W·V·4) = 4·max(16·480·4, 16·384 + 2·1024)
    assert narrow == max(4 * 2 * 256 * 4 + 4 * max(16 * 480 * 4, 16 * 96 * 4 + 2 * 256 * 4), 8_192 + 57_344)
    # the allowances: NCCL with several processes, 5% of the peak
    r = predict_memory(TINY, dataclasses.replace(f, reserve=True, shards=8))
    plain = predict_memory(TINY, dataclasses.replace(f, shards=8))
    assert r["terms"]["reserve"] == NCCL_BYTES + int(0.05 * plain["peak"])


def test_checkpoint_disk_by_hand():
    f = Footprint(prompt_length=10, gen_length=6, rows_per_call=4, views_per_forward=8)
    N = param_count(TINY)
    one = checkpoint_bytes(TINY, f, processes=1, model_bytes=4)
    assert one == {"model": 4 * N, "resume_state": 8 * N, "checkpoint": 12 * N, "final": 4 * N}
    fsdp = checkpoint_bytes(TINY, f, processes=8, model_bytes=2)  # bf16 model file, float32 shards of it again
    assert fsdp["checkpoint"] == 2 * N + 8 * N + 4 * N
    lora = checkpoint_bytes(TINY, dataclasses.replace(f, lora_params=1000), processes=8, model_bytes=2)
    assert lora["checkpoint"] == 4 * 1000 + 8 * 1000  # the adapters and their AdamW states only


def test_the_longest_prompt_in_tokens_is_the_longest_encoded():
    task, tok = get_task("countdown"), build_char_tokenizer()
    got = preflight.longest_prompt_tokens(task, tok, False)
    prompts = [p.prompt for s in ("train", "test") for p in task.generate(256, split=s, seed=0)]
    assert got == 1 + max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)  # BOS and the prompt


def _no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model's weights were loaded")
    monkeypatch.setattr(training_run, "load_policy", refuse)


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_its_weights_load(tiny_dir, tmp_path, monkeypatch):
    _no_weights(monkeypatch)
    monkeypatch.setattr(training_run, "machine_of", lambda device, n, sharded: preflight.Machine(10**5, "GPU", n))
    with pytest.raises(ConfigError) as e:
        train(_cfg(tiny_dir, tmp_path / "run"), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "in the update phase" in msg and "model.gradient_checkpointing" in msg
    assert not (tmp_path / "run").exists()  # nothing written


def test_checkpoints_that_cannot_fit_the_disk_are_refused(tiny_dir, tmp_path, monkeypatch):
    _no_weights(monkeypatch)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: SimpleNamespace(free=1000))
    with pytest.raises(ConfigError, match=r"checkpoints need .* GB of disk .* free at .*output_dir") as e:
        train(_cfg(tiny_dir, tmp_path / "run"), progress=False)
    assert "\n" not in str(e.value)


def test_preflight_false_prints_the_prediction_and_goes_on(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(training_run, "machine_of", lambda device, n, sharded: preflight.Machine(10**5, "GPU", n))
    train(_cfg(tiny_dir, tmp_path / "run", preflight=False), progress=False)
    out = capsys.readouterr().out
    assert "preflight: " in out and "(update) of 0.00 GB GPU" in out and (tmp_path / "run" / "final").is_dir()


@pytest.mark.parametrize("name", RECIPES)
def test_the_printed_prediction_of_each_shipped_recipe(name, monkeypatch):
    monkeypatch.setattr(preflight, "model_config", lambda path: None)  # offline: the shapes we know
    cfg = load(name)
    task = SimpleNamespace(completion_length=cfg.rollout.gen_length)
    pred = preflight.predict_run(cfg, task, preflight.Machine(80 * 10**9, "GPU", 8, True), prompt_tokens=(256, 256),
                                 eval_rows=64)
    line = pred.line()
    assert line.startswith("preflight: ") and "of 80.00 GB GPU" in line and "checkpoints need" in line
    assert set(pred.phases) == {"start", "rollout", "scoring", "update", "optimizer", "evaluation"}
    phase, peak = pred.peak
    assert phase == "update" and 30e9 < peak < 80e9  # fits an 80 GB GPU, not a 24 GB one
    with pytest.raises(ConfigError, match="in the update phase"):
        preflight.check_run(dataclasses.replace(pred, machine=preflight.Machine(24 * 10**9, "GPU", 8, True)), ".")


def test_a_run_the_memory_model_cannot_read_goes_on_and_says_so(tiny_dir, tmp_path, monkeypatch, capsys):
    def unreadable(*a, **k):
        raise RuntimeError("a task without prompts to measure")
    monkeypatch.setattr(training_run, "longest_prompt_tokens", unreadable)
    train(_cfg(tiny_dir, tmp_path / "run"), progress=False)
    assert "preflight: no prediction (RuntimeError: a task without prompts to measure)" in capsys.readouterr().out
    assert (tmp_path / "run" / "final").is_dir()
