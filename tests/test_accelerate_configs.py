"""The shipped accelerate configs pass `accelerator.prepare` with every family's layer classes
(docs/scale-out.md).

`configs/accelerate/deepspeed-zero3.yaml` likewise (DeepSpeed's CPU backend over gloo, when
deepspeed is installed): prepare with no dataloader, parameters partitioned, one step; and a
reference copy of each model prepared as the trainer prepares it, partitioned too, with the
policy's logits.

`configs/accelerate/fsdp.yaml`, unchanged, under a 2-process CPU launch (gloo; the FSDP switch
of tests/test_distributed.py's `_cpu_fsdp_main`), wraps the tiny model and the LLaDA, Dream and
SDAR stand-ins (which list what the real classes list) layer by layer: each of their 2 layers
and the root become FSDP modules, and one SGD step runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"
ZERO3_CONFIG = ROOT / "configs" / "accelerate" / "deepspeed-zero3.yaml"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.conftest import make_tiny_policy
    from tests.models.test_adapters import save_stand_ins

    root = tmp_path_factory.mktemp("configs")
    out = {name: path for name, path in save_stand_ins(root).items() if name in ("llada", "dream", "sdar")}
    out["tiny"] = root / "tiny"
    make_tiny_policy(seed=5).save(out["tiny"])
    return out


def _launch(config: Path, checkpoints: dict[str, Path], tmp_path: Path) -> dict:
    from tests.test_distributed import _free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(_free_port()),
           "-m", "tests.test_accelerate_configs", str(tmp_path / "report.json"),
           *(f"{name}={path}" for name, path in checkpoints.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, "\n".join(line for line in res.stderr.splitlines() if "Error" in line)[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # FSDP's RAM-efficient loading (fsdp.yaml) gives real weights to the first process only
    assert report["loaded"] == ([1, 0] if config == FSDP_CONFIG else [1, 1])
    return report["models"]


@pytest.mark.slow  # one 2-process launch, about 20 s
def test_the_shipped_fsdp_config_wraps_every_familys_layers(checkpoints, tmp_path):
    report = _launch(FSDP_CONFIG, checkpoints, tmp_path)
    layer = {"tiny": "_Block", "llada": "LLaDALlamaBlock", "dream": "DreamDecoderLayer", "sdar": "SDARDecoderLayer"}
    assert report.keys() == layer.keys()
    for name, seen in report.items():
        # each of the 2 layers is an FSDP module of its own (FSDP2 names its class FSDP<class>),
        # and so is the root; accelerate adds the embeddings (and a final norm) beside them
        assert seen["wrapped"].count(f"FSDP{layer[name]}") == 2 and seen["root"] in seen["wrapped"], seen
        assert seen["no_split_modules"] == [layer[name]], name
        assert seen["sharded"] and seen["changed"], name


@pytest.mark.slow  # one 2-process launch, about 30 s
def test_the_shipped_zero3_config_prepares_without_a_dataloader(checkpoints, tmp_path):
    pytest.importorskip("deepspeed")
    report = _launch(ZERO3_CONFIG, checkpoints, tmp_path)
    assert report.keys() == {*checkpoints, *(f"{name}-reference" for name in checkpoints)}
    for name, seen in report.items():
        # every parameter partitioned over the 2 processes (ZeRO-3), and one step changed the
        # weights; a reference copy (stabledrl.training_run.prepare_reference_copy) is an engine
        # of its own, partitioned, whose logits equal the policy's before the step, bit for bit
        assert seen["root"] == "DeepSpeedEngine" and seen["sharded"], (name, seen)
        assert seen["same_logits"] if name.endswith("-reference") else seen["changed"], (name, seen)


def _zero3_gathered(model) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _partitioned(engine) -> bool:
    """Every parameter of a ZeRO-3 engine partitioned over the 2 processes."""
    return all(p.ds_tensor.numel() < p.ds_numel for p in engine.parameters() if p.ds_numel > 1)


def _main(report: str, checkpoints: list[str]) -> int:
    """Under `accelerate launch`: prepare each model with an SGD optimiser, take one step, and
    (on the main process) write what was wrapped to `report`."""
    import accelerate
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    from stabledrl.models import ModelConfig, load_policy
    from stabledrl.training_run import prepare_reference_copy

    torch.set_num_threads(1)
    acc = accelerate.Accelerator(cpu=True)
    # on CPUs accelerate picks MULTI_CPU whatever the launcher says: switch to FSDP (as
    # tests/test_distributed.py's _cpu_fsdp_main does) or DeepSpeed, with the plugin that the
    # launcher's variables (the config file) describe, as Accelerator makes it on GPUs
    zero3 = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    kind = DistributedType.DEEPSPEED if zero3 else DistributedType.FSDP
    PartialState().distributed_type = acc.state.distributed_type = kind
    out = {}
    for item in checkpoints:
        name, path = item.split("=", 1)
        if zero3:
            plugin = DeepSpeedPlugin()
            plugin.set_mixed_precision("no")  # what Accelerator does with its mixed_precision
            acc.state.deepspeed_plugins = {"default": plugin}
            plugin.select(True)
        else:  # a plugin per model: one keeps the layer classes of the first model it wrapped
            acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        policy = load_policy(ModelConfig(path=path))
        before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        model, opt = acc.prepare(policy.model, torch.optim.SGD(policy.model.parameters(), lr=0.5))
        policy.model = model
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]] * 2)  # (2, 6)
        mask = torch.ones(2, 6, 6, dtype=torch.bool) if policy.attention_kind == "block" else torch.ones(2, 6)
        logits = policy.logits(ids, mask, torch.arange(6).expand(2, 6))  # (2, 6, V)
        if zero3:  # the reference copy: an engine of its own, partitioned, the policy's logits
            reference = load_policy(ModelConfig(path=path))
            prepare_reference_copy(reference, acc)
            with torch.no_grad():
                same = torch.equal(reference.logits(ids, mask, torch.arange(6).expand(2, 6)), logits)
            out[f"{name}-reference"] = {"root": type(reference.model).__name__, "sharded": _partitioned(reference.model),
                                        "same_logits": same}
        acc.backward(logits.log_softmax(-1)[..., 2].mean())
        opt.step()
        after = _zero3_gathered(model) if zero3 else acc.get_state_dict(model)
        inner = getattr(model, "module", model)
        sharded = _partitioned(model) if zero3 else all(p.__class__.__name__ == "DTensor" for p in model.parameters())
        out[name] = {"root": type(model).__name__ if zero3 else type(inner).__name__,
                     "wrapped": sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)),
                     "no_split_modules": list(inner._no_split_modules),
                     "sharded": sharded,
                     "changed": acc.is_main_process and any(not torch.equal(before[k], after[k]) for k in before
                                                            if k in after)}
    # which processes read real weights at load (and so ran the attention probe)
    from stabledrl._compat import weights_loaded_here
    loaded = acc.gather(torch.tensor([int(weights_loaded_here())])).tolist()
    if acc.is_main_process:
        Path(report).write_text(json.dumps({"loaded": loaded, "models": out}, indent=1))
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = _main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # past gloo's threads at interpreter teardown (stabledrl.cli does the same)


def test_the_zero3_config_names_a_deepspeed_file_accelerate_accepts():
    # Checked without deepspeed: the YAML points at its JSON (stage 3, a micro-batch size, which
    # accelerate needs when prepare() gets no dataloader) and sets no mixed_precision beside it.
    import yaml

    cfg = yaml.safe_load(ZERO3_CONFIG.read_text())
    ds = json.loads((ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]).read_text())
    assert "mixed_precision" not in cfg
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] >= 1
