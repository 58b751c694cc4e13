"""benchmarks/native_rollout.py: its count of the model's multiply-adds against hand arithmetic
and against PyTorch's FLOP counter on a real `generate` of a tiny native LLaDA."""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import native_rollout  # noqa: E402

from stabledrl.sampling import SamplingConfig, generate, row_generators  # noqa: E402

SHAPE = dict(rows=2, prompt=4, length=8, block=4, steps=4, width=32, layers=2, vocab=300)


def test_model_work_by_hand():
    # T = 4 + 8 = 12 columns, k = 4·4/8 = 2 steps a block, 2 blocks. Per fed column and layer:
    # weights 13·32² = 13,312, attention 2·12·32 = 768; head on the block: 4·32·300 = 38,400.
    whole = 2 * (12 * 2 * (13_312 + 768) + 38_400)  # 752,640: one whole-sequence call of both rows
    block = 2 * (4 * 2 * (13_312 + 768) + 38_400)  # 302,080: the block's 4 columns
    assert native_rollout.model_work("none", **SHAPE) == 2 * (2 * whole)
    assert native_rollout.model_work("dual", **SHAPE) == 2 * (whole + block)


@pytest.mark.parametrize("scheme", ["none", "dual"])
def test_model_work_is_what_the_sampler_computes(scheme):
    torch.manual_seed(0)
    policy = native_rollout.reduced_llada(SHAPE["vocab"], SHAPE["width"], SHAPE["layers"])
    ids = torch.randint(40, 290, (2, 4), generator=torch.Generator().manual_seed(1))
    sampling = SamplingConfig(gen_length=8, steps=4, block_length=4, temperature=1.0, noise="counter",
                              **native_rollout.SCHEMES[scheme])
    # The math attention kernel: its matrix products are what the counter sees (a fused kernel's are not).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        generate(policy, ids, torch.ones_like(ids), sampling, generator=row_generators("r", 0, 2))
    assert counter.get_total_flops() == 2 * native_rollout.model_work(scheme, **SHAPE)


def test_interleaved_calls_compose_a_rollout_from_its_calls():
    # 2 blocks of k = 2 steps: uncached 2·2 whole calls; dual per block one first call and one later call
    torch.manual_seed(0)
    policy = native_rollout.reduced_llada(SHAPE["vocab"], SHAPE["width"], SHAPE["layers"])
    shape = {k: v for k, v in SHAPE.items() if k not in ("width", "layers")}
    res = native_rollout.interleaved_calls(policy, **shape, repeats=3)
    c = res["call_seconds"]
    assert set(c) == {"uncached", "first", "later"} and min(c.values()) > 0
    assert res["model_seconds"]["none"] == pytest.approx(4 * c["uncached"], rel=1e-12)
    assert res["model_seconds"]["dual"] == pytest.approx(2 * (c["first"] + c["later"]), rel=1e-12)
    assert res["model_speedup"] == pytest.approx(4 * c["uncached"] / (2 * (c["first"] + c["later"])), rel=1e-12)
