"""The rollout-engine seam: the built-in engine is the sampler; a second engine, chosen by
configuration, produces the rollouts of a training run."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.config import ConfigError, load_config
from stabledrl.data import completion_mask, encode_completions, encode_prompts
from stabledrl.engines import BuiltinEngine, RolloutRequest, check_output, load_engine, roll_out
from stabledrl.sampling import GenerationOutput, SamplingConfig, generate, row_generators
from stabledrl.train import TrainConfig, run_train
from tests.conftest import make_tiny_policy

ANSWERS = ("4312214334211234", "1111222233334444", "1234")


class FixedEngine:
    """Fixed completions: each row one of `ANSWERS`, chosen by a draw of its own generator,
    every slot committed at step 0. Keeps what it was asked."""

    requests: list[RolloutRequest] = []

    def __init__(self, tag: str = "fixed"):
        self.tag = tag

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        FixedEngine.requests.append(request)
        tok = request.policy.tokenizer
        pick = [int(torch.randint(len(ANSWERS), (1,), generator=g)) for g in request.generators]
        ids = encode_completions(tok, [ANSWERS[i] for i in pick], request.gen_length).to(request.prompt_ids.device)
        B, L = ids.shape
        return GenerationOutput(sequences=torch.cat([request.prompt_ids, ids], dim=1), completion_ids=ids,
                                completion_mask=completion_mask(ids, tok.eos_token_id),
                                unmask_step=torch.zeros((B, L), dtype=torch.long), forward_passes=0,
                                entropy=torch.zeros(B))


class PadEndedEngine(FixedEngine):
    """`FixedEngine`'s completions ending at a PAD instead of EOS: what the sampler writes when it
    draws PAD there, with PAD a stop token (tests/test_train.py trains on them)."""

    def rollout(self, request: RolloutRequest) -> GenerationOutput:
        out = super().rollout(request)
        policy = request.policy
        ids = out.completion_ids.masked_fill(out.completion_ids == policy.eos_token_id, policy.pad_token_id)
        return dataclasses.replace(out, sequences=torch.cat([request.prompt_ids, ids], dim=1), completion_ids=ids,
                                   completion_mask=completion_mask(ids, policy.stop_token_ids))


class NotAnEngine:
    pass


def _request(policy, prompts=("..12..4..4.11.3.", "1.3.2..4.1..3..2"), **sampling):
    ids, mask = encode_prompts(policy.tokenizer, list(prompts))
    return RolloutRequest(policy, ids, mask, 17, row_generators("e", 0, len(prompts)), SamplingConfig(**sampling))


@pytest.mark.parametrize("fast", [{}, {"noise": "counter", "threshold": 0.9, "approx_cache": "prefix", "block_length": 6}])
def test_the_builtin_engine_is_the_sampler_with_every_option(fast):
    policy = make_tiny_policy(seed=2)
    req = _request(policy, temperature=1.0, steps=9, **fast)
    got = roll_out(req)
    one_call = SamplingConfig(gen_length=17, temperature=1.0, steps=9, **fast)
    want = generate(policy, req.prompt_ids, req.prompt_mask, one_call, generator=row_generators("e", 0, 2))
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)
    assert isinstance(load_engine("builtin"), BuiltinEngine)


def test_the_builtin_engine_sorts_micro_batches_by_prompt_length_when_asked(prompt_widths):
    policy = make_tiny_policy(seed=2)
    prompts = ("..12..4..4.11.3.", "1.3", "4.1..3..2", "2")  # BOS and 16, 3, 9, 1 characters
    for sort in (False, True):
        req = _request(policy, prompts, temperature=1.0, sort_by_length=sort)
        req.micro_batch = 2
        roll_out(req)
    assert prompt_widths == [17, 17, 1 + 3, 1 + 16]  # sorted: (1, 3) then (9, 16), each without common padding


def test_an_external_engine_is_imported_by_name_and_its_output_checked():
    policy = make_tiny_policy(seed=2)
    req = _request(policy, engine="tests.test_engines:FixedEngine", engine_options={"tag": "x"})
    out = roll_out(req)
    assert load_engine("tests.test_engines:FixedEngine", {"tag": "x"}).tag == "x"
    assert out.completion_mask.sum(1).tolist() == [len(ANSWERS[i]) + 1 for i in
                                                   [int(torch.randint(3, (1,), generator=g)) for g in
                                                    row_generators("e", 0, 2)]]
    with pytest.raises(ValueError, match="does not import"):
        load_engine("tests.no_such_module:Engine")
    with pytest.raises(ValueError, match="does not import"):
        load_engine("tests.test_engines:Missing")
    with pytest.raises(TypeError, match="not a rollout engine"):
        load_engine("tests.test_engines:NotAnEngine")
    bad = GenerationOutput(out.sequences, out.completion_ids[:, :5], out.completion_mask, out.unmask_step, 0,
                           out.entropy)
    with pytest.raises(ValueError, match=r"completion_ids \(2, 5\)"):
        check_output(bad, req)
    unstamped = GenerationOutput(out.sequences, out.completion_ids, out.completion_mask, out.unmask_step - 1, 0,
                                 out.entropy)
    with pytest.raises(ValueError, match="unmask_step"):
        check_output(unstamped, req)
    with pytest.raises(TypeError, match="GenerationOutput"):
        check_output({"completion_ids": out.completion_ids}, req)


def test_engine_settings_are_checked_in_the_config():
    with pytest.raises(ConfigError, match="package.module:ClassName"):
        load_config(SamplingConfig, {"engine": "nocolon"})
    with pytest.raises(ConfigError, match="engine_options"):
        load_config(SamplingConfig, {"engine_options": {"a": 1}})
    with pytest.raises(ConfigError, match="threshold"):
        load_config(SamplingConfig, {"threshold": 0.9, "remasking": "random"})


def test_a_training_run_takes_its_rollouts_from_the_configured_engine(tmp_path):
    init = tmp_path / "init"
    make_tiny_policy(seed=41).save(init)
    cfg = load_config(TrainConfig, {
        "model": str(init), "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "mu": 1, "lr": 1e-3, "eval_n": 4, "save_every": 2,
        "estimator": {"method": "path"}, "zero_variance_groups": "keep",
        "rollout": {"temperature": 1.0, "engine": "tests.test_engines:FixedEngine"}})
    FixedEngine.requests.clear()
    run_train(cfg, progress=False)
    assert len(FixedEngine.requests) == 2  # one rollout per step; the evaluations use the built-in sampler
    assert all(r.prompt_ids.size(0) == 8 and r.gen_length == 17 for r in FixedEngine.requests)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    # Sudoku rewards of the three fixed answers (exact 1.0, partial, cut short) averaged over the groups.
    lengths = {len(a) + 1 for a in ANSWERS}
    before, after = (load_file(d / "model.safetensors") for d in (init, tmp_path / "run" / "final"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the engine's rollouts trained the policy
    assert len(steps) == 2
    for r in steps:
        assert r["entropy"] == 0.0  # the engine's, not the sampler's
        assert 0 < r["reward_mean"] <= 1
        assert min(lengths) <= r["completion_length"] <= max(lengths)


def test_rollout_settings_that_do_not_fit_are_refused_before_a_run_directory_exists(tmp_path):
    init = tmp_path / "block"
    make_tiny_policy(seed=41, attention_kind="block", block_size=3).save(init)
    base = {"model": str(init), "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 1,
            "prompts_per_step": 2, "group_size": 2, "eval_n": 2, "estimator": {"method": "blockwise"}}
    for rollout, match in (({"temperature": 1.0, "approx_cache": "prefix"}, "full-attention"),
                           ({"temperature": 1.0, "engine": "tests.test_engines:NotAnEngine"}, "not a rollout engine")):
        with pytest.raises((ValueError, TypeError), match=match):
            run_train(load_config(TrainConfig, {**base, "rollout": rollout}), progress=False)
        assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="built-in sampler"):
        load_config(TrainConfig, {**base, "eval_sampling": {"engine": "tests.test_engines:FixedEngine"}})
