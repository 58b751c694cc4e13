"""What the real LLaDA, Dream and SDAR files declare and do, through their stand-ins
(`fake_dllm.py`, each behaviour with the real file and line), and what stabledrl does about it:
the FSDP wrap list, the load-time attention probe, and SDAR's flash-attn imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stabledrl import _compat
from stabledrl.data import completion_mask, encode_prompts, position_ids
from stabledrl.likelihood import Completions, plan_views, score_views
from stabledrl.models import ModelConfig, load_policy
from stabledrl.models.adapters import load_hf_policy, probe_attention
from stabledrl.sampling import SamplingConfig, generate
from tests.conftest import make_tiny_policy
from tests.models.test_adapters import fake_dllm, remote_code, save_stand_ins, sdar_tokenizer

ROOT = Path(__file__).parents[2]


def _modules(model) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def _stand_ins():
    return {"llada": fake_dllm.LLaDAModelLM(fake_dllm.LLaDAConfig()),
            "dream": fake_dllm.DreamModel(fake_dllm.DreamConfig()),
            "sdar": fake_dllm.SDARForCausalLM(fake_dllm.SDARConfig()),
            "tiny": make_tiny_policy().model}


def test_the_stand_ins_declare_the_real_classes_no_split_modules():
    models = _stand_ins()
    # LLaDA lists three block classes; a llama-type model holds only LLaDALlamaBlock
    assert models["llada"]._no_split_modules == ["LLaDABlock", "LLaDASequentialBlock", "LLaDALlamaBlock"]
    assert {"LLaDABlock", "LLaDASequentialBlock"}.isdisjoint(_modules(models["llada"]))
    assert "LLaDALlamaBlock" in _modules(models["llada"])
    assert list(models["dream"]._no_split_modules) == ["DreamDecoderLayer"]  # (a set under transformers 5)
    assert "DreamDecoderLayer" in _modules(models["dream"])
    assert list(models["sdar"]._no_split_modules) == ["SDARDecoderLayer"] and "SDARDecoderLayer" in _modules(models["sdar"])
    assert list(models["tiny"]._no_split_modules) == ["_Block"]


def _layer_wrap_policy(model):
    """accelerate's FSDP2 layer-wrap policy for `model`, as `prepare` makes it with configs/accelerate/fsdp.yaml."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy as prepare

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    plugin.set_auto_wrap_policy(model)  # as fsdp2_prepare_model does first (1.13's policy wraps nothing without it)
    return prepare(plugin, model)


def test_accelerates_layer_wrap_fails_on_llada_until_its_list_is_fitted():
    for name, model in _stand_ins().items():
        if name == "llada":  # what `prepare` met with configs/accelerate/fsdp.yaml
            with pytest.raises(ValueError, match="Could not find the transformer layer class LLaDABlock"):
                _layer_wrap_policy(model)
        kept = _compat.fit_no_split_modules(model)
        policy = _layer_wrap_policy(model)
        wrapped = [m for m in model.modules() if policy(m)]
        assert len(wrapped) == 2 and {type(m).__name__ for m in wrapped} == set(kept)  # the 2 layers, nothing else
    # the class keeps the published list; a model with none of its listed classes is refused
    assert fake_dllm.LLaDAModelLM._no_split_modules[0] == "LLaDABlock"
    model = fake_dllm.DreamModel(fake_dllm.DreamConfig())
    model._no_split_modules = ["Qwen2DecoderLayer"]
    with pytest.raises(ValueError, match="none of which it contains"):
        _compat.fit_no_split_modules(model)


def test_llada_is_built_without_its_initialisation():
    # modeling_llada.py: LLaDAModelLM passes init_params=False; reset_parameters() initialises
    torch.manual_seed(0)
    model = fake_dllm.LLaDAModelLM(fake_dllm.LLaDAConfig(d_model=64))
    w = model.model.transformer.wte.weight.detach()
    assert abs(float(w.std()) - 1.0) < 0.1  # torch's Embedding default: N(0, 1)
    model.model.reset_parameters()
    assert abs(float(w.std()) - 0.02) < 0.002


# ------------------------------------------------------------------ the attention probe
@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Each copy of LLaDA's and Dream's modelling file in circulation, as a checkpoint carries it."""
    variants = {"authors": {}, "hub": {"LLADA_COPY": "hub"}, "key_padding": {"LLADA_COPY": "key_padding"},
                "causal": {"LLADA_COPY": "causal"}, "dream_dllm_rl": {"DREAM_COPY": "dllm_rl"}}
    return {name: save_stand_ins(tmp_path_factory.mktemp(name), copy) for name, copy in variants.items()}


def _raw_forward(model, boolean_mask: bool):
    """The model called as the adapters once did: LLaDA with the (B, T) mask, Dream with a
    boolean (B, 1, T, T) key mask (its own sampler's form)."""
    def logits(ids, mask):
        if boolean_mask:
            B, T = ids.shape
            mask = mask.bool()[:, None, None, :].expand(B, 1, T, T)
        return model(input_ids=ids, attention_mask=mask).logits
    return logits


@remote_code
def test_the_probe_refuses_a_copy_made_causal_by_a_padding_mask(copies):
    # dLLM-RL's and the StableDRL authors' modeling_llada.py: a (B, T) mask holding a 0 and no
    # bias -> the causal bias, in every row (the measurement)
    policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies["authors"]["llada"])))  # the adapter passes no mask: loads
    with pytest.raises(ValueError, match="attends causally"):
        probe_attention(_raw_forward(policy.model, False), vocab=24, avoid=(0, 1, 3), source="modeling_llada.py")
    # ML-GSAI's (key padding, no causal default) passes either way
    policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies["key_padding"]["llada"])))
    probe_attention(_raw_forward(policy.model, False), vocab=24, avoid=(0, 1, 3), source="modeling_llada.py")


@remote_code
def test_the_probe_refuses_the_llada_copy_that_drops_its_mask_if_given_padding(copies):
    # The Hub copy's attention call passes attn_mask=None: padding is attended whatever is passed.
    # The adapter never gives it padding (next tests), so the copy loads.
    policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies["hub"]["llada"])))
    with pytest.raises(ValueError, match="attends to padding"):
        probe_attention(_raw_forward(policy.model, False), vocab=24, avoid=(0, 1, 3), source="modeling_llada.py")


LLADA_COPIES = ("authors", "hub", "key_padding")


def _padded(policy, prompts, L=3):
    """Left-padded prompts followed by L completion tokens: (B, P+L) ids and mask."""
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    comp = torch.full((ids.size(0), L), 9)
    return torch.cat([ids, comp], dim=1), torch.cat([mask, torch.ones_like(comp)], dim=1)


@remote_code
def test_every_llada_copy_gives_a_padded_row_the_logits_of_the_row_alone(copies):
    # Prompt lengths 9, 7 and 4 (BOS included): three padding counts, so each row runs as a
    # batch of one on its real columns, the shape of the row alone: the same kernels, equal bits.
    for name in LLADA_COPIES:
        policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies[name]["llada"])))  # the probe accepts every copy
        ids, mask = _padded(policy, ["3,5,7=22", "12,4=9", "1=1"])
        with torch.no_grad():
            batch = policy.logits(ids, mask, position_ids(mask))  # (3, T, V)
            for b in range(3):
                n = int(mask[b].sum())
                alone = policy.model(input_ids=ids[b:b + 1, -n:]).logits[0]  # (n, V): no padding, no mask
                assert torch.equal(batch[b, -n:], alone), (name, b)
                assert torch.equal(batch[b, :-n], torch.zeros_like(batch[b, :-n]))  # padding columns: zeros
    # The rows alone are what ML-GSAI's copy gives the padded batch with its key-padding mask
    # (RoPE: only position differences count), up to float32 rounding of the other angles.
    with torch.no_grad():
        native = policy.model(input_ids=ids, attention_mask=mask).logits  # key_padding: the last loaded
    real = mask.bool()
    assert (batch[real] - native[real]).abs().max() <= 1e-5 * native.abs().max()


@remote_code
def test_llada_rows_of_one_padding_count_run_together(copies):
    # Two rows share each padding count: one forward per count (2, not 4), and each row's logits
    # equal the row alone up to the rounding of a batch of two (measured: 0 here; bound 1e-6 of scale).
    policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies["hub"]["llada"])))
    ids, mask = _padded(policy, ["3,5,7=22", "1=1", "9,8,7=24", "2=2"])
    calls = []
    policy.model.model.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    with torch.no_grad():
        batch = policy.logits(ids, mask, position_ids(mask))
        assert sorted(calls) == [(2, 7), (2, 12)]  # 4 and 9 tokens (BOS included), then 3
        for b in range(4):
            n = int(mask[b].sum())
            alone = policy.model(input_ids=ids[b:b + 1, -n:]).logits[0]
            assert (batch[b, -n:] - alone).abs().max() <= 1e-6 * alone.abs().max(), b


@remote_code
def test_the_probe_still_refuses_a_causal_llada(copies):
    # No mask reaches the model, so no copy can be made causal through the adapter; a model that
    # is causal itself is refused, in one line naming its file.
    path = copies["causal"]["llada"]
    with pytest.raises(ValueError, match=f"^{path / 'fake_dllm.py'} \\(llada adapter\\): position 0 does not depend") as e:
        load_policy(ModelConfig(path=str(path), trust_remote_code=True))
    assert "\n" not in str(e.value)


@remote_code
def test_check_attention_off_loads_the_causal_llada_from_the_config_or_the_keyword(copies):
    # One switch, the config's check_attention; load_policy's keyword, when given, overrides it.
    path = str(copies["causal"]["llada"])
    remote = dict(path=path, trust_remote_code=True)
    assert load_policy(ModelConfig(**remote), check_attention=False).attention_kind == "full"
    assert load_policy(ModelConfig(**remote, check_attention=False)).attention_kind == "full"
    assert load_hf_policy(ModelConfig(**remote, check_attention=False), "llada").attention_kind == "full"
    for refused in (lambda: load_policy(ModelConfig(**remote, check_attention=False), check_attention=True),
                    lambda: load_hf_policy(ModelConfig(**remote), "llada")):
        with pytest.raises(ValueError, match="attends causally"):
            refused()


@remote_code
def test_the_sampler_and_the_likelihood_agree_across_llada_copies(copies):
    # A padded batch: every copy gives the same tokens and the same log-likelihood terms, bit for bit.
    seqs, terms = {}, {}
    for name in LLADA_COPIES:
        policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies[name]["llada"])))
        ids, mask = encode_prompts(policy.tokenizer, ["3,5,7=22", "12,4=9", "1=1"])
        with torch.no_grad():
            out = generate(policy, ids, mask, SamplingConfig(gen_length=8, steps=4, block_length=4, temperature=1.0),
                           generator=torch.Generator().manual_seed(0))
            c_ids = out.sequences[:, ids.size(1):]
            c_mask = completion_mask(c_ids, policy.stop_token_ids)
            rows = Completions(c_mask, prompt_ids=ids, completion_ids=c_ids, prompt_mask=mask)
            plan = plan_views("mc", rows, num_samples=2, generator=torch.Generator().manual_seed(1))
            terms[name] = score_views(policy, plan, rows).token
        seqs[name] = out.sequences
    assert torch.equal(seqs["hub"], seqs["key_padding"]) and torch.equal(seqs["authors"], seqs["key_padding"])
    assert torch.equal(terms["hub"], terms["key_padding"]) and torch.equal(terms["authors"], terms["key_padding"])
    assert terms["hub"].abs().sum() > 0


@remote_code
def test_the_probe_refuses_a_boolean_mask_where_dream_casts_it(copies):
    # dLLM-RL's modeling_dream.py casts the mask to the query dtype: True/False become 1/0 added
    # to the scores, so a boolean key mask masks nothing; the adapter's additive mask survives it
    for name in ("authors", "dream_dllm_rl"):
        policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies[name]["dream"])))  # the probe passes at load
        if name == "dream_dllm_rl":
            with pytest.raises(ValueError, match="attends to padding"):
                probe_attention(_raw_forward(policy.model, True), vocab=24, avoid=(0, 1, 3), source="modeling_dream.py")
        else:
            probe_attention(_raw_forward(policy.model, True), vocab=24, avoid=(0, 1, 3), source="modeling_dream.py")


@remote_code
def test_the_probe_passes_the_adapters_of_the_faithful_copies(copies):
    for name in ("llada", "dream", "masked_lm"):
        policy = load_policy(ModelConfig(trust_remote_code=True, path=str(copies["authors"][name]), adapter=name))
        probe_attention(policy.logits, vocab=24, avoid=(0, 1, 3), source=name)


def test_the_probe_refuses_a_causal_model():
    policy = make_tiny_policy(seed=3)
    def logits(ids, mask):  # (B, T) padding mask -> a boolean (B, T, T) causal mask
        T = ids.size(1)
        allowed = torch.ones(T, T, dtype=torch.bool).tril() & mask.bool()[:, None, :] | torch.eye(T, dtype=torch.bool)
        return policy.model(input_ids=ids, attention_mask=allowed, position_ids=position_ids(mask)).logits
    with pytest.raises(ValueError, match="^tiny: position 0 does not depend"):
        probe_attention(logits, vocab=24, avoid=(0, 1, 3), source="tiny")
    probe_attention(lambda ids, mask: policy.logits(ids, mask), vocab=24, avoid=(0, 1, 3), source="tiny")


# ------------------------------------------------------------------ SDAR without flash-attn
def test_the_flash_attn_stand_ins_equal_the_arithmetic():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)  # (B, T, H, Dh)
    k, v = (torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))  # 2 kv heads
    for causal in (False, True):
        out = _compat.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal)
        kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)  # heads 0,1 -> kv 0
        scores = torch.einsum("bthd,bshd->bhts", q, kk) * 0.3  # (B, H, T, S)
        if causal:  # query t sees keys up to t + (S - T): the last query the last key
            allowed = torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2
            scores = scores.masked_fill(~allowed, float("-inf"))
        ref = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vv)
        assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    x, w, r = (torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(3))
    ref = (x + r) / ((x + r).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w[0]
    y, s = _compat.rms_norm_fn(x, w[0], residual=r, eps=1e-5, prenorm=True)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12) and torch.equal(s, x + r)
    plain = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w[0]
    assert torch.allclose(_compat.rms_norm_fn(x, w[0], eps=1e-5), plain, rtol=0, atol=1e-12)
    # an argument the stand-in does not implement is refused, not ignored
    with pytest.raises(NotImplementedError, match="install flash-attn"):
        _compat.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))


@remote_code
def test_sdars_file_needs_flash_attn_and_loads_through_the_shim(tmp_path):
    # A fresh process without flash-attn: the stand-in file (module-level flash_attn imports,
    # as modeling_sdar.py:51) does not import; load_policy's shims make its own imports work,
    # and transformers still reports flash-attn as unavailable.
    sdar = save_stand_ins(tmp_path)["sdar"]
    code = f"""
import importlib.util, sys, torch, transformers
from stabledrl import _compat
from stabledrl.models import ModelConfig, load_policy
assert importlib.util.find_spec("flash_attn") is None, "flash-attn is installed here"
transformers.utils.LossKwargs = _compat.LossKwargs  # the other shim alone
spec = importlib.util.spec_from_file_location("sdar_file", {str(sdar / "fake_dllm.py")!r})
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    raise SystemExit("imported without flash_attn")
except ModuleNotFoundError as e:
    assert e.name == "flash_attn", e
p = load_policy(ModelConfig(path={str(sdar)!r}, trust_remote_code=True))
assert not transformers.utils.is_flash_attn_2_available()
ids = torch.tensor([[5, 6, 7, 8]])
allowed = torch.ones(1, 4, 4, dtype=torch.bool)  # all True: SDAR's flash_attn_func path
print(p.adapter, tuple(p.logits(ids, allowed, torch.arange(4)[None]).shape))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-4:] == ["sdar", "(1,", "4,", f"{len(sdar_tokenizer())})"]


def test_the_stand_ins_make_their_tensors_on_the_inputs_device():
    """The real files build RoPE's positions (and LLaDA its causal bias) on the input's device. A
    LLaDA stand-in that built them on the CPU passed every CPU test and failed at its first forward
    on an H100 (`benchmarks/gpu_start.py`, docs/gpu-check.md). On the meta device a tensor made on
    the CPU meets the model's and raises; the default positions are the path under test."""
    for name, model in _stand_ins().items():
        model = model.eval().to("meta")
        ids = torch.zeros(2, 6, dtype=torch.long, device="meta")
        out = model(input_ids=ids, **({"use_cache": False} if name != "tiny" else {}))
        logits = getattr(out, "logits", out)
        assert logits.device.type == "meta" and logits.shape[:2] == (2, 6), name
