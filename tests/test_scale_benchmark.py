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

    shape = dataclasses.replace(TINY, vocab_size=2048, num_hidden_layers=1)
    AcceleratorState._reset_state()
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(scale.build_model(shape, "cpu"))
    ids = torch.randint(5, 2048, (8, 24), generator=torch.Generator().manual_seed(0))  # (n, T)
    with torch.no_grad(), scale.LiveBytes() as live:
        for t in (*model.parameters(), *model.buffers(), ids):
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
