"""benchmarks/scale.py: the memory model against hand arithmetic, the LLaDA-8B meta model's
parameter count, the live-tensor counter, and one step of the benchmark on a tiny shape."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale  # noqa: E402

TINY = scale.SHAPES["tiny"]  # V 256, d 32, 2 layers, 2 heads, I 96


def test_parameter_count_of_the_tiny_shape_by_hand():
    # per layer: q, k, v, out 4·32² = 4096; gate, up, down 3·32·96 = 9216; two norms 2·32 = 64
    # -> 13,376; two layers 26,752; embedding and head 2·256·32 = 16,384; final norm 32: 43,168
    assert scale.param_count(TINY) == 43_168
    assert sum(p.numel() for p in scale.build_model(TINY, "cpu").parameters()) == 43_168


def test_llada_8b_meta_model_has_the_published_parameter_count():
    # LLaDA-8B's config: d 4096, 32 layers, MLP 12288, vocabulary 126464, no biases, untied head.
    # per layer: 4·4096² = 67,108,864; 3·4096·12288 = 150,994,944; 2·4096 = 8,192 -> 218,112,000
    # 32 layers: 6,979,584,000; embedding and head 2·126464·4096 = 1,035,993,088; final norm 4,096
    # total 8,015,581,184, i.e. the 16,031,162,368 bytes of the checkpoint's bfloat16 safetensors / 2
    model = scale.build_model(scale.SHAPES["llada-8b"], "meta")
    assert sum(p.numel() for p in model.parameters()) == 8_015_581_184
    assert scale.param_count(scale.SHAPES["llada-8b"]) == 8_015_581_184
    assert next(model.parameters()).device.type == "meta"


def _footprint(**kw):
    return scale.Footprint(**{"prompt_length": 13, "gen_length": 11, "rows_per_call": 4, "views_per_forward": 8, **kw})


def test_resident_terms_by_hand():
    N = 43_168
    t = scale.predict_memory(TINY, _footprint(reference=True))["terms"]
    # float32 weights 4N, reference copy 4N, gradients 4N, AdamW m and v 8N
    assert (t["weights"], t["reference"], t["gradients"], t["adamw_states"]) == (4 * N, 4 * N, 4 * N, 8 * N)
    sharded = scale.predict_memory(TINY, _footprint(reference=True, shards=8))["terms"]
    # FSDP over 8 divides weights, gradients and AdamW states (43,168 / 8 = 5,396); the reference is whole
    assert (sharded["weights"], sharded["gradients"], sharded["adamw_states"]) == (4 * 5_396, 4 * 5_396, 8 * 5_396)
    assert sharded["reference"] == 4 * N


def test_lora_terms_by_hand():
    # r = 4 on qkv (32 -> 96), proj (32 -> 32), gate_up (32 -> 192), down (96 -> 32):
    # 4·(128 + 64 + 224 + 128) = 2,176 per layer, 4,352 for two
    assert scale.lora_param_count(TINY, 4) == 4_352
    t = scale.predict_memory(TINY, _footprint(lora_params=4_352, weight_bytes=2))["terms"]
    # a bfloat16 base (2 bytes per weight) and float32 adapters; gradients and AdamW only for the adapters
    assert t["weights"] == 2 * 43_168 + 4 * 4_352
    assert (t["gradients"], t["adamw_states"], t["reference"]) == (4 * 4_352, 8 * 4_352, 0)


def test_activation_bytes_by_hand():
    # T = 13 + 11 = 24 tokens, float32. Per token and layer: norms 4d = 128, qkv, RoPE'd q and
    # k, SDPA output and copy, residuals 9d = 288, MLP 4I = 384, mask row T = 24, logsumexp
    # H = 2, rsqrt 2: 828 elements = 3,312 bytes; two layers 6,624. Once per token: embedding
    # d, cos and sin Dh = 16, final norm and head input 2d: 112 elements = 448 bytes.
    # 24 · (6,624 + 448) = 169,728, plus the log-softmax 4·11·256 = 11,264: 180,992 per view
    assert scale.activation_bytes(TINY, _footprint()) == 180_992
    t = scale.predict_memory(TINY, _footprint())["terms"]
    assert t["activations"] == 8 * 180_992


def test_scoring_terms_by_hand():
    # 8 views of T = 24 tokens (L = 11 scored), V = 256, float32: the larger of a layer's
    # temporaries, 8·24·(4·96 + 3·32)·4 = 368,640, the head's, 8·24·(3·32 + 256)·4 = 270,336,
    # and the logits with the log-softmax over L and the copy of its strided input (CUDA),
    # 8·256·(4·24 + 8·11) = 376,832
    t = scale.predict_memory(TINY, _footprint())["terms"]
    assert t["scoring_transient"] == 376_832
    # Under autocast the prepared model's bfloat16 logits (2 bytes) get a float32 copy (4)
    # beside them: 8·24·256·6 = 294,912. With 2 completion slots of 24 that copy is the largest:
    # the log-softmax then takes 8·256·(4·24 + 8·2) = 229,376 and a layer 8·24·(4·96 + 3·32)·2 = 184,320
    t = scale.predict_memory(TINY, _footprint(autocast=True, prompt_length=22, gen_length=2))["terms"]
    assert t["scoring_transient"] == 294_912


def test_the_prepared_model_returns_float32_logits_made_beside_the_bfloat16_ones():
    # What the scoring term reads: under mixed_precision bf16 accelerate converts the
    # outputs to float32 after autocast has freed its casts, so with a vocabulary large
    # enough for the head to dominate (V = 2048, one layer) a forward without a graph peaks
    # at n·T·V·(2 + 4) bytes: 8·24·2048·6 = 2,359,296.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from stabledrl.models.tiny import rope_frequencies

    shape = dataclasses.replace(TINY, vocab_size=2048, num_hidden_layers=1)
    AcceleratorState._reset_state()
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(scale.build_model(shape, "cpu"))
    ids = torch.randint(5, 2048, (8, 24), generator=torch.Generator().manual_seed(0))  # (n, T)
    # RoPE's frequencies are made once per process and device (kept, like a buffer): made here, counted here
    freqs = rope_frequencies(float(shape.rope_theta), shape.hidden_size // shape.num_attention_heads, torch.device("cpu"))
    with torch.no_grad(), scale.LiveBytes() as live:
        for t in (*model.parameters(), *model.buffers(), ids, freqs):
            live.add(t)
        start = live.live
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    assert max(live.peaks.values()) - start == 2_359_296


def test_live_bytes_counts_a_saved_tensor_until_the_backward_frees_it():
    x = torch.randn(1000, requires_grad=True)
    with scale.LiveBytes() as live:
        y = x.exp()  # 1000 float32: 4,000 bytes, kept by exp's backward
        z = y.sum()
        del y
        assert live.live == 4_000 + 4  # the graph holds exp's output; z is one float
        z.backward()
        # the saved output is freed; x.grad (4,000 bytes) was made by the backward
        assert live.live == 4 + 4_000
    assert live.peaks["start"] >= 8_000


def test_a_forward_without_a_graph_keeps_nothing_per_layer():
    # The memory model gives a forward without a graph no term per layer: the peak of the
    # tensors it makes is one layer's temporaries or the head's, whatever the depth.
    # (TinyDiffusionLM used to keep every layer's qkv output and RoPE'd k to its end: 4 layers
    # then peaked 3 · (96 + 32) · 4 bytes per token, 147,456 for 4 × 24 tokens, above 1 layer.)
    ids = torch.randint(5, TINY.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))  # (B, T)
    made = []
    for layers in (1, 4):
        model = scale.build_model(dataclasses.replace(TINY, num_hidden_layers=layers), "cpu")
        with torch.no_grad(), scale.LiveBytes() as live:
            for t in (*model.parameters(), *model.buffers(), ids):  # counted before, as the benchmark does
                live.add(t)
            start = live.live
            model(ids)
        made.append(max(live.peaks.values()) - start)
    assert made[0] == made[1] > 0


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("precision", ["no", "bf16"])  # bf16: autocast (and a bfloat16 LoRA base), as at scale
def test_a_step_on_the_tiny_shape_measures_what_the_model_predicts(mode, precision):
    pre = scale.preset("countdown", ["prompts_per_step=2", "group_size=2", f"mixed_precision={precision}"])
    lora = scale.LoraSettings(r=4, alpha=8.0)
    base = torch.bfloat16 if precision == "bf16" else torch.float32
    res = scale.run_mode("tiny", pre, mode, "cpu", repeats=1, lora=lora, lora_base_dtype=base)
    assert res["counts"]["rows"] == 4 and res["counts"]["views_trained"] == 4 * 2  # K = 2 views a row
    assert res["rollout_tokens_per_s"] > 0 and res["scoring_views_per_s"] > 0 and res["update_views_per_s"] > 0
    assert set(res["split"]) == {"rollout", "scoring", "update", "optimizer"}
    assert res["trainable"] == (43_168 if mode == "full" else 4_352)
    mem = res["memory"]
    # measured on CPU as live tensor bytes: the model is within 20% of it
    assert 0.8 < mem["ratio_predicted_over_measured"] < 1.2
    assert mem["measured_phases"]["update"] > mem["measured_phases"]["start"]


def test_largest_finds_the_last_size_that_fits_by_bisection():
    assert scale._largest(lambda k: k <= 7, 10) == 7
    assert scale._largest(lambda k: True, 10) == 10
    assert scale._largest(lambda k: False, 10) == 0


def test_checkpointing_terms_by_hand():
    # A layer keeps only its input: d = 32 float32 values per token (128 bytes); two layers 256.
    # Once per token as without checkpointing: 448 bytes. 24 · (256 + 448) = 16,896, plus the
    # log-softmax 11,264: 28,160 per view
    f = _footprint(checkpointing=True)
    assert scale.activation_bytes(TINY, f) == 28_160
    t = scale.predict_memory(TINY, f)["terms"]
    assert t["activations"] == 8 * 28_160
    # one layer recomputed (3,312 bytes a token, as in test_activation_bytes_by_hand) with the residual's
    # gradient in and out (2 · 4 · 32 = 256): 8 views · 24 tokens · 3,568 = 685,056
    assert t["recompute"] == 685_056
    assert scale.predict_memory(TINY, _footprint())["terms"]["recompute"] == 0


def test_counter_noise_rollout_term_by_hand():
    # 4 rows of T = 24, V = 256, float32. The previous step's logits 4·24·256·4 = 98,304 are held
    # while the next forward's largest temporaries run, 4·24·(4·96 + 3·32)·4 = 184,320: 282,624,
    # above the draw: the logits and 7 float32 (N, V) over N = 4 rows × 4 block columns,
    # 98,304 + 28·4·4·256 = 212,992
    t = scale.predict_memory(TINY, _footprint(noise="counter", block_length=4))["terms"]
    assert t["rollout_transient"] == 282_624


def test_block_models_score_the_staircase_and_cache_keys():
    # S = 4: the staircase [q ; y ; q̃ ; ỹ] is 13 + 2·11 + 4 = 39 tokens; the rollout feeds 4 columns
    assert scale.scored_length(_footprint(block_size=4)) == 39
    assert scale.scored_length(_footprint()) == 24
    t = scale.predict_memory(TINY, _footprint(noise="counter", block_size=4))["terms"]
    # cache 2 · 4 rows · 2 layers · 24 positions · 32 · 4 bytes = 49,152; held logits 4·4·256·4 = 16,384;
    # the forward over 4 columns 4·4·1,920 = 30,720; the draw 16,384 + 28·4·4·256 = 131,072
    assert t["rollout_transient"] == 49_152 + 131_072


def test_full_attention_rollouts_under_fast_dllms_caches_hold_every_columns_keys():
    # approx_cache: the keys and values of all 13 + 11 = 24 columns, 2 · 4 rows · 2 layers · 24 · 32 · 4 bytes
    # = 49,152 on top of the uncached rollout's transient
    plain = scale.predict_memory(TINY, _footprint(noise="counter"))["terms"]["rollout_transient"]
    cached = scale.predict_memory(TINY, _footprint(noise="counter", approx_cache=True))["terms"]["rollout_transient"]
    assert cached - plain == 49_152


def test_dream_and_sdar_shapes_have_their_base_models_parameter_counts():
    # Qwen2.5-7B (Dream-7B): per layer q, o 2·3584² = 25,690,112; k, v 2·3584·512 = 3,670,016; biases
    # 3584 + 1024; MLP 3·3584·18944 = 203,685,888; norms 7,168 -> 233,057,792 · 28 = 6,525,618,176;
    # embedding and head 2·152064·3584 = 1,089,994,752; final norm 3,584: 7,615,616,512
    assert scale.param_count(scale.SHAPES["dream-7b"]) == 7_615_616_512
    # Qwen3-8B (SDAR-8B): q, o 2·4096² = 33,554,432; k, v 2·4096·1024 = 8,388,608; MLP 150,994,944;
    # norms 8,192 and q/k norms 256 -> 192,946,432 · 36 = 6,946,071,552; 2·151936·4096 = 1,244,659,712;
    # final norm 4,096: 8,190,735,360
    assert scale.param_count(scale.SHAPES["sdar-8b"]) == 8_190_735_360
    with pytest.raises(ValueError, match="grouped-query"):
        scale.build_model(scale.SHAPES["sdar-8b"], "meta")


def test_every_recipe_is_predicted_to_fit_80_gb_per_gpu_full_fine_tuning_only_with_checkpointing_and_rounds():
    pred = scale.predict_recipes(80e9)
    for name in scale.RECIPES:
        e = pred[name]
        assert e["fits"] and e["peak"] <= 80e9, name
        if name.endswith("-stabledrl"):  # full fine-tuning: it needs both
            assert e["peak_without_checkpointing"] > 80e9 > e["peak"]
            assert e["one_round"]["peak"] > 80e9  # the step's prompts in one round, every row in one graph
            # the authors' layout: 32 prompts × 16 in 4 rounds on 8 GPUs, 16 rows (32 views) per GPU and round;
            # SDAR's own: 64 × 16 in 64 rounds, 2 rows (4 views) per GPU and round, 128 rows in one round
            want = (2, 4, 128) if name.startswith("sdar") else (16, 32, 64)
            assert (e["rows_per_round"], e["views_per_forward"], e["one_round"]["rows"]) == want, name
    # d1: 16 prompts × 6 in 2 rounds, 6 rows (one view each) per GPU and round, LoRA on q, k, v, up:
    # r·(2d + 2d + 2d + d + I) = 128·40,960 per layer, × 32 layers
    assert pred["llada-8b-instruct-gsm8k-d1-diffu-grpo"]["footprint"]["lora_params"] == 167_772_160
    # every linear module: r·(11d + 3I) per layer
    assert scale.llada_lora_param_count(scale.SHAPES["llada-8b"], 1, ["all-linear"]) == 32 * (11 * 4096 + 3 * 12288)
    table = scale.recipes_table(pred)
    assert "| llada-8b-instruct-gsm8k-stabledrl | 8.02 B | 32 × 16, 4 | 16 | 16 | 32 |" in table
    assert "| llada-8b-instruct-gsm8k-d1-diffu-grpo | 8.02 B | 16 × 6, 2 | 6 | 6 | 6 |" in table


def test_a_round_holds_its_share_of_the_step_rows_in_the_memory_model():
    # P = 32, G = 16 on 8 processes: 64 rollouts each, sampled 16 at a time; in R = 4 rounds a
    # process scores 8·16/8 = 16 rows, 2 views each; in one round 64 rows, 128 views
    cfg = scale.recipe_config("llada-8b-instruct-gsm8k-stabledrl")
    f = scale.footprint(cfg, 256, shards=8)
    assert (f.rows_per_call, f.views_per_forward) == (16, 32)
    one = scale.footprint(scale.recipe_config("llada-8b-instruct-gsm8k-stabledrl", ["accumulation_rounds=1"]), 256,
                          shards=8)
    assert (one.rows_per_call, one.views_per_forward) == (16, 128)
    # the update's activations scale with the round's views: 4 rounds hold a quarter
    shape = scale.SHAPES["llada-8b"]
    assert scale.predict_memory(shape, one)["terms"]["activations"] == \
        4 * scale.predict_memory(shape, f)["terms"]["activations"]
