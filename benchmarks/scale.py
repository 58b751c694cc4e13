"""Throughput and peak memory of one RL step at the presets' sizes, and a memory model for LLaDA-8B.

    python benchmarks/scale.py --threads 1       # CPU: the scaled-down LLaDA shape, full FT and LoRA
    python benchmarks/scale.py --shape llada-8b --preset gsm8k-llada --predict-only   # the memory model alone
    python benchmarks/scale.py --recipes     # per GPU for the shipped 8-GPU recipes (docs/gpu-check.md)
    # one GPU (not run here): LoRA on LLaDA-8B's shape; full fine-tuning is refused as predicted not to fit
    python benchmarks/scale.py --device cuda --preset gsm8k-llada --set prompts_per_step=2 \
        --set rollout.micro_batch=16 --set estimator.max_views_per_forward=8

The model is `TinyDiffusionLM`, randomly initialised from a config. Its block is LLaDA's
(pre-norm RMSNorm, bidirectional multi-head attention with RoPE, SwiGLU MLP, no biases, an
untied output head; LLaDA's q, k, v and ff_proj, up_proj are one matrix each here, which
changes no count), so with LLaDA-8B's config it has LLaDA-8B's 8,015,581,184 parameters.
That shape is built on the `meta` device to count them and feed the memory model (32 GB in
float32: no CPU here holds it) and is materialised only on a GPU. On CPU the default shape
is `llada-cpu`: the same block with LLaDA's proportions at width 256 and 8 layers.

One step is the trainer's (`stabledrl.train`, one process), wired from the library's own
components: `generate_micro_batched` rollouts, `plan_views` and `score_views` for ℓ_old (and
ℓ_ref under `drift_kl` or β > 0), then μ inner iterations of `score_views` with a graph (or
`backward_views` under `estimator.max_views_per_forward`), the preset's objective, clipping
and AdamW, the model and optimizer prepared by accelerate as the trainer prepares them
(autocast under `mixed_precision: bf16`). Deviations, so that the step needs no task:
prompts are random token ids (BOS, then tokens; no padding) of the preset's prompt length;
rewards are uniform random numbers (every group has variance, none is skipped); no
evaluation, checkpoint or metrics file; and the optimizer steps all parameters at once
(the trainer steps them in chunks to measure the update norm: `predict_memory` has both).

Measured, medians over `--repeats` steps after one warm-up step:
- rollout tokens/s: completion slots written per second of sampling;
- likelihood views/s: noised views scored per second without a graph (ℓ_old, ℓ_ref), and
  per second of the update's forward and backward;
- the step's split: rollout / scoring (ℓ_old, ℓ_ref) / update (forward, objective,
  backward) / optimizer (clip, step);
- peak memory, per phase, in one more step: on a GPU `torch.cuda.max_memory_allocated`; on
  CPU, where torch keeps no statistics of its allocator, the bytes of live tensors counted
  storage by storage (`LiveBytes`, the counterpart of memory_allocated), and, for scale, the
  process's peak RSS above its size before the model was built (which also holds the
  allocator's free lists and Python's own memory).

Several modes (full FT, LoRA) run in fresh processes, one each, so that their RSS peaks are
their own. Writes benchmarks/results/scale-<tag>.json: the machine, the shape, every
setting, every figure and the memory model's prediction beside each measured peak.

Shapes: B = P·G rollouts, Pl prompt columns, L completion slots, T = Pl + L, V vocabulary,
d width, I MLP width, H heads, nl layers, n views.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stabledrl.evaluate import EVAL_MICRO_BATCH
from stabledrl.likelihood import Completions, backward_views
from stabledrl.memory import (  # noqa: F401 (the memory model, read here by the tests and benchmarks)
    Footprint,
    Shape,
    activation_bytes,
    footprint,
    layer_params,
    llada_lora_param_count,
    lora_param_count,
    param_count,
    predict_memory,
    scored_length,
    views_per_row,
)
from stabledrl.models import TinyDiffusionConfig, TinyDiffusionLM, TinyPolicy, add_lora, base_policy
from stabledrl.objectives import group_advantages
from stabledrl.preflight import PUBLISHED_SHAPES, Machine, eval_rows_per_call, run_disk, run_footprint
from stabledrl.sampling import RolloutRequest, generate_micro_batched, row_generators
from stabledrl.settings import LoraSettings, TrainConfig
from stabledrl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


# ----------------------------------------------------------------------------- shapes
SHAPES = {
    # GSAI-ML/LLaDA-8B-Base (and -Instruct) config.json: d_model 4096, n_layers 32, n_heads 32,
    # n_kv_heads 32, mlp_hidden_size 12288 (block_type llama: ff_proj and up_proj 4096 -> 12288,
    # ff_out 12288 -> 4096), vocab_size = embedding_size 126464, include_bias false,
    # weight_tying false, layer_norm_type rms with affine weights and no bias, rope_theta 5e5,
    # max_sequence_length 4096. Its safetensors index: total_size 16,031,162,368 bytes of
    # bfloat16, i.e. 8,015,581,184 parameters, which `param_count` gives.
    "llada-8b": PUBLISHED_SHAPES["GSAI-ML/LLaDA-8B-Instruct"],
    # Dream-v0-Instruct-7B is Qwen2.5-7B's shape (its config.json: hidden 3584, 28 layers, 28 heads,
    # 4 key-value heads, intermediate 18944, vocabulary 152064, q/k/v biases, untied head):
    # 7,615,616,512 parameters, Qwen2.5-7B's published count. Not buildable as TinyDiffusionLM (GQA).
    "dream-7b": PUBLISHED_SHAPES["Dream-org/Dream-v0-Instruct-7B"],
    # SDAR-8B-Chat is Qwen3-8B's shape (hidden 4096, 36 layers, 32 heads, 8 key-value heads of 128,
    # intermediate 12288, vocabulary 151936, q/k norms, untied head): 8,190,735,360 parameters.
    "sdar-8b": PUBLISHED_SHAPES["JetLM/SDAR-8B-Chat"],
    # LLaDA's proportions (I = 3d, head width 128, V/d = 32) at width 256: 11.0 M parameters.
    "llada-cpu": Shape(8192, 256, 8, 2, 768),
    # for the tests
    "tiny": Shape(256, 32, 2, 2, 96, max_position_embeddings=256),
}


def buildable(shape: Shape) -> bool:
    """Whether `TinyDiffusionLM` has this shape: no grouped-query attention, biases or q/k norms."""
    return shape.kv_width == shape.hidden_size and not (shape.qkv_bias or shape.qk_norm)


def build_model(shape: Shape, device: str | torch.device, dtype: torch.dtype = torch.float32) -> TinyDiffusionLM:
    """A randomly initialised `TinyDiffusionLM` of this shape, made directly on `device`
    (``meta``: no memory, for counting). The special tokens are those of the char tokenizer."""
    if not buildable(shape):
        raise ValueError("TinyDiffusionLM has no grouped-query attention, q/k/v biases or q/k norms: this shape "
                         "is for the memory model (--predict-only, --recipes)")
    tok = build_char_tokenizer()
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "rope_theta", "max_position_embeddings")
    cfg = TinyDiffusionConfig(**{k: getattr(shape, k) for k in fields}, mask_token_id=tok.mask_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in `dtype`: a bfloat16 LoRA base never exists in float32
    try:
        with torch.device(device):
            return TinyDiffusionLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Preset:
    """The sizes of a step: a training config and the prompt length it meets."""

    config: TrainConfig
    prompt_length: int  # Pl: BOS and the prompt's tokens
    source: str


def preset(name: str, overrides: list[str] = ()) -> Preset:
    """`countdown`: the README's main preset, read from configs/countdown-stabledrl.yaml (P = 32,
    G = 8, K = 2 mc views, μ = 1), with its task's longest prompt and completion.
    `gsm8k-llada`: the StableDRL authors' GSM8K run of LLaDA-8B-Instruct (their
    configs/gsm8k_math_spg_snis.yaml): 8 processes × 4 accumulation rounds × 1 prompt = P = 32,
    G = 16 (8 generations × 2 repeats), L = 256 in 128 steps of blocks of 32, temperature 0.9,
    K = 2 views, μ = 2, AdamW lr 2e-6, weight decay 0.1, clip 0.2, bf16. The prompt length is
    ours, not theirs: 256 columns, as docs/scale-out.md assumes for GSM8K in LLaDA's chat
    template. Their SPG estimator is not implemented here: the step uses mc with K = 2."""
    from stabledrl.config import load_config  # imported here: gpu_check runs without dacite

    if name == "countdown":
        path = ROOT / "configs" / "countdown-stabledrl.yaml"
        cfg = load_config(TrainConfig, path, overrides)
        from stabledrl.tasks import get_task

        task = get_task(cfg.task.name, **cfg.task.options)
        if cfg.rollout.gen_length is None:
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gen_length=task.completion_length))
        return Preset(cfg, task.prompt_length + 1, str(path.relative_to(ROOT)))
    if name == "gsm8k-llada":
        data = {"prompts_per_step": 32, "group_size": 16, "mu": 2, "lr": 2e-6, "weight_decay": 0.1,
                "grad_clip": 0.2, "mixed_precision": "bf16", "drift_kl": False,
                "rollout": {"gen_length": 256, "steps": 128, "block_length": 32, "temperature": 0.9},
                "estimator": {"method": "mc", "num_samples": 2, "options": {"masking": "count"}},
                "objective": {"name": "stabledrl", "clip": "upper", "clip_max": 5.0}}
        return Preset(load_config(TrainConfig, data, overrides), 256,
                      "JianyuanZhong/StableDRL configs/gsm8k_math_spg_snis.yaml (sizes), mc estimator")
    raise ValueError(f"unknown preset {name!r}: countdown or gsm8k-llada")


# ----------------------------------------------------------------------------- measuring
class LiveBytes(TorchDispatchMode):
    """Bytes of live CPU tensors, counted storage by storage: the counterpart of
    `torch.cuda.memory_allocated`, which torch does not keep for its CPU allocator. A storage
    counts from the op that makes it until it is freed (a finalizer on the storage's Python
    object, which torch keeps for as long as the storage lives, views and autograd's saved
    tensors included); tensors made before the mode is entered are added with `add`. Memory a
    kernel allocates and frees inside itself is not seen. `peaks[phase]`: the largest count
    while that phase ran."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._seen: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        weakref.finalize(storage, self._free, key, size)
        if self.live > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.live

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


class _Clock:
    """Seconds per phase of a step and the peak memory of each phase: on a GPU from torch's
    allocator (synchronised at each phase's end, so that a phase's time includes its
    kernels), on CPU from a `LiveBytes` when one is given."""

    def __init__(self, cuda: bool, live: LiveBytes | None = None) -> None:
        self.cuda, self.live = cuda, live
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.live is not None:
            self.live.enter(phase)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                self.peaks[phase] = max(self.peaks.get(phase, 0), torch.cuda.max_memory_allocated())
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            if self.live is not None:
                self.peaks = dict(self.live.peaks)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ----------------------------------------------------------------------------- one RL step
@dataclass
class _Run:
    """What a step needs: the policy, its reference, the optimizer and the step's prompts."""

    cfg: TrainConfig
    policy: TinyPolicy
    reference: Any
    accelerator: Any
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    prompt_ids: torch.Tensor  # (B, Pl)
    prompt_mask: torch.Tensor  # (B, Pl)


def rl_step(run: _Run, step: int, clock: _Clock) -> dict[str, int]:
    """One step of the trainer (stabledrl.train, one process) on random prompts and rewards."""
    from stabledrl.objectives import ScoredBatch, objective_for
    from stabledrl.rollouts import RolloutBatch
    from stabledrl.scoring import StepScoring

    cfg, policy, acc = run.cfg, run.policy, run.accelerator
    B, G, L = run.prompt_ids.size(0), cfg.group_size, cfg.rollout.gen_length
    e = cfg.estimator
    with clock("rollout"):
        gens = row_generators(f"{cfg.seed}/{step}/0", 0, B)
        roll = generate_micro_batched(RolloutRequest(policy, run.prompt_ids, run.prompt_mask, L, gens, cfg.rollout,
                                                     micro_batch=cfg.rollout.micro_batch))
    comp, cmask = roll.completion_ids, roll.completion_mask  # (B, L)
    batch = RolloutBatch(run.prompt_ids, run.prompt_mask, comp, cmask, roll.unmask_step)
    objective = objective_for(cfg.objective)
    rewards = torch.rand(B, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))  # (B,): random rewards
    advantages = group_advantages(rewards, G, cfg.objective.advantage_scale)  # (B,)

    scoring = StepScoring(run, batch, step)  # the trainer's scoring (its rounds unused: one here)

    def plan(slot: int):  # the trainer's plan of seed slot `slot`
        return scoring.plan(slot)

    def score(pol, pl) -> torch.Tensor:  # (B,) or (B, L), on the CPU as in the trainer
        return scoring.own(pol, pl, batch)[0].cpu()

    ocmask = cmask.cpu()  # the objective's completion mask, beside the CPU ℓ

    scored = 0
    with clock("scoring"), torch.no_grad():
        plan_old = plan(1)
        old = score(policy, plan_old)
        scored += plan_old.num_views
        ref = None
        if run.reference is not None:
            with acc.autocast():  # a reference copy is not prepared: the precision of ℓ_old
                ref = score(run.reference, plan_old)
            scored += plan_old.num_views
        if cfg.objective.weight_masks:
            plan_w = plan(2)
            w_old = score(policy, plan_w)
            scored += plan_w.num_views
    two_pass = e.max_views_per_forward is not None
    trained = 0
    for it in range(cfg.mu):
        pl = plan_old if cfg.masks == "shared" else plan(3 + it)
        with clock("update"):
            w_kw = {}
            if cfg.objective.weight_masks:
                with torch.no_grad():
                    w_kw = {"weight_logp": score(policy, plan_w), "weight_old_logp": w_old}
            run.opt.zero_grad(set_to_none=True)
            if two_pass:  # ∂loss/∂ℓ on a leaf, pushed back one micro-batch of views at a time
                with torch.no_grad():
                    leaf = score(policy, pl).requires_grad_()
                res = objective(ScoredBatch(leaf, old, advantages, G, ocmask, ref_logp=ref, **w_kw))
                res.loss.backward()
                backward_views(policy, pl, Completions(cmask, prompt_ids=run.prompt_ids, completion_ids=comp,
                                                       prompt_mask=run.prompt_mask), leaf.grad.to(comp.device),
                               reduction=e.reduction, max_views_per_forward=e.max_views_per_forward,
                               backward=acc.backward)
            else:
                res = objective(ScoredBatch(score(policy, pl), old, advantages, G, ocmask, ref_logp=ref, **w_kw))
                acc.backward(res.loss)
            trained += pl.num_views
        with clock("optimizer"):
            acc.clip_grad_norm_(run.params, cfg.grad_clip)
            run.opt.step()
    return {"rows": B, "completion_slots": B * L, "scored_tokens": int(cmask.sum()), "views_scored": scored,
            "views_trained": trained, "forward_passes": roll.forward_passes}


def _resident(run: _Run) -> list[torch.Tensor]:
    """The tensors a step starts with: weights, buffers, gradients, AdamW states, prompts."""
    models = [run.policy.model] + ([run.reference.model] if isinstance(run.reference, TinyPolicy) else [])
    out = [t for m in models for t in (*m.parameters(), *m.buffers())]
    out += [p.grad for p in run.params if p.grad is not None]
    out += [v for s in run.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out + [run.prompt_ids, run.prompt_mask]


# ----------------------------------------------------------------------------- one mode
def _with_lora(cfg: TrainConfig, mode: str, lora: LoraSettings) -> TrainConfig:
    return cfg if mode == "full" else dataclasses.replace(cfg, lora=lora)


def run_mode(shape_name: str, pre: Preset, mode: str, device: str, *, repeats: int, lora: LoraSettings,
             lora_base_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Build the model, run one warm-up step and `repeats` timed steps (and, on CPU, one more
    under `LiveBytes`); return the figures and the memory model's prediction."""
    from stabledrl.training_run import _optimizer
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    shape = SHAPES[shape_name]
    cfg = _with_lora(pre.config, mode, lora)
    cuda = torch.device(device).type == "cuda"
    dtype = lora_base_dtype if mode == "lora" else torch.float32
    lora_n = lora_param_count(shape, lora.r) if mode == "lora" else 0
    f = footprint(cfg, pre.prompt_length, lora_params=lora_n, weight_bytes=dtype.itemsize, foreach=cuda)
    noise = cfg.rollout.noise_for(shape.vocab_size)
    f = dataclasses.replace(f, noise=noise, block_length=cfg.rollout.block_length, head_on_block=noise == "counter")
    predicted = predict_memory(shape, f)
    if cuda:  # rejected at start-up, not discovered as an out-of-memory error
        total = torch.cuda.mem_get_info()[1]
        if predicted["peak"] > 0.95 * total:
            return {"mode": mode, "skipped": f"predicted peak {predicted['peak'] / GB:.1f} GB > 95% of the GPU's "
                    f"{total / GB:.1f} GB (full fine-tuning of this shape needs FSDP: see --predict-only)",
                    "predicted": predicted, "footprint": dataclasses.asdict(f)}

    rss_before = _rss()
    policy = TinyPolicy(build_model(shape, device, dtype), build_char_tokenizer())
    reference = None
    if mode == "lora":  # as the trainer: the base model with the adapters off, no second copy
        add_lora(policy, cfg.lora, seed=cfg.seed)
        reference = base_policy(policy)
    elif (cfg.drift_kl or cfg.objective.needs_reference):  # the trainer loads a second copy of the initial model
        reference = TinyPolicy(copy.deepcopy(policy.model).requires_grad_(False), policy.tokenizer)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=not cuda, mixed_precision=cfg.mixed_precision)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = _optimizer(cfg, params)  # the trainer's optimizer, prepared as it prepares it
    policy.model, opt = acc.prepare(policy.model, opt)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    if mode == "lora" and sum(p.numel() for p in params) != lora_n:
        raise RuntimeError(f"peft made {sum(p.numel() for p in params)} adapter parameters, lora_param_count {lora_n}")
    B = cfg.prompts_per_step * cfg.group_size
    # BOS, then plain tokens (ids past the char tokenizer's five special tokens): (B, Pl)
    ids = torch.randint(5, shape.vocab_size, (B, pre.prompt_length), generator=torch.Generator().manual_seed(cfg.seed))
    ids[:, 0] = policy.tokenizer.bos_token_id
    ids = ids.to(device)
    run = _Run(cfg, policy, reference, acc, opt, params, ids, torch.ones_like(ids))

    rl_step(run, 0, _Clock(cuda))  # warm-up: AdamW's states are made here
    steps = []
    for r in range(repeats):
        clock = _Clock(cuda)
        t0 = time.perf_counter()
        counts = rl_step(run, 1 + r, clock)
        steps.append({"seconds": time.perf_counter() - t0, **{f"{k}_seconds": v for k, v in clock.seconds.items()},
                      **counts, **({"peaks": clock.peaks} if cuda else {})})
    if cuda:
        peaks = {k: max(s["peaks"][k] for s in steps) for k in steps[0]["peaks"]}
    else:  # one more step, with every live tensor counted
        live = LiveBytes()
        with live:
            for t in _resident(run):
                live.add(t)
            clock = _Clock(False, live)
            rl_step(run, 1 + repeats, clock)
        peaks = clock.peaks
    measured = max(peaks.values())
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k.endswith("seconds")}
    last = steps[-1]
    out = {
        "mode": mode, "params": predicted["params"], "trainable": sum(p.numel() for p in params),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "reference": "none" if reference is None else ("base model, adapters off" if mode == "lora" else "a copy"),
        "median_seconds": med,
        # shares of the summed step time (medians of different steps need not add up)
        "split": {k.removesuffix("_seconds"): sum(s[k] for s in steps) / sum(s["seconds"] for s in steps)
                  for k in med if k != "seconds"},
        "rollout_tokens_per_s": last["completion_slots"] / med["rollout_seconds"],
        "scoring_views_per_s": last["views_scored"] / med["scoring_seconds"],
        "update_views_per_s": last["views_trained"] / med["update_seconds"],
        "counts": {k: last[k] for k in ("rows", "completion_slots", "scored_tokens", "views_scored",
                                        "views_trained", "forward_passes")},
        "memory": {
            "measured_by": "torch.cuda.max_memory_allocated" if cuda else "LiveBytes (live tensor storages)",
            "measured_peak": measured, "measured_phases": peaks,
            "predicted_peak": predicted["peak"], "predicted_phases": predicted["phases"],
            "predicted_terms": predicted["terms"], "ratio_predicted_over_measured": predicted["peak"] / measured,
        },
        "footprint": dataclasses.asdict(f),
        "steps": steps,
    }
    if not cuda:
        rss = _peak_rss() - rss_before
        out["memory"].update(rss_peak_above_start=rss, ratio_predicted_over_rss=predicted["peak"] / rss)
    return out


# ----------------------------------------------------------------------------- predictions alone
def _largest(fits, hi: int) -> int:
    """The largest k in [1, hi] with fits(k) (fits is monotone); 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def predict_layouts(shape_name: str, pre: Preset, *, shards: int, lora: LoraSettings,
                    gpu_bytes: float) -> dict[str, Any]:
    """The memory model, per process, for full fine-tuning sharded over `shards` processes
    (FSDP, the trainer's chunked AdamW step, foreach) and for LoRA over a bfloat16 base in
    one process, at the preset's sizes, and what fits in `gpu_bytes`: the largest
    rollout.micro_batch and estimator.max_views_per_forward, and under FSDP the largest
    share of rows that fits without a view budget (docs/scale-out.md: with sharded
    parameters the trainer leaves `max_views_per_forward` unset)."""
    shape = SHAPES[shape_name]
    n_meta = sum(p.numel() for p in build_model(shape, "meta").parameters()) if buildable(shape) else param_count(shape)
    if n_meta != param_count(shape):
        raise RuntimeError(f"the meta model has {n_meta} parameters, param_count {param_count(shape)}")
    K = views_per_row(pre.config)
    out: dict[str, Any] = {"params": n_meta, "lora_params": lora_param_count(shape, lora.r), "gpu_bytes": gpu_bytes}
    full = footprint(pre.config, pre.prompt_length, shards=shards, optimizer_chunk=2**26, foreach=True)
    low = footprint(_with_lora(pre.config, "lora", lora), pre.prompt_length, lora_params=out["lora_params"],
                    weight_bytes=2, optimizer_chunk=2**26, foreach=True)
    for name, f in ((f"full FT, FSDP over {shards} processes", full), ("LoRA, one process", low)):
        share = -(-pre.config.prompts_per_step * pre.config.group_size // f.shards)
        predict = lambda **kw: predict_memory(shape, dataclasses.replace(f, **kw))  # noqa: E731
        peak = lambda **kw: predict(**kw)["peak"]  # noqa: E731
        rows = _largest(lambda k: peak(rows_per_call=k, views_per_forward=1) <= gpu_bytes, share)
        views = _largest(lambda k: peak(rows_per_call=1, views_per_forward=k) <= gpu_bytes, share * K)
        entry = {"footprint": dataclasses.asdict(f), "share_rows": share, **predict_memory(shape, f),
                 "rollout_bytes_per_row": predict(rows_per_call=max(2, f.rows_per_call))["phases"]["rollout"]
                 - predict(rows_per_call=max(1, f.rows_per_call - 1))["phases"]["rollout"],  # at the preset's size
                 "activation_bytes_per_view": activation_bytes(shape, f),
                 "fits": {"rollout.micro_batch": rows, "estimator.max_views_per_forward": views,
                          "peak": peak(rows_per_call=max(rows, 1), views_per_forward=max(views, 1))}}
        if f.shards > 1:
            entry["fits"]["rows_per_process_without_view_budget"] = _largest(
                lambda k: peak(rows_per_call=min(k, f.rows_per_call), views_per_forward=k * K) <= gpu_bytes, share)
        out[name] = entry
    return out


# ----------------------------------------------------------------------------- the recipes
@dataclass(frozen=True)
class Recipe:
    """What the memory model reads of a shipped recipe besides its config (configs/<name>.yaml,
    whose batch, rounds, lengths, estimator, micro-batches, precision and checkpointing it takes):
    the model's shape, the prompt length it meets, the processes (FSDP full shard, AdamW)."""

    shape: str
    block_size: int | None = None  # a block model's S, from its checkpoint (staircase scoring, KV-cached rollouts)
    prompt_length: int = 256  # Pl: the chat-templated GSM8K / MATH prompt, as docs/scale-out.md assumes
    processes: int = 8


RECIPES = {
    # the StableDRL authors' GSM8K / MATH run (docs/recipes.md); the MATH recipe has the same sizes
    "llada-8b-instruct-gsm8k-stabledrl": Recipe("llada-8b"),
    "dream-7b-instruct-gsm8k-stabledrl": Recipe("dream-7b"),
    "sdar-8b-chat-gsm8k-stabledrl": Recipe("sdar-8b", block_size=4),
    # d1's diffu-GRPO: LoRA over a bfloat16 base (the memory model leaves the frozen base unsharded)
    "llada-8b-instruct-gsm8k-d1-diffu-grpo": Recipe("llada-8b"),
}


def recipe_config(name: str, overrides: list[str] = ()) -> TrainConfig:
    """The shipped recipe configs/<name>.yaml."""
    from stabledrl.config import load_config  # imported here: gpu_check runs without dacite

    return load_config(TrainConfig, ROOT / "configs" / f"{name}.yaml", list(overrides))


def recipe_footprint(r: Recipe, cfg: TrainConfig) -> Footprint:
    """One GPU's footprint of `cfg` on the recipe's processes, as `stabledrl train`'s preflight
    builds it (`stabledrl.preflight.run_footprint`): full fine-tuning sharded over them, or the
    config's LoRA adapters, the config's precision, noise, blocks, checkpointing and evaluation
    (prompts as long as training's), and the allowances for CUDA, NCCL and the allocator."""
    machine = Machine(None, "GPU", r.processes, sharded=True)
    eval_rows = eval_rows_per_call(cfg, r.processes, EVAL_MICRO_BATCH)
    return run_footprint(cfg, SHAPES[r.shape], r.block_size, machine, (r.prompt_length,) * 2, eval_rows,
                         cfg.rollout.gen_length)


def predict_recipes(gpu_bytes: float) -> dict[str, Any]:
    """Per GPU, for each recipe as shipped (a round's rows scored and back-propagated at once, the
    rollouts in the config's micro-batches): the prediction, beside the same without
    checkpointing, and the step's P prompts in one round (accumulation_rounds: 1)."""
    out: dict[str, Any] = {"gpu_bytes": gpu_bytes}
    for name, r in RECIPES.items():
        shape, cfg = SHAPES[r.shape], recipe_config(name)
        f = recipe_footprint(r, cfg)
        pred = predict_memory(shape, f)
        one = predict_memory(shape, recipe_footprint(r, recipe_config(name, ["accumulation_rounds=1"])))
        P, G, R = cfg.prompts_per_step, cfg.group_size, cfg.accumulation_rounds
        out[name] = {"recipe": dataclasses.asdict(r), "params": param_count(shape),
                     "batch": {"prompts_per_step": P, "group_size": G, "accumulation_rounds": R,
                               "gen_length": cfg.rollout.gen_length, "views_per_row": views_per_row(cfg)},
                     "rows_per_round": -(-P // R * G // r.processes), "rollout.micro_batch": f.rows_per_call,
                     "views_per_forward": f.views_per_forward, "footprint": dataclasses.asdict(f),
                     "peak": pred["peak"], "phases": pred["phases"], "terms": pred["terms"],
                     "fits": pred["peak"] <= gpu_bytes,
                     "peak_without_checkpointing":
                         predict_memory(shape, dataclasses.replace(f, checkpointing=False))["peak"],
                     "one_round": {"rows": -(-P * G // r.processes), "phases": one["phases"], "peak": one["peak"]},
                     "disk": run_disk(shape, f, cfg, r.processes)}
    return out


def recipes_table(pred: dict[str, Any]) -> str:
    """The markdown table of `predict_recipes`."""
    lines = ["| recipe | parameters | prompts × G, rounds | rows per GPU and round | rollout.micro_batch | "
             "views per forward | predicted peak per GPU | largest phase | evaluation | without checkpointing | "
             "in one round | disk of the checkpoints |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in pred.items():
        if not isinstance(e, dict):
            continue
        phase, b = max(e["phases"], key=e["phases"].get), e["batch"]
        lines.append(f"| {name} | {e['params'] / 1e9:.2f} B | {b['prompts_per_step']} × {b['group_size']}, "
                     f"{b['accumulation_rounds']} | {e['rows_per_round']} | {e['rollout.micro_batch']} | "
                     f"{e['views_per_forward']} | {_gb(e['peak'])} | {phase} | {_gb(e['phases']['evaluation'])} | "
                     f"{_gb(e['peak_without_checkpointing'])} | {_gb(e['one_round']['peak'])} ({e['one_round']['rows']} rows) | "
                     f"{_gb(e['disk']['run'])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def _machine(device: str) -> dict[str, Any]:
    m = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
         "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
         "python": platform.python_version()}
    if torch.device(device).type == "cuda":
        m["gpu"] = torch.cuda.get_device_name()
        m["gpu_bytes"] = torch.cuda.mem_get_info()[1]
    return m


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: llada-8b on cuda, llada-cpu on cpu")
    ap.add_argument("--preset", choices=["countdown", "gsm8k-llada"], default="countdown")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the preset's training config, e.g. rollout.micro_batch=16")
    ap.add_argument("--prompt-length", type=int, help="prompt columns (BOS included); default: the preset's")
    ap.add_argument("--modes", default="full,lora", help="full, lora or both (each in a fresh process)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-base-dtype", choices=["float32", "bfloat16"],
                    help="the LoRA base's weights; default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--predict-only", action="store_true",
                    help="no model is materialised: the parameter count of the meta model and the memory model's "
                         "prediction for full FT under FSDP and for LoRA on one GPU")
    ap.add_argument("--recipes", action="store_true",
                    help="the memory model alone, per GPU, for the shipped recipes (8 GPUs, FSDP): "
                         "benchmarks/results/scale-recipes.json and a markdown table")
    ap.add_argument("--shards", type=int, default=8, help="--predict-only: FSDP processes of full fine-tuning")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="--predict-only: GB of one GPU")
    ap.add_argument("--tag", help="default: <shape>-<preset>")
    ap.add_argument("--out", help="default: benchmarks/results/scale-<tag>.json")
    ap.add_argument("--child-out", help=argparse.SUPPRESS)  # one mode, written here (internal)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible")
    shape_name = args.shape or ("llada-8b" if cuda else "llada-cpu")
    shape = SHAPES[shape_name]
    sets = list(args.set)
    pre = preset(args.preset, sets)
    if args.prompt_length:
        pre = dataclasses.replace(pre, prompt_length=args.prompt_length)
    lora = LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=0.0, target_modules=["all-linear"])
    base_dtype = getattr(torch, args.lora_base_dtype or ("bfloat16" if cuda else "float32"))
    tag = args.tag or f"{shape_name}-{args.preset}"
    out_path = Path(args.out or ROOT / "benchmarks" / "results" / f"scale-{tag}.json")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"full", "lora"}:
        ap.error("--modes: full, lora or full,lora")

    if args.child_out:  # one mode, in this process
        res = run_mode(shape_name, pre, modes[0], args.device, repeats=args.repeats, lora=lora,
                       lora_base_dtype=base_dtype)
        Path(args.child_out).write_text(json.dumps(res))
        return
    report: dict[str, Any] = {
        "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]), "machine": _machine(args.device),
        "shape": {"name": shape_name, **dataclasses.asdict(shape), "params": param_count(shape)},
        "preset": {"name": args.preset, "source": pre.source, "prompt_length": pre.prompt_length, "sets": sets,
                   "config": dataclasses.asdict(pre.config)},
        "settings": {"device": args.device, "threads": args.threads, "repeats": args.repeats,
                     "lora": dataclasses.asdict(lora), "lora_base_dtype": str(base_dtype).removeprefix("torch.")},
    }
    if args.recipes:
        pred = predict_recipes(args.gpu_memory * GB)
        path = Path(args.out or ROOT / "benchmarks" / "results" / "scale-recipes.json")
        path.write_text(json.dumps({"command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]),
                                    "predicted": pred}, indent=2) + "\n")
        print(recipes_table(pred))
        print(f"wrote {path}")
        return
    if args.predict_only:
        pred = predict_layouts(shape_name, pre, shards=args.shards, lora=lora, gpu_bytes=args.gpu_memory * GB)
        report["predicted"] = pred
        print(f"{shape_name}: {pred['params']:,} parameters (meta model); LoRA r={lora.r}: {pred['lora_params']:,}")
        for name, e in pred.items():
            if isinstance(e, dict):
                ph = ", ".join(f"{k} {_gb(v)}" for k, v in e["phases"].items())
                print(f"  {name}: predicted peak {_gb(e['peak'])} per process ({ph})")
    else:
        report["modes"] = []
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:  # a fresh process: its RSS peak is its own
                child = Path(tmp) / "mode.json"
                cmd = [sys.executable, __file__, *sys.argv[1:], "--modes", mode, "--child-out", str(child)]
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                res = json.loads(child.read_text())
            report["modes"].append(res)
            if "skipped" in res:
                print(f"{mode}: skipped: {res['skipped']}")
                continue
            m, s = res["memory"], res["median_seconds"]
            print(f"{mode}: step {s['seconds']:.2f} s (rollout {s['rollout_seconds']:.2f}, scoring "
                  f"{s['scoring_seconds']:.2f}, update {s['update_seconds']:.2f}, optimizer "
                  f"{s['optimizer_seconds']:.2f}); rollout {res['rollout_tokens_per_s']:.0f} tokens/s, "
                  f"scoring {res['scoring_views_per_s']:.1f} views/s, update {res['update_views_per_s']:.1f} views/s; "
                  f"peak {_gb(m['measured_peak'])} measured, {_gb(m['predicted_peak'])} predicted "
                  f"(ratio {m['ratio_predicted_over_measured']:.3f})", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
