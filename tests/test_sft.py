import json
import math

import pytest
import torch

from stabledrl.config import ConfigError, load_config
from stabledrl.data import encode_completions, encode_prompts
from stabledrl.likelihood import block_logprobs_by_separate_passes
from stabledrl.sft import SFTConfig, diffusion_loss, run_sft, sample_mask_levels
from stabledrl.tasks import get_task
from tests.conftest import make_tiny_policy


class UniformPolicy:
    """Logits all zero: every masked token costs exactly log V nats."""

    def __init__(self, vocab: int, mask_id: int = 1):
        self.V, self.mask_token_id = vocab, mask_id

    def logits(self, input_ids, attention_mask=None, position_ids=None):
        return torch.zeros(*input_ids.shape, self.V, requires_grad=True)


class UniformBlockPolicy(UniformPolicy):
    attention_kind, block_size = "block", 3  # L = 8: blocks of 3, 3, 2


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("stratified", [True, False])
def test_loss_is_unbiased_for_the_completion_nll(stratified, block):
    # With uniform logits the NLL of a length-L completion is L log V. The loss
    # (1/(B L)) Σ_b (1/t_b) Σ_{masked} log V has expectation log V exactly
    # (E[#masked / t | t] = L for any t), so its mean over many batches must sit near
    # log V. This checks the 1/t weighting and the normalisation, not t's distribution
    # (the next test does that).
    V, B, L = 24, 64, 8
    policy = UniformPolicy(V)
    prompts = torch.full((B, 3), 7)
    comp = torch.randint(5, V, (B, L))
    gen = torch.Generator().manual_seed(0)
    # The block loss draws one level per block (B·NB levels, stratified across all of
    # them), and each block's term has the same expectation.
    policy = UniformBlockPolicy(V) if block else policy
    values = torch.tensor([
        float(diffusion_loss(policy, prompts, torch.ones_like(prompts), comp, generator=gen,
                                   t_min=1e-3, stratified_t=stratified)[0].detach())
        for _ in range(400)
    ])
    se = values.std() / math.sqrt(len(values))
    assert abs(values.mean() - math.log(V)) < 4 * se


def test_mask_levels_are_uniform_and_stratified_one_per_stratum():
    gen = torch.Generator().manual_seed(0)
    t = sample_mask_levels(8, generator=gen, t_min=0.2, stratified=True)
    # u = frac(u0 + b/8); t = 1 - 0.8 u: exactly one t in each stratum of width 0.1 of (0.2, 1].
    strata = ((1 - t) / 0.8 * 8).floor().long().sort().values
    assert strata.tolist() == list(range(8))
    assert ((t > 0.2) & (t <= 1)).all()
    many = sample_mask_levels(20000, generator=gen, t_min=0.0, stratified=False)
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_loss_matches_a_hand_computation():
    # One sequence, L = 4, t forced by the generator; recompute t and the mask with the
    # same generator state and the NLL with log_softmax, independently of the function.
    policy = make_tiny_policy(seed=11)
    p_ids, p_mask = encode_prompts(policy.tokenizer, ["3,5,7=22"])
    comp = encode_completions(policy.tokenizer, ["3*5+7"], 7)
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    loss, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=gen, t_min=1e-3, stratified_t=False)
    gen.set_state(state)
    t = 1 - (1 - 1e-3) * torch.rand(1, generator=gen)
    masked = torch.rand((1, 7), generator=gen) < t
    x = torch.cat([p_ids, comp.masked_fill(masked, policy.mask_token_id)], 1)
    logp = policy.logits(x, torch.ones_like(x)).log_softmax(-1)[0, p_ids.size(1):]
    nll = -logp.gather(-1, comp[0, :, None]).squeeze(-1)
    expected = (nll * masked[0]).sum() / t / 7
    assert torch.allclose(loss, expected.squeeze(), atol=1e-6)
    # per row (one row here): the same sum, not divided by B·L
    gen.set_state(state)
    row, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=gen, t_min=1e-3, stratified_t=False,
                            reduction="none")
    assert row.shape == (1,) and torch.allclose(row, 7 * expected.reshape(1), atol=1e-5)


def test_per_row_reduction_adds_up_to_the_loss():
    # reduction "none" gives each row's Σ (1/t) Σ_masked −log p on the same draws: their
    # sum over rows, divided by B·L, is the loss; rows differ (their own levels and masks).
    policy = make_tiny_policy(seed=11)
    p_ids, p_mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "1,2=3", "4,4,4=12"])
    comp = encode_completions(policy.tokenizer, ["3*5+7", "1+2", "4+4+4"], 7)
    with torch.no_grad():
        loss, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=torch.Generator().manual_seed(4))
        rows, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=torch.Generator().manual_seed(4),
                                 reduction="none")
    assert rows.shape == (3,) and len(set(rows.tolist())) == 3
    with pytest.raises(ValueError, match="reduction"):
        diffusion_loss(policy, p_ids, p_mask, comp, generator=torch.Generator(), reduction="sum")
    assert torch.allclose(rows.sum() / (3 * 7), loss, rtol=1e-5)


@pytest.mark.parametrize("L", [8, 7])  # S = 3: blocks 3,3,2 and 3,3,1
def test_block_loss_equals_separate_passes_per_block(L):
    # The one-pass staircase loss against NB separate passes over [q ; y_<j ; ỹ_j] with
    # the block-causal mask, on the same levels and masks (same generator state).
    policy = make_tiny_policy(seed=13, attention_kind="block", block_size=3)
    p_ids, p_mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "1=1"])  # left-padded
    comp = encode_completions(policy.tokenizer, ["3*5+7", "1"], L)
    gen = torch.Generator().manual_seed(6)
    state = gen.get_state()
    loss, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=gen, stratified_t=False)
    gen.set_state(state)
    B, NB = 2, math.ceil(L / 3)
    t = (1 - (1 - 1e-3) * torch.rand(B * NB, generator=gen)).view(B, NB)
    level = t.repeat_interleave(3, 1)[:, :L]  # (B, L) each slot's block level
    masked = torch.rand((B, L), generator=gen) < level
    logp = block_logprobs_by_separate_passes(policy, p_ids, p_mask, comp, masked)  # (B, L)
    total = (-logp * masked / level).sum()
    assert torch.allclose(loss, total / (B * L), atol=1e-5)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_a_few_steps_lower_the_loss(kind):
    # From random weights: the masked-diffusion loss, or the one-pass block loss (S = 4).
    torch.manual_seed(0)
    policy = make_tiny_policy(seed=12, **({"attention_kind": "block", "block_size": 4} if kind == "block" else {}))
    task = get_task("countdown")
    problems = task.generate(64, seed=3)
    p_ids, p_mask = encode_prompts(policy.tokenizer, [p.prompt for p in problems])
    comp = encode_completions(policy.tokenizer, [p.answer for p in problems], task.completion_length)

    def held_loss():  # the same masks every time
        with torch.no_grad():
            return float(diffusion_loss(policy, p_ids, p_mask, comp, generator=torch.Generator().manual_seed(99))[0])

    before = held_loss()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    policy.model.train()
    for _ in range(30):
        loss, _ = diffusion_loss(policy, p_ids, p_mask, comp, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.model.eval()
    assert held_loss() < 0.85 * before  # measured: full 3.30 -> 2.57, block 3.28 -> 2.21


def _tiny_cfg(tmp_path, **kw):
    base = {
        "output_dir": str(tmp_path / "run"), "steps": 6, "batch_size": 16, "warmup_steps": 2,
        "log_every": 2, "eval_every": 3, "eval_n": 8, "save_every": 3,
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
    }
    base.update(kw)
    return load_config(SFTConfig, base)


def test_run_writes_model_metrics_and_resumes_exactly(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    summary = run_sft(cfg, progress=False)
    run = tmp_path / "run"
    assert (run / "final" / "model.safetensors").is_file()
    assert (run / "config.yaml").is_file()
    evaluated = json.loads((run / "eval.json").read_text())
    assert evaluated["n"] == 8 and len(evaluated["samples"]) == 8
    assert summary["eval_accuracy"] == sum(s["correct"] for s in evaluated["samples"]) / 8
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]
    with pytest.raises(FileExistsError):
        run_sft(cfg, progress=False)

    # An interrupted run: the same 6-step schedule crashes right after its step-3
    # checkpoint, then is resumed; it must end with the same weights and losses.
    import stabledrl.sft as sft

    cfg_a = _tiny_cfg(tmp_path, output_dir=str(tmp_path / "a"))

    class Stop(Exception):
        pass

    real_save = sft.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Stop

    sft.save_checkpoint = save_then_crash
    try:
        with pytest.raises(Stop):
            run_sft(cfg_a, progress=False)
    finally:
        sft.save_checkpoint = real_save
    run_sft(cfg_a, resume=True, progress=False)
    from safetensors.torch import load_file

    full = load_file(run / "final" / "model.safetensors")
    resumed = load_file(tmp_path / "a" / "final" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    def losses(rs):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in rs if "loss" in r]

    assert losses(rows_a) == losses(rows)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="unknown config key model.width"):
        load_config(SFTConfig, {"model": {"width": 3}})
    with pytest.raises(ConfigError, match="'lr'"):
        load_config(SFTConfig, {"lr": "fast"})
    with pytest.raises(ConfigError, match="one of 'low_confidence', 'random'"):
        load_config(SFTConfig, {"sampling": {"remasking": "greedy"}})
    with pytest.raises(ConfigError, match="even integer"):
        load_config(SFTConfig, {"model": {"hidden_size": 30, "num_heads": 6}})  # head width 5
    with pytest.raises(ConfigError, match="batch_size"):
        load_config(SFTConfig, None, ["batch_size=0"])
    cfg = load_config(SFTConfig, {"lr": "3e-4"}, ["model.num_layers=2", "task.options={num_numbers: 4}"])
    assert cfg.lr == 3e-4 and cfg.model.num_layers == 2 and cfg.task.options == {"num_numbers": 4}
