"""Every shipped preset loads into its dataclass and points at a model that ships; bad
config files and values are a `ConfigError` that names the file or field and the fix."""

from pathlib import Path

import pytest

from stabledrl.config import ConfigError, load_config
from stabledrl.sft import SFTConfig
from stabledrl.train import TrainConfig
from tests.test_recipes import RECIPES

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
        if path.stem in RECIPES:  # real models from the Hub: tests/test_recipes.py
            return
        assert (root / cfg.model.path / "config.json").is_file(), f"{path.name}: {cfg.model.path} does not ship"


def test_the_tiny_presets_keep_the_drift_diagnostic_that_the_default_turns_off():
    # Their runs, reports and figures were made with the reference copy on; a real model's
    # recipe leaves it off (a second model on every GPU), as the default does.
    tiny = [p for p in CONFIGS if p.name.startswith(("countdown-", "sudoku-"))]
    assert len(tiny) >= 10
    assert all(load_config(TrainConfig, p).drift_kl for p in tiny)
    assert not TrainConfig().drift_kl
    assert not any(load_config(TrainConfig, p).drift_kl for p in CONFIGS if p.stem in RECIPES)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed-zero3"])
def test_accelerate_example_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(Path(__file__).resolve().parent.parent / "configs" / "accelerate" / f"{name}.yaml"))
    assert cfg.distributed_type.value == {"ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed-zero3": "DEEPSPEED"}[name]


@pytest.mark.parametrize("text, message", [
    ("steps: 4\nestimator: {method: mc\nlr: 1e-3\n", r"bad\.yaml: not valid YAML: .*at line 3, column 3"),
    ("", r"bad\.yaml is empty"),
    ("# only a comment\n", r"bad\.yaml is empty"),
    ("- steps: 4\n", r"bad\.yaml: the top level must be a mapping"),
])
def test_a_bad_config_file_is_an_error_that_names_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(TrainConfig, path)
    assert "\n" not in str(e.value)  # one line on the command line


def test_a_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: runs/caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml is not UTF-8 .*byte 20"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("override, message", [
    ("lr=[1e-3,", r"--set lr=\[1e-3,: the value is not valid YAML"),
    ("estimator.num_samples: 2", r"must look like key.sub=value"),
])
def test_a_malformed_override_names_it(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(TrainConfig, {}, [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("data, field", [
    ({"steps": True}, "steps"),  # a bool is an int to Python, not to a config
    ({"threads": False}, "threads"),  # int | None
    ({"estimator": {"num_samples": True}}, "estimator.num_samples"),
    ({"lr": True}, "lr"),
    ({"rollout": {"temperature": True}}, "rollout.temperature"),
    ({"lora": {"r": True}}, "lora.r"),  # inside an optional section (LoraSettings | None) too
])
def test_a_bool_is_not_a_number(data, field):
    with pytest.raises(ConfigError, match=rf"config field '{field}': expected .*, got True|got False"):
        load_config(TrainConfig, data)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(TrainConfig, {}, [f"{field}={str(next(iter(_leaves(data))))}"])


def test_an_unknown_key_in_an_optional_section_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"unknown config key lora\.rr; section 'lora' accepts \['r'"):
        load_config(TrainConfig, {"lora": {"rr": 2}})


def _leaves(d):
    for v in d.values():
        yield from _leaves(v) if isinstance(v, dict) else [v]


def test_the_configs_validate_without_torch():
    # `stabledrl train` and `sft` read and check their config before the slow imports
    # (torch, transformers: seconds), so a bad value is reported at once.
    import subprocess
    import sys

    code = ("import sys; from stabledrl.config import load_config; from stabledrl.settings import SFTConfig, TrainConfig; "
            "cfg = load_config(TrainConfig, {'steps': 3, 'lora': {'r': 2}, 'model': 'some/dir'}); assert cfg.steps == 3; "
            "cfg = load_config(SFTConfig, {'model': {'num_layers': 1}}); assert cfg.model.num_layers == 1; "
            "heavy = sorted({'torch', 'transformers', 'datasets', 'accelerate'} & set(sys.modules)); "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_config_classes_are_still_importable_from_their_modules():
    from stabledrl import settings
    from stabledrl.models import ModelConfig
    from stabledrl.models.lora import LoraSettings
    from stabledrl.sampling import SamplingConfig
    from stabledrl.sft import TaskConfig, TinyModelConfig
    from stabledrl.train import EstimatorConfig, ObjectiveConfig

    assert (TrainConfig, SFTConfig, EstimatorConfig, ObjectiveConfig, ModelConfig, LoraSettings, SamplingConfig,
            TaskConfig, TinyModelConfig) == (settings.TrainConfig, settings.SFTConfig, settings.EstimatorConfig,
                                            settings.ObjectiveConfig, settings.ModelConfig, settings.LoraSettings,
                                            settings.SamplingConfig, settings.TaskConfig, settings.TinyModelConfig)


def test_a_word_that_yaml_reads_as_a_bool_is_the_word_for_a_choice_of_words():
    # YAML 1.1 reads `no` as False: `mixed_precision: no` (or --set mixed_precision=no) means "no"
    assert load_config(TrainConfig, {"mixed_precision": False}).mixed_precision == "no"
    assert load_config(TrainConfig, None, ["mixed_precision=no"]).mixed_precision == "no"
    with pytest.raises(ConfigError, match="mixed_precision"):  # no word for True among no | bf16
        load_config(TrainConfig, None, ["mixed_precision=yes"])


@pytest.mark.parametrize("source, overrides", [
    ({}, ["rollout.noise=counter"]),
    ({"rollout": {"noise": "counter"}}, []),
])
def test_a_section_given_in_part_keeps_its_fields_default(source, overrides):
    # TrainConfig's rollout defaults to temperature 1.0 where SamplingConfig's own default is 0
    assert TrainConfig().rollout.temperature == 1.0
    cfg = load_config(TrainConfig, source, overrides)
    assert cfg.rollout.noise == "counter" and cfg.rollout.temperature == 1.0
    # a key that is given wins, and the other sections keep their class defaults
    cfg = load_config(TrainConfig, {"rollout": {"temperature": 0.5}, "eval_sampling": {"steps": 4}})
    assert cfg.rollout.temperature == 0.5 and cfg.eval_sampling.temperature == 0.0
