"""Adapters for real checkpoints, each on a tiny randomly initialised config built here.

LLaDA, Dream and SDAR checkpoints load into stabledrl's native code by default
(tests/models/test_native.py checks it against their published code); with
``trust_remote_code`` they run their own modelling code. `fake_dllm.py` stands in for it,
with each checkpoint's names, interface and quirks (its docstring lists them), saved beside
the weights as the real checkpoints are. The published files run only under transformers
< 4.58, so the tests of that path (`remote_code`) skip under 5.x. BERT (masked LM) and Llama
(causal decoder) are `transformers` classes.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (BertConfig, BertForMaskedLM, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, RobertaConfig, RobertaForMaskedLM)

from stabledrl._compat import install_remote_code_shims
from stabledrl.cli import main
from stabledrl.config import load_config
from stabledrl.data import completion_mask, encode_completions, encode_prompts, position_ids
from stabledrl.likelihood import Completions, plan_views, score_views
from stabledrl.models import HFPolicy, ModelConfig, load_policy
from stabledrl.models.attention import block_causal_attention_mask
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tokenizer import CHARS, build_char_tokenizer
from stabledrl.train import TrainConfig, run_train
from tests.test_likelihood_blockwise import terms_by_separate_passes

install_remote_code_shims()  # fake_dllm imports LossKwargs, as SDAR's file does
from tests.models import fake_dllm  # noqa: E402

PROMPTS = ["3,5,7=22", "12,4,6=9", "1=1"]  # unequal lengths: left padding
remote_code = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) >= 5,
    reason=f"the published LLaDA, Dream and SDAR files do not run under transformers {transformers.__version__} "
           "(stabledrl refuses them there); the slow layer runs them under transformers 4.57 "
           "(tests/models/test_published_code.py)")
SDAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "[UNK]"]


def run_fresh(code: str) -> str:
    """`code` in a fresh Python process (this checkout's src first on its path): its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def sdar_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer with the special tokens of SDAR-Chat's (Qwen3's): no BOS, EOS and PAD
    <|endoftext|>, the end-of-turn <|im_end|> (the generation config's EOS) and <|MASK|>."""
    vocab = {t: i for i, t in enumerate(SDAR_SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|MASK|>", unk_token="[UNK]",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def _save_remote(path: Path, model, tok, auto: str, copy: dict[str, str] | None = None) -> Path:
    """`copy`: module constants of fake_dllm.py to rewrite in the saved file (which copy of a
    modelling file it stands for, e.g. {"LLADA_COPY": "hub"})."""
    # Weights spread enough that random completions differ in reward (RL needs mixed groups).
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.2)
    cfg = model.config
    cfg.auto_map = {"AutoConfig": f"fake_dllm.{type(cfg).__name__}", auto: f"fake_dllm.{type(model).__name__}"}
    model.save_pretrained(path)
    tok.save_pretrained(path)
    code = Path(fake_dllm.__file__).read_text()
    for name, value in (copy or {}).items():
        line = f'{name} = "{getattr(fake_dllm, name)}"'
        assert line in code, name
        code = code.replace(line, f'{name} = "{value}"')
    (path / "fake_dllm.py").write_text(code)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return save_stand_ins(tmp_path_factory.mktemp("adapters"))


def save_stand_ins(root: Path, copies: dict[str, str] | None = None) -> dict[str, Path]:
    """The five checkpoints under `root`; `copies` as `_save_remote`'s `copy`."""
    tok = build_char_tokenizer()
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    # LLaDA's tokenizer does not declare its mask token; its config does.
    llada_tok = build_char_tokenizer()
    llada_tok.mask_token = None
    torch.manual_seed(0)
    out = {"llada": _save_remote(root / "llada", fake_dllm.LLaDAModelLM(fake_dllm.LLaDAConfig(
        mask_token_id=tok.mask_token_id, **ids)), llada_tok, "AutoModel", copies)}
    torch.manual_seed(0)
    out["dream"] = _save_remote(root / "dream", fake_dllm.DreamModel(fake_dllm.DreamConfig(
        mask_token_id=tok.mask_token_id, bos_token_id=tok.bos_token_id, **ids)), tok, "AutoModel", copies)
    # Dream-v0-Instruct-7B's generation_config.json: its sampler's own fields beside the ids
    (out["dream"] / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": tok.bos_token_id,
         "eos_token_id": tok.eos_token_id, "eps": 0.001, "mask_token_id": None, "output_history": False,
         "pad_token_id": tok.pad_token_id, "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None}))
    stok = sdar_tokenizer()
    torch.manual_seed(0)
    sdar = fake_dllm.SDARForCausalLM(fake_dllm.SDARConfig(
        vocab_size=len(stok), block_size=4, mask_token_id=stok.mask_token_id, pad_token_id=stok.pad_token_id,
        eos_token_id=stok.eos_token_id))
    sdar.generation_config = GenerationConfig(eos_token_id=[stok.convert_tokens_to_ids("<|im_end|>"), stok.eos_token_id])
    out["sdar"] = _save_remote(root / "sdar", sdar, stok, "AutoModelForCausalLM", copies)
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


ADAPTER_OF = {"llada": "llada", "dream": "dream", "sdar": "sdar", "masked_lm": "masked_lm", "decoder": "decoder"}
BLOCK_ADAPTERS = ("sdar", "decoder")


def _policy(dirs, name: str, **kw) -> HFPolicy:
    """llada, dream and sdar are recognised from config.json's model_type (their block size and
    mask token from the checkpoint) and load natively; `remote`: their published code (the
    stand-in) instead; the others are named."""
    if name == "decoder":
        kw.setdefault("block_size", 4)
    if kw.pop("remote", False):
        kw["trust_remote_code"] = True
    auto = name in ("llada", "dream", "sdar")
    return load_policy(ModelConfig(path=str(dirs[name]), adapter="auto" if auto else name, **kw))


def _batch(policy, L=6):
    p_ids, p_mask = encode_prompts(policy.tokenizer, PROMPTS)  # (3, P)
    c_ids = encode_completions(policy.tokenizer, ["3*5", "12-4", "1"], L)
    return p_ids, p_mask, c_ids


@pytest.mark.parametrize("name", ["llada", "dream", "sdar", "masked_lm", "decoder"])
def test_every_adapter_loads_with_its_mask_token_and_attention_kind(dirs, name):
    policy = _policy(dirs, name)
    adapter = ADAPTER_OF[name]
    assert isinstance(policy, HFPolicy) and policy.adapter == adapter
    # The tokenizer's [MASK] (1), declared by LLaDA's config only; SDAR's <|MASK|> from its config.
    assert policy.mask_token_id == (SDAR_SPECIALS.index("<|MASK|>") if name == "sdar" else 1)
    assert policy.attention_kind == ("block" if adapter in BLOCK_ADAPTERS else "full")
    assert policy.block_size == (4 if adapter in BLOCK_ADAPTERS else None)
    # SDAR's blocks run over the whole sequence (tests/test_prompt_attention.py)
    assert policy.prompt_attention == ("sequence_blocks" if adapter in BLOCK_ADAPTERS else "bidirectional")
    assert policy.native == (name in ("llada", "dream", "sdar")) and not policy.trust_remote_code


@remote_code
def test_llada_logits_are_its_own_unshifted_logits(dirs):
    policy = _policy(dirs, "llada", remote=True)
    assert policy.tokenizer.mask_token_id is None  # LLaDA's tokenizer does not name it
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    assert not mask.all()  # left padding
    given = []
    policy.model.register_forward_pre_hook(lambda m, a, kw: given.append(sorted(kw)), with_kwargs=True)
    with torch.no_grad():
        out = policy.logits(ids, mask, position_ids(mask))
        # Each row's real columns, run without padding and without a mask (rows 0 and 1 together:
        # the same padding count, so the same batch of two as the adapter's)
        native = [policy.model(input_ids=ids[:2]).logits, policy.model(input_ids=ids[2:, -4:]).logits]
        # ... never the (B, T) mask, which the authors' copy (the stand-in's) makes causal
        causal = policy.model(input_ids=ids, attention_mask=mask).logits
    assert given[:2] == [["input_ids", "use_cache"]] * 2  # two padding counts: two forwards, no mask nor bias
    assert torch.equal(out[:2], native[0]) and torch.equal(out[2:, -4:], native[1])
    assert torch.equal(out[2, :-4], torch.zeros_like(out[2, :-4]))  # padding columns: zeros, never read
    assert not torch.allclose(out[2:, -4:], causal[2:, -4:], atol=1e-3)


@remote_code
def test_llada_makes_the_forwards_other_processes_make(dirs, monkeypatch):
    # Sharded weights make every forward a collective: a process with fewer padding counts than
    # another makes spare forwards, at weight 0 in the graph. Here 2 more than its own 2: the
    # same logits and gradients, 4 forwards.
    from stabledrl.models import adapters

    policy = _policy(dirs, "llada", remote=True)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    calls = []
    policy.model.register_forward_pre_hook(lambda *a: calls.append(1))
    out, grads = [], []
    for extra in (0, 2):
        monkeypatch.setattr(adapters, "_forwards_everywhere", lambda model, n, device: n + extra)
        policy.model.zero_grad()
        out.append(policy.logits(ids, mask))
        out[-1].square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in policy.model.named_parameters()})
    assert len(calls) == 2 + 4
    assert torch.equal(out[0], out[1])
    assert all(torch.equal(g, grads[1][k]) for k, g in grads[0].items())


def _sharded_llada(rank: int, path: str, init: str, report: str) -> None:
    """One of 2 CPU processes: the LLaDA stand-in sharded with FSDP2, a left-padded batch with
    2 padding counts on rank 0 and 1 on rank 1, a forward and a backward; writes its logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    policy = load_policy(ModelConfig(path=path, device="cpu", trust_remote_code=True))
    for block in policy.model.model.transformer.blocks:
        fully_shard(block)
    fully_shard(policy.model)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS if rank == 0 else PROMPTS[:2])
    logits = policy.logits(ids, mask)
    logits.square().mean().backward()
    torch.save(logits.detach(), f"{report}.{rank}")
    del policy, logits
    gc.collect()
    dist.destroy_process_group()
    os._exit(0)  # past gloo's threads at interpreter teardown, which can abort (stabledrl.cli does the same)


@remote_code
@pytest.mark.slow  # two processes, about 10 s
def test_sharded_llada_processes_make_the_same_forwards(dirs, tmp_path):
    # Without the spare forward, rank 1 (one padding count) would leave rank 0's second forward
    # waiting for its all-gather: a hang, ended by the timeout.
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'store'}"
    ctx = mp.spawn(_sharded_llada, args=(str(dirs["llada"]), init, str(tmp_path / "logits")), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5) and time.monotonic() < deadline:  # join returns as each process ends
        pass
    hung = [p for p in ctx.processes if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a process waits on a collective"
    policy = _policy(dirs, "llada", remote=True)
    for rank, prompts in ((0, PROMPTS), (1, PROMPTS[:2])):
        ids, mask = encode_prompts(policy.tokenizer, prompts)
        with torch.no_grad():
            want = policy.logits(ids, mask)
        assert torch.allclose(torch.load(tmp_path / f"logits.{rank}"), want, rtol=0, atol=1e-5 * want.abs().max())


@remote_code
def test_llada_checkpoints_activations_only_through_its_own_hook(dirs):
    # The stand-in reproduces what a gradient-checkpointing setting must use for LLaDA.
    policy = _policy(dirs, "llada", remote=True)
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        policy.model.gradient_checkpointing_enable()
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    grads = []
    for strategy in (None, "whole_layer"):
        policy.model.model.set_activation_checkpointing(strategy)
        policy.model.zero_grad()
        policy.logits(ids, mask).square().mean().backward()
        grads.append(policy.model.get_input_embeddings().weight.grad.clone())
    assert policy.model.model.checkpointed_calls == 4  # 2 layers x 2 forwards (2 padding counts), in eval mode
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


FIRST_LAYER = {"llada": lambda m: m.model.transformer.blocks[0], "dream": lambda m: m.model.layers[0],
               "sdar": lambda m: m.model.layers[0], "masked_lm": lambda m: m.bert.encoder.layer[0],
               "decoder": lambda m: m.model.layers[0]}


@pytest.mark.parametrize("name, remote", [("llada", False), ("dream", False), ("sdar", False), ("masked_lm", False),
                                          ("decoder", False), pytest.param("llada", True, marks=remote_code)])
def test_gradient_checkpointing_runs_the_models_own_hook_with_the_same_gradients(dirs, name, remote):
    # model.gradient_checkpointing for every adapter: each layer's activations are
    # recomputed in the backward, so layer 0 runs twice per forward and backward (once under
    # no_grad), through the model's own hook: the native models' flag, LLaDA's published
    # set_activation_checkpointing (its stand-in counts the checkpointed layers), else
    # transformers' gradient_checkpointing_enable, in the eval mode the update runs in (BERT's
    # dropout stays off: the same gradients).
    grads, calls = [], []
    for ckpt in (False, True):
        policy = _policy(dirs, name, gradient_checkpointing=ckpt, remote=remote)
        model = policy.model
        p_ids, p_mask, c_ids = _batch(policy)
        x = torch.cat([p_ids, c_ids], dim=1)
        keys = torch.cat([p_mask, torch.ones_like(c_ids)], dim=1)
        attn = (block_causal_attention_mask(p_mask, c_ids.size(1), 4, policy.prompt_attention)
                if policy.attention_kind == "block" else keys)
        n = [0]
        # a projection inside layer 0: transformers 5 recomputes a layer's forward without its own hooks
        first = next(m for m in FIRST_LAYER[name](model).modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        logp = policy.logits(x, attn, position_ids(keys)).double().log_softmax(-1)  # (B, T, V)
        logp.gather(-1, x[..., None]).mean().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            policy.logits(x, attn, position_ids(keys))
        calls.append(n[0])
        assert not any(m.training for m in model.modules())  # still in eval mode everywhere
    # plain: 1 + 1 (no_grad); checkpointed: 2 + 1; LLaDA's published code twice that: one forward per padding
    # count (2)
    assert calls == ([4, 6] if remote else [2, 3])
    assert policy.checkpointing_hook == ("set_activation_checkpointing" if remote else None if policy.native
                                         else "gradient_checkpointing_enable")
    assert not policy.native or policy.model.gradient_checkpointing is True
    if remote:
        # 2 layers; the load's probe makes 5 forwards (2 rows of 2 padding counts, twice; 1 row alone), then 2 + 2
        assert policy.model.model.checkpointed_calls == 2 * (5 + 2 + 2)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for k, g in grads[0].items():  # recomputed in float32: relative 1e-5 of the largest entry
        assert (g - grads[1][k]).abs().max() <= 1e-5 * g.abs().max(), k
    assert any(g.abs().max() > 0 for g in grads[0].values())


def test_gradient_checkpointing_is_refused_for_a_model_without_a_hook():
    class NoCheckpointing(BertForMaskedLM):
        supports_gradient_checkpointing = False

    tok = build_char_tokenizer()
    model = NoCheckpointing(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id))
    with pytest.raises(ValueError, match="supports neither transformers' gradient_checkpointing_enable"):
        HFPolicy(model.eval(), tok, "masked_lm", tok.mask_token_id, gradient_checkpointing=True)


@remote_code
def test_dream_logits_are_unshifted_by_one_position(dirs):
    policy = _policy(dirs, "dream", remote=True)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    pos = position_ids(mask)
    keys = mask.bool()[:, None, None, :].expand(-1, 1, ids.size(1), -1)  # (B, 1, T, T), as Dream's sampler builds
    with torch.no_grad():
        out = policy.logits(ids, mask, pos)
        native = policy.model(input_ids=ids, attention_mask=keys, position_ids=pos).logits  # [:, i] predicts i+1
    # Hand-shifted reference: column i of the interface is native column i − 1; column 0 repeats column 0.
    assert torch.equal(out[:, 1:], native[:, :-1])
    assert torch.equal(out[:, 0], native[:, 0])
    assert not torch.allclose(out[:, 1:], native[:, 1:], atol=1e-3)  # the shift is real, not a no-op


@pytest.mark.parametrize("remote", [False, pytest.param(True, marks=remote_code)])
def test_a_dream_policy_saves_its_own_generation_config_and_loads_again(dirs, tmp_path, remote):
    # Dream's DreamGenerationConfig.validate() takes no `strict`, which save_pretrained passes; the native
    # model reads the same file as a plain GenerationConfig.
    policy = _policy(dirs, "dream", remote=remote)
    assert type(policy.model.generation_config).__name__ == ("DreamGenerationConfig" if remote else "GenerationConfig")
    policy.save(tmp_path / "saved")
    gen = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert (gen["steps"], gen["alg"]) == (512, "origin")  # Dream's own fields survive
    again = load_policy(tmp_path / "saved")
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    with torch.no_grad():
        assert torch.equal(again.logits(ids, mask), policy.logits(ids, mask))


@pytest.mark.parametrize("name", ["dream", "masked_lm"])
def test_left_padding_changes_nothing_for_adapters_with_positions(dirs, name):
    # Each prompt alone vs in a left-padded batch: the same logits on its real tokens.
    policy = _policy(dirs, name)
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


@remote_code
def test_sdar_reads_the_block_mask_as_true_where_a_query_may_attend(dirs):
    # SDAR's eval attention calls attention_mask.bool(): the adapter must hand it True = attend.
    # Reference: the model's own forward on a hand-built boolean (B, 1, T, T) block-causal mask.
    policy = _policy(dirs, "sdar", remote=True)
    p_ids, p_mask, c_ids = _batch(policy, 8)
    x = torch.cat([p_ids, c_ids], dim=1)
    attn = block_causal_attention_mask(p_mask, 8, 4)  # (B, T, T) bool
    pos = position_ids(torch.cat([p_mask, torch.ones_like(c_ids)], dim=1))
    allowed = (attn | torch.eye(x.size(1), dtype=torch.bool))[:, None]  # (B, 1, T, T)
    with torch.no_grad():
        out = policy.logits(x, attn, pos)
        native = policy.model(input_ids=x, attention_mask=allowed, position_ids=pos, use_cache=False).logits
        inverted = policy.model(input_ids=x, attention_mask=torch.zeros(allowed.shape).masked_fill(
            ~allowed, torch.finfo(torch.float32).min), position_ids=pos, use_cache=False).logits
    assert torch.equal(out, native)
    assert not torch.allclose(inverted, native, atol=1e-3)  # an additive mask is read inverted


@pytest.mark.parametrize("name", ["decoder", "sdar"])
@pytest.mark.parametrize("L", [8, 7])  # S = 4 divides L, or not
def test_decoder_staircase_likelihood_equals_separate_passes(dirs, name, L):
    policy = _policy(dirs, name)
    p_ids, p_mask, c_ids = _batch(policy, L)
    c_mask = completion_mask(c_ids, policy.eos_token_id)
    plan = plan_views("blockwise", Completions(c_mask, prompt_mask=p_mask), num_samples=3, block_size=4,
                      prompt_attention=policy.prompt_attention, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rows = Completions(c_mask, prompt_ids=p_ids, completion_ids=c_ids, prompt_mask=p_mask)
        one = score_views(policy, plan, rows).token.double()  # (B, L)
    sep = terms_by_separate_passes(policy, plan, p_ids, p_mask, c_ids, c_mask)
    assert plan.masked.any() and one.abs().sum() > 0
    assert torch.allclose(one, sep, atol=1e-5)


@pytest.mark.parametrize("name", ["decoder", "sdar"])
def test_decoder_blocks_do_not_see_later_blocks(dirs, name):
    policy = _policy(dirs, name)
    p_ids, p_mask, c_ids = _batch(policy, 8)
    x = torch.cat([p_ids, c_ids], dim=1)
    attn = block_causal_attention_mask(p_mask, 8, 4)
    pos = position_ids(torch.cat([p_mask, torch.ones_like(c_ids)], dim=1))
    x2 = x.clone()
    x2[:, -1] = policy.tokenizer.convert_tokens_to_ids("7")  # a token of the last block
    with torch.no_grad():
        a, b = policy.logits(x, attn, pos), policy.logits(x2, attn, pos)
    P = p_ids.size(1)
    assert torch.equal(a[:, : P + 4], b[:, : P + 4])  # prompt and block 0 unchanged
    assert not torch.equal(a[:, P + 4:], b[:, P + 4:])


@pytest.mark.parametrize("remote", [False, pytest.param(True, marks=remote_code)])
@pytest.mark.parametrize("L, remasking", [(8, "low_confidence"), (7, "random")])
def test_sdar_decodes_the_same_tokens_with_its_kv_cache(dirs, L, remasking, remote):
    # The native model's KVCache, or SDAR's own store_kv (modeling_sdar.py:545-555; the stand-in copies
    # it): the block sampler keeps the prompt's and the finished blocks' keys and feeds a step only its
    # block. Left-padded prompts of three lengths put the prompt's tail in each row's first block at a
    # different offset (S = 4 divides L, or not).
    policy = _policy(dirs, "sdar", remote=remote)
    assert callable(policy.new_cache)
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)  # (3, P)
    fed = []  # per model call: (tokens fed, whether a cache was passed)
    hook = policy.model.register_forward_pre_hook(
        lambda m, args, kw: fed.append((kw["input_ids"].numel(), kw.get("past_key_values") is not None)),
        with_kwargs=True)
    out = {}
    for cached in (True, False):
        fed.clear()
        sampling = SamplingConfig(gen_length=L, steps=L, temperature=1.0, remasking=remasking, kv_cache=cached)
        with torch.no_grad():
            out[cached] = generate(policy, ids, mask, sampling, record_logprob=True,
                                   generator=[torch.Generator().manual_seed(i) for i in range(3)])
        out[cached, "fed"], out[cached, "cached calls"] = sum(n for n, _ in fed), sum(c for _, c in fed)
        assert out[cached, "cached calls"] in (0, len(fed))
    hook.remove()
    assert out[True, "cached calls"] > 0 == out[False, "cached calls"]
    assert out[True, "fed"] < out[False, "fed"]  # only the block (and the prompt once) per call
    assert torch.equal(out[True].completion_ids, out[False].completion_ids)
    assert torch.equal(out[True].unmask_step, out[False].unmask_step)
    # the same distributions up to rounding (the keys summed in another order; measured: 7e-7)
    assert torch.allclose(out[True].token_logprob, out[False].token_logprob, atol=1e-5)
    assert (out[True].completion_ids != policy.pad_token_id).sum() > 3  # more than an early EOS


def test_a_decoder_without_store_kv_has_no_cache(dirs):
    # transformers' own decoders append to any cache they are given: the adapter offers none, and the
    # block sampler recomputes the prefix for them.
    policy = _policy(dirs, "decoder")
    assert not hasattr(policy, "new_cache")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="keeps no KV cache"):
        policy.logits(ids, torch.ones(1, 4, 4, dtype=torch.bool), torch.arange(4)[None], cache=object())


def test_the_decoders_prompt_attention_can_be_named_and_is_saved(dirs, tmp_path):
    # sequence_blocks by default (SDAR's); model.prompt_attention names another, and a saved
    # policy keeps it. Full-attention adapters have no prompt blocks to choose.
    policy = _policy(dirs, "sdar", prompt_attention="prompt_blocks")
    assert policy.prompt_attention == "prompt_blocks"
    policy.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "stabledrl_adapter.json").read_text())
    assert saved["prompt_attention"] == "prompt_blocks"
    assert load_policy(tmp_path / "saved").prompt_attention == "prompt_blocks"
    assert load_policy(ModelConfig(path=str(tmp_path / "saved"), prompt_attention="sequence_blocks")).prompt_attention \
        == "sequence_blocks"
    with pytest.raises(ValueError, match="prompt_attention is for the decoder and sdar adapters"):
        ModelConfig(path=str(dirs["llada"]), adapter="llada", prompt_attention="prompt_blocks")
    with pytest.raises(ValueError, match="prompt_attention is for block models"):
        HFPolicy(policy.model, policy.tokenizer, "masked_lm", 1, prompt_attention="sequence_blocks")


def test_sdar_prompts_start_without_bos(dirs):
    # SDAR's (Qwen's) tokenizer has no BOS: the prompt is its own tokens, left-padded.
    tok = _policy(dirs, "sdar").tokenizer
    assert tok.bos_token_id is None
    ids, mask = encode_prompts(tok, ["1=1", "12=3"])
    assert ids[0].tolist() == [tok.pad_token_id] + tok.encode("1=1", add_special_tokens=False)
    assert mask[0].tolist() == [0, 1, 1, 1]


def test_sdar_completions_can_end_at_its_end_of_turn_token(dirs):
    # <|im_end|> is a special token other than the tokenizer's EOS, named as EOS by the
    # generation config: the sampler must let it be drawn, and a completion ends at it.
    policy = _policy(dirs, "sdar")
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end != policy.eos_token_id
    ids, mask = encode_prompts(policy.tokenizer, ["1,2=3"] * 256)
    out = generate(policy, ids, mask, SamplingConfig(gen_length=4, temperature=1.0, remasking="random"),
                   generator=torch.Generator().manual_seed(0))
    # ~1,000 draws from a near-uniform distribution over 29 tokens: never drawing <|im_end|>
    # (if it were allowed) has probability about e^-30.
    ends = out.completion_ids == im_end  # (B, L)
    assert ends.any()
    first = ends.float().argmax(1)
    for b in ends.any(1).nonzero().squeeze(1).tolist():
        j = int(first[b])
        assert out.completion_mask[b].tolist() == [True] * (j + 1) + [False] * (3 - j)
        assert (out.completion_ids[b, j + 1:] == policy.pad_token_id).all()
    assert not (out.completion_ids == policy.mask_token_id).any()


@remote_code
def test_sdar_code_loads_in_a_fresh_process(dirs):
    # SDAR's file imports transformers.utils.LossKwargs, gone since transformers 4.56: the
    # adapter installs the shim before loading (a fresh process, where nothing else has).
    out = run_fresh("from stabledrl.models import ModelConfig, load_policy; "
                    f"p = load_policy(ModelConfig(path={str(dirs['sdar'])!r}, trust_remote_code=True)); "
                    "print(p.adapter, p.block_size, p.native)")
    assert out.split()[-3:] == ["sdar", "4", "False"]


def test_a_missing_or_colliding_mask_token_is_a_start_up_error(dirs, tmp_path):
    shutil.copytree(dirs["llada"], tmp_path / "llada")
    cfg_file = tmp_path / "llada" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("mask_token_id")  # neither the config nor the tokenizer names it now
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="126336"):  # LLaDA's own id is named in the message
        load_policy(ModelConfig(path=str(tmp_path / "llada")))
    with pytest.raises(ValueError, match="equals pad_token_id"):
        _policy(dirs, "masked_lm", mask_token_id=0)
    with pytest.raises(ValueError, match="block_size"):
        load_policy(ModelConfig(path=str(dirs["decoder"]), adapter="decoder"))
    with pytest.raises(ValueError, match="model.adapter"):  # a Llama checkpoint is not guessed to be anything
        load_policy(ModelConfig(path=str(dirs["decoder"])))


@pytest.mark.parametrize("name", ["llada", "dream", "sdar", "masked_lm", "decoder"])
def test_a_two_step_rl_run_trains_every_adapter(dirs, tmp_path, name):
    adapter = ADAPTER_OF[name]
    model = {"path": str(dirs[name]), "adapter": "auto" if name == "sdar" else adapter}
    if name == "decoder":
        model["block_size"] = 4
    method = "blockwise" if adapter in BLOCK_ADAPTERS else "mc"
    cfg = load_config(TrainConfig, {
        "model": model, "output_dir": str(tmp_path / "run"), "task": {"name": "sudoku"}, "steps": 2,
        "prompts_per_step": 2, "group_size": 4, "mu": 1, "lr": 1e-3, "eval_n": 2, "save_every": 2,
        "zero_variance_groups": "keep", "estimator": {"method": method, "num_samples": 2}})
    run_train(cfg, progress=False)
    before = load_file(dirs[name] / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in rows) == 2
    # The run's final model loads again with its adapter, mask token, block size and native code.
    again = load_policy(tmp_path / "run" / "final")
    mask_id = SDAR_SPECIALS.index("<|MASK|>") if name == "sdar" else 1
    assert (again.adapter, again.mask_token_id, again.block_size) == (adapter, mask_id,
                                                                       4 if adapter in BLOCK_ADAPTERS else None)
    assert again.native == (name in ("llada", "dream", "sdar")) and not again.trust_remote_code
    assert json.loads((tmp_path / "run" / "final" / "stabledrl_adapter.json").read_text())["trust_remote_code"] is False


def test_eval_reads_a_family_natively_unless_told_to_run_its_code(dirs, tmp_path, capsys):
    args = ["eval", "--model", str(dirs["sdar"]), "--task", "sudoku", "--n", "2", "--device", "cpu",
            "--out", str(tmp_path / "eval.json")]
    assert main(args + ["--no-trust-remote-code"]) == 0  # stabledrl's own SDAR
    assert json.loads((tmp_path / "eval.json").read_text())["n"] == 2
    if int(transformers.__version__.split(".")[0]) >= 5:  # the published file is refused in one line
        assert main(args + ["--trust-remote-code"]) == 2
        assert "drop model.trust_remote_code" in capsys.readouterr().err
    else:
        assert main(args + ["--trust-remote-code"]) == 0
