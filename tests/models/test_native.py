"""stabledrl's own LLaDA, Dream and SDAR (`stabledrl.models.native`) against the published code.

The reference is each family's stand-in (`fake_dllm.py`: the published file's names, arithmetic
and quirks, each with its file and line), built from the same config.json and weights and run
one row at a time, unpadded, as every copy of the published files agrees on; SDAR under its
own block-causal mask. benchmarks/published_parity.py runs the same comparison against the
published files themselves (docs/scale-out.md, "Native models").
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from stabledrl.data import encode_prompts, position_ids
from stabledrl.models import ModelConfig, load_policy
from stabledrl.models.attention import block_causal_attention_mask
from stabledrl.models.native import NATIVE_MODELS, LLaDAConfig, architecture
from stabledrl.sampling import SamplingConfig, _ApproxCache, generate, row_generators
from tests.conftest import CopiedCache, DispatchedOps, bf16_twin, cached_block_inputs, make_tiny_policy
from tests.models.test_adapters import dirs, fake_dllm, remote_code, run_fresh  # noqa: F401 (the fixture)

PROMPTS = ["3,5,7=22", "12,4,6=9", "1=1", "8,8=16"]  # three padding counts: 0, 1 and 5 columns
STAND_IN = {"llada": (fake_dllm.LLaDAConfig, fake_dllm.LLaDAModelLM), "dream": (fake_dllm.DreamConfig, fake_dllm.DreamModel),
            "sdar": (fake_dllm.SDARConfig, fake_dllm.SDARForCausalLM)}


def _stand_in(path):
    """The family's published-code stand-in with the checkpoint's config and weights, loaded by
    hand (LLaDA's published class does not survive transformers 5's from_pretrained)."""
    config = json.loads((path / "config.json").read_text())
    config_cls, model_cls = STAND_IN[str(config["model_type"]).lower()]
    model = model_cls(config_cls(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")}))
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return model.eval()


def _padded(policy):
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)  # (4, P) left-padded
    assert len(set((mask == 0).sum(1).tolist())) == 3  # three padding counts
    return ids, mask


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_each_family_loads_natively_under_its_published_names(dirs, family):
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    assert policy.native and type(policy.model) is NATIVE_MODELS[family]
    saved = load_file(dirs[family] / "model.safetensors")
    ours = policy.model.state_dict()
    assert set(saved) == set(ours)  # the published key names, no conversion
    assert all(torch.equal(saved[k], ours[k]) for k in saved)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_padded_batch_logits_equal_the_published_code_row_by_row(dirs, family):
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    reference = _stand_in(dirs[family])
    ids, mask = _padded(policy)
    pos = position_ids(mask)
    with torch.no_grad():
        if family == "sdar":  # SDAR's blocks, counted from each row's first token
            attn = block_causal_attention_mask(mask, 0, policy.block_size, "sequence_blocks")  # (B, P, P)
            ours = policy.model(ids, attention_mask=attn, position_ids=pos).logits  # (B, P, V)
        else:
            ours = policy.model(ids, attention_mask=mask).logits  # (B, P, V), the model's own columns
        for b in range(ids.size(0)):
            real = ids[b:b + 1, mask[b].bool()]  # (1, n)
            n = real.size(1)
            if family == "sdar":
                blocks = torch.arange(n) // policy.block_size
                own = (blocks[None, :] <= blocks[:, None])[None, None]  # (1, 1, n, n) as SDAR's sampler builds it
                theirs = reference(input_ids=real, attention_mask=own, position_ids=torch.arange(n)[None],
                                   use_cache=False).logits
            else:
                theirs = reference(input_ids=real, use_cache=False).logits  # (1, n, V): no mask, every copy's full attention
            assert (ours[b, -n:] - theirs[0]).abs().max() <= 1e-4, b


def test_one_forward_for_a_batch_of_three_padding_counts(dirs):
    policy = load_policy(ModelConfig(path=str(dirs["llada"])))
    ids, mask = _padded(policy)
    calls = []
    policy.model.register_forward_pre_hook(lambda *a: calls.append(1))
    policy.logits(ids, mask, position_ids(mask)).sum().backward()
    assert len(calls) == 1


def test_dreams_shifted_logits_are_moved_back_by_one(dirs):
    policy = load_policy(ModelConfig(path=str(dirs["dream"])))
    assert policy.shift_logits
    ids, mask = _padded(policy)
    with torch.no_grad():
        out = policy.logits(ids, mask, position_ids(mask))
        raw = policy.model(ids, attention_mask=mask).logits  # [:, i] predicts token i + 1
    assert torch.equal(out[:, 1:], raw[:, :-1]) and torch.equal(out[:, 0], raw[:, 0])


@pytest.mark.parametrize("family", ["llada", "dream", "tiny"])
def test_the_head_runs_on_the_asked_columns_only_with_the_same_logits(dirs, family):
    # `columns`: the sampler asks for its block's logits only; the head (Dream: on the columns
    # before, its logits predicting the next token) sees those W columns, and they are the
    # whole forward's logits there.
    policy = make_tiny_policy(seed=1) if family == "tiny" else load_policy(ModelConfig(path=str(dirs[family])))
    ids, mask = encode_prompts(policy.tokenizer, PROMPTS)
    pos = position_ids(mask)
    head = policy.model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    with torch.no_grad():
        full = policy.logits(ids, mask, pos)
        for cols in (slice(3, 7), slice(1, None), slice(0, 2)):
            part = policy.logits(ids, mask, pos, columns=cols)
            assert part.shape == full[:, cols].shape
            assert (part - full[:, cols]).abs().max() <= 1e-5 * full.abs().max()
    hook.remove()
    want = ids.size(1) if family == "dream" else 2  # Dream's slice(0, 2) needs column -1: the whole row, then cut
    assert seen == [ids.size(1), 4, ids.size(1) - 1, want]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_a_refreshed_cached_step_is_the_uncached_step(dirs, family, approx_cache):
    # Fast-dLLM's caches on the native models: a block's first call is the uncached call (bit for
    # bit), and fed the tokens they were built from, later calls give the uncached logits (Dream: the
    # column before the block fed too, its logits predicting the block's first slot).
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    ids, mask = _padded(policy)
    B, P = ids.shape
    L, lo, hi = 12, 4, 8
    x, attn, pos = cached_block_inputs(ids, mask, L, 20, seed=0)
    rows = torch.arange(B)
    with torch.no_grad():
        want = policy.logits(x, attn, pos)[:, P + lo : P + hi]  # (B, 4, V)
        cache = _ApproxCache(policy, SamplingConfig(approx_cache=approx_cache), P, lo, hi, attn, pos)
        assert torch.equal(cache.logits(x, rows), want)
        assert (cache.logits(x, rows) - want).abs().max() <= 1e-4 * want.abs().max()
        some = torch.tensor([0, 2])  # rows that finished the block leave the cache
        assert (cache.logits(x[some], some) - want[some]).abs().max() <= 1e-4 * want.abs().max()
        x2 = x.clone()
        x2[:, P + lo + 1] = policy.mask_token_id  # the block changes: the kept keys go stale
        stale = cache.logits(x2[some], some)
        assert (stale - policy.logits(x2, attn, pos)[some, P + lo : P + hi]).abs().max() > 1e-6


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("approx_cache", ["prefix", "dual"])
def test_the_cache_written_in_place_gives_the_copied_caches_logits(dirs, family, approx_cache):
    # The native models write the fed columns' keys into the first call's (Dream's fed run starting
    # a column before the block): the copied cache's logits with the block changed (the kept keys
    # stale), left-padded rows, rows leaving the block (for good).
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    assert policy.cache_in_place
    ids, mask = _padded(policy)
    B, P = ids.shape
    L, lo, hi = 12, 4, 8
    x, attn, pos = cached_block_inputs(ids, mask, L, 20, seed=1)
    caches = [_ApproxCache(p, SamplingConfig(approx_cache=approx_cache), P, lo, hi, attn, pos) for p in (policy, CopiedCache(policy))]
    x2 = x.clone()
    x2[:, P + lo + 1] = policy.mask_token_id
    x3 = x2.clone()
    x3[:, P + hi + 1] = policy.mask_token_id
    rows, some, fewer = torch.arange(B), torch.tensor([1, 3]), torch.tensor([3])
    with torch.no_grad():
        for inputs, active in ((x, rows), (x2, rows), (x3, rows), (x3[some], some), (x2[fewer], fewer)):
            got, want = (c.logits(inputs, active) for c in caches)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_dual_cache_with_one_step_per_block_samples_the_exact_tokens(dirs, family):
    # Every call is then a block's refresh: the cached sampler is the uncached one.
    policy = load_policy(ModelConfig(path=str(dirs[family])))
    ids, mask = _padded(policy)
    common = dict(gen_length=8, steps=4, block_length=2, temperature=1.0, noise="counter")
    want = generate(policy, ids, mask, SamplingConfig(**common), generator=row_generators("d", 0, 4))
    got = generate(policy, ids, mask, SamplingConfig(**common, approx_cache="dual"), generator=row_generators("d", 0, 4))
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.unmask_step, want.unmask_step)
    # threshold decoding on the cache: a confidence above 1/V always clears 0.01, so each block takes one call
    fast = generate(policy, ids, mask, SamplingConfig(**{**common, "steps": 8}, approx_cache="dual", threshold=0.01),
                    generator=row_generators("d", 0, 4))
    assert fast.forward_passes == 4 and not (fast.completion_ids == policy.mask_token_id).any()


def test_a_saved_native_checkpoint_keeps_the_published_layout_and_loads_back(dirs, tmp_path):
    policy = load_policy(ModelConfig(path=str(dirs["dream"])))
    policy.save(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(load_file(dirs["dream"] / "model.safetensors"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "Dream" and config["auto_map"]["AutoModel"] == "fake_dllm.DreamModel"
    assert (tmp_path / "saved" / "fake_dllm.py").is_file()  # the published code travels with it
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text())["steps"] == 512
    again = load_policy(tmp_path / "saved")
    ids, mask = _padded(policy)
    with torch.no_grad():
        assert torch.equal(again.logits(ids, mask), policy.logits(ids, mask))
    # ... and the published code (the stand-in) reads the same weights to the same logits
    reference = _stand_in(tmp_path / "saved")
    with torch.no_grad():
        assert (reference(input_ids=ids[:1], use_cache=False).logits - policy.model(ids[:1]).logits).abs().max() <= 1e-4


def test_a_checkpoint_from_the_hub_points_its_auto_map_at_the_hub_repository(dirs, tmp_path):
    # no local folder to copy the published files from: transformers' "repo--module.Class" names them
    policy = load_policy(ModelConfig(path=str(dirs["llada"])))
    policy.model.config._name_or_path = "GSAI-ML/LLaDA-8B-Instruct"
    policy.save(tmp_path / "saved")
    auto_map = json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "GSAI-ML/LLaDA-8B-Instruct--fake_dllm.LLaDAModelLM"
    assert not (tmp_path / "saved" / "fake_dllm.py").exists()


@remote_code
def test_the_published_code_loads_a_native_checkpoint_through_its_auto_map(dirs, tmp_path):
    for family in ("llada", "dream", "sdar"):
        load_policy(ModelConfig(path=str(dirs[family]))).save(tmp_path / family)
        published = load_policy(ModelConfig(path=str(tmp_path / family), trust_remote_code=True))
        assert not published.native and type(published.model).__module__.endswith("fake_dllm")


def test_a_config_it_does_not_compute_is_refused_naming_the_field(dirs, tmp_path):
    shutil.copytree(dirs["llada"], tmp_path / "llada")
    config_file = tmp_path / "llada" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "block_type": "sequential"}))
    with pytest.raises(ValueError, match=r"block_type = 'sequential' is not understood.*trust_remote_code"):
        load_policy(ModelConfig(path=str(tmp_path / "llada")))
    with pytest.raises(ValueError, match="scale_logits"):
        architecture(LLaDAConfig(block_type="llama", activation_type="silu", layer_norm_type="rms", rope=True,
                                 scale_logits=True))
    with pytest.raises(ValueError, match="model_type 'dream' is not a llada checkpoint"):
        load_policy(ModelConfig(path=str(dirs["dream"]), adapter="llada"))


def test_a_native_family_loads_in_a_fresh_process_without_its_codes_imports(dirs):
    # The stand-ins' file imports flash-attn at module level, as SDAR's does: the native path never
    # imports it (no shim installed, no remote config class read for the tokenizer).
    out = run_fresh("import sys; from stabledrl.models import ModelConfig, load_policy; "
                    f"p = load_policy(ModelConfig(path={str(dirs['sdar'])!r})); "
                    "print(p.native, 'flash_attn' in sys.modules)")
    assert out.split()[-2:] == ["True", "False"]


def _small_configs() -> dict:
    from stabledrl.models.native import DreamConfig, SDARConfig

    return {"llada": LLaDAConfig(d_model=32, n_heads=2, n_layers=1, mlp_hidden_size=48, vocab_size=40, embedding_size=40,
                                 block_type="llama", activation_type="silu", layer_norm_type="rms", rope=True,
                                 weight_tying=False),
            "dream": DreamConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1),
            "sdar": SDARConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)}


def test_a_tied_head_is_the_embedding_matrix():
    # SDAR-1.7B and Qwen3's small sizes tie the head to the embedding: no weights of its own, logits h · Eᵀ
    torch.manual_seed(0)
    model = NATIVE_MODELS["sdar"](_small_configs()["sdar"]).eval()
    assert "lm_head.weight" not in model.state_dict() and model.get_output_embeddings() is None
    ids = torch.randint(0, 40, (2, 5))
    seen = {}
    model.model.norm.register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones(2, 5, 5, dtype=torch.bool),
                       position_ids=torch.arange(5).expand(2, 5)).logits
    assert torch.allclose(logits, seen["h"] @ model.model.embed_tokens.weight.T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_every_family_runs_in_bfloat16(family):
    # the recipes' compute dtype: finite bfloat16 logits (RoPE and the norms in float32 inside)
    model = NATIVE_MODELS[family](_small_configs()[family]).to(torch.bfloat16).eval()
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, 5, dtype=torch.bool) if family == "sdar" else torch.ones(2, 5)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=torch.arange(5).expand(2, 5)).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_under_fsdps_bf16_mixed_precision_the_numbers_are_the_bf16_models(fsdp_bf16, family):
    # The recipes' FSDP (accelerate, mixed_precision bf16) casts every floating-point tensor a layer is
    # called with to bf16; LLaDA rotates in float32 with tables made in float32 (its published block
    # makes them inside itself): they reach the layers in float32, the numbers of the bf16 model, and
    # the gradients too, through gradient checkpointing's recomputation.
    config = _small_configs()[family]
    config.update({"n_layers" if family == "llada" else "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = NATIVE_MODELS[family](config).eval()
    reference = bf16_twin(model)  # float32 master weights that are bf16 numbers, and the bf16 model
    layers = model.model.transformer.blocks if family == "llada" else model.model.layers
    wrapped = fsdp_bf16(model, layers)
    T = 9
    ids = torch.randint(0, 40, (2, T), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(T) + 300).expand(2, T)  # where a table's bf16 rounding moves the rotation
    mask = torch.ones(2, T, T, dtype=torch.bool) if family == "sdar" else torch.ones(2, T)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = wrapped(ids, attention_mask=mask, position_ids=positions).logits
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    with warnings.catch_warnings(record=True) as seen:  # a layer returns no view (its keys only for a cache)
        warnings.simplefilter("always")
        for m in (reference, wrapped):
            m.gradient_checkpointing = True
            m(ids, attention_mask=mask, position_ids=positions).logits.float().log_softmax(-1)[..., 3].sum().backward()
    assert not [w for w in seen if "view tensor" in str(w.message)]
    for (name, p), q in zip(reference.named_parameters(), wrapped.parameters()):
        assert q.grad.dtype == torch.float32 and torch.equal(q.grad.full_tensor(), p.grad.float()), name


@pytest.mark.parametrize("in_float32", [True, False])
def test_queries_and_keys_rotate_in_one_pass_as_each_alone(in_float32):
    # One pass over both (fewer kernels) against RoPE as the published files write it, each tensor
    # alone: x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), in float32 and cast back
    # (LLaDA's rope_full_precision) or in x's dtype with the tables cast to it (Qwen2's, Qwen3's).
    from stabledrl.models.native import _rotate
    from stabledrl.models.tiny import RopeTables

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, Dh = 2, 4, 2, 5, 8
    q = torch.randn(B, T, H, Dh, generator=g).to(torch.bfloat16).transpose(1, 2)  # as the layer hands them over
    k = torch.randn(B, T, Hkv, Dh, generator=g).to(torch.bfloat16).transpose(1, 2)
    angles = (torch.arange(T) + 300.0)[None, None, :, None] * torch.rand(Dh // 2, generator=g)  # (1, 1, T, Dh/2)
    c, s = angles.cos(), angles.sin()
    cos, sin = torch.cat((c, c), -1), torch.cat((s, s), -1)

    def alone(x):
        h = x.float() if in_float32 else x
        x1, x2 = h.chunk(2, -1)
        return (h * cos.to(h.dtype) + torch.cat((-x2, x1), -1) * sin.to(h.dtype)).to(x.dtype)

    rope = RopeTables(cos, torch.cat((-s, s), -1))
    _rotate(q, k, rope, in_float32)  # a forward's first layer casts the tables where it rotates in bf16
    with DispatchedOps() as dispatched:
        got_q, got_k = _rotate(q, k, rope, in_float32)
    assert torch.equal(got_q, alone(q)) and torch.equal(got_k, alone(k))
    kernels = sum(not op.is_view for op in dispatched.ops)  # operations that compute (views excluded)
    assert kernels == (7 if in_float32 else 5)  # each tensor alone: 6 and 4 (+ 2 casts of the tables)


def test_the_key_padding_is_read_once_a_mask_and_again_after_a_change(monkeypatch):
    # the sampler's later calls of a block pass one mask: its check reads the device once (a call replayed
    # from a CUDA graph may not read it at all), again after an in-place change; inference tensors each time
    from stabledrl.models.native import _no_padding

    reads, real = [], torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda self, *a, **k: reads.append(1) or real(self, *a, **k))
    mask = torch.ones(2, 5, dtype=torch.long)
    assert _no_padding(mask) and _no_padding(mask) and len(reads) == 1
    mask[0, 0] = 0
    assert not _no_padding(mask) and len(reads) == 2
    with torch.inference_mode():
        kept = torch.ones(2, 5)
        assert _no_padding(kept) and _no_padding(kept) and len(reads) == 4
