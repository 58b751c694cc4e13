import json
import weakref
from pathlib import Path

import pytest
import torch

from stabledrl.models import KVCache, TinyDiffusionConfig, TinyDiffusionLM, TinyPolicy, load_policy
from tests.conftest import bf16_twin, make_tiny_policy


def test_save_load_gives_identical_logits(tmp_path):
    policy = make_tiny_policy(seed=3)
    x = torch.randint(5, len(policy.tokenizer), (3, 12))
    am = torch.ones_like(x)
    am[0, :4] = 0
    before = policy.logits(x, am)
    policy.save(tmp_path)
    loaded = load_policy(tmp_path)
    assert torch.equal(loaded.logits(x, am), before)
    assert loaded.mask_token_id == policy.mask_token_id
    assert loaded.tokenizer.encode("1+2", add_special_tokens=False) == policy.tokenizer.encode("1+2", add_special_tokens=False)


def test_left_padding_does_not_change_real_token_logits():
    # Positions are counted over real tokens and padding keys are masked, so a prompt
    # padded on the left must give the same logits as the same prompt alone.
    policy = make_tiny_policy(seed=1)
    x = torch.randint(5, len(policy.tokenizer), (1, 7))
    alone = policy.logits(x, torch.ones_like(x))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], dim=1)
    am = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(x)], dim=1)
    out = policy.logits(padded, am)
    assert torch.allclose(out[:, 5:], alone, atol=1e-5)
    assert torch.isfinite(out).all()  # padding rows are finite, not NaN


def test_full_attention_is_bidirectional():
    policy = make_tiny_policy(seed=2)
    x = torch.randint(5, len(policy.tokenizer), (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] - 4) % (len(policy.tokenizer) - 5) + 5  # change only the last token
    assert not torch.allclose(policy.logits(x)[0, 0], policy.logits(y)[0, 0])


def test_four_d_boolean_mask_matches_key_padding_mask():
    policy = make_tiny_policy(seed=4)
    x = torch.randint(5, len(policy.tokenizer), (2, 6))
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    four_d = am.bool()[:, None, :].expand(2, 6, 6)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    assert torch.allclose(policy.logits(x, am), policy.logits(x, four_d, pos), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "divisible"),
        (dict(hidden_size=18, num_attention_heads=6), "even"),
        (dict(attention_kind="sparse"), "attention_kind"),
        (dict(attention_kind="block"), "block_size"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TinyDiffusionConfig(**kwargs)


def test_config_takes_its_fields_as_keywords_and_round_trips_through_json(tmp_path):
    cfg = TinyDiffusionConfig(vocab_size=40, hidden_size=16, num_attention_heads=2, attention_kind="block",
                              block_size=4, mask_token_id=3, pad_token_id=0, eos_token_id=2, tie_word_embeddings=True)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.block_size) == (40, 16, 2, 4)
    assert (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, getattr(cfg, "bos_token_id", None)) == (3, 0, 2, None)
    assert cfg.tie_word_embeddings is True
    # unset fields take their defaults; intermediate_size defaults to 4 * hidden_size
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.rope_theta, cfg.rms_norm_eps) == (4, 64, 10000.0, 1e-6)
    assert TinyDiffusionConfig().tie_word_embeddings is False
    cfg.save_pretrained(tmp_path)
    loaded = TinyDiffusionConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("name", ["countdown-tiny", "countdown-tiny-block", "sudoku-tiny"])
def test_the_shipped_configs_load_with_their_values(name):
    path = Path(__file__).resolve().parents[2] / "checkpoints" / name
    written = json.loads((path / "config.json").read_text())
    loaded = TinyDiffusionConfig.from_pretrained(path).to_dict()
    assert {k: loaded[k] for k in written if k != "transformers_version"} == {
        k: v for k, v in written.items() if k != "transformers_version"}


def test_policy_requires_distinct_mask_and_pad(tiny_policy):
    cfg = TinyDiffusionConfig(vocab_size=24, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              mask_token_id=tiny_policy.pad_token_id)
    with pytest.raises(ValueError, match="equals pad_token_id"):
        TinyPolicy(TinyDiffusionLM(cfg), tiny_policy.tokenizer)


def test_load_policy_rejects_a_directory_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(tmp_path)


def test_block_model_refuses_a_mask_that_cannot_say_where_blocks_are():
    # A 2-D key-padding mask (or none) would let every token see later blocks.
    policy = make_tiny_policy(attention_kind="block", block_size=2)
    x = torch.randint(5, len(policy.tokenizer), (1, 6))
    for am in (None, torch.ones_like(x)):
        with pytest.raises(ValueError, match="block_causal_attention_mask"):
            policy.logits(x, am)
    # A boolean mask says who sees whom, not where tokens sit (ỹ repeats y's positions).
    with pytest.raises(ValueError, match="staircase_position_ids"):
        policy.logits(x, torch.ones((1, 6, 6), dtype=torch.bool))


def test_kv_cache_gives_the_same_logits_as_the_full_pass():
    # Prefix (left-padded) cached, then a 3-token chunk attending to it and itself: the
    # chunk's logits equal those of one pass over prefix + chunk with the same mask.
    policy = make_tiny_policy(seed=5)
    B, Tp, T = 2, 6, 3
    x = torch.randint(5, len(policy.tokenizer), (B, Tp + T))
    keys = torch.ones(B, Tp + T, dtype=torch.bool)
    keys[0, :2] = False  # row 0 left-padded by two
    full_mask = keys[:, None, :].expand(B, Tp + T, Tp + T).clone()
    full_mask[:, :Tp, Tp:] = False  # the prefix does not see the chunk (as when it was cached)
    pos = (keys.long().cumsum(-1) - 1).clamp(min=0)
    reference = policy.logits(x, full_mask, pos)
    cache = policy.new_cache()
    prefix = policy.logits(x[:, :Tp], full_mask[:, :Tp, :Tp], pos[:, :Tp], cache=cache, extend_cache=True)
    assert len(cache) == Tp
    chunk = policy.logits(x[:, Tp:], full_mask[:, Tp:], pos[:, Tp:], cache=cache)
    assert len(cache) == Tp  # not extended
    assert torch.allclose(prefix[0, 2:], reference[0, 2:Tp], atol=1e-5)
    assert torch.allclose(chunk, reference[:, Tp:], atol=1e-5)
    policy.logits(x[:, Tp:], full_mask[:, Tp:], pos[:, Tp:], cache=cache, extend_cache=True)
    assert len(cache) == Tp + T


def test_a_cache_written_in_place_gives_the_logits_of_the_joined_one():
    # A whole left-padded sequence cached; its last 3 columns fed again, changed. Written in place
    # (write_at) they overwrite their own keys and attend to all 9 columns under the sequence's key
    # padding: the logits of the kept 6 columns' keys joined to the fed ones' (the usual cache),
    # in the same tensors (no copy), and the fed columns' new keys are in them after the call.
    policy = make_tiny_policy(seed=6)
    B, T, F = 2, 9, 3
    x = torch.randint(5, len(policy.tokenizer), (B, T))
    keys = torch.ones(B, T, dtype=torch.long)
    keys[0, :2] = 0  # row 0 left-padded by two
    pos = (keys.cumsum(-1) - 1).clamp(min=0)
    cache = policy.new_cache()
    with torch.no_grad():
        policy.logits(x, keys, pos, cache=cache, extend_cache=True)
        joined = cache.select(cols=torch.arange(T - F))
        fed = torch.randint(5, len(policy.tokenizer), (B, F))
        want = policy.logits(fed, keys, pos[:, T - F :], cache=joined)
        ptrs = [t.data_ptr() for layer in cache.layers for t in layer]
        before = cache.layers[0][0][:, :, T - F :].clone()  # layer 0's keys: of each column's token alone
        cache.write_at = slice(T - F, T)
        got = policy.logits(fed, keys, pos[:, T - F :], cache=cache)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        assert [t.data_ptr() for layer in cache.layers for t in layer] == ptrs and len(cache) == T
        fresh = policy.new_cache()
        policy.logits(torch.cat([x[:, : T - F], fed], 1), keys, pos, cache=fresh, extend_cache=True)
        now, new = cache.layers[0][0][:, :, T - F :], fresh.layers[0][0][:, :, T - F :]
        assert (now - new).abs().max() <= 1e-5 * new.abs().max() < (before - new).abs().max()
        with pytest.raises(ValueError, match="not extended"):
            policy.logits(fed, keys, pos[:, T - F :], cache=cache, extend_cache=True)
        with pytest.raises(ValueError, match="2 tokens were fed"):
            policy.logits(fed[:, :2], keys, pos[:, T - 2 :], cache=cache)
        with pytest.raises(ValueError, match="Tc = 9 columns"):
            policy.logits(fed, torch.ones(B, T + F, dtype=torch.long), pos[:, T - F :], cache=cache)


@pytest.mark.parametrize("extend", [False, True])
def test_a_forward_keeps_layer_keys_and_values_only_for_the_cache(extend):
    # A block returns its (k, v) (k the RoPE'd keys, v a view of the block's whole qkv output) only
    # for a cache: without extend_cache none (held to the forward's end they would keep every
    # layer's at once; and FSDP2 warns of a layer returning a view); with it the cache holds every layer's.
    policy = make_tiny_policy(seed=3, num_hidden_layers=3)
    x = torch.randint(5, len(policy.tokenizer), (2, 7))
    mask, pos = torch.ones_like(x), torch.arange(7).expand(2, 7)
    refs, alive_at_head = [], []

    def watch(block, args, out):  # weak references to the storages of the layer's k and v
        refs.append([] if out[1] is None else [weakref.ref(t.untyped_storage()) for t in out[1]])

    for block in policy.model.blocks:
        block.register_forward_hook(watch)
    policy.model.lm_head.register_forward_pre_hook(
        lambda *a: alive_at_head.extend(r() is not None for layer in refs for r in layer))
    cache = policy.new_cache()
    with torch.no_grad():
        policy.logits(x, mask, pos, cache=cache, extend_cache=extend)
    assert alive_at_head == [True] * (6 if extend else 0)  # 3 layers × (k, v)
    assert len(cache) == (7 if extend else 0)


@pytest.mark.parametrize("kw", [{}, dict(attention_kind="block", block_size=3)])
def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_each_block(tmp_path, kw):
    # model.gradient_checkpointing: each block's activations are recomputed in the backward
    # (so block 0 runs twice per forward and backward), in eval mode too, where the RL
    # update runs; the gradients are those of the plain model, bit for bit. Under no_grad
    # nothing is recomputed.
    from stabledrl.models import ModelConfig
    from stabledrl.models.attention import block_causal_attention_mask

    make_tiny_policy(seed=4, **kw).save(tmp_path / "m")
    x = torch.randint(5, 20, (3, 12))
    mask = block_causal_attention_mask(torch.ones(3, 6, dtype=torch.long), 6, 3) if kw else torch.ones_like(x)
    pos = torch.arange(12).expand(3, 12)
    grads, calls = [], []
    for ckpt in (False, True):
        policy = load_policy(ModelConfig(path=str(tmp_path / "m"), gradient_checkpointing=ckpt))
        assert not policy.model.training
        n = [0]
        policy.model.blocks[0].register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        policy.logits(x, mask, pos).float().square().mean().backward()
        grads.append([p.grad.clone() for p in policy.model.parameters()])
        with torch.no_grad():
            policy.logits(x, mask, pos)
        calls.append(n[0])
    assert calls == [2, 3]  # plain: 1 + 1 (no_grad); checkpointed: 2 + 1
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_keeping_some_rows_of_a_cache_is_selecting_them():
    cache = KVCache()
    cache.write_at = slice(2, 4)
    cache.layers = [(torch.randn(4, 2, 6, 3), torch.randn(4, 2, 6, 3)) for _ in range(3)]
    rows = torch.tensor([3, 1])
    want = cache.select(rows=rows)
    cache.keep_rows(rows)
    assert cache.write_at == slice(2, 4) and len(cache.layers) == 3
    assert all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(cache.layers, want.layers))


def test_under_fsdps_bf16_mixed_precision_the_logits_are_the_bf16_models(fsdp_bf16):
    # RoPE in float32 with float32 tables, though FSDP casts a block's floating-point inputs to bf16
    policy = make_tiny_policy(seed=3)
    model = policy.model
    reference = bf16_twin(model)
    wrapped = fsdp_bf16(model, model.blocks)
    ids = torch.randint(5, len(policy.tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(9) + 40).expand(2, 9)
    with torch.no_grad():
        want = reference(ids, attention_mask=torch.ones(2, 9), position_ids=positions).logits
        got = wrapped(ids, attention_mask=torch.ones(2, 9), position_ids=positions).logits
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
