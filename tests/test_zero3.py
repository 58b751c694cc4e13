"""A training run under DeepSpeed with a KL term (docs/scale-out.md, "FSDP and DeepSpeed
ZeRO-3"): the frozen reference copy is a DeepSpeed engine of its own, under ZeRO-3 its
parameters partitioned like the policy's and gathered for each forward, and it runs in the
policy's precision.

Two CPU processes (DeepSpeed's CPU backend over gloo; skipped without deepspeed) launched by
`accelerate launch` with the shipped configs/accelerate/deepspeed-zero3.yaml, through
`_cpu_zero3_main`, against one process without DeepSpeed on the same data and seeds (the
setting of tests/test_distributed.py: SGD at lr 1, so the update is the clipped gradient; the
one process clips at 1.0, the `gradient_clipping` of deepspeed-zero3.json). At step 1 the
policy is the reference, so their ℓ on the same masks must agree exactly: `drift_kl` and
`kl_ref` are 0; at step 2 they differ by the first update, as in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stabledrl.config import load_config
from stabledrl.train import TrainConfig, run_train
from tests.test_distributed import _free_port, _overrides, _update, assert_same_update

ROOT = Path(__file__).parents[1]
ZERO3_CONFIG = ROOT / "configs" / "accelerate" / "deepspeed-zero3.yaml"


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    from tests.conftest import make_tiny_policy

    path = tmp_path_factory.mktemp("zero3") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _zero3_overrides(init_model, out: Path, **extra) -> list[str]:
    # a KL term (β > 0) and the drift diagnostic both read the reference; 2 steps
    return _overrides(init_model, out, "grpo", **{"objective.beta": 0.1, "steps": 2, "grad_clip": 1.0, **extra})


def _launch(overrides: list[str], tmp_path: Path, config: Path = ZERO3_CONFIG) -> None:
    """`accelerate launch --config_file config` of `stabledrl train` on 2 CPU processes."""
    empty = tmp_path / "empty.yaml"  # every field comes from --set
    empty.write_text("{}\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(_free_port()),
           "-m", "tests.test_zero3", "train", "--config", str(empty), *(f"--set={o}" for o in overrides)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow  # one launch of 2 processes and one run of one, about 15 s
@pytest.mark.parametrize("extra", [{}, {"lora.r": 4, "lora.alpha": 8}], ids=["full", "lora"])
def test_zero3_with_a_kl_term_makes_the_steps_of_one_process(init_model, tmp_path, extra):
    pytest.importorskip("deepspeed")
    one, two = tmp_path / "one", tmp_path / "zero3"
    run_train(load_config(TrainConfig, None, _zero3_overrides(init_model, one, **extra)), progress=False)
    _launch(_zero3_overrides(init_model, two, **extra), tmp_path)
    r1, r2 = _rows(one), _rows(two)
    # before the first update the reference's ℓ is the policy's, bit for bit
    assert r2[1]["drift_kl"] == r2[1]["drift_k3"] == r2[1]["kl_ref"] == 0.0
    assert r2[2]["drift_kl"] > 0.1  # after it they differ (measured: 5.8; LoRA 0.9) ...
    for key in ("reward_mean", "loss", "grad_norm", "drift_kl", "drift_k3", "kl_ref"):
        for step in (1, 2):  # ... as in one process (measured: within 1e-7)
            assert r2[step][key] == pytest.approx(r1[step][key], rel=1e-5, abs=1e-7), (step, key)
    if not extra:  # the saved weights: gathered from the partitions
        assert_same_update(_update(init_model, one), _update(init_model, two))


def _stage2_config(tmp_path: Path) -> Path:
    """deepspeed-zero3.yaml with ZeRO stage 2 (parameters whole on every process) in its JSON."""
    import yaml

    cfg = yaml.safe_load(ZERO3_CONFIG.read_text())
    ds = json.loads((ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]).read_text())
    ds["zero_optimization"] = {"stage": 2}
    (tmp_path / "zero2.json").write_text(json.dumps(ds))
    cfg["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "zero2.json"), "zero3_init_flag": False}
    (tmp_path / "zero2.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "zero2.yaml"


@pytest.mark.slow  # one launch of 2 processes, about 10 s
@pytest.mark.parametrize("stage", [3, 2])
def test_under_bf16_the_reference_runs_in_the_policys_precision(init_model, tmp_path, stage):
    # DeepSpeed's bf16 mode holds bfloat16 weights, and accelerate's autocast does nothing under
    # DeepSpeed: a float32 reference beside them scored otherwise (measured with a plain copy
    # under stage 2: drift_kl 0.003 at step 1).
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    _launch(_zero3_overrides(init_model, out, mixed_precision="bf16"), tmp_path,
            ZERO3_CONFIG if stage == 3 else _stage2_config(tmp_path))
    step1 = _rows(out)[1]
    assert step1["drift_kl"] == step1["kl_ref"] == 0.0 and step1["grad_norm"] > 0


def _cpu_zero3_main() -> int:
    """The CLI under DeepSpeed on CPU processes. accelerate turns DeepSpeed on only for GPU-like
    process groups (as with FSDP: tests/test_distributed.py's `_cpu_fsdp_main`); DeepSpeed itself
    runs on CPU processes over gloo. Its type and the plugin that the launcher's variables (the
    config file) describe are set right after the Accelerator is made, as accelerate does on GPUs."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    from stabledrl.cli import main

    class CpuZero3Accelerator(accelerate.Accelerator):
        def __init__(self, *args, mixed_precision=None, **kwargs):
            super().__init__(*args, mixed_precision=mixed_precision, **kwargs)
            PartialState().distributed_type = self.state.distributed_type = DistributedType.DEEPSPEED
            plugin = DeepSpeedPlugin()
            plugin.set_mixed_precision(mixed_precision or "no")
            self.state.deepspeed_plugins = {"default": plugin}
            plugin.select(True)  # zero3_init_flag: transformers partitions the models as they load

    accelerate.Accelerator = CpuZero3Accelerator  # run_train imports it when it runs
    return main()


if __name__ == "__main__":
    code = _cpu_zero3_main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code or 0)
