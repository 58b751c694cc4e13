"""LoRA through peft: only the adapters train, and the reference is the base model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.config import ConfigError, load_config
from stabledrl.data import encode_prompts, position_ids
from stabledrl.models import LoraSettings, add_lora, base_policy, load_policy
from stabledrl.train import TrainConfig, run_train
from tests.conftest import DispatchedOps, make_tiny_policy


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "model"
    make_tiny_policy(seed=41).save(path)
    return path


def _logits(policy):
    ids, mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "1=1"])
    with torch.no_grad():
        return policy.logits(ids, mask, position_ids(mask))


def test_a_lora_run_changes_only_the_adapters(init_model, tmp_path):
    cfg = load_config(TrainConfig, {
        "model": str(init_model), "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "mu": 2, "lr": 1e-2, "eval_n": 2, "zero_variance_groups": "keep",
        "estimator": {"method": "mc", "num_samples": 2}, "lora": {"r": 4, "alpha": 8}})
    run_train(cfg, progress=False)
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    adapters = load_file(final / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at zero
    trained = load_policy(final)  # the base it was trained on, then the adapters
    base_now = trained.model.get_base_model().state_dict()
    initial = load_file(init_model / "model.safetensors")
    for k, v in initial.items():  # every base weight exactly as it was
        peft_key = next(n for n in base_now if n.endswith(k.replace(".weight", ".base_layer.weight"))
                        or n == k)
        assert torch.equal(base_now[peft_key], v), k
    assert not torch.allclose(_logits(trained), _logits(load_policy(init_model)), atol=1e-4)


def test_the_reference_is_the_base_model_with_adapters_off(init_model):
    base = load_policy(init_model)
    expected = _logits(base)
    policy = add_lora(load_policy(init_model), LoraSettings(r=4))
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # as if trained: the adapters now change the output
    reference = base_policy(policy)
    assert reference.model is policy.model  # no second copy of the weights
    assert torch.equal(_logits(reference), expected)
    assert not torch.allclose(_logits(policy), expected, atol=1e-3)  # adapters back on after the reference call
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="lora.r"):
        load_config(TrainConfig, {"lora": {"r": 0}})
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(TrainConfig, {"lora": {"target_modules": []}})


def _llada_with_adapters(dtype=torch.float32, dropout=0.0, seed=0, alpha=8.0):
    """A small native LLaDA (2 layers) with LoRA r 4 on every linear layer, B drawn (as if trained)."""
    from stabledrl.models.native import LLaDAModelLM
    from tests.models.test_native import _small_configs

    torch.manual_seed(seed)
    cfg = _small_configs()["llada"]
    cfg.n_layers = 2
    model = LLaDAModelLM(cfg).to(dtype).eval()
    policy = add_lora(type("P", (), {"model": model})(), LoraSettings(r=4, alpha=alpha, dropout=dropout), seed=seed)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return policy.model.eval()  # peft leaves it in training mode


def _forward(model, autocast: bool):
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids).logits


@pytest.mark.parametrize("base,adapters,autocast", [
    (torch.float32, torch.float32, False),  # full precision
    (torch.bfloat16, torch.float32, True),  # the LoRA recipes': a bf16 base, peft's float32 adapters, bf16 compute
    (torch.float32, torch.float32, True),  # float32 weights, bf16 compute
    (torch.bfloat16, torch.float32, False),  # peft casts x to float32 and adds in float32
    (torch.bfloat16, torch.bfloat16, True),
])
@pytest.mark.parametrize("alpha", [8.0, 6.0], ids=["scaling-2", "scaling-1.5"])  # a power of two: one fused sum
def test_lean_adapters_give_peft_forward_to_the_bit(base, adapters, autocast, alpha):
    from peft.tuners.lora import Linear as LoraLinear

    from stabledrl.models.lora import lean_adapters

    model = _llada_with_adapters(base, dropout=0.1, alpha=alpha)  # eval mode: the dropout draws nothing
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapters)
    expected = _forward(model, autocast)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    with lean_adapters(model) as lean:
        assert lean == len(layers) == 2 * 7  # q, k, v, attn_out, ff_proj, up_proj, ff_out in each block
        got = _forward(model, autocast)
        again = _forward(model, autocast)  # the cached casts
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert not any("forward" in vars(m) for m in layers)  # peft's forward back


@pytest.mark.parametrize("alpha, tail", [(8.0, ["add_"]), (6.0, ["mul_", "add_"])])
def test_lean_adapters_launch_fewer_operations_under_bf16_autocast(alpha, tail):
    # by the operations dispatched: peft's forward casts x to float32 and back and A and B to bf16 in every
    # call (autocast keeps no cast from one model call to the next); the short one adds to the base linear's
    # own operations A's and B's products and the scaled sum, in place (scaling 1.5: the scaling first)
    from stabledrl.models.lora import lean_adapters

    model = _llada_with_adapters(torch.bfloat16, alpha=alpha)
    layer = model.base_model.model.model.transformer.blocks[0].q_proj
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16)

    def ops(module):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), DispatchedOps() as dispatched:
            module(x)
        return [op.overloadpacket.__name__ for op in dispatched.ops]

    base_ops, peft_ops = ops(layer.base_layer), ops(layer)
    with lean_adapters(model):
        ops(layer)  # the first call casts A and B
        lean_ops = ops(layer)
    assert peft_ops.count("_to_copy") >= 2 and peft_ops.count("mm") == 3  # peft 0.21: 4 (x there and back, A, B)
    assert lean_ops[: len(base_ops)] == base_ops
    assert lean_ops[len(base_ops):] == ["view", "mm", "mm", "view", *tail]
    assert len(lean_ops) < len(peft_ops) and '_to_copy' not in lean_ops  # peft 0.21: 18 against 10


def test_lean_adapters_keep_peft_forward_for_gradients_adapters_off_and_dropout():
    from stabledrl.models.lora import lean_adapters

    model = _llada_with_adapters(dropout=0.3)
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
    model.train()  # dropout draws: peft's forward, with the same draws
    torch.manual_seed(5)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with lean_adapters(model):
        torch.manual_seed(5)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, expected)
        model.eval()
        with torch.no_grad(), model.disable_adapter():  # the reference (base_policy)
            assert torch.equal(model(input_ids=ids).logits, base)
        model(input_ids=ids).logits.sum().backward()  # gradients: peft's forward, which they flow through
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_A" in n}
    assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads.values())


def test_lean_adapters_leave_hooked_wrapped_partitioned_and_double_adapters_to_peft():
    from stabledrl.models.lora import _plain_lora_layers

    model = _llada_with_adapters()
    blocks = model.base_model.model.model.transformer.blocks
    all_layers = len(_plain_lora_layers(model))
    blocks[0].q_proj.lora_A["default"].register_forward_pre_hook(lambda m, a: None)  # offloading, ZeRO-3's gather
    blocks[0].k_proj.lora_B["default"].weight.ds_id = 7  # a DeepSpeed ZeRO-3 parameter
    blocks[1].v_proj.lora_A["default"].weight.data = blocks[1].v_proj.lora_A["default"].weight.data.double()
    blocks[1].q_proj.base_layer.register_forward_hook(lambda m, a, out: None)  # could keep the output
    blocks[1].k_proj.lora_B["default"].__class__ = type("Wrapped", (torch.nn.Linear,), {})  # an FSDP unit's class
    served = {id(m) for m, _ in _plain_lora_layers(model)}
    left = {id(blocks[0].q_proj), id(blocks[0].k_proj), id(blocks[1].v_proj), id(blocks[1].q_proj), id(blocks[1].k_proj)}
    assert len(served) == all_layers - 5 and not left & served


@pytest.mark.parametrize("variant", ["use_dora", "lora_bias"])
def test_lean_adapters_leave_dora_and_a_bias_of_b_to_peft(variant):
    # DoRA (peft names it in `lora_variant`) and a bias on B compute more than base(x) + B(A(x))·scaling
    from peft import LoraConfig, get_peft_model

    from stabledrl.models.lora import _plain_lora_layers
    from stabledrl.models.native import LLaDAModelLM
    from tests.models.test_native import _small_configs

    cfg = _small_configs()["llada"]
    cfg.n_layers = 1
    model = get_peft_model(LLaDAModelLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "k_proj"], **{variant: True}))
    plain = get_peft_model(LLaDAModelLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "k_proj"]))
    assert len(_plain_lora_layers(plain)) == 2 and _plain_lora_layers(model) == []


def tiny_with_trained_adapters():
    """The tiny model as the LoRA recipes hold an 8B one: bf16 base, float32 adapters (r 4), B drawn."""
    policy = add_lora(make_tiny_policy(seed=3), LoraSettings(r=4))
    policy.model.to(torch.bfloat16)
    for name, p in policy.model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return policy


def _sampled_both_ways(monkeypatch, sample):
    """`sample()` with the sampler's short LoRA forward (`generate` enters `lean_adapters`), then with
    peft's in every layer: (the short forward's tokens, peft's tokens, [the calls each layer given the
    short forward took, over the first sample's generates])."""
    from contextlib import contextmanager, nullcontext

    import stabledrl.sampling as sampling
    from stabledrl.models.lora import _LeanForward, lean_adapters

    calls = []

    @contextmanager
    def spy(model):
        with lean_adapters(model) as n:
            yield n
            calls.extend(m.forward.calls for m in model.modules() if isinstance(vars(m).get("forward"), _LeanForward))

    monkeypatch.setattr(sampling, "lean_adapters", spy)
    lean = sample()
    monkeypatch.setattr(sampling, "lean_adapters", lambda model: nullcontext())
    return lean, sample(), calls


def test_the_sampler_draws_the_same_tokens_with_lean_adapters(monkeypatch):
    # generate runs under lean_adapters; with peft's forward instead every token is the same (bf16
    # base, float32 adapters, bf16 autocast: the LoRA recipes' setting)
    from stabledrl.sampling import SamplingConfig, generate, row_generators

    policy = tiny_with_trained_adapters()
    ids, mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "1=1"])
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, temperature=1.0, approx_cache="dual")

    def sample():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(policy, ids, mask, cfg, generator=row_generators("t", 0, 2)).completion_ids

    lean, peft, served = _sampled_both_ways(monkeypatch, sample)
    assert served  # layers given the short forward
    assert torch.equal(peft, lean)


@pytest.mark.parametrize("autocast", [False, True])
def test_under_fsdps_bf16_mixed_precision_lean_adapters_draw_peft_tokens(fsdp_bf16, monkeypatch, autocast):
    # FSDP2 over the blocks (accelerate's bf16 policy: the adapters gathered in bf16 too) and the sampler
    # under lean_adapters, with and without autocast: the same tokens as peft's forward, through the short one
    from stabledrl.models.adapters import HFPolicy
    from stabledrl.models.native import LLaDAModelLM
    from stabledrl.sampling import SamplingConfig, generate, row_generators
    from stabledrl.tokenizer import build_char_tokenizer
    from tests.models.test_native import _small_configs

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = _small_configs()["llada"]
    cfg.update(dict(n_layers=2, vocab_size=len(tok), embedding_size=len(tok), mask_token_id=tok.mask_token_id,
                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    policy = add_lora(HFPolicy(LLaDAModelLM(cfg).eval(), tok, "llada", tok.mask_token_id),
                      LoraSettings(r=4, alpha=8.0, dropout=0.0), seed=0)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    fsdp_bf16(policy.model, policy.model.base_model.model.model.transformer.blocks)
    policy.model.eval()
    ids, mask = encode_prompts(tok, ["3,5,7=22", "1=1", "12,4=3"])
    cfg = SamplingConfig(gen_length=8, steps=8, block_length=4, temperature=0.9, approx_cache="dual", noise="counter")

    def sample():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return generate(policy, ids, mask, cfg, generator=row_generators("f", 0, 3)).completion_ids

    lean, peft, short = _sampled_both_ways(monkeypatch, sample)
    assert len(short) == 2 * 7 and min(short) > 0  # every adapted layer took the short forward
    assert torch.equal(peft, lean)
