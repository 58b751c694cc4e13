"""One RL step of an 8B diffusion LM on one GPU: rollout, scoring, update; speed, memory and MFU.

    python benchmarks/gpu_check.py                            # CUDA: LLaDA-8B's shape, LoRA, checkpointing
    python benchmarks/gpu_check.py --train full --layers 8    # full fine-tuning of the first 8 layers' depth
    python benchmarks/gpu_check.py --model PATH               # a real checkpoint (load_policy)
    python benchmarks/gpu_check.py --size tiny --device cpu   # the same path at a tiny size (the test)
    python benchmarks/gpu_check.py --model-code tiny          # the project's TinyDiffusionLM at that shape
    python benchmarks/gpu_check.py --schemes none dual --also-without-adapters --step-schemes dual
                                                              # the caches with LoRA on and off; the step on dual
    python benchmarks/gpu_check.py --schemes dual --also-peft-forward --also-without-adapters --step-schemes dual
                                                              # LoRA's short forward against peft's, and off
    python benchmarks/gpu_check.py --schemes dual dual+graphs --also-peft-forward --also-without-adapters \
        --step-schemes dual dual+graphs                       # and the later calls replayed from CUDA graphs

The default model is stabledrl's native LLaDA (`stabledrl.models.native.LLaDAModelLM`, what
`adapter: llada` loads) at LLaDA-8B's shape (32 layers, width 4096, 32 heads, SwiGLU 12288,
vocabulary 126,464, RoPE θ 5e5, RMSNorm, no biases, untied head: 8,015,581,184 parameters),
random weights made directly on the device in the base dtype. Before the step, the rollout
alone under each of Fast-dLLM's caches (`--schemes`: none, prefix, dual, dual with threshold
0.9, dual refreshed every second call; named, dual and prefix with a block's later calls replayed
from a CUDA graph, `sampling.cuda_graphs`, whose tokens are compared with the unreplayed scheme's
when both run; a scheme that fails is reported with its error and the others run): tokens/s,
model calls and peak memory of `generate` for the `--rows` rows beside the memory model's
rollout phase (random weights never reach the
threshold: its row shows the cost of the check alone); with `--also-peft-forward` again with
peft's own LoRA forward in every layer (the sampler otherwise runs its short one,
`stabledrl.models.lora.lean_adapters`: the same tokens); with `--also-without-adapters` again with
LoRA's adapters off. The step (`--step-schemes`: its rollout under each) is `benchmarks/scale.py`'s `rl_step`, the trainer's
(one process) wired from the library's components, for a config made of this script's
options (`train_config`): rollouts (built-in engine, counter noise), ℓ_old on the trainer's
mask plan, one update (a graph, or `backward_views` under a view budget; the stabledrl
objective; accelerate's backward; clipping at 0.2; AdamW). Random prompts and rewards. One warm-up step, then
`--repeats` timed ones. Peak memory: `torch.cuda.max_memory_allocated` (on CPU the live tensor
bytes, `scale.LiveBytes`) beside `scale.predict_memory` for the same setting. MFU: model FLOPs
(a forward 2·N_matmul per token plus attention's 4·nl·d per token and key; the update's
backward 2× the forward in full fine-tuning, 1× with LoRA; recomputation not counted) over
`--peak-tflops` (989: the H100 SXM's dense bf16 rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402

from stabledrl.models import HFPolicy, TinyPolicy, add_lora  # noqa: E402
from stabledrl.models.native import LLaDAConfig, LLaDAModelLM  # noqa: E402
from stabledrl.sampling import generate, row_generators  # noqa: E402
from stabledrl.settings import EstimatorConfig, LoraSettings, SamplingConfig, StableDRLConfig, TrainConfig  # noqa: E402
from stabledrl.tokenizer import build_char_tokenizer  # noqa: E402

GB = 1e9
SIZES = ("llada-8b", "tiny")  # shapes of benchmarks/scale.py
SCHEMES = {"none": {}, "prefix": {"approx_cache": "prefix"}, "dual": {"approx_cache": "dual"},
           "dual+threshold0.9": {"approx_cache": "dual", "threshold": 0.9},
           "dual+refresh2": {"approx_cache": "dual", "approx_refresh": 2},
           "dual+graphs": {"approx_cache": "dual", "cuda_graphs": True},
           "prefix+graphs": {"approx_cache": "prefix", "cuda_graphs": True}}
GRAPHED = ("dual+graphs", "prefix+graphs")  # CUDA only: not among the default schemes
PHASES = ("rollout", "scoring", "update", "optimizer")  # a step's, as scale.rl_step clocks them


class _Tokens:
    """Counts the tokens fed to the model (forward pre-hook), for the FLOP count."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.sq = 0  # Σ rows·T², for attention's FLOPs
        self.headless = 0  # tokens whose logits were not computed (the sampler's head on its block: logits_columns)
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.count += ids.numel()
        self.sq += ids.size(0) * ids.size(1) ** 2
        cols = kwargs.get("logits_columns")
        if cols is not None:
            self.headless += ids.size(0) * (ids.size(1) - len(range(ids.size(1))[cols]))


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The `TinyDiffusionLM` (or HF model) under peft's and accelerate's wrappers."""
    while True:
        nxt = getattr(model, "module", None) or getattr(getattr(model, "base_model", None), "model", None)
        if nxt is None or nxt is model:
            return model
        model = nxt


def build(args) -> tuple[TinyPolicy, scale.Shape | None]:
    """The policy: a random `TinyDiffusionLM` of the size's shape (depth `--layers`) in the
    base dtype, or `--model`; LoRA adapters with `--train lora`; checkpointing on."""
    dtype = torch.bfloat16 if args.train == "lora" else torch.float32  # full FT: float32 master weights
    if args.model:
        from stabledrl.models.policy import load_policy

        policy = load_policy(args.model, device=args.device, dtype=dtype)
        shape = _shape_of(policy.model.config)
    else:
        shape = scale.SHAPES[args.size]
        if args.layers:
            shape = dataclasses.replace(shape, num_hidden_layers=args.layers)
        if args.model_code == "tiny":
            policy = TinyPolicy(scale.build_model(shape, args.device, dtype), build_char_tokenizer())
        else:
            policy = native_llada(shape, args.device, dtype)
    model = policy.model
    if args.checkpointing:
        if hasattr(model, "gradient_checkpointing") and isinstance(model.gradient_checkpointing, bool):
            model.gradient_checkpointing = True  # TinyDiffusionLM: every block, also in eval mode
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(args.train == "full")
    if args.train == "lora":
        add_lora(policy, LoraSettings(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0), seed=0)
    policy.model.eval()
    return policy, shape


def native_llada(shape: scale.Shape, device: str, dtype: torch.dtype) -> HFPolicy:
    """A random native LLaDA of `shape` behind the llada adapter, made directly on `device` in
    `dtype` (the char tokenizer's special tokens: its ids are below any shape's vocabulary)."""
    tok = build_char_tokenizer()
    config = LLaDAConfig(d_model=shape.hidden_size, n_heads=shape.num_attention_heads,
                         n_kv_heads=shape.num_key_value_heads or shape.num_attention_heads,
                         n_layers=shape.num_hidden_layers, mlp_hidden_size=shape.intermediate_size,
                         vocab_size=shape.vocab_size, embedding_size=shape.vocab_size, rope_theta=shape.rope_theta,
                         block_type="llama", activation_type="silu", layer_norm_type="rms", rope=True,
                         weight_tying=False, mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LLaDAModelLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return HFPolicy(model, tok, "llada", tok.mask_token_id)


def timed_rollout(policy, args, ids: torch.Tensor, cuda: bool, scheme: str, steps: int) -> tuple[float, Any]:
    """One `generate` of the rows under `scheme` in `steps` steps: its seconds (the GPU synchronised
    before and after; CUDA's peak memory reset at its start) and its result."""
    sampling = SamplingConfig(gen_length=args.gen_length, steps=steps, block_length=args.block_length,
                              temperature=args.temperature, noise=args.noise, **SCHEMES[scheme])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = generate(policy, ids, torch.ones_like(ids), sampling, generator=row_generators("check", 0, len(ids)))
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, gen


def rollout_schemes(policy, args, ids: torch.Tensor, cuda: bool, save=lambda part: None,
                    label: str = "") -> dict[str, Any]:
    """The rollout alone under each of `args.schemes`: seconds, tokens/s, model calls, peak memory
    (CUDA) of one `generate` of the rows. Each scheme is warmed up first by a rollout of two steps a
    block (a block's first call and a later one: every shape of call the rollout makes, in a fraction
    of its time; one step a block warmed the first calls alone); `save` gets the results so far."""
    out: dict[str, Any] = {}
    blocks = -(-args.gen_length // args.block_length)
    tokens: dict[str, torch.Tensor] = {}
    for name in args.schemes:
        try:
            timed_rollout(policy, args, ids, cuda, name, min(2 * blocks, args.steps))  # warm-up
            seconds, gen = timed_rollout(policy, args, ids, cuda, name, args.steps)
        except Exception as e:  # noqa: BLE001 (one scheme's failure, e.g. a capture on a new GPU, is a result too)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"rollout{label}, {name}: failed: {out[name]['error']}", flush=True)
            save(out)
            continue
        out[name] = {"seconds": seconds, "tokens_per_s": ids.size(0) * args.gen_length / seconds,
                     "model_calls": gen.forward_passes,
                     "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
        tokens[name] = gen.completion_ids
        plain = name.removesuffix("+graphs")
        if plain != name and plain in tokens:  # replayed calls: the same kernels, so the same tokens
            out[name]["same_tokens_as_" + plain] = bool(torch.equal(tokens[plain], gen.completion_ids))
        print(f"rollout{label}, {name}: {out[name]['tokens_per_s']:.0f} tokens/s, {gen.forward_passes} calls, "
              f"{seconds:.2f} s", flush=True)
        save(out)
    return out


@contextmanager
def _peft_forward() -> Iterator[None]:
    """The sampler without its short LoRA forward (`stabledrl.sampling.generate` enters
    `lean_adapters`): peft's forward in every adapted layer."""
    import stabledrl.sampling as sampling_module

    lean = sampling_module.lean_adapters
    sampling_module.lean_adapters = lambda model: nullcontext()
    try:
        yield
    finally:
        sampling_module.lean_adapters = lean


def _shape_of(cfg) -> scale.Shape | None:
    """The memory model's shape of a checkpoint's config (HF names, or LLaDA's); None if unreadable."""
    def get(*names):
        return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)
    d, nl = get("hidden_size", "d_model"), get("num_hidden_layers", "n_layers")
    H = get("num_attention_heads", "n_heads")
    I, V = get("intermediate_size", "mlp_hidden_size"), get("embedding_size", "vocab_size")
    if None in (d, nl, H, I, V):
        return None
    kv = get("num_key_value_heads", "n_kv_heads")
    return scale.Shape(V, d, nl, H, I, num_key_value_heads=None if kv == H else kv,
                       qkv_bias=bool(get("attention_bias", "include_bias")), qk_norm=any(t in str(get("model_type")) for t in ("qwen3", "sdar")))


def train_config(args, scheme: str = "none") -> TrainConfig:
    """The trainer's config of this check's step (one process), for `scale.rl_step`; the
    rollout under `scheme` (`SCHEMES`)."""
    options = {"block_length": args.block_length, "p_prompt": 0.15} if args.estimator == "block_random" else {}
    return TrainConfig(
        lora=LoraSettings(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0) if args.train == "lora" else None,
        rollout=SamplingConfig(gen_length=args.gen_length, steps=args.steps, block_length=args.block_length,
                               temperature=args.temperature, noise=args.noise, micro_batch=args.micro_batch,
                               **SCHEMES[scheme]),
        estimator=EstimatorConfig(method=args.estimator, num_samples=args.views, options=options, reduction="mean",
                                  max_views_per_forward=args.max_views_per_forward),
        objective=StableDRLConfig(), prompts_per_step=args.rows // args.group_size, group_size=args.group_size,
        mu=1, lr=args.lr, weight_decay=0.1, grad_clip=0.2, mixed_precision="bf16", drift_kl=False)


class _CountingClock(scale._Clock):
    """`scale`'s clock of a step's phases, also counting the tokens each phase feeds the model."""

    def __init__(self, cuda: bool, tokens: _Tokens, live: scale.LiveBytes | None = None) -> None:
        super().__init__(cuda, live)
        self.tokens = tokens
        self.fed: dict[str, tuple[int, int, int]] = {}  # phase -> (tokens, Σ rows·T², tokens without logits)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        c0, s0, h0 = self.tokens.count, self.tokens.sq, self.tokens.headless
        with super().__call__(phase):
            yield
        c, sq, h = self.fed.get(phase, (0, 0, 0))
        self.fed[phase] = (c + self.tokens.count - c0, sq + self.tokens.sq - s0, h + self.tokens.headless - h0)


def rl_step(run: scale._Run, tokens: _Tokens, step: int, live: scale.LiveBytes | None = None) -> dict[str, Any]:
    """One step of `scale.rl_step` (the trainer's, one process): seconds, tokens and peaks per phase."""
    clock = _CountingClock(run.prompt_ids.device.type == "cuda", tokens, live)
    counts = scale.rl_step(run, step, clock)
    out: dict[str, Any] = {
        name: {"seconds": clock.seconds[name], "tokens": clock.fed[name][0], "tokens_sq": clock.fed[name][1],
               "tokens_without_logits": clock.fed[name][2], "peak_bytes": clock.peaks.get(name)}
        for name in PHASES}
    out["counts"] = {"rows": counts["rows"], "completion_slots": counts["completion_slots"],
                     "scored_slots": counts["scored_tokens"], "views": counts["views_scored"],
                     "forward_passes": counts["forward_passes"]}
    return out


def flops_per_token(n_matmul: int, layers: int, width: int) -> tuple[int, int]:
    """Forward FLOPs: (per token, the dense part 2·N_matmul; per token and key, attention's 4·nl·d)."""
    return 2 * n_matmul, 4 * layers * width


def footprint(args, lora_params: int, rows: int, scheme: str = "none") -> scale.Footprint:
    """The memory model's description of this run (one process, no sharding), its rollouts under `scheme`."""
    views = rows * args.views
    return scale.Footprint(prompt_length=args.prompt_length, gen_length=args.gen_length,
                           rows_per_call=min(rows, args.micro_batch or rows),
                           views_per_forward=min(views, args.max_views_per_forward or views),
                           lora_params=lora_params, weight_bytes=2 if args.train == "lora" else 4, autocast=True,
                           foreach=True, checkpointing=args.checkpointing, noise=args.noise,
                           block_length=args.block_length, head_on_block=args.noise == "counter",
                           approx_cache=bool(SCHEMES[scheme].get("approx_cache")))


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="llada-8b", help="the random model's shape")
    ap.add_argument("--model", help="a checkpoint directory instead (stabledrl.models.policy.load_policy)")
    ap.add_argument("--model-code", choices=["native", "tiny"], default="native",
                    help="the random model: stabledrl's native LLaDA, or the project's TinyDiffusionLM")
    ap.add_argument("--schemes", nargs="*", default=[s for s in SCHEMES if s not in GRAPHED], choices=list(SCHEMES),
                    help="rollout caches timed before the step (none: skip); the +graphs ones (CUDA) when named")
    ap.add_argument("--also-without-adapters", action="store_true",
                    help="with --train lora: time the schemes again with the adapters off (as full fine-tuning samples)")
    ap.add_argument("--also-peft-forward", action="store_true",
                    help="with --train lora: time the schemes again with peft's LoRA forward (not the sampler's short one)")
    ap.add_argument("--step-schemes", nargs="+", default=["none"], choices=list(SCHEMES),
                    help="the steps' rollout: the first is the report's step; each further one is timed "
                         "the same way after it (step_by_scheme)")
    ap.add_argument("--layers", type=int, help="depth of the random model (default: the shape's)")
    ap.add_argument("--train", choices=["lora", "full"], default="lora")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=16, help="rollouts: one group of --group-size by default")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--noise", choices=["counter", "generator"], default="counter",
                    help="the sampler's noise (generator: float64 Gumbel noise from CPU generators)")
    ap.add_argument("--micro-batch", type=int, help="rollout rows per sampler call (default: all)")
    ap.add_argument("--estimator", choices=["mc", "block_random"], default="block_random")
    ap.add_argument("--views", type=int, default=2, help="noised views per rollout (K)")
    ap.add_argument("--max-views-per-forward", type=int, help="view budget of scoring and the update")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="JSON output (default: print only)")
    return ap.parse_args(argv)


def _matmul_tflops() -> float:
    """The bf16 rate this GPU reaches on an 8192³ product (median of 10 after 3 warm-ups)."""
    x, y = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x @ y
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible (use --size tiny --device cpu)")
    if args.rows % args.group_size:
        raise SystemExit(f"--rows ({args.rows}) must be a multiple of --group-size ({args.group_size})")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    t0 = time.perf_counter()
    policy, shape = build(args)
    build_seconds = time.perf_counter() - t0
    inner = _inner(policy.model)
    cfg = inner.config
    base = [p for name, p in inner.named_parameters() if "lora_" not in name]  # the model without adapters
    n_params = sum(p.numel() for p in base)
    embed = inner.get_input_embeddings().weight.numel()
    n_matmul = sum(p.numel() for p in base if p.dim() == 2) - embed  # the lookup makes no FLOPs
    tokens = _Tokens(inner)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=not cuda, mixed_precision="bf16")
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    policy.model, opt = acc.prepare(policy.model, opt)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    vocab = cfg.vocab_size
    ids = torch.randint(5, min(vocab, len(policy.tokenizer)) if args.model else vocab,
                        (args.rows, args.prompt_length), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = policy.tokenizer.bos_token_id if policy.tokenizer.bos_token_id is not None else ids[0, 0]
    ids = ids.to(policy.device)
    run = scale._Run(train_config(args, args.step_schemes[0]), policy, None, acc, opt, params, ids, torch.ones_like(ids))
    source = (f"checkpoint {args.model}" if args.model else
              f"random {'native LLaDA' if args.model_code == 'native' else 'TinyDiffusionLM'}, {args.size} shape")
    layers = shape.num_hidden_layers if shape is not None else cfg.num_hidden_layers
    print(f"model: {source}, {n_params:,} parameters ({layers} layers), train {args.train}: {trainable:,} "
          f"trainable; built in {build_seconds:.1f} s", flush=True)
    partial: dict[str, Any] = {"command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
                               "complete": False, "model": {"source": source, "params": n_params, "layers": layers}}

    def save(key: str, value: Any) -> None:  # what is measured so far, kept if a later part fails
        partial[key] = value
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(partial, indent=2) + "\n")

    schemes = rollout_schemes(policy, args, ids, cuda, lambda done: save("rollout_schemes", done)) if args.schemes else {}
    peft_forward: dict[str, Any] = {}
    if args.schemes and args.also_peft_forward and args.train == "lora":
        # the same rollouts with peft's own LoRA forward in every layer, as before the sampler's short one
        # (stabledrl.models.lora.lean_adapters: the same tokens, fewer operations a call)
        with _peft_forward():
            peft_forward = rollout_schemes(policy, args, ids, cuda, lambda done: save("rollout_schemes_peft_forward", done),
                                           label=" with peft's LoRA forward")
    bare: dict[str, Any] = {}
    if args.schemes and args.also_without_adapters and args.train == "lora":
        # the same rollouts with the adapters off (peft's disable_adapter: the base layers alone, none of
        # LoRA's own kernels): what a fully fine-tuned model, or one sharded by FSDP, samples with
        with policy.model.disable_adapter():
            bare = rollout_schemes(policy, args, ids, cuda, lambda done: save("rollout_schemes_without_adapters", done),
                                   label=" without adapters")
    t0 = time.perf_counter()
    rl_step(run, tokens, 0)  # warm-up: kernels, AdamW's states
    warm = time.perf_counter() - t0
    print(f"warm-up step: {warm:.1f} s", flush=True)
    steps = [rl_step(run, tokens, 1 + r) for r in range(args.repeats)]
    if not cuda:  # one more step with every live tensor counted (scale.LiveBytes: torch keeps no CPU statistics)
        with scale.LiveBytes() as live:
            for t in scale._resident(run):
                live.add(t)
            steps.append(rl_step(run, tokens, 1 + args.repeats, live))
    save("steps", steps)
    by_scheme = {args.step_schemes[0]: _step_seconds(steps)}
    for name in args.step_schemes[1:]:  # the same step with another rollout (kernels and AdamW warm already)
        other = dataclasses.replace(run, cfg=train_config(args, name))
        by_scheme[name] = _step_seconds([rl_step(other, tokens, 1 + r) for r in range(args.repeats)])
        print(f"step, rollout {name}: {by_scheme[name]['step']:.2f} s (rollout {by_scheme[name]['rollout']:.2f} s)",
              flush=True)
        save("step_by_scheme", by_scheme)
    med = by_scheme[args.step_schemes[0]]
    last = steps[-1]
    width = shape.hidden_size if shape is not None else cfg.hidden_size
    dense, attn = flops_per_token(n_matmul, layers, width)
    backward = 2 if args.train == "full" else 1
    vocab = shape.vocab_size if shape is not None else cfg.vocab_size
    # the head's 2·V·d a token, not spent on the tokens whose logits the sampler did not ask for
    flops = {k: dense * last[k]["tokens"] + attn * last[k]["tokens_sq"] - 2 * vocab * width * last[k]["tokens_without_logits"]
             for k in ("rollout", "scoring")}
    flops["update"] = (1 + backward) * flops["scoring"]  # the same views; a view budget's no-grad pass not counted
    mm = _matmul_tflops() if cuda else None
    report: dict[str, Any] = {
        "command": partial["command"], "complete": True,
        "machine": {"device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
                    "gpu_bytes": torch.cuda.mem_get_info()[1] if cuda else None, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "platform": platform.platform(),
                    "matmul_bf16_tflops_8192": mm},
        "model": {"source": source, "params": n_params, "matmul_params": n_matmul,
                  "layers": layers, "hidden_size": width, "vocab_size": vocab,
                  "train": args.train, "trainable": trainable, "checkpointing": args.checkpointing},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "warmup_seconds": warm, "build_seconds": build_seconds,
        "median_seconds": med,
        "counts": last["counts"],
        "rollout_tokens_per_s": last["counts"]["completion_slots"] / med["rollout"],
        "rollout_schemes": schemes,
        "rollout_schemes_peft_forward": peft_forward,
        "rollout_schemes_without_adapters": bare,
        "step_by_scheme": by_scheme,
        "model_tflop": {k: v / 1e12 for k, v in flops.items()},
        "mfu": {k: flops[k] / med[k] / (args.peak_tflops * 1e12) for k in flops} if cuda else None,
        "peak_tflops": args.peak_tflops,
        "steps": steps,
    }
    measured = {k: max(s[k]["peak_bytes"] or 0 for s in steps) for k in PHASES}
    by = "torch.cuda.max_memory_allocated" if cuda else "LiveBytes (live tensor storages)"
    report["memory"] = {"measured_by": by,
                        "measured_phases": measured, "measured_peak": max(measured.values())}
    if shape is not None:
        lora_n = trainable if args.train == "lora" else 0
        pred = scale.predict_memory(shape, footprint(args, lora_n, args.rows, args.step_schemes[0]))
        mem = report.setdefault("memory", {})
        mem.update(predicted_peak=pred["peak"], predicted_phases=pred["phases"], predicted_terms=pred["terms"])
        mem["ratio_predicted_over_measured"] = pred["peak"] / mem["measured_peak"]
        for name, r in [*schemes.items(), *bare.items()]:  # the rollout alone (no AdamW states yet) vs the rollout phase
            r["predicted_rollout_bytes"] = scale.predict_memory(shape, footprint(args, lora_n, args.rows, name))["phases"]["rollout"]
    _print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return report


def _step_seconds(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each phase, and of the whole step, over `steps`."""
    med = {k: statistics.median(s[k]["seconds"] for s in steps) for k in PHASES}
    return {**med, "step": statistics.median(sum(s[k]["seconds"] for k in PHASES) for s in steps)}


def _size(x: float) -> str:
    return f"{x / GB:.2f} GB" if x >= 0.1 * GB else f"{x / 1e6:.3f} MB"


def _print(r: dict[str, Any]) -> None:
    s, m = r["median_seconds"], r.get("memory", {})
    print(f"device: {r['machine']['device']}; bf16 matmul 8192³: {r['machine']['matmul_bf16_tflops_8192'] or 0:.0f} "
          f"TFLOP/s; MFU against {r['peak_tflops']:.0f} TFLOP/s")
    print(f"step {s['step']:.2f} s: rollout {s['rollout']:.2f} s ({r['rollout_tokens_per_s']:.0f} tokens/s), "
          f"scoring {s['scoring']:.2f} s, update {s['update']:.2f} s, optimizer {s['optimizer']:.2f} s")
    if r["mfu"]:
        print("MFU: " + ", ".join(f"{k} {v:.1%}" for k, v in r["mfu"].items()))
    if "measured_peak" in m:
        print("peak memory measured: " + ", ".join(f"{k} {_size(v)}" for k, v in m["measured_phases"].items()))
    if "predicted_peak" in m:
        print("peak memory predicted: " + ", ".join(f"{k} {_size(v)}" for k, v in m["predicted_phases"].items()
                                                     if k != "start"))
    if "ratio_predicted_over_measured" in m:
        print(f"peak: measured {_size(m['measured_peak'])}, predicted {_size(m['predicted_peak'])}, "
              f"ratio {m['ratio_predicted_over_measured']:.3f}")


if __name__ == "__main__":
    main()
