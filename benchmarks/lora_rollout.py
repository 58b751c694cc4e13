"""LoRA rollouts where launching operations is the cost: peft's forward against the sampler's
short one (`stabledrl.models.lora.lean_adapters`) and against the adapters switched off, at
LLaDA-8B's depth and a tiny width, on the CPU.

    python benchmarks/lora_rollout.py                       # ~5 min on one thread
    python benchmarks/lora_rollout.py --schemes none dual --repeats 5

At 8B on a GPU a cached rollout's later calls are bound by launching kernels, not by arithmetic
(docs/gpu-check.md: ~3,500 launches a model call; with LoRA's adapters off the dual-cache rollout
took 4.88 s against 9.43 s on). A model of LLaDA-8B's depth (32 layers, `gpu_check.native_llada`)
at width 64 (4 heads, MLP 192, vocabulary 1,024) makes the same operations a call with next to no
arithmetic, so the CPU's time is the host's cost of issuing them: the part of the GPU's time that
the short forward can save. bf16 weights, LoRA r 16 on every linear layer but the head (peft's
float32 adapters: gpu_check's setting), bf16 autocast in each model call (accelerate's, as the
trainer's: a cast of a weight is not kept from one call to the next), 16 rows of 32 prompt tokens, 256 tokens in
blocks of 32, 128 steps, temperature 0.9, counter noise, no stop tokens (every row runs every step,
as at 8B's vocabulary, where random weights all but never draw one).

Per variant (peft's forward; the short one; adapters off: peft's forward under its
`disable_adapter`, as gpu_check timed it) and scheme:
the rollout's wall seconds, median over `--repeats` rounds that run the variants in turn (load
moves all alike); the operations dispatched per model call (a `TorchDispatchMode` count inside
the policy's `logits`, over a rollout of two steps a block; and in its last call alone); and whether the short forward's
tokens equal peft's (they must: the same operations on the same values).
Writes benchmarks/results/lora_rollout.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402
import scale  # noqa: E402

from stabledrl.models import LoraSettings, add_lora  # noqa: E402
from stabledrl.models.lora import lean_adapters  # noqa: E402
from stabledrl.sampling import SamplingConfig, generate, row_generators  # noqa: E402

VARIANTS = ("peft", "lean", "off")


class _CountOps(TorchDispatchMode):
    """Counts the operations dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Counted:
    """The policy, with the operations of its `logits` calls counted."""

    def __init__(self, policy) -> None:
        self.policy, self.ops, self.calls, self.last = policy, 0, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def logits(self, *args, columns=None, **kwargs):
        with _CountOps() as mode:
            out = self.policy.logits(*args, columns=columns, **kwargs)
        self.ops, self.calls, self.last = self.ops + mode.count, self.calls + 1, mode.count
        return out


def build(args):
    shape = dataclasses.replace(scale.SHAPES["llada-8b"], hidden_size=args.width, num_attention_heads=4,
                                num_key_value_heads=4, intermediate_size=3 * args.width, vocab_size=args.vocab,
                                num_hidden_layers=args.layers)
    policy = gpu_check.native_llada(shape, "cpu", torch.bfloat16)
    # No stop tokens (EOS and PAD join the banned special tokens): every row runs every step. A random
    # model draws one about once in 126k slots at LLaDA's vocabulary, here at 1,024 in about one row in
    # five, and a row that ends leaves the dual cache's later calls: with adapters off (other tokens)
    # the variants would not compute the same rows.
    policy.stop_token_ids = ()
    add_lora(policy, LoraSettings(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0), seed=0)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:  # as if trained (B starts at zero)
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    policy.model = Accelerator(cpu=True, mixed_precision="bf16").prepare(policy.model)  # autocast a call, as the trainer's
    policy.model.eval()
    return policy


def rollout(policy, args, ids, scheme: str, variant: str, steps: int):
    """One `generate` (bf16 autocast in each model call: accelerate's): (wall seconds, completions)."""
    cfg = SamplingConfig(gen_length=args.gen_length, steps=steps, block_length=args.block_length,
                         temperature=0.9, noise="counter", **gpu_check.SCHEMES[scheme])
    peft = gpu_check._peft_forward() if variant in ("peft", "off") else nullcontext()  # off: as gpu_check timed it
    off = getattr(policy.model, "module", policy.model).disable_adapter() if variant == "off" else nullcontext()
    t0 = time.perf_counter()
    with torch.no_grad(), peft, off:
        gen = generate(policy, ids, torch.ones_like(ids), cfg, generator=row_generators("lora", 0, len(ids)))
    return time.perf_counter() - t0, gen.completion_ids


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["dual"], choices=list(gpu_check.SCHEMES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_rollout.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    policy = build(args)
    ids = torch.randint(5, args.vocab, (args.rows, args.prompt_length), generator=torch.Generator().manual_seed(0))
    blocks = -(-args.gen_length // args.block_length)
    with lean_adapters(policy.model) as served:
        pass
    report = {"command": "python benchmarks/lora_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": args.threads, "lora_layers": served, "settings": {k: str(v) for k, v in vars(args).items()},
              "schemes": {}}
    for scheme in args.schemes:
        row: dict = {v: {"seconds": []} for v in VARIANTS}
        counted = _Counted(policy)
        for v in VARIANTS:  # warm-up, and the operations a call
            counted.ops = counted.calls = 0
            rollout(counted, args, ids, scheme, v, 2 * blocks)
            row[v]["ops_per_call"] = counted.ops / counted.calls
            row[v]["ops_last_call"] = counted.last  # a later call of the last block: no cast made once
        tokens = {}
        for _ in range(args.repeats):
            for v in VARIANTS:
                seconds, tokens[v] = rollout(policy, args, ids, scheme, v, args.steps)
                row[v]["seconds"].append(seconds)
        for v in VARIANTS:
            row[v]["median_seconds"] = statistics.median(row[v]["seconds"])
            row[v]["tokens_per_s"] = args.rows * args.gen_length / row[v]["median_seconds"]
        row["lean_tokens_equal_peft"] = bool(torch.equal(tokens["lean"], tokens["peft"]))
        row["lean_over_peft_seconds"] = row["lean"]["median_seconds"] / row["peft"]["median_seconds"]
        row["off_over_peft_seconds"] = row["off"]["median_seconds"] / row["peft"]["median_seconds"]
        report["schemes"][scheme] = row
        print(f"{scheme}: " + ", ".join(f"{v} {row[v]['median_seconds']:.2f} s ({row[v]['ops_per_call']:.0f} ops a call)"
                                        for v in VARIANTS)
              + f"; lean/peft {row['lean_over_peft_seconds']:.3f}, off/peft {row['off_over_peft_seconds']:.3f}, "
              f"same tokens: {row['lean_tokens_equal_peft']}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
