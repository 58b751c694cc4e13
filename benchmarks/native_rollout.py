"""Rollout speed of the native LLaDA under Fast-dLLM's caches, on the CPU, at LLaDA's vocabulary.

    python benchmarks/native_rollout.py                      # ~15 min on one thread
    python benchmarks/native_rollout.py --width 512 --layers 32 --steps 128 --schemes none dual \
        --repeats 1 --out benchmarks/results/native_rollout-w512-32layers.json   # LLaDA's depth: ~32 min

A randomly initialised native LLaDA (`stabledrl.models.native.LLaDAModelLM`) of a reduced
shape (width 128, 2 layers, 4 heads, MLP 384) with LLaDA's whole vocabulary (126,464), so that
the output layer and the draw cost what they cost at 8B per token; 16 rows (one prompt's group)
of 32 prompt tokens, 256 completion tokens in blocks of 32, 64 steps, temperature 1, counter
noise (the recipes'). Schemes: no cache, prefix cache, dual cache, dual cache + threshold 0.9.
Random weights give near-uniform predictions, which never reach the threshold: there it saves
no call (the tiny tasks measure what it saves on a trained model, docs/decoding.md).

Tokens per CPU second = 16 · 256 / process time of one `generate` (one thread; heavy load on the
machine still moves a CPU second's work by a tenth, and unevenly between schemes run minutes apart:
`--interleaved N` times the schemes' model calls in turn instead), median over repeats; the model calls; the share of that time inside
the model's forward (the rest is the sampler's draw over the vocabulary); the speed-up over no
cache.
Writes benchmarks/results/native_rollout.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from stabledrl.models.adapters import HFPolicy
from stabledrl.models.native import LLaDAConfig, LLaDAModelLM
from stabledrl.sampling import SamplingConfig, generate, row_generators
from stabledrl.tokenizer import build_char_tokenizer

SCHEMES = {"none": {}, "prefix": {"approx_cache": "prefix"}, "dual": {"approx_cache": "dual"},
           "dual+threshold0.9": {"approx_cache": "dual", "threshold": 0.9}}


class _Timed:
    """The policy, with the process time of its `logits` calls added up."""

    def __init__(self, policy) -> None:
        self.policy, self.seconds = policy, 0.0

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def logits(self, *args, columns=None, **kwargs):  # `columns` named: the sampler asks for it by name
        t0 = time.process_time()
        out = self.policy.logits(*args, columns=columns, **kwargs)
        self.seconds += time.process_time() - t0
        return out


def reduced_llada(vocab: int, width: int, layers: int) -> HFPolicy:
    torch.manual_seed(0)
    config = LLaDAConfig(d_model=width, n_heads=4, n_kv_heads=4, n_layers=layers, mlp_hidden_size=3 * width,
                         vocab_size=vocab, embedding_size=vocab, block_type="llama", activation_type="silu",
                         layer_norm_type="rms", rope=True, rope_theta=500000.0, weight_tying=False,
                         mask_token_id=126336 if vocab > 126336 else vocab - 1)
    tok = build_char_tokenizer()  # ids below 30: only its special tokens matter to the sampler
    return HFPolicy(LLaDAModelLM(config).eval(), tok, "llada", config.mask_token_id)


def model_work(scheme: str, *, rows: int, prompt: int, length: int, block: int, steps: int, width: int,
               layers: int, vocab: int) -> int:
    """Multiply-adds of one `generate`'s model calls, by hand: what the speed-up should be where the
    model's forward is all the time. Per fed column and layer, the weights' 13·d² (q, k, v, o and
    the MLP of 3·d) and the attention's 2·keys·d; the head's d·V on the block's columns. A block
    of k = steps·block/length steps: k whole-sequence calls uncached; one whole call and k − 1 calls
    of the block's columns (attending to all T keys) with the dual cache."""
    T, d = prompt + length, width
    k = steps * block // length

    def call(fed: int) -> int:
        return rows * (fed * layers * (13 * d * d + 2 * T * d) + block * d * vocab)

    return per_rollout(scheme, length // block, k, call(T), call(block))


def predicted_speedup(shape: dict) -> float:
    """The dual cache's speed-up over no cache from model work alone."""
    return model_work("none", **shape) / model_work("dual", **shape)


def per_rollout(scheme: str, blocks: int, k: int, whole, later):
    """A rollout's cost from its calls': a block of k steps is k whole-sequence calls uncached, one
    whole call and k - 1 calls of the block with the dual cache."""
    return blocks * (k * whole if scheme == "none" else whole + (k - 1) * later)


def interleaved_calls(policy, *, rows: int, prompt: int, length: int, block: int, steps: int, vocab: int,
                      repeats: int) -> dict:
    """The model's time of each scheme from its calls timed side by side, so that the machine's
    load falls on both alike: an uncached call (the whole sequence, the head on a block), a dual
    cache's first call of a block (the same, its keys kept) and a later call (the block's columns
    against the kept keys), in turn, `repeats` times; medians composed as `generate` makes them
    (a block: k uncached calls, or one first call and k - 1 later ones)."""
    from stabledrl.data import position_ids
    from stabledrl.sampling import _ApproxCache

    T, k, blocks = prompt + length, steps * block // length, length // block
    x = torch.randint(0, min(126000, vocab - 1), (rows, T), generator=torch.Generator().manual_seed(2))  # no mask id
    attn = torch.ones_like(x)
    pos, active = position_ids(attn), torch.arange(rows)
    times: dict[str, list[float]] = {"uncached": [], "first": [], "later": []}

    def timed(name: str, call) -> None:
        t0 = time.process_time()
        with torch.no_grad():
            call()
        times[name].append(time.process_time() - t0)

    for _ in range(repeats):
        timed("uncached", lambda: policy.logits(x, attn, pos, columns=slice(prompt, prompt + block)))
        cache = _ApproxCache(policy, SamplingConfig(approx_cache="dual"), prompt, 0, block, attn, pos)
        timed("first", lambda: cache.logits(x, active))
        timed("later", lambda: cache.logits(x, active))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    none = per_rollout("none", blocks, k, med["uncached"], None)
    dual = per_rollout("dual", blocks, k, med["first"], med["later"])
    return {"call_seconds": med, "repeats": repeats, "model_seconds": {"none": none, "dual": dual},
            "model_speedup": none / dual}


def _write(args, argv: list[str] | None, policy, **results) -> None:
    """The JSON: the command, the settings, the model's size, the versions, then the results."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/native_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "parameters": sum(p.numel() for p in policy.model.parameters()),
        "torch": torch.__version__, "python": platform.python_version(), "threads": 1, **results}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=126464)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/native_rollout.json"))
    ap.add_argument("--predict", action="store_true", help="print the dual cache's speed-up from model work and stop")
    ap.add_argument("--interleaved", type=int, metavar="REPEATS",
                    help="time the schemes' model calls side by side, REPEATS times, instead of whole rollouts")
    args = ap.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("rows", "prompt", "length", "block", "steps", "width", "layers", "vocab")}
    if args.predict:
        print(f"model work alone predicts {predicted_speedup(shape):.2f}x for the dual cache")
        return 0
    torch.set_num_threads(1)
    policy = reduced_llada(args.vocab, args.width, args.layers)
    if args.interleaved:
        res = interleaved_calls(policy, **{k: v for k, v in shape.items() if k not in ("width", "layers")},
                                repeats=args.interleaved)
        res["predicted_speedup_from_model_work"] = predicted_speedup(shape)
        print(f"calls side by side: the dual cache's model time {res['model_speedup']:.2f}x shorter "
              f"(model work predicts {res['predicted_speedup_from_model_work']:.2f}x)")
        _write(args, argv, policy, interleaved=res)
        return 0
    ids = torch.randint(100, 126000, (args.rows, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    rows = {}
    for name in args.schemes:
        sampling = SamplingConfig(gen_length=args.length, steps=args.steps, block_length=args.block, temperature=1.0,
                                  noise="counter", **SCHEMES[name])
        cpu, wall, model = [], [], []
        for r in range(args.repeats):
            timed = _Timed(policy)
            c0, w0 = time.process_time(), time.perf_counter()
            with torch.no_grad():
                out = generate(timed, ids, mask, sampling, generator=row_generators(f"r{r}", 0, args.rows))
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            model.append(timed.seconds / cpu[-1])
        tokens = args.rows * args.length
        rows[name] = {"cpu_seconds": statistics.median(cpu), "wall_seconds": statistics.median(wall),
                      "tokens_per_cpu_second": tokens / statistics.median(cpu), "model_calls": out.forward_passes,
                      "model_share_of_cpu": statistics.median(model),
                      "repeats": args.repeats}
        print(f"{name:18s} {rows[name]['tokens_per_cpu_second']:8.1f} tokens/CPU-s, {out.forward_passes} calls, "
              f"{rows[name]['model_share_of_cpu']:.0%} in the model", flush=True)
    if "none" in rows:
        for r in rows.values():
            r["speedup_vs_none"] = r["tokens_per_cpu_second"] / rows["none"]["tokens_per_cpu_second"]
    for name in ("none", "dual"):
        if name in rows:
            rows[name]["model_multiply_adds"] = model_work(name, **shape)
    if {"none", "dual"} <= rows.keys():
        rows["dual"]["predicted_speedup_from_model_work"] = predicted_speedup(shape)
        print(f"model work alone predicts {rows['dual']['predicted_speedup_from_model_work']:.2f}x for the dual cache")
    _write(args, argv, policy, schemes=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
