"""Fast rollouts (issue 15): the cost of the sampling noise, rollout tokens/s under each
decoding scheme, and what each scheme does to held-out accuracy.

    python benchmarks/rollout.py noise                                   # ~1 min
    python benchmarks/rollout.py speed --model tiny --lengths 64 256     # ~4 min
    python benchmarks/rollout.py speed --model tiny --lengths 1024 --batch 2 --repeats 1 --tag -1024
    python benchmarks/rollout.py speed --model mid --lengths 64 256      # ~15 min
    python benchmarks/rollout.py speed --model mid --lengths 1024 --repeats 1 --short-warmup --tag -1024
    python benchmarks/rollout.py speed --model mid --vocab 126464 --lengths 256 --repeats 2 \
        --schemes today counter counter+dual --short-warmup --tag=-vocab126k
    python benchmarks/rollout.py accuracy --n 500                        # ~5 min
    python benchmarks/rollout.py drift --n 200                           # ~2 min
    python benchmarks/rollout.py sort --lengths 64 --repeats 3           # ~6 min
    python benchmarks/rollout.py sort --lengths 256 --repeats 2 --tag -256
    python benchmarks/rollout.py logprob --repeats 5                     # ~1 min

Each writes its section of benchmarks/results/rollout.json (the others are kept), with the
command that made it. CPU only, one thread (no GPU was available for these measurements).

1. noise: one denoising step's draw (`stabledrl.sampling._pick`) for one row at L = 256 and
   LLaDA's vocabulary (126,464), random logits: the noise alone and the whole step, for the
   generator noise (float64 Gumbel over every column x the vocabulary, the default) and the
   counter noise (one uniform per decoded slot, inverse-CDF draw), with every column eligible
   (a one-block step) and with a block of 32.
2. speed: B rows of held-out Countdown prompts, temperature 1, block length 32, steps L/4;
   EOS is suppressed so that every row decodes every slot (the time does not depend on when
   the model would stop). Schemes (`SCHEMES`): today's sampler; counter noise; + prefix cache;
   + dual cache (instead); + threshold 0.9 / 0.7 on the dual cache. Models: the shipped tiny
   model (its positions are trained up to 25 only: beyond that it writes noise, which changes
   nothing to the time but makes its confidences those of a confused model) and a randomly
   initialised mid-size full-attention model (12 layers, width 768, 12 heads, vocabulary
   32,000: 162 M parameters), whose near-uniform predictions never reach a threshold, so
   threshold decoding saves no call there; `--vocab 126464` gives it LLaDA's vocabulary, where
   the noise and the output layer cost the most. Tokens/s = B·L / seconds, median over repeats;
   the share of the time outside the model's forward; model calls. Also tokens per CPU
   second of this (one-thread) process, `time.process_time`: on a machine that other jobs
   share, wall time grows with their load while CPU time barely does, so schemes timed
   during different loads compare by their CPU time (`cpu_speedup_vs_today`).
3. accuracy: the shipped model on the first n Countdown test problems (L = 11), greedy and
   temperature 1, under each scheme (one block, T = L as the README's figures, and blocks of 4).
4. drift: temperature-1 rollouts of the shipped model under each scheme; per row the sampler's
   own log-probability (Σ token_logprob), the path estimate and an mc ELBO (16 views): how far
   what RL estimates is from what the sampler did.
5. sort: B = 64 prompts of random tokens whose lengths vary as GSM8K's (uniform in 40..300
   tokens), micro-batches of 16, in the given order against sorted by prompt length with each
   micro-batch's common left padding dropped (`sort_by_length`), interleaved; the shipped tiny
   model, EOS suppressed, temperature 1, blocks of 32, steps L/4. Median seconds per rollout of
   the 64 rows, and how many rows wrote the same tokens both ways.
6. logprob: the cost of recording `token_logprob` (`generate(record_logprob=True)`: a logsumexp
   over the vocabulary per eligible slot) in one step's draw of 4 rows at L = 256 and LLaDA's
   vocabulary, counter noise, random logits: `_step` with the record against `_pick` without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from stabledrl.data import encode_policy_prompts
from stabledrl.evaluate import evaluate
from stabledrl.models import TinyPolicy, load_policy
from stabledrl.sampling import (
    RolloutRequest,
    SamplingConfig,
    _At,
    _pick,
    generate,
    generate_micro_batched,
    row_generators,
    row_keys,
)
from stabledrl.tasks import get_task
from stabledrl.tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from block import _median_time  # noqa: E402
from sampler import TimedPolicy  # noqa: E402
from scale import Shape, build_model  # noqa: E402

OUT = Path(__file__).parent / "results" / "rollout.json"
SHIPPED = "checkpoints/countdown-tiny"
SCHEMES = {  # name -> generate options on top of the common ones
    "today": {},
    "counter": {"noise": "counter"},
    "counter+prefix": {"noise": "counter", "approx_cache": "prefix"},
    "counter+dual": {"noise": "counter", "approx_cache": "dual"},
    "counter+dual+tau0.9": {"noise": "counter", "approx_cache": "dual", "threshold": 0.9},
    "counter+dual+tau0.7": {"noise": "counter", "approx_cache": "dual", "threshold": 0.7},
}


class Timed(TimedPolicy):
    """`TimedPolicy` (benchmarks/sampler.py), with EOS suppressed if asked, so that every row
    decodes every slot."""

    def __init__(self, policy, no_eos: bool = False):
        super().__init__(policy)
        self.no_eos = no_eos

    def logits(self, *args, **kwargs):
        out = super().logits(*args, **kwargs)
        if self.no_eos:
            out[..., self.inner.eos_token_id] = -1e4
        return out


def _warm_median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return _median_time(fn, repeats)


def _draw_state(sampling: SamplingConfig, gens, keys, logprob: bool = False) -> SimpleNamespace:
    """What `_pick` and `_step` read of a `generate` call: its settings, noise and banned tokens."""
    return SimpleNamespace(sampling=sampling, generator=gens, keys=keys, banned=[0, 1, 2],
                           logprob=torch.zeros(0) if logprob else None)


def bench_noise(repeats: int) -> dict:
    """Seconds per row per step of the draw at L = 256, V = 126,464."""
    from stabledrl.sampling import _rand, counter_uniform

    L, V = 256, 126_464
    logits = torch.randn(1, L, V, generator=torch.Generator().manual_seed(0)) * 3
    rows = torch.arange(1)
    out = {"gen_length": L, "vocab": V}
    for width in (L, 32):
        eligible = torch.zeros(1, L, dtype=torch.bool)
        eligible[:, :width] = True
        gens = row_generators("noise", 0, 1)
        keys = row_keys(gens, 1, "cpu")
        cols = torch.arange(L)

        def old_noise():
            u = _rand(logits.shape, gens, rows, "cpu", torch.float64)
            return -torch.log(-torch.log(u.clamp_min(1e-300)))

        def new_noise():
            return counter_uniform(keys, 0, cols, 0)[eligible]

        def step(noise):
            dec = _draw_state(SamplingConfig(temperature=1.0, noise=noise), gens, keys)
            return lambda: _pick(dec, logits.clone(), eligible, 8, _At(rows, 0, cols))

        out[f"eligible_{width}"] = {
            "generator_noise_seconds": _warm_median_time(old_noise, repeats),
            "counter_noise_seconds": _warm_median_time(new_noise, repeats),
            "generator_step_seconds": _warm_median_time(step("generator"), repeats),
            "counter_step_seconds": _warm_median_time(step("counter"), repeats),
        }
    return out


def bench_logprob(repeats: int, rows: int) -> dict:
    """The share of `token_logprob` (a full-vocabulary logsumexp per eligible slot, `_step`) in
    a denoising step's draw (`_pick`), counter noise, at L = 256 and LLaDA's vocabulary, random
    logits; every column eligible and a block of 32."""
    from stabledrl.sampling import _step

    L, V = 256, 126_464
    logits = torch.randn(rows, L, V, generator=torch.Generator().manual_seed(0)) * 3  # (A, L, V)
    gens = row_generators("logprob", 0, rows)
    sampling, keys = SamplingConfig(temperature=1.0, noise="counter"), row_keys(gens, rows, "cpu")
    plain, recording = _draw_state(sampling, gens, keys), _draw_state(sampling, gens, keys, logprob=True)
    at = _At(torch.arange(rows), 0, torch.arange(L))
    out = {"gen_length": L, "vocab": V, "rows": rows}
    for width in (L, 32):
        eligible = torch.zeros(rows, L, dtype=torch.bool)
        eligible[:, :width] = True
        t = {"clone": _warm_median_time(lambda: logits.clone(), repeats),
             "pick": _warm_median_time(lambda: _pick(plain, logits.clone(), eligible, 8, at), repeats),
             "step": _warm_median_time(lambda: _step(recording, logits.clone(), eligible, 8, at), repeats)}
        draw = t["step"] - t["clone"]  # the sampler's work on one call's logits, token_logprob included
        out[f"eligible_{width}"] = {**{f"{k}_seconds": v for k, v in t.items()},
                                    "logprob_seconds": t["step"] - t["pick"],
                                    "logprob_share_of_step": (t["step"] - t["pick"]) / draw}
        print(f"eligible {width}: step {draw:.3f} s, of which token_logprob {t['step'] - t['pick']:.3f} s "
              f"({(t['step'] - t['pick']) / draw:.1%})", flush=True)
    return out


MID = Shape(32_000, 768, 12, 12, 4 * 768, rope_theta=10_000.0, max_position_embeddings=2048)
"""The mid-size full-attention model of the speed part: 12 layers, width 768, vocab 32k (162 M)."""


def _mid_policy(vocab: int | None = None) -> TinyPolicy:
    """The mid-size model; `vocab` replaces its vocabulary (LLaDA's 126,464: the sampling noise
    and the output layer at a real dLLM's vocabulary)."""
    torch.manual_seed(0)
    shape = MID if vocab is None else dataclasses.replace(MID, vocab_size=vocab)
    return TinyPolicy(build_model(shape, "cpu"), build_char_tokenizer())


def bench_speed(model: str, lengths: list[int], batch: int, repeats: int, schemes: list[str],
                short_warmup: bool = False, vocab: int | None = None) -> dict:
    """`short_warmup`: warm each scheme up with one rollout of 32 tokens instead of a full one
    (for long rollouts, where a full warm-up would double the run's time)."""
    policy = load_policy(SHIPPED) if model == "tiny" else _mid_policy(vocab)
    timed = Timed(policy, no_eos=True)
    problems = get_task("countdown").generate(batch, split="test", seed=0)
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    result = {}
    for L in lengths:
        common = dict(gen_length=L, steps=L // 4, block_length=32, temperature=1.0)
        per = {}
        for name in schemes:
            runs = []
            if short_warmup:
                generate(timed, ids, mask, SamplingConfig(**dict(common, gen_length=32, steps=8), **SCHEMES[name]),
                         generator=row_generators("speed/warm", 0, batch))
            for r in range(int(short_warmup), repeats + 1):  # run 0 warms up and is dropped
                timed.seconds = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                out = generate(timed, ids, mask, SamplingConfig(**common, **SCHEMES[name]),
                               generator=row_generators(f"speed/{r}", 0, batch))
                total, cpu = time.perf_counter() - t0, time.process_time() - c0
                if r:
                    runs.append({"seconds": total, "cpu_seconds": cpu, "forward_seconds": timed.seconds,
                                 "forward_passes": out.forward_passes})
            sec = statistics.median(x["seconds"] for x in runs)
            cpu = statistics.median(x["cpu_seconds"] for x in runs)
            per[name] = {"tokens_per_second": batch * L / sec, "seconds_median": sec,
                         "tokens_per_cpu_second": batch * L / cpu, "cpu_seconds_median": cpu,
                         "share_outside_forward": statistics.median(1 - x["forward_seconds"] / x["seconds"]
                                                                    for x in runs),
                         "forward_passes": statistics.median(x["forward_passes"] for x in runs), "runs": runs}
            base = per.get("today")
            if base:
                per[name]["speedup_vs_today"] = base["seconds_median"] / sec
                per[name]["cpu_speedup_vs_today"] = base["cpu_seconds_median"] / cpu
            print(f"{model} L={L} {name}: {per[name]['tokens_per_second']:.1f} tok/s, "
                  f"{per[name]['tokens_per_cpu_second']:.1f} tok per CPU second, "
                  f"{per[name]['forward_passes']} calls", flush=True)
        result[f"L{L}"] = {"settings": common, "batch": batch, "schemes": per}
    result["vocab_size"] = policy.model.config.vocab_size
    return result


ACCURACY_SCHEMES = {  # name -> sampling options (steps = L = 11 unless set)
    "today": {},
    "counter": {"noise": "counter"},
    "tau0.9": {"noise": "counter", "threshold": 0.9},
    "tau0.7": {"noise": "counter", "threshold": 0.7},
    "prefix(prompt)": {"noise": "counter", "approx_cache": "prefix"},
    "prefix(prompt)+tau0.9": {"noise": "counter", "approx_cache": "prefix", "threshold": 0.9},
    "blocks4": {"block_length": 4},
    "blocks4+counter": {"block_length": 4, "noise": "counter"},
    "blocks4+prefix": {"block_length": 4, "noise": "counter", "approx_cache": "prefix"},
    "blocks4+dual": {"block_length": 4, "noise": "counter", "approx_cache": "dual"},
    "blocks4+dual+tau0.9": {"block_length": 4, "noise": "counter", "approx_cache": "dual", "threshold": 0.9},
    "blocks4+dual+tau0.7": {"block_length": 4, "noise": "counter", "approx_cache": "dual", "threshold": 0.7},
}


def bench_accuracy(n: int) -> dict:
    policy = Timed(load_policy(SHIPPED))
    task = get_task("countdown")
    problems = task.generate(n, split="test", seed=0)
    result = {}
    for temperature in (0.0, 1.0):
        for name, options in ACCURACY_SCHEMES.items():
            policy.seconds = 0.0
            calls = []
            counting = _CountingGenerate(calls)
            with counting:
                res = evaluate(policy, task, problems, SamplingConfig(temperature=temperature, **options),
                               progress=False)
            result[f"T{temperature:g}/{name}"] = {"accuracy": res.accuracy, "mean_reward": res.mean_reward,
                                                  "seconds": res.seconds, "forward_passes": sum(calls)}
            print(f"T={temperature:g} {name}: accuracy {res.accuracy:.4f}, calls {sum(calls)}", flush=True)
    return {"n": n, "split": "test", "gen_length": task.completion_length, "results": result}


DRIFT_SCHEMES = {k: ACCURACY_SCHEMES[k] for k in ("today", "counter", "tau0.9", "tau0.7", "prefix(prompt)",
                                                   "blocks4", "blocks4+prefix", "blocks4+dual",
                                                   "blocks4+dual+tau0.7")}


def bench_drift(n: int, mc_samples: int) -> dict:
    """What each scheme does to the likelihood RL estimates: temperature-1 rollouts of the
    shipped model; per row, the sampler's own log-probability (Σ token_logprob), the path
    estimate (the exact model along the sampled trajectory) and an mc ELBO estimate."""
    from stabledrl.likelihood import Completions, estimate

    policy = load_policy(SHIPPED)
    task = get_task("countdown")
    problems = task.generate(n, split="test", seed=0)
    ids, mask = encode_policy_prompts(policy, [p.prompt for p in problems])
    result = {}
    for name, options in DRIFT_SCHEMES.items():
        out = generate(policy, ids, mask, SamplingConfig(gen_length=task.completion_length, temperature=1.0, **options),
                       generator=row_generators("drift", 0, n), record_logprob=True)
        with torch.no_grad():
            path = estimate(policy, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                                prompt_mask=mask, unmask_step=out.unmask_step), method="path").sequence
            mc = estimate(policy, Completions(out.completion_mask, prompt_ids=ids, completion_ids=out.completion_ids,
                                              prompt_mask=mask), method="mc", num_samples=mc_samples,
                          generator=torch.Generator().manual_seed(0)).sequence
        own = out.token_logprob.sum(1)
        result[name] = {"sampler_logprob_mean": float(own.mean()), "path_mean": float(path.mean()),
                        "mc_elbo_mean": float(mc.mean()),
                        "sampler_minus_path_mean_abs": float((own - path).abs().mean()),
                        "mc_minus_path_mean": float((mc - path).mean()),
                        "completion_length_mean": float(out.completion_mask.sum(1).double().mean())}
        print(name, {k: round(v, 4) for k, v in result[name].items()}, flush=True)
    return {"n": n, "mc_samples": mc_samples, "temperature": 1.0, "results": result}


def bench_sort(lengths: list[int], batch: int, micro_batch: int, repeats: int, lo: int, hi: int) -> dict:
    """Micro-batched rollouts of prompts whose lengths vary as GSM8K's do (uniform in [lo, hi]
    tokens, random tokens, left-padded to hi), in the given order against sorted by length
    (`SamplingConfig(sort_by_length=True)`), interleaved; the shipped tiny model with
    EOS suppressed, temperature 1, blocks of 32, steps L/4."""
    policy = Timed(load_policy(SHIPPED), no_eos=True)
    rng = torch.Generator().manual_seed(0)
    special = set(policy.tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(len(policy.tokenizer)) if t not in special])
    n = torch.randint(lo, hi + 1, (batch,), generator=rng)  # (B,) prompt lengths
    P = int(n.max())
    mask = (torch.arange(P) >= P - n[:, None]).long()  # (B, P) left padding
    ids = vocab[torch.randint(0, vocab.numel(), (batch, P), generator=rng)].masked_fill(mask == 0,
                                                                                       policy.pad_token_id)
    result = {"prompt_lengths": n.tolist(), "batch": batch, "micro_batch": micro_batch}
    for L in lengths:
        common = dict(gen_length=L, steps=L // 4, block_length=32, temperature=1.0)
        runs = {False: [], True: []}
        outs = {}
        for r in range(repeats + 1):  # the first round warms up and is dropped
            for sort in (False, True):
                policy.seconds = 0.0
                t0 = time.perf_counter()
                gens = row_generators(f"sort/{r}", 0, batch)
                sampling = SamplingConfig(**common, sort_by_length=sort)
                outs[sort] = generate_micro_batched(RolloutRequest(policy, ids, mask, L, gens, sampling,
                                                                   micro_batch=micro_batch))
                if r:
                    runs[sort].append({"seconds": time.perf_counter() - t0, "forward_seconds": policy.seconds,
                                       "forward_passes": outs[sort].forward_passes})
        med = {k: statistics.median(x["seconds"] for x in v) for k, v in runs.items()}
        same = (outs[False].completion_ids == outs[True].completion_ids).all(1)  # (B,) the last round's rows
        result[f"L{L}"] = {"settings": {**common, "micro_batch": micro_batch}, "unsorted_seconds_median": med[False],
                           "sorted_seconds_median": med[True], "speedup": med[False] / med[True],
                           "rows_with_identical_tokens": int(same.sum()), "runs": {str(k): v for k, v in runs.items()}}
        print(f"L={L}: unsorted {med[False]:.2f} s, sorted {med[True]:.2f} s, {med[False] / med[True]:.2f}x; "
              f"identical rows {int(same.sum())}/{batch}", flush=True)
    return result


class _CountingGenerate:
    """Adds up `forward_passes` of every `generate` call made inside the block."""

    def __init__(self, calls: list[int]):
        self.calls = calls

    def __enter__(self):
        import stabledrl.sampling as sampling

        self.module, self.real = sampling, sampling.generate

        def counted(*args, **kwargs):
            out = self.real(*args, **kwargs)
            self.calls.append(out.forward_passes)
            return out

        sampling.generate = counted
        return self

    def __exit__(self, *exc):
        self.module.generate = self.real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["noise", "speed", "accuracy", "drift", "sort", "logprob"])
    ap.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--batch", type=int, default=None, help="rows (speed); default 8 tiny, 1 mid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--vocab", type=int, default=None, help="speed, mid model: its vocabulary (default 32,000)")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--mc-samples", type=int, default=16)
    ap.add_argument("--short-warmup", action="store_true",
                    help="speed: warm up with a 32-token rollout instead of a full one (long L)")
    ap.add_argument("--tag", default="", help="appended to the JSON key of a speed or sort section")
    ap.add_argument("--micro-batch", type=int, default=16, help="rows per sampler call (sort)")
    ap.add_argument("--prompt-lengths", type=int, nargs=2, default=[40, 300], metavar=("LO", "HI"),
                    help="prompt lengths, uniform in [LO, HI] tokens (sort)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part == "noise":
        key, section = "noise", bench_noise(args.repeats)
    elif args.part == "speed":
        batch = args.batch or (8 if args.model == "tiny" else 1)
        key, section = f"speed_{args.model}{args.tag}", bench_speed(args.model, args.lengths, batch, args.repeats, args.schemes,
                                                                    args.short_warmup, args.vocab)
    elif args.part == "logprob":
        key, section = "logprob", bench_logprob(args.repeats, args.batch or 4)
    elif args.part == "sort":
        key, section = f"sort{args.tag}", bench_sort(args.lengths, args.batch or 64, args.micro_batch, args.repeats,
                                          *args.prompt_lengths)
    elif args.part == "drift":
        key, section = "drift", bench_drift(args.n, args.mc_samples)
    else:
        key, section = "accuracy", bench_accuracy(args.n)
    section.update(command="python benchmarks/rollout.py " + " ".join(sys.argv[1:]), threads=1,
                   load_average_at_end=os.getloadavg(),
                   device="cpu (no GPU available)", torch=torch.__version__, machine=platform.machine())
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    data[key] = section
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2))
    print(json.dumps({k: v for k, v in section.items() if k not in ("runs",)}, indent=1)[:3000])


if __name__ == "__main__":
    main()
