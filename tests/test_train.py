import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

import stabledrl.instruments as instruments
import stabledrl.train as train_mod
import stabledrl.training_run as training_run
from stabledrl.config import ConfigError, load_config
from stabledrl.objectives import OBJECTIVES, ScoredBatch, objective_for
from stabledrl.scoring import split_rounds
from stabledrl.seeds import step_seed
from stabledrl.tasks import get_task
from stabledrl.train import TrainConfig, run_train
from tests.conftest import make_tiny_policy, metric_rows


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _cfg(init_model, out, **kw):
    # Sudoku: a random model's rewards are fractions, so groups almost never tie.
    base = {"model": str(init_model), "output_dir": str(out), "task": {"name": "sudoku"}, "steps": 4,
            "prompts_per_step": 2, "group_size": 4, "mu": 2, "lr": 1e-3, "eval_n": 4, "save_every": 2,
            "estimator": {"method": "mc", "num_samples": 2}}
    base.update(kw)
    return load_config(TrainConfig, base)


def _changed_weights_and_step_rows(init_model, run_dir) -> list[dict]:
    """Assert the run's final weights differ from the initial ones; its metric rows with a loss."""
    before = load_file(init_model / "model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


class _Killed(Exception):
    """The process dies here."""


def _capturing_set_up(monkeypatch, runs: list, then=lambda run: None) -> None:
    """`train` keeps the runs it sets up in `runs` (and calls `then` on each before its first step)."""
    real = train_mod.set_up

    def set_up(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        then(runs[-1])
        return runs[-1]

    monkeypatch.setattr(train_mod, "set_up", set_up)


def _saves_then_dies_at(monkeypatch, step: int, saved: list) -> None:
    """The checkpoint of `step` is written, then the process dies; `saved` lists the steps saved."""
    real = train_mod.save_checkpoint

    def save(run_dir, done, *args, **kwargs):
        saved.append(done)
        out = real(run_dir, done, *args, **kwargs)
        if done == step:
            raise _Killed
        return out

    monkeypatch.setattr(train_mod, "save_checkpoint", save)


def _losses(path):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["ratio_max"]) for r in rows if "loss" in r]


@pytest.mark.parametrize("objective, estimator", [
    ({"name": "stabledrl"}, {"method": "mc", "num_samples": 2}),
    ({"name": "stabledrl", "separate_weight_masks": True, "clip": "two_sided"}, {"method": "sdmc", "num_samples": 1}),
    ({"name": "grpo", "ratio_level": "token", "beta": 0.04}, {"method": "mean_field", "num_samples": 1}),
    ({"name": "grpo", "ratio_level": "sequence_normalized"}, {"method": "sdmc", "num_samples": 1}),
    ({"name": "wd1", "psi": 2.0}, {"method": "mc", "num_samples": 2}),
    ({"name": "grpo", "ratio_level": "token", "advantage_scale": "leave_one_out"}, {"method": "coupled"}),
    ({"name": "spg"}, {"method": "block_random", "num_samples": 2, "options": {"block_length": 8}}),
    ({"name": "stabledrl", "likelihood": "spg"},
     {"method": "block_random", "num_samples": 2, "options": {"block_length": 8, "p_prompt": 0.15}}),
])
def test_a_short_run_changes_parameters_and_logs_every_diagnostic(init_model, tmp_path, objective, estimator):
    # keep: a step whose groups all tie still logs its loss row
    # 4 prompts: a random model's completions often end at EOS or PAD before Sudoku's 16 digits
    # (reward 0), and a step needs one group whose rewards differ for a nonzero gradient
    cfg = _cfg(init_model, tmp_path / "run", steps=2, objective=objective, estimator=estimator, masks="independent",
               zero_variance_groups="keep", update_norm=True, drift_kl=True, prompts_per_step=4)
    summary = run_train(cfg, progress=False)
    step_rows = _changed_weights_and_step_rows(init_model, tmp_path / "run")
    assert len(step_rows) == 2
    for row in step_rows:  # every diagnostic is logged, with a value that means what it says
        keys = ("reward_mean", "reward_std", "ratio_mean", "ratio_std", "ratio_max", "clip_fraction",
                "bypass_fraction", "grad_norm", "update_norm", "drift_kl", "completion_length", "entropy")
        assert all(isinstance(row[k], float) and math.isfinite(row[k]) for k in keys), row
        assert 0 <= row["reward_mean"] <= 1 and row["reward_std"] >= 0
        assert 0 < row["ratio_mean"] <= row["ratio_max"] and row["ratio_std"] >= 0
        assert 0 <= row["clip_fraction"] <= 1 and 0 <= row["bypass_fraction"] <= 1
        assert row["grad_norm"] > 0 and row["update_norm"] > 0 and row["entropy"] > 0
        assert 1 <= row["completion_length"] <= get_task("sudoku").completion_length
    if objective["name"] == "stabledrl":
        assert 1 <= step_rows[0]["ess"] <= 4
    if objective["name"] == "spg":
        assert all(math.isfinite(row["eubo_gap"]) for row in step_rows)
    assert "eval_initial" in summary and "eval_final" in summary
    assert (tmp_path / "run" / "tensorboard").is_dir()


@pytest.mark.parametrize("lora", [None, {"r": 4}])
def test_resume_continues_exactly(init_model, tmp_path, lora, monkeypatch):
    full = _cfg(init_model, tmp_path / "full", lora=lora)
    run_train(full, progress=False)

    crash = _cfg(init_model, tmp_path / "crash", lora=lora)
    saved = []
    with monkeypatch.context() as m:
        _saves_then_dies_at(m, 2, saved)
        with pytest.raises(_Killed):  # stopped right after the step-2 checkpoint
            run_train(crash, progress=False)
    assert saved == [2]  # none at step 1
    run_train(crash, resume=True, progress=False)
    assert _losses(tmp_path / "crash" / "metrics.jsonl") == _losses(tmp_path / "full" / "metrics.jsonl")
    weights = "adapter_model.safetensors" if lora else "model.safetensors"  # LoRA runs save the adapters
    a = load_file(tmp_path / "full" / "final" / weights)
    b = load_file(tmp_path / "crash" / "final" / weights)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:Detected call of")  # no optimizer step ran: intended
@pytest.mark.parametrize("rounds", [1, 2])
def test_a_non_finite_loss_is_skipped_and_never_reaches_the_weights(init_model, tmp_path, monkeypatch, rounds):
    # with 2 accumulation rounds the second round's loss is the bad one: the first round's
    # gradient, already in .grad, is dropped with it
    real, calls = OBJECTIVES["stabledrl"], []

    def poisoned(cfg, batch):
        out = real(cfg, batch)
        calls.append(batch.advantages.size(0))
        if len(calls) % rounds == 0:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setitem(OBJECTIVES, "stabledrl", poisoned)
    summary = run_train(_cfg(init_model, tmp_path / "nan", steps=2, accumulation_rounds=rounds), progress=False)
    assert calls == [8 // rounds] * 4 * rounds  # 2 steps x mu 2 x the rounds, each of 8 / rounds rows
    assert summary["skipped_steps"] == 4  # 2 steps x mu 2
    before = load_file(init_model / "model.safetensors")
    after = load_file(tmp_path / "nan" / "final" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("objective, estimator", [
    ({"name": "stabledrl"}, {"method": "mc", "num_samples": 3}),
    ({"name": "grpo", "ratio_level": "token", "beta": 0.04}, {"method": "mean_field", "num_samples": 1}),
])
def test_a_view_budget_gives_the_same_update_with_bounded_memory(init_model, tmp_path, objective, estimator):
    # Two-pass update (no-grad ℓ, ∂loss/∂ℓ, backward 2 views at a time) vs one graph: the
    # same gradient at each of the μ = 2 optimizer steps.
    runs = [_optimizer_gradients(_cfg(init_model, tmp_path / name, steps=1, optimizer="sgd", lr=1e-2,
                                      objective=objective, estimator={**estimator, "max_views_per_forward": budget}))
            for name, budget in (("whole", None), ("budget", 2))]
    _assert_same_gradients(*runs, steps=2)
    flat = [[v for row in _losses(tmp_path / n / "metrics.jsonl") for v in row] for n in ("whole", "budget")]
    assert flat[0] == pytest.approx(flat[1], rel=1e-4, abs=1e-6)  # a loss can be ~1e-5: the abs part


def _optimizer_gradients(cfg: TrainConfig) -> list[torch.Tensor]:
    """Train `cfg`; the gradient each optimizer step was handed, (P,) float64 over all parameters.
    Compared under plain SGD at a small lr, so that later gradients are taken at weights equal up
    to rounding. Not AdamW's weights: its g/√v turns a rounding difference of ~1e-7 in a near-zero
    gradient into one of ~lr (2.9e-5 on another CPU)."""
    grads: list[torch.Tensor] = []

    def record(opt, args, kwargs):
        grads.append(torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if p.grad is None
                                else p.grad.detach().double().flatten()
                                for group in opt.param_groups for p in group["params"]]))

    hook = register_optimizer_step_pre_hook(record)
    try:
        run_train(cfg, progress=False)
    finally:
        hook.remove()
    return grads


def _assert_same_gradients(a: list[torch.Tensor], b: list[torch.Tensor], *, steps: int) -> None:
    assert len(a) == len(b) == steps
    for x, y in zip(a, b):
        assert x.norm() > 0  # the update is not empty
        # float32 rounding: relative 3e-7 measured; a real difference would be O(1)
        assert (x - y).norm() <= 1e-4 * x.norm()


@pytest.mark.parametrize("objective, estimator, extra", [
    # StableDRL on SPG's sandwich: weights self-normalised within each group, the EUBO; a mean over groups
    ({"name": "stabledrl", "likelihood": "spg"}, {"method": "mc", "num_samples": 2}, {}),
    # d1's loss: a mean over every scored token of the batch, plus a k3 KL to the reference
    ({"name": "grpo", "ratio_level": "token", "token_aggregation": "batch_token_mean", "beta": 0.04},
     {"method": "mean_field", "num_samples": 1}, {}),
    ({"name": "spg"}, {"method": "mc", "num_samples": 2}, {}),
    # rounds of one group each, fresh masks every inner iteration, the backward 3 views at a time
    ({"name": "stabledrl"}, {"method": "mc", "num_samples": 2, "max_views_per_forward": 3},
     {"masks": "independent", "accumulation_rounds": 4}),
])
def test_accumulation_rounds_give_the_one_round_update(init_model, tmp_path, objective, estimator, extra,
                                                       monkeypatch):
    # 4 prompts of G = 4, mu = 2: each optimizer step's gradient accumulated over R rounds of whole
    # groups, against the same step in one round (same rollouts, same masks)
    rows = []  # the rows each objective call saw
    real = train_mod.objective_for
    monkeypatch.setattr(train_mod, "objective_for", lambda c: (lambda f: lambda b: (
        rows.append(b.advantages.size(0)), f(b))[1])(real(c)))
    R = extra.get("accumulation_rounds", 2)
    runs = []
    for name, rounds in (("one", 1), ("rounds", R)):
        cfg = _cfg(init_model, tmp_path / name, steps=1, prompts_per_step=4, optimizer="sgd", lr=1e-2,
                   objective=objective, estimator=estimator, **{**extra, "accumulation_rounds": rounds})
        runs.append(_optimizer_gradients(cfg))
    assert rows == [16] * 2 + [16 // R] * (2 * R)  # not vacuous: the second run scored R rounds an iteration
    _assert_same_gradients(*runs, steps=2)
    # the logged loss is the step's (the rounds' losses weighted by their share)
    flat = [[r[1] for r in _losses(tmp_path / n / "metrics.jsonl")] for n in ("one", "rounds")]
    assert flat[0] == pytest.approx(flat[1], rel=1e-4, abs=1e-6)


def test_a_loss_over_a_constant_gets_the_one_round_gradient_in_4_rounds(init_model, tmp_path, objective_registry):
    # −Σ_b A_b ℓ_b / 10, a sum over the rows divided by a constant: each round's loss counts whole
    # (weighting it by its groups, as a mean over groups is, would give a quarter of the gradient)
    from dataclasses import dataclass
    from typing import ClassVar, Literal

    from stabledrl.objectives import LossOutput, objective
    from stabledrl.settings import ObjectiveSection

    @dataclass
    class SumOverConstant(ObjectiveSection):
        name: Literal["sum_over_constant"] = "sum_over_constant"
        declared: str = "constant"
        """The normaliser it declares (sequences: the wrong one, to show that the declaration decides)."""

        @property
        def normaliser(self):
            return self.declared

    rows = []  # the rows of each call

    @objective("sum_over_constant")
    def sum_over_constant(opts: SumOverConstant, batch) -> LossOutput:
        rows.append(batch.advantages.size(0))
        return LossOutput(-(batch.advantages.detach() * batch.logp).sum() / 10.0)

    grads, losses = {}, {}
    for R, declared in ((1, "constant"), (4, "constant"), (4, "sequences")):
        out = tmp_path / f"{R}-{declared}"
        cfg = _cfg(init_model, out, steps=1, prompts_per_step=4, mu=1, optimizer="sgd", lr=1e-2, grad_clip=1e9,
                   zero_variance_groups="keep", accumulation_rounds=R,  # no clip: the gradients as computed
                   objective={"name": "sum_over_constant", "declared": declared})
        (grads[R, declared],) = _optimizer_gradients(cfg)
        (losses[R, declared],) = [r["loss"] for r in metric_rows(out) if "loss" in r]
    assert rows == [16] + [4] * 8  # one round of 4 groups, then 4 rounds of 1, twice
    one = grads[1, "constant"]
    assert one.norm() > 0
    assert (grads[4, "constant"] - one).norm() <= 1e-5 * one.norm()  # float32 rounding: ~1e-7 measured
    assert losses[4, "constant"] == pytest.approx(losses[1, "constant"], rel=1e-5)
    assert (grads[4, "sequences"] - one / 4).norm() <= 1e-5 * one.norm()  # declared wrong: a quarter


def test_accumulation_rounds_cut_the_kept_groups_and_weigh_each_by_its_share():
    # 3 kept groups of G = 2 in R = 2 rounds: groups [0] and [1, 2]; completion lengths 1, 1 | 2, 2 | 3, 0
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from stabledrl.rollouts import RolloutBatch
    from stabledrl.shards import Shards

    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])  # (6, 3)
    ids = torch.zeros(6, 3, dtype=torch.long)
    groups = RolloutBatch(ids, torch.ones(6, 3), ids, mask, ids, problems=[0, 1, 2], rewards=torch.zeros(3, 2))
    shards = Shards(SimpleNamespace(process_index=0, num_processes=1, distributed_type=DistributedType.NO))

    def rounds(normaliser: str, R: int = 2):
        cfg = SimpleNamespace(group_size=2, accumulation_rounds=R, objective=SimpleNamespace(normaliser=normaliser))
        return split_rounds(SimpleNamespace(cfg=cfg, shards=shards, device="cpu"), groups)

    assert [(s.lo, s.hi, s.start, s.end, s.rows.completion_mask.size(0)) for s in rounds("sequences")] == [
        (0, 2, 0, 2, 2), (2, 6, 2, 6, 4)]
    # a mean over groups: 1 of 3, 2 of 3 (the loss and the metrics alike)
    assert [(s.weight, s.part) for s in rounds("sequences")] == [(1 / 3, 1 / 3), (2 / 3, 2 / 3)]
    # a mean over the 9 scored tokens: 2 of them, 7 of them
    assert [x for s in rounds("tokens") for x in (s.weight, s.part)] == pytest.approx([2 / 9, 2 / 9, 7 / 9, 7 / 9])
    # a sum over a constant: each round's loss counts whole, its metrics by its groups
    assert [(s.weight, s.part) for s in rounds("constant")] == [(1.0, 1 / 3), (1.0, 2 / 3)]
    # more rounds than kept groups: one group a round; one round: the whole batch, weight exactly 1
    assert [(s.lo, s.hi) for s in rounds("sequences", R=5)] == [(0, 2), (2, 4), (4, 6)]
    assert [(s.lo, s.hi, s.weight) for s in rounds("tokens", R=1)] == [(0, 6, 1.0)]


def test_config_cross_checks():
    with pytest.raises(ConfigError, match="beta"):
        load_config(TrainConfig, {"objective": {"name": "stabledrl", "beta": 0.1}})
    with pytest.raises(ConfigError, match="temperature"):
        load_config(TrainConfig, {"rollout": {"temperature": 0.0}})
    with pytest.raises(ConfigError, match="group_size"):
        load_config(TrainConfig, {"group_size": 1})
    with pytest.raises(ConfigError, match="ratio_level"):
        load_config(TrainConfig, {"objective": {"name": "stabledrl", "ratio_level": "token"}})
    with pytest.raises(ConfigError, match="token_aggregation batch_token_mean needs per-token terms"):
        load_config(TrainConfig, {"objective": {"name": "grpo", "token_aggregation": "batch_token_mean"}})
    with pytest.raises(ConfigError, match="estimator.options.weight must be count or time"):
        load_config(TrainConfig, {"estimator": {"method": "sdmc", "options": {"weight": "inverse_t"}}})
    # another objective's option is not a key of this objective's section
    for name, key, value in [("stabledrl", "psi", 2.0), ("wd1", "clip_max", 3.0), ("wd1", "beta", 0.1),
                             ("grpo", "likelihood", "spg"), ("grpo", "spg_omega", 0.3),
                             ("spg", "ratio_level", "sequence_normalized")]:
        with pytest.raises(ConfigError, match=f"unknown config key objective.{key}; section 'objective' accepts"):
            load_config(TrainConfig, {"objective": {"name": name, key: value}})
    with pytest.raises(ConfigError, match="name: 'ppo' is none of stabledrl, grpo, wd1, spg"):
        load_config(TrainConfig, {"objective": {"name": "ppo"}})
    with pytest.raises(ConfigError, match="spg_omega must be in"):
        load_config(TrainConfig, {"objective": {"name": "spg", "spg_omega": 1.5}})
    with pytest.raises(ConfigError, match="EUBO is not linear"):
        load_config(TrainConfig, {"objective": {"name": "spg"}, "estimator": {"max_views_per_forward": 4}})
    with pytest.raises(ConfigError, match="per-sequence likelihood"):
        load_config(TrainConfig, {"objective": {"name": "stabledrl", "likelihood": "spg",
                                                "ratio_level": "sequence_normalized"}})
    with pytest.raises(ConfigError, match=r"prompts_per_step \(6\) must be a multiple of accumulation_rounds \(4\)"):
        load_config(TrainConfig, {"prompts_per_step": 6, "accumulation_rounds": 4})
    with pytest.raises(ConfigError, match="grad_agreement needs the one-round update"):
        load_config(TrainConfig, {"prompts_per_step": 4, "accumulation_rounds": 2, "grad_agreement": True})
    with pytest.raises(ConfigError, match="accumulation_rounds must be >= 1"):
        load_config(TrainConfig, {"accumulation_rounds": 0})
    with pytest.raises(ConfigError, match="not SPG's sandwich"):
        load_config(TrainConfig, {"objective": {"name": "stabledrl", "likelihood": "spg",
                                                "separate_weight_masks": True}})


def test_batch_token_mean_reaches_the_objective_and_splits_by_tokens_for_grad_agreement():
    # 2 groups of G = 2; ρ = 1 everywhere, so each scored token's term is A_b; lengths 3, 1 | 1, 1 (N = 6)
    cfg = load_config(TrainConfig, {"group_size": 2, "objective": {"name": "grpo", "ratio_level": "token",
                                                                   "token_aggregation": "batch_token_mean"}})
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, -1.5])
    logp = torch.zeros(4, 3)
    batch = ScoredBatch(logp, logp, adv, 2, mask)
    res = objective_for(cfg.objective)(batch)
    # −(3·1 − 1 + 0.5 − 1.5)/6 = −1/6 (sequence_mean would give −(1 − 1 + 0.5 − 1.5)/4 = 0.25)
    assert res.loss.item() == pytest.approx(-1 / 6, abs=1e-6)
    # the first group's share: its tokens over all the batch's, −(3 − 1)/6 = −1/3
    # (a mean over groups would give −(2/4)·(1/2) = −0.25)
    part = instruments.first_half_loss(objective_for(cfg.objective), batch, normaliser=cfg.objective.normaliser)
    assert part.item() == pytest.approx(-1 / 3, abs=1e-6)


@pytest.fixture(scope="module")
def block_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("init-block") / "model"
    make_tiny_policy(seed=42, attention_kind="block", block_size=4).save(path)
    return path


@pytest.mark.parametrize("objective, options", [
    ({"name": "stabledrl"}, {"inner": "mc", "stratified": True}),
    ({"name": "grpo", "ratio_level": "sequence_normalized"}, {"inner": "sdmc", "num_nodes": 2}),
])
def test_a_block_model_trains_with_the_blockwise_estimator(block_model, tmp_path, objective, options):
    cfg = _cfg(block_model, tmp_path / "run", steps=2, objective=objective,
               estimator={"method": "blockwise", "num_samples": 2, "options": options})
    summary = run_train(cfg, progress=False)
    before = load_file(block_model / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert summary["skipped_steps"] == 0


@pytest.mark.parametrize("model", ["init_model", "block_model"])
def test_the_path_estimator_trains_either_kind_and_its_first_ratio_is_exactly_one(request, tmp_path, model):
    # The path plan is a function of the rollouts: with "independent" masks and mu = 1 the
    # only inner iteration scores theta_old's own views again, so every ratio is 1.
    init = request.getfixturevalue(model)
    cfg = _cfg(init, tmp_path / "run", steps=2, mu=1, masks="independent", zero_variance_groups="keep",
               estimator={"method": "path", "num_samples": 1})
    run_train(cfg, progress=False)
    step_rows = _changed_weights_and_step_rows(init, tmp_path / "run")
    assert len(step_rows) == 2
    for r in step_rows:
        assert r["ratio_max"] == pytest.approx(1.0, abs=1e-5) and r["log_ratio_std"] == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ConfigError, match="num_samples: 1"):
        _cfg(init, tmp_path / "bad", estimator={"method": "path", "num_samples": 2})


def test_estimator_and_model_kind_must_match_at_start_up(init_model, block_model, tmp_path):
    with pytest.raises(ConfigError, match="blockwise"):
        run_train(_cfg(block_model, tmp_path / "a"), progress=False)
    with pytest.raises(ConfigError, match="blockwise"):
        run_train(_cfg(init_model, tmp_path / "b", estimator={"method": "blockwise"}), progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any run directory


class _RuledTask:
    """Countdown whose reward is decided by the prompt: an 'informative' problem's group
    gets rewards 0, 1, 0, 1, ... (by row), any other group all zeros (zero variance)."""

    def __init__(self):
        from stabledrl.tasks import get_task

        self.inner = get_task("countdown")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @staticmethod
    def informative(problem) -> bool:
        import hashlib

        return int(hashlib.sha256(problem.prompt.encode()).hexdigest(), 16) % 3 == 0

    def reward(self, texts, problems):
        return [float(k % 2) if self.informative(p) else 0.0 for k, p in enumerate(problems)]


@pytest.mark.parametrize("mode, rounds", [("keep", 0), ("skip", 0), ("resample", 3)])
@pytest.mark.filterwarnings("ignore:Detected call of")  # a step with no group left runs no optimizer step
def test_zero_variance_groups_are_kept_skipped_or_resampled(init_model, tmp_path, mode, rounds, monkeypatch):
    task = _RuledTask()
    P = 6
    cfg = _cfg(init_model, tmp_path / mode, steps=2, prompts_per_step=P, group_size=2, mu=1, save_every=5,
               task={"name": "countdown"}, zero_variance_groups=mode, max_resample_rounds=rounds)
    seen = []  # the advantages of the groups that reach the objective, step by step (mu = 1: one call a step)
    real = OBJECTIVES["stabledrl"]

    def recording(obj_cfg, batch):  # what reached the objective: each used group's advantages
        seen.append(batch.advantages.view(-1, cfg.group_size))
        return real(obj_cfg, batch)

    monkeypatch.setitem(OBJECTIVES, "stabledrl", recording)
    summary = run_train(cfg, task=task, progress=False)
    rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
            or '"groups_used"' in x]
    assert len(rows) == 2
    # The bookkeeping again, by hand: the same problems as the trainer draws.
    zero, resampled = 0, 0
    for step, row in enumerate(rows):
        first = task.generate(P, split="train", seed=step)
        good = sum(map(task.informative, first))
        zero += P - good
        used = P if mode == "keep" else good
        for r in range(rounds):
            missing = P - used
            if missing <= 0:
                break
            extra = task.generate(missing, split="train", seed=step_seed(0, step, "resample", r))
            e_good = sum(map(task.informative, extra))
            zero += missing - e_good
            resampled += missing
            used += e_good
        assert row["groups_used"] == used
    used_groups = torch.cat(seen)  # (groups, G) every group used, in every step; equal rewards, equal advantages
    assert len(used_groups) == sum(r["groups_used"] for r in rows)
    constant = (used_groups == used_groups[:, :1]).all(1)
    assert constant.any() if mode == "keep" else not constant.any()  # rows stayed aligned with their groups
    assert summary["zero_variance_groups"] == zero and summary["resampled_groups"] == resampled
    if mode == "resample":
        assert resampled > 0 and rows[0]["groups_used"] > sum(map(task.informative, task.generate(P, seed=0)))


def test_by_default_no_reference_copy_is_loaded(init_model, tmp_path, monkeypatch):
    # The default config (drift_kl off, beta 0) loads the model once: the policy only.
    loads = []
    real = training_run.load_policy
    monkeypatch.setattr(training_run, "load_policy", lambda *a, **k: loads.append(a) or real(*a, **k))
    runs = []
    _capturing_set_up(monkeypatch, runs)
    assert not TrainConfig().drift_kl and not TrainConfig().objective.needs_reference
    run_train(_cfg(init_model, tmp_path / "a", steps=1, zero_variance_groups="keep"), progress=False)
    assert runs[-1].reference is None and len(loads) == 1
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert "loss" in rows[1] and "drift_kl" not in rows[1]
    # A KL term needs the reference whatever the diagnostic says: a second copy, frozen.
    run_train(_cfg(init_model, tmp_path / "b", steps=1, drift_kl=False, objective={"name": "grpo", "beta": 0.1},
                   zero_variance_groups="keep"), progress=False)
    run = runs[-1]
    assert run.reference is not None and run.reference.model is not run.policy.model
    assert not any(p.requires_grad for p in run.reference.model.parameters())
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert "kl_ref" in rows[1]
    # With LoRA the reference is the base model (adapters off): no copy, and not scored unless read.
    run_train(_cfg(init_model, tmp_path / "c", steps=1, drift_kl=False, lora={"r": 4}), progress=False)
    assert runs[-1].reference is None
    run_train(_cfg(init_model, tmp_path / "d", steps=1, drift_kl=True, lora={"r": 4}), progress=False)
    assert runs[-1].reference is not None and runs[-1].reference.model is runs[-1].policy.model


def test_a_run_on_the_code_task_carries_on_through_sandboxed_failures(init_model, tmp_path):
    # The tiny model writes digits and operators, never a valid function body: every program
    # fails in the sandbox (a syntax error or a failed assert), scores 0 with a reason, and
    # the run still completes its steps and saves its model.
    from tests.tasks.test_code import HUMANEVAL, write_jsonl

    write_jsonl(tmp_path / "he-test.jsonl", HUMANEVAL)
    write_jsonl(tmp_path / "he-train.jsonl", HUMANEVAL[:2])
    task = {"name": "code", "options": {"path": str(tmp_path / "he-{split}.jsonl"), "cache_dir": str(tmp_path / "hf"),
                                        "timeout_s": 2.0, "workers": 2}}
    cfg = _cfg(init_model, tmp_path / "run", steps=2, task=task, prompts_per_step=2, group_size=2, eval_n=2,
               rollout={"temperature": 1.0, "gen_length": 8}, eval_sampling={"gen_length": 8})
    summary = run_train(cfg, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    assert all(r["reward_mean"] == 0.0 for r in rows if "reward_mean" in r)
    assert summary["zero_variance_groups"] == 4 and summary["eval_final"]["accuracy"] == 0.0
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_a_run_killed_before_its_first_checkpoint_or_in_its_final_save_reruns_cleanly(init_model, tmp_path,
                                                                                       monkeypatch):
    run = tmp_path / "run"
    cfg = _cfg(init_model, run, steps=2, mu=1)

    def dies(*args, **kwargs):
        raise _Killed

    with monkeypatch.context() as m:
        m.setattr(train_mod, "save_checkpoint", dies)
        with pytest.raises(_Killed):  # killed before the first checkpoint (step 2) is written
            run_train(cfg, progress=False)

    def dies_in_the_final_save(run_dir, policy):  # the final row is logged, then the save begins ...
        (run / ".tmp-final-x1").mkdir()  # ... and dies, leaving its temporary folder
        raise _Killed

    with monkeypatch.context() as m:  # the same command again, killed at the end: in the final save
        m.setattr(training_run, "save_final", dies_in_the_final_save)
        with pytest.raises(_Killed):
            run_train(cfg, progress=False)
    run_train(cfg, resume=True, progress=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # step 0 (initial evaluation), steps 1 and 2, the final evaluation: each once
    assert [(r["step"], "loss" in r, "eval_accuracy" in r) for r in rows] == [
        (0, False, True), (1, True, False), (2, True, False), (2, False, True)]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_micro_batched_rollouts_and_evaluation_and_a_chunked_optimizer_step_change_nothing(init_model, tmp_path,
                                                                                            monkeypatch):
    # Run A samples a step's 8 rollouts and the 5 held-out problems in one call each and
    # steps all parameters at once; run B samples 3 rows at a time, evaluates 2 at a time and
    # steps the parameters in chunks of at most 3,000 elements. The tokens are the same (each
    # row draws from its own generator), so the updates agree up to the rounding of logits
    # computed in batches of other sizes (about 1e-7 on some CPUs): SGD, whose step is
    # linear in the gradient, keeps that difference at rounding size (AdamW's g/sqrt(v)
    # would not); the chunked AdamW step itself is checked bit for bit below.
    kw = dict(steps=2, mu=1, eval_n=5, eval_every=1, drift_kl=False, zero_variance_groups="keep",
              optimizer="sgd", lr=0.1, update_norm=True)
    run_train(_cfg(init_model, tmp_path / "a", **kw), progress=False)
    with monkeypatch.context() as m:
        m.setattr(instruments, "UPDATE_CHUNK", 3000)
        run_train(_cfg(init_model, tmp_path / "b", rollout={"temperature": 1.0, "micro_batch": 3},
                       eval_sampling={"micro_batch": 2}, **kw), progress=False)
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    init = load_file(init_model / "model.safetensors")
    assert any(not torch.equal(a[k], init[k]) for k in a)  # the runs did update the weights
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)
    rows_a, rows_b = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [sorted(r) for r in rows_a] == [sorted(r) for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for k, v in ra.items():  # counts and accuracies exactly, float diagnostics to rounding
            assert rb[k] == (v if not isinstance(v, float) else pytest.approx(v, rel=1e-4, abs=1e-5)), k


def test_the_optimizer_steps_in_chunks_and_reports_the_norm_of_the_change():
    # The update is measured without a copy of all parameters: AdamW steps chunks of at
    # most chunk_size elements (a larger parameter alone), and the weights and states
    # are those of one ordinary step, bit for bit.
    import copy

    policy = make_tiny_policy(seed=3)
    model = policy.model
    twin = copy.deepcopy(model)
    x = torch.randint(5, 20, (4, 12))
    for m in (model, twin):
        m.logits_sum = m(input_ids=x).logits.square().mean()
        m.logits_sum.backward()
    params, twin_params = list(model.parameters()), list(twin.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    twin_opt = torch.optim.AdamW(twin_params, lr=1e-3, weight_decay=0.1)
    before = [p.detach().clone().double() for p in params]
    twin_opt.step()

    stepped = []  # elements handed a gradient at each optimizer step
    hook = register_optimizer_step_pre_hook(
        lambda o, a, k: stepped.append(sum(p.numel() for g in o.param_groups for p in g["params"]
                                           if p.grad is not None)) if o is opt else None)
    try:
        norm = instruments.step_measuring_update(opt, params, chunk_size=5000)
    finally:
        hook.remove()
    largest = max(p.numel() for p in params)  # 8,192 (gate_up): a chunk of its own
    assert len(stepped) > 3 and max(stepped) <= max(5000, largest) and sum(stepped) == sum(p.numel() for p in params)
    assert all(p.grad is not None for p in params)  # the gradients are given back
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], twin_opt.state[q]["exp_avg_sq"])
    # the norm of the change, computed independently in float64
    expected = sum(float((p.detach().double() - b).square().sum()) for p, b in zip(params, before)) ** 0.5
    assert expected > 0
    assert norm == pytest.approx(expected, rel=1e-5)


def test_the_logged_update_norm_is_the_norm_of_the_change_of_the_weights(init_model, tmp_path, monkeypatch):
    # One step, μ = 1: the logged update_norm is ‖θ_final − θ_init‖, here with the step in chunks.
    monkeypatch.setattr(instruments, "UPDATE_CHUNK", 4000)
    run_train(_cfg(init_model, tmp_path / "r", steps=1, mu=1, drift_kl=False, zero_variance_groups="keep",
                   update_norm=True), progress=False)
    row = next(r for r in metric_rows(tmp_path / "r") if "update_norm" in r)
    before = load_file(init_model / "model.safetensors")
    after = load_file(tmp_path / "r" / "final" / "model.safetensors")
    expected = sum(float((after[k].double() - before[k].double()).square().sum()) for k in before) ** 0.5
    assert expected > 0
    assert row["update_norm"] == pytest.approx(expected, rel=1e-5)


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_a_1e_6_step(init_model, tmp_path, monkeypatch):
    # mixed_precision: bf16 with float32 weights (the recommended precision): the matmuls of
    # the policy and of its reference copy run in bfloat16 (so the drift from the reference
    # is exactly 0 at the first step, as in float32), and one AdamW step at lr 1e-6 (≈ 1e-6
    # on every weight whose gradient is not ~0) changes every element of every matrix.
    dtypes = set()

    def watch(run):
        for model in (run.policy.model, run.reference.model):  # the reference: a second copy
            model.blocks[0].qkv.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))

    _capturing_set_up(monkeypatch, [], then=watch)
    run_train(_cfg(init_model, tmp_path / "r", steps=1, mu=1, lr=1e-6, mixed_precision="bf16",
                   zero_variance_groups="keep", drift_kl=True), progress=False)
    assert dtypes == {torch.bfloat16}
    assert next(r for r in metric_rows(tmp_path / "r") if "drift_kl" in r)["drift_kl"] == 0.0
    before = load_file(init_model / "model.safetensors")
    after = load_file(tmp_path / "r" / "checkpoint-0000001" / "model.safetensors")  # the trained float32 weights
    for k in before:
        if before[k].dim() == 2 and k != "embed.weight":  # embedding rows of unseen tokens get no gradient
            assert after[k].dtype == torch.float32
            assert (after[k] != before[k]).float().mean() == 1.0, k
    # final/ is handed over in the precision the run computed in (final_dtype: auto)
    final = load_file(tmp_path / "r" / "final" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in final.values())


def test_a_1e_6_step_on_bf16_weights_is_mostly_lost_and_that_precision_is_refused(init_model, tmp_path):
    # What the check above guards against: AdamW at lr 1e-6 on bfloat16 weights (size
    # ~0.02, rounding step ~1e-4) leaves most of them as they were.
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_tiny_policy(seed=3).model.parameters()]
    before = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    torch.optim.AdamW(params, lr=1e-6, weight_decay=0).step()
    changed = sum(int((p != b).sum()) for p, b in zip(params, before))
    assert changed < 0.1 * sum(b.numel() for b in before)
    with pytest.raises(ConfigError, match="mixed_precision: bf16"):
        _cfg(init_model, tmp_path / "x", model={"path": str(init_model), "dtype": "bfloat16"})
    # with LoRA only the adapters train (peft keeps them in float32): a bfloat16 base is fine
    _cfg(init_model, tmp_path / "x", model={"path": str(init_model), "dtype": "bfloat16"}, lora={"r": 4})


class _Sleepy(torch.nn.Module):
    """A forward that takes `ms` milliseconds of a fake GPU clock."""

    def __init__(self, clock_ms: list[float], ms: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.clock_ms, self.ms = clock_ms, ms

    def forward(self, x):
        self.clock_ms[0] += self.ms
        return x


def test_the_forward_clock_reads_gpu_time_from_events_with_one_synchronisation():
    # On a GPU a forward returns once its kernels are queued, so host time misses the work:
    # the clock records an event before and after each forward (no synchronisation there)
    # and, when read, synchronises once and sums the events' elapsed times (ms -> s).
    clock_ms, syncs = [0.0], []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = clock_ms[0]

        def synchronize(self):
            syncs.append(self.t)

        def elapsed_time(self, end):
            return end.t - self.t

    model = _Sleepy(clock_ms, 250.0)
    clock = instruments.ForwardClock(model, model, event=FakeEvent)
    assert not clock.cuda  # a CPU model: host time, no events
    clock.cuda = True  # as for a model on a GPU
    for _ in range(3):
        model(torch.zeros(1))
        clock_ms[0] += 1000.0  # host work between forwards is not counted
    assert syncs == []
    assert clock.seconds == pytest.approx(0.75)
    assert len(syncs) == 1
    clock.seconds = 0.0
    model(torch.zeros(1))
    assert clock.seconds == pytest.approx(0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_forward_clock_counts_the_kernels_time():
    import time

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    x = torch.randn(4096, 4096, device="cuda")
    clock = instruments.ForwardClock(model)
    assert clock.cuda
    with torch.no_grad():
        model(x)  # warm-up
        torch.cuda.synchronize()
        clock.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    assert 0.5 * wall <= clock.seconds <= 1.05 * wall  # host gaps between forwards are not counted


def test_every_objective_section_loads_by_name_and_has_a_loss():
    # the registry is the list: each section a config can name has its loss, and no loss lacks options
    # (what each loss computes: tests/test_objectives.py, for every registered objective)
    from stabledrl.settings import OBJECTIVE_SECTIONS

    assert list(OBJECTIVES) == list(OBJECTIVE_SECTIONS) and "stabledrl" in OBJECTIVES
    for name, section in OBJECTIVE_SECTIONS.items():
        assert type(load_config(TrainConfig, {"objective": {"name": name}}).objective) is section


def test_the_progress_bar_shows_only_what_the_step_computed():
    from types import SimpleNamespace

    run = SimpleNamespace(counters={"skipped_steps": 0}, monitor=SimpleNamespace(collapsed=False))
    assert train_mod._progress(run, {"reward_mean": 0.5, "grad_norm": 0.25, "ratio_max": 3.0}) == {
        "reward": "0.500", "gnorm": "0.25", "ratio_max": "3", "skipped": 0}
    # an objective that returns no ratio diagnostics, and a step with no group to train on: no invented 1 or 0
    assert train_mod._progress(run, {"reward_mean": 0.5, "grad_norm": 0.25}) == {
        "reward": "0.500", "gnorm": "0.25", "skipped": 0}
    assert train_mod._progress(run, {"reward_mean": 0.0}) == {"reward": "0.000", "skipped": 0}


def test_a_run_whose_completions_end_at_pad_trains(init_model, tmp_path):
    """PAD is a stop token of every policy: a completion may end at a PAD, which the likelihoods
    score as its last slot (the engine writes "digits, PAD, PAD ..." with no EOS)."""
    engine = {"engine": "tests.test_engines:PadEndedEngine"}
    run_train(_cfg(init_model, tmp_path / "run", steps=2, rollout=engine), progress=False)
    assert len(_changed_weights_and_step_rows(init_model, tmp_path / "run")) == 2


def test_a_run_logs_a_sample_table_at_every_evaluation_and_a_nonnegative_drift(init_model, tmp_path):
    # steps 4, eval_every 2: evaluations at steps 0 (initial), 2 and 4 (final), eval_n 4 problems each
    out = tmp_path / "run"
    run_train(_cfg(init_model, out, eval_every=2, drift_kl=True), progress=False)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4 + [4] * 4
    assert all(set(s) == {"step", "prompt", "completion", "reward", "correct"} for s in samples)
    rows = metric_rows(out)
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    for step in (0, 2, 4):  # the table's verdicts are the logged accuracy's
        assert evals[step] == sum(s["correct"] for s in samples if s["step"] == step) / 4
    k3 = [r["drift_k3"] for r in rows if "drift_k3" in r]
    assert len(k3) == 4 and all(v >= 0 for v in k3)


def test_report_to_a_backend_that_is_not_one_is_refused_at_load(init_model, tmp_path):
    with pytest.raises(ConfigError, match="report_to"):
        _cfg(init_model, tmp_path / "run", report_to=["mlflow"])


def test_keep_checkpoints_and_a_final_model_in_bfloat16_in_hub_sized_files(init_model, tmp_path, monkeypatch):
    from safetensors import safe_open

    import stabledrl._compat as compat
    from stabledrl.models import ModelConfig, load_policy

    monkeypatch.setattr(compat, "MAX_SHARD_SIZE", "20KB")  # the tiny model's 5 GB: several files
    cfg = _cfg(init_model, tmp_path / "run", steps=3, save_every=1, keep_checkpoints=1, final_dtype="bfloat16", mu=1)
    run_train(cfg, progress=False)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-0000003"]  # only the newest kept
    files = sorted((run / "final").glob("model-*.safetensors"))
    assert len(files) > 1 and (run / "final" / "model.safetensors.index.json").is_file()
    for f in files:
        with safe_open(str(f), "pt") as t:
            assert all(t.get_tensor(k).dtype == torch.bfloat16 for k in t.keys())
    # the checkpoint's weights stay float32 (an exact resume), and final/ loads back
    ckpt = load_file(next((run / "checkpoint-0000003").glob("model*.safetensors")))
    assert all(v.dtype == torch.float32 for v in ckpt.values())
    back = load_policy(ModelConfig(path=str(run / "final")))
    assert all(p.dtype == torch.float32 for p in back.model.parameters())
