"""N processes compute the update of one process (docs/scale-out.md; issue: exact group statistics),
and resume from a checkpoint exactly; under DDP and under FSDP (on CPU: `_cpu_fsdp_main`).

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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.checkpoint import latest_checkpoint
from stabledrl.config import ConfigError, load_config
from stabledrl.models.policy import load_policy
from stabledrl.train import TrainConfig, run_train
from stabledrl.training_run import check_processes
from tests.conftest import make_tiny_policy, metric_rows

FSDP_CONFIG = Path(__file__).parents[1] / "configs" / "accelerate" / "fsdp.yaml"


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _overrides(init_model, out, objective: str, **extra) -> list[str]:
    sets = {"model": str(init_model), "output_dir": str(out), "task.name": "sudoku", "steps": 1,
            "prompts_per_step": 3, "group_size": 4, "mu": 1, "optimizer": "sgd", "lr": 1.0, "grad_clip": 1e6,
            "eval_n": 2, "zero_variance_groups": "keep", "estimator.method": "mc", "estimator.num_samples": 2,
            "objective.name": objective, "threads": 1, "drift_kl": True, **extra}
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(overrides: list[str], processes: int, tmp_path, timeout: float = 300, *, fsdp: bool = False,
            resume: bool = False, stop_after_save: bool = False, launcher: tuple[str, ...] = (),
            report: Path | None = None, kill: str = "", lean: Path | None = None) -> None:
    """`accelerate launch ... -m stabledrl train` on `processes` CPU processes. `fsdp`: with
    configs/accelerate/fsdp.yaml, through `_cpu_fsdp_main`; `stop_after_save`: every process
    stops right after the first checkpoint (the launch must then fail); `launcher`: more
    options of `accelerate launch`; `report`: a JSON file where the main process says how its
    model was prepared (`_report_run`); `kill`: "STAGE:RANK:N", that process dies at the N-th
    time it reaches that stage of a save (`_kill_at`), and the launch, the others waiting for it,
    is stopped after `timeout` if it has not ended by then; `lean`: a JSON file where the main
    process lists, for each `generate`, the LoRA layers given the short forward and its calls
    (`_report_lean`)."""
    empty = tmp_path / "empty.yaml"  # every field comes from --set
    empty.write_text("{}\n")
    # --multi_gpu selects accelerate's torchrun launcher; the trainer's Accelerator(cpu=True)
    # then forms a gloo group of CPU processes (accelerate's --cpu launcher needs MPI).
    layout = ["--config_file", str(FSDP_CONFIG)] if fsdp else ["--multi_gpu"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *layout, *launcher, "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m",
           "tests.test_distributed" if fsdp or stop_after_save or report or kill or lean else "stabledrl", "train",
           "--config", str(empty), *(["--resume"] if resume else [])]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "STABLEDRL_TEST_FSDP": str(int(fsdp)),
           "STABLEDRL_TEST_STOP_AFTER_SAVE": str(int(stop_after_save)), "STABLEDRL_TEST_REPORT": str(report or ""),
           "STABLEDRL_TEST_KILL": kill, "STABLEDRL_TEST_LEAN": str(lean or "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).parents[1])
    try:
        _, stderr = proc.communicate(timeout=timeout)  # a hang fails, not blocks
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: torchrun (inside accelerate's launcher) then stops the
        # processes it started, which run in sessions of their own.
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if kill:  # the survivors waited for the lost process: the whole launch is stopped, as a user would
            return
        raise
    if kill:
        assert proc.returncode != 0, stderr[-4000:]
    elif stop_after_save:
        assert proc.returncode != 0 and "_StopAfterSave" in stderr, stderr[-4000:]
    else:
        assert proc.returncode == 0, stderr[-4000:]


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


@pytest.mark.slow  # two launches (about 9 s): .ci/run's second step, `python -m pytest -m slow`
@pytest.mark.parametrize("objective, common, extra, fsdp", [
    # G = 3: 9 rows, 4 on one process and 5 on the other
    ("grpo", {"group_size": 3}, {}, False),
    ("stabledrl", {}, {}, False),
    # gradient accumulation, 2 views per forward/backward, with uneven shares: the
    # processes make different numbers of micro-batches and synchronise once
    ("stabledrl", {"group_size": 3}, {"estimator.max_views_per_forward": 2}, False),
    # the path estimator replays each rollout's unmask order, which is gathered with the rows
    ("stabledrl", {"group_size": 3, "estimator.method": "path", "estimator.num_samples": 1}, {}, False),
    # counter noise: a row's keys come from its own generator, so it samples the same on either
    # process as in one (uneven shares); rollouts at TrainConfig's temperature 1
    pytest.param("stabledrl", {"group_size": 3, "rollout.noise": "counter"}, {}, False,
                 id="counter-noise"),
    # FSDP (configs/accelerate/fsdp.yaml, on CPU: see _cpu_fsdp_main): each process holds
    # half of every weight; sampling in lockstep, gathered weights saved
    ("stabledrl", {}, {}, True),
    # and in 3 accumulation rounds of one group (2 rows a process each) against one process in one round
    pytest.param("stabledrl", {}, {"accumulation_rounds": 3}, True, id="fsdp-rounds"),
])
def test_two_processes_make_the_update_of_one(init_model, tmp_path, objective, common, extra, fsdp):
    one = tmp_path / "one"
    run_train(load_config(TrainConfig, None, _overrides(init_model, one, objective, **common)), progress=False)
    two = tmp_path / "two"
    _launch(_overrides(init_model, two, objective, **common, **extra), processes=2, tmp_path=tmp_path, fsdp=fsdp)
    assert_same_update(_update(init_model, one), _update(init_model, two))
    # Every process saw the same whole groups: the logged statistics agree too.
    m1 = (one / "metrics.jsonl").read_text().splitlines()
    m2 = (two / "metrics.jsonl").read_text().splitlines()
    assert len(m1) == len(m2) == 3  # one writer: the main process
    r1, r2 = json.loads(m1[1]), json.loads(m2[1])
    # drift_kl: at step 1 the policy is the reference, so it is 0 unless a process's
    # reference copy differs (under FSDP, one loaded without its weights)
    for key in ("reward_mean", "loss", "grad_norm", "ratio_max", "groups_used", "drift_kl"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-7), key
    if common.get("rollout.noise") == "counter":  # not vacuous: random rollouts, which the noise decides
        cfg = load_config(TrainConfig, None, _overrides(init_model, tmp_path / "generator", objective, **{
            **common, "rollout.noise": "generator"}))
        assert cfg.rollout.temperature > 0
        run_train(cfg, progress=False)
        other = tmp_path / "generator"
        assert _max_diff(_update(init_model, one), _update(init_model, other)) > 1e-2


@pytest.mark.slow  # one launch of 2 processes and a run of one, about 15 s
def test_lora_under_fsdp_samples_through_the_short_forward_and_makes_the_update_of_one(init_model, tmp_path):
    # The sampler's short LoRA forward inside FSDP's units (casts from the gathered weights): the
    # rollouts, and so the update, of one process; the adapters' B matrices start at zero, so they
    # are the update.
    lora = {"lora.r": 4, "lora.alpha": 8}
    one, two, lean = tmp_path / "one", tmp_path / "two", tmp_path / "lean.json"
    run_train(load_config(TrainConfig, None, _overrides(init_model, one, "stabledrl", **lora)), progress=False)
    _launch(_overrides(init_model, two, "stabledrl", **lora), processes=2, tmp_path=tmp_path, fsdp=True, lean=lean)
    served = json.loads(lean.read_text())  # rollouts and evaluations
    assert served and all(layers > 0 and calls > 0 for layers, calls in served)
    a, b = (load_file(d / "final" / "adapter_model.safetensors") for d in (one, two))
    assert set(a) == set(b)
    learned = [k for k in a if "lora_B" in k]
    assert_same_update({k: a[k] for k in learned}, {k: b[k] for k in learned})


def test_micro_batches_give_the_update_of_one_batch(init_model, tmp_path):
    # One process: backward 1 view at a time (accumulating .grad) vs the whole batch at once.
    updates = []
    for name, budget in (("whole", None), ("micro", 1)):
        sets = _overrides(init_model, tmp_path / name, "stabledrl", **{"estimator.max_views_per_forward": budget})
        run_train(load_config(TrainConfig, None, sets), progress=False)
        updates.append(_update(init_model, tmp_path / name))
    assert_same_update(*updates)


@pytest.mark.slow  # launches of 3 and 4 processes on CPU (about 15 s each)
@pytest.mark.parametrize("processes, common, extra, fsdp", [
    # 2 rows on 3 processes: the main process has none; it rolls out and scores a stand-in row
    # with weight 0 (seed 1: the group's two rewards differ, so there is an update)
    (3, {"group_size": 2, "prompts_per_step": 1, "seed": 1}, {}, False),
    # the same, its backward view batch by view batch (the stand-in's gradient is 0 there too)
    (3, {"group_size": 2, "prompts_per_step": 1, "seed": 1}, {"estimator.max_views_per_forward": 1}, False),
    # d1's G = 6 on more processes than a step's kept rows need: one group, 1 or 2 rows each
    (4, {"group_size": 6, "prompts_per_step": 1}, {}, False),
    # FSDP: every forward is a collective, the stand-in's included (sampling in lockstep)
    pytest.param(3, {"group_size": 2, "prompts_per_step": 1, "seed": 1}, {}, True, id="fsdp"),
])
def test_a_group_smaller_than_the_processes_makes_the_update_of_one(init_model, tmp_path, processes, common, extra,
                                                                    fsdp):
    common = {**common, "eval_n": processes}
    one = tmp_path / "one"
    run_train(load_config(TrainConfig, None, _overrides(init_model, one, "stabledrl", **common)), progress=False)
    many = tmp_path / "many"
    _launch(_overrides(init_model, many, "stabledrl", **common, **extra), processes=processes, tmp_path=tmp_path,
            fsdp=fsdp)
    assert_same_update(_update(init_model, one), _update(init_model, many))
    r1, r2 = (json.loads((d / "metrics.jsonl").read_text().splitlines()[1]) for d in (one, many))
    for key in ("reward_mean", "loss", "grad_norm", "groups_used", "drift_kl"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-7), key


def test_any_group_size_runs_on_any_number_of_processes():
    # G = 6 on 4 processes (d1's groups on more GPUs than a step's kept rows may fill) is
    # accepted; held-out problems must still give every process one.
    check_processes(load_config(TrainConfig, None, ["group_size=6", "prompts_per_step=1", "eval_n=8"]), 4)
    check_processes(load_config(TrainConfig, None, ["group_size=2", "eval_n=8"]), 3)
    with pytest.raises(ConfigError, match="eval_n"):
        check_processes(load_config(TrainConfig, None, ["eval_n=2"]), 3)


def _resume_overrides(init_model, out) -> list[str]:
    # AdamW (its state is what a resume must restore), 4 steps, a checkpoint every 2.
    return _overrides(init_model, out, "stabledrl", steps=4, save_every=2, optimizer="adamw", lr=1e-3, grad_clip=1.0,
                      prompts_per_step=2, mu=2)


# What a run under FSDP sets besides the resume's settings: bf16 autocast, each block recomputed in
# the backward, rollouts and evaluation 2 rows a call, the backward 2 views at a time, 2 rounds a step
_EVERYTHING = {"mixed_precision": "bf16", "model.gradient_checkpointing": "true", "rollout.micro_batch": 2,
               "eval_sampling.micro_batch": 1, "estimator.max_views_per_forward": 2, "accumulation_rounds": 2}
# layout -> (accelerate launch's options, the run's other settings, what accelerate writes in a checkpoint)
_LAYOUTS = {
    "ddp": (None, {}, {"optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"}),  # the weights: the policy's
    # gathered into one file by the main process
    "fsdp-full": (("--fsdp_state_dict_type", "FULL_STATE_DICT"), {}, {
        "optimizer.bin", "pytorch_model_fsdp.bin", "random_states_0.pkl", "random_states_1.pkl"}),
    # configs/accelerate/fsdp.yaml as shipped: every process writes its shards (torch.distributed.checkpoint
    # folders); with everything a real-scale recipe turns on
    "fsdp-sharded": ((), _EVERYTHING, {"optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl",
                                       "random_states_1.pkl"}),
}


@pytest.mark.slow  # two launches of two processes each (about 25 s): .ci/run's second step
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_two_processes_resume_exactly(init_model, tmp_path, layout):
    # Two processes, stopped right after the step-2 checkpoint and resumed, against the same
    # two processes uninterrupted: the same metrics and final weights, bit for bit. Under FSDP
    # each process holds half of the weights and of AdamW's state; a checkpoint that kept only
    # the main process's half (or none of it) resumes with other moments and drifts.
    launcher, extra, files = _LAYOUTS[layout]
    kw = {"fsdp": launcher is not None, "launcher": launcher or ()}
    full, crash = tmp_path / "full", tmp_path / "crash"
    sets = lambda out: [*_resume_overrides(init_model, out), *(f"{k}={v}" for k, v in extra.items())]  # noqa: E731
    _launch(sets(full), 2, tmp_path, report=tmp_path / "report.json", **kw)
    _launch(sets(crash), 2, tmp_path, stop_after_save=True, **kw)
    assert [p.name for p in crash.glob("checkpoint-*")] == ["checkpoint-0000002"]
    _launch(sets(crash), 2, tmp_path, resume=True, **kw)
    assert metric_rows(crash) == metric_rows(full)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (full, crash))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in load_file(init_model / "model.safetensors").items())
    # The last checkpoint holds the whole model (gathered from the shards), as final/ does (in
    # bfloat16 under bf16: `final_dtype`), and both load; accelerate's part is laid out as the layout says.
    last = crash / "checkpoint-0000004"
    c = load_file(last / "model.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k].to(a[k].dtype)) for k in a)
    assert {p.name for p in (last / "accelerate").iterdir()} == files
    for d in (last, crash / "final"):
        load_policy(d)
    assert not [p.name for p in crash.iterdir() if p.name.startswith(".")]  # no leftovers
    report = json.loads((tmp_path / "report.json").read_text())
    if kw["fsdp"]:  # each of the 2 blocks is an FSDP unit of its own (FSDP2 names its class FSDP<class>)
        assert report["wrapped"].count("FSDP_Block") == 2 and "FSDPTinyDiffusionLM" in report["wrapped"], report
    # the blocks' matmuls ran in bfloat16 under bf16 autocast, in float32 otherwise; recomputed if asked
    assert report["linear_dtypes"] == (["torch.bfloat16"] if extra else ["torch.float32"]), report
    assert report["checkpointing"] == bool(extra)


def _kill_overrides(init_model, out) -> list[str]:
    # AdamW, 2 steps, a checkpoint after each: the kills hit the second one (or final/)
    return _overrides(init_model, out, "stabledrl", steps=2, save_every=1, optimizer="adamw", lr=1e-3,
                      grad_clip=1.0, prompts_per_step=2, mu=2)


@pytest.fixture(scope="module")
def uninterrupted(init_model, tmp_path_factory):
    """The run that the killed ones, resumed, must end as: the same two FSDP processes, not stopped."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _launch(_kill_overrides(init_model, tmp / "run"), 2, tmp, fsdp=True)
    return tmp / "run"


@pytest.mark.slow  # a launch killed mid-save and one resuming, each case (about 25 s): .ci/run's second step
@pytest.mark.parametrize("kill, resumes_from, left", [
    # rank 1 dies before its part of accelerate's state: rank 0 is left inside save_state's collective
    pytest.param("begin:1:2", 1, ".tmp-checkpoint-0000002", id="rank1-before-save_state"),
    # rank 0 dies with its shard of the optimizer written, before the weights: rank 1 waits in the barrier
    pytest.param("state:0:2", 1, ".tmp-checkpoint-0000002", id="rank0-after-save_state"),
    # every part written, no commit record yet
    pytest.param("written:0:1", 0, ".tmp-checkpoint-0000001", id="before-checkpoint.json"),
    # the commit record written, not renamed into place: still not a checkpoint
    pytest.param("recorded:0:2", 1, ".tmp-checkpoint-0000002", id="before-rename"),
    # the main process dies writing final/ (the gathered weights): the last checkpoint is the end of the run
    pytest.param("final:0:1", 2, ".tmp-final-", id="during-final"),
])
def test_a_process_killed_mid_save_resumes_exactly_from_the_last_complete_checkpoint(
        init_model, uninterrupted, tmp_path, kill, resumes_from, left):
    # Two FSDP processes (configs/accelerate/fsdp.yaml: each writes its shards), one killed at a
    # stage of a save; the launch ends (or is stopped), and the same command with --resume starts
    # from the last complete checkpoint (none: from step 0), removes the incomplete one and ends
    # with the uninterrupted run's metrics and final weights, bit for bit.
    crash = tmp_path / "crash"
    _launch(_kill_overrides(init_model, crash), 2, tmp_path, fsdp=True, kill=kill, timeout=120)
    last = latest_checkpoint(crash)
    assert (last.name if last else None) == (f"checkpoint-{resumes_from:07d}" if resumes_from else None)
    leftovers = [p.name[:len(left)] for p in crash.iterdir() if p.name.startswith(".")]
    # the main process removes its incomplete folder if it lives to see the collective fail
    assert leftovers == [left] or (kill.split(":")[1] != "0" and leftovers == [])
    if kill.startswith("recorded"):  # the commit record is there, but under the temporary name
        assert (crash / left / "checkpoint.json").is_file()
    _launch(_kill_overrides(init_model, crash), 2, tmp_path, fsdp=True, resume=True)
    assert metric_rows(crash) == metric_rows(uninterrupted)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (uninterrupted, crash))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in crash.iterdir() if p.name.startswith((".", "checkpoint-"))) == [
        "checkpoint-0000001", "checkpoint-0000002"]  # the incomplete one removed, no leftovers


class _StopAfterSave(Exception):
    pass


def _cpu_fsdp_main() -> int:
    """The CLI, for `_launch`: with STABLEDRL_TEST_FSDP=1 under FSDP on CPU processes, with
    STABLEDRL_TEST_STOP_AFTER_SAVE=1 stopping every process after its first checkpoint.

    accelerate 1.15 turns FSDP on only for GPU-like process groups: with Accelerator(cpu=True),
    which the trainer makes on any machine without a GPU, the distributed type is MULTI_CPU
    whatever the launcher says (ACCELERATE_USE_FSDP), and `prepare` wraps the model in DDP.
    torch's FSDP2 itself runs on CPU processes over gloo, and so does accelerate's FSDP2 code
    (prepare, get_state_dict, save_state, load_state) once its state says FSDP: set here,
    after the Accelerator is made, with the plugin that the launcher's FSDP_* variables
    (configs/accelerate/fsdp.yaml) describe."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import stabledrl.train as train_mod
    from stabledrl.cli import main

    class CpuFsdpAccelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # AcceleratorState copies PartialState's type when it is made again: set both
            PartialState().distributed_type = self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = FullyShardedDataParallelPlugin()
            if self.state.mixed_precision != "no":  # as AcceleratorState does for an FSDP launch (state.py)
                self.state.fsdp_plugin.set_mixed_precision(self.state.mixed_precision)

    if os.environ.get("STABLEDRL_TEST_FSDP") == "1":
        accelerate.Accelerator = CpuFsdpAccelerator  # run_train imports it when it runs
    if os.environ.get("STABLEDRL_TEST_REPORT"):
        _report_run(train_mod, os.environ["STABLEDRL_TEST_REPORT"])
    if os.environ.get("STABLEDRL_TEST_LEAN"):
        _report_lean(os.environ["STABLEDRL_TEST_LEAN"])
    if os.environ.get("STABLEDRL_TEST_STOP_AFTER_SAVE") == "1":
        real = train_mod.save_checkpoint

        def save_then_stop(*args, **kwargs):
            real(*args, **kwargs)
            raise _StopAfterSave

        train_mod.save_checkpoint = save_then_stop
    if os.environ.get("STABLEDRL_TEST_KILL"):
        _kill_at(*os.environ["STABLEDRL_TEST_KILL"].split(":"))
    return main()


def _kill_at(stage: str, rank: str, nth: str) -> None:
    """Process `rank` dies (os._exit, as if killed: no cleanup, no exception) the `nth` time it
    reaches `stage` of a save (`stabledrl.checkpoint._stage`)."""
    import stabledrl.checkpoint as checkpoint

    reached = []

    def stage_or_die(name: str) -> None:
        if name == stage and os.environ["RANK"] == rank:
            reached.append(name)
            if len(reached) == int(nth):
                os._exit(9)

    checkpoint._stage = stage_or_die


def _report_lean(path: str) -> None:
    """The main process writes to `path`, for each `generate`, [LoRA layers given the short forward
    (`stabledrl.models.lora.lean_adapters`), the calls that took it]."""
    from contextlib import contextmanager

    import torch.distributed as dist

    import stabledrl.sampling as sampling
    from stabledrl.models.lora import _LeanForward

    real, seen = sampling.lean_adapters, []

    @contextmanager
    def recorded(model):
        with real(model) as layers:
            yield layers
            forwards = [f for f in (vars(m).get("forward") for m in model.modules()) if isinstance(f, _LeanForward)]
            seen.append([layers, sum(f.calls for f in forwards)])
            if dist.get_rank() == 0:
                Path(path).write_text(json.dumps(seen))

    sampling.lean_adapters = recorded


def _report_run(train_mod, path: str) -> None:
    """`train` writes to `path` (main process) how its model was prepared: the FSDP units, whether
    its blocks recompute in the backward, and the dtypes its blocks' linear layers computed in."""
    from torch.distributed.fsdp import FSDPModule

    real = train_mod.set_up

    def set_up(*args, **kwargs):
        run = real(*args, **kwargs)
        model = run.policy.model
        inner = getattr(model, "module", model)  # DDP's wrapper holds it; FSDP2 wraps in place
        info = {"wrapped": sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)),
                "checkpointing": inner.gradient_checkpointing, "linear_dtypes": []}
        write = lambda: run.main and Path(path).write_text(json.dumps(info))  # noqa: E731

        def seen(module, args, output):
            if str(output.dtype) not in info["linear_dtypes"]:
                info["linear_dtypes"].append(str(output.dtype))
                write()

        for block in inner.blocks:
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_hook(seen)
        write()
        return run

    train_mod.set_up = set_up


if __name__ == "__main__":
    sys.exit(_cpu_fsdp_main())


def test_the_train_verb_ends_the_process_group_and_leaves_at_once(monkeypatch, tmp_path):
    # Left to the interpreter's exit, gloo's threads can abort a finished run (SIGABRT,
    # "terminate called without an active exception": 1 of 12 two-process launches here, and
    # under FSDP once in CI even with the group ended): the verb ends the group, then exits
    # without the interpreter's teardown.
    import torch.distributed as dist

    import stabledrl.cli as cli
    import stabledrl.train as train_mod

    ended, left = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: not ended)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: ended.append(group))
    monkeypatch.setattr(cli, "_leave", left.append)
    evaluation = {"accuracy": 0.5, "mean_reward": 0.5}
    monkeypatch.setattr(train_mod, "run_train", lambda cfg, resume: {
        "eval_initial": evaluation, "eval_final": evaluation, "skipped_steps": 0, "zero_variance_groups": 0})
    (tmp_path / "empty.yaml").write_text("{}\n")
    assert cli.main(["train", "--config", str(tmp_path / "empty.yaml"), "--set", f"output_dir={tmp_path}"]) == 0
    assert ended == [None] and left == [0]
    # one process, no group: nothing to end, the ordinary exit
    assert cli.main(["train", "--config", str(tmp_path / "empty.yaml"), "--set", f"output_dir={tmp_path}"]) == 0
    assert ended == [None] and left == [0]
