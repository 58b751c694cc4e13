"""benchmarks/lora_rollout.py at a tiny size: the three variants' rollouts, the short forward's
tokens equal to peft's with adapters that change the output, and the operations it saves a call
by hand."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lora_rollout  # noqa: E402


def test_the_short_forward_saves_its_operations_and_samples_peft_tokens(tmp_path):
    out = tmp_path / "lora.json"
    lora_rollout.main(["--schemes", "dual", "--repeats", "1", "--layers", "2", "--width", "32", "--vocab", "64",
                       "--rows", "2", "--prompt-length", "4", "--gen-length", "8", "--block-length", "4",
                       "--steps", "4", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["lora_layers"] == 2 * 7  # q, k, v, attn_out, ff_proj, up_proj, ff_out a block
    row = report["schemes"]["dual"]
    assert row["lean_tokens_equal_peft"] is True
    assert all(len(row[v]["seconds"]) == 1 and row[v]["tokens_per_s"] > 0 for v in lora_rollout.VARIANTS)
    # a call of every adapted layer: peft's forward casts x to float32 and back and A and B to bf16 (4 casts)
    # and computes x·Aᵀ, ·Bᵀ, the scaling and the sum through two linears (each a transpose, a view, a product
    # and a view back); the short one casts nothing and makes a view, two products, a view and one fused sum
    # (alpha / r = 2): 4 + (4 + 4 + 1 + 1) - 5 = 9 fewer. Adapters off: peft's 14 fewer, the short one's 5.
    peft, lean, off = (row[v]["ops_last_call"] for v in lora_rollout.VARIANTS)
    assert peft - lean == 9 * 14 and lean - off == 5 * 14
    assert row["peft"]["ops_per_call"] > row["lean"]["ops_per_call"] > row["off"]["ops_per_call"]
