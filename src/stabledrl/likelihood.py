"""Likelihood estimators for diffusion LMs: mc, sdmc, exact, mean_field, blockwise, path, coupled,
block_random (docs/methods.md, "Likelihood estimators": each method, and where it parts from
the papers).

A dLLM's log π(y|q) is intractable; RL needs an estimate ℓ(y). Every estimator here is
model-agnostic: it decides *which noised views* of each completion to score (a `ViewPlan`:
which slots are replaced by the mask token, with what weight) and asks the policy only for
logits. Splitting the plan from its evaluation gives common random numbers: one plan, drawn
once from a `torch.Generator`, can be scored under θ, θ_old and a reference, so their
difference carries no mask noise. Nothing here touches the global RNG.

The estimate is a weighted sum over views v of Σ_{i masked in v} log p_θ(y_i | x_v, q),
written into a per-token (B, L) tensor and summed over the scored slots (up to and including
the first EOS) into a (B,) estimate (`reduction="sum"`) or divided by the scored length
(`"mean"`). A block model takes ``blockwise`` (or ``path``), and only it takes ``blockwise``.

Shapes: B batch, P prompt columns, L completion slots, V vocabulary, Nv views,
K samples, N quadrature nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Literal

import numpy as np
import torch

from stabledrl.data import banned_token_ids, position_ids, stop_ids_of
from stabledrl.models.attention import (
    block_causal_attention_mask,
    block_offset,
    check_prompt_attention,
    completion_block_slices,
    completion_blocks,
    prompt_attention_of,
    staircase_inputs,
)
from stabledrl.models.policy import Policy
from stabledrl.settings import METHODS, Method

__all__ = [
    "ViewPlan",
    "LikelihoodEstimate",
    "Completions",
    "plan_views",
    "plan_for",
    "check_method_fits",
    "score_views",
    "backward_views",
    "estimate",
    "eubo",
    "completion_logits",
    "gauss_legendre",
    "planner",
    "planner_options",
    "PlanInputs",
    "PLANNERS",
    "METHODS",
]

MAX_EXACT_SLOTS = 16


@dataclass
class ViewPlan:
    """Which noised views to score, independent of any model."""

    seq_index: torch.Tensor
    """(Nv,) the sequence each view noises."""
    masked: torch.Tensor
    """(Nv, L) bool: the completion slots the view replaces by the mask token."""
    weight: torch.Tensor
    """(Nv, L) float64: the weight of each slot's log-probability in the view; 0 on the
    slots the view does not count (never a slot it leaves clean). mc, sdmc, exact: one
    value on the view's masked slots; blockwise: one per block; path: 1 on the slots
    committed at the view's step; mean_field: 1 on the scored slots (it masks all L)."""
    prompt_masked: torch.Tensor | None
    """(Nv, P) bool: prompt tokens replaced by the mask token (mean_field only)."""
    batch_size: int
    """B."""
    block_size: int | None = None
    """blockwise: views are scored in one staircase pass over [q ; y ; ỹ] with blocks of this size."""
    block_offset: torch.Tensor | None = None
    """(B,) the prompt tokens in each sequence's first completion block, which is that much
    shorter (`stabledrl.models.attention.block_offset`; ``sequence_blocks`` models); None: 0."""

    def __post_init__(self) -> None:
        if self.weight.shape != self.masked.shape or self.weight.dtype != torch.float64:
            raise ValueError(f"a plan's weight must be float64 of the masks' shape {tuple(self.masked.shape)}, got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")
        if (self.weight[~self.masked] != 0).any():
            raise ValueError("a plan weighs a slot its view leaves clean: weight must be 0 wherever masked is False")

    @property
    def num_views(self) -> int:
        return int(self.seq_index.numel())

    def rows(self, lo: int, hi: int) -> "ViewPlan":
        """The views of sequences lo..hi-1, renumbered from 0: a process's share of a
        plan drawn for the whole batch (so the shares together are the whole plan)."""
        if not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"rows {lo}..{hi} outside a plan of {self.batch_size} sequences")
        keep = (self.seq_index >= lo) & (self.seq_index < hi)  # (Nv,)
        return dataclasses.replace(
            self, seq_index=self.seq_index[keep] - lo, masked=self.masked[keep], weight=self.weight[keep],
            prompt_masked=None if self.prompt_masked is None else self.prompt_masked[keep], batch_size=hi - lo,
            block_offset=None if self.block_offset is None else self.block_offset[lo:hi])


@dataclass
class LikelihoodEstimate:
    sequence: torch.Tensor
    """(B,) estimate of log π(y|q) (reduction "sum") or of its per-token mean."""
    token: torch.Tensor
    """(B, L) per-slot terms; zero off the scored slots. `sequence` = token.sum(-1)
    (divided by the scored length for "mean")."""
    num_views: int
    """Noised views scored, i.e. forward passes of one sequence each."""
    views: torch.Tensor | None = None
    """(Nv, L) each view's unweighted log p(y_i | view) on the slots it masks and scores, 0
    elsewhere (what `eubo` reads)."""


@dataclass(frozen=True)
class Completions:
    """The rows a likelihood reads: completions and their prompts. A `RolloutBatch` has the same
    fields and serves `score_views`, `estimate` and `plan_for` as well (not `plan_views`, for
    which an `unmask_step` means method path); planning reads no `completion_ids`, scoring no
    `unmask_step`."""

    completion_mask: torch.Tensor
    """(B, L) bool: the scored slots."""
    prompt_ids: torch.Tensor | None = None
    """(B, P) left-padded."""
    completion_ids: torch.Tensor | None = None
    """(B, L)."""
    prompt_mask: torch.Tensor | None = None
    """(B, P) 1 for prompt tokens; None: no padding."""
    unmask_step: torch.Tensor | None = None
    """(B, L) the step at which the sampler committed each slot (path)."""


def gauss_legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of n-point Gauss–Legendre quadrature on (0, 1)."""
    if not 1 <= n <= 16:
        raise ValueError(f"the number of quadrature nodes must be in [1, 16], got {n}")
    x, w = np.polynomial.legendre.leggauss(n)
    return (x + 1) / 2, w / 2


# --- input checks ---------------------------------------------------------------------


def _check_inputs(
    policy: Policy, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
    prompt_mask: torch.Tensor | None,
) -> torch.Tensor:
    if getattr(policy, "mask_token_id", None) is None:
        raise ValueError("the policy has no mask_token_id: the estimators need to know the mask token")
    if completion_ids.dim() != 2 or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids and completion_ids must be (B, P) and (B, L), got "
                         f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
    if prompt_ids.size(0) != completion_ids.size(0):
        raise ValueError(f"{prompt_ids.size(0)} prompts for {completion_ids.size(0)} completions")
    if prompt_mask is not None and prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} does not match prompt_ids {tuple(prompt_ids.shape)}")
    if completion_mask.shape != completion_ids.shape:
        raise ValueError(f"completion_mask {tuple(completion_mask.shape)} does not match completion_ids "
                         f"{tuple(completion_ids.shape)}")
    scored = completion_mask.bool()
    if not scored.any(dim=1).all():
        empty = (~scored.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"empty completions (no scored slot) at rows {empty[:10]}: drop them before estimating")
    _check_convention(policy, completion_ids, scored)
    return scored


def _check_convention(policy: Policy, completion_ids: torch.Tensor, scored: torch.Tensor) -> None:
    """What the sampler can write (`stabledrl.data`'s convention): no scored token the sampler
    bans, a stop token only as the last scored slot, and PAD in every slot after the scored ones."""
    banned_ids = banned_token_ids(policy)
    if (scored & torch.isin(completion_ids, torch.as_tensor(banned_ids, device=completion_ids.device))).any():
        raise ValueError("completion_mask scores MASK or special tokens the sampler never draws "
                         f"({banned_ids}): they cannot be in a completion")
    stop = torch.isin(completion_ids, torch.as_tensor(stop_ids_of(policy), device=completion_ids.device))
    if (stop & scored & (scored.long().cumsum(-1) < scored.sum(-1, keepdim=True))).any():
        raise ValueError("completion_mask scores a stop token before the last scored slot: it does not match "
                         "completion_ids (use stabledrl.data.completion_mask(ids, stop_ids_of(policy)))")
    if (~scored & (completion_ids != policy.pad_token_id)).any():
        raise ValueError("an unscored completion slot is not PAD: after a completion's end only PAD may follow, "
                         "as in SFT targets and the sampler's fill (stabledrl.data.encode_completions)")


def _need_generator(generator: torch.Generator | None, method: str) -> torch.Generator:
    if generator is None:
        raise ValueError(f"method {method!r} draws random masks: pass generator=torch.Generator().manual_seed(s) "
                         "(the same generator state gives the same masks)")
    return generator


# --- plans ----------------------------------------------------------------------------


def _uniforms(B: int, K: int, stratified: bool, generator: torch.Generator) -> torch.Tensor:
    """(B, K) uniforms in (0, 1]; stratified: one per stratum ((k + u) / K, shuffled)."""
    u = torch.rand((B, K), generator=generator, dtype=torch.float64)
    if stratified:
        strata = torch.rand((B, K), generator=generator).argsort(dim=1).double()  # a random stratum order
        u = (strata + u) / K
    return 1.0 - u  # (0, 1]


def _random_subsets(scored: torch.Tensor, k: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(Nv, L) scored slots, (Nv,) counts -> (Nv, L) bool: k uniformly chosen scored slots."""
    scores = torch.rand(scored.shape, generator=generator).masked_fill(~scored, 2.0)  # unscored last
    rank = scores.argsort(dim=1).argsort(dim=1)  # (Nv, L) rank of each slot
    return rank < k[:, None]


def _all_subsets(slots: list[int], k: int, L: int) -> torch.Tensor:
    """(C(n, k), L) bool: every k-subset of `slots`, one per row."""
    combos = list(itertools.combinations(slots, k))
    m = torch.zeros((len(combos), L), dtype=torch.bool)
    for r, combo in enumerate(combos):
        m[r, list(combo)] = True
    return m


@dataclass(frozen=True)
class PlanInputs:
    """What a planner reads besides its own options (`plan_views` checks these)."""

    scored: torch.Tensor
    """(B, L) bool on the CPU: the scored slots."""
    num_samples: int
    """K."""
    generator: torch.Generator | None
    prompt_ids: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    bos_token_id: int | None
    block_size: int | None
    """A block model's S (blockwise; path on block models); None: full attention."""
    offset: torch.Tensor | None
    """(B,) the prompt tokens in each row's first block (``sequence_blocks``); None: 0."""
    unmask_step: torch.Tensor | None
    """(B, L) the step at which the sampler committed each slot (path)."""

    def draws(self, method: str) -> torch.Generator:
        """The generator, which a method that draws masks needs."""
        return _need_generator(self.generator, method)


PLANNERS: dict[str, Callable[..., ViewPlan]] = {}
"""method -> planner(inputs: PlanInputs, **options) -> ViewPlan. A planner's options are its
keyword-only parameters, with their defaults (`planner_options`), and it checks their values.
Register one with `@planner("name")` and add the name to `stabledrl.settings.Method`."""


def planner(method: str) -> Callable[[Callable[..., ViewPlan]], Callable[..., ViewPlan]]:
    def register(fn: Callable[..., ViewPlan]) -> Callable[..., ViewPlan]:
        PLANNERS[method] = fn
        return fn
    return register


def planner_options(method: str) -> dict[str, Any]:
    """The options `method` takes, with their defaults (None: the planner chooses, as
    blockwise's num_nodes and stratified, which depend on its inner method)."""
    if method not in PLANNERS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    params = inspect.signature(PLANNERS[method]).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _per_view(weight: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """(Nv,) a weight per view -> (Nv, L) on the view's masked slots, 0 elsewhere."""
    return weight[:, None] * masked


@planner("mc")
def _plan_mc(x: PlanInputs, *, masking: str = "count", stratified: bool = False, antithetic: bool = False) -> ViewPlan:
    scored, K, generator = x.scored, x.num_samples, x.draws("mc")
    B, L = scored.shape
    n = scored.sum(1)  # (B,)
    if antithetic:
        if masking != "bernoulli":
            raise ValueError("antithetic masks need masking='bernoulli' (the complement of a k-subset is an "
                             "(n-k)-subset, which the exact-count weights do not pair)")
        if K % 2:
            raise ValueError(f"antithetic=True needs an even num_samples, got {K}")
        draws = K // 2
    else:
        draws = K
    u = _uniforms(B, draws, stratified, generator)  # (B, D)
    seq = torch.arange(B).repeat_interleave(draws)  # (B*D,)
    sc = scored[seq]  # (B*D, L)
    if masking == "count":
        k = torch.ceil(u * n[:, None]).long().clamp(min=1).minimum(n[:, None]).flatten()  # (B*D,) in 1..n
        masked = _random_subsets(sc, k, generator)
        weight = n[seq].double() / k.double() / K
    elif masking == "bernoulli":
        t = u.flatten()  # (B*D,)
        masked = (torch.rand(sc.shape, generator=generator, dtype=torch.float64) < t[:, None]) & sc
        weight = 1.0 / t / K
        if antithetic:
            t_c = 1.0 - t
            masked = torch.cat([masked, sc & ~masked])
            weight = torch.cat([weight, torch.where(t_c > 0, 1.0 / t_c.clamp(min=1e-300), 0.0) / K])
            seq = torch.cat([seq, seq])
    else:
        raise ValueError(f"masking must be 'count' or 'bernoulli', got {masking!r}")
    return ViewPlan(seq, masked, _per_view(weight, masked), None, B)


@planner("sdmc")
def _plan_sdmc(x: PlanInputs, *, num_nodes: int = 2, weight: str = "count") -> ViewPlan:
    if weight not in ("count", "time"):
        raise ValueError(f"sdmc weight must be 'count' (n/k) or 'time' (1/t), got {weight!r}")
    scored, K, generator = x.scored, x.num_samples, x.draws("sdmc")
    B, L = scored.shape
    nodes, node_w = gauss_legendre(num_nodes)
    seqs, masks, weights = [], [], []
    for b in range(B):
        slots = scored[b].nonzero().flatten()  # (n,)
        n = int(slots.numel())
        for t_j, w_j in zip(nodes, node_w):
            k = min(n, max(1, math.floor(t_j * n + 0.5)))  # round half up, whatever n's parity
            subsets = math.comb(n, k)
            if K >= subsets:  # enumerate the node exactly
                m = _all_subsets(slots.tolist(), k, L)
                reps = subsets
            else:
                m = _random_subsets(scored[b].expand(K, L), torch.full((K,), k), generator)
                reps = K
            seqs.append(torch.full((reps,), b))
            masks.append(m)
            c = n / k if weight == "count" else 1.0 / t_j  # the node's factor (module docstring)
            weights.append(torch.full((reps,), w_j * c / reps, dtype=torch.float64))
    masked = torch.cat(masks)
    return ViewPlan(torch.cat(seqs), masked, _per_view(torch.cat(weights), masked), None, B)


@planner("exact")
def _plan_exact(x: PlanInputs) -> ViewPlan:
    scored = x.scored
    B, L = scored.shape
    seqs, masks, weights = [], [], []
    for b in range(B):
        slots = scored[b].nonzero().flatten().tolist()
        n = len(slots)
        if n > MAX_EXACT_SLOTS:
            raise ValueError(f"method 'exact' enumerates 2^n masks; row {b} has n={n} > {MAX_EXACT_SLOTS} slots")
        for k in range(1, n + 1):
            m = _all_subsets(slots, k, L)
            seqs.append(torch.full((len(m),), b))
            masks.append(m)
            weights.append(torch.full((len(m),), math.factorial(k - 1) * math.factorial(n - k) / math.factorial(n),
                                      dtype=torch.float64))
    masked = torch.cat(masks)
    return ViewPlan(torch.cat(seqs), masked, _per_view(torch.cat(weights), masked), None, B)


@planner("mean_field")
def _plan_mean_field(x: PlanInputs, *, p_prompt: float = 0.15, prompt_columns: str = "tokens") -> ViewPlan:
    """`prompt_columns`: which prompt columns may be masked: "tokens", the real prompt tokens
    but BOS (ours), or "all", every column, BOS and left padding included (d1's)."""
    if x.prompt_ids is None:
        raise ValueError("mean_field needs prompt_ids (it masks prompt tokens)")
    if not 0 <= p_prompt < 1:
        raise ValueError(f"p_prompt must be in [0, 1), got {p_prompt}")
    if prompt_columns not in ("tokens", "all"):
        raise ValueError(f"prompt_columns must be 'tokens' (not BOS) or 'all' (d1's), got {prompt_columns!r}")
    if x.num_samples != 1:
        raise ValueError("mean_field is a one-view estimate: num_samples must be 1")
    scored, prompt_ids = x.scored, x.prompt_ids.cpu()
    B, L = scored.shape
    maskable = torch.ones_like(prompt_ids, dtype=torch.bool)
    if prompt_columns == "tokens":
        if x.prompt_mask is not None:
            maskable = x.prompt_mask.cpu().bool()
        if x.bos_token_id is not None:
            maskable = maskable & (prompt_ids != x.bos_token_id)
    if p_prompt > 0:
        prompt_masked = (torch.rand(prompt_ids.shape, generator=x.draws("mean_field")) < p_prompt) & maskable  # (B, P)
    else:
        prompt_masked = torch.zeros_like(maskable)
    # The whole completion is masked; the scored slots are the counted ones.
    return ViewPlan(torch.arange(B), torch.ones((B, L), dtype=torch.bool), scored.double(), prompt_masked, B)


@planner("coupled")
def _plan_coupled(x: PlanInputs, *, t_min: float = 0.2, t_max: float = 0.8) -> ViewPlan:
    """DiffuCoder's coupled views (coupled-GRPO; module docstring): three views per sample,
    the whole completion masked (weight ½ on the scored slots), the scored slots with
    u < t masked (weight 1/(2t)) and the rest of them (weight 1/(2(1 − t))), with
    t ~ U(t_min, t_max) per row and u ~ U(0, 1) per slot. Each scored slot counts in the
    first view and in exactly one of the other two; K samples are averaged."""
    if not 0 < t_min <= t_max < 1:
        raise ValueError(f"coupled needs 0 < t_min <= t_max < 1, got t_min={t_min}, t_max={t_max}")
    scored, K, gen = x.scored, x.num_samples, x.draws("coupled")
    B, L = scored.shape
    t = t_min + (t_max - t_min) * torch.rand((B, K, 1), generator=gen, dtype=torch.float64)  # (B, K, 1)
    low = scored[:, None] & (torch.rand((B, K, L), generator=gen, dtype=torch.float64) < t)  # (B, K, L)
    high = scored[:, None] & ~low
    whole = torch.ones_like(low)
    masked = torch.stack([whole, low, high], dim=2)  # (B, K, 3, L)
    weight = torch.stack([0.5 * scored[:, None].double().expand(B, K, L), low / (2 * t), high / (2 * (1 - t))],
                         dim=2) / K  # (B, K, 3, L)
    seq = torch.arange(B).repeat_interleave(3 * K)  # (B·K·3,)
    return ViewPlan(seq, masked.reshape(-1, L), weight.reshape(-1, L), None, B)


@planner("block_random")
def _plan_block_random(x: PlanInputs, *, block_length: int = 32, p_prompt: float = 0.15) -> ViewPlan:
    """SPG's ``block_random`` masks (module docstring; the masks of the authors' StableDRL): per
    view, a block j of `block_length` completion slots, k ~ U{1..m} of its m scored slots,
    every slot after them and every unscored slot masked, each earlier completion slot and
    each real prompt token masked with probability `p_prompt`; every masked scored slot
    counts, with weight 1/(K·c), c = their number in the view: ℓ is a per-token mean."""
    if block_length < 1:
        raise ValueError(f"block_random's block_length must be >= 1, got {block_length}")
    if not 0 <= p_prompt < 1:
        raise ValueError(f"block_random's p_prompt must be in [0, 1), got {p_prompt}")
    if x.prompt_ids is None:
        raise ValueError("block_random needs prompt_ids (it masks prompt tokens)")
    scored, K, gen = x.scored, x.num_samples, x.draws("block_random")
    B, L = scored.shape
    num_blocks = math.ceil(L / block_length)
    if K > num_blocks:
        raise ValueError(f"block_random draws the K views' blocks without replacement: num_samples ({K}) must be "
                         f"at most the {num_blocks} blocks of {block_length} in {L} slots")
    n = scored.sum(1)  # (B,)
    filled = (n - 1) // block_length + 1  # (B,) the blocks that hold scored slots
    # The first K blocks of a random order of all blocks, wrapped onto the filled ones (the authors' draw:
    # not uniform over the filled blocks when their number does not divide num_blocks).
    order = torch.rand((B, num_blocks), generator=gen).argsort(dim=1)[:, :K]  # (B, K)
    seq = torch.arange(B).repeat_interleave(K)  # (Nv,)
    start = (order % filled[:, None]).flatten() * block_length  # (Nv,) first slot of each view's block
    m = (n[seq] - start).clamp(max=block_length)  # (Nv,) scored slots in the block, >= 1
    k = (torch.rand(m.shape, generator=gen, dtype=torch.float64) * m).long() + 1  # (Nv,) uniform on 1..m
    slot = torch.arange(L)[None, :]  # (1, L)
    in_block = (slot >= start[:, None]) & (slot < (start + m)[:, None])  # (Nv, L)
    drawn = _random_subsets(in_block, k, gen)
    after = (slot >= start[:, None]) & ~in_block  # the block's unscored slots and every later block
    before = (torch.rand((B * K, L), generator=gen) < p_prompt) & (slot < start[:, None])
    masked = drawn | after | before | ~scored[seq]
    counted = masked & scored[seq]
    weight = counted.double() / counted.sum(1, keepdim=True).double() / K
    real = (torch.ones_like(x.prompt_ids) if x.prompt_mask is None else x.prompt_mask).cpu().bool()  # (B, P)
    prompt_masked = (torch.rand(real[seq].shape, generator=gen) < p_prompt) & real[seq]
    return ViewPlan(seq, masked, weight, prompt_masked, B)


@planner("blockwise")
def _plan_blockwise(x: PlanInputs, *, inner: str = "mc", num_nodes: int | None = None,
                    stratified: bool | None = None) -> ViewPlan:
    """Per-block ELBO terms; `num_nodes` (sdmc, default 2) and `stratified` (mc, default
    False) belong to the inner method, and another inner method refuses them."""
    takes = {"mc": {"stratified"}, "sdmc": {"num_nodes"}, "exact": set()}
    if inner not in takes:
        raise ValueError(f"blockwise inner must be 'mc', 'sdmc' or 'exact', got {inner!r}")
    given = {name for name, v in (("num_nodes", num_nodes), ("stratified", stratified)) if v is not None}
    if given - takes[inner]:
        raise ValueError(f"blockwise with inner={inner!r} takes {sorted(takes[inner]) or 'no options'}, "
                         f"not {sorted(given - takes[inner])}")
    gen = None if inner == "exact" else x.draws("blockwise")
    return _blockwise_views(x.scored, x.num_samples, x.block_size, x.offset, inner,
                            2 if num_nodes is None else num_nodes, bool(stratified), gen)


def _blockwise_views(scored, K, block_size, offset, inner, num_nodes, stratified, generator) -> ViewPlan:
    """K views per sequence (N·K for sdmc); each view masks k_j of the n_j scored slots of
    every block j and gives them the weight n_j / k_j (times the view's own weight).
    `offset` (B,): each row's first block is that much shorter (None: 0)."""
    B, L = scored.shape
    blk_of = completion_blocks(torch.zeros(B, dtype=torch.long) if offset is None else offset, L, block_size)  # (B, L)
    NB = int(blk_of.max()) + 1 if L else 0
    member = [blk_of == j for j in range(NB)]  # (B, L) each: the slots of block j, per row
    n = torch.stack([(scored & m).sum(1) for m in member], dim=1)  # (B, NB) scored slots per block
    if inner == "exact":
        return _blockwise_exact_views(scored, offset, n, block_size)
    if inner == "mc":
        reps = K
        u = _uniforms(B * NB, K, stratified, generator).view(B, NB, K)  # (B, NB, K) one level per block and view
        k = torch.ceil(u * n[..., None]).long().clamp(min=1).minimum(n[..., None].clamp(min=1))  # (B, NB, K)
        k = k.permute(0, 2, 1)  # (B, K, NB)
        view_w = torch.full((B, K, NB), 1.0 / K, dtype=torch.float64)
    elif inner == "sdmc":
        nodes, node_w = gauss_legendre(num_nodes)
        reps = num_nodes * K
        t = torch.tensor(nodes, dtype=torch.float64).repeat_interleave(K)  # (N·K,) the node of each view
        k = torch.floor(t[None, :, None] * n[:, None, :] + 0.5).long().clamp(min=1)  # (B, N·K, NB)
        k = k.minimum(n[:, None, :].clamp(min=1))
        view_w = torch.tensor(node_w, dtype=torch.float64).repeat_interleave(K)[None, :, None] / K
        view_w = view_w.expand(B, reps, NB)
    seq = torch.arange(B).repeat_interleave(reps)  # (Nv,)
    masked = torch.zeros((B * reps, L), dtype=torch.bool)
    weight = torch.zeros((B * reps, L), dtype=torch.float64)
    for j in range(NB):
        cols = member[j].any(0).nonzero().flatten()
        blk = slice(int(cols[0]), int(cols[-1]) + 1)  # the columns of block j in some row
        inside = member[j][seq, blk]  # (Nv, W) the row's own slots of block j (all, without offsets)
        kj = k[:, :, j].flatten()  # (Nv,)
        nj = n[seq, j]  # (Nv,)
        sub = _random_subsets(scored[seq, blk] & inside, kj, generator) & (nj > 0)[:, None]  # (Nv, W)
        masked[:, blk] |= sub
        w = torch.where(nj > 0, nj.double() / kj.double(), 0.0) * view_w[:, :, j].flatten()
        weight[:, blk] = torch.where(inside & sub, w[:, None], weight[:, blk])
    return ViewPlan(seq, masked, weight, None, B, block_size=block_size, block_offset=offset)


def _blockwise_exact_views(scored, offset, n, block_size) -> ViewPlan:
    """Every non-empty subset of every block, with the exact-ELBO weights; view r carries
    the r-th subset of each block (blocks with fewer subsets are left clean: a noisy block
    is invisible to the other blocks, so they can share views)."""
    B, L = scored.shape
    if int(n.max()) > MAX_EXACT_SLOTS:
        raise ValueError(f"inner 'exact' enumerates 2^n masks per block; a block has n={int(n.max())} > "
                         f"{MAX_EXACT_SLOTS} slots")
    seqs, masks, weights = [], [], []
    for b in range(B):
        blocks = completion_block_slices(0 if offset is None else int(offset[b]), L, block_size)
        per_block = []
        for blk in blocks:
            slots = scored[b, blk].nonzero().flatten().add(blk.start).tolist()
            m = len(slots)
            rows = [(_all_subsets(slots, kk, L), math.factorial(kk - 1) * math.factorial(m - kk) / math.factorial(m))
                    for kk in range(1, m + 1)]
            per_block.append(rows)
        nv = max(sum(len(r[0]) for r in rows) for rows in per_block)
        mb = torch.zeros((nv, L), dtype=torch.bool)
        wb = torch.zeros((nv, L), dtype=torch.float64)
        for blk, rows in zip(blocks, per_block):
            r0 = 0
            for subsets, w in rows:
                mb[r0 : r0 + len(subsets), blk] = subsets[:, blk]
                wb[r0 : r0 + len(subsets), blk] = subsets[:, blk].double() * w
                r0 += len(subsets)
        seqs.append(torch.full((nv,), b))
        masks.append(mb)
        weights.append(wb)
    return ViewPlan(torch.cat(seqs), torch.cat(masks), torch.cat(weights), None, B, block_size=block_size,
                    block_offset=offset)


@planner("path")
def _plan_path(x: PlanInputs) -> ViewPlan:
    if x.unmask_step is None:
        raise ValueError("method 'path' needs the rollouts' unmask_step")
    if x.num_samples != 1:
        raise ValueError("path is deterministic given the unmask order: num_samples must be 1")
    return _path_views(x.scored, x.unmask_step.cpu(), x.block_size, x.offset)


def _path_views(scored: torch.Tensor, step: torch.Tensor, block_size: int | None,
                offset: torch.Tensor | None = None) -> ViewPlan:
    """Views replaying each rollout's decoding: at step s, the slots committed at s or
    later are masked and those committed at s count (weight 1). Block models: view j masks,
    in every block, the slots from the block's j-th step on (blocks with fewer steps are
    left clean); the steps are those of the block's scored slots."""
    B, L = scored.shape
    if step.shape != scored.shape:
        raise ValueError(f"unmask_step {tuple(step.shape)} does not match the completions {tuple(scored.shape)}")
    if (step[scored] < 0).any():
        raise ValueError("unmask_step has scored slots that were never committed (-1): pass the rollout's own "
                         "GenerationOutput.unmask_step")
    seqs, masks, weights = [], [], []
    for b in range(B):
        blocks = ([slice(0, L)] if block_size is None
                  else completion_block_slices(0 if offset is None else int(offset[b]), L, block_size))
        firsts = [step[b, blk][scored[b, blk]].unique() for blk in blocks]  # each block's steps, ascending
        nv = max(len(f) for f in firsts)
        mb = torch.zeros((nv, L), dtype=torch.bool)
        wb = torch.zeros((nv, L), dtype=torch.float64)
        for blk, f in zip(blocks, firsts):
            for j, s in enumerate(f.tolist()):
                mb[j, blk] = step[b, blk] >= s
                wb[j, blk] = ((step[b, blk] == s) & scored[b, blk]).double()
        seqs.append(torch.full((nv,), b))
        masks.append(mb)
        weights.append(wb)
    return ViewPlan(torch.cat(seqs), torch.cat(masks), torch.cat(weights), None, B, block_size=block_size,
                    block_offset=offset)


def plan_views(
    method: Method,
    rows: Any,
    *,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    bos_token_id: int | None = None,
    block_size: int | None = None,
    prompt_attention: str = "bidirectional",
    **options,
) -> ViewPlan:
    """Draw the noised views of `method` for `rows` (a `Completions`; a `RolloutBatch` only for
    path, otherwise use `plan_for`: rows with an `unmask_step` are for path alone), whose
    scored slots are `rows.completion_mask` (B, L). The same generator state gives the same plan.
    `block_size` is the block model's S (blockwise, and path on block models) and
    `prompt_attention` where its prompt's blocks fall (the policy's ``prompt_attention``):
    under ``sequence_blocks`` each row's first block holds the prompt's tail, so the plan's
    blocks depend on the prompt lengths (`rows.prompt_mask` is then required);
    `rows.unmask_step` (B, L) the step at which the sampler committed each slot (path only).

    Options by method (`planner_options(method)`; an option another method takes is an
    error, not ignored): mc: masking ("count" | "bernoulli"), stratified, antithetic;
    sdmc: num_nodes, weight ("count" | "time"); mean_field: p_prompt, prompt_columns
    ("tokens" | "all"); coupled: t_min, t_max; block_random: block_length, p_prompt;
    blockwise: inner ("mc" | "sdmc" | "exact"), num_nodes, stratified."""
    completion_mask, prompt_ids, prompt_mask, unmask_step = (
        rows.completion_mask, rows.prompt_ids, rows.prompt_mask, rows.unmask_step)
    takes = planner_options(method)
    unknown = set(options) - set(takes)
    if unknown:
        raise ValueError(f"method {method!r} takes the options {sorted(takes)}, not {sorted(unknown)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if method == "blockwise" and block_size is None:
        raise ValueError("method 'blockwise' needs block_size (the block model's S)")
    if method not in ("blockwise", "path") and block_size is not None:
        raise ValueError(f"block_size is for the methods 'blockwise' and 'path', not {method!r}")
    if method != "path" and unmask_step is not None:
        raise ValueError("method 'path' needs the rollouts' unmask_step, and only it takes one")
    check_prompt_attention(prompt_attention)
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    offset = None  # the blocks start at the first completion slot
    if block_size is not None and prompt_attention == "sequence_blocks":
        if prompt_mask is None:
            raise ValueError("prompt_attention 'sequence_blocks' needs the prompt_mask: each row's first block "
                             "holds its prompt's tail")
        offset = block_offset(prompt_mask.cpu(), block_size, prompt_attention)  # (B,)
    inputs = PlanInputs(completion_mask.bool().cpu(), num_samples, generator, prompt_ids, prompt_mask, bos_token_id,
                        block_size, offset, unmask_step)
    return PLANNERS[method](inputs, **options)


def check_method_fits(method: str, policy: Policy) -> None:
    """A block model's likelihood is a sum of per-block terms: it takes ``blockwise`` (or
    ``path``), and only it takes ``blockwise``."""
    block = getattr(policy, "attention_kind", "full") == "block"
    if method != "path" and block != (method == "blockwise"):
        raise ValueError(f"estimator method {method!r} does not fit a {'block' if block else 'full'}-attention "
                         "model: a block policy takes 'blockwise' (or 'path'), any other policy mc, sdmc, "
                         "mean_field, coupled, block_random, exact (or path)")


def plan_for(policy: Policy, method: Method, rows: Any, *, generator: torch.Generator | None = None,
             num_samples: int = 1, **options) -> ViewPlan:
    """`plan_views` for `policy`'s kind (its block size and prompt blocks, its BOS) and for
    `rows`, anything with `completion_mask`, `prompt_ids`, `prompt_mask` and, for ``path``,
    `unmask_step`; the method must fit the model (`check_method_fits`)."""
    check_method_fits(method, policy)
    block = getattr(policy, "attention_kind", "full") == "block"
    rows = Completions(rows.completion_mask, prompt_ids=rows.prompt_ids, prompt_mask=rows.prompt_mask,
                       unmask_step=rows.unmask_step if method == "path" else None)
    return plan_views(
        method, rows, num_samples=num_samples, generator=generator,
        bos_token_id=getattr(policy.tokenizer, "bos_token_id", None),
        block_size=policy.block_size if method == "blockwise" or (method == "path" and block) else None,
        prompt_attention=prompt_attention_of(policy) if block else "bidirectional", **options,
    )


# --- scoring --------------------------------------------------------------------------


def completion_logits(
    policy: Policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor,
    block_size: int | None,
) -> torch.Tensor:
    """(B, L, V) the policy's logits at the completion slots of its noised input.

    `block_size` None: one pass over [q ; ỹ] (`noisy`, with mask tokens), full attention.
    Set (a block model's S): one staircase pass over [q ; y ; q̃ ; ỹ] (`clean` is y), each
    noisy block seeing the prompt and the clean blocks before it, read at ỹ
    (`stabledrl.models.attention.staircase_inputs`, under the policy's ``prompt_attention``).
    The one place the likelihood estimators, the SFT loss and the benchmarks build that input."""
    L = noisy.size(1)
    if block_size is not None:
        x, attn, pos = staircase_inputs(prompt_ids, prompt_mask, clean, noisy, block_size,
                                        prompt_attention_of(policy))  # (B, T), (B, T, T), (B, T)
        return policy.logits(x, attn, pos)[:, -L:]
    x = torch.cat([prompt_ids, noisy], dim=1)  # (B, P+L)
    attn = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
    return policy.logits(x, attn, position_ids(attn))[:, -L:]


def _view_logp(
    policy: Policy, plan: ViewPlan, idx: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor, completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views `idx`: (n, L) log p(y_i | view) on the slots each view masks and scores, 0
    elsewhere, and (n,) their sequences."""
    device = completion_ids.device
    b = plan.seq_index[idx].to(device)  # (n,)
    masked = plan.masked[idx].to(device)  # (n, L)
    comp = completion_ids[b].masked_fill(masked, policy.mask_token_id)  # (n, L)
    prm = prompt_ids[b]  # (n, P)
    if plan.prompt_masked is not None:
        prm = prm.masked_fill(plan.prompt_masked[idx].to(device), policy.mask_token_id)
    logits = completion_logits(policy, prm, prompt_mask[b], completion_ids[b], comp, plan.block_size).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[b][..., None]).squeeze(-1)  # (n, L)
    return torch.where(masked & completion_mask[b], logp, torch.zeros_like(logp)), b


def _view_terms(
    policy: Policy, plan: ViewPlan, idx: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor, completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views `idx`: (n, L) weighted terms, (n,) their sequences and the (n, L) log-probs (`_view_logp`)."""
    logp, b = _view_logp(policy, plan, idx, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return logp * plan.weight[idx].to(device=logp.device, dtype=logp.dtype), b, logp


def eubo(plan: ViewPlan, view_logp: torch.Tensor, completion_mask: torch.Tensor, *, beta: float) -> torch.Tensor:
    """SPG's evidence upper bound per token (Wang et al. 2025; docs/methods.md, "spg"), from
    the (Nv, L) log-probabilities of a plan's views (`LikelihoodEstimate.views` of `score_views`):

        a_i = (1/K_b) Σ_v p_v(y_i)^β m_vi / t_v,   EUBO_b = (1/β) · mean over {i : a_i > 0} of log a_i,

    K_b the views of sequence b, m_vi whether view v masks scored slot i, t_v = (masked
    scored slots of v) / n_b its masking rate. Computed in log space (a log-sum-exp over
    the views), so a p^β below float32's range still counts (the authors' code loses it
    and drops the slot). (B,), differentiable through `view_logp`."""
    if beta <= 0:
        raise ValueError(f"the EUBO's beta must be positive, got {beta}")
    scored = completion_mask.bool()
    B, L = scored.shape
    if view_logp.shape != (plan.num_views, L):
        raise ValueError(f"view_logp must be ({plan.num_views}, {L}), got {tuple(view_logp.shape)}")
    b = plan.seq_index.to(view_logp.device)  # (Nv,)
    counted = plan.masked.to(view_logp.device) & scored[b]  # (Nv, L)
    t = counted.sum(1) / scored.sum(1)[b]  # (Nv,) each view's masking rate
    views = torch.bincount(b, minlength=B)[b]  # (Nv,) K_b of each view's sequence
    log_w = -torch.log(views * t.clamp(min=1e-30)).to(view_logp.dtype)  # log 1/(K t), (Nv,)
    z = (beta * view_logp + log_w[:, None]).masked_fill(~counted, -math.inf)  # (Nv, L)
    top = torch.full((B, L), -math.inf, dtype=z.dtype, device=z.device).scatter_reduce(
        0, b[:, None].expand_as(z), z.detach(), "amax")  # (B, L) the largest term of each slot
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # (B, L) a slot no view masks: 0
    total = torch.zeros((B, L), dtype=z.dtype, device=z.device).index_add(0, b, torch.exp(z - top[b]))
    present = total > 0  # a_i > 0: some view masks slot i
    log_a = top + torch.log(total.clamp(min=1e-30))
    return (log_a * present).sum(1) / present.sum(1).clamp(min=1) / beta


def block_logprobs_by_separate_passes(
    policy: Policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    masked: torch.Tensor,
) -> torch.Tensor:
    """(B, L) log p(y_i | q, y_<b, ỹ_b) for slot i of block b, ỹ_b = y_b with `masked`
    slots replaced by MASK: NB separate passes over [q ; y_<b ; ỹ_b] under the block-causal
    mask of the policy's `prompt_attention` (a row's block b may end before another's: the
    pass runs to the last end, and the later slots, clean, are hidden from block b). The
    slow reference that the one staircase pass of `blockwise` equals (tests and
    benchmarks/block.py); not used in training."""
    P, L, S = prompt_ids.size(1), completion_ids.size(1), policy.block_size
    conv = prompt_attention_of(policy)
    pos = position_ids(torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1))  # (B, P+L)
    blk_of = completion_blocks(block_offset(prompt_mask, S, conv), L, S)  # (B, L)
    out = torch.zeros(completion_ids.shape, device=completion_ids.device)
    for j in range(int(blk_of.max()) + 1 if L else 0):
        member = blk_of == j  # (B, L)
        cols = member.any(0).nonzero().flatten()
        lo, hi = int(cols[0]), int(cols[-1]) + 1
        noisy = completion_ids[:, :hi].masked_fill(masked[:, :hi] & member[:, :hi], policy.mask_token_id)
        x = torch.cat([prompt_ids, noisy], dim=1)  # (B, P+hi): [q ; y_<j ; ỹ_j ; (later slots, hidden)]
        attn = block_causal_attention_mask(prompt_mask, hi, S, conv)
        logits = policy.logits(x, attn, pos[:, : P + hi])
        logp = logits[:, P + lo :].float().log_softmax(-1)  # (B, W, V)
        logp = logp.gather(-1, completion_ids[:, lo:hi, None]).squeeze(-1)  # (B, W)
        out[:, lo:hi] = torch.where(member[:, lo:hi], logp, out[:, lo:hi])
    return out


def _check_scoring(policy, plan, prompt_ids, completion_ids, completion_mask, prompt_mask, reduction):
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    kind = getattr(policy, "attention_kind", "full")
    if plan.block_size is None and kind == "block":
        raise ValueError("a block-diffusion policy needs the 'blockwise' estimator (its likelihood is a sum of "
                         "per-block terms over the staircase); full-attention plans do not apply")
    if plan.block_size is not None and (kind != "block" or plan.block_size != policy.block_size):
        raise ValueError(f"a blockwise plan with block size {plan.block_size} needs a block policy with the same "
                         f"block size (this one: {kind}, block size {getattr(policy, 'block_size', None)})")
    if plan.batch_size != completion_ids.size(0):
        raise ValueError(f"the plan is for {plan.batch_size} sequences, got {completion_ids.size(0)}")
    conv = prompt_attention_of(policy)
    if plan.block_size is not None and (plan.block_offset is not None or conv == "sequence_blocks"):
        # The plan's blocks must be the model's: under sequence_blocks the prompt's tail shortens the first.
        pm = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask
        want = block_offset(pm.cpu(), plan.block_size, conv)  # (B,)
        have = torch.zeros_like(want) if plan.block_offset is None else plan.block_offset
        if not torch.equal(have, want):
            raise ValueError(f"the plan's blocks are not the policy's: its prompt_attention is {conv!r} (each row's "
                             "first completion block holds the prompt's tail under 'sequence_blocks'); draw the "
                             f"plan with plan_for, or plan_views(..., prompt_attention={conv!r}) on rows with their "
                             "prompt_mask")
    scored = _check_inputs(policy, prompt_ids, completion_ids, completion_mask, prompt_mask)
    pm = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask
    return scored, pm


def _chunks(num_views: int, max_views: int | None):
    step = num_views if not max_views else max_views
    for s in range(0, num_views, step):
        yield torch.arange(s, min(s + step, num_views))


def _reduce(token: torch.Tensor, completion_mask: torch.Tensor, reduction: str) -> torch.Tensor:
    seq = token.sum(-1)  # (B,)
    if reduction == "mean":
        seq = seq / completion_mask.sum(-1).to(seq.dtype)
    return seq


def score_views(
    policy: Policy,
    plan: ViewPlan,
    rows: Any,
    *,
    reduction: Literal["sum", "mean"] = "sum",
    max_views_per_forward: int | None = None,
) -> LikelihoodEstimate:
    """Score a plan under `policy` on `rows` (a `Completions` or a `RolloutBatch`: its
    `prompt_ids`, `completion_ids`, `completion_mask` and `prompt_mask`). Differentiable
    unless called under `torch.no_grad()`; with gradients, every micro-batch's graph is kept
    until backward (use `backward_views` to bound memory in training). Each view's
    log-probabilities come with the estimate (`LikelihoodEstimate.views`, for `eubo`)."""
    prompt_ids, completion_ids, completion_mask, prompt_mask = (
        rows.prompt_ids, rows.completion_ids, rows.completion_mask, rows.prompt_mask)
    scored, pm = _check_scoring(policy, plan, prompt_ids, completion_ids, completion_mask, prompt_mask, reduction)
    B, L = completion_ids.shape
    token = torch.zeros((B, L), device=completion_ids.device)
    kept = []
    for idx in _chunks(plan.num_views, max_views_per_forward):
        terms, b, logp = _view_terms(policy, plan, idx, prompt_ids, pm, completion_ids, scored)
        token = token.index_add(0, b, terms)
        kept.append(logp)
    return LikelihoodEstimate(_reduce(token, scored, reduction), token, plan.num_views, torch.cat(kept))


def backward_views(
    policy: Policy,
    plan: ViewPlan,
    rows: Any,
    grad: torch.Tensor,
    *,
    reduction: Literal["sum", "mean"] = "sum",
    max_views_per_forward: int | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    no_sync: Callable[[], ContextManager] | None = None,
) -> None:
    """Accumulate the parameters' `.grad` of a loss through ℓ, one micro-batch of views at
    a time, so memory does not grow with the number of views. `backward` runs each
    micro-batch's backward (e.g. `accelerator.backward`). `no_sync` (e.g.
    ``lambda: accelerator.no_sync(model)``) wraps every micro-batch but the last, so that a
    multi-process run synchronises gradients once, whatever each process's number of
    micro-batches.

    `grad` is ∂loss/∂ℓ computed from a no-grad estimate of the same plan: (B,) for the
    sequence estimate (``reduction`` as scored) or (B, L) for the per-token terms. ℓ is
    linear in the view terms, so this equals `(grad * ℓ).sum().backward()` on
    `score_views(policy, plan, rows)`."""
    prompt_ids, completion_ids, completion_mask, prompt_mask = (
        rows.prompt_ids, rows.completion_ids, rows.completion_mask, rows.prompt_mask)
    scored, pm = _check_scoring(policy, plan, prompt_ids, completion_ids, completion_mask, prompt_mask, reduction)
    B, L = completion_ids.shape
    if grad.shape not in ((B,), (B, L)):
        raise ValueError(f"grad must have shape ({B},) or ({B}, {L}), got {tuple(grad.shape)}")
    g = grad.detach().to(completion_ids.device, torch.float32)
    if g.dim() == 1:  # the sequence estimate: every slot of row b carries ∂loss/∂ℓ_b
        if reduction == "mean":
            g = g / scored.sum(-1)
        g = g[:, None].expand(B, L)
    chunks = list(_chunks(plan.num_views, max_views_per_forward))
    for c, idx in enumerate(chunks):
        with no_sync() if no_sync is not None and c < len(chunks) - 1 else contextlib.nullcontext():
            terms, b, _ = _view_terms(policy, plan, idx, prompt_ids, pm, completion_ids, scored)  # (n, L), (n,)
            backward((terms * g[b]).sum())


def estimate(
    policy: Policy,
    rows: Any,
    *,
    method: Method,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    reduction: Literal["sum", "mean"] = "sum",
    max_views_per_forward: int | None = None,
    **options,
) -> LikelihoodEstimate:
    """Estimate log π(y|q) for each completion of `rows` (a `Completions` or a `RolloutBatch`;
    `unmask_step`, the rollouts' (B, L) decoding order, for method "path"): `plan_for` then
    `score_views`.

    `options` go to `plan_views` (masking, stratified, antithetic, num_nodes, weight, p_prompt).
    For common random numbers across models, call `plan_views` once and `score_views`
    per model — or pass generators in the same state.
    """
    _check_inputs(policy, rows.prompt_ids, rows.completion_ids, rows.completion_mask, rows.prompt_mask)
    plan = plan_for(policy, method, rows, generator=generator, num_samples=num_samples, **options)
    if (method == "exact" or options.get("inner") == "exact") and max_views_per_forward is None:
        max_views_per_forward = 4096  # up to 2^16 views per sequence: never all at once
    return score_views(policy, plan, rows, reduction=reduction, max_views_per_forward=max_views_per_forward)
