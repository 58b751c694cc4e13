"""Masked-diffusion generation (docs/methods.md, "Sampling"), for full-attention and block-diffusion models.

Start from L mask tokens after the prompt; over T steps, predict every masked slot and
commit the ones chosen by the remasking rule: ``low_confidence`` keeps the slots whose
predicted token has the highest probability (LLaDA, Nie et al. 2025, Alg. 5), ``random``
picks slots uniformly. With ``block_length`` < L the completion is decoded in
semi-autoregressive blocks, left to right, the steps split evenly among blocks.

Deliberate choices:
- The number of slots committed per step is ceil(masked left in the block / steps left),
  so the schedule adapts when slots are filled early (see EOS below) and every mask is
  filled by the last step.
- EOS: as soon as a slot decodes to EOS, every slot after it becomes PAD (decoded or not).
  The completion's text ends at its first EOS, and the model, trained on PAD after EOS,
  sees the same layout in RL likelihoods. A policy with several stop tokens
  (``stop_token_ids``: EOS and, for chat checkpoints, an end-of-turn such as SDAR's
  ``<|im_end|>``) ends a completion at the first of any of them. Special tokens other than
  those (MASK, PAD, BOS, UNK) are never sampled.
- Temperature uses the Gumbel-max trick with noise from the explicit `generator`;
  temperature 0 is greedy and needs no generator. With one generator per row, each
  row's noise comes from its own generator, so a row's completion does not depend on
  which other rows share its batch (or its process, in a multi-process run).
- The prompt columns are never written.
- Block models decode in their own blocks (``prompt_attention``, `stabledrl.models.attention`):
  under ``sequence_blocks`` (SDAR, TraDo) a row's first block holds the prompt's tail and
  S − r slots, as SDAR's sampler decodes it, so L slots can span ceil((L + S − 1) / S) blocks;
  each row splits its steps over its own blocks. Deviation: the last block is cut at L, where
  SDAR's sampler denoises it whole and drops what runs past its length.

Options that depart from the exact sampler (all off by default; off, the tokens are those
of the sampler without them, bit for bit):
- ``top_k`` / ``top_p``: the Gumbel-max draw is restricted to the k most likely tokens and
  then to the nucleus, the smallest set of most likely tokens whose mass under the tempered
  distribution reaches p (Holtzman et al. 2020). The confidence that orders the commits and
  the entropy stay those of the model's own distribution. Rollouts drawn this way are not
  samples of the policy that RL scores.
- ``eos_confidence_scale`` < 1 (EOS damping): a slot whose drawn token is a stop token has
  its remasking score multiplied by the scale, so it is committed after slots of similar
  confidence that drew other tokens. LLaDA-style samplers otherwise commit a confident EOS
  early and end the answer before it is written. The number of slots committed per step is
  unchanged, so a completion can still end with a stop token (at the latest on the last step).

Fast decoding (issue 15; all off by default):
- ``noise="counter"``: instead of each row's CPU generator drawing float64 Gumbel noise over
  every completion column and the whole vocabulary, each decoded slot gets one uniform, an
  integer hash of (the row's key, the step, the column) computed on the model's device
  (`counter_uniform`; the key is drawn from the row's generator, `row_keys`), and its token
  is an inverse-CDF draw from the tempered distribution (`categorical`). Only the eligible
  slots (the masked slots of the current block) are drawn, scored and normalised. A row's
  tokens still depend on its own generator only (not its batch, micro-batch or process);
  the distribution is the same, the tokens are not: switching changes every sampled
  completion (and so any figure made with the default), greedy decoding is unchanged.
- ``threshold=τ``: confidence-threshold parallel decoding (Fast-dLLM, Wu et al. 2025): a
  step commits every eligible slot whose remasking score exceeds τ, and at least the
  schedule's ceil(masked left / steps left), so ``steps`` stays an upper bound. Strictly
  above τ, so τ = 1 (like None) commits nothing more and gives today's tokens bit for bit.
  Slots committed together share their step in ``unmask_step``, and the ``path`` estimator
  replays them as one view: it scores the sampled trajectory exactly (tests/test_fast_sampling.py,
  against ``token_logprob``). Departs from the exact sampler's trajectory distribution
  (several slots drawn independently given the same context), not from its per-slot draws.
- ``approx_cache="prefix" | "dual"`` (full-attention policies with ``new_cache``): Fast-dLLM's
  approximate KV caches (`_ApproxCache`). Each block's first step runs the whole sequence, as
  the exact sampler does, and keeps the keys/values of the prefix (and, ``dual``, of the
  suffix); the block's later steps feed the block and the suffix (``prefix``) or the block
  alone (``dual``). An approximation: under full attention the kept keys depend on tokens
  that change while the block is decoded. Exact: a block's first step; the cache's
  mechanics (fed the tokens it was built from, a cached call gives the uncached logits); one
  step per block. A rollout drawn this way is not a sample of the policy that RL scores.
  Policies without ``new_cache`` (the HF adapters) are refused with an error, not silently
  run uncached; block models have their exact ``kv_cache`` instead.

Shapes: B batch, P prompt columns, L completion length, V vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import Literal, Sequence, get_args

import torch
from tqdm.auto import tqdm

from stabledrl.data import completion_mask as _completion_mask
from stabledrl.data import position_ids
from stabledrl.models.attention import (
    block_causal_attention_mask,
    block_offset,
    completion_blocks,
    prompt_attention_of,
    tail_width,
)
from stabledrl.models.policy import Policy
from stabledrl.settings import ApproxCache, Noise, SamplingConfig  # defined without torch, for the command line

__all__ = ["SamplingConfig", "GenerationOutput", "generate", "generate_micro_batched", "micro_batch_calls",
           "restrict_logits", "row_generators", "row_keys", "check_fast_decoding", "counter_uniform", "categorical", "concat_outputs"]


@dataclass
class GenerationOutput:
    sequences: torch.Tensor
    """(B, P + L) prompt and completion."""
    completion_ids: torch.Tensor
    """(B, L) completion tokens; PAD after the first EOS."""
    completion_mask: torch.Tensor
    """(B, L) bool, True up to and including the first EOS: the scored positions."""
    unmask_step: torch.Tensor
    """(B, L) the step (0-based, global over blocks) at which each slot was committed
    (or turned into PAD by an EOS before it); with the generator's seed and the
    sampling settings this replays the rollout."""
    forward_passes: int
    """Model calls made (each on the rows that still had masks)."""
    entropy: torch.Tensor
    """(B,) mean entropy (nats) of the model's distribution at each slot it committed,
    at the step it committed it (special tokens other than EOS excluded)."""
    token_logprob: torch.Tensor | None = None
    """(B, L) the sampler's own log-probability of each scored token: log p(y_i) under the
    model's distribution (untempered, over the whole vocabulary) in the call that committed
    slot i, what the `path` estimator scores (`stabledrl.likelihood`); 0 on the unscored
    slots. (The draw itself excludes MASK, PAD, BOS and UNK, and is tempered.) Filled by the
    built-in sampler when asked, ``generate(record_logprob=True)`` (a logsumexp over the
    vocabulary for every eligible slot of every step: a quarter to a third of a step's draw at
    a 126k vocabulary), else None; the trainer does not read it, and another engine may leave it None."""


def _rows_topk(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, L) scores, (B,) counts -> (B, L) bool selecting each row's k[b] highest scores."""
    order = scores.argsort(dim=-1, descending=True)  # (B, L)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.size(-1), device=scores.device).expand_as(order))
    return rank < k[:, None]


Generators = torch.Generator | Sequence[torch.Generator] | None


def _rand(shape: torch.Size, generator: Generators, rows: torch.Tensor, device, dtype=torch.float32,
          own: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform noise of `shape` (A, W, ...) for batch rows `rows`: from the one generator, or
    row b's part from generator[b]. With per-row generators, `own` (A, W) bool limits row
    b's draws to its own columns (the others get 0.5, never used), so that what a row draws
    does not depend on the columns its batch spans."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device, dtype=dtype)
    if own is None:
        draws = [torch.rand(shape[1:], generator=generator[b], dtype=dtype) for b in rows.tolist()]
        return torch.stack(draws).to(device)
    out = torch.full(shape, 0.5, dtype=dtype)
    for a, b in enumerate(rows.tolist()):
        cols = own[a].nonzero().flatten().cpu()
        if cols.numel():
            out[a, cols] = torch.rand((cols.numel(), *shape[2:]), generator=generator[b], dtype=dtype)
    return out.to(device)


def restrict_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(..., V) logits -> a copy with −inf outside the `top_k` largest and then outside the
    nucleus: the smallest set of most likely tokens whose probability (softmax of the
    top-k logits) reaches `top_p`. None (or top_p 1) leaves that step out."""
    V = logits.size(-1)
    if top_k is not None and top_k < V:
        top = logits.topk(top_k, dim=-1).indices  # (..., k)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
        logits = logits.masked_fill(~keep, -math.inf)
    if top_p is not None and top_p < 1:
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)  # (..., V)
        mass_before = torch.nn.functional.pad(probs.cumsum(-1)[..., :-1], (1, 0))  # of the more likely tokens
        # a token is kept while the more likely ones have not reached p: the most likely always is
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, mass_before < top_p)
        logits = logits.masked_fill(~keep, -math.inf)
    return logits


_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: a 32-bit value times it stays below 2**63, so int64 products are exact


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in [0, 2**32) onto the same range (two rounds of
    xorshift-multiply). Only exact int64 operations: products of a 32-bit value and a
    constant below 2**31, right shifts of non-negative values; the same bits on every device."""
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def counter_uniform(keys: torch.Tensor, step: int | torch.Tensor, cols: torch.Tensor, purpose: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), float64 (A, W): a pure function of each row's key
    (A, 2) (two 32-bit halves, `row_keys`), its step (an int or (A,)), the completion column
    (A, W) or (W,) and the draw's `purpose` (0: the token, 1: the random remasking score).
    Nothing is consumed, so a row's draws do not depend on its batch, micro-batch, process
    or device."""
    step = torch.as_tensor(step, dtype=torch.long, device=keys.device).expand(keys.size(0))  # (A,)
    h = _mix32(_mix32(keys[:, 0] ^ _mix32(keys[:, 1] ^ purpose)) ^ step)  # (A,)
    h = _mix32(_mix32(h[:, None] ^ cols.to(keys.device)))  # (A, W)
    return (h.double() + 0.5) / 2.0**32


def row_keys(generator: Generators, B: int, device) -> torch.Tensor | None:
    """(B, 2) the counter keys of B rows, two 32-bit values drawn from each row's generator
    (or B pairs from the one generator); None without a generator. A fresh generator with
    the same seed gives the same keys; drawing them advances it, so a reused generator
    gives new rollouts, as with the generator noise."""
    if generator is None:
        return None
    if isinstance(generator, torch.Generator):
        keys = torch.randint(0, 2**32, (B, 2), generator=generator)
    else:
        keys = torch.stack([torch.randint(0, 2**32, (2,), generator=g) for g in generator])
    return keys.to(device)


def categorical(probs: torch.Tensor, u: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Inverse-CDF draw: (N, V) probabilities (unnormalised, ≥ 0, a positive sum) and (N,)
    uniforms -> (N,) the first index whose cumulative mass exceeds u times the total. In two
    levels, so only (N, V / chunk) and (N, chunk) sums are float64: the chunk holding the
    target, then the token within it. A zero-probability token is never returned."""
    N, V = probs.shape
    whole = V - V % chunk
    sums = probs[:, :whole].reshape(N, -1, chunk).sum(-1, dtype=torch.float64)  # (N, V // chunk)
    if whole < V:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    cum = sums.cumsum(-1)  # (N, C)
    target = u.double() * cum[:, -1]  # (N,)
    j = torch.searchsorted(cum, target[:, None], right=True).clamp(max=cum.size(1) - 1)  # (N, 1) the chunk
    rest = target[:, None] - torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), 0.0)  # (N, 1)
    idx = j * chunk + torch.arange(chunk, device=probs.device)  # (N, chunk)
    p = probs.gather(1, idx.clamp(max=V - 1)).double().masked_fill(idx >= V, 0.0)  # (N, chunk)
    i = torch.searchsorted(p.cumsum(-1), rest, right=True)  # (N, 1)
    # rounding can put the target at the chunk's very end: take its last token of positive mass
    last = ((p > 0) * torch.arange(chunk, device=probs.device)).amax(-1, keepdim=True)  # (N, 1)
    return (j * chunk + torch.minimum(i, last)).squeeze(1)


def _draw_counter(logits: torch.Tensor, eligible: torch.Tensor, temperature: float, remasking: str,
                  keys: torch.Tensor | None, step: int | torch.Tensor, cols: torch.Tensor,
                  top_k: int | None, top_p: float | None) -> tuple[torch.Tensor, ...]:
    """Counter noise: the draw, score and entropy (each (A, W), 0 off the eligible slots)
    computed on the eligible slots only. The token is an inverse-CDF draw
    from the tempered (and restricted) distribution with one counter uniform per slot."""
    a, w = eligible.nonzero(as_tuple=True)  # (N,) each
    lg = logits[a, w]  # (N, V)
    q, logq = lg.softmax(-1), lg.log_softmax(-1)  # (N, V) each
    if temperature > 0:
        tempered = lg / temperature if temperature != 1 else lg
        if top_k is not None or top_p is not None:
            tempered = restrict_logits(tempered, top_k, top_p)
        probs = q if tempered is lg else tempered.softmax(-1)  # (N, V)
        x0 = categorical(probs, counter_uniform(keys, step, cols, 0)[a, w])
    else:
        x0 = lg.argmax(-1)  # (N,)
    if remasking == "low_confidence":
        score = q.gather(-1, x0[:, None]).squeeze(-1)  # p(x0), as the generator path computes it
    else:
        score = counter_uniform(keys, step, cols, 1)[a, w].float()
    ent = -(q * logq.nan_to_num(neginf=0.0)).sum(-1)  # (N,)
    out = []
    for v, fill in ((x0, 0), (score, 0.0), (ent, 0.0)):
        full = torch.full(eligible.shape, fill, dtype=v.dtype, device=v.device)
        full[a, w] = v
        out.append(full)
    return tuple(out)


def _draw_generator(logits: torch.Tensor, temperature: float, remasking: str, generator: Generators,
                    rows: torch.Tensor, own: torch.Tensor | None, top_k: int | None,
                    top_p: float | None) -> tuple[torch.Tensor, ...]:
    """Generator noise (the default, the stream every figure was made with): float64 Gumbel
    noise over every column and the whole vocabulary -> x0, score and entropy, (A, W)."""
    if temperature > 0:
        u = _rand(logits.shape, generator, rows, logits.device, torch.float64, own)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tempered = logits.double() / temperature  # (A, W, V)
        if top_k is not None or top_p is not None:
            tempered = restrict_logits(tempered, top_k, top_p)
        x0 = (tempered + gumbel).argmax(-1)  # (A, W)
    else:
        x0 = logits.argmax(-1)  # (A, W)
    if remasking == "low_confidence":
        score = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)  # (A, W) p(x0)
    else:
        score = _rand(x0.shape, generator, rows, logits.device, own=own)
    logq = logits.log_softmax(-1)  # (A, W, V)
    ent = -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1)  # (A, W)
    return x0, score, ent


def _pick(
    logits: torch.Tensor, eligible: torch.Tensor, steps_left: int | torch.Tensor, temperature: float, remasking: str,
    generator: Generators, banned: list[int], rows: torch.Tensor, top_k: int | None = None,
    top_p: float | None = None, eos_confidence_scale: float = 1.0, stop_ids: Sequence[int] = (),
    own: torch.Tensor | None = None, noise: str = "generator", keys: torch.Tensor | None = None,
    step: int | torch.Tensor = 0, cols: torch.Tensor | None = None, threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising step over W columns: (A, W, V) logits and (A, W) eligible slots of
    batch rows `rows` (A,), with `steps_left` (an int, or (A,) one per row) -> the slots to
    commit (A, W) bool, their tokens x0 (A, W) and the entropy (A, W).
    `own` (A, W): the columns a row draws generator noise for (`_rand`); None: all.
    Counter noise: `keys` (A, 2) the rows' keys, `step` the step (int or (A,)), `cols` (W,)
    the completion columns of the W. `threshold`: also commit every slot whose score exceeds it."""
    logits[..., banned] = -math.inf
    if noise == "counter":
        x0, score, ent = _draw_counter(logits, eligible, temperature, remasking, keys, step, cols, top_k, top_p)
    else:
        x0, score, ent = _draw_generator(logits, temperature, remasking, generator, rows, own, top_k, top_p)
    if eos_confidence_scale != 1:  # EOS damping: a slot that drew a stop token waits
        drew_stop = torch.isin(x0, torch.as_tensor(stop_ids, dtype=torch.long, device=x0.device))  # (A, W)
        score = torch.where(drew_stop, score * eos_confidence_scale, score)
    score = score.masked_fill(~eligible, -math.inf)
    k = (eligible.sum(-1) + steps_left - 1) // steps_left  # ceil(masked / steps left), (A,)
    if threshold is not None:  # parallel decoding: every slot above the threshold, at least the schedule's k
        k = torch.maximum(k, (score > threshold).sum(-1))
    chosen = _rows_topk(score, k) & eligible  # (A, W)
    return chosen, x0, ent


def _step(logits: torch.Tensor, eligible: torch.Tensor, steps_left: int | torch.Tensor, *, logprob: bool,
          **kw) -> tuple[torch.Tensor, ...]:
    """`_pick`, and with `logprob` the model's log-probability of each draw (A, W), else None:
    over the whole vocabulary, special tokens included, as the likelihood scores it (the draw
    excludes them); computed on the eligible slots (−inf or 0 elsewhere, never committed)."""
    if not logprob:
        return *_pick(logits, eligible, steps_left, **kw), None
    lse = torch.zeros(eligible.shape, device=logits.device)  # (A, W) the model's normaliser
    lse[eligible] = logits[eligible].logsumexp(-1)
    chosen, x0, ent = _pick(logits, eligible, steps_left, **kw)
    return chosen, x0, ent, logits.gather(-1, x0[..., None]).squeeze(-1) - lse  # x0 is never banned


class _Decoding:
    """The completion being written and its bookkeeping, shared by both samplers."""

    def __init__(self, policy: Policy, B: int, L: int, device: torch.device, record_logprob: bool = False) -> None:
        self.mask_id, self.pad_id = policy.mask_token_id, policy.pad_token_id
        self.stop_ids = tuple(getattr(policy, "stop_token_ids", (policy.eos_token_id,)))  # ends a completion
        self.banned = sorted({self.mask_id, self.pad_id, *policy.tokenizer.all_special_ids} - set(self.stop_ids))
        self.comp = torch.full((B, L), self.mask_id, dtype=torch.long, device=device)  # (B, L)
        self.unmask_step = torch.full((B, L), -1, dtype=torch.long, device=device)
        self.entropy_sum = torch.zeros(B, device=device)
        # (B, L) log p of each committed token, if recorded
        self.logprob = torch.zeros((B, L), device=device) if record_logprob else None
        self.committed = torch.zeros(B, device=device)
        self.passes = 0

    def commit(self, rows: torch.Tensor, cols: slice, chosen, x0, ent, logp, step: int | torch.Tensor) -> None:
        """Write the chosen tokens of rows `rows` in columns `cols`; PAD after any EOS.
        `step`: the step number, or (A,) each row's own."""
        self.entropy_sum[rows] += (ent * chosen).sum(-1)
        if self.logprob is not None:
            logprob = self.logprob[rows]  # (A, L)
            logprob[:, cols] = torch.where(chosen, logp.float(), logprob[:, cols])
            self.logprob[rows] = logprob
        self.committed[rows] += chosen.sum(-1)
        comp = self.comp[rows]  # (A, L)
        comp[:, cols] = torch.where(chosen, x0, comp[:, cols])
        # After the first EOS only PAD, whether those slots were decoded or not.
        after_eos = ~_completion_mask(comp, self.stop_ids)  # (A, L)
        self.comp[rows] = comp.masked_fill(after_eos, self.pad_id)
        newly = after_eos.clone()
        newly[:, cols] |= chosen
        stamped = self.unmask_step[rows]  # (A, L); a slot keeps the step it was first filled at
        step = step[:, None] if isinstance(step, torch.Tensor) else step
        self.unmask_step[rows] = torch.where(newly & (stamped < 0), step, stamped)

    def output(self, prompt_ids: torch.Tensor) -> GenerationOutput:
        if (self.comp == self.mask_id).any():  # cannot happen with the ceil schedule; guard the invariant
            raise RuntimeError("generation left masks unfilled")
        scored = _completion_mask(self.comp, self.stop_ids)  # (B, L)
        return GenerationOutput(
            sequences=torch.cat([prompt_ids, self.comp], dim=1),
            completion_ids=self.comp.clone(),
            completion_mask=scored,
            unmask_step=self.unmask_step,
            forward_passes=self.passes,
            entropy=self.entropy_sum / self.committed.clamp(min=1),
            token_logprob=None if self.logprob is None else self.logprob.masked_fill(~scored, 0.0),
        )


def _check_draws(B: int, temperature: float, remasking: str, generator: Generators, top_k: int | None,
                 top_p: float | None, eos_confidence_scale: float) -> None:
    """`generate`'s options of each step's draw and commit."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if (top_k is not None or top_p is not None) and temperature == 0:
        raise ValueError("top_k and top_p restrict a random draw: set temperature > 0 or leave them None")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    if not 0 < eos_confidence_scale <= 1:
        raise ValueError(f"eos_confidence_scale must be in (0, 1], got {eos_confidence_scale}")
    if generator is None and (temperature > 0 or remasking == "random"):
        raise ValueError("random sampling needs an explicit generator=torch.Generator().manual_seed(seed)")
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != B:
        raise ValueError(f"one generator per row: got {len(generator)} generators for {B} rows")


def _one_of(choices) -> str:
    """A Literal's values for a message: 'a', 'b' or 'c'."""
    words = [repr(c) for c in get_args(choices)]
    return ", ".join(words[:-1]) + " or " + words[-1]


def check_fast_decoding(policy: Policy, remasking: str, noise: str, threshold: float | None,
                        approx_cache: str) -> None:
    """`generate`'s options of fast decoding, against the policy (a ValueError saying what to set)."""
    if noise not in get_args(Noise):
        raise ValueError(f"noise must be {_one_of(Noise)}, got {noise!r}")
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1] or None, got {threshold}")
    if threshold is not None and remasking != "low_confidence":
        raise ValueError("threshold commits the slots whose confidence exceeds it: it needs remasking 'low_confidence'")
    if approx_cache not in get_args(ApproxCache):
        raise ValueError(f"approx_cache must be {_one_of(ApproxCache)}, got {approx_cache!r}")
    if approx_cache != "none" and policy.attention_kind != "full":
        raise ValueError("approx_cache is for full-attention models; a block model's kv_cache is already exact")
    if approx_cache != "none" and not hasattr(policy, "new_cache"):
        raise ValueError(f"approx_cache {approx_cache!r} needs a policy with a KV cache (new_cache(), cache= in "
                         f"logits), which {type(policy).__name__} lacks (the HF adapters have none): set it to 'none'")


def _blocks(policy: Policy, L: int, steps: int, block_length: int | None) -> tuple[int, int]:
    """The block length and the number of blocks of `generate`, checked."""
    if policy.attention_kind == "block":
        if block_length not in (None, policy.block_size):
            raise ValueError(f"a block model decodes in its own blocks of {policy.block_size}; "
                             f"block_length must be null or {policy.block_size}, got {block_length}")
        block_length = policy.block_size
    elif policy.attention_kind != "full":
        raise NotImplementedError(f"no sampler for attention kind {policy.attention_kind!r}")
    block_length = L if block_length is None else block_length
    if L < 1 or steps < 1 or block_length < 1:
        raise ValueError(f"gen_length, steps and block_length must be >= 1, got {L}, {steps}, {block_length}")
    num_blocks = math.ceil(L / block_length)
    shared = policy.attention_kind == "block" and prompt_attention_of(policy) == "sequence_blocks"
    if shared:  # the prompt's tail shortens the first block: L slots can span one block more
        num_blocks = math.ceil((L + block_length - 1) / block_length)
    if steps < num_blocks:
        raise ValueError(f"steps ({steps}) must be at least the number of blocks ({num_blocks})" + (
            f": with prompt_attention 'sequence_blocks' the prompt's tail shares the first block, so {L} slots "
            f"can span {num_blocks} blocks of {block_length}" if shared else ""))
    return block_length, num_blocks


@torch.no_grad()
def generate(
    policy: Policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    *,
    gen_length: int,
    steps: int | None = None,
    block_length: int | None = None,
    temperature: float = 0.0,
    remasking: Literal["low_confidence", "random"] = "low_confidence",
    generator: Generators = None,
    kv_cache: bool = True,
    synced: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_confidence_scale: float = 1.0,
    noise: Noise = "generator",
    threshold: float | None = None,
    approx_cache: ApproxCache = "none",
    record_logprob: bool = False,
) -> GenerationOutput:
    """Generate `gen_length` tokens after each (left-padded) prompt.

    `steps` defaults to `gen_length` (one slot per step); `block_length` defaults to
    `gen_length` (one block) for full-attention models and must be the model's block
    size (or None) for block models. `generator` is required when sampling is random
    (temperature > 0 or random remasking): one for the batch, or a sequence of B, one per
    row (then a row's completion does not depend on the rest of the batch). `kv_cache` (block models with a cache only):
    keep the keys and values of the prompt and finished blocks instead of recomputing them.
    `synced`: make every model call of the schedule even when no row has work left (the
    output is discarded), so that processes whose parameters are sharded (FSDP, ZeRO-3),
    where each call is a collective, make the same number of calls; same tokens.
    `top_k`, `top_p` (temperature > 0) and `eos_confidence_scale` depart from the exact
    sampler (module docstring); left at their defaults they change no token.
    Fast decoding (module docstring, "Fast decoding"): `noise` "counter" draws on the model's
    device, for the decoded slots only (other tokens, the same distribution); `threshold`
    commits every slot whose confidence exceeds it (parallel decoding; None or 1: today's
    tokens); `approx_cache` "prefix" / "dual" (full attention, a policy with `new_cache`):
    Fast-dLLM's approximate caches, refreshed at each block's first step.
    `record_logprob`: fill `GenerationOutput.token_logprob` (the sampler's own log-probability of
    each token, which the `path` estimator should reproduce; the trainer does not need it);
    else it is None. Same tokens either way.
    """
    B, P = prompt_ids.shape
    L = gen_length
    steps = L if steps is None else steps
    block_length, num_blocks = _blocks(policy, L, steps, block_length)
    _check_draws(B, temperature, remasking, generator, top_k, top_p, eos_confidence_scale)
    check_fast_decoding(policy, remasking, noise, threshold, approx_cache)
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    # Steps per block: as even as possible, earlier blocks take the remainder.
    per_block = [steps // num_blocks + (b < steps % num_blocks) for b in range(num_blocks)]
    dec = _Decoding(policy, B, L, prompt_ids.device, record_logprob)
    pick = dict(temperature=temperature, remasking=remasking, generator=generator, banned=dec.banned,
                top_k=top_k, top_p=top_p, eos_confidence_scale=eos_confidence_scale, stop_ids=dec.stop_ids,
                noise=noise, threshold=threshold)
    keys = row_keys(generator, B, prompt_ids.device) if noise == "counter" else None
    if policy.attention_kind == "block":
        _decode_blocks(policy, dec, prompt_ids, prompt_mask, block_length, steps,
                       kv_cache and hasattr(policy, "new_cache"), pick, synced, keys)
    else:
        _decode_full(policy, dec, prompt_ids, prompt_mask, block_length, per_block, pick, synced, approx_cache, keys)
    return dec.output(prompt_ids)


class _ApproxCache:
    """Fast-dLLM's caches for one block [lo, hi) of a full-attention model (Wu et al. 2025).

    The block's first call runs the whole [q ; completion], exactly as the uncached sampler,
    and keeps the keys and values of the prefix (prompt and finished blocks; ``prefix``) or
    of everything but the block (``dual``). The block's later calls feed the block and the
    suffix (``prefix``) or the block alone (``dual``), attending to the kept keys. An
    approximation: under full attention the kept keys depend on the tokens fed after them,
    which change as the block is decoded (and with them the suffix's, under ``dual``)."""

    def __init__(self, policy, kind: str, P: int, lo: int, hi: int, attn: torch.Tensor, pos: torch.Tensor) -> None:
        self.policy, self.kind, self.P, self.lo, self.hi = policy, kind, P, lo, hi
        self.attn, self.pos = attn, pos  # (B, P+L) all rows
        T = attn.size(1)
        col = torch.arange(T, device=attn.device)
        fed = (col >= P + lo) & ((col < P + hi) | (kind == "prefix"))  # (T,) the columns a later call feeds
        self.fed, self.kept = fed.nonzero().flatten(), (~fed).nonzero().flatten()
        self.kv, self.rows = None, None  # the kept keys/values, and the batch rows they are of

    def logits(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """(A, P+L) inputs of batch rows `active` -> (A, hi - lo, V) logits of the block."""
        P, lo, hi = self.P, self.lo, self.hi
        if self.kv is None:  # the block's first call: the whole sequence, its keys kept
            cache = self.policy.new_cache()
            out = self.policy.logits(x, self.attn[active], self.pos[active], cache=cache, extend_cache=True)
            self.kv, self.rows = cache.select(cols=self.kept), active
            return out[:, P + lo : P + hi]
        cache = self.kv
        if not torch.equal(active, self.rows):  # rows that finished the block leave the cache
            cache = cache.select(rows=torch.searchsorted(self.rows, active))
        keys = self.attn[active][:, torch.cat([self.kept, self.fed])]  # (A, Tc+F) key padding, cached first
        out = self.policy.logits(x[:, self.fed], keys, self.pos[active][:, self.fed], cache=cache)
        return out[:, : hi - lo]


def _decode_full(policy, dec: _Decoding, prompt_ids, prompt_mask, block_length, per_block, pick, synced,
                 approx_cache: str = "none", keys: torch.Tensor | None = None) -> None:
    """Full attention: every step runs the whole [q ; completion] of the rows with work left
    (with `approx_cache`, what `_ApproxCache` feeds)."""
    B, P = prompt_ids.shape
    L = dec.comp.size(1)
    attn = torch.cat([prompt_mask, torch.ones((B, L), dtype=prompt_mask.dtype, device=prompt_mask.device)], dim=1)
    pos = position_ids(attn)  # (B, P+L)
    slot = torch.arange(L, device=prompt_ids.device)
    # Generator noise without a cache draws over every column (the default stream); otherwise only the block's.
    narrow = pick["noise"] == "counter" or approx_cache != "none"
    step = 0
    for b, block_steps in enumerate(per_block):
        lo, hi = b * block_length, min(L, (b + 1) * block_length)
        cols = slice(lo, hi) if narrow else slice(None)
        in_block = (slot >= lo) & (slot < hi)  # (L,)
        cache = None if approx_cache == "none" else _ApproxCache(policy, approx_cache, P, lo, hi, attn, pos)
        for s in range(block_steps):
            eligible = (dec.comp == dec.mask_id) & in_block  # (B, L)
            active = eligible.any(dim=1).nonzero().squeeze(1)  # rows with work left in this block
            if active.numel() == 0:
                if synced:  # the call the other processes are making; its output is not needed
                    policy.logits(torch.cat([prompt_ids[:1], dec.comp[:1]], dim=1), attn[:1], pos[:1])
                    dec.passes += 1
                    step += 1
                    continue
                step += block_steps - s
                break
            x = torch.cat([prompt_ids[active], dec.comp[active]], dim=1)  # (A, P+L)
            if cache is None:
                logits = policy.logits(x, attn[active], pos[active])[:, P:][:, cols].float()  # (A, W, V)
            else:
                logits = cache.logits(x, active).float()  # (A, W, V)
            dec.passes += 1
            chosen, x0, ent, logp = _step(logits, eligible[active][:, cols], block_steps - s,
                                          logprob=dec.logprob is not None, rows=active,
                                          keys=None if keys is None else keys[active], step=step,
                                          cols=slot[cols], **pick)
            dec.commit(active, cols, chosen, x0, ent, logp, step)
            step += 1


def _block_schedule(num_blocks: torch.Tensor, steps: int, width: int) -> torch.Tensor:
    """(R,) blocks per row -> (R, width) steps of each row's block j: `steps` split as evenly as
    possible, earlier blocks taking the remainder; 0 past a row's last block."""
    j = torch.arange(width, device=num_blocks.device)
    per = (steps // num_blocks)[:, None] + (j[None] < (steps % num_blocks)[:, None]).long()  # (R, width)
    return per.masked_fill(j[None] >= num_blocks[:, None], 0)


def _decode_blocks(policy, dec: _Decoding, prompt_ids, prompt_mask, S, steps, use_cache, pick, synced,
                   noise_keys: torch.Tensor | None = None) -> None:
    """Block diffusion: block j is denoised attending to the clean blocks < j, then frozen.
    Without the cache each step runs [q ; y_≤j] under the block-causal mask; with it, the
    prompt's whole blocks and each finished block are run once and their keys/values kept,
    and a step feeds only block j. Same mathematics.

    The blocks are the policy's (`prompt_attention`). Under ``sequence_blocks`` a row's
    first block holds its prompt's tail, r = (prompt length mod S) tokens, and S − r slots:
    the rows' blocks are then shifted against each other, and block j is decoded for all
    rows at once over the columns it covers in any row (a row's other columns there belong
    to its blocks j − 1 or j + 1: hidden from block j, never written). The tail is fed with
    the first block (with the cache: once more, its prefilled keys are not used) and frozen
    with it. Each row splits its `steps` over its own blocks, and its steps are counted
    over its own blocks (`unmask_step`), so a row's tokens do not depend on its batch."""
    B, P = prompt_ids.shape
    L = dec.comp.size(1)
    device = prompt_ids.device
    conv = prompt_attention_of(policy)
    keys = torch.cat([prompt_mask.bool(), torch.ones((B, L), dtype=torch.bool, device=device)], dim=1)  # (B, P+L)
    pos = position_ids(torch.cat([prompt_mask, torch.ones_like(dec.comp)], dim=1))  # (B, P+L)
    offset = block_offset(prompt_mask, S, conv)  # (B,) prompt tokens in each row's first block
    blk_of = completion_blocks(offset, L, S)  # (B, L) each slot's block
    W = tail_width(P, S, conv)
    tail = prompt_mask[:, P - W :].bool() & (torch.arange(W, device=device) >= W - offset[:, None])  # (B, W)
    # Every block count a row of this model can have (so that synced processes make the same calls).
    counts = torch.arange(S if conv == "sequence_blocks" else 1, device=device)
    counts = torch.div(counts + L + S - 1, S, rounding_mode="floor").unique()  # ceil((r + L) / S) for each r
    NB = int(counts.max())
    sched = _block_schedule(blk_of[:, -1] + 1, steps, NB)  # (B, NB) each row's steps per block
    first_step = sched.cumsum(1) - sched  # (B, NB) each row's step number at the start of block j
    iters = _block_schedule(counts, steps, NB).max(0).values.tolist()  # (NB,) calls per block, batch-independent
    rows = torch.arange(B, device=device)
    cache, valid = None, None
    if use_cache:  # prefill the prompt; its keys are valid but for a tail that shares the first block
        cache = policy.new_cache()
        mask = block_causal_attention_mask(prompt_mask, 0, S, conv)  # (B, P, P)
        policy.logits(prompt_ids, mask, pos[:, :P], cache=cache, extend_cache=True)
        dec.passes += 1
        valid = keys[:, :P].clone()  # (B, Tc) cached keys a later query may attend to
        valid[:, P - W :] &= ~tail
    for j in range(NB):
        member = blk_of == j  # (B, L) the slots of block j, per row
        cols = member.any(0).nonzero().flatten()
        if cols.numel() == 0 and not synced:
            continue
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (L - 1, L)  # none: a discarded call
        member = member[:, lo:hi]  # (B, W_j)
        head = W if j == 0 else 0  # the prompt's tail denoises with the first block (cache path: fed again)
        if use_cache:
            fresh = torch.cat([tail[:, W - head :], member], dim=1)  # (B, F) the columns of each row's block j
            fed_pos = torch.cat([pos[:, P - head : P], pos[:, P + lo : P + hi]], dim=1)  # (B, F)
            mask = fresh[:, :, None] & torch.cat([valid, fresh], dim=1)[:, None, :]  # (B, F, Tc+F)
        for s in range(iters[j]):
            active = s < sched[:, j]  # (B,) rows still within their steps of block j
            eligible = (dec.comp[:, lo:hi] == dec.mask_id) & member & active[:, None]  # (B, W_j)
            if not eligible.any() and not synced:
                break
            if use_cache:  # block j (and the tail) attend to the valid cached keys and to themselves
                fed = torch.cat([prompt_ids[:, P - head :], dec.comp[:, lo:hi]], dim=1)  # (B, F)
                logits = policy.logits(fed, mask, fed_pos, cache=cache)[:, head:]
            else:
                x = torch.cat([prompt_ids, dec.comp[:, :hi]], dim=1)  # (B, P+hi)
                attn = block_causal_attention_mask(prompt_mask, hi, S, conv)  # (B, P+hi, P+hi)
                logits = policy.logits(x, attn, pos[:, : P + hi])[:, P + lo :]
            dec.passes += 1
            if eligible.any():  # (synced calls with nothing left to decode are discarded)
                steps_left = (sched[:, j] - s).clamp(min=1)  # (B,)
                # A row draws noise for its own block's columns, and only while it has slots to fill: its
                # draws do not depend on the other rows (a row without any has none left: EOS came).
                own = member & eligible.any(1, keepdim=True)  # (B, W_j)
                chosen, x0, ent, logp = _step(logits.float(), eligible, steps_left, logprob=dec.logprob is not None,
                                              rows=rows, own=own, keys=noise_keys,
                                              step=first_step[:, j] + s, cols=torch.arange(lo, hi, device=device),
                                              **pick)
                dec.commit(rows, slice(lo, hi), chosen, x0, ent, logp, first_step[:, j] + s)
        later = blk_of > j
        if use_cache and j < NB - 1 and (synced or (dec.comp[later] == dec.mask_id).any()):  # freeze block j
            fed = torch.cat([prompt_ids[:, P - head :], dec.comp[:, lo:hi]], dim=1)  # (B, F)
            policy.logits(fed, mask, fed_pos, cache=cache, extend_cache=True)
            valid = torch.cat([valid, fresh], dim=1)
            dec.passes += 1


def row_generators(tag: str, lo: int, hi: int) -> list[torch.Generator]:
    """One generator per row lo..hi-1 of a batch named `tag`: a row's draws depend on the
    tag and its index only, not on the batch, micro-batch or process it is sampled in."""
    def seed(row: int) -> int:
        return int.from_bytes(hashlib.sha256(f"{tag}/{row}".encode()).digest()[:8], "big") >> 1
    return [torch.Generator().manual_seed(seed(r)) for r in range(lo, hi)]


def micro_batch_calls(rows: int, micro_batch: int | None) -> int:
    """`generate` calls that `generate_micro_batched` makes for `rows` rows."""
    return 1 if micro_batch is None else max(1, math.ceil(rows / micro_batch))


def generate_micro_batched(
    policy: Policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    *,
    micro_batch: int | None,
    generator: Generators = None,
    synced: bool = False,
    num_calls: int | None = None,
    progress: bool = False,
    sort_by_length: bool = False,
    **kwargs,
) -> GenerationOutput:
    """`generate` on at most `micro_batch` rows at a time (None: all at once), the outputs
    concatenated; `forward_passes` is the sum over the calls. The rows keep their padding
    (P columns for all), and with one generator per row (or with no randomness) each row
    writes the same tokens as in a single call: a row's tokens do not depend on the others
    in its batch (tests/test_sampling.py). A single generator would be consumed in another
    order, so it is refused when there is more than one micro-batch.

    `sort_by_length`: the rows are cut into micro-batches in order of prompt length (each
    row with its own generator), and each call drops the left padding columns that all its
    rows have, so a micro-batch of short prompts runs on short sequences; the output is in
    the given row order, `sequences` with the P columns of `prompt_ids`. Where a row's
    positions come from the padding mask (the tiny models, and every adapter but LLaDA's) it
    sees the same positions and keys, and only the number of hidden padding keys changes:
    the same tokens but for rounding (tests/test_sampling.py, in float64). LLaDA counts
    positions itself, so its positions shift by the columns dropped, which RoPE's relative
    angles absorb, again up to rounding. With a single micro-batch the order is kept (and
    its common padding still dropped).

    `synced` with `num_calls`: processes with sharded parameters must make the same model
    calls, so a process with fewer micro-batches than `num_calls` (those of the largest
    share, `micro_batch_calls`) makes the missing ones on its first row and discards them.
    `progress`: a progress bar over the micro-batches."""
    B = prompt_ids.size(0)
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1 or None, got {micro_batch}")
    size = B if micro_batch is None else micro_batch
    starts = list(range(0, B, size))
    one_generator = isinstance(generator, torch.Generator)
    if len(starts) > 1 and one_generator:
        raise ValueError("micro-batches need one generator per row (stabledrl.sampling.row_generators): "
                         "a single generator would give other draws than one call")
    order = torch.arange(B)  # (B,) the rows in the order they are cut into micro-batches
    if sort_by_length and len(starts) > 1:
        order = prompt_mask.sum(1).cpu().argsort(stable=True)
    outs = []
    for s in tqdm(starts, desc="sampling", disable=not progress, leave=False):
        rows = order[s : s + size]  # (b,)
        gens = generator if generator is None or one_generator else [generator[i] for i in rows.tolist()]
        ids, mask = prompt_ids[rows.to(prompt_ids.device)], prompt_mask[rows.to(prompt_mask.device)]  # (b, P)
        lead = _common_padding(mask) if sort_by_length else 0
        out = generate(policy, ids[:, lead:], mask[:, lead:], generator=gens, synced=synced, **kwargs)
        if lead:  # back to the P columns of the prompts as given
            out.sequences = torch.cat([ids[:, :lead], out.sequences], dim=1)  # (b, P + L)
        outs.append(out)
    if synced and num_calls is not None:
        for _ in range(num_calls - len(starts)):  # the calls of a larger share; output discarded
            spare = [torch.Generator().manual_seed(0)]
            generate(policy, prompt_ids[:1], prompt_mask[:1], generator=spare, synced=True, **kwargs)
    out = concat_outputs(outs)
    if not torch.equal(order, torch.arange(B)):
        out = _take_rows(out, order.argsort().to(out.completion_ids.device))
    return out


def _common_padding(prompt_mask: torch.Tensor) -> int:
    """The number of leading columns of (b, P) `prompt_mask` that are padding in every row
    (none when no row has a prompt token)."""
    real = prompt_mask.bool().any(0).nonzero()  # columns where some row has a token
    return int(real[0]) if real.numel() else 0


def _take_rows(out: GenerationOutput, rows: torch.Tensor) -> GenerationOutput:
    """The rows `rows` (an index tensor) of `out`, in that order; `forward_passes` kept."""
    picked = {f.name: getattr(out, f.name)[rows] for f in fields(GenerationOutput)
              if f.name != "forward_passes" and getattr(out, f.name) is not None}
    return GenerationOutput(forward_passes=out.forward_passes, **picked)


def concat_outputs(outs: Sequence[GenerationOutput]) -> GenerationOutput:
    """The rows of several outputs (same P and L) in one; `forward_passes` summed, a
    `token_logprob` kept when every output has one."""
    if len(outs) == 1:
        return outs[0]
    cat = {f.name: torch.cat([getattr(o, f.name) for o in outs]) for f in fields(GenerationOutput)
           if f.name != "forward_passes" and all(getattr(o, f.name) is not None for o in outs)}
    return GenerationOutput(forward_passes=sum(o.forward_passes for o in outs), **cat)
