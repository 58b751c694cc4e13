"""Every shipped preset loads into its dataclass and points at a model that ships; bad
config files and values are a `ConfigError` that names the file or field and the fix."""

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest

from stabledrl import settings
from stabledrl.config import ConfigError, field_docs, load_config, to_dict
from stabledrl.settings import RunConfig, TaskConfig
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


# The fields `stabledrl sft` and `stabledrl train` share, with each run's defaults as shipped.
_SHARED_DEFAULTS = {
    #                 SFTConfig    TrainConfig
    "output_dir":   ("runs/sft",   "runs/train"),
    "steps":        (4000,         100),
    "lr":           (1e-3,         1e-5),
    "min_lr_ratio": (0.1,          1.0),
    "warmup_steps": (200,          0),
    "weight_decay": (0.01,         0.0),
    "log_every":    (20,           1),
    "eval_every":   (1000,         0),
    "save_every":   (500,          50),
    "task":         (TaskConfig(), TaskConfig()),
    "seed":         (0,            0),
    "grad_clip":    (1.0,          1.0),
    "eval_n":       (500,          500),
    "eval_split":   ("test",       "test"),
    "threads":      (None,         None),
}


def _own_field_docs(cls) -> dict[str, str | None]:
    """Each field a class body declares -> the docstring under it there (None: none), as
    `stabledrl.config.field_docs` reads them."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                        and isinstance(after.value.value, str)) else None
            out[node.target.id] = doc
    return out


def test_the_fields_sft_and_rl_share_are_declared_once_in_run_config():
    shared = [f.name for f in dataclasses.fields(RunConfig)]
    assert shared == list(_SHARED_DEFAULTS)
    sft, rl = ({f.name for f in dataclasses.fields(c)} for c in (SFTConfig, TrainConfig))
    assert sft & rl == set(shared) | {"model"}  # `model` is a TinyModelConfig in one, a ModelConfig in the other
    base = _own_field_docs(RunConfig)
    assert all(base[name] for name in shared)  # each documented there, once
    base_types = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    no_default = {f.name for f in dataclasses.fields(RunConfig) if f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING}
    for cls in (SFTConfig, TrainConfig):
        again = {name: doc for name, doc in _own_field_docs(cls).items() if name in base}
        assert set(again) == no_default, cls  # a subclass only gives the defaults the base leaves open
        assert not any(again.values()), cls  # without a second docstring
        assert all(dataclasses.fields(cls)[i].type == base_types[f] for i, f in enumerate(shared)), cls
    assert field_docs(SFTConfig)["lr"] == field_docs(TrainConfig)["lr"] == " ".join(base["lr"].split())


def test_the_shared_fields_keep_each_runs_defaults():
    sft, rl = SFTConfig(), TrainConfig()
    assert {k: (getattr(sft, k), getattr(rl, k)) for k in _SHARED_DEFAULTS} == _SHARED_DEFAULTS
    # and a run's dumped config reads back, whatever the order of its keys
    for cfg in (sft, rl):
        data = to_dict(cfg)
        assert load_config(type(cfg), dict(reversed(data.items()))) == cfg


@pytest.mark.parametrize("cls", [SFTConfig, TrainConfig])
@pytest.mark.parametrize("override, message", [
    ("steps=0", "steps must be >= 1, got 0"),
    ("eval_n=0", "eval_n must be >= 1"),
    ("lr=0", "lr must be positive"),
    ("min_lr_ratio=1.5", r"min_lr_ratio must be in \[0, 1\]"),
    ("warmup_steps=-1", "warmup_steps and eval_every must be >= 0"),
    ("eval_every=-1", "warmup_steps and eval_every must be >= 0"),
])
def test_both_runs_check_the_shared_fields_the_same_way(cls, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, None, [override])


def test_every_field_docstring_of_the_settings_is_at_most_two_lines():
    # What a field does and why one would change it; the history and figures go to docs/.
    tree = ast.parse(Path(settings.__file__).read_text())
    long = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node, after in zip(cls.body, cls.body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str) and len(after.value.value.strip().splitlines()) > 2):
                long.append(f"{cls.name}.{node.target.id}")
    assert not long, long
