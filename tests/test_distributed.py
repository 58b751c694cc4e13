"""N processes compute the update of one process (docs/scale-out.md; issue: exact group statistics).

Two CPU processes (gloo, launched by `accelerate launch` exactly as a user would) against
one process on the same data and seeds. The optimiser is plain SGD with lr 1 and no
clipping, so the update is −g itself (AdamW's first step is lr·sign(g) and would hide
almost any error) and the comparison checks the gradient to 1e-5 of its largest entry,
4e-6 here: 30 times the rounding of float32 weights of size 1 (1.2e-7), far below any real
error. 3 prompts × G = 4 is 12 rows, 6 per process: group 1 (rows 4-7) spans both
processes, so the advantages and StableDRL's self-normalised weights are only right if
computed on the gathered group; with G = 3 the 9 rows split 4/5, so the processes' shares
(and micro-batch counts) differ.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.config import ConfigError, load_config
from stabledrl.train import TrainConfig, _check_processes, run_train
from tests.conftest import make_tiny_policy


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _overrides(init_model, out, objective: str, **extra) -> list[str]:
    sets = {"model": str(init_model), "output_dir": str(out), "task.name": "sudoku", "steps": 1,
            "prompts_per_step": 3, "group_size": 4, "mu": 1, "optimizer": "sgd", "lr": 1.0, "grad_clip": 1e6,
            "eval_n": 2, "zero_variance_groups": "keep", "estimator.method": "mc", "estimator.num_samples": 2,
            "objective.name": objective, "threads": 1, **extra}
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(overrides: list[str], processes: int, tmp_path, timeout: float = 300) -> None:
    empty = tmp_path / "empty.yaml"  # every field comes from --set
    empty.write_text("{}\n")
    # --multi_gpu selects accelerate's torchrun launcher; the trainer's Accelerator(cpu=True)
    # then forms a gloo group of CPU processes (accelerate's --cpu launcher needs MPI).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "stabledrl", "train", "--config", str(empty)]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)  # a hang fails, not blocks
    assert res.returncode == 0, res.stderr[-4000:]


def _update(init_model, run_dir) -> dict[str, torch.Tensor]:
    before = load_file(init_model / "model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    return {k: after[k] - before[k] for k in before}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_update(a: dict, b: dict) -> None:
    scale = max(float(v.abs().max()) for v in a.values())
    assert scale > 1e-2  # a real update, not a no-op
    assert _max_diff(a, b) < 1e-5 * scale  # measured: 6e-8 against a scale of 0.4


@pytest.mark.parametrize("objective, common, extra", [
    # G = 3: 9 rows, 4 on one process and 5 on the other
    ("grpo", {"group_size": 3}, {}),
    ("stabledrl", {}, {}),
    # gradient accumulation, 2 views per forward/backward, with uneven shares: the
    # processes make different numbers of micro-batches and synchronise once
    ("stabledrl", {"group_size": 3}, {"estimator.max_views_per_forward": 2}),
    # the path estimator replays each rollout's unmask order, which is gathered with the rows
    ("stabledrl", {"group_size": 3, "estimator.method": "path", "estimator.num_samples": 1}, {}),
])
def test_two_processes_make_the_update_of_one(init_model, tmp_path, objective, common, extra):
    one = tmp_path / "one"
    run_train(load_config(TrainConfig, None, _overrides(init_model, one, objective, **common)), progress=False)
    two = tmp_path / "two"
    _launch(_overrides(init_model, two, objective, **common, **extra), processes=2, tmp_path=tmp_path)
    assert_same_update(_update(init_model, one), _update(init_model, two))
    # Every process saw the same whole groups: the logged statistics agree too.
    m1 = (one / "metrics.jsonl").read_text().splitlines()
    m2 = (two / "metrics.jsonl").read_text().splitlines()
    assert len(m1) == len(m2) == 3  # one writer: the main process
    r1, r2 = json.loads(m1[1]), json.loads(m2[1])
    for key in ("reward_mean", "loss", "grad_norm", "ratio_max", "groups_used"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-7), key


def test_micro_batches_give_the_update_of_one_batch(init_model, tmp_path):
    # One process: backward 1 view at a time (accumulating .grad) vs the whole batch at once.
    updates = []
    for name, budget in (("whole", None), ("micro", 1)):
        sets = _overrides(init_model, tmp_path / name, "stabledrl", **{"estimator.max_views_per_forward": budget})
        run_train(load_config(TrainConfig, None, sets), progress=False)
        updates.append(_update(init_model, tmp_path / name))
    assert_same_update(*updates)


def test_each_process_needs_a_row_of_every_group():
    # A step may keep one group; with group_size 2 and 3 processes one process would have
    # no row and DDP would wait for its backward forever: refused at start-up instead.
    cfg = load_config(TrainConfig, None, ["group_size=2", "eval_n=8"])
    _check_processes(cfg, 2)
    with pytest.raises(ConfigError, match="group_size"):
        _check_processes(cfg, 3)
    with pytest.raises(ConfigError, match="eval_n"):
        _check_processes(load_config(TrainConfig, None, ["eval_n=2"]), 3)
