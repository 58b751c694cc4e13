"""Before a run loads its model: the memory each process will hold in every phase of a step
and of an evaluation (the memory model, `stabledrl.memory`, fed the run's config, the model's
config.json and the task's longest prompt in tokens) and the disk its checkpoints will take,
against what the machine has. `stabledrl train` prints the prediction on every run and
refuses, in one line naming the phase and the setting to change, a run that cannot fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabledrl.config import ConfigError
from stabledrl.memory import (
    Footprint,
    Shape,
    checkpoint_bytes,
    footprint,
    llada_lora_param_count,
    lora_param_count,
    predict_memory,
    with_eval,
)

__all__ = ["Machine", "Prediction", "predict_run", "run_footprint", "run_disk", "eval_rows_per_call", "check_run",
           "PUBLISHED_SHAPES"]

GB = 1e9

PUBLISHED_SHAPES = {  # when config.json cannot be read (offline); each config.json's fields, cited in benchmarks/scale.py
    "GSAI-ML/LLaDA-8B-Instruct": Shape(126464, 4096, 32, 32, 12288),
    "GSAI-ML/LLaDA-8B-Base": Shape(126464, 4096, 32, 32, 12288),
    "GSAI-ML/LLaDA-1.5": Shape(126464, 4096, 32, 32, 12288),
    "Dream-org/Dream-v0-Instruct-7B": Shape(152064, 3584, 28, 28, 18944, 1e6, 131072, 4, qkv_bias=True),
    "Dream-org/Dream-v0-Base-7B": Shape(152064, 3584, 28, 28, 18944, 1e6, 131072, 4, qkv_bias=True),
    "JetLM/SDAR-8B-Chat": Shape(151936, 4096, 36, 32, 12288, 1e6, 32768, 8, qk_norm=True),
}
PUBLISHED_BLOCK_SIZES = {"JetLM/SDAR-8B-Chat": 4}

ADVICE = {
    "start": "train fewer parameters (lora: {r: 16}) or shard them over more processes (configs/accelerate/fsdp.yaml)",
    "rollout": "lower rollout.micro_batch or rollout.gen_length",
    "scoring": "lower estimator.max_views_per_forward or raise accumulation_rounds",
    "update": "turn on model.gradient_checkpointing, lower estimator.max_views_per_forward or raise accumulation_rounds",
    "optimizer": "train fewer parameters (lora: {r: 16}) or shard them over more processes (configs/accelerate/fsdp.yaml)",
    "evaluation": "lower eval_sampling.micro_batch or set eval_sampling.max_prompt_length",
}


@dataclass(frozen=True)
class Machine:
    """What one process of the run has: memory (bytes; None: unknown), where, and the processes."""

    memory: int | None
    where: str  # "GPU" or "RAM"
    processes: int = 1
    sharded: bool = False  # FSDP or ZeRO-3: weights, gradients and AdamW states split among the processes


@dataclass
class Prediction:
    """The memory model's phases for one process, the disk of the run's checkpoints, the machine."""

    phases: dict[str, int]
    terms: dict[str, int]
    disk: dict[str, int]
    machine: Machine
    disk_free: int | None = None
    disk_path: str = ""
    kept: int = 2  # checkpoints the run keeps (`TrainConfig.keep_checkpoints`)

    @property
    def peak(self) -> tuple[str, int]:
        phase = max(self.phases, key=self.phases.get)
        return phase, self.phases[phase]

    def line(self) -> str:
        """One line: the peak, every phase, and the disk."""
        phase, peak = self.peak
        of = f" of {self.machine.memory / GB:.2f} GB" if self.machine.memory else ""
        each = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.phases.items() if k != "start")
        free = f" ({self.disk_free / GB:.1f} GB free)" if self.disk_free is not None else ""
        return (f"preflight: {peak / GB:.2f} GB per process at its peak ({phase}){of} {self.machine.where} "
                f"[{each} GB]; checkpoints need {self.disk['run'] / GB:.2f} GB of disk{free}")


def model_config(path: str) -> dict[str, Any] | None:
    """A checkpoint's config.json as a dict: a local directory's, else the Hub's (cached), else None."""
    local = Path(path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(path, "config.json")).read_text())
    except Exception:  # offline, no such repository: the caller falls back to the published shapes
        return None


def _shape(cfg: Any) -> tuple[Shape, int | None]:
    """The model's shape and a block model's block size, from config.json or the shapes we know."""
    config = model_config(cfg.model.path)
    if config is None:
        if cfg.model.path not in PUBLISHED_SHAPES:
            raise LookupError(f"no config.json at {cfg.model.path}")
        return PUBLISHED_SHAPES[cfg.model.path], cfg.model.block_size or PUBLISHED_BLOCK_SIZES.get(cfg.model.path)
    block = cfg.model.block_size or (config.get("block_size") if config.get("attention_kind", "block") == "block" else None)
    return Shape.from_config(config), block


def run_footprint(cfg: Any, shape: Shape, block: int | None, machine: Machine, prompt_tokens: tuple[int, int],
                  eval_rows: int, completion_length: int) -> Footprint:
    """The memory model's footprint of one process of `cfg` on `machine`: `prompt_tokens` the
    longest training and evaluation prompts, `eval_rows` evaluation's rows per sampler call,
    `completion_length` the task's where the sampling settings give no gen_length."""
    lora = 0
    if cfg.lora is not None:
        targets = list(cfg.lora.target_modules) if cfg.lora.target_modules else ["all-linear"]
        lora = (llada_lora_param_count(shape, cfg.lora.r, targets) if cfg.model.adapter == "llada"
                else lora_param_count(shape, cfg.lora.r))
    run_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, gen_length=cfg.rollout.gen_length or completion_length))
    f = footprint(run_cfg, prompt_tokens[0], lora_params=lora, weight_bytes=_weight_bytes(cfg),
                  shards=machine.processes if machine.sharded else 1, optimizer_chunk=2**26,
                  foreach=machine.where == "GPU")
    noise = cfg.rollout.noise_for(shape.vocab_size)
    f = dataclasses.replace(f, checkpointing=cfg.model.gradient_checkpointing, noise=noise,
                            block_length=cfg.rollout.block_length, block_size=block,
                            approx_cache=cfg.rollout.approx_cache != "none", reserve=machine.where == "GPU",
                            head_on_block=noise == "counter" and not cfg.model.trust_remote_code)
    return with_eval(f, eval_rows, prompt_tokens[1], cfg.eval_sampling.gen_length or completion_length)


def _weight_bytes(cfg: Any) -> int:
    return 2 if cfg.model.dtype in ("bfloat16", "float16") else 4


def run_disk(shape: Shape, f: Footprint, cfg: Any, processes: int) -> dict[str, int]:
    """`checkpoint_bytes` of `cfg`'s checkpoints, and ``run``: the kept ones, one more while the next
    is saved, and final/ in `TrainConfig.final_precision`."""
    final = {"bfloat16": 2, "float32": 4}.get(cfg.final_precision)
    disk = checkpoint_bytes(shape, f, processes=processes, model_bytes=_weight_bytes(cfg), final_bytes=final)
    return {**disk, "run": (cfg.keep_checkpoints + 1) * disk["checkpoint"] + disk["final"]}


def eval_rows_per_call(cfg: Any, processes: int, default_micro_batch: int) -> int:
    """Evaluation's rows per sampler call: its micro-batch (else the default), at most a process's share."""
    return min(cfg.eval_sampling.micro_batch or default_micro_batch, -(-cfg.eval_n // processes))


def predict_run(cfg: Any, task: Any, machine: Machine, *, prompt_tokens: tuple[int, int], eval_rows: int) -> Prediction:
    """The prediction for `cfg` on `machine` (`run_footprint`, `run_disk`), the model's shape read
    from its config.json."""
    shape, block = _shape(cfg)
    f = run_footprint(cfg, shape, block, machine, prompt_tokens, eval_rows, task.completion_length)
    pred = predict_memory(shape, f)
    return Prediction(pred["phases"], pred["terms"], run_disk(shape, f, cfg, machine.processes), machine,
                      kept=cfg.keep_checkpoints)


def check_run(pred: Prediction, out: str | Path) -> None:
    """Refuse (ConfigError, one line) when the predicted peak exceeds the machine's memory or the
    checkpoints the free disk at `out` (its nearest existing folder); records the free disk."""
    where = Path(out).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    pred.disk_free, pred.disk_path = shutil.disk_usage(where).free, str(where)
    phase, peak = pred.peak
    m = pred.machine
    if m.memory is not None and peak > m.memory:
        raise ConfigError(f"the memory model predicts {peak / GB:.2f} GB per process in the {phase} phase, more than "
                          f"the {m.memory / GB:.2f} GB of {m.where} a process has: {ADVICE[phase]} "
                          "(or preflight: false to try anyway)")
    if pred.disk["run"] > pred.disk_free:
        raise ConfigError(f"the run's checkpoints need {pred.disk['run'] / GB:.2f} GB of disk ({pred.kept + 1} "
                          f"checkpoints of {pred.disk['checkpoint'] / GB:.2f} GB while one is saved, and final/), "
                          f"{pred.disk_free / GB:.2f} GB are free at {where}: free space or set output_dir on another "
                          "disk (or preflight: false)")


def longest_prompt_tokens(task: Any, tokenizer: Any, chat_template: bool, *, k: int = 16) -> int:
    """Tokens of the task's longest prompt (BOS and chat template included): the `k` longest by
    characters of both splits (all rows of a dataset task; 256 problems of each split of a
    generated one) encoded as the sampler encodes them."""
    from stabledrl.data import encode_prompts

    if hasattr(task, "data") and hasattr(task, "prompt_of"):
        texts = [task.prompt_of(r) for r in task.data.loaded_rows()]
    else:
        texts = [p.prompt for split in ("train", "test") for p in task.generate(256, split=split, seed=0)]
    longest = sorted(texts, key=len)[-k:]
    return encode_prompts(tokenizer, longest, chat_template=chat_template)[0].size(1) if longest else 1


def machine_of(device: Any, processes: int, sharded: bool) -> Machine:
    """One process's share of the machine: a GPU's whole memory, or the RAM divided among the processes."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return Machine(torch.cuda.get_device_properties(device).total_memory, "GPU", processes, sharded)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    return Machine(None if ram is None else ram // processes, "RAM", processes, sharded)
