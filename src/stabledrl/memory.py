"""The memory model: the peak bytes one process holds in each phase of an RL step (rollout,
scoring, update, optimizer) and of an evaluation, and the disk a run's checkpoints take, from
the model's shape and the run's settings alone (no model is built).

`predict_memory` is the model; docs/scale-out.md, "The memory model", lists every term, what
it counts and where it was measured. `stabledrl.preflight` feeds it a config before the
model loads; benchmarks/scale.py measures it against live tensors on a CPU and the allocator's
peak on a GPU.

Shapes: B = P·G rollouts, Pl prompt columns, L completion slots, T = Pl + L, V vocabulary,
d width, I MLP width, H heads, nl layers, n views.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["Shape", "Footprint", "layer_params", "param_count", "lora_param_count", "llada_lora_param_count",
           "scored_length", "activation_bytes", "layer_bytes", "predict_memory", "views_per_row", "footprint",
           "checkpoint_bytes", "NCCL_BYTES", "ALLOCATOR_SLACK"]

NCCL_BYTES = 10**9
"""Allowance per GPU process of a multi-process run for what torch's allocator does not count:
the CUDA context and NCCL's communicators and buffers. Not measured here (no GPU run has compared
`memory_allocated` with the device's free memory yet): an allowance to calibrate with gpu_check."""
ALLOCATOR_SLACK = 0.05
"""Allowance for the caching allocator's fragmentation, a share of the predicted peak (idem)."""


@dataclass(frozen=True)
class Shape:
    """A transformer's shape: LLaDA's block (pre-norm RMSNorm, RoPE attention, SwiGLU MLP),
    with Qwen2's q/k/v biases (Dream) or Qwen3's q/k norms (SDAR) and grouped heads."""

    vocab_size: int  # V
    hidden_size: int  # d
    num_hidden_layers: int  # nl
    num_attention_heads: int  # H
    intermediate_size: int  # I, the SwiGLU width
    rope_theta: float = 500000.0
    max_position_embeddings: int = 4096
    num_key_value_heads: int | None = None  # grouped-query attention (None: H)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3)
    tied_head: bool = False  # the output head is the embedding (SDAR-1.7B)
    head_dim: int | None = None  # Dh when config.json gives it (Qwen3); None: d / H

    @property
    def dh(self) -> int:
        """A head's width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        """The width of k and of v: (H_kv) · Dh."""
        return (self.num_key_value_heads or self.num_attention_heads) * self.dh

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shape:
        """The shape of a checkpoint's config.json: LLaDA's field names (d_model, n_layers, ...),
        or transformers' (hidden_size, num_hidden_layers, ...: Dream, SDAR, the tiny models).
        A KeyError names a field the config lacks."""
        if str(config.get("model_type", "")).lower() == "llada":
            return cls(config.get("embedding_size") or config["vocab_size"], config["d_model"], config["n_layers"],
                       config["n_heads"], config["mlp_hidden_size"], config.get("rope_theta", 10000.0),
                       config.get("max_sequence_length", 4096), config.get("n_kv_heads"),
                       qkv_bias=bool(config.get("include_bias")), tied_head=bool(config.get("weight_tying")))
        kind = str(config.get("model_type", "")).lower()  # Dream-v0's config says "Dream"
        return cls(config["vocab_size"], config["hidden_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], config["intermediate_size"], config.get("rope_theta", 10000.0),
                   config.get("max_position_embeddings", 4096), config.get("num_key_value_heads"),
                   qkv_bias=kind == "dream", qk_norm=kind == "sdar",
                   tied_head=bool(config.get("tie_word_embeddings", False)), head_dim=config.get("head_dim"))


def layer_params(shape: Shape) -> int:
    """Parameters of one layer: q, out (2·d·H·Dh: 2d² where H·Dh = d), k, v (2·d·kv, kv = d without
    GQA), gate, up (2dI), down (Id), two RMSNorm weights (2d); Qwen's q, k, v biases (H·Dh + 2kv)
    or q, k norms (2·Dh)."""
    d, I, kv, Dh = shape.hidden_size, shape.intermediate_size, shape.kv_width, shape.dh
    q = shape.num_attention_heads * Dh
    extra = (q + 2 * kv if shape.qkv_bias else 0) + (2 * Dh if shape.qk_norm else 0)
    return 2 * d * q + 2 * d * kv + 3 * d * I + 2 * d + extra


def param_count(shape: Shape) -> int:
    """Parameters of the shape: the layers, the embedding and the output head (Vd each; one of
    them when tied) and the final norm (d)."""
    heads = 1 if shape.tied_head else 2
    return shape.num_hidden_layers * layer_params(shape) + heads * shape.vocab_size * shape.hidden_size + shape.hidden_size


def lora_param_count(shape: Shape, r: int) -> int:
    """LoRA adapters of rank r on every linear layer but the output head (peft's
    "all-linear"): r·(in + out) for qkv (d -> 3d), proj (d -> d), gate_up (d -> 2I), down (I -> d).
    (LLaDA's own modules, with q, k, v and ff_proj, up_proj apart, take r·(11d + 3I) per layer.)"""
    d, I, kv = shape.hidden_size, shape.intermediate_size, shape.kv_width
    return shape.num_hidden_layers * r * ((2 * d + 2 * kv) + 2 * d + d + 2 * I + I + d)


def llada_lora_param_count(shape: Shape, r: int, targets: list[str]) -> int:
    """LoRA adapters of rank r on LLaDA's own linear modules named in `targets`, r·(in + out) each
    per layer: q_proj, attn_out (d -> d), k_proj, v_proj (d -> kv), ff_proj, up_proj (d -> I),
    ff_out (I -> d); "all-linear" names all seven (r·(11d + 3I) per layer without GQA)."""
    d, I, kv = shape.hidden_size, shape.intermediate_size, shape.kv_width
    sizes = {"q_proj": 2 * d, "attn_out": 2 * d, "k_proj": d + kv, "v_proj": d + kv, "ff_proj": d + I,
             "up_proj": d + I, "ff_out": I + d}
    names = list(sizes) if "all-linear" in targets else targets
    return shape.num_hidden_layers * r * sum(sizes[n] for n in names)


@dataclass(frozen=True)
class Footprint:
    """What the memory model reads besides the shape: one process's share of one step."""

    prompt_length: int  # Pl
    gen_length: int  # L
    rows_per_call: int  # A: rollout rows in one sampler call (rollout.micro_batch, else the share)
    views_per_forward: int  # views in one forward, with a graph (the update) or without (scoring)
    lora_params: int = 0  # trainable adapter parameters; 0: full fine-tuning
    weight_bytes: int = 4  # bytes per model weight: 4 (float32), 2 (a bfloat16 LoRA base)
    autocast: bool = False  # mixed_precision bf16: the forwards compute in bfloat16
    reference: bool = False  # a second copy of the weights (full FT with drift_kl or beta > 0)
    shards: int = 1  # FSDP / ZeRO-3 processes sharing weights, gradients and AdamW states
    optimizer_chunk: int | None = None  # elements stepped at a time (the trainer: 2**26); None: all
    foreach: bool = False  # torch's multi-tensor AdamW (its default for CUDA tensors)
    checkpointing: bool = False  # gradient checkpointing: a layer keeps only its input for the backward
    noise: str = "generator"  # the sampler's noise: generator (float64, every column) or counter
    block_length: int | None = None  # the sampler's block: counter noise draws over its columns only
    block_size: int | None = None  # a block model's S: KV-cached rollouts, staircase scoring [q ; y ; q̃ ; ỹ]
    approx_cache: bool = False  # rollout.approx_cache prefix / dual: a full-attention model's rollouts keep a KV cache
    accumulation_rounds: int = 1  # R > 1: the gradients of the rounds before are held through a round's update
    eval_rows_per_call: int = 0  # evaluation's rows per sampler call (0: no evaluation phase)
    eval_prompt_length: int = 0  # evaluation's Pl: its longest prompt (one padding for all its problems)
    eval_gen_length: int = 0  # evaluation's L
    reserve: bool = False  # add the allowances for CUDA, NCCL and the allocator (NCCL_BYTES, ALLOCATOR_SLACK)
    head_on_block: bool = False  # counter noise on stabledrl's own models: a sampler step's head runs on its block only


def scored_length(f: Footprint) -> int:
    """Tokens of one scored view: P + L, or a block model's staircase P + 2L + S (q̃ is at most a block)."""
    return f.prompt_length + f.gen_length + (f.gen_length + f.block_size if f.block_size else 0)


def activation_bytes(shape: Shape, f: Footprint) -> int:
    """Bytes kept for the backward by one view of T tokens (`scored_length`): T · (nl ·
    `layer_bytes` + what is kept once per token) + the log-softmax over the L completion slots
    (L·V, float32). With gradient checkpointing a layer keeps only its input, the residual stream:
    in the weights' dtype, or in bfloat16 under FSDP's mixed precision (its layers take and
    return bfloat16). docs/scale-out.md, "The memory model", lists the tensors."""
    T, L = scored_length(f), f.gen_length
    residual = 2 if f.autocast and f.shards > 1 and f.lora_params == 0 else f.weight_bytes
    per_layer = residual * shape.hidden_size if f.checkpointing else layer_bytes(shape, f)
    return T * (shape.num_hidden_layers * per_layer + _once_bytes(shape, f)) + 4 * L * shape.vocab_size


def layer_bytes(shape: Shape, f: Footprint) -> int:
    """Bytes one layer keeps for the backward per token, without checkpointing: in float32 the
    norms (4d; 2d under LoRA), q, k, v, the RoPE'd q and k, SDPA's output and its copy, proj's
    input and the residuals (9d), the MLP (4I), the mask (T), the logsumexp (H) and two rsqrt;
    under autocast bfloat16 but for the residuals and norms (docs/scale-out.md)."""
    d, I, H = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    T, full = scored_length(f), f.lora_params == 0
    if f.autocast:
        return 2 * (9 * d + 4 * I + T) + 4 * ((2 * d if full else 0) + 2 * d + H + 2)
    return 4 * ((4 * d if full else 2 * d) + 9 * d + 4 * I + T + H + 2)


def _once_bytes(shape: Shape, f: Footprint) -> int:
    """Bytes kept once per token, outside the layers: the embedding's output, RoPE's cos and
    sin, and with full fine-tuning the final norm and the head's input."""
    d, Dh, full = shape.hidden_size, shape.hidden_size // shape.num_attention_heads, f.lora_params == 0
    if f.autocast:
        return 4 * (d * (f.weight_bytes == 4) + Dh) + (6 * d if full else 0)
    return 4 * (d + Dh + (2 * d if full else 0))


def _resident(shape: Shape, f: Footprint) -> dict[str, int]:
    """The weights (a LoRA run's float32 adapters besides), the reference copy (never sharded),
    the float32 gradients and AdamW's m and v of the trainable parameters, sharded among
    `shards`; and the weight copies a forward holds: autocast's bfloat16 casts of every
    trainable float32 weight, or under FSDP the gathered unit and the prefetched next one."""
    N, full = param_count(shape), f.lora_params == 0
    train, shard = (N if full else f.lora_params), (f.shards if full else 1)
    act = 2 if f.autocast else 4
    terms = {"weights": N * f.weight_bytes // shard + (0 if full else 4 * f.lora_params),
             "reference": N * f.weight_bytes if f.reference and full else 0,
             "gradients": 4 * train // shard, "adamw_states": 8 * train // shard}
    if full and f.shards > 1:
        terms["forward_weight_copies"] = 2 * max(layer_params(shape), shape.vocab_size * shape.hidden_size) * act
    else:
        terms["forward_weight_copies"] = 2 * N if f.autocast and full else 0
    return terms


def _forward_peak(shape: Shape, f: Footprint, copies: int, rows: int, tokens: int, head: int | None = None) -> int:
    """A forward without a graph, which keeps nothing across layers: the weight copies, and the
    larger of a layer's temporaries and the head (the final residual, its norm, the logits) on
    `head` of the `tokens` columns (None: all)."""
    d, I, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    act = logit = 2 if f.autocast else 4
    head = tokens if head is None else head
    return copies + rows * max(tokens * (4 * I + 3 * d) * act, tokens * 3 * d * act + head * V * logit)


def _sampler_bytes(shape: Shape, f: Footprint, copies: int, rows: int, prompt: int, gen: int) -> int:
    """One sampler call of `rows` rows: a KV cache (a block model's, or Fast-dLLM's), and the
    largest of the forward beside the previous step's float32 logits (A, Tr, V), accelerate's
    float32 copy of bfloat16 logits, and the draw over the vocabulary: counter noise, 7 float32
    (N, V) over the block's eligible slots; generator noise, 40 bytes per logit of every
    completion column (float64 u, Gumbel noise, tempered logits and their sum; the float32
    softmax, log-softmax, exp and entropy product). With `head_on_block` the logits are the
    block's W columns only."""
    V, L = shape.vocab_size, gen
    Tr = f.block_size or prompt + gen  # the columns a sampler step feeds
    W = min(L, f.block_size or f.block_length or L)
    Tl = W if f.head_on_block else Tr  # the columns whose logits a step computes
    logit = 2 if f.autocast else 4
    held = rows * Tl * V * 4
    to_float32 = (logit + 4) if f.autocast else 0
    if f.noise == "counter":
        pick = rows * Tl * V * 4 + 28 * rows * W * V
    else:
        pick = rows * Tr * V * logit + (4 * rows * L * V if f.autocast else 0) + 40 * rows * L * V
    cached = f.block_size or f.approx_cache
    cache = 2 * rows * shape.num_hidden_layers * (prompt + L) * shape.kv_width * (2 if f.autocast else 4) if cached else 0
    return cache + max(held + _forward_peak(shape, f, copies, rows, Tr, Tl), held + rows * Tl * V * to_float32, pick)


def _update_terms(shape: Shape, f: Footprint, terms: dict[str, int]) -> dict[str, int]:
    """Scoring (a forward of n views without a graph, then the float32 logits and the
    log-softmax over the L slots, copied whole on CUDA: 8 bytes per logit of n·T·V measured on an
    H100) and the update: the views' activations, the head of its forward, the backward's first
    steps (the log-softmax's two gradients, then the logits' gradient with the head's), and with
    checkpointing one layer's activations while recomputed with the residual's gradients."""
    d, V, L, T, n = shape.hidden_size, shape.vocab_size, f.gen_length, scored_length(f), f.views_per_forward
    logit = act = 2 if f.autocast else 4
    to_float32 = (logit + 4) if f.autocast else 0
    head = n * V * (4 * T + 8 * L)
    copies = terms["forward_weight_copies"]
    return {"scoring_transient": max(_forward_peak(shape, f, copies, n, T), n * T * V * to_float32, head),
            "activations": n * activation_bytes(shape, f),
            "update_forward_head": max(n * T * V * to_float32, head) - 4 * n * L * V,
            "update_backward_transient": max(8 * n * L * V, n * T * V * logit + n * T * d * act
                                             + (4 * V * d if f.lora_params == 0 else 0)),
            "recompute": n * T * (layer_bytes(shape, f) + 8 * d) if f.checkpointing else 0}


def _optimizer_bytes(shape: Shape, f: Footprint) -> int:
    """AdamW's temporaries: √v and its quotient for the largest parameter (torch's per-tensor
    AdamW, on CPU), or √v of all that is stepped at once (foreach; `optimizer_chunk` bounds it
    and adds the trainer's copy of the chunk)."""
    full = f.lora_params == 0
    stepped = (param_count(shape) if full else f.lora_params) // (f.shards if full else 1)
    if f.foreach:
        chunk = stepped if f.optimizer_chunk is None else min(stepped, f.optimizer_chunk)
        return 4 * chunk * (2 if f.optimizer_chunk is not None else 1)
    return 2 * 4 * shape.vocab_size * shape.hidden_size if full else 0


def predict_memory(shape: Shape, f: Footprint) -> dict[str, Any]:
    """Peak bytes of one process by phase at steady state (AdamW's states exist; a step's
    gradients are held from its last backward to the next update's zero_grad): the terms
    (`_resident`, `_sampler_bytes`, `_update_terms`, `_optimizer_bytes`), the phases, the peak."""
    terms = _resident(shape, f)
    copies = terms["forward_weight_copies"]
    resident = terms["weights"] + terms["reference"] + terms["adamw_states"]
    terms["rollout_transient"] = _sampler_bytes(shape, f, copies, f.rows_per_call, f.prompt_length, f.gen_length)
    terms.update(_update_terms(shape, f, terms))
    terms["optimizer_transient"] = _optimizer_bytes(shape, f)
    # rounds 2..R of a step keep the gradients of the rounds before (float32, sharded) through their update
    terms["gradients_between_rounds"] = terms["gradients"] if f.accumulation_rounds > 1 else 0
    held = resident + terms["gradients"]
    phases = {
        "start": held,
        "rollout": held + terms["rollout_transient"],
        "scoring": held + terms["scoring_transient"],
        "update": resident + terms["gradients_between_rounds"] + copies + terms["activations"]
                  + max(terms["update_backward_transient"], terms["recompute"], terms["update_forward_head"]),
        "optimizer": held + terms["optimizer_transient"],
    }
    if f.eval_rows_per_call:
        terms["evaluation_transient"] = _sampler_bytes(shape, f, copies, f.eval_rows_per_call, f.eval_prompt_length,
                                                       f.eval_gen_length)
        phases["evaluation"] = held + terms["evaluation_transient"]
    if f.reserve:
        terms["reserve"] = (NCCL_BYTES if f.shards > 1 else 0) + int(ALLOCATOR_SLACK * max(phases.values()))
        phases = {k: v + terms["reserve"] for k, v in phases.items()}
    N = param_count(shape)
    return {"terms": terms, "phases": phases, "peak": max(phases.values()), "params": N,
            "trainable": N if f.lora_params == 0 else f.lora_params}


def views_per_row(cfg: Any) -> int:
    """Noised views a rollout gets from the estimator (ℓ_old's plan; the update reuses its size):
    K draws, each of sdmc's nodes (its default if unset); a blockwise draw is one staircase view."""
    from stabledrl.likelihood import planner_options

    e = cfg.estimator
    inner = e.options.get("inner", "mc") if e.method == "blockwise" else e.method
    if inner == "sdmc":
        return e.num_samples * {**planner_options("sdmc"), **e.options}["num_nodes"]
    if inner in ("mc", "mean_field", "block_random"):
        return e.num_samples
    raise ValueError(f"estimator.method {e.method!r}: the memory model reads mc, sdmc, mean_field, block_random and "
                     "blockwise (inner mc or sdmc)")


def footprint(cfg: Any, prompt_length: int, *, lora_params: int = 0, weight_bytes: int = 4,
              shards: int = 1, optimizer_chunk: int | None = None, foreach: bool = False) -> Footprint:
    """The footprint of one process of `shards` running `cfg` (a `TrainConfig`): its share of
    the P·G rows is sampled (in micro-batches), its share of one accumulation round's P/R·G rows
    scored and back-propagated (in view batches)."""
    rows = -(-cfg.prompts_per_step * cfg.group_size // shards)
    views = -(-cfg.prompts_per_step // cfg.accumulation_rounds * cfg.group_size // shards) * views_per_row(cfg)
    budget = cfg.estimator.max_views_per_forward
    return Footprint(prompt_length=prompt_length, gen_length=cfg.rollout.gen_length,
                     rows_per_call=min(rows, cfg.rollout.micro_batch or rows),
                     views_per_forward=min(views, budget or views),
                     lora_params=lora_params, weight_bytes=weight_bytes, autocast=cfg.mixed_precision == "bf16",
                     reference=cfg.lora is None and (cfg.drift_kl or cfg.objective.needs_reference), shards=shards,
                     optimizer_chunk=optimizer_chunk, foreach=foreach, accumulation_rounds=cfg.accumulation_rounds)


def checkpoint_bytes(shape: Shape, f: Footprint, *, processes: int, model_bytes: int,
                     final_bytes: int | None = None) -> dict[str, int]:
    """Disk of one checkpoint and of the run's final model: the model in `model_bytes` per
    weight (a LoRA run: its float32 adapters only), and the resume state: AdamW's m and v (8
    bytes per trainable parameter) and, under FSDP, the model's shards again (float32); final/
    in `final_bytes` per weight (None: `model_bytes`; LoRA: the adapters in it)."""
    N, full = param_count(shape), f.lora_params == 0
    model = N * model_bytes if full else 4 * f.lora_params
    final = (N if full else f.lora_params) * final_bytes if final_bytes else model
    state = 8 * (N if full else f.lora_params) + (4 * N if full and processes > 1 else 0)
    return {"model": model, "resume_state": state, "checkpoint": model + state, "final": final}


def with_eval(f: Footprint, rows: int, prompt_length: int, gen_length: int) -> Footprint:
    """`f` with an evaluation phase of `rows` rows a sampler call."""
    return dataclasses.replace(f, eval_rows_per_call=rows, eval_prompt_length=prompt_length, eval_gen_length=gen_length)
