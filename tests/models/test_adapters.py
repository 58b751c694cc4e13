"""Adapters for real checkpoints, each on a tiny randomly initialised config built here.

LLaDA and Dream run their own modelling code (`trust_remote_code`); `fake_dllm.py` stands
in for it with the same forward signatures, saved beside the weights as the real
checkpoints are. BERT (masked LM) and Llama (causal decoder) are `transformers` classes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, RobertaConfig,
                          RobertaForMaskedLM)

from stabledrl.config import load_config
from stabledrl.data import completion_mask, encode_completions, encode_prompts, position_ids
from stabledrl.likelihood import plan_views, score_views
from stabledrl.models import HFPolicy, ModelConfig, load_policy
from stabledrl.models.attention import block_causal_attention_mask
from stabledrl.tokenizer import build_char_tokenizer
from stabledrl.train import TrainConfig, run_train
from tests.models import fake_dllm
from tests.test_likelihood_blockwise import terms_by_separate_passes

PROMPTS = ["3,5,7=22", "12,4,6=9", "1=1"]  # unequal lengths: left padding


def _save_remote(path: Path, config_cls, model_cls, tok) -> Path:
    cfg = config_cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg.auto_map = {"AutoConfig": f"fake_dllm.{config_cls.__name__}", "AutoModel": f"fake_dllm.{model_cls.__name__}"}
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    shutil.copy(fake_dllm.__file__, path / "fake_dllm.py")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    tok = build_char_tokenizer()
    out = {
        "llada": _save_remote(root / "llada", fake_dllm.FakeLLaDAConfig, fake_dllm.FakeLLaDAModelLM, tok),
        "dream": _save_remote(root / "dream", fake_dllm.FakeDreamConfig, fake_dllm.FakeDreamModel, tok),
    }
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id))
    out["masked_lm"] = root / "bert"
    bert.save_pretrained(out["masked_lm"])
    tok.save_pretrained(out["masked_lm"])
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id))
    out["decoder"] = root / "llama"
    llama.save_pretrained(out["decoder"])
    tok.save_pretrained(out["decoder"])
    return out


def _policy(dirs, adapter: str, **kw) -> HFPolicy:
    if adapter == "decoder":
        kw.setdefault("block_size", 4)
    auto = adapter in ("llada", "dream")  # recognised from config.json's model_type
    return load_policy(ModelConfig(path=str(dirs[adapter]), adapter="auto" if auto else adapter, **kw))


def _batch(policy, L=6):
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)  # (3, P)
    c_ids = encode_completions(policy.tokenizer, ["3*5", "12-4", "1"], L)
    return p_ids, p_mask, c_ids


@pytest.mark.parametrize("adapter", ["llada", "dream", "masked_lm", "decoder"])
def test_every_adapter_loads_with_its_mask_token_and_attention_kind(dirs, adapter):
    policy = _policy(dirs, adapter)
    assert isinstance(policy, HFPolicy) and policy.adapter == adapter
    assert policy.mask_token_id == policy.tokenizer.mask_token_id == 1  # from the tokenizer here
    assert policy.attention_kind == ("block" if adapter == "decoder" else "full")
    assert policy.block_size == (4 if adapter == "decoder" else None)


def test_llada_logits_are_its_own_unshifted_logits(dirs):
    policy = _policy(dirs, "llada")
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.no_grad():
        out = policy.logits(ids, mask, position_ids(mask))
        native = policy.model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(out, native)


def test_dream_logits_are_unshifted_by_one_position(dirs):
    policy = _policy(dirs, "dream")
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    pos = position_ids(mask)
    keys = mask.bool()[:, None, None, :].expand(-1, 1, ids.size(1), -1)  # (B, 1, T, T)
    with torch.no_grad():
        out = policy.logits(ids, mask, pos)
        native = policy.model(input_ids=ids, attention_mask=keys, position_ids=pos).logits  # [:, i] predicts i+1
        truth = policy.model.unshifted_logits(ids, keys, pos)  # what position i says about token i
    # Hand-shifted reference: column i of the interface is native column i − 1.
    assert torch.equal(out[:, 1:], native[:, :-1])
    assert torch.allclose(out[:, 1:], truth[:, 1:], atol=1e-6)
    assert not torch.allclose(native[:, 1:], truth[:, 1:], atol=1e-3)  # the shift is real, not a no-op


@pytest.mark.parametrize("adapter", ["dream", "masked_lm"])
def test_left_padding_changes_nothing_for_adapters_with_positions(dirs, adapter):
    # Each prompt alone vs in a left-padded batch: the same logits on its real tokens.
    policy = _policy(dirs, adapter)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.no_grad():
        batch = policy.logits(ids, mask, position_ids(mask))
        for b, prompt in enumerate(PROMPTS):
            one_ids, one_mask = encode_prompts(policy.tokenizer, [prompt])
            alone = policy.logits(one_ids, one_mask, position_ids(one_mask))[0]
            # From the second real token on: the first (BOS) has no prediction in Dream's shifted head.
            assert torch.allclose(batch[b, -alone.size(0) + 1:], alone[1:], atol=1e-5)


def test_roberta_positions_start_after_its_padding_index(tmp_path):
    # RoBERTa numbers positions from padding_idx + 1 (here pad 0 -> 1, 2, ...) and derives
    # them itself from the pad tokens: on a left-padded batch the adapter's logits equal the
    # native forward without position ids.
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    RobertaForMaskedLM(RobertaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64,
                                     pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = load_policy(ModelConfig(path=str(tmp_path), adapter="masked_lm"))
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.no_grad():
        out = policy.logits(ids, mask, position_ids(mask))
        native = policy.model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(out[real], native[real], atol=1e-5)


def test_decoder_with_a_causal_mask_reads_the_native_causal_logits(dirs):
    # A lower-triangular (B, T, T) mask through the adapter's 4-D path = the model's own causal pass.
    policy = _policy(dirs, "decoder")
    ids = torch.tensor([[2, 8, 9, 10, 11, 12, 13]])
    T = ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        out = policy.logits(ids, causal, torch.arange(T)[None])
        native = policy.model(input_ids=ids).logits
    assert torch.allclose(out, native, atol=1e-5)
    shifted = _policy(dirs, "decoder", shift_logits=True)
    with torch.no_grad():
        assert torch.allclose(shifted.logits(ids, causal, torch.arange(T)[None])[:, 1:], native[:, :-1], atol=1e-5)


@pytest.mark.parametrize("L", [8, 7])  # S = 4 divides L, or not
def test_decoder_staircase_likelihood_equals_separate_passes(dirs, L):
    policy = _policy(dirs, "decoder")
    p_ids, p_mask, c_ids = _batch(policy, L)
    c_mask = completion_mask(c_ids, policy.eos_token_id)
    plan = plan_views("blockwise", c_mask, num_samples=3, block_size=4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one = score_views(policy, plan, p_ids, c_ids, c_mask, prompt_mask=p_mask).token.double()  # (B, L)
    sep = terms_by_separate_passes(policy, plan, p_ids, p_mask, c_ids, c_mask)
    assert plan.masked.any() and one.abs().sum() > 0
    assert torch.allclose(one, sep, atol=1e-5)


def test_decoder_blocks_do_not_see_later_blocks(dirs):
    policy = _policy(dirs, "decoder")
    p_ids, p_mask, c_ids = _batch(policy, 8)
    x = torch.cat([p_ids, c_ids], dim=1)
    attn = block_causal_attention_mask(p_mask, 8, 4)
    pos = position_ids(torch.cat([p_mask, torch.ones_like(c_ids)], dim=1))
    x2 = x.clone()
    x2[:, -1] = 12  # a token of the last block
    with torch.no_grad():
        a, b = policy.logits(x, attn, pos), policy.logits(x2, attn, pos)
    P = p_ids.size(1)
    assert torch.equal(a[:, : P + 4], b[:, : P + 4])  # prompt and block 0 unchanged
    assert not torch.equal(a[:, P + 4:], b[:, P + 4:])


def test_a_missing_or_colliding_mask_token_is_a_start_up_error(dirs, tmp_path):
    shutil.copytree(dirs["llada"], tmp_path / "llada")
    tok_cfg = tmp_path / "llada" / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg.pop("mask_token", None)
    tok_cfg.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="126336"):  # LLaDA's own id is named in the message
        load_policy(ModelConfig(path=str(tmp_path / "llada")))
    with pytest.raises(ValueError, match="equals pad_token_id"):
        _policy(dirs, "masked_lm", mask_token_id=0)
    with pytest.raises(ValueError, match="block_size"):
        load_policy(ModelConfig(path=str(dirs["decoder"]), adapter="decoder"))
    with pytest.raises(ValueError, match="model.adapter"):  # a Llama checkpoint is not guessed to be anything
        load_policy(ModelConfig(path=str(dirs["decoder"])))


@pytest.mark.parametrize("adapter", ["llada", "dream", "masked_lm", "decoder"])
def test_a_two_step_rl_run_trains_every_adapter(dirs, tmp_path, adapter):
    model = {"path": str(dirs[adapter]), "adapter": adapter}
    if adapter == "decoder":
        model["block_size"] = 4
    method = "blockwise" if adapter == "decoder" else "mc"
    cfg = load_config(TrainConfig, {
        "model": model, "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "mu": 1, "lr": 1e-3, "eval_n": 2, "save_every": 2,
        "zero_variance_groups": "keep", "estimator": {"method": method, "num_samples": 2}})
    run_train(cfg, progress=False)
    before = load_file(dirs[adapter] / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in rows) == 2
    # The run's final model loads again with its adapter, mask token and block size.
    again = load_policy(tmp_path / "run" / "final")
    assert (again.adapter, again.mask_token_id, again.block_size) == (adapter, 1, model.get("block_size"))
