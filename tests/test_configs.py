"""Every shipped preset loads into its dataclass and points at a model that ships."""

from pathlib import Path

import pytest

from stabledrl.config import load_config
from stabledrl.sft import SFTConfig
from stabledrl.train import TrainConfig

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_there_are_presets():
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_loads_and_its_model_exists(path):
    root = Path(__file__).parents[1]
    if path.name.startswith("sft-"):
        cfg = load_config(SFTConfig, path)
        if cfg.model.init_from:
            assert (root / cfg.model.init_from / "config.json").is_file()
    else:
        cfg = load_config(TrainConfig, path)
        assert (root / cfg.model.path / "config.json").is_file(), f"{path.name}: {cfg.model.path} does not ship"


@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed-zero3"])
def test_accelerate_example_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(Path(__file__).resolve().parent.parent / "configs" / "accelerate" / f"{name}.yaml"))
    assert cfg.distributed_type.value == {"ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed-zero3": "DEEPSPEED"}[name]
