"""benchmarks/gpu_check.py at a tiny size on CPU: one rollout, scoring pass and RL step, its
token and FLOP counts by hand, and its peak memory against the memory model."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402
import scale  # noqa: E402

# 4 rows in groups of 2, prompts of 8, 16 slots in blocks of 4, 8 steps: T = 24
TINY = ["--size", "tiny", "--device", "cpu", "--rows", "4", "--group-size", "2", "--prompt-length", "8",
        "--gen-length", "16", "--block-length", "4", "--steps", "8"]


def test_one_step_on_cpu_counts_its_tokens_and_flops_and_meets_the_memory_model(tmp_path):
    out = tmp_path / "check.json"
    r = gpu_check.main(TINY + ["--out", str(out)])
    assert json.loads(out.read_text())["counts"] == r["counts"]
    # K = 2 views a row; 8 steps; in the last step (the counts', and the FLOPs') no row drew EOS
    # before its last slot (all 64 slots scored), so every row has work left at every step
    assert r["counts"] == {"rows": 4, "completion_slots": 64, "scored_slots": 64, "views": 8, "forward_passes": 8}
    assert r["model"]["params"] == 43_168
    # the native LLaDA's seven linear modules a layer: 2 · 16 · (11 · 32 + 3 · 96) = 20,480
    assert r["model"]["trainable"] == scale.llada_lora_param_count(scale.SHAPES["tiny"], 16, ["all-linear"]) == 20_480
    # the rollout alone under each cache: at most the schedule's 8 calls (fewer if every row ended)
    assert list(r["rollout_schemes"]) == [s for s in gpu_check.SCHEMES if s not in gpu_check.GRAPHED]
    assert all(0 < s["tokens_per_s"] and 1 <= s["model_calls"] <= 8 for s in r["rollout_schemes"].values())
    step = r["steps"][-1]
    # every sampler call feeds the 4 rows' 24 tokens: 8 · 4 · 24 = 768; scoring and the update one pass of 8 views
    assert (step["rollout"]["tokens"], step["scoring"]["tokens"], step["update"]["tokens"]) == (768, 192, 192)
    # 2-D weights but the embedding: 2 · (4·32² + 3·32·96) + the head 256·32 = 34,816; attention
    # 4 · 2 layers · 32 = 256 per token and key. Rollout: 2·34,816·768 + 256·(8·4·24²) = 58,195,968, less
    # the head on the columns the sampler asks no logits of (its block of 4: 8 · 4 · 20 = 640 tokens),
    # 2·256·32·640 = 10,485,760: 47,710,208
    assert r["model"]["matmul_params"] == 34_816
    assert step["rollout"]["tokens_without_logits"] == 640
    assert r["model_tflop"]["rollout"] * 1e12 == pytest.approx(47_710_208, rel=1e-12)
    # LoRA's update: the forward and a backward through the activations only (2× the forward)
    assert r["model_tflop"]["update"] == pytest.approx(2 * r["model_tflop"]["scoring"], rel=1e-12)
    mem = r["memory"]
    assert mem["measured_by"].startswith("LiveBytes") and mem["measured_peak"] > 0
    assert 0.8 < mem["ratio_predicted_over_measured"] < 1.2


def test_full_fine_tuning_with_micro_batches_and_a_view_budget():
    r = gpu_check.main(TINY + ["--train", "full", "--micro-batch", "2", "--max-views-per-forward", "3",
                               "--estimator", "mc"])
    assert r["model"]["trainable"] == 43_168
    # the backward 2× the forward; the view budget's no-grad pass for ∂loss/∂ℓ is not model FLOPs
    assert r["model_tflop"]["update"] == pytest.approx(3 * r["model_tflop"]["scoring"], rel=1e-12)
    assert r["steps"][-1]["update"]["tokens"] == 2 * r["steps"][-1]["scoring"]["tokens"]
    assert 0.8 < r["memory"]["ratio_predicted_over_measured"] < 1.2


def test_a_bfloat16_model_runs_without_autocast():
    # RoPE in float32 made q and k float32 beside a bfloat16 v, which SDPA refuses (seen on an H100)
    model = scale.build_model(scale.SHAPES["tiny"], "cpu", torch.bfloat16)
    ids = torch.randint(5, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_the_rollouts_without_adapters_and_the_step_under_further_rollout_schemes(tmp_path):
    out = tmp_path / "check.json"
    r = gpu_check.main(TINY + ["--schemes", "none", "dual", "--also-without-adapters", "--also-peft-forward",
                               "--step-schemes", "none", "dual+refresh2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] is True and list(saved["step_by_scheme"]) == ["none", "dual+refresh2"]
    # fresh LoRA adapters (B = 0) change nothing: the same schedule of calls with them off or under peft's forward
    for other in ("rollout_schemes_without_adapters", "rollout_schemes_peft_forward"):
        assert list(r[other]) == ["none", "dual"]
        assert [s["model_calls"] for s in r[other].values()] == [s["model_calls"] for s in r["rollout_schemes"].values()]
    # the dual cache's rollout phase predicts the cache beside the uncached one: 2 (k, v) · 4 rows · 2 layers ·
    # 24 columns · 32 wide · 2 bytes (bf16 autocast, on CPU too) = 24,576 bytes more
    assert saved["rollout_schemes"]["dual"]["predicted_rollout_bytes"] - \
        saved["rollout_schemes"]["none"]["predicted_rollout_bytes"] == 2 * 4 * 2 * 24 * 32 * 2
    step = r["step_by_scheme"]["dual+refresh2"]
    assert step["step"] == pytest.approx(sum(step[k] for k in ("rollout", "scoring", "update", "optimizer")))


def test_graphed_schemes_compare_their_tokens_and_a_failed_scheme_is_reported(tmp_path, monkeypatch):
    # on the CPU a capture fails (no CUDA): the scheme is reported with its error and the others run;
    # with the CPU's emulation of a capture (tests/cpu_graphs.py) the replayed rollout is timed and its
    # tokens compared with the plain scheme's
    import stabledrl.sampling as sampling
    from tests.cpu_graphs import RecordedCall

    failed = gpu_check.main(TINY + ["--schemes", "dual", "dual+graphs", "--out", str(tmp_path / "a.json")])
    assert "cuda_graphs needs the model on a CUDA device" in failed["rollout_schemes"]["dual+graphs"]["error"]
    assert failed["rollout_schemes"]["dual"]["tokens_per_s"] > 0
    monkeypatch.setattr(sampling, "CapturedCall", RecordedCall)
    r = gpu_check.main(TINY + ["--schemes", "dual", "dual+graphs", "prefix+graphs", "--out", str(tmp_path / "b.json")])
    assert r["rollout_schemes"]["dual+graphs"]["same_tokens_as_dual"] is True
    assert "same_tokens_as_prefix" not in r["rollout_schemes"]["prefix+graphs"]  # prefix did not run
