"""LoRA through peft: only the adapters train, and the reference is the base model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.config import ConfigError, load_config
from stabledrl.data import encode_prompts, position_ids
from stabledrl.models import LoraSettings, add_lora, base_policy, load_policy
from stabledrl.train import TrainConfig, run_train
from tests.conftest import make_tiny_policy


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _logits(policy):
    ids, mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "1=1"])
    with torch.no_grad():
        return policy.logits(ids, mask, position_ids(mask))


def test_a_lora_run_changes_only_the_adapters(init_model, tmp_path):
    cfg = load_config(TrainConfig, {
        "model": str(init_model), "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "mu": 2, "lr": 1e-2, "eval_n": 2, "zero_variance_groups": "keep",
        "estimator": {"method": "mc", "num_samples": 2}, "lora": {"r": 4, "alpha": 8}})
    run_train(cfg, progress=False)
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    adapters = load_file(final / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at zero
    trained = load_policy(final)  # the base it was trained on, then the adapters
    base_now = trained.model.get_base_model().state_dict()
    initial = load_file(init_model / "model.safetensors")
    for k, v in initial.items():  # every base weight exactly as it was
        peft_key = next(n for n in base_now if n.endswith(k.replace(".weight", ".base_layer.weight"))
                        or n == k)
        assert torch.equal(base_now[peft_key], v), k
    assert not torch.allclose(_logits(trained), _logits(load_policy(init_model)), atol=1e-4)


def test_the_reference_is_the_base_model_with_adapters_off(init_model):
    base = load_policy(init_model)
    expected = _logits(base)
    policy = add_lora(load_policy(init_model), LoraSettings(r=4))
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # as if trained: the adapters now change the output
    reference = base_policy(policy)
    assert reference.model is policy.model  # no second copy of the weights
    assert torch.equal(_logits(reference), expected)
    assert not torch.allclose(_logits(policy), expected, atol=1e-3)  # adapters back on after the reference call
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="lora.r"):
        load_config(TrainConfig, {"lora": {"r": 0}})
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(TrainConfig, {"lora": {"target_modules": []}})
